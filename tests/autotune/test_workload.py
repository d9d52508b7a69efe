"""The workload against a fake OpenAI engine whose speeds are known, and a workload sized to a
duration there.

The fake engine answers in-process (httpx.MockTransport) on the requesting thread, and its time is
virtual (`VirtualTime`, the client's clock): it takes exactly its stated seconds per prompt token
and per generated token, so every figure the workload measures is known to the bit and no busy
test machine changes it.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import pytest

from moelab.autotune.client import EngineClient
from moelab.autotune.modes import MODES
from moelab.autotune.sizing import calibrate, size_workload
from moelab.autotune.trial_record import TrialResult
from moelab.autotune.workload import (
    WARMUP_GENERATED_TOKENS,
    Workload,
    WorkloadResult,
    WorkloadSpec,
)
from moelab.engine.bench.agent_session import SessionShape
from moelab.engine.model.corpus import corpus_paragraphs, excerpt

PREFILL_S_PER_TOKEN = 0.0005  # 2,000 tok/s
DECODE_S_PER_TOKEN = 0.01  # 100 tok/s per request, any number of requests at once
CHARS_PER_TOKEN = 4
CONTEXT = 3000


class VirtualTime:
    """Seconds that pass only as the fake engine serves, each thread's as it receives.

    The thread that made it (the workload's) reads the latest time any thread has reached: it
    reads after its concurrent clients have all ended. Another thread (a concurrent client)
    starts at the making thread's time when it first reads, and goes on from its own since:
    concurrent requests take their time side by side, as the fake engine serves them."""

    def __init__(self) -> None:
        self._owner = threading.get_ident()
        self._owner_s = 0.0
        self._latest_s = 0.0
        self._local = threading.local()
        self._lock = threading.Lock()

    def now(self) -> float:
        if threading.get_ident() == self._owner:
            self._owner_s = max(self._owner_s, self._latest_s)
            return self._owner_s
        if not hasattr(self._local, "s"):
            self._local.s = self._owner_s
        return self._local.s

    def advance(self, seconds: float) -> None:
        """The calling thread's request takes `seconds` more."""
        later = self.now() + seconds
        if threading.get_ident() == self._owner:
            self._owner_s = later
        else:
            self._local.s = later
        with self._lock:
            self._latest_s = max(self._latest_s, later)


class FakeEngine:
    """/v1/completions that takes a known time per prompt token and per generated token,
    `speed` times faster than the module's figures, plus `request_s` per request; the first
    `cold_requests` requests take `cold_s` longer (kernels compiled on first use). /v1/messages
    the same, its prompt's tokens past the last request's prompt (where it begins with that)
    taken from a prefix cache."""

    def __init__(
        self,
        burst: bool = False,
        speed: float = 1.0,
        tokens_of: Callable[[str], int] | None = None,
        request_s: float = 0.0,
        cold_requests: int = 0,
        cold_s: float = 0.0,
    ) -> None:
        self.burst = burst  # hold every chunk back and send them at the end
        self.request_s = request_s
        self.cold_requests = cold_requests
        self.cold_s = cold_s
        self.tokens_of = tokens_of or (lambda text: len(text) // CHARS_PER_TOKEN)
        self.prompts: list[str] = []
        self.max_tokens: list[int] = []
        self.prefill_s_per_token = PREFILL_S_PER_TOKEN / speed
        self.decode_s_per_token = DECODE_S_PER_TOKEN / speed
        self.time = VirtualTime()
        self._lock = threading.Lock()
        self.last_prompt = ""  # the last Messages request's, which the prefix cache holds
        self.messages: list[tuple[int, int, int]] = []  # (prompt, cached, max_tokens) tokens

    def client(self) -> EngineClient:
        """A client of this engine, timed by its virtual time."""
        transport = httpx.MockTransport(self.route)
        return EngineClient("http://fake", timeout_s=30, clock=self.time.now, transport=transport)

    def route(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/messages"):
            return self.messages_api(request)
        return self.completions(request)

    def messages_api(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        parts = [json.dumps(body.get("system")), json.dumps(body.get("tools"))]
        parts += [json.dumps(m["content"]) for m in body["messages"]]
        prompt = "".join(parts)  # a request whose history grows begins with the one before it
        tokens = max(1, self.tokens_of(prompt))
        if request.url.path.endswith("/count_tokens"):
            return httpx.Response(200, json={"input_tokens": tokens})
        max_tokens = body["max_tokens"]
        if tokens + max_tokens > CONTEXT:
            error = {"type": "error", "error": {"type": "invalid_request_error", "message": "long"}}
            return httpx.Response(400, json=error)
        cached = self.tokens_of(self.last_prompt) if prompt.startswith(self.last_prompt) else 0
        self.last_prompt = prompt
        self.messages.append((tokens, cached, max_tokens))
        usage = {"input_tokens": tokens - cached, "cache_read_input_tokens": cached}

        def event(data: dict) -> bytes:
            return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()

        def events() -> Iterator[bytes]:
            self.time.advance(self.request_s + (tokens - cached) * self.prefill_s_per_token)
            yield event(
                {"type": "message_start", "message": {"usage": {**usage, "output_tokens": 0}}}
            )
            for i in range(max_tokens):
                if i:
                    self.time.advance(self.decode_s_per_token)
                delta = {"type": "text_delta", "text": "x"}
                yield event({"type": "content_block_delta", "index": 0, "delta": delta})
            yield event({"type": "message_delta", "usage": {**usage, "output_tokens": max_tokens}})
            yield event({"type": "message_stop"})

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    def completions(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        with self._lock:
            self.prompts.append(prompt)
            self.max_tokens.append(max_tokens)
            cold = len(self.prompts) <= self.cold_requests
        tokens = max(1, self.tokens_of(prompt))
        if tokens + max_tokens > CONTEXT:
            error = {"error": {"message": "too long", "code": "context_length_exceeded"}}
            return httpx.Response(400, json=error)
        usage = {"prompt_tokens": tokens, "completion_tokens": max_tokens}
        before_s = self.request_s + (self.cold_s if cold else 0.0)
        prefill_s = tokens * self.prefill_s_per_token
        if not body.get("stream"):
            self.time.advance(before_s + prefill_s)
            return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": usage})

        def chunks() -> Iterator[bytes]:
            # runs on the requesting thread as it reads: the time passes for that thread
            self.time.advance(before_s + prefill_s)
            held = []
            for i in range(max_tokens):
                if i:
                    self.time.advance(self.decode_s_per_token)
                chunk = f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n".encode()
                if self.burst:
                    held.append(chunk)
                else:
                    yield chunk
            yield from held
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=chunks(), headers={"content-type": "text/event-stream"})


SPEC = WorkloadSpec(
    prefill_tokens=1024,
    prefill_requests=2,
    decode_requests=3,
    decode_tokens=40,
    clients=4,
    aggregate_tokens=30,
    aggregate_rounds=2,
)


@pytest.mark.parametrize("burst", [False, True])
def test_figures_match_the_speeds_of_the_server(burst: bool) -> None:
    fake = FakeEngine(burst=burst)
    client = fake.client()
    workload = Workload(SPEC)
    chars = workload.warm_up(client, {})
    assert chars == pytest.approx(CHARS_PER_TOKEN, rel=0.05)
    result = workload.run(client, CONTEXT, chars)
    assert result.prefill_prompt_tokens == pytest.approx(1024, rel=0.02)
    assert result.details["prompt_chars_per_token"] == pytest.approx(CHARS_PER_TOKEN, rel=0.01)
    # the seconds the workload took: its parts, each at the engine's speeds, and nothing else
    details, parts = result.details, result.details["parts_s"]
    prefill_s = sum(details["prefill_prompt_tokens"]) * PREFILL_S_PER_TOKEN
    assert parts["prefill"] == pytest.approx(prefill_s)
    decodes = zip(details["decode_prompt_tokens"], details["decode_tokens"], strict=True)
    decode_s = sum(p * PREFILL_S_PER_TOKEN + (n - 1) * DECODE_S_PER_TOKEN for p, n in decodes)
    assert parts["decode"] == pytest.approx(decode_s)
    # a round of concurrent streams lasts as long as its longest one
    round_s = (
        max(fake.tokens_of(p) for p in fake.prompts[-8:]) * PREFILL_S_PER_TOKEN
        + (SPEC.aggregate_tokens - 1) * DECODE_S_PER_TOKEN
    )
    assert details["aggregate"]["rounds_wall_s"] == pytest.approx([round_s, round_s])
    assert sum(parts.values()) == pytest.approx(details["workload_s"])
    assert result.prefill_tok_s == pytest.approx(1 / PREFILL_S_PER_TOKEN)
    # chunks held back and sent in one burst do not make decode look faster than it is
    assert result.decode_tok_s == pytest.approx(1 / DECODE_S_PER_TOKEN)
    assert result.aggregate_tok_s == pytest.approx(SPEC.clients * SPEC.aggregate_tokens / round_s)
    assert len(result.details["aggregate"]["rounds_tok_s"]) == 2


def test_every_trial_sends_the_same_text_behind_a_fresh_first_line() -> None:
    fake = FakeEngine()
    client = fake.client()
    spec = WorkloadSpec(prefill_tokens=64, prefill_requests=1, decode_requests=2, decode_tokens=2)
    for _trial in range(2):
        Workload(spec).run(client, CONTEXT, 4.0)
    first, second = fake.prompts[:3], fake.prompts[3:]
    assert [p.split("\n", 1)[1] for p in first] == [p.split("\n", 1)[1] for p in second]
    heads = [p.split("\n", 1)[0] for p in fake.prompts]
    assert len(set(heads)) == len(heads), "no two prompts share a first line"


def test_agent_sessions_give_their_tokens_over_their_time_and_fit_the_context() -> None:
    fake = FakeEngine()
    client = fake.client()
    quick = MODES["quick"].workload_for(0, agent=True)
    spec = replace(quick, prefill_tokens=64, prefill_requests=1, decode_requests=1,
                   decode_tokens=2, agent_sessions=2)  # fmt: skip
    result = Workload(spec).run(client, CONTEXT, 4.0)
    agent = result.details["agent"]
    assert len(agent["sessions"]) == 2 and all(len(s["turns"]) == 6 for s in agent["sessions"])
    # the quick mode's session needs more than this engine's context: it was shrunk to fit
    assert SessionShape(6, 2048, (128, 1024), (10, 64)).context_tokens > CONTEXT
    assert all(prompt + reply <= CONTEXT for prompt, _, reply in fake.messages)
    # every turn's prompt but the first begins with the one before it: the cache holds that much
    turns = fake.messages[:6]  # the first session's
    assert turns[0][1] == 0 and all(cached > 0 for _, cached, _ in turns[1:])
    # a session's figure: its tokens over its time, each turn's new prompt tokens at the
    # prefill rate and its tokens after the first at the decode rate
    seconds = sum((p - c) * PREFILL_S_PER_TOKEN + (n - 1) * DECODE_S_PER_TOKEN
                  for p, c, n in turns)  # fmt: skip
    first = agent["sessions"][0]
    assert first["session_s"] == pytest.approx(seconds)
    assert first["agent_tok_s"] == pytest.approx(sum(n for _, _, n in turns) / seconds)
    assert result.agent_tok_s == pytest.approx(statistics.median(agent["sessions_tok_s"]))
    assert result.details["parts_s"]["agent"] == pytest.approx(sum(agent["sessions_s"]))


@pytest.mark.parametrize(
    ("config", "tokens"),
    [
        ({}, 32),  # an engine that does not say: a short prompt all the same
        ({"prefill_stream_min_tokens": 6, "prefill_chunk_tokens": 2048}, 32),
        ({"prefill_stream_min_tokens": 200, "prefill_chunk_tokens": 2048}, 200),
        ({"prefill_stream_min_tokens": 200, "prefill_chunk_tokens": 64}, 64),
        ({"prefill_stream_min_tokens": 6, "prefill_chunk_tokens": 2}, 2),
    ],
)
def test_the_warm_up_is_one_short_request(config: dict, tokens: int) -> None:
    # long enough for the engine's streamed prefill path, never more than one prefill chunk
    fake = FakeEngine()
    client = fake.client()
    Workload(WorkloadSpec(prefill_tokens=1024, prefill_chars=4096)).warm_up(client, config)
    assert len(fake.prompts) == 1 and fake.max_tokens == [WARMUP_GENERATED_TOKENS]
    assert len(fake.prompts[0]) // CHARS_PER_TOKEN == tokens


MINIMUM = WorkloadSpec(prefill_tokens=256, prefill_requests=2, decode_requests=2, decode_tokens=8)
TARGET_S = 2.0


def calibration_trial(client: EngineClient, minimum: WorkloadSpec) -> TrialResult:
    """A calibration trial's readings (its stages in one engine), as the trial runner records
    them."""
    chars_per_token = Workload(minimum).warm_up(client, {})

    def run(spec: WorkloadSpec) -> WorkloadResult:
        return Workload(spec).run(client, CONTEXT, chars_per_token)

    result = calibrate(minimum, TARGET_S, run)
    return TrialResult(
        ok=True, started=0.0, duration_s=0.0, prefill_tok_s=result.prefill_tok_s,
        decode_tok_s=result.decode_tok_s, details=result.details,
    )  # fmt: skip


def run_sized(client: EngineClient, spec: WorkloadSpec) -> float:
    """Seconds a later trial's workload of `spec` takes."""
    sized = Workload(spec)
    return sized.run(client, CONTEXT, sized.warm_up(client, {})).details["workload_s"]


def test_a_workload_sized_to_a_duration_lasts_about_that_long() -> None:
    specs = {}
    for speed in (1.0, 4.0):
        client = FakeEngine(speed=speed).client()
        calibration = calibration_trial(client, MINIMUM)
        sizing = size_workload(MINIMUM, calibration, TARGET_S)
        assert sizing.measured_s < TARGET_S / 2
        assert sizing.expected_s == pytest.approx(TARGET_S, rel=0.15)
        # a later trial's workload lasts what the sizing expected
        assert run_sized(client, sizing.spec) == pytest.approx(sizing.expected_s), sizing
        specs[speed] = sizing.spec
    slow, fast = specs[1.0], specs[4.0]
    assert fast.decode_tokens * fast.decode_requests > 2 * slow.decode_tokens * slow.decode_requests
    assert fast.prefill_requests > slow.prefill_requests >= MINIMUM.prefill_requests


def test_a_cold_server_with_per_request_costs_is_sized_from_the_warm_stage() -> None:
    # as on an H200: the first requests compile kernels (the warm-up does not reach them all),
    # and every request costs a time that does not grow with its tokens
    fake = FakeEngine(speed=4.0, request_s=0.02, cold_requests=3, cold_s=0.3)
    client = fake.client()
    calibration = calibration_trial(client, MINIMUM)
    sizing = size_workload(MINIMUM, calibration, TARGET_S)
    # the first estimate lasted under half the target: a second estimate ran before the sizing
    minimum, first, second = calibration.details["stages"]
    # the second stage ran what sizing from the cold minimum alone (as before) gives: meant to
    # last the target, warm it lasted a third of it (0.6 s of 2 s)
    alone = size_workload(MINIMUM, replace(calibration, details=minimum), TARGET_S)
    assert alone.expected_s == pytest.approx(TARGET_S, rel=0.15)
    assert first["workload"] == alone.spec.to_json()
    assert first["workload_s"] < TARGET_S / 2, sizing.reason
    assert second["workload_s"] == pytest.approx(TARGET_S, rel=0.15), sizing.reason
    # sized from that warm stage, a later trial lasts the target, as the sizing expected
    assert sizing.expected_s == pytest.approx(TARGET_S, rel=0.15), sizing.reason
    assert run_sized(client, sizing.spec) == pytest.approx(sizing.expected_s), sizing.reason


def uneven_tokens(text: str) -> int:
    """A tokenizer whose density varies along the corpus: a token per 6 ASCII characters, one
    per character of anything else (the Japanese prose)."""
    ascii_chars = sum(1 for c in text if c.isascii())
    return ascii_chars // 6 + len(text) - ascii_chars


def test_the_long_prompt_is_cut_to_the_engines_count_of_tokens() -> None:
    # the warm-up's short prompt is no guide to the long one's density: the calibration trial
    # corrects each cut by the engine's count of the ones before it
    fake = FakeEngine(tokens_of=uneven_tokens)
    client = fake.client()
    minimum = replace(MINIMUM, prefill_tokens=1000, prefill_requests=3)
    calibration = calibration_trial(client, minimum)
    counts = calibration.details["stages"][0]["prefill_prompt_tokens"]
    assert abs(counts[-1] - 1000) < abs(counts[0] - 1000)
    spec = size_workload(minimum, calibration, TARGET_S).spec
    sent = []
    for warm_up_count in (2.5, 6.0):  # every later trial sends the same, whatever it counted
        fake.prompts.clear()
        result = Workload(spec).run(client, CONTEXT, warm_up_count)
        assert result.details["prefill_prompt_tokens"] == pytest.approx([1000] * 3, rel=0.03)
        sent.append([p.split("\n", 1)[1] for p in fake.prompts])
    assert sent[0] == sent[1]


def test_a_context_is_proven_by_a_prompt_of_95_percent_of_it() -> None:
    client = FakeEngine().client()
    # start from a wrong guess of characters per token: the engine's count corrects it
    proof = Workload(SPEC).prove_context(client, CONTEXT, chars_per_token=2.5)
    assert proof.ok, proof
    assert 0.95 * CONTEXT <= proof.prompt_tokens < CONTEXT
    beyond = Workload(SPEC).prove_context(client, 2 * CONTEXT, chars_per_token=4.0)
    assert not beyond.ok and beyond.prompt_tokens < 0.95 * 2 * CONTEXT


def dense_tail_tokens(text: str) -> int:
    """A tokenizer whose density jumps inside the proof's window: a token per 6 characters for
    the first 16,200, then 3 per character (as where a cut lands in prose that splits into
    several byte tokens a character)."""
    thin = min(len(text), 16_200)
    return thin // 6 + 3 * (len(text) - thin)


def test_a_context_is_proven_where_the_density_jumps_inside_the_window() -> None:
    # 2,850-2,999 tokens is a span of only 50 characters here: a guess from the average density
    # overshoots past the context and back below the window, and must close in instead
    client = FakeEngine(tokens_of=dense_tail_tokens).client()
    for guess in (6.0, 5.0, 8.0, 1.5):  # 1.5: the first prompt a quarter of the aim
        proof = Workload(SPEC).prove_context(client, CONTEXT, chars_per_token=guess)
        assert proof.ok, (guess, proof)
        assert 0.95 * CONTEXT <= proof.prompt_tokens < CONTEXT


def test_excerpts_come_from_the_shipped_corpus() -> None:
    paragraphs = corpus_paragraphs()
    assert any("def " in p for p in paragraphs) and any("港" in p for p in paragraphs)
    text = excerpt(random.Random(1), 50_000)
    assert len(text) == 50_000, "long prompts wrap around the corpus"
    assert excerpt(random.Random(1), 300) == excerpt(random.Random(1), 300)
