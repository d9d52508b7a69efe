"""Fixtures of the console tests: an in-process daemon holding a recorded engine, and clients that
are a browser on the machine itself, a LAN viewer, and a LAN viewer logged in with the token."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from moelab.daemon.schema import Server
from moelab.daemon.service import Daemon
from moelab.daemon.telemetry import Compactor, write_rows
from tests.daemon.conftest import asgi_client, make_daemon, synth

DATA = Path(__file__).parent / "data"
LAN_HOST = "mgr.lan:1901"
LOOPBACK_HOST = "127.0.0.1:1901"


def recorded_stats() -> list[dict[str, Any]]:
    """Two /v1/stats bodies of a real `moelab serve` on the demo model, 1.5 s apart, under load
    (their `experts.miss_cost` is from a later run of the same model: the recorded engine did
    not fit one yet)."""
    return [json.loads((DATA / f"demo-stats-{i}.json").read_text()) for i in (1, 2)]


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("models") / "demo-tiny")


@dataclass(frozen=True)
class Recorded:
    """The server rows the recorded fixture made: one "running", one that crashed."""

    running_id: int
    crashed_id: int


def record_engine(
    daemon: Daemon,
    model: Path,
    name: str = "recorded-demo",
    port: int = 8199,
    host: str = "127.0.0.1",
    flags: tuple[str, ...] = ("--device", "cpu"),
) -> Recorded:
    """A server row whose telemetry is the recorded bodies, as the sampler would have stored
    them (with a picks row), plus a crashed server with its exit code and last log lines."""
    first, second = recorded_stats()
    now = time.time()
    log = daemon.data_dir / "logs" / "recorded.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("engine ready in 1.0 s\n")
    with daemon.store.session() as session:
        running = Server(
            name=name, model=str(model), flags=[*flags, "--port", str(port)],
            host=host, port=port, device="cpu", status="running", log_path=str(log),
            created=now - 120, started=now - 120, ready=now - 100,
            last_stats=second, last_stats_time=now - 1,
        )  # fmt: skip
        crashed = Server(
            name="crashed-demo", model=str(model), flags=["--port", "8198"], host="127.0.0.1",
            port=8198, device="cpu", status="crashed", log_path=str(log), created=now - 60,
            started=now - 60, stopped=now - 50, exit_code=3,
            log_tail="Traceback (most recent call last):\nRuntimeError: out of memory",
        )  # fmt: skip
        session.add_all([running, crashed])
        session.flush()
        ids = Recorded(running.id, crashed.id)
    compactor = Compactor(fresh=True, picks_every_s=1.0)
    rows = compactor.ingest(first, now - 20) + compactor.ingest(second, now - 2)
    write_rows(daemon.store, ids.running_id, rows)
    return ids


@pytest.fixture(scope="session")
def console_daemon(
    tmp_path_factory: pytest.TempPathFactory, demo_model: Path
) -> Iterator[tuple[Daemon, Recorded]]:
    daemon = make_daemon(
        tmp_path_factory.mktemp("console-data"),
        demo_model.parent,
        host="0.0.0.0",
        allow_hosts=("mgr.lan",),
    )
    daemon.start()
    yield daemon, record_engine(daemon, demo_model)
    daemon.close()


@pytest.fixture(scope="session")
def daemon(console_daemon: tuple[Daemon, Recorded]) -> Daemon:
    return console_daemon[0]


@pytest.fixture(scope="session")
def recorded(console_daemon: tuple[Daemon, Recorded]) -> Recorded:
    return console_daemon[1]


def lan_client(daemon: Daemon, address: str = "192.168.7.50") -> TestClient:
    return asgi_client(daemon, address, LAN_HOST)


def local_client(daemon: Daemon) -> TestClient:
    return asgi_client(daemon, "127.0.0.1", LOOPBACK_HOST)


def logged_in_client(daemon: Daemon) -> TestClient:
    client = lan_client(daemon, "192.168.7.51")
    reply = client.post(
        "/api/auth/login",
        json={"token": daemon.token},
        headers={"Origin": f"http://{LAN_HOST}"},
    )
    assert reply.status_code == 200, reply.text
    return client


MODES = ("this-machine", "lan-read-only", "lan-logged-in")


def client_for(daemon: Daemon, mode: str) -> TestClient:
    return {
        "this-machine": local_client,
        "lan-read-only": lan_client,
        "lan-logged-in": logged_in_client,
    }[mode](daemon)
