"""A coding agent's session, replayed through the Messages API and timed as the agent sees it
(torch-free: `moelab bench agent` and the benchmark's agent objective run it).

The session has the shape Claude Code's have (`SessionShape`): a system prompt with tool
definitions of `system_tokens`, then `turns` requests. The first asks for a task; each later one
adds the assistant's previous turn (a sentence and one tool call, as an agent sends its history
back: recorded, not what this model wrote) and that call's result, `result_tokens` of code and
prose; each asks for `reply_tokens` tokens (drawn per turn from the ranges, `ignore_eos`). So each
prompt begins with the one before it, as an agent's do, and the prefix cache can hold all of it
but the newest turn.

A turn's figures (`TurnTiming`) are the client's: the time to the first streamed token, the
decode rate after it, and the share of the prompt the usage says the prefix cache held
(`cache_read_input_tokens`). A session's (`SessionResult`) add its total time and its generated
tokens over that time (`agent_tok_s`), what an agent's user waits on.
"""

from __future__ import annotations

import json
import random
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx

from ..model.corpus import excerpt

# the system prompt's first block, before the text that fills it to its size
PREAMBLE = (
    "You are an interactive command-line agent that helps users with software engineering "
    "tasks. Use the tools below to read, search and change the repository; answer briefly, and "
    "say what you changed. Prefer editing files to writing new ones; run the tests after a change."
)
TASK = (
    "The service starts on the wrong port when the config file sets one. Find where the config "
    "is parsed, fix it and run the tests."
)
# tool definitions of the shape Claude Code sends (its documented tools, JSON Schema input)
TOOLS: list[dict[str, Any]] = [
    {"name": "Bash", "description": "Run a shell command in the repository and return its output.",
     "input_schema": {"type": "object", "properties": {
         "command": {"type": "string", "description": "The command to run"},
         "timeout": {"type": "integer", "description": "Milliseconds before it is stopped"},
         "description": {"type": "string", "description": "What the command does, in 5-10 words"},
     }, "required": ["command"], "additionalProperties": False}},
    {"name": "Read", "description": "Read a file, with line numbers; long files in parts.",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string", "description": "The absolute path of the file"},
         "offset": {"type": "integer", "description": "The line to start at"},
         "limit": {"type": "integer", "description": "How many lines to read"},
     }, "required": ["file_path"], "additionalProperties": False}},
    {"name": "Edit", "description": "Replace an exact string in a file by another.",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string"}, "old_string": {"type": "string"},
         "new_string": {"type": "string"},
         "replace_all": {"type": "boolean", "description": "Replace every occurrence"},
     }, "required": ["file_path", "old_string", "new_string"], "additionalProperties": False}},
    {"name": "Write", "description": "Write a whole file, replacing what it held.",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string"}, "content": {"type": "string"},
     }, "required": ["file_path", "content"], "additionalProperties": False}},
    {"name": "Glob", "description": "Find files whose paths match a glob pattern.",
     "input_schema": {"type": "object", "properties": {
         "pattern": {"type": "string"}, "path": {"type": "string"},
     }, "required": ["pattern"], "additionalProperties": False}},
    {"name": "Grep", "description": "Search file contents for a regular expression.",
     "input_schema": {"type": "object", "properties": {
         "pattern": {"type": "string"}, "path": {"type": "string"},
         "glob": {"type": "string", "description": "Only files matching this glob"},
         "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
     }, "required": ["pattern"], "additionalProperties": False}},
    {"name": "TodoWrite", "description": "Keep the task's to-do list: each item and its state.",
     "input_schema": {"type": "object", "properties": {"todos": {"type": "array", "items": {
         "type": "object", "properties": {
             "content": {"type": "string"},
             "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
         }, "required": ["content", "status"]}}}, "required": ["todos"]}},
    {"name": "WebFetch", "description": "Fetch a web page and answer a question about it.",
     "input_schema": {"type": "object", "properties": {
         "url": {"type": "string", "format": "uri"}, "prompt": {"type": "string"},
     }, "required": ["url", "prompt"], "additionalProperties": False}},
]  # fmt: skip
# the assistant's turns of the history, in turn: (what it says, the tool, its input)
ACTIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("Let me find the config parser.", "Grep", {"pattern": "def load_config", "path": "src"}),
    ("I'll read it.", "Read", {"file_path": "/repo/src/config.py"}),
    ("Now the server's start-up.", "Read", {"file_path": "/repo/src/server.py"}),
    ("Let me run the tests as they are.", "Bash", {"command": "python -m pytest -q tests"}),
    ("The port is read before the file.", "Edit", {"file_path": "/repo/src/server.py",
     "old_string": "port = DEFAULT_PORT", "new_string": "port = config.port or DEFAULT_PORT"}),
    ("And the tests again.", "Bash", {"command": "python -m pytest -q tests/test_config.py"}),
]  # fmt: skip
# tokens an assistant turn of the history and a result's wrapping take, at most (for the
# context a session needs)
HISTORY_TOKENS = 120


