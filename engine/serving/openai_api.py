"""OpenAI request parsing and validation, and the response and stream chunk shapes."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from starlette.requests import Request

from ..runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs
from . import harmony
from .tool_calls import ToolParser, parser_for

DEFAULT_MAX_TOKENS = 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_STOPS = 16
# how deep a request's JSON may nest: a chat with tools' schemas is a dozen levels; deeper is no
# request, and Python's decoder and the template's filters recurse
MAX_JSON_DEPTH = 64
# the largest top_k taken (any value past the vocabulary is the whole of it)
MAX_TOP_K = 2**31 - 1
# chat template variables a request names in their own fields, not in chat_template_kwargs
TEMPLATE_FIELDS = ("messages", "tools", "add_generation_prompt")

log = logging.getLogger("moelab.openai_api")

# The sampling fields a request may leave out: OpenAI's default (top_k and min_p: off) and the
# range a request's value must fall in, (default, lo, hi, integer). A checkpoint's
# generation_config.json may set other defaults (`generation_defaults`).
SAMPLING_FIELDS: dict[str, tuple[float, float | None, float | None, bool]] = {
    "temperature": (1.0, 0.0, 2.0, False),
    "top_p": (1.0, 1e-9, 1.0, False),
    "top_k": (0, -1, MAX_TOP_K, True),
    "min_p": (0.0, 0.0, 1.0, False),
    "repetition_penalty": (1.0, 0.01, 10.0, False),
}


class ApiError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass(slots=True)
class ParsedRequest:
    """What a completion request asks for, validated."""

    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    logprobs: int | None
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    model: str | None
    # the tokenizer's own special tokens around the prompt text (its BOS, as its post-processor
    # adds them): completions' default; a chat template writes its own
    add_special_tokens: bool
    echo: bool = False  # completions: the prompt comes first in the text (and its logprobs)
    # chat: how tool calls are taken out of the reply (tool_calls.py); None: they stay text
    tool_parser: ToolParser | None = None
    # chat: the reply's start the prompt wrote (a forced tool call's opening), part of its text
    reply_prefix: str = ""
    # chat with --reasoning-parser think: whether the prompt opened the reply's reasoning
    # (reasoning.py); None: the reasoning stays in the text
    think_opened: bool | None = None
    # chat: the reply's tokens inside its <think> block before the server closes it
    reasoning_budget: int | None = None
    # chat in gpt-oss's format: how the reply's channels and calls are read (harmony.py); the
    # reply is decoded with its special tokens, which frame the format
    harmony: harmony.HarmonyReply | None = None
    # max_tokens past the context's room left is cut to it (the Messages API's way), not refused
    fit_context: bool = False
    # chat on a hybrid or sliding-window model: the character offsets in prompt_text where its
    # system prompt and its last message end, where the engine keeps state checkpoints
    message_ends: tuple[int, ...] = ()

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=self.logit_bias,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
        )


async def read_body(request: Request):
    """The JSON body (strict: `decode_body`), refusing bodies past MAX_BODY_BYTES before
    reading them whole."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(
            413,
            f"request body of {int(length)} bytes exceeds {MAX_BODY_BYTES}",
            code="request_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(
                413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large"
            )
        chunks.append(chunk)
    return decode_body(b"".join(chunks))


