"""A checkpoint's generation_config.json sets the sampling of requests that leave it out (as
vLLM's --generation-config auto): read and checked, applied under a request's own values, and off
with --generation-config off; a real server process for the end to end (with
--reasoning-parser's plumbing)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from moelab.engine.process.launch import stop_engine
from moelab.engine.serving import openai_api as api
from moelab.engine.synth_checkpoint import synthesize

from .served import serve


def _write(path, **fields) -> None:
    config = {"eos_token_id": 1, "do_sample": True, **fields}
    (path / "generation_config.json").write_text(json.dumps(config))


def test_the_sampling_fields_are_read_and_bad_ones_skipped_with_why(tmp_path, caplog):
    _write(tmp_path, temperature=0.6, top_p=0.95, top_k=20, min_p=0, repetition_penalty="high",
           max_new_tokens=100, num_beams=1)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="moelab.openai_api"):
        defaults = api.generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    assert "repetition_penalty" in caplog.text and "must be a number" in caplog.text
    _write(tmp_path, temperature=5.0, top_p=0.0)  # outside the API's ranges
    with caplog.at_level(logging.WARNING, logger="moelab.openai_api"):
        assert api.generation_defaults(tmp_path) == {}
    assert "temperature: must be at most 2.0" in caplog.text and "top_p" in caplog.text
    # Python's json reads NaN and Infinity, and NaN passes every range check by comparison
    _write(tmp_path, temperature=float("nan"), top_k=float("inf"))
    with caplog.at_level(logging.WARNING, logger="moelab.openai_api"):
        assert api.generation_defaults(tmp_path) == {}
    assert "temperature: must be a finite number, got nan" in caplog.text
    # no file, or a file that is not JSON: no defaults
    (tmp_path / "generation_config.json").unlink()
    assert api.generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert api.generation_defaults(tmp_path) == {}


def test_a_requests_own_values_win_over_the_defaults():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    parsed = api.parse_common({}, defaults=defaults)
    assert (parsed["temperature"], parsed["top_p"], parsed["top_k"]) == (0.6, 0.95, 20)
    assert parsed["min_p"] == 0.0 and parsed["repetition_penalty"] == 1.0  # OpenAI's
    own = api.parse_common({"temperature": 0, "top_k": -1, "top_p": None}, defaults=defaults)
    assert (own["temperature"], own["top_k"], own["top_p"]) == (0.0, 0, 0.95)
    assert api.parse_common({})["temperature"] == 1.0  # no defaults: OpenAI's


@pytest.fixture(scope="module")
def top_one_model(tmp_path_factory):
    """A checkpoint whose generation config keeps only the likeliest token (top_k 1)."""
    path = synthesize(tmp_path_factory.mktemp("genconfig"), preset="tiny", seed=23)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "top_k": 1,
                                                             "temperature": 0.7}))  # fmt: skip
    return path


def _texts(engine, n: int = 2, **fields) -> list[str]:
    body = {"prompt": "The harbour", "max_tokens": 16, **fields}
    return [httpx.post(engine.base_url + "/v1/completions", json=body, timeout=60).json()
            ["choices"][0]["text"] for _ in range(n)]  # fmt: skip


def test_a_server_applies_the_checkpoints_sampling_unless_told_not_to(top_one_model, tmp_path):
    engine = serve(top_one_model, tmp_path)
    try:
        greedy = _texts(engine, 1, temperature=0)[0]
        # unseeded and without sampling fields: top_k 1 from the checkpoint, every time greedy
        assert _texts(engine) == [greedy, greedy]
        # the request's own top_k (off) wins: unseeded draws at the checkpoint's temperature
        drawn = _texts(engine, top_k=-1)
        assert drawn[0] != drawn[1]
        log = Path(engine.log_path).read_text()
        assert "sampling defaults from generation_config.json: temperature 0.7, top_k 1" in log
    finally:
        stop_engine(engine)
    engine = serve(top_one_model, tmp_path, "--generation-config", "off",
                   "--reasoning-parser", "think")  # fmt: skip
    try:
        plain = _texts(engine)  # OpenAI's defaults: temperature 1, no top-k
        assert plain[0] != plain[1]
        # (and a chat message gets its reasoning field: a random model writes no <think>)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        reply = httpx.post(engine.base_url + "/v1/chat/completions", json=chat, timeout=60)
        message = reply.json()["choices"][0]["message"]
        assert "reasoning_content" in message and message["content"]
    finally:
        stop_engine(engine)