class SessionError(RuntimeError):
    """The engine refused or broke off a session's request; the message says which and why."""


@dataclass(frozen=True, slots=True)
class SessionShape:
    """How big a session is: its turns, its system prompt, each result and reply (token ranges,
    drawn per turn from `seed`)."""

    turns: int = 20
    system_tokens: int = 12_000
    result_tokens: tuple[int, int] = (500, 4_000)
    reply_tokens: tuple[int, int] = (50, 300)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError("a session has at least one turn")
        if self.system_tokens < 0:
            raise ValueError("the system prompt's tokens must be 0 or more")
        for name in ("result_tokens", "reply_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range MIN-MAX with 1 <= MIN <= MAX")

    def draws(self) -> list[tuple[int, int]]:
        """Each turn's (result tokens it adds, reply tokens it asks for); the first adds none.
        A draw is its range's bounds mixed by a share drawn from the seed, so that shrunk
        ranges (`fitted`) shrink every draw alike."""
        rng = random.Random(self.seed)

        def draw(bounds: tuple[int, int]) -> int:
            lo, hi = bounds
            return lo + round(rng.random() * (hi - lo))

        return [(draw(self.result_tokens) if turn else 0, draw(self.reply_tokens))
                for turn in range(self.turns)]  # fmt: skip

    @property
    def context_tokens(self) -> int:
        """About the context the last turn needs: every result, the history, the last reply."""
        draws = self.draws()
        history = HISTORY_TOKENS * self.turns + sum(result for result, _ in draws)
        return self.system_tokens + history + draws[-1][1]

    def fitted(self, context_tokens: int, system_floor: int = 0) -> SessionShape:
        """This shape, its system prompt and results shrunk alike where the session would need
        more than `context_tokens`, its system prompt taking at least `system_floor` (what its
        tool definitions take)."""

        def needs(shape: SessionShape) -> int:
            return shape.context_tokens + max(0, system_floor - shape.system_tokens)

        fitted, share = self, 1.0
        while needs(fitted) > context_tokens and share > 0.01:
            share *= 0.95
            lo, hi = self.result_tokens
            fitted = replace(
                self,
                system_tokens=int(self.system_tokens * share),
                result_tokens=(max(1, int(lo * share)), max(1, int(hi * share))),
            )
        return fitted

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class TurnTiming:
    """One turn as the client saw it, and its usage."""

    turn: int
    input_tokens: int  # of the prompt, computed
    cached_tokens: int  # of the prompt, read from the prefix cache
    output_tokens: int
    sent: float
    first_token: float
    last_token: float

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cached_tokens

    @property
    def hit_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.sent

    @property
    def decode_s(self) -> float:
        return self.last_token - self.first_token

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time after the first."""
        if self.output_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.output_tokens - 1) / self.decode_s

    def to_json(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_share": self.hit_share,
            "output_tokens": self.output_tokens,
            "ttft_s": self.ttft_s,
            "decode_tok_s": self.decode_tok_s,
            "wall_s": self.last_token - self.sent,
        }


@dataclass(frozen=True, slots=True)
class SessionResult:
    """A session's turns and what they add up to."""

    shape: SessionShape
    turns: tuple[TurnTiming, ...]

    @property
    def session_s(self) -> float:
        return self.turns[-1].last_token - self.turns[0].sent

    @property
    def decode_tok_s(self) -> float | None:
        """Every turn's tokens after its first over their time."""
        decode_s = sum(t.decode_s for t in self.turns if t.output_tokens > 1)
        tokens = sum(t.output_tokens - 1 for t in self.turns if t.output_tokens > 1)
        return tokens / decode_s if decode_s > 0 else None

    @property
    def hit_share(self) -> float:
        """The share of all the session's prompt tokens that the prefix cache held."""
        prompt = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_tokens for t in self.turns) / prompt if prompt else 0.0

    @property
    def agent_tok_s(self) -> float:
        """The session's generated tokens over its whole time, first tokens' waits included."""
        return sum(t.output_tokens for t in self.turns) / self.session_s

    def to_json(self) -> dict[str, Any]:
        ttfts = [t.ttft_s for t in self.turns]
        return {
            "shape": self.shape.to_json(),
            "turns": [t.to_json() for t in self.turns],
            "session_s": self.session_s,
            "ttft_s_median": statistics.median(ttfts),
            "ttft_s_max": max(ttfts),
            "decode_tok_s": self.decode_tok_s,
            "hit_share": self.hit_share,
            "agent_tok_s": self.agent_tok_s,
        }

    def summary(self) -> str:
        """The session in a line."""
        decode = f"{self.decode_tok_s:.1f}" if self.decode_tok_s else "-"
        ttfts = [t.ttft_s for t in self.turns]
        return (
            f"session: {len(self.turns)} turns in {self.session_s:.1f} s; time to first token "
            f"median {statistics.median(ttfts):.2f} s, max {max(ttfts):.2f} s; decode {decode} "
            f"tok/s; prefix cache {self.hit_share:.0%} of the prompt tokens; "
            f"{self.agent_tok_s:.1f} generated tok/s over the session"
        )


