"""`moelab serve` as a real process: the OpenAI API, errors, streaming, limits, drain, metrics."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.process.launch import start_engine, stop_engine
from moelab.engine.synth_checkpoint import synthesize

from .served import serve

openai = pytest.importorskip("openai", reason="the openai client is a test dependency")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("served"), preset="tiny", routing_skew=1.0, seed=21)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    engine = serve(
        model,
        tmp_path_factory.mktemp("log"),
        "--moe-cache-rate",
        "0.5",
        "--served-model-name",
        "tiny-moe",
    )
    yield engine
    stop_engine(engine)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_models_advertises_the_usable_context(server, client):
    [m] = client.models.list().data
    assert m.id == "tiny-moe"
    health = httpx.get(server.base_url + "/health").json()
    assert m.model_extra["max_model_len"] == health["max_model_len"] <= 4096


def test_chat_and_completions_with_usage_from_the_tokenizer(server, client, model):
    tok = Tokenizer(model)
    messages = [{"role": "user", "content": "Tell me about the harbour town."}]
    chat = client.chat.completions.create(
        model="tiny-moe",
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt = tok.apply_chat_template(messages)
    assert chat.usage.prompt_tokens == len(tok.encode(prompt))
    assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"
    text = client.completions.create(
        model="tiny-moe",
        prompt="The harbour town",
        max_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert text.usage.prompt_tokens == len(tok.encode("The harbour town"))
    assert text.usage.completion_tokens == 9


def test_streaming_equals_non_streaming_and_reports_usage(server, client):
    kwargs = dict(
        model="tiny-moe",
        messages=[{"role": "user", "content": "朝の港は"}],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert "".join(pieces) == whole
    # every piece is whole characters: a multi-byte character is never split across chunks
    for piece in pieces:
        assert piece.encode("utf-8").decode("utf-8") == piece
        assert "\ufffd" not in piece or "\ufffd" in whole
    assert usage is not None and usage.completion_tokens == 40


def test_stop_strings_are_honoured(server, client):
    base = (
        client.completions.create(
            model="tiny-moe", prompt="The river", max_tokens=30, temperature=0
        )
        .choices[0]
        .text
    )
    stop = base[5:8]
    cut = client.completions.create(
        model="tiny-moe", prompt="The river", max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(server, client):
    kwargs = dict(
        model="tiny-moe", prompt="Cities grow", max_tokens=16, temperature=0.9, top_p=0.9, seed=123
    )
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_eight_concurrent_streams_match_running_alone(server, client):
    prompts = [f"Story {i}: the harbour" for i in range(8)]

    def run(prompt: str, stream: bool) -> str:
        if not stream:
            return (
                client.completions.create(
                    model="tiny-moe", prompt=prompt, max_tokens=20, temperature=0
                )
                .choices[0]
                .text
            )
        return "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="tiny-moe", prompt=prompt, max_tokens=20, temperature=0, stream=True
            )
            if c.choices
        )

    alone = [run(p, False) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: run(p, True), prompts))
    assert together == alone


def _post(server, path, body, **kw):
    return httpx.post(
        server.base_url + path,
        content=body if isinstance(body, bytes) else json.dumps(body),
        timeout=60,
        **kw,
    )


def test_errors_are_openai_json_and_name_the_field(server):
    r = _post(server, "/v1/completions", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _post(server, "/v1/completions", {"prompt": "x", "temperature": "hot"})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = _post(server, "/v1/chat/completions", {"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(server, "/v1/completions", {"prompt": "x", "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = _post(server, "/v1/completions", {"prompt": "x", "seed": 2**64, "temperature": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = _post(server, "/v1/completions", {"prompt": "x", "seed": -(2**63), "max_tokens": 2})
    assert r.status_code == 200  # the whole int64 range draws


def test_logit_bias_penalties_and_min_p_reach_the_sampler(server, client, model):
    tok = Tokenizer(model)
    token = tok.encode(" river")[0]
    forced = client.completions.create(model="tiny-moe", prompt="The harbour", max_tokens=4,
                                       temperature=0, logit_bias={str(token): 100})  # fmt: skip
    assert forced.choices[0].text == tok.decode([token] * 4)
    banned = client.completions.create(model="tiny-moe", prompt="The harbour", max_tokens=8,
                                       temperature=0, logit_bias={str(token): -100})  # fmt: skip
    assert token not in tok.encode(banned.choices[0].text)

    def penalized() -> str:
        return (
            client.chat.completions.create(
                model="tiny-moe",
                messages=[{"role": "user", "content": "Tell a story"}],
                max_tokens=12,
                temperature=0.8,
                seed=5,
                frequency_penalty=1.0,
                presence_penalty=0.5,
                extra_body={"repetition_penalty": 1.2, "min_p": 0.05},
            )
            .choices[0]
            .message.content
        )

    assert penalized() == penalized()  # seeded, and every adjustment accepted


def test_fields_that_would_change_the_answer_are_refused_not_ignored(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, extra, param in (
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 150}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": [5]}, "logit_bias"),
        ("/v1/completions", {"frequency_penalty": 3}, "frequency_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"min_p": 2}, "min_p"),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
    ):
        body = {**(chat if "chat" in path else {"prompt": "x", "max_tokens": 2}), **extra}
        r = _post(server, path, body)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)
    # their "off" values are fine
    off = {"logprobs": False, "top_logprobs": 0, "echo": False, "best_of": 1,
           "response_format": {"type": "text"}, "logit_bias": {}}  # fmt: skip
    assert _post(server, "/v1/chat/completions", {**chat, **off}).status_code == 200


def test_logprobs_in_chat_and_completions_streamed_or_not(server, client, model):
    tok = Tokenizer(model)
    tok_texts = {tok.token_text(i) for i in range(tok.vocab_size)}
    kwargs = dict(model="tiny-moe", messages=[{"role": "user", "content": "Tell a story"}],
                  max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})  # fmt: skip
    reply = client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 12
    for entry in content:
        # greedy: each token is the likeliest, its log probability the first of the three
        assert len(entry.top_logprobs) == 3 and entry.token == entry.top_logprobs[0].token
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode(errors="replace") == entry.token or "\ufffd" in entry.token
    # the tokens' bytes make the reply's text (random weights also pick bytes that make no
    # character: replaced, as the text has them)
    text = b"".join(bytes(e.bytes) for e in content).decode(errors="replace")
    assert text == reply.choices[0].message.content
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(**kwargs, stream=True)
                if c.choices and c.choices[0].logprobs]  # fmt: skip
    # the same tokens; their log probabilities to rounding (an expert run by the cache on one
    # request may run on the CPU workers on the next)
    again = [e for lp in streamed for e in lp.content]
    assert [(e.token, e.bytes) for e in again] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in again] == pytest.approx([e.logprob for e in content], abs=1e-4)
    # the legacy shape: tokens, their log probabilities, the top ones and each token's offset
    legacy = client.completions.create(model="tiny-moe", prompt="The harbour", max_tokens=8,
                                       temperature=0, logprobs=2)  # fmt: skip
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 2 and max(top.values()) == p
               for top, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # fmt: skip
    # each one a token's own text
    assert all(t in tok_texts for t in lp.tokens)
    # without the field, none
    plain = client.completions.create(model="tiny-moe", prompt="The harbour", max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_echo_gives_the_prompt_and_its_scores_before_the_completion(server, client, model):
    """echo (lm-evaluation-harness's way of scoring a text): the prompt's text first, with each
    prompt token's log probability given the ones before it (the first has none); max_tokens 0
    gives the prompt alone."""
    tok = Tokenizer(model)
    prompt = "The harbour was quiet that night"
    ids = tok.encode(prompt)
    scored = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=2)  # fmt: skip
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tok.token_text(i) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(p <= 0 for p in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    # with a completion: the prompt, then what the same request without echo gives
    kwargs = dict(model="tiny-moe", prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    plain = client.completions.create(**kwargs).choices[0]
    echoed = client.completions.create(**kwargs, echo=True).choices[0]
    assert echoed.text == prompt + plain.text
    assert echoed.logprobs.tokens == lp.tokens + plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-4
    )
    # streamed: the prompt's chunk first, then the completion's
    chunks = list(client.completions.create(**kwargs, echo=True, stream=True))
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]  # fmt: skip
    assert streamed == echoed.logprobs.tokens
    # a prompt of token ids is echoed as its text
    by_ids = client.completions.create(model="tiny-moe", prompt=ids, max_tokens=0, echo=True)
    assert by_ids.choices[0].text == tok.decode(ids)


def test_context_length_exceeded_gives_both_numbers(server):
    context = httpx.get(server.base_url + "/health").json()["max_model_len"]
    r = _post(server, "/v1/completions", {"prompt": list(range(1, 101)), "max_tokens": context})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert str(context) in error["message"] and str(100 + context) in error["message"]


def test_huge_bodies_do_not_hurt_the_server(server):
    body = json.dumps({"prompt": "word " * 6_000_000, "max_tokens": 1}).encode()  # ~30 MB
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # refused from its length, without encoding 30 MB (which took ~50 s on a 2-core machine)
    assert "at least" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", b"x" * (70 * 1024 * 1024))
    assert r.status_code == 413
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"


def test_client_disconnect_mid_stream_frees_kv(server):
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        timeout=60,
        content=json.dumps(
            {
                "prompt": "The harbour",
                "max_tokens": 3000,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
            }
        ),
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)

    def freed() -> bool:
        stats = httpx.get(server.base_url + "/v1/stats").json()
        return stats["kv"]["tokens_used"] == 0 and stats["requests"]["running"] == 0

    _until(freed, "the request to end and free its KV")
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_shared_prefix_is_reported_cached_in_usage_stats_and_metrics(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    system = {"role": "system", "content": "You answer questions about harbours. " * 12}

    def ask(question: str):
        return client.chat.completions.create(
            model="tiny-moe", messages=[system, {"role": "user", "content": question}],
            max_tokens=4, temperature=0,
        ).usage  # fmt: skip

    before = httpx.get(server.base_url + "/v1/stats").json()["kv"]["prefix_cache"]
    first, second = ask("Which is the deepest?"), ask("Which is the oldest?")
    # the second takes the system prompt's whole pages (16 tokens each) from the first
    assert second.prompt_tokens_details.cached_tokens >= 64
    assert second.prompt_tokens_details.cached_tokens % 16 == 0
    assert second.prompt_tokens_details.cached_tokens < second.prompt_tokens
    after = httpx.get(server.base_url + "/v1/stats").json()["kv"]["prefix_cache"]
    assert after["enabled"] and after["tokens_held"] > 0
    cached = first.prompt_tokens_details.cached_tokens + second.prompt_tokens_details.cached_tokens
    assert after["cached_tokens"] - before["cached_tokens"] == cached
    assert after["prompt_tokens"] - before["prompt_tokens"] == first.prompt_tokens + (
        second.prompt_tokens
    )
    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)
    }
    samples = {s.labels["source"]: s.value for s in families["moelab_prompt_tokens"].samples}
    assert samples["cached"] == after["cached_tokens"]


def test_stats_has_the_contract_fields(server, client):
    # a step's breakdown exists once a step ran, whichever tests ran before this one
    client.completions.create(model="tiny-moe", prompt="The", max_tokens=2)
    s = httpx.get(server.base_url + "/v1/stats").json()
    assert set(s["throughput"]) >= {
        "decode_tok_s_10s",
        "prefill_tok_s_10s",
        "decode_tok_s_60s",
        "prefill_tok_s_60s",
    }
    assert set(s["requests"]) >= {
        "running", "queued", "preempted", "paused", "completed", "ttft_mean_s", "ttft_p95_s"
    }  # fmt: skip
    assert set(s["memory"]["device"][0]) >= {
        "index",
        "total",
        "weights",
        "kv",
        "expert_cache",
        "prefill_buffer",
        "activations",
        "graphs",
        "other",
    }
    assert set(s["kv"]) >= {"tokens_total", "tokens_used", "tokens_peak", "max_context"}
    assert set(s["config"]) >= {"policy", "cpu_threads", "bp_gbps", "bh_gbps", "fetch_fraction"}
    e = s["experts"]
    assert set(e) >= {
        "num_layers",
        "num_experts",
        "top_k",
        "slots",
        "slot_bytes",
        "policy",
        "layers",
        "window_60s",
        "picks",
        "whatif",
        "hit_rate_60s",
        "miss_cost",
    }
    assert len(e["layers"]) == len(e["picks"]) == e["num_layers"]
    assert len(e["whatif"]) >= 20 and any(w["slots"] == e["slots"] for w in e["whatif"])
    assert set(s["breakdown"]) >= {"route", "copy", "gpu_experts", "cpu_experts", "other", "step_s"}


def test_metrics_parse_as_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)
    }
    assert "moelab_requests_completed" in families
    reads = families["moelab_expert_reads"].samples
    assert reads and all(s.labels["outcome"] in ("hits", "fills", "cpu") for s in reads)


def test_cache_resize_without_reloading(server):
    r = _post(server, "/v1/cache/resize", {"moe_cache_size": 20})
    assert r.status_code == 200 and r.json()["moe_cache_size"] == 20
    assert httpx.get(server.base_url + "/v1/stats").json()["experts"]["slots"] == 20
    r = _post(server, "/v1/cache/resize", {"moe_cache_size": 10**9})
    assert r.status_code == 200  # more slots than experts: everything resident
    r = _post(server, "/v1/cache/resize", {"kv_reserve_tokens": 10**9})
    assert r.status_code == 409 and "lower --kv-reserve-tokens" in r.json()["error"]["message"]
    r = _post(server, "/v1/cache/resize", {"moe_cache_size": 24})
    assert r.status_code == 200
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3}).status_code == 200


def test_a_cross_site_page_cannot_resize_the_cache_nor_reach_the_engine_by_another_name(server):
    def slots() -> int:
        return httpx.get(server.base_url + "/v1/stats").json()["experts"]["slots"]

    before = slots()
    # a page on another site posting a form-like body: no CORS preflight is asked for
    r = _post(
        server,
        "/v1/cache/resize",
        json.dumps({"moe_cache_size": before + 1}).encode(),
        headers={"Content-Type": "text/plain", "Origin": "http://evil.example",
                 "Sec-Fetch-Site": "cross-site"},
    )  # fmt: skip
    assert r.status_code == 403 and r.json()["error"]["code"] == "foreign_origin"
    assert slots() == before
    # DNS rebinding: the attacker's name resolved to this machine
    port = server.base_url.rsplit(":", 1)[1]
    body = {"prompt": "x", "max_tokens": 2}
    r = _post(server, "/v1/completions", body, headers={"Host": f"rebind.example:{port}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_host"
    assert _post(server, "/v1/completions", body, headers={"Host": f"localhost:{port}"}).is_success


def _until(check, what: str, timeout_s: float = 60.0):
    """Polls `check()` until it returns something truthy, and returns that; fails naming `what`
    after timeout_s, which only a hung engine reaches (each wait is for something it reports)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _first_token(response: httpx.Response):
    """A streamed completion's lines after its first token (so the request is running). Keep
    them while the request should run: dropped, they close the stream, which cancels it."""
    assert response.status_code == 200
    lines = response.iter_lines()
    next(line for line in lines if line.startswith("data: "))
    return lines


def test_queue_overflow_gets_429_with_a_retry_hint(model, tmp_path):
    """With one request running and one queued, a third is refused: here the first is a stream
    whose first token has come and which runs for thousands of tokens more, and the second is
    queued behind it once the engine says so."""
    engine = serve(model, tmp_path, "--max-running-requests", "1", "--max-queued-requests", "1")
    url = engine.base_url
    long = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    short = {"prompt": "x", "max_tokens": 4, "ignore_eos": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as running:
                lines = _first_token(running)
                queued = pool.submit(_post, engine, "/v1/completions", short)
                _until(
                    lambda: httpx.get(url + "/v1/stats").json()["requests"]["queued"] == 1,
                    "the second request to be queued",
                )
                rejected = _post(engine, "/v1/completions", short)
                lines.close()  # the first request is cancelled: the queued one runs
            assert queued.result(timeout=60).status_code == 200
        assert rejected.status_code == 429
        assert rejected.headers["retry-after"] and rejected.json()["error"]["code"] == "queue_full"
    finally:
        stop_engine(engine)


def test_a_queued_request_a_resize_leaves_too_long_ends_with_its_api_s_error(model, tmp_path):
    """Requests queued while a resize waits for the running one to end, whose prompt and
    max_tokens the smaller context cannot hold, end with a 400 in their API's shape as the
    resize is done, rather than wait for room that never comes."""
    # (with a set expert cache, the KV is what the resize reserves)
    flags = ["--max-running-requests", "1", "--moe-cache-size", "16", "--served-model-name", "m"]
    engine = serve(model, tmp_path, *flags)
    url = engine.base_url

    def requests() -> dict:
        return httpx.get(url + "/v1/stats").json()["requests"]

    long = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    openai_body = {"prompt": list(range(1, 11)), "max_tokens": 2000}
    anthropic_body = {"model": "m", "max_tokens": 2000, "messages": [{"role": "user",
                      "content": "Weather in Tromsø?"}]}  # fmt: skip
    try:
        assert httpx.get(url + "/health").json()["max_model_len"] > 2010
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as running:
                lines = _first_token(running)
                completion = pool.submit(_post, engine, "/v1/completions", openai_body)
                message = pool.submit(_post, engine, "/v1/messages", anthropic_body)
                _until(lambda: requests()["queued"] == 2, "both requests to be queued")
                resize = pool.submit(_post, engine, "/v1/cache/resize", {"kv_reserve_tokens": 256})
                _until(lambda: requests()["paused"], "the resize to hold the queue")
                lines.close()  # the running request is cancelled: the resize goes ahead
            resized = resize.result(timeout=60)
            assert resized.status_code == 200 and resized.json()["max_model_len"] < 2000
            context = resized.json()["max_model_len"]
            r = completion.result(timeout=60)
            error = r.json()["error"]
            assert r.status_code == 400 and error["code"] == "context_length_exceeded"
            assert f"= 2010 exceeds the usable context of {context} tokens" in error["message"]
            r = message.result(timeout=60)
            assert r.status_code == 400 and r.json()["type"] == "error"
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert f"exceeds the usable context of {context} tokens" in error["message"]
        stats = requests()
        assert stats["queued"] == stats["running"] == 0 and not stats["paused"]
        assert _post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 2}).is_success
    finally:
        stop_engine(engine)