def decode_body(raw: bytes):
    """A request body's JSON, strictly: no NaN or Infinity (which Python's decoder takes, and
    which no field means) and no number past a float's range, each refused naming its field;
    nesting at most MAX_JSON_DEPTH deep; every string valid Unicode (no lone surrogate, which no
    tokenizer encodes)."""
    try:
        body = json.loads(raw, parse_constant=_NotFinite, parse_float=_finite_float)
    except RecursionError:
        raise ApiError(
            400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    except ValueError as err:  # UnicodeDecodeError included
        raise ApiError(
            400, f"the request body is not valid JSON: {err}", code="invalid_json"
        ) from None
    _check_tree(body)
    return body


class _NotFinite(str):
    """Where the body has NaN, Infinity or a number past a float's range: refused by
    `_check_tree`, which knows the field's name."""


def _finite_float(text: str) -> float | _NotFinite:
    value = float(text)
    return value if math.isfinite(value) else _NotFinite(text)


def _check_tree(body, root: str = "") -> None:
    """Refuse nesting past MAX_JSON_DEPTH, numbers that are not finite and strings that are not
    valid Unicode, naming where (`messages[0].content`; `root`: where `body` itself is)."""
    stack = [(body, root, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, _NotFinite):
            raise bad(path or "body", f"must be a finite number, got {value}")
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad(path, f"nests deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, f"{path} (a key)" if path else "body (a key)")
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
            if isinstance(item, (str, dict, list)):
                stack.append((item, where, depth + 1))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        raise bad(
            path or "body",
            f"holds a lone surrogate (U+{code:04X}), which is not text; send valid UTF-8",
        ) from None


def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(name, f"must be a finite number, got {value}")
    if integer and int(value) != value:
        raise bad(name, f"must be a whole number, got {value}")
    if lo is not None and value < lo:
        raise bad(name, f"must be at least {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad(name, f"must be at most {hi}, got {value}")
    return int(value) if integer else float(value)


MAX_LOGIT_BIAS = 300  # tokens a request may bias, as OpenAI's limit


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Fields that would change what a request returns and that this server does not do:
    refused rather than ignored, each naming what was asked for."""
    if chat and body.get("echo"):
        raise bad("echo", "echo is a /v1/completions field")
    if body.get("suffix"):
        raise bad("suffix", "a suffix (insertion) is not supported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad("best_of", "only best_of=1 is supported")
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind != "text":
            raise bad("response_format", "only the text format is supported (no JSON mode)")


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object of token ids (as strings) to biases in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad("logit_bias", "must be an object of token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad("logit_bias", f"{key!r} is not a token id") from None
        if token < 0:
            raise bad("logit_bias", f"{key!r} is not a token id")
        out.append((token, _number({"logit_bias": value}, "logit_bias", 0.0, lo=-100, hi=100)))
    return tuple(out)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many of the likeliest tokens' log probabilities each output token comes with (0:
    only its own), or None: chat's `logprobs` (true or false) and `top_logprobs`, completions'
    `logprobs` (a count)."""
    if not chat:
        return _number(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad("logprobs", "must be true or false")
    top = _number(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    if top is not None and top > 0 and not wanted:
        raise bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def generation_defaults(model_path: str | Path) -> dict[str, float]:
    """The sampling defaults a checkpoint's generation_config.json sets (the SAMPLING_FIELDS it
    has, as vLLM's --generation-config auto reads them). A value a request could not send is
    skipped with a warning that says why; no file (or not JSON): none."""
    path = Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    defaults: dict[str, float] = {}
    for name, (_, lo, hi, integer) in SAMPLING_FIELDS.items():
        if name not in config:
            continue
        try:
            defaults[name] = _number(config, name, None, lo=lo, hi=hi, integer=integer)
        except ApiError as err:
            log.warning("%s: %s: skipped", path, err.message)
    return defaults


def describe_defaults(defaults: dict[str, float]) -> str:
    """`temperature 0.6, top_p 0.95, top_k 20`."""
    return ", ".join(f"{name} {value:g}" for name, value in defaults.items())


def parse_common(body: dict, chat: bool = False, defaults: dict[str, float] | None = None) -> dict:
    """Fields shared by /v1/completions and /v1/chat/completions (chat: the latter's forms).
    defaults: the sampling fields' values where the request leaves them out or null (the
    checkpoint's, `generation_defaults`), else OpenAI's."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_unsupported(body, chat)
    n = _number(body, "n", 1, lo=1, integer=True)
    if n != 1:
        raise bad("n", "only n=1 is supported")
    echo = False if chat else body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad("echo", "must be true or false")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        # 0 with echo: the prompt (and its log probabilities) alone, as for scoring
        max_tokens = _number({name: max_tokens}, name, None, lo=0 if echo else 1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOPS:
            raise bad("stop", f"at most {MAX_STOPS} stop strings")
        stops = tuple(s for s in stop if s)
    else:
        raise bad("stop", "must be a string or a list of strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage", "must be true or false")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", "must be true or false")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    add_special_tokens = body.get("add_special_tokens", not chat)
    if not isinstance(add_special_tokens, bool):
        raise bad("add_special_tokens", "must be true or false")
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", None, lo=-(2**63), hi=2**63 - 1, integer=True)
    sampling = {
        name: _number(body, name, (defaults or {}).get(name, default), lo=lo, hi=hi,
                      integer=integer)
        for name, (default, lo, hi, integer) in SAMPLING_FIELDS.items()
    }  # fmt: skip
    sampling["top_k"] = max(0, sampling["top_k"])  # -1: off, as 0
    return dict(
        max_tokens=max_tokens,
        **sampling,
        frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        logit_bias=_logit_bias(body),
        logprobs=_logprobs(body, chat),
        stop=stops,
        seed=seed,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=ignore_eos,
        model=model,
        add_special_tokens=add_special_tokens,
        echo=echo,
    )


def parse_completion(body: dict, defaults: dict[str, float] | None = None) -> ParsedRequest:
    common = parse_common(body, defaults=defaults)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return ParsedRequest(prompt_text=prompt, prompt_ids=None, **common)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return ParsedRequest(prompt_text=None, prompt_ids=list(prompt), **common)
    if prompt is None:
        raise bad("prompt", "is required")
    raise bad("prompt", "must be a string or a list of token ids (one prompt; n=1)")


def parse_messages(body: dict) -> list[dict]:
    """The chat's messages as the template takes them: text parts joined, and an assistant's
    tool call arguments parsed from their JSON string into the object templates iterate."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(where, "must be an object with a role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"{where}.content", "only text content parts are supported")
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise bad(f"{where}.content[{j}].text", "must be a string")
                texts.append(text)
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        for name in ("name", "tool_call_id", "reasoning_content"):
            if message.get(name) is not None and not isinstance(message[name], str):
                raise bad(f"{where}.{name}", "must be a string")
        parsed = {**message, "content": content}
        if message.get("tool_calls") is not None:
            parsed["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(parsed)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool calls, each function's arguments as an object: OpenAI sends
    them as a JSON string, and chat templates (Qwen3-Coder's, Qwen3.5's) iterate their items."""
    if not isinstance(calls, list):
        raise bad(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(
                f"{where}[{j}]", 'must be {"type": "function", "function": {"name", "arguments"}}'
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(
                    arguments or "{}", parse_constant=_NotFinite, parse_float=_finite_float
                )
            except (ValueError, RecursionError) as err:
                raise bad(
                    f"{where}[{j}].function.arguments",
                    f"is not valid JSON ({err}); send the arguments as a JSON object in a string",
                ) from None
            _check_tree(arguments, f"{where}[{j}].function.arguments")
        if not isinstance(arguments, dict):
            raise bad(
                f"{where}[{j}].function.arguments",
                f"must be a JSON object of the arguments, got {type(arguments).__name__}",
            )
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def parse_tools(body: dict) -> list[dict] | None:
    """The tools offered to the model (each an object, as the template reads them), or None."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "must be a list")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}]", 'must be an object, {"type": "function", "function": {...}}')
    return tools


def parse_template_kwargs(body: dict) -> dict:
    """chat_template_kwargs: more variables for the chat template (enable_thinking, ...)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "must be an object")
    for name in TEMPLATE_FIELDS:
        if name in kwargs:
            raise bad(
                f"chat_template_kwargs.{name}",
                "is no template option: the server sets it from the request",
            )
    return kwargs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; cached_tokens: the prompt's tokens the prefix cache held (OpenAI's
    prompt_tokens_details), where known."""
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish: str,
    u: dict,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
    reasoning: str | bool | None = False,
    stop_reason: str | None = None,
) -> dict:
    """reasoning: the message's reasoning_content (None: it has none); False: no such field.
    stop_reason: the stop string the reply ended before, as vLLM's choices give it."""
    message: dict = {"role": "assistant", "content": text}
    if reasoning is not False:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["content"] = text or None
        message["tool_calls"] = tool_calls
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
        ],
        "usage": u,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict,
    finish: str | None,
    u: dict | None = None,
    logprobs: dict | None = None,
    stop_reason: str | None = None,
) -> dict:
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": stop_reason}],
    }  # fmt: skip
    if u is not None:
        chunk["choices"] = []
        chunk["usage"] = u
    return chunk


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish: str,
    u: dict,
    logprobs: dict | None = None,
    stop_reason: str | None = None,
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": stop_reason}],
        "usage": u,
    }  # fmt: skip


