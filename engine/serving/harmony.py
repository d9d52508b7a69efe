"""gpt-oss's chat format, harmony (OpenAI's openai-harmony package defines it): a reply is a
series of messages, each a header and a body between special tokens,

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Oslo"}<|call|>

and the channel says what a message is for: `analysis` is the reasoning (the message's
`reasoning_content`), `final` the answer (its `content`), `commentary` a preamble to the calls
(content too) or, with a recipient `to=functions.NAME`, a call of that function whose body is its
arguments' JSON (OpenAI's `tool_calls`). The reply stops at <|return|> (the answer is done) or
<|call|> (a call awaits its result).

The prompt is the checkpoint's chat template's (gpt-oss's renders harmony: the system message with
`Reasoning: low|medium|high` from the `reasoning_effort` variable, the developer message with the
instructions and the tools as TypeScript in a `functions` namespace); it ends in
`<|start|>assistant`, where the reply's first header begins. The reply is read from its text with
the special tokens kept (the server decodes a harmony reply so). A reply that is not in this form
is content as written; a call whose body is not a JSON object is content too, as the other tool
call parsers leave a block they cannot read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .tool_calls import new_call

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
ENDOFTEXT = "<|endoftext|>"  # one of gpt-oss's end tokens too
# the tokens a message's body ends at
_ENDS = (END, RETURN, CALL, ENDOFTEXT)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT)
EFFORTS = ("low", "medium", "high")
NAMESPACE = "functions."
# the reply's answer begun in the prompt: the reasoning skipped (a reasoning budget of 0)
FINAL = f"{CHANNEL}final{MESSAGE}"
# what ends the reasoning once a reasoning budget is spent: the answer's header follows
CLOSING = f"{END}{START}assistant{FINAL}"

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def is_harmony(chat_template_source: str | None) -> bool:
    """Whether a chat template writes harmony (its messages carry channels)."""
    return bool(chat_template_source) and CHANNEL in chat_template_source


def template_messages(messages: list[dict]) -> list[dict]:
    """The chat's messages as gpt-oss's template reads them: an assistant's reasoning as its
    `thinking` (the template's name for it), so that the reasoning before a call reaches the
    model again with the call's result. The template refuses a message with calls that has both
    a content and a thinking (it renders such a content as the reasoning): there the content, a
    preamble the client saw, is dropped, as llama.cpp drops it."""
    out = []
    for message in messages:
        reasoning = message.get("reasoning_content")
        if message.get("role") == "assistant" and reasoning and not message.get("thinking"):
            message = {**message, "thinking": reasoning}
            if message.get("tool_calls"):
                message["content"] = None
        out.append(message)
    return out


def opening(name: str | None) -> str:
    """The start of a call to `name` (None: to a function the model names), as gpt-oss writes
    it at the head of its reply."""
    if name is None:
        return f"{CHANNEL}commentary to={NAMESPACE}"
    return f"{CHANNEL}commentary to={NAMESPACE}{name} {CONSTRAIN}json{MESSAGE}"


@dataclass(frozen=True, slots=True)
class Header:
    """A message's header: its channel, and the recipient where it is a call."""

    channel: str | None
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        """`assistant<|channel|>commentary to=functions.f <|constrain|>json` and the forms the
        model writes it in (the recipient before the channel, no role, no space before
        <|constrain|>)."""
        text = text.split(CONSTRAIN, 1)[0]
        recipient = _RECIPIENT.search(text)
        channel = None
        if CHANNEL in text:
            after = text.split(CHANNEL, 1)[1].split()
            channel = after[0] if after and not after[0].startswith("to=") else None
        return cls(channel, recipient.group(1) if recipient else None)

    @property
    def function(self) -> str | None:
        """The function a call message calls (None: it calls none)."""
        if self.recipient and self.recipient.startswith(NAMESPACE):
            return self.recipient[len(NAMESPACE) :] or None
        return None


@dataclass(frozen=True, slots=True)
class HarmonyReply:
    """How one request's reply is read: whether its calls are taken out (the request gives tools
    and lets the model call them), and whether it may make several (parallel_tool_calls)."""

    calls: bool
    parallel: bool = True

    @property
    def limit(self) -> int | None:
        return None if self.parallel else 1

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self.calls, self.limit)

    def split(self, text: str) -> tuple[str | None, str, list[dict]]:
        return split_harmony(text, self.calls, self.limit)


