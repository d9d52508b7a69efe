"""A chat reply's reasoning taken out of its text: what a thinking model (Qwen3, QwQ, DeepSeek-R1)
writes between <think> and </think> before its answer, given as `reasoning_content` beside the
`content`, as vLLM's and SGLang's reasoning parsers give it (`--reasoning-parser think`).

The reply starts in its reasoning where the rendered prompt ends inside a <think> block (the
chat template opened it: DeepSeek-R1, the Qwen3 thinking models of 2507), or where the reply
itself opens with <think>. Otherwise it has no reasoning (Qwen3 with enable_thinking false,
whose template closes an empty block in the prompt; any other model). The reasoning ends at
</think>, and everything after it is content. A reply cut short inside its reasoning is all
reasoning. Whitespace around the reasoning and before the content is dropped.

A reasoning budget (`ReasoningBudget`: `--reasoning-budget`, a request's own) ends the block after
that many of the reply's tokens inside it: the server then writes the closing tag as the chat
templates write it (`CLOSING`) and the model goes on with its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

OPEN, CLOSE = "<think>", "</think>"
# a block's end as the Qwen templates write a past turn's reasoning (and an empty one)
CLOSING = "\n</think>\n\n"


def opened_by_prompt(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a <think> block, so the reply starts in it."""
    return prompt.rstrip().endswith(OPEN)


def closed(prompt: str) -> str:
    """The rendered prompt with the <think> block it ends in closed empty (as Qwen3's template
    writes it with enable_thinking false), so that the reply starts with its answer; any other
    prompt as it is."""
    return prompt + CLOSING if opened_by_prompt(prompt) else prompt


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """A whole reply's (reasoning, None where it has none or it is empty; content)."""
    stream = ReasoningStream(opened)
    reasoning, content = stream.feed(text)
    more, rest = stream.flush()
    return (reasoning + more) or None, content + rest


@dataclass
class ReasoningStream:
    """Streamed reply text in, (reasoning, content) out as it comes. Held back: the reply's
    leading whitespace and what may begin <think> there, the reasoning's trailing whitespace and
    what may begin </think>, and the whitespace between </think> and the content."""

    opened: bool = False  # the prompt opened the reasoning
    # "start" (a <think> may open), "reasoning" (dropping its leading whitespace), "thinking",
    # "after" (dropping the whitespace after </think>), "content"
    _state: str = ""
    _held: str = ""

    def __post_init__(self) -> None:
        self._state = "reasoning" if self.opened else "start"

    @property
    def inside(self) -> bool:
        """Whether the text so far ends inside the reasoning."""
        return self._state in ("reasoning", "thinking")

    def feed(self, piece: str) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        reasoning: list[str] = []
        while text:
            if self._state == "start":
                lead = text.lstrip()
                if lead.startswith(OPEN):
                    self._state = "reasoning"
                    text = lead[len(OPEN) :]
                    continue
                if OPEN.startswith(lead):  # whitespace, or the start of <think>: wait
                    self._held = text
                    return "", ""
                self._state = "content"
                return "", text
            if self._state == "reasoning":  # its leading whitespace dropped
                text = text.lstrip()
                if text:
                    self._state = "thinking"
                continue
            if self._state == "thinking":
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning.append(text[:end].rstrip())
                    self._state, text = "after", text[end + len(CLOSE) :]
                    continue
                keep = _held_back(text)
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            if self._state == "after":  # the whitespace before the content dropped
                text = text.lstrip()
                if text:
                    self._state = "content"
                continue
            return "".join(reasoning), text  # content
        return "".join(reasoning), ""

    def flush(self) -> tuple[str, str]:
        """The end of the reply: what is held goes out (whitespace dropped), as reasoning where
        the reply is still in it, else as content (a lone start of <think>)."""
        held, self._held = self._held, ""
        if self._state in ("reasoning", "thinking"):
            return held.rstrip(), ""
        return "", held


def _held_back(text: str) -> int:
    """How many characters at the end of reasoning text to hold: what may begin </think>, and
    the whitespace before it."""
    tag = next((k for k in range(min(len(CLOSE) - 1, len(text)), 0, -1)
                if CLOSE.startswith(text[-k:])), 0)  # fmt: skip
    body = text[: len(text) - tag]
    return tag + len(body) - len(body.rstrip())


class ReasoningReader(Protocol):
    """Reads a reply's text as it comes and tells whether it ends inside the reasoning
    (ReasoningStream; harmony.HarmonyStream for gpt-oss's format)."""

    @property
    def inside(self) -> bool: ...
    def feed(self, piece: str) -> object: ...


@dataclass
class ReasoningBudget:
    """Counts a reply's tokens inside its reasoning (its <think> block, or what `reading`
    finds), one `feed` a token, and tells when `tokens` of them are spent with the reasoning
    still going: the closing tag is then due."""

    tokens: int
    opened: bool = False  # the prompt opened the block
    spent: int = 0
    reading: ReasoningReader | None = None  # None: a <think> block's
    _text: ReasoningReader = field(init=False)

    def __post_init__(self) -> None:
        assert self.tokens >= 0, self.tokens
        self._text = self.reading or ReasoningStream(self.opened)

    def feed(self, piece: str) -> bool:
        """Take one token's text; whether the budget is spent and the reply still thinking."""
        was_inside = self._text.inside
        self._text.feed(piece)
        if was_inside:
            self.spent += 1
        return self._text.inside and self.spent >= self.tokens