def completion_chunk(rid: str, model: str, text: str, finish: str | None,
                     u: dict | None = None, logprobs: dict | None = None,
                     stop_reason: str | None = None) -> dict:  # fmt: skip
    chunk = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": stop_reason}],
    }  # fmt: skip
    if u is not None:
        chunk["choices"] = []
        chunk["usage"] = u
    return chunk


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.matched: str | None = None  # the stop string reached

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was reached."""
        self.pending += text
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                self.matched = stop
                return out, True
        if self.hold == 0:
            out, self.pending = self.pending, ""
            return out, False
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TokenNames(Protocol):
    """What the logprobs shapes read of a tokenizer (tokenizer.Tokenizer)."""

    def token_text(self, token_id: int) -> str: ...
    def token_bytes(self, token_id: int) -> list[int]: ...


class TokenIds:
    """Names for a model without a tokenizer: each token as its id."""

    @staticmethod
    def token_text(token_id: int) -> str:
        return f"token_id:{token_id}"

    @staticmethod
    def token_bytes(token_id: int) -> list[int]:
        return []


def chat_logprobs(entries: list[TokenLogprobs], names: TokenNames) -> dict:
    """Chat's logprobs object: each output token's text, log probability and bytes, with the
    likeliest tokens'."""

    def one(token: int, logprob: float) -> dict:
        return {"token": names.token_text(token), "logprob": logprob,
                "bytes": names.token_bytes(token)}  # fmt: skip

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprobs], names: TokenNames, offset: int) -> dict:
    """The legacy completions' logprobs object; `offset`: the text's length before these
    tokens (text_offset counts from the completion's start)."""
    tokens, offsets = [], []
    for e in entries:
        text = names.token_text(e.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        # (None: an echoed prompt's first token, which nothing predicts)
        "top_logprobs": [
            None if e.logprob is None else {names.token_text(t): lp for t, lp in e.top}
            for e in entries
        ],
        "text_offset": offsets,
    }


