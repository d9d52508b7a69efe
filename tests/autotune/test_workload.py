"""The workload against a fake OpenAI server whose speeds are known, and a workload
sized to a duration there."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from moelab.autotune.client import EngineClient
from moelab.autotune.sizing import calibrate, size_workload
from moelab.autotune.trial import TrialResult
from moelab.autotune.workload import (
    WARMUP_GENERATED_TOKENS,
    Workload,
    WorkloadResult,
    WorkloadSpec,
    corpus_paragraphs,
    excerpt,
)

PREFILL_S_PER_TOKEN = 0.0005  # 2,000 tok/s
DECODE_S_PER_TOKEN = 0.01  # 100 tok/s per request, any number of requests at once
CHARS_PER_TOKEN = 4
CONTEXT = 3000


class FakeServer:
    """/v1/completions that takes a known time per prompt token and per generated token,
    `speed` times faster than the module's figures, plus `request_s` per request; the first
    `cold_requests` requests take `cold_s` longer (kernels compiled on first use)."""

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

    async def completions(self, request: Request):
        body = await request.json()
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        self.prompts.append(prompt)
        self.max_tokens.append(max_tokens)
        cold = len(self.prompts) <= self.cold_requests
        await asyncio.sleep(self.request_s + (self.cold_s if cold else 0.0))
        tokens = max(1, self.tokens_of(prompt))
        if tokens + max_tokens > CONTEXT:
            return JSONResponse(
                {"error": {"message": "too long", "code": "context_length_exceeded"}}, 400
            )
        usage = {"prompt_tokens": tokens, "completion_tokens": max_tokens}
        if not body.get("stream"):
            await asyncio.sleep(tokens * self.prefill_s_per_token)
            return JSONResponse({"choices": [{"text": "x"}], "usage": usage})

        async def chunks():
            await asyncio.sleep(tokens * self.prefill_s_per_token)
            held = []
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(self.decode_s_per_token)
                chunk = f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n"
                if self.burst:
                    held.append(chunk)
                else:
                    yield chunk
            for chunk in held:
                yield chunk
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")


@pytest.fixture
def serve() -> Iterator:
    servers = []

    def start(fake: FakeServer) -> str:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        app = Starlette(routes=[Route("/v1/completions", fake.completions, methods=["POST"])])
        server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.01)
        servers.append(server)
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.should_exit = True


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
def test_figures_match_the_speeds_of_the_server(serve, burst: bool) -> None:
    fake = FakeServer(burst=burst)
    client = EngineClient(serve(fake), timeout_s=30)
    workload = Workload(SPEC)
    chars = workload.warm_up(client, {})
    assert chars == pytest.approx(CHARS_PER_TOKEN, rel=0.05)
    result = workload.run(client, CONTEXT, chars)
    assert result.prefill_prompt_tokens == pytest.approx(1024, rel=0.02)
    assert result.details["prompt_chars_per_token"] == pytest.approx(CHARS_PER_TOKEN, rel=0.01)
    # the seconds the workload took: its parts, each at the server's known speeds
    parts = result.details["parts_s"]
    assert 0.9 < sum(parts.values()) / result.details["workload_s"] <= 1.0
    assert parts["prefill"] >= 2 * 1024 * PREFILL_S_PER_TOKEN
    assert parts["decode"] >= 3 * 39 * DECODE_S_PER_TOKEN
    assert parts["aggregate"] >= 2 * 29 * DECODE_S_PER_TOKEN
    # a busy test machine only slows the client down: the bounds are tight above, loose below
    assert 0.5 < result.prefill_tok_s * PREFILL_S_PER_TOKEN < 1.15
    # chunks held back and sent in one burst do not make decode look faster than it is
    assert 0.6 < result.decode_tok_s * DECODE_S_PER_TOKEN < 1.15
    assert 0.5 < result.aggregate_tok_s * DECODE_S_PER_TOKEN / 4 < 1.15
    assert len(result.details["aggregate"]["rounds_tok_s"]) == 2


def test_every_trial_sends_the_same_text_behind_a_fresh_first_line(serve) -> None:
    fake = FakeServer()
    client = EngineClient(serve(fake), timeout_s=30)
    spec = WorkloadSpec(prefill_tokens=64, prefill_requests=1, decode_requests=2, decode_tokens=2)
    for _trial in range(2):
        Workload(spec).run(client, CONTEXT, 4.0)
    first, second = fake.prompts[:3], fake.prompts[3:]
    assert [p.split("\n", 1)[1] for p in first] == [p.split("\n", 1)[1] for p in second]
    heads = [p.split("\n", 1)[0] for p in fake.prompts]
    assert len(set(heads)) == len(heads), "no two prompts share a first line"


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
def test_the_warm_up_is_one_short_request(serve, config: dict, tokens: int) -> None:
    # long enough for the engine's streamed prefill path, never more than one prefill chunk
    fake = FakeServer()
    client = EngineClient(serve(fake), timeout_s=30)
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


def test_a_workload_sized_to_a_duration_lasts_about_that_long(serve) -> None:
    specs = {}
    for speed in (1.0, 4.0):
        client = EngineClient(serve(FakeServer(speed=speed)), timeout_s=30)
        calibration = calibration_trial(client, MINIMUM)
        sizing = size_workload(MINIMUM, calibration, TARGET_S)
        assert sizing.measured_s < TARGET_S / 2
        assert sizing.expected_s == pytest.approx(TARGET_S, rel=0.15)
        # a busy test machine only makes it longer: tight below, loose above
        assert 0.8 * TARGET_S < run_sized(client, sizing.spec) < 1.5 * TARGET_S, sizing
        specs[speed] = sizing.spec
    slow, fast = specs[1.0], specs[4.0]
    assert fast.decode_tokens * fast.decode_requests > 2 * slow.decode_tokens * slow.decode_requests
    assert fast.prefill_requests > slow.prefill_requests >= MINIMUM.prefill_requests


def test_a_cold_server_with_per_request_costs_is_sized_from_the_warm_stage(serve) -> None:
    # as on an H200: the first requests compile kernels (the warm-up does not reach them all),
    # and every request costs a time that does not grow with its tokens
    fake = FakeServer(speed=4.0, request_s=0.02, cold_requests=3, cold_s=0.3)
    client = EngineClient(serve(fake), timeout_s=30)
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
    assert 0.85 * TARGET_S < second["workload_s"] < 1.5 * TARGET_S, sizing.reason
    # sized from that warm stage, a later trial lasts the target (a busy machine only adds)
    assert 0.85 * TARGET_S < run_sized(client, sizing.spec) < 1.5 * TARGET_S, sizing.reason


def uneven_tokens(text: str) -> int:
    """A tokenizer whose density varies along the corpus: a token per 6 ASCII characters, one
    per character of anything else (the Japanese prose)."""
    ascii_chars = sum(1 for c in text if c.isascii())
    return ascii_chars // 6 + len(text) - ascii_chars


def test_the_long_prompt_is_cut_to_the_engines_count_of_tokens(serve) -> None:
    # the warm-up's short prompt is no guide to the long one's density: the calibration trial
    # corrects each cut by the engine's count of the ones before it
    fake = FakeServer(tokens_of=uneven_tokens)
    client = EngineClient(serve(fake), timeout_s=30)
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


def test_a_context_is_proven_by_a_prompt_of_95_percent_of_it(serve) -> None:
    client = EngineClient(serve(FakeServer()), timeout_s=30)
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


def test_a_context_is_proven_where_the_density_jumps_inside_the_window(serve) -> None:
    # 2,850-2,999 tokens is a span of only 50 characters here: a guess from the average density
    # overshoots past the context and back below the window, and must close in instead
    client = EngineClient(serve(FakeServer(tokens_of=dense_tail_tokens)), timeout_s=30)
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
