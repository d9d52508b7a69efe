"""`moelab serve`: the OpenAI-compatible API, /health, /v1/stats, /metrics and cache resizing."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..config.config import EngineConfig
from ..model.tokenizer import ChatTemplateError
from ..runtime.sampling import TokenLogprobs
from ..runtime.worker import EngineWorker
from ..runtime.worker import Request as EngineRequest
from . import anthropic_api, anthropic_reply, harmony
from . import openai_api as api
from .access import access_middleware
from .generation import Generation
from .hosts import ServedHosts, is_loopback_address
from .openai_api import ApiError
from .reasoning import ReasoningStream, closed, opened_by_prompt, split_reasoning
from .tool_calls import ToolCallStream

log = logging.getLogger("moelab.server")

RESIZE_WAIT_S = 30.0
MAX_RESIZE = 2**31 - 1  # slots or tokens: past any machine's memory, within the planner's ints


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _refusal(request: Request, err: ApiError) -> JSONResponse:
    """An error in the shape of the API the path belongs to: Anthropic's, or OpenAI's."""
    if request.url.path.startswith(anthropic_api.PATH):
        return anthropic_reply.error_response(err)
    return _error(err)


async def _no_route(request: Request, exc: Exception) -> Response:
    """Starlette's routing refusals (an unknown path, a method a path does not take) as
    OpenAI-style JSON."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        paths = ", ".join(route.path for route in request.app.routes)
        message = f"no endpoint {request.url.path}; this server has {paths}"
    elif exc.status_code == 405:
        allowed = exc.headers.get("Allow", "") if exc.headers else ""
        message = f"{request.url.path} does not take {request.method}; it takes {allowed}"
    else:
        message = str(exc.detail)
    return _refusal(request, ApiError(exc.status_code, message, headers=exc.headers))


def _internal_error(exc: Exception) -> ApiError:
    """What a client is told of an error no handler expected (the log has the traceback)."""
    return ApiError(
        500,
        f"the engine failed on this request ({type(exc).__name__}); its log has the details",
        type_="server_error",
        code="internal_error",
    )


async def _internal(request: Request, exc: Exception) -> Response:
    return _refusal(request, _internal_error(exc))  # uvicorn logs the traceback


