"""A loading engine's /health: the phase it is in, the native kernel's build among them, and a
build that fails ending the load with the compiler's error (a real `moelab serve` process)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from moelab.engine.process.launch import get_json, start_engine, stop_engine
from moelab.engine.synth_checkpoint import synthesize
from moelab.kernels.native_build import COMPILING
from tests.daemon.conftest import free_port, wait_for
from tests.kernels.native_build_procs import fake_compiler


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(tmp_path_factory.mktemp("model"), preset="tiny", routing_skew=1.0, seed=3)


def test_the_build_shows_in_health_and_its_failure_ends_the_load(
    model: Path, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    # a compiler that runs until the test opens its gate, then fails as a broken toolchain does
    env = fake_compiler(
        tmp_path / "c++",
        f"while [ ! -e {gate} ]; do sleep 0.1; done\n"
        "echo 'cpu_experts.cpp:1:1: error: simulated compiler failure' >&2\nexit 1\n",
    )
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # no build of the kernel there yet
    flags = ["--model-path", str(model), "--port", str(free_port()), "--device", "cpu",
             "--moe-cpu-kernel", "native"]  # fmt: skip
    engine = start_engine(flags, tmp_path / "engine.log", env=env)

    def health_when(ready: Callable[[dict], bool], what: str) -> dict:
        def check() -> dict | None:
            body = get_json(engine.base_url + "/health")
            return body if body and ready(body) else None

        return wait_for(check, 300, what)

    try:
        body = health_when(lambda b: b.get("phase") == COMPILING, "the build's phase")
        assert body["status"] == "loading" and body["total_bytes"] > 0, body
        gate.touch()
        body = health_when(lambda b: b["status"] != "loading", "the end of the load")
        assert body["status"] == "error", body
        assert "simulated compiler failure" in body["error"], body
        log = Path(engine.log_path).read_text()
        assert "compiling the native kernel" in log
        assert "simulated compiler failure" in log and "loading failed" in log
    finally:
        gate.touch()
        stop_engine(engine)
