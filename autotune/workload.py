"""The workload every trial runs: fixed-seed corpus excerpts sent to a live engine, timed.

Prompts are excerpts of the corpus that ships with the engine (prose, Japanese, code), chosen by a
fixed seed so every trial reads the same text. Each prompt starts with a random line, so a prefix
cache cannot make a later request cheaper than the first. Lengths in tokens come from the engine's
own `usage`, never from a guess. How much a trial sends is a `WorkloadSpec`: a mode's minimum for
the calibration trial, then the spec sized from it (autotune/sizing.py) for every later trial.

The agent objective's workload adds coding agents' sessions (engine/bench/agent_session.py): each a
system prompt with tool definitions and turns that each add a tool result and generate a reply,
through the Messages API, shrunk where it would not fit the engine's usable context.
"""

from __future__ import annotations

import random
import secrets
import statistics
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..engine.bench.agent_session import AgentSession, SessionError, SessionResult, SessionShape
from ..engine.model.corpus import excerpt
from ..engine.text import Text, text_fields, text_of
from .client import EngineClient, StreamTiming, WorkloadError

PROOF_SHARE = 0.95  # a context tier counts as served when a prompt reaches this share of it
PROOF_ATTEMPTS = 12  # prompts a context proof may send before it gives up
REFUSED_SHRINK = 0.9  # a refused proof prompt with none served yet: this share of it next
# the warm-up prompt: long enough to span KV pages and reach the engine's streamed prefill path,
# never longer than one prefill chunk; a few generated tokens run the decode path
WARMUP_MIN_TOKENS = 32
WARMUP_GENERATED_TOKENS = 4
# characters per token assumed before the engine has counted any (the warm-up measures it); high,
# so a prompt cut by it has at least the tokens it was meant to have on most tokenizers
GUESS_CHARS_PER_TOKEN = 4.0
DECODE_PROMPT_CHARS = 400
AGGREGATE_PROMPT_CHARS = 300


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How much each trial asks of the engine: a mode's minimum, or that sized to a duration.

    `prefill_chars` is the long prompt's text in characters, fixed by the calibration trial (the
    cut the engine counts as `prefill_tokens`), so every later trial sends the very same prompt.
    None (the calibration trial itself): cut by the warm-up's count, then corrected by the
    engine's count of each long prompt sent.
    """

    seed: int = 20_251_129
    prefill_tokens: int = 2048  # length of the long prompt that gives prefill tok/s
    prefill_requests: int = 2
    decode_requests: int = 5  # streamed generations; decode tok/s is their median
    decode_tokens: int = 128
    clients: int = 0  # concurrent clients for aggregate tok/s; 0 leaves it unmeasured
    aggregate_tokens: int = 96
    aggregate_rounds: int = 2  # rounds of `clients` streams at once; the median round counts
    request_timeout_s: float = 600.0
    prefill_chars: int | None = None
    # the agent sessions (0 turns leaves agent tok/s unmeasured): their turns, system prompt,
    # and the most tokens a result adds (from an eighth of it) and a reply asks (from a sixth)
    agent_turns: int = 0
    agent_system_tokens: int = 12_000
    agent_result_tokens: int = 4_000
    agent_reply_tokens: int = 300
    agent_sessions: int = 1  # sessions one after the other; agent tok/s is their median

    def __post_init__(self) -> None:
        assert self.prefill_tokens >= 16 and self.decode_tokens >= 2, self
        assert self.prefill_requests >= 1 and self.decode_requests >= 1, self
        assert self.aggregate_rounds >= 1, self
        assert self.prefill_chars is None or self.prefill_chars > 0, self
        assert self.agent_sessions >= 1 and self.agent_reply_tokens >= 6, self
        assert self.agent_result_tokens >= 8, self

    def session(self, index: int) -> SessionShape:
        """The shape of the `index`-th agent session."""
        return SessionShape(
            turns=self.agent_turns,
            system_tokens=self.agent_system_tokens,
            result_tokens=(self.agent_result_tokens // 8, self.agent_result_tokens),
            reply_tokens=(self.agent_reply_tokens // 6, self.agent_reply_tokens),
            seed=self.seed + index,
        )

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadSpec:
        return cls(**{name: data[name] for name in cls.__slots__ if name in data})


@dataclass(slots=True)
class WorkloadResult:
    """The figures of one trial's workload, with the per-request readings behind them.

    `details` holds the readings, the spec that was run (`workload`), the seconds it took
    (`workload_s`) and each part of them (`parts_s`: prefill, decode, aggregate, agent), and
    the long prompts' lengths in characters and as the engine counted them (`prefill_cuts`):
    what the calibration trial sizes the run's workload from.
    """

    prefill_tok_s: float
    prefill_prompt_tokens: int
    decode_tok_s: float
    ttft_s: float
    aggregate_tok_s: float | None = None
    agent_tok_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ContextProof:
    """A request sent to prove a context length: how many prompt tokens the engine served."""

    target_tokens: int
    prompt_tokens: int
    ok: bool
    message: Text | str

    def to_json(self) -> dict[str, Any]:
        return {
            "target_tokens": self.target_tokens,
            "prompt_tokens": self.prompt_tokens,
            "ok": self.ok,
            **text_fields("message", self.message),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ContextProof:
        return cls(
            int(data["target_tokens"]),
            int(data["prompt_tokens"]),
            bool(data["ok"]),
            text_of(data, "message"),
        )


def fresh_line() -> str:
    """A first line no earlier prompt had, so no cached prefix is shared between requests."""
    return f"Request {secrets.token_hex(8)}.\n"


FRESH_LINE_CHARS = len(fresh_line())


def chars_for_tokens(tokens: int, cuts: list[tuple[int, int]]) -> int:
    """Characters of the long text that make a prompt of `tokens`, from the cuts the engine
    counted (characters, tokens): on the line through the two nearest, one on each side when
    there are such, or scaled from the one cut there is."""
    by_distance = sorted(set(cuts), key=lambda cut: abs(cut[1] - tokens))
    below = [c for c in by_distance if c[1] <= tokens]
    above = [c for c in by_distance if c[1] >= tokens]
    pair = [below[0], above[0]] if below and above else by_distance[:2]
    (chars_0, tokens_0), (chars_1, tokens_1) = pair[0], pair[-1]
    if tokens_1 != tokens_0 and (chars_1 - chars_0) * (tokens_1 - tokens_0) > 0:
        return max(
            1, round(chars_0 + (tokens - tokens_0) * (chars_1 - chars_0) / (tokens_1 - tokens_0))
        )
    return max(1, round(chars_0 * tokens / max(1, tokens_0)))


class Workload:
    """The same requests for every trial, derived from one spec and its seed."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec

    def warm_up(self, client: EngineClient, engine_config: dict[str, Any]) -> float:
        """One short request before timing anything; returns characters per prompt token.

        It only has to make the engine compile and load what the workload's requests use: a
        prompt of `warm_up_tokens` (no first line of its own: this engine has seen no prompt it
        could share a prefix with) and a few generated tokens.
        """
        spec = self.spec
        ratio = GUESS_CHARS_PER_TOKEN
        if spec.prefill_chars:
            ratio = spec.prefill_chars / spec.prefill_tokens
        chars = max(1, int(warm_up_tokens(engine_config) * ratio))
        text = excerpt(random.Random(spec.seed), chars)
        timing = client.stream(text, WARMUP_GENERATED_TOKENS, spec.seed)
        return len(text) / max(1, timing.prompt_tokens)

    def prefill_target(self, usable_context: int) -> int:
        """Tokens of the long prompt: the spec's, or, before they were counted, half the usable
        context when that is less (a first guess of characters per token may be off by that
        much)."""
        if self.spec.prefill_chars:
            return self.spec.prefill_tokens
        return min(self.spec.prefill_tokens, max(16, (usable_context - 64) // 2))

    def run(
        self,
        client: EngineClient,
        usable_context: int,
        chars_per_token: float,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> WorkloadResult:
        """Prefill, then single-request decode, then (when asked) concurrent clients and
        agent sessions.

        The long prompt is the spec's `prefill_chars` of text; without them (the calibration
        trial), the first is cut by `chars_per_token` (the warm-up's count) and each next one
        by the engine's count of those before it, closer to `prefill_tokens` each time.
        """
        spec = self.spec
        began = client.clock()
        rng = random.Random(spec.seed)
        prefill_target = self.prefill_target(usable_context)
        first_cut = spec.prefill_chars or int(prefill_target * chars_per_token)
        # room for the later cuts to grow: a longer text's start is the shorter one
        long_text = excerpt(rng, first_cut if spec.prefill_chars else 4 * first_cut)
        prefills, cuts = [], []
        for i in range(spec.prefill_requests):
            _check(cancelled)
            fixed = spec.prefill_chars or not cuts
            chars = first_cut if fixed else chars_for_tokens(prefill_target, cuts)
            prefills.append(client.stream(fresh_line() + long_text[:chars], 1, spec.seed + i))
            cuts.append((chars, prefills[-1].prompt_tokens))
        prefill_rates = [t.prompt_tokens / t.ttft_s for t in prefills]
        short_prompts = [excerpt(rng, DECODE_PROMPT_CHARS) for _ in range(spec.decode_requests)]
        decodes = []
        for i, prompt in enumerate(short_prompts):
            _check(cancelled)
            decodes.append(client.stream(fresh_line() + prompt, spec.decode_tokens, spec.seed + i))
        prefill_tok_s = statistics.median(prefill_rates)
        decode_rates = [r for r in (t.decode_tok_s(prefill_tok_s) for t in decodes) if r]
        if not decode_rates:
            raise WorkloadError("no decode rate: every generation ended after one token")
        details: dict[str, Any] = {
            "prefill_tok_s": prefill_rates,
            "prefill_prompt_tokens": [t.prompt_tokens for t in prefills],
            "prefill_target_tokens": prefill_target,
            "prefill_cuts": cuts,  # (characters of text, prompt tokens) of each long prompt
            "decode_tok_s": decode_rates,
            "decode_tokens": [t.completion_tokens for t in decodes],
            "decode_prompt_tokens": [t.prompt_tokens for t in decodes],
            "ttft_s": [t.ttft_s for t in decodes],
            "prompt_chars_per_token": (cuts[-1][0] + FRESH_LINE_CHARS) / cuts[-1][1],
            "parts_s": {
                "prefill": sum(t.wall_s for t in prefills),
                "decode": sum(t.wall_s for t in decodes),
            },
            "prefill_wall_s": [t.wall_s for t in prefills],
            "decode_wall_s": [t.wall_s for t in decodes],
        }
        aggregate_tok_s = None
        if spec.clients > 0:
            _check(cancelled)
            aggregate_tok_s, details["aggregate"] = self._aggregate(client, rng, cancelled)
            details["parts_s"]["aggregate"] = sum(details["aggregate"]["rounds_wall_s"])
        agent_tok_s = None
        if spec.agent_turns > 0:
            _check(cancelled)
            agent_tok_s, details["agent"] = self._agent(client, usable_context, cancelled)
            details["parts_s"]["agent"] = sum(details["agent"]["sessions_s"])
        details["workload"] = spec.to_json()
        details["workload_s"] = client.clock() - began
        return WorkloadResult(
            prefill_tok_s=prefill_tok_s,
            prefill_prompt_tokens=prefills[0].prompt_tokens,
            decode_tok_s=statistics.median(decode_rates),
            ttft_s=statistics.median(t.ttft_s for t in decodes),
            aggregate_tok_s=aggregate_tok_s,
            agent_tok_s=agent_tok_s,
            details=details,
        )

    def _agent(
        self, client: EngineClient, usable_context: int, cancelled: Callable[[], bool]
    ) -> tuple[float, dict[str, Any]]:
        """Agent sessions one after the other: each one's generated tokens over its time."""
        messages = client.messages()
        results: list[SessionResult] = []
        for index in range(self.spec.agent_sessions):
            _check(cancelled)
            try:
                # shrunk to fit, a tenth of the context to spare: its sizes are estimates
                shape = self.spec.session(index)
                session = AgentSession.sized(shape, messages, usable_context * 9 // 10)
                results.append(session.run(messages))
            except SessionError as err:
                raise WorkloadError(str(err)) from None
        details = {
            "sessions_s": [r.session_s for r in results],
            "sessions_tok_s": [r.agent_tok_s for r in results],
            "sessions": [r.to_json() for r in results],
        }
        return statistics.median(r.agent_tok_s for r in results), details

    def _aggregate(
        self, client: EngineClient, rng: random.Random, cancelled: Callable[[], bool]
    ) -> tuple[float, dict[str, Any]]:
        """Rounds of `clients` streamed generations at once: completion tokens over wall time."""
        spec = self.spec
        prompts = [excerpt(rng, AGGREGATE_PROMPT_CHARS) for _ in range(spec.clients)]
        rates, walls = [], []
        with ThreadPoolExecutor(max_workers=spec.clients) as pool:
            for round_ in range(spec.aggregate_rounds):
                _check(cancelled)
                start = threading.Barrier(spec.clients)

                def one(
                    i: int, start: threading.Barrier = start, round_: int = round_
                ) -> StreamTiming:
                    start.wait()
                    seed = spec.seed + 100 * round_ + i
                    return client.stream(fresh_line() + prompts[i], spec.aggregate_tokens, seed)

                timings = list(pool.map(one, range(spec.clients)))
                wall_s = max(t.last_token for t in timings) - min(t.sent for t in timings)
                rates.append(sum(t.completion_tokens for t in timings) / wall_s)
                walls.append(wall_s)
        details = {"clients": spec.clients, "rounds_tok_s": rates, "rounds_wall_s": walls}
        return statistics.median(rates), details

    def prove_context(
        self, client: EngineClient, target_tokens: int, chars_per_token: float
    ) -> ContextProof:
        """Prove a context: a prompt of 95% of `target_tokens` or more (the engine's count), served.

        The prompt's length in characters is searched from the engine's own counts until it lands
        between 95% and the target, or the engine refuses a prompt that should fit. Each guess
        scales the longest prompt served so far by the density around it; where that leaves the
        bracket of served-too-short and refused lengths (the text's density changes inside the
        window), the bracket is halved instead.
        """
        need = int(PROOF_SHARE * target_tokens + 0.999)
        ceiling = target_tokens - 1  # one token of room to generate
        aim = (need + ceiling) // 2
        seed = self.spec.seed + 1
        # the same seed gives the same start: a longer excerpt extends a shorter one
        body_text = excerpt(random.Random(seed), int(2 * aim * chars_per_token) + 2000)
        served: list[tuple[int, int]] = []  # (characters, prompt tokens), each under `need`
        refused: int | None = None  # the fewest characters the engine refused
        chars = max(1, int(aim * chars_per_token))
        for _attempt in range(PROOF_ATTEMPTS):
            if chars > len(body_text):
                body_text = excerpt(random.Random(seed), 2 * chars)
            status, body = client.complete(fresh_line() + body_text[:chars], 1)
            if status == 200:
                tokens = int(body["usage"]["prompt_tokens"])
                if tokens >= need:
                    return ContextProof(
                        target_tokens,
                        tokens,
                        True,
                        Text(
                            "a prompt of {tokens} tokens was served ({share:.0%} of {target})",
                            tokens=tokens,
                            share=tokens / target_tokens,
                            target=target_tokens,
                        ),
                    )
                served.append((chars, tokens))
            elif body.get("error", {}).get("code") == "context_length_exceeded":
                refused = chars if refused is None else min(refused, chars)
            else:
                message = body.get("error", {}).get("message", str(body)[:300])
                return ContextProof(
                    target_tokens, max(served)[1] if served else 0, False,
                    Text("the engine answered {status}: {message}", status=status, message=message),
                )  # fmt: skip
            chars = _next_proof_chars(served, refused, aim)
        last_tokens = max(served)[1] if served else 0
        return ContextProof(
            target_tokens,
            last_tokens,
            False,
            Text(
                "no prompt between {low} and {high} tokens was served (last: {last})",
                low=need,
                high=ceiling,
                last=last_tokens,
            ),
        )


def _next_proof_chars(served: list[tuple[int, int]], refused: int | None, aim: int) -> int:
    """The next prompt length of a context proof, in characters, aimed at `aim` tokens."""
    if not served:
        assert refused is not None
        return max(1, int(refused * REFUSED_SHRINK))
    longest = max(served)
    below = [point for point in served if point[0] < longest[0]]
    if below:  # the density just under the longest prompt, not the average from its start
        nearest = max(below)
        chars_per_token = (longest[0] - nearest[0]) / max(1, longest[1] - nearest[1])
    else:
        chars_per_token = longest[0] / max(1, longest[1])
    # never past twice the longest served: a density from two close counts can be far off
    step = max(1, int((aim - longest[1]) * chars_per_token))
    guess = longest[0] + min(longest[0], step)
    if refused is None:
        return guess
    if longest[0] < guess < refused:
        return guess
    return (longest[0] + refused) // 2


def warm_up_tokens(engine_config: dict[str, Any]) -> int:
    """Prompt tokens of the warm-up: enough to take the prefill path the workload's prompts take
    (`prefill_stream_min_tokens`, from /v1/stats), never more than one prefill chunk."""
    stream_min = int(engine_config.get("prefill_stream_min_tokens") or 0)
    chunk = int(engine_config.get("prefill_chunk_tokens") or WARMUP_MIN_TOKENS)
    return max(1, min(chunk, max(WARMUP_MIN_TOKENS, stream_min)))


def _check(cancelled: Callable[[], bool]) -> None:
    if cancelled():
        raise WorkloadError("cancelled")
