"""Tool calls out of a chat reply's text, in the Hermes form the Qwen family writes:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

as OpenAI's `tool_calls` (each call's arguments a JSON string). Used where a request gives tools
and the checkpoint's chat template writes this form (`speaks_hermes`). A block that does not parse
as a call stays in the content as it was written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def speaks_hermes(chat_template_source: str | None) -> bool:
    """Whether a chat template asks for tool calls in <tool_call> blocks."""
    return bool(chat_template_source) and OPEN in chat_template_source


def parse_call(block: str) -> dict | None:
    """An OpenAI tool call from the JSON inside one block, or None where it is not one."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": arguments},
    }


def split_reply(text: str) -> tuple[str, list[dict]]:
    """A whole reply's content (the text outside the calls, stripped where calls were taken)
    and its tool calls."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    rest, more = stream.flush()
    content, calls = content + rest, calls + more
    return (content.strip() if calls else content), calls


@dataclass
class ToolCallStream:
    """Streamed text in, (content, calls) out: text outside the blocks as it comes, less a
    tail that may be the start of <tool_call>; each block once it closes, as a call (or, where
    it does not parse, as the text it was)."""

    _held: str = ""  # text not yet given out: a possible opening tag, or an open block
    _inside: bool = False
    calls_made: int = 0

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        text = self._held + piece
        self._held = ""
        content, calls = [], []
        while text:
            if self._inside:
                end = text.find(CLOSE)
                if end < 0:
                    self._held = text
                    break
                block, text = text[:end], text[end + len(CLOSE) :]
                self._inside = False
                call = parse_call(block)
                if call is None:
                    content.append(OPEN + block + CLOSE)
                else:
                    calls.append(call)
                    self.calls_made += 1
                continue
            start = text.find(OPEN)
            if start >= 0:
                content.append(text[:start])
                text = text[start + len(OPEN) :]
                self._inside = True
                continue
            keep = _partial_tag(text)
            content.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return "".join(content), calls

    def flush(self) -> tuple[str, list[dict]]:
        """The end of the reply: what is held goes out as text (a block left open included)."""
        held, self._held = self._held, ""
        if self._inside:
            self._inside = False
            return OPEN + held, []
        return held, []


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` may begin <tool_call>."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
