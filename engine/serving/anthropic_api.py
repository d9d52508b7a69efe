"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat path.

A Messages request is translated into the chat completion request it means (`chat_body`), which
the server parses, renders and generates as any other (`Server.parse_chat`, `generate`,
`collect`, `chunks`); the chat response or its stream's chunks are translated back into
Anthropic's message or its server-sent events (engine/serving/anthropic_reply.py). So the
Messages API has every feature of the chat path: the tool call parsers, the reasoning parser and
budget, stop strings, sampling, the prefix cache.

The translation, field by field:
- `system` (a string or text blocks) becomes the first message, a system one;
- `messages`: a user turn's text blocks become one user message and each of its `tool_result`
  blocks a tool message (`tool_use_id` as its `tool_call_id`); an assistant turn's text blocks
  become its content, its `tool_use` blocks its tool calls (the input as the arguments) and its
  `thinking` blocks its reasoning_content (`redacted_thinking` is dropped);
- `tools` (`name`, `description`, `input_schema`) become functions; `tool_choice` auto, any,
  tool (a name) and none become "auto", "required", the named function and "none";
  `disable_parallel_tool_use` becomes parallel_tool_calls false;
- `thinking`: enabled with `budget_tokens` becomes the reasoning budget, and the reasoning
  effort of a model that takes one (gpt-oss): low under 8,192 tokens, medium under 16,384, high
  from there; disabled becomes a budget of 0 and the template's `enable_thinking: false`;
  adaptive and between_tools leave the model to decide; `display: "omitted"` leaves the
  thinking blocks empty;
- `output_config.effort` (low, medium, high) becomes the reasoning effort, in place of the one
  `thinking` gives;
- `stop_sequences` become `stop`; `max_tokens`, `temperature`, `top_p`, `top_k`, `stream`
  and `model` keep their names, as do moelab's own `seed`, `ignore_eos` and
  `chat_template_kwargs`.

`max_tokens` past the context's room is cut to it (a client such as Claude Code asks for 32,000
whatever the model's context). The usage counts the prompt's tokens the prefix cache held as
`cache_read_input_tokens` and the rest as `input_tokens`. Errors have Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import anthropic_reply as reply
from . import harmony
from . import openai_api as api
from .generation import Generation
from .openai_api import ApiError, ParsedRequest, bad

PATH = "/v1/messages"
# moelab's own fields a Messages request may send, as the chat path takes them
EXTENSIONS = ("seed", "ignore_eos", "chat_template_kwargs")
# the reasoning effort a thinking budget asks for: the first whose bound the budget is under
# (Claude Code's "think", "think hard" and "ultrathink" ask for 4,000, 10,000 and 31,999 tokens)
EFFORT_OF_BUDGET = ((8192, "low"), (16384, "medium"), (float("inf"), "high"))


class ChatPath(Protocol):
    """What the Messages API uses of the server (server.Server)."""

    model_name: str

    def admit(self, request: Request): ...
    async def parse_chat(self, engine, body: dict) -> ParsedRequest: ...
    async def generate(self, engine, parsed: ParsedRequest, *, chat: bool) -> Generation: ...
    async def collect(self, gen: Generation, rid: str, chat: bool) -> dict: ...
    def chunks(self, gen: Generation, rid: str, chat: bool) -> AsyncIterator[dict | ApiError]: ...


def routes(server: ChatPath) -> list[Route]:
    """The Messages API's routes over `server`."""
    messages = MessagesApi(server)
    return [
        Route(PATH, messages.create, methods=["POST"]),
        Route(f"{PATH}/count_tokens", messages.count_tokens, methods=["POST"]),
    ]