def split_harmony(
    text: str, calls: bool = True, limit: int | None = None
) -> tuple[str | None, str, list[dict]]:
    """A whole reply's (reasoning, None where it has none; content; calls)."""
    stream = HarmonyStream(calls, limit)
    reasoning, content, made = stream.feed(text)
    more, rest, last = stream.flush()
    return (reasoning + more) or None, content + rest, made + last


@dataclass
class HarmonyStream:
    """Streamed reply text in, (reasoning, content, calls) out as it comes: the analysis
    channel's text as reasoning, the final and commentary channels' as content, each call once
    its message ends (`calls` False: a call's body is content). Held back: a header until its
    <|message|>, a call's body until its end, and a body's tail that may begin a special
    token. Once `limit` calls are made the reply has ended, and what follows is dropped."""

    calls: bool = True
    limit: int | None = None
    calls_made: int = 0
    # "header" (up to <|message|>), "body" (up to its end), "between" (after a message's end)
    _state: str = "header"
    _header: Header = field(default_factory=lambda: Header(None, None))
    _held: str = ""
    _messages: int = 0  # messages begun

    @property
    def full(self) -> bool:
        """Whether the reply made its last call (`limit`)."""
        return self.limit is not None and self.calls_made >= self.limit

    @property
    def inside(self) -> bool:
        """Whether the text so far ends inside the reasoning (an analysis message's body)."""
        return self._state == "body" and self._kind == "reasoning"

    @property
    def _kind(self) -> str:
        """What the open message's body is: reasoning, content, or a call."""
        if self.calls and self._header.function is not None:
            return "call"
        return "reasoning" if self._header.channel == "analysis" else "content"

    def feed(self, piece: str) -> tuple[str, str, list[dict]]:
        text = "" if self.full else self._held + piece
        self._held = ""
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        made: list[dict] = []
        while text and not self.full:
            if self._state == "between":  # the next message's <|start|>
                if START.startswith(text) and text != START:
                    self._held = text
                    break
                self._state, text = "header", text.removeprefix(START)
                continue
            if self._state == "header":
                at = text.find(MESSAGE)
                if at < 0:
                    self._held = text
                    break
                self._header = Header.parse(text[:at])
                self._messages += 1
                self._state, text = "body", text[at + len(MESSAGE) :]
                continue
            end, marker = _first_end(text)
            if end < 0:  # the body goes on: out as it comes, but a call's and a marker's start
                if self._kind == "call":
                    self._held = text
                    break
                keep = _partial_marker(text)
                out[self._kind].append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            body, text = text[:end], text[end + len(marker) :]
            self._state = "between"
            if self._kind != "call":
                out[self._kind].append(body)
            elif (call := _call(self._header.function, body)) is not None:
                made.append(call)
                self.calls_made += 1
            else:
                out["content"].append(body)
        return "".join(out["reasoning"]), "".join(out["content"]), made

    def flush(self) -> tuple[str, str, list[dict]]:
        """The end of the reply: what is held goes out as the open message's (a call cut short
        as content, as written); a reply in no harmony form is content as written (less an end
        token), and a header cut short is dropped."""
        held, self._held = self._held, ""
        if self.full or not held:
            return "", "", []
        if self._state == "body":
            return (held, "", []) if self._kind == "reasoning" else ("", held, [])
        if self._state == "header" and self._messages == 0:
            for end in _ENDS:  # the end token a reply in no harmony form may end at
                held = held.removesuffix(end)
            if not any(marker in held for marker in MARKERS):
                return "", held, []
        return "", "", []


def _first_end(text: str) -> tuple[int, str]:
    """Where the first of a body's end tokens is in `text`, and which (-1, "": none)."""
    found = [(text.find(end), end) for end in _ENDS if end in text]
    return min(found) if found else (-1, "")


def _partial_marker(text: str) -> int:
    """How many characters at the end of `text` may begin a special token."""
    for n in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-n:]) for marker in MARKERS):
            return n
    return 0


def _call(name: str, body: str) -> dict | None:
    """An OpenAI tool call of `name` with `body` as its arguments (empty: none), or None where
    the body is not a JSON object."""
    arguments = body.strip() or "{}"
    try:
        if not isinstance(json.loads(arguments), dict):
            return None
    except ValueError:
        return None
    return new_call(name, arguments)
