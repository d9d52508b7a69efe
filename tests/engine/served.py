"""A real `moelab serve` process on a free port, for the tests that talk to one over HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx

from moelab.engine.model.spec import ModelSpec
from moelab.engine.process.launch import EngineProcess, start_engine, stop_engine, wait_ready
from tests.ports import free_port


def serve(model: Path, tmp_path: Path, *flags: str) -> EngineProcess:
    """`moelab serve` on `model` with a 1 GiB device budget and its bank under `tmp_path`, then
    `flags`, once it is ready; its log is tmp_path / engine-PORT.log."""
    port = free_port()
    flags = ("--model-path", str(model), "--port", str(port), "--device-memory", "1GiB",
             "--bank-dir", str(tmp_path / "bank"), *flags)  # fmt: skip
    engine = start_engine(list(flags), tmp_path / f"engine-{port}.log")
    try:
        wait_ready(engine, timeout_s=120)
    except BaseException:
        stop_engine(engine)
        raise
    return engine


def assert_offloaded_experts_serve(engine: EngineProcess, model: Path, fmt: str, n: int) -> dict:
    """A greedy completion of `n` tokens from `engine`, whose expert slots hold `fmt` at its own
    bytes and some of the experts, not all; the stats' experts section."""
    body = {"prompt": "The expert bank holds", "max_tokens": n, "temperature": 0}
    r = httpx.post(engine.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == n
    experts = httpx.get(engine.base_url + "/v1/stats").json()["experts"]
    spec = ModelSpec.from_dir(model)
    assert experts["dtype"] == fmt and experts["slot_bytes"] == spec.expert_bytes_as(fmt)
    assert 0 < experts["slots"] < spec.experts_total
    assert sum(layer["reads"] for layer in experts["layers"]) > 0
    return experts
