"""Fixtures of the benchmark tests: the demo checkpoint and in-process daemons with their app."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from moelab.console.main import build_app
from moelab.daemon.measure import Reading
from moelab.daemon.models import ModelRoot
from moelab.daemon.service import Daemon, DaemonConfig
from moelab.engine.model.spec import ModelSpec


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_moe checkpoint written by the real `moelab synth` (the daemon's demo)."""
    out = tmp_path_factory.mktemp("models") / "demo-tiny"
    subprocess.run(
        [sys.executable, "-m", "moelab.engine.cli", "synth", "--arch", "qwen3_moe", "--preset",
         "tiny", "--routing-skew", "1.0", "--seed", "0", "--out", str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


def record_fresh_rates(daemon: Daemon, model: Path) -> None:
    """A `moelab bench bw` reading at the model's expert size, as if measured a moment ago."""
    spec = ModelSpec.from_dir(model)
    inventory = daemon.hardware.inventory(max_age_s=3600.0)
    params = {"hidden": spec.hidden_size, "intermediate": spec.moe_intermediate_size,
              "threads": 1, "experts": 1, "kernel": "native"}  # fmt: skip
    daemon.hardware.record(
        [Reading("cpu_experts", 2.5, "GB/s", params)], "moelab bench bw", inventory
    )


@contextmanager
def running_app(data_dir: Path, models: Path) -> Iterator[tuple[Daemon, TestClient]]:
    """A daemon over `data_dir` and its app with the lifespan running, called from loopback."""
    daemon = Daemon(
        DaemonConfig(
            data_dir=data_dir,
            model_roots=(ModelRoot(models, "--models-dir"),),
            write_demo=False,
        )
    )
    app = build_app(daemon)
    client = TestClient(app, base_url="http://127.0.0.1", client=("127.0.0.1", 50123))
    with client:
        yield daemon, client
