"""Fixtures of the profile tests: the demo checkpoint and a daemon over a real SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from moelab.daemon.service import Daemon
from tests.daemon.conftest import asgi_client, make_daemon, synth


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("models") / "demo-tiny")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Daemon]:
    """A started daemon (models found, inventory recorded) over its own data dir."""
    daemon = make_daemon(tmp_path_factory.mktemp("mgr-data"), demo_model.parent)
    daemon.start()
    yield daemon
    daemon.close()


@pytest.fixture(scope="module")
def local(daemon: Daemon) -> TestClient:
    """A client on this machine (loopback: control without a token)."""
    return asgi_client(daemon, "127.0.0.1", "127.0.0.1:1901")


@pytest.fixture(scope="module")
def viewer(daemon: Daemon) -> TestClient:
    """A client elsewhere on the LAN without the token (read-only)."""
    return asgi_client(daemon, "192.168.7.50", "127.0.0.1:1901")