def tool_use(
    body: dict, tools: list | None, template_source: str | None, parser: str = "auto"
) -> tuple[ToolParser | None, str]:
    """How a chat request's tool calls are taken out of its reply (None: they stay text), and
    the opening of the call its reply must begin with ("" where the model chooses).

    `tool_choice` absent or "auto": calls are read where the request gives tools and the reply
    has a form to read them in (`parser`: --tool-call-parser; auto: the chat template's form);
    "none": the reply stays text. "required", or a named function
    (`{"type": "function", "function": {"name": ...}}`), makes the reply begin with the opening
    of a call (of that function), which the prompt writes: the model goes on inside it.
    `parallel_tool_calls` false ends the reply at its first call."""
    asked = _asked_calls(body, tools)
    if asked is None:
        return None, ""
    forced, name, parallel = asked
    form = parser_for(template_source, parser)
    reader = ToolParser.of(form, tools, parallel) if form else None
    if not forced:
        return reader, ""
    if reader is None:
        raise bad(
            "tool_choice",
            "this model's chat template writes no tool calls this server reads; start it with "
            "--tool-call-parser hermes or qwen_xml to force a call",
        )
    return reader, reader.opening(name)


def harmony_use(body: dict, tools: list | None) -> tuple[harmony.HarmonyReply, str]:
    """How a chat request's reply in gpt-oss's format is read (its calls taken out where the
    request gives tools and tool_choice is not "none"), and the opening of the call it must
    begin with ("" where the model chooses), as `tool_use` for the other formats."""
    asked = _asked_calls(body, tools)
    if asked is None:
        return harmony.HarmonyReply(calls=False), ""
    forced, name, parallel = asked
    return harmony.HarmonyReply(True, parallel), harmony.opening(name) if forced else ""


def _asked_calls(body: dict, tools: list | None) -> tuple[bool, str | None, bool] | None:
    """Whether a chat request's tool_choice forces a call, the function it names (None: any),
    and whether the reply may make several (`parallel_tool_calls`); None where the reply makes
    no calls (no tools, or tool_choice "none")."""
    choice = body.get("tool_choice")
    forced, name = _forced_call(choice)
    if not tools or choice == "none":
        if forced:
            raise bad("tool_choice", "asks for a tool call, but the request gives no tools")
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "must be true or false")
    if forced and name is not None and name not in _tool_names(tools):
        raise bad("tool_choice", f"names {name!r}, which is not among the request's tools")
    return forced, name, parallel


def _forced_call(choice) -> tuple[bool, str | None]:
    """Whether `tool_choice` forces a call, and the function it names (None: any)."""
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return True, function["name"]
    raise bad(
        "tool_choice",
        'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
    )


def _tool_names(tools: list) -> set[str]:
    """The function names a request's tools offer."""
    names = set()
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def parse_reasoning_budget(body: dict, default: int | None) -> int | None:
    """`reasoning_budget`: the reply's tokens inside its <think> block before the server closes
    it (0: none); absent or null: the server's --reasoning-budget."""
    budget = _number(body, "reasoning_budget", None, lo=0, integer=True)
    return default if budget is None else budget


def parse_reasoning_effort(body: dict) -> str | None:
    """`reasoning_effort` (low, medium or high): how long a model that takes it (gpt-oss) reasons,
    given to the chat template as its `reasoning_effort` variable; absent or null: the
    template's default."""
    value = body.get("reasoning_effort")
    if value is not None and value not in harmony.EFFORTS:
        raise bad("reasoning_effort", f"must be one of {', '.join(harmony.EFFORTS)}, got {value!r}")
    return value
