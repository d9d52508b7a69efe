"""The Messages API's replies (engine/serving/anthropic_api.py): a chat response as Anthropic's
message, a chat stream's chunks as its server-sent events, an error in its shape.

A reply's blocks come in the order the chat's parsers find them: thinking (the reasoning's text,
with an empty signature: nothing here signs it), text (without whitespace around it), then one
tool_use block a call (its id the call's with `toolu_` for `call_`, its input the arguments).
The stop reason is `end_turn`, `max_tokens`, `tool_use`, `stop_sequence` (with the string), or
`model_context_window_exceeded` where max_tokens was cut to the context's room and the reply ran
to it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

from starlette.responses import JSONResponse

from .generation import Generation
from .openai_api import ApiError

# Anthropic's error type for each status the server answers with
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(err: ApiError) -> dict:
    fallback = "api_error" if err.status >= 500 else "invalid_request_error"
    kind = ERROR_TYPES.get(err.status, fallback)
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def usage(chat_usage: dict) -> dict:
    """Anthropic's usage from the chat's: the prompt's tokens the prefix cache held are read
    from the cache, the rest are input."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": chat_usage["completion_tokens"],
    }


def stop_reason(choice: dict, gen: Generation, asked_max_tokens: int) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's end."""
    finish = choice["finish_reason"]
    if finish == "stop" and choice.get("stop_reason") is not None:
        return "stop_sequence", choice["stop_reason"]
    if finish == "length" and gen.max_tokens < asked_max_tokens:
        return "model_context_window_exceeded", None
    return STOP_REASONS.get(finish, "end_turn"), None


def tool_use(call: dict) -> dict:
    """An OpenAI tool call as a tool_use block (its arguments are a JSON object's text)."""
    function = call["function"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": function["name"],
        "input": json.loads(function["arguments"]),
    }


def message(chat: dict, gen: Generation, asked_max_tokens: int, shown: bool = True) -> dict:
    """The Messages response of a whole chat response (`shown`: with the reasoning's text)."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content: list[dict] = []
    if reply.get("reasoning_content"):
        thinking = reply["reasoning_content"] if shown else ""
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if reply.get("content") and reply["content"].strip():
        content.append({"type": "text", "text": reply["content"].strip()})
    content += [tool_use(call) for call in reply.get("tool_calls") or ()]
    reason, sequence = stop_reason(choice, gen, asked_max_tokens)
    return {
        "id": chat["id"],
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat["usage"]),
    }


class MessageEvents:
    """A chat stream's chunks as the Messages API's events: message_start (once the first
    token is in, when the prompt's cached tokens are known), each block's
    content_block_start, deltas and content_block_stop (thinking, text, tool_use), then
    message_delta with the stop reason and the usage, and message_stop; a failure as an error
    event. Whitespace around a text block is dropped, as a whole message drops it."""

    def __init__(
        self, gen: Generation, rid: str, model: str, asked_max_tokens: int, shown: bool = True
    ) -> None:
        self.gen = gen
        self.shown = shown  # the thinking blocks carry the reasoning's text
        self.rid = rid
        self.model = model
        self.asked_max_tokens = asked_max_tokens
        self.started = False
        self.block: str | None = None  # the open block's type
        self.index = -1  # the open (or last) block's index
        self.end: tuple[str, str | None] | None = None  # stop reason and sequence, once known
        self.space = ""  # whitespace at the text's end, given out only when more text follows

    async def stream(self, chunks: AsyncIterator[dict | ApiError]) -> AsyncIterator[str]:
        async with aclosing(chunks):
            async for chunk in chunks:
                for name, data in self.events(chunk):
                    yield f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def events(self, chunk: dict | ApiError) -> Iterator[tuple[str, dict]]:
        if isinstance(chunk, ApiError):
            yield "error", error_body(chunk)
            return
        if chunk.get("usage") is not None:  # the last chunk
            yield from self._start()
            yield from self._close()
            reason, sequence = self.end or ("end_turn", None)
            yield (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(chunk["usage"]),
                },
            )
            yield "message_stop", {"type": "message_stop"}
            return
        choice = chunk["choices"][0]
        delta = choice["delta"]
        if delta.get("role"):  # the stream's first chunk: no token yet
            return
        yield from self._start()
        if delta.get("reasoning_content"):
            yield from self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if self.shown:
                yield self._delta(
                    {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                )
        if delta.get("content"):
            yield from self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            block = tool_use(call)
            yield from self._close()
            yield from self._open("tool_use", {**block, "input": {}})
            arguments = call["function"]["arguments"]
            yield self._delta({"type": "input_json_delta", "partial_json": arguments})
            yield from self._close()
        if choice["finish_reason"] is not None:
            self.end = stop_reason(choice, self.gen, self.asked_max_tokens)

    def _text(self, text: str) -> Iterator[tuple[str, dict]]:
        """Text into a text block: none begins or ends in whitespace, as in `message`."""
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if self.block != "text":
            body = body.lstrip()
        if body:
            yield from self._open("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": body})

    def _start(self) -> Iterator[tuple[str, dict]]:
        if self.started:
            return
        self.started = True
        cached = self.gen.cached_tokens or 0
        yield "message_start", {"type": "message_start", "message": {
            "id": self.rid, "type": "message", "role": "assistant",
            "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.gen.prompt_tokens - cached,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                      "output_tokens": 0},
        }}  # fmt: skip

    def _open(self, kind: str, block: dict) -> Iterator[tuple[str, dict]]:
        if self.block == kind:
            return
        yield from self._close()
        self.block, self.index = kind, self.index + 1
        yield (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": self.index,
                "content_block": block,
            },
        )

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                       "delta": delta}  # fmt: skip

    def _close(self) -> Iterator[tuple[str, dict]]:
        self.space = ""
        if self.block is None:
            return
        self.block = None
        yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