class MessagesApi:
    """The endpoints, each a translation around the server's chat path."""

    def __init__(self, server: ChatPath) -> None:
        self.server = server

    async def create(self, request: Request) -> Response:
        server = self.server
        try:
            engine = server.admit(request)
            body = await _read(request)
            parsed = await server.parse_chat(engine, chat_body(body))
            parsed.fit_context = True
            gen = await server.generate(engine, parsed, chat=True)
            rid = f"msg_{uuid.uuid4().hex[:24]}"
            shown = shows_thinking(body)
            if parsed.stream:
                events = reply.MessageEvents(gen, rid, server.model_name, body["max_tokens"], shown)
                return StreamingResponse(
                    events.stream(server.chunks(gen, rid, chat=True)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            chat = await server.collect(gen, rid, chat=True)
            return JSONResponse(reply.message(chat, gen, body["max_tokens"], shown))
        except ClientDisconnect:
            return Response(status_code=499)
        except ApiError as err:
            return reply.error_response(err)

    async def count_tokens(self, request: Request) -> Response:
        server = self.server
        try:
            engine = server.admit(request)
            body = await _read(request)
            parsed = await server.parse_chat(engine, chat_body(body, counting=True))
            ids = engine.tokenizer.encode(parsed.prompt_text)
            return JSONResponse({"input_tokens": len(ids)})
        except ClientDisconnect:
            return Response(status_code=499)
        except ApiError as err:
            return reply.error_response(err)


async def _read(request: Request) -> dict:
    body = await api.read_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# request --------------------------------------------------------------------------------------


def chat_body(body: dict, *, counting: bool = False) -> dict:
    """The chat completion request a Messages request means (counting: a count_tokens request,
    which has no max_tokens)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    out: dict = {name: body[name] for name in EXTENSIONS if name in body}
    for name in ("model", "temperature", "top_p", "top_k"):
        if name in body:
            out[name] = body[name]
    if not counting:
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad("max_tokens", "is required: a whole number of at least 1")
        out["max_tokens"] = max_tokens
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream", "must be true or false")
        if stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
    out["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out.update(_tool_choice(body["tool_choice"]))
    if body.get("stop_sequences") is not None:
        out["stop"] = _stop_sequences(body["stop_sequences"])
    if body.get("thinking") is not None:
        out.update(_thinking(body["thinking"], out.get("chat_template_kwargs")))
    output = body.get("output_config")
    if isinstance(output, dict) and output.get("format") is not None:
        raise bad("output_config.format", "structured output formats are not supported")
    if isinstance(output, dict) and output.get("effort") is not None:
        if output["effort"] not in harmony.EFFORTS:
            raise bad("output_config.effort", f"must be one of {', '.join(harmony.EFFORTS)}")
        out["reasoning_effort"] = output["effort"]
    return out


def _text(value, where: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result's content)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, "must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad(f"{where}[{i}]", 'must be a text block, {"type": "text", "text": ...}')
        if not isinstance(block.get("text"), str):
            raise bad(f"{where}[{i}].text", "must be a string")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _system(system) -> list[dict]:
    if system is None:
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list")
    out: list[dict] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise bad(where, 'must be an object with role "user" or "assistant"')
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise bad(f"{where}.content", "must be a string or a list of content blocks")
        for j, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise bad(f"{where}.content[{j}]", "must be a content block with a type")
        if role == "user":
            out += _user(content, where)
        else:
            out.append(_assistant(content, where))
    if messages[-1]["role"] == "assistant":
        raise bad(
            f"messages[{len(messages) - 1}]",
            "ends the conversation with an assistant turn (a prefill), which this server does "
            "not continue; end with a user turn",
        )
    return out


def _user(blocks: list[dict], where: str) -> list[dict]:
    """A user turn: its tool results as tool messages and its text as a user message, in the
    order they come."""
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
                texts = []
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{at}.tool_use_id", "must be a string")
            content = _text(block.get("content", ""), f"{at}.content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        else:
            raise _unsupported(kind, at)
    if texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _assistant(blocks: list[dict], where: str) -> dict:
    """An assistant turn: its text, tool calls and reasoning as one assistant message."""
    texts: list[str] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad(at, "a tool_use block needs an id and a name, both strings")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad(f"{at}.input", "must be an object of the tool's arguments")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": arguments}})  # fmt: skip
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise bad(f"{at}.thinking", "must be a string")
            reasoning.append(block["thinking"])
        elif kind != "redacted_thinking":  # nothing to read in it
            raise _unsupported(kind, at)
    message: dict = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n\n".join(reasoning)
    return message


def _block_text(block: dict, at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad(f"{at}.text", "must be a string")
    return block["text"]


def _unsupported(kind: str, at: str) -> ApiError:
    return bad(
        at,
        f"a {kind!r} block is not supported; this server takes text, tool_use, tool_result and "
        "thinking blocks",
    )


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, "must be an object with a name and an input_schema")
        if tool.get("type", "custom") != "custom" or not isinstance(tool.get("input_schema"), dict):
            raise bad(
                where,
                f"{tool.get('type', 'a tool without an input_schema')!r} is not a tool this "
                "server offers; give custom tools, each with a name and an input_schema",
            )
        if not isinstance(tool.get("name"), str):
            raise bad(f"{where}.name", "must be a string")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice) -> dict:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad(
            "tool_choice",
            'must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or '
            '{"type": "none"}',
        )
    out: dict = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "must be the name of one of the request's tools")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "must be true or false")
    if parallel:
        out["parallel_tool_calls"] = False
    return out


def _stop_sequences(stops) -> list[str]:
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop_sequences", "must be a list of strings")
    if len(stops) > api.MAX_STOPS:
        raise bad("stop_sequences", f"at most {api.MAX_STOPS} stop sequences")
    return stops


def _thinking(thinking, template_kwargs) -> dict:
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise bad("thinking.budget_tokens", "must be a whole number of 0 or more")
        effort = next(e for limit, e in EFFORT_OF_BUDGET if budget < limit)
        return {"reasoning_budget": budget, "reasoning_effort": effort}
    if kind == "disabled":
        kwargs = template_kwargs if isinstance(template_kwargs, dict) else {}
        return {"reasoning_budget": 0,
                "chat_template_kwargs": {**kwargs, "enable_thinking": False}}  # fmt: skip
    if kind in ("adaptive", "between_tools"):  # the model decides: as it always does here
        return {}
    raise bad(
        "thinking",
        'must be {"type": "enabled", "budget_tokens": N}, {"type": "disabled"}, '
        '{"type": "adaptive"} or {"type": "between_tools"}',
    )


def shows_thinking(body: dict) -> bool:
    """Whether thinking blocks carry the reasoning's text (`thinking.display` "omitted": they
    are empty)."""
    thinking = body.get("thinking")
    return not (isinstance(thinking, dict) and thinking.get("display") == "omitted")
