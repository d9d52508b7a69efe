"""The workload's client against a fake OpenAI server whose speeds are known."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from moelab.autotune.workload import (
    EngineClient,
    Workload,
    WorkloadSpec,
    corpus_paragraphs,
    excerpt,
)

PREFILL_S_PER_TOKEN = 0.0005  # 2,000 tok/s
DECODE_S_PER_TOKEN = 0.01  # 100 tok/s per request, any number of requests at once
CHARS_PER_TOKEN = 4
CONTEXT = 3000


class FakeServer:
    """/v1/completions that takes a known time per prompt token and per generated token."""

    def __init__(self, burst: bool = False) -> None:
        self.burst = burst  # hold every chunk back and send them at the end
        self.prompts: list[str] = []

    async def completions(self, request: Request):
        body = await request.json()
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        self.prompts.append(prompt)
        tokens = max(1, len(prompt) // CHARS_PER_TOKEN)
        if tokens + max_tokens > CONTEXT:
            return JSONResponse(
                {"error": {"message": "too long", "code": "context_length_exceeded"}}, 400
            )
        usage = {"prompt_tokens": tokens, "completion_tokens": max_tokens}
        if not body.get("stream"):
            await asyncio.sleep(tokens * PREFILL_S_PER_TOKEN)
            return JSONResponse({"choices": [{"text": "x"}], "usage": usage})

        async def chunks():
            await asyncio.sleep(tokens * PREFILL_S_PER_TOKEN)
            held = []
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(DECODE_S_PER_TOKEN)
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
    chars = workload.warm_up(client)
    assert chars == pytest.approx(CHARS_PER_TOKEN, rel=0.01)
    result = workload.run(client, CONTEXT, chars)
    assert result.prefill_prompt_tokens == pytest.approx(1024, rel=0.02)
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


def test_a_context_is_proven_by_a_prompt_of_95_percent_of_it(serve) -> None:
    client = EngineClient(serve(FakeServer()), timeout_s=30)
    # start from a wrong guess of characters per token: the engine's count corrects it
    proof = Workload(SPEC).prove_context(client, CONTEXT, chars_per_token=2.5)
    assert proof.ok, proof
    assert 0.95 * CONTEXT <= proof.prompt_tokens < CONTEXT
    beyond = Workload(SPEC).prove_context(client, 2 * CONTEXT, chars_per_token=4.0)
    assert not beyond.ok and beyond.prompt_tokens < 0.95 * 2 * CONTEXT


def test_excerpts_come_from_the_shipped_corpus() -> None:
    paragraphs = corpus_paragraphs()
    assert any("def " in p for p in paragraphs) and any("港" in p for p in paragraphs)
    text = excerpt(random.Random(1), 50_000)
    assert len(text) == 50_000, "long prompts wrap around the corpus"
    assert excerpt(random.Random(1), 300) == excerpt(random.Random(1), 300)