def test_sigterm_drains_running_requests_then_exits(model, tmp_path):
    """A request running when SIGTERM comes (a stream whose first token has come) is finished,
    a request after the engine says it drains is refused (503, or the listener is already
    closed), and the process exits 0."""
    engine = serve(model, tmp_path)
    body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    def draining() -> bool:
        try:
            return httpx.get(engine.base_url + "/health", timeout=10).json()["draining"]
        except httpx.TransportError:
            return True  # the listener is closed: as refusing

    with httpx.stream("POST", engine.base_url + "/v1/completions", json=body, timeout=60) as r:
        lines = _first_token(r)
        engine.popen.send_signal(signal.SIGTERM)
        _until(draining, "the engine to say it drains")
        try:
            late = _post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        except httpx.TransportError:
            pass  # the listener may already be closed: also a refusal
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    assert engine.popen.wait(timeout=30) == 0
    # the process ends without the interpreter's teardown, its log written to the end
    log = Path(engine.log_path).read_text()
    last = log.rstrip().splitlines()[-1]
    assert last.endswith("moelab.serve: stopped: the HTTP server is down and the engine closed")
    # the heap was settled once the engine was ready (no full collection walks it mid-decode),
    # and nothing complained of leaked objects on the way out
    assert "moelab.worker: heap settled: a full collection took" in log and "leaked" not in log


def test_a_port_in_use_ends_the_process_with_one_clear_line(model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = start_engine(
            ["--model-path", str(model), "--port", str(port), "--device-memory", "1GiB",
             "--bank-dir", str(tmp_path / "bank")],
            tmp_path / "engine.log",
        )  # fmt: skip
        assert engine.popen.wait(timeout=60) == 1
    log = Path(engine.log_path).read_text()
    assert log.rstrip().splitlines()[-1] == f"moelab serve: could not listen on 127.0.0.1:{port}"


def test_api_key_and_loopback_only_control(model, tmp_path):
    engine = serve(model, tmp_path, "--api-key", "s3cret")
    try:
        assert _post(engine, "/v1/completions", {"prompt": "x"}).status_code == 401
        ok = _post(
            engine,
            "/v1/completions",
            {"prompt": "x", "max_tokens": 2},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert ok.status_code == 200
        assert httpx.get(engine.base_url + "/health").status_code == 200
    finally:
        stop_engine(engine)