TURN_HEADER = (
    f"{'turn':>4} {'prompt':>7} {'cached':>7} {'hit':>5} {'ttft s':>7} {'out':>5} {'tok/s':>7} "
    f"{'wall s':>7}"
)


def turn_row(t: TurnTiming) -> str:
    """A turn as a line of the table under TURN_HEADER."""
    rate = f"{t.decode_tok_s:7.1f}" if t.decode_tok_s else f"{'-':>7}"
    return (
        f"{t.turn:>4} {t.prompt_tokens:>7} {t.cached_tokens:>7} {t.hit_share:>5.0%} "
        f"{t.ttft_s:>7.2f} {t.output_tokens:>5} {rate} {t.last_token - t.sent:>7.2f}"
    )


class MessagesClient:
    """Messages API requests to one engine over an httpx client, timed by `clock`."""

    def __init__(
        self,
        http: httpx.Client,
        base_url: str,
        model: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.http = http
        self.base_url = base_url
        self.model = model
        self.clock = clock

    def _body(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "model": self.model} if self.model else body

    def count_tokens(self, body: dict[str, Any]) -> int:
        response = self.http.post(
            self.base_url + "/v1/messages/count_tokens", json=self._body(body)
        )
        if response.status_code != 200:
            raise SessionError(refusal_text(response))
        return int(response.json()["input_tokens"])

    def stream(self, body: dict[str, Any], turn: int) -> TurnTiming:
        """Send one streamed request; its timing and the engine's usage."""
        first = last = None
        usage: dict[str, Any] = {}
        sent = self.clock()
        url = self.base_url + "/v1/messages"
        with self.http.stream("POST", url, json={**self._body(body), "stream": True}) as response:
            if response.status_code != 200:
                response.read()
                raise SessionError(refusal_text(response))
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                kind = event.get("type")
                if kind == "error":
                    raise SessionError(f"the engine broke off a request: {event['error']}")
                if kind == "message_start":
                    usage.update(event["message"]["usage"])
                elif kind == "content_block_delta":
                    now = self.clock()
                    first = now if first is None else first
                    last = now
                elif kind == "message_delta":
                    usage.update(event["usage"])
        if "output_tokens" not in usage:
            raise SessionError("the engine's stream ended without its usage")
        if first is None or last is None:
            raise SessionError(
                f"the engine generated {usage['output_tokens']} tokens but streamed no text: "
                "its tokenizer decodes them to nothing, so no token can be timed"
            )
        return TurnTiming(
            turn=turn,
            input_tokens=int(usage["input_tokens"]),
            cached_tokens=int(usage.get("cache_read_input_tokens") or 0),
            output_tokens=int(usage["output_tokens"]),
            sent=sent,
            first_token=first,
            last_token=last,
        )


def refusal_text(response: httpx.Response) -> str:
    """An engine's refusal in a line: its status and its error's message (either API's)."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    return f"the engine answered {response.status_code}: {message}"


class AgentSession:
    """The requests of one session of `shape`, sized for an engine's tokenizer."""

    def __init__(self, shape: SessionShape, chars_per_token: float, fixed_tokens: int) -> None:
        """`fixed_tokens`: what the tool definitions and the preamble take, which the system
        prompt's text fills up to `shape.system_tokens`."""
        self.shape = shape
        self.system_tokens = max(shape.system_tokens, fixed_tokens)
        rng = random.Random(shape.seed)
        # a first line of its own: no earlier session's prompt shares a prefix with this one
        fresh = f"Session {secrets.token_hex(8)}.\n\n"
        fill = (shape.system_tokens - fixed_tokens) * chars_per_token
        self.system = [
            {"type": "text", "text": fresh + PREAMBLE},
            {"type": "text", "text": excerpt(rng, max(1, int(fill)))},
        ]
        self.draws = shape.draws()
        # the result each turn after the first adds, of the call the turn before it made
        self.results = [excerpt(rng, max(1, int(tokens * chars_per_token)))
                        for tokens, _ in self.draws[1:]]  # fmt: skip

    @property
    def context_tokens(self) -> int:
        """About the context the session's last turn needs."""
        return self.shape.context_tokens - self.shape.system_tokens + self.system_tokens

    @classmethod
    def sized(
        cls, shape: SessionShape, client: MessagesClient, context_tokens: int | None = None
    ) -> AgentSession:
        """A session sized by the engine's own counts: its characters per token of the corpus,
        and the tokens the tool definitions and the preamble take; shrunk to `context_tokens`
        where given (`SessionShape.fitted`)."""
        ask = {"messages": [{"role": "user", "content": TASK}]}
        bare = client.count_tokens(ask)
        sample = excerpt(random.Random(shape.seed + 1), 8_000)
        with_text = client.count_tokens({**ask, "system": sample})
        fixed = client.count_tokens({**ask, "system": PREAMBLE, "tools": TOOLS})
        chars_per_token = len(sample) / max(1, with_text - bare)
        if context_tokens is not None:
            shape = shape.fitted(context_tokens, fixed - bare)
        return cls(shape, chars_per_token, fixed - bare)

    def request(self, turn: int) -> dict[str, Any]:
        """The body of the session's `turn`-th request (from 0)."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>The working directory is /repo, a git "
             "repository.</system-reminder>"},
            {"type": "text", "text": TASK},
        ]}]  # fmt: skip
        for k in range(turn):
            said, tool, arguments = ACTIONS[k % len(ACTIONS)]
            call = f"toolu_{k:04d}"
            messages.append({"role": "assistant", "content": [
                {"type": "text", "text": said},
                {"type": "tool_use", "id": call, "name": tool, "input": arguments},
            ]})  # fmt: skip
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call, "content": self.results[k]},
            ]})  # fmt: skip
        return {
            "max_tokens": self.draws[turn][1],
            "system": self.system,
            "tools": TOOLS,
            "messages": messages,
            "temperature": 0.7,
            "seed": self.shape.seed + turn,
            "ignore_eos": True,
        }

    def run(
        self, client: MessagesClient, on_turn: Callable[[TurnTiming], None] = lambda _turn: None
    ) -> SessionResult:
        """Send every turn in order, each once the one before it ended."""
        turns = []
        for turn in range(self.shape.turns):
            turns.append(client.stream(self.request(turn), turn + 1))
            on_turn(turns[-1])
        return SessionResult(self.shape, tuple(turns))