class Server:
    """The HTTP side of one engine."""

    def __init__(self, config: EngineConfig, worker: EngineWorker) -> None:
        self.config = config
        server = config.server
        self.worker = worker
        self.model_name = config.model.name
        # what a request's omitted sampling fields take: the checkpoint's, or OpenAI's
        self.sampling_defaults = (
            api.generation_defaults(config.model.path) if server.generation_config == "auto" else {}
        )
        if self.sampling_defaults:
            log.info(
                "sampling defaults from generation_config.json: %s (a request's own values win; "
                "--generation-config off for OpenAI's)",
                api.describe_defaults(self.sampling_defaults),
            )
        self.draining = False
        self.started = time.time()
        self.app = Starlette(routes=[
            Route("/health", self.health),
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/stats", self.stats),
            Route("/metrics", self.metrics),
            Route("/v1/cache/resize", self.resize, methods=["POST"]),
            *anthropic_api.routes(self),
        ], middleware=access_middleware(
            ServedHosts(server.host, server.allow_host or ()), server.allowed_origins or ()
        ), exception_handlers={HTTPException: _no_route, Exception: _internal})  # fmt: skip

    # guards ------------------------------------------------------------------------------------

    def admit(self, request: Request):
        """The engine, for a request with the API key while the model is ready (else an
        ApiError that says which is missing)."""
        self._check_key(request)
        return self._ready()

    def _check_key(self, request: Request) -> None:
        key = self.config.server.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        token = request.headers.get("x-api-key", token)  # Anthropic's clients send it so
        if not secrets.compare_digest(token.encode(), key.encode()):
            raise ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                type_="authentication_error",
                code="invalid_api_key",
            )

    def _ready(self):
        if self.draining:
            raise ApiError(
                503, "the server is shutting down", type_="server_error", code="shutting_down"
            )
        w = self.worker
        if w.status == "loading":
            raise ApiError(
                503,
                "the model is still loading; retry when /health says ok",
                type_="server_error",
                code="loading",
                headers={"Retry-After": "5"},
            )
        if w.status == "error":
            raise ApiError(
                503,
                f"the model failed to load: {w.error}",
                type_="server_error",
                code="load_failed",
            )
        return w.engine

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # endpoints ---------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        w = self.worker
        body: dict = {"status": w.status, "model": self.model_name}
        if w.status == "loading":
            body.update(w.loading.to_json())
        elif w.status == "error":
            body["error"] = w.error
        else:
            body.update(max_model_len=w.engine.max_context, draining=self.draining)
        return JSONResponse(body, status_code=200 if w.status != "error" else 500)

    async def models(self, request: Request) -> Response:
        try:
            self._check_key(request)
            engine = self._ready()
        except ApiError as err:
            return _error(err)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(self.started),
            "owned_by": "moelab", "max_model_len": engine.max_context,
        }]})  # fmt: skip

    async def chat(self, request: Request) -> Response:
        try:
            self._check_key(request)
            engine = self._ready()
            body = await api.read_body(request)
            parsed = await self.parse_chat(engine, body)
            return await self._run(engine, parsed, chat=True)
        except ClientDisconnect:
            return Response(status_code=499)
        except ApiError as err:
            return _error(err)

    async def parse_chat(self, engine, body) -> api.ParsedRequest:
        """A chat request's fields and its prompt, rendered by the chat template: with the
        opening of the call a forced tool choice makes, and the reasoning closed where it gets
        no tokens (a forced call, or a budget of 0)."""
        common = api.parse_common(body, chat=True, defaults=self.sampling_defaults)
        self._check_model(common["model"])
        messages = api.parse_messages(body)
        kwargs = api.parse_template_kwargs(body)
        tools = api.parse_tools(body)
        server = self.config.server
        budget = api.parse_reasoning_budget(body, server.reasoning_budget)
        effort = api.parse_reasoning_effort(body)
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        if engine.tokenizer is None or not engine.tokenizer.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        source = engine.tokenizer.chat_template_source
        in_harmony = harmony.is_harmony(source) or "harmony" in (
            server.reasoning_parser,
            server.tool_call_parser,
        )
        if in_harmony:
            messages = harmony.template_messages(messages)
        try:
            text = await asyncio.to_thread(
                engine.tokenizer.apply_chat_template, messages, tools=tools, **kwargs
            )
        except ChatTemplateError as err:
            raise api.bad("messages", str(err)) from None
        ends = ()
        if engine.scheduler.checkpointing:
            ends = await asyncio.to_thread(
                _message_ends, engine.tokenizer, messages, text, tools=tools, **kwargs
            )
        if in_harmony:
            reply, opening = api.harmony_use(body, tools)
            # a forced call skips the reasoning; so does a budget of 0, the answer begun
            opening = opening or (harmony.FINAL if budget == 0 else "")
            return api.ParsedRequest(
                prompt_text=text + opening, prompt_ids=None, **common, reply_prefix=opening,
                reasoning_budget=budget, harmony=reply, message_ends=ends,
            )  # fmt: skip
        tool_parser, opening = api.tool_use(body, tools, source, server.tool_call_parser)
        if opening or budget == 0:
            text = closed(text) + opening
        opened = opened_by_prompt(text) if server.reasoning_parser == "think" else None
        return api.ParsedRequest(
            prompt_text=text, prompt_ids=None, **common, tool_parser=tool_parser,
            reply_prefix=opening, think_opened=opened, reasoning_budget=budget,
            message_ends=ends,
        )  # fmt: skip

    async def completions(self, request: Request) -> Response:
        try:
            self._check_key(request)
            engine = self._ready()
            body = await api.read_body(request)
            parsed = api.parse_completion(body, self.sampling_defaults)
            self._check_model(parsed.model)
            return await self._run(engine, parsed, chat=False)
        except ClientDisconnect:
            return Response(status_code=499)
        except ApiError as err:
            return _error(err)

    async def _run(self, engine, parsed: api.ParsedRequest, *, chat: bool) -> Response:
        gen = await self.generate(engine, parsed, chat=chat)
        rid = api.new_id("chatcmpl" if chat else "cmpl")
        if parsed.stream:
            stream = _sse_lines(self.chunks(gen, rid, chat))
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return JSONResponse(await self.collect(gen, rid, chat))

    async def generate(self, engine, parsed: api.ParsedRequest, *, chat: bool) -> Generation:
        """The request's prompt checked against the vocabulary and the context (chat: its
        messages), and its generation queued."""
        tok = engine.tokenizer
        boundaries: tuple[int, ...] = ()
        if parsed.prompt_ids is not None:
            ids = parsed.prompt_ids
            bad = [t for t in ids if not 0 <= t < engine.spec.vocab_size]
            if bad:
                raise api.bad("prompt", f"token ids {bad[:5]} are outside the vocabulary")
        else:
            if tok is None:
                raise ApiError(400, "this model has no tokenizer; send the prompt as token ids")
            floor = tok.min_tokens(parsed.prompt_text)
            if floor >= engine.max_context:  # too long for certain: no need to encode it all
                raise ApiError(
                    400,
                    f"this model's usable context is {engine.max_context} tokens, but the prompt "
                    f"alone is at least {floor} ({len(parsed.prompt_text)} characters); shorten "
                    "the prompt",
                    param="messages" if chat else "prompt",
                    code="context_length_exceeded",
                )
            ids, boundaries = await asyncio.to_thread(
                tok.encode_marked, parsed.prompt_text, parsed.message_ends,
                parsed.add_special_tokens,
            )  # fmt: skip
        if not ids:
            raise api.bad("prompt", "is empty")
        if outside := [t for t, _ in parsed.logit_bias if t >= engine.spec.vocab_size]:
            raise api.bad("logit_bias", f"token ids {outside[:5]} are outside the vocabulary")
        context = engine.max_context
        room = context - len(ids)
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            max_tokens = min(api.DEFAULT_MAX_TOKENS, max(room, 1))
        elif parsed.fit_context:
            max_tokens = min(max_tokens, max(room, 1))
        if len(ids) + max_tokens > context:
            raise ApiError(
                400,
                f"this model's usable context is {context} tokens, but the request needs "
                f"{len(ids) + max_tokens} ({len(ids)} in the prompt + {max_tokens} max_tokens); "
                "shorten the prompt or lower max_tokens",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        try:
            # echo with max_tokens 0 (the prompt's score alone): one token, not handed out
            params = parsed.sampling(max(max_tokens, 1))
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        gen = Generation(
            self.worker, engine, parsed, ids, params, self.config.batching.max_requests_in_flight,
            boundaries,
        )  # fmt: skip
        gen.submit()
        return gen

    def _logprobs(self, engine, entries: list, chat: bool, offset: int) -> dict | None:
        """The logprobs object of `entries` (tokens whose text begins `offset` characters into
        the completion), or None where the request asked for none."""
        if not entries:
            return None
        names = engine.tokenizer or api.TokenIds()
        if chat:
            return api.chat_logprobs(entries, names)
        return api.completion_logprobs(entries, names, offset)

    async def collect(self, gen: Generation, rid: str, chat: bool) -> dict:
        """The whole response (chat.completion or text_completion) once generation ends."""
        engine, parsed = gen.engine, gen.parsed
        pieces, finish, completion, entries = [], "stop", 0, []
        try:
            async for text, reason, logprobs in gen.pieces():
                completion += 1
                pieces.append(text)
                if logprobs is not None:
                    entries.append(logprobs)
                if reason is not None:
                    finish = reason
        except asyncio.CancelledError:
            gen.cancel()
            raise
        completion = gen.completion_tokens(completion)
        if parsed.max_tokens == 0:  # echo alone: the token drawn is not handed out
            pieces, entries, completion, finish = [], [], 0, "length"
        text = parsed.reply_prefix + "".join(pieces)
        if parsed.echo:
            text = _prompt_text(engine, parsed, gen.first) + text
            entries = _prompt_entries(gen.first, parsed) + entries
        u = api.usage(gen.prompt_tokens, completion, gen.cached_tokens)
        logprobs = self._logprobs(engine, entries, chat, 0)
        name, stopped = self.model_name, gen.stop_matched
        if not chat:
            return api.completion_response(rid, name, text, finish, u, logprobs, stopped)
        reasoning: str | bool | None = False
        calls = None
        if parsed.harmony is not None:
            reasoning, text, calls = parsed.harmony.split(text)
        else:
            if parsed.think_opened is not None:
                reasoning, text = split_reasoning(text, parsed.think_opened)
            if parsed.tool_parser:  # in the content only: a call the reasoning mentions is none
                text, calls = parsed.tool_parser.split(text)
        reader = parsed.harmony or parsed.tool_parser
        if reader is not None:
            # a reply held to one call ended with it, whatever the model wrote after
            ended = finish == "stop" or not reader.parallel
            finish = "tool_calls" if calls and ended else finish
        return api.chat_response(rid, name, text, finish, u, logprobs, calls, reasoning, stopped)

    async def chunks(self, gen: Generation, rid: str, chat: bool) -> AsyncIterator[dict | ApiError]:
        """The stream's chunks (chat.completion.chunk or text_completion) as tokens arrive, the
        usage's last where asked; a failure after the start as its ApiError, last."""
        engine, parsed, name = gen.engine, gen.parsed, self.model_name
        done = False
        try:
            if chat:
                yield api.chat_chunk(rid, name, {"role": "assistant", "content": ""}, None)
            # the tokens' log probabilities go with the chunk that carries their text (text held
            # back, a character's first bytes or a possible stop string, keeps them waiting)
            entries: list = []
            offset = 0
            reader = parsed.harmony or parsed.tool_parser
            tools = reader.stream() if reader is not None else None
            opened = parsed.think_opened
            thinking = ReasoningStream(opened) if opened is not None else None
            echo = parsed.echo
            prefix = parsed.reply_prefix
            async for text, reason, logprobs in gen.pieces():
                if echo:  # the prompt first, once its scores are in (with the first token)
                    echo = False
                    lp = self._logprobs(engine, _prompt_entries(gen.first, parsed), chat, offset)
                    prompt_text = _prompt_text(engine, parsed, gen.first)
                    offset += len(prompt_text)
                    yield api.completion_chunk(rid, name, prompt_text, None, logprobs=lp)
                if parsed.max_tokens == 0:  # echo alone: the token drawn is not handed out
                    text, logprobs, reason = "", None, "length"
                if logprobs is not None:
                    entries.append(logprobs)
                stopped = gen.stop_matched if reason is not None else None
                if chat:
                    text, prefix = prefix + text, ""
                    deltas = _chat_deltas(tools, thinking, text, reason)
                    if deltas:  # the waiting entries go with the first chunk
                        lp, entries = self._logprobs(engine, entries, chat, 0), []
                    for i, (delta, finish) in enumerate(deltas):
                        lp = None if i else lp
                        yield api.chat_chunk(rid, name, delta, finish, logprobs=lp,
                                             stop_reason=stopped if finish else None)  # fmt: skip
                    if tools is not None and tools.full:  # its one call made: the reply ends
                        gen.cancel()
                        break
                elif text or reason is not None:
                    lp = self._logprobs(engine, entries, chat, offset)
                    offset += sum(len(t) for t in lp["tokens"]) if lp else 0
                    entries = []
                    yield api.completion_chunk(rid, name, text, reason, logprobs=lp,
                                               stop_reason=stopped)  # fmt: skip
            done = True
            if parsed.include_usage:
                completion = 0 if parsed.max_tokens == 0 else gen.completion_tokens(0)
                u = api.usage(gen.prompt_tokens, completion, gen.cached_tokens)
                maker = api.chat_chunk if chat else api.completion_chunk
                yield maker(rid, name, {}, None, u) if chat else maker(rid, name, "", None, u)
        except ApiError as err:
            yield err
        except Exception as err:  # the status is sent: the failure can only be one more event
            log.exception("stream %s failed", rid)
            yield _internal_error(err)
        finally:
            if not done:  # the client went away (or the stream failed): free the KV now
                gen.cancel()

    async def stats(self, request: Request) -> Response:
        try:
            self._check_key(request)
            self._ready()
            body = await asyncio.wrap_future(self.worker.call(self._stats_snapshot))
        except ApiError as err:
            return _error(err)
        return JSONResponse(body)

    def _stats_snapshot(self, engine) -> dict:
        s = engine.scheduler
        return engine.telemetry.stats(
            running=len(s.running),
            queued=len(s.waiting),
            preempted=s.preemptions,
            paused=s.paused,
            model_name=self.model_name,
        )

    async def metrics(self, request: Request) -> Response:
        from .metrics import render_metrics

        if self.worker.status != "ok":
            return Response("", media_type="text/plain; version=0.0.4")
        stats = await asyncio.wrap_future(self.worker.call(self._stats_snapshot))
        body, content_type = render_metrics(stats)
        return Response(body, media_type=content_type)

    async def resize(self, request: Request) -> Response:
        try:
            self._check_key(request)
            if not self.config.server.api_key and not is_loopback_address(
                request.client.host if request.client else ""
            ):
                raise ApiError(
                    403,
                    "cache resizing is allowed from this machine only (or start "
                    "the server with --api-key)",
                    type_="permission_error",
                    code="forbidden",
                )
            self._ready()
            body = await api.read_body(request)
            if (
                not isinstance(body, dict)
                or len({"moe_cache_size", "kv_reserve_tokens"} & set(body)) != 1
            ):
                raise ApiError(400, 'send {"moe_cache_size": N} or {"kv_reserve_tokens": N}')
            key = "moe_cache_size" if "moe_cache_size" in body else "kv_reserve_tokens"
            value = body[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_RESIZE
            ):
                raise api.bad(key, f"must be a whole number from 0 to {MAX_RESIZE}")
            result = await self._resize(key, value)
        except ApiError as err:
            return _error(err)
        return JSONResponse(result)

    async def _resize(self, key: str, value: int) -> dict:
        """Pause admission, wait for running requests to end, resize on the engine thread."""
        from ..config.memory import MemoryPlanError

        worker = self.worker
        worker.engine.scheduler.paused = True
        try:
            deadline = time.monotonic() + RESIZE_WAIT_S
            while True:
                running = await asyncio.wrap_future(worker.call(lambda e: len(e.scheduler.running)))
                if running == 0:
                    break
                if time.monotonic() > deadline:
                    raise ApiError(
                        409,
                        f"{running} requests still running after "
                        f"{RESIZE_WAIT_S:.0f} s; try again when the engine is idle",
                        type_="conflict",
                        code="busy",
                    )
                await asyncio.sleep(0.05)

            def apply(engine) -> dict:
                if key == "moe_cache_size":
                    engine.resize_cache(value)
                else:
                    engine.resize_kv(value)
                result = {
                    "moe_cache_size": engine.cache.slots,
                    "kv_tokens": engine.kv.capacity_tokens,
                    "max_model_len": engine.max_context,
                    "plan": engine.plan.to_dict(),
                }
                if engine.split is not None:  # each device's slots (the sum above)
                    result["devices"] = [
                        {"device": name, "slots": plan.slots}
                        for name, plan in zip(engine.split.names, engine.split.plans, strict=True)
                    ]
                return result

            try:
                return await asyncio.wrap_future(worker.call(apply))
            except MemoryPlanError as err:
                raise ApiError(409, str(err), type_="conflict", code="does_not_fit") from None
        finally:
            worker.engine.scheduler.paused = False


def _message_ends(tokenizer, messages: list[dict], text: str, **template) -> tuple[int, ...]:
    """Where in a chat's rendered prompt `text` its system prompt (the leading system or
    developer messages) and its last message end, as character offsets: the chat rendered up to
    there without a generation prompt, where the prompt begins with that rendering. A later
    turn's prompt renders the same history, so its state resumes from these places."""
    system = 0
    while system < len(messages) and messages[system].get("role") in ("system", "developer"):
        system += 1
    ends = []
    for count in sorted({system, len(messages)} - {0}):
        try:
            head = tokenizer.apply_chat_template(
                messages[:count], add_generation_prompt=False, **template
            )
        except ChatTemplateError:
            continue  # a template that refuses a system prompt alone: no place there
        if head and text.startswith(head):
            ends.append(len(head))
    return tuple(ends)


def _chat_deltas(
    tools: ToolCallStream | harmony.HarmonyStream | None,
    thinking: ReasoningStream | None,
    text: str,
    reason: str | None,
) -> list[tuple[dict, str | None]]:
    """The chat chunks (delta, finish reason) one arrival of text makes: its reasoning
    (`thinking`: the reply's reasoning taken out of it), its content, then each tool call that
    closed (`tools`: the request's calls taken out of the content; a harmony stream takes the
    reasoning out too), the finish reason on the last ("tool_calls" where the reply ended on its
    own after making calls, or made the one call it may make); none while everything is held
    back."""
    reasoning = ""
    if isinstance(tools, harmony.HarmonyStream):
        reasoning, text, calls = tools.feed(text)
        if tools.full:
            reason = "stop"
        if reason is not None:
            more, rest, last = tools.flush()
            reasoning, text, calls = reasoning + more, text + rest, calls + last
        return _deltas(tools, reasoning, text, calls, reason)
    if thinking is not None:
        reasoning, text = thinking.feed(text)
        if reason is not None:
            more, rest = thinking.flush()
            reasoning, text = reasoning + more, text + rest
    calls: list[dict] = []
    if tools is not None:
        text, calls = tools.feed(text)
        if tools.full:  # its one call made (parallel_tool_calls false): the reply ends here
            reason = "stop"
        if reason is not None:
            rest, more = tools.flush()
            text, calls = text + rest, calls + more
    return _deltas(tools, reasoning, text, calls, reason)


def _deltas(
    tools: ToolCallStream | harmony.HarmonyStream | None,
    reasoning: str,
    text: str,
    calls: list[dict],
    reason: str | None,
) -> list[tuple[dict, str | None]]:
    """The chunks of one arrival's reasoning, content and calls, as `_chat_deltas` says."""
    if tools is not None and reason == "stop" and tools.calls_made:
        reason = "tool_calls"
    deltas: list[dict] = [{"reasoning_content": reasoning}] if reasoning else []
    deltas += [{"content": text}] if text else []
    first = tools.calls_made - len(calls) if tools is not None else 0
    deltas += [{"tool_calls": [{"index": first + i, **c}]} for i, c in enumerate(calls)]
    if reason is not None and not deltas:
        deltas = [{}]
    last = len(deltas) - 1
    return [(delta, reason if i == last else None) for i, delta in enumerate(deltas)]


def _prompt_text(engine, parsed: api.ParsedRequest, req: EngineRequest) -> str:
    """An echoed prompt's text: as sent, or its token ids decoded ("" without a tokenizer)."""
    if parsed.prompt_text is not None:
        return parsed.prompt_text
    tokenizer = engine.tokenizer
    return tokenizer.decode(req.prompt_ids) if tokenizer is not None else ""


def _prompt_entries(req: EngineRequest, parsed: api.ParsedRequest) -> list[TokenLogprobs]:
    """An echoed prompt's log probabilities, where the request asked for them: its first token
    with none, then each token's given the ones before it."""
    if parsed.logprobs is None or req.seq is None:
        return []
    first = TokenLogprobs(req.seq.prompt_ids[0], None)
    return [first, *req.seq.prompt_logprobs]


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse_lines(chunks: AsyncIterator[dict | ApiError]) -> AsyncIterator[str]:
    """A stream's chunks as OpenAI's server-sent events, a failure's error as one of them, and
    `[DONE]` last."""
    async with aclosing(chunks):
        async for item in chunks:
            yield _sse(item.body() if isinstance(item, ApiError) else item)
    yield "data: [DONE]\n\n"
