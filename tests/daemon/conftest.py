"""Fixtures of the daemon tests: the demo checkpoint, in-process daemons, real `mgr` processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from moelab.console.main import build_app
from moelab.daemon.models import ModelRoot
from moelab.daemon.retention import Retention
from moelab.daemon.service import Daemon, DaemonConfig
from tests.ports import free_port


def synth(out: Path, *extra: str) -> Path:
    """A tiny qwen3_moe checkpoint written by the real `moelab synth`."""
    subprocess.run(
        [sys.executable, "-m", "moelab.engine.cli", "synth", "--arch", "qwen3_moe", "--preset",
         "tiny", "--routing-skew", "1.0", "--seed", "0", "--out", str(out), *extra],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("models") / "demo-tiny")


def make_daemon(data_dir: Path, models: Path | None, **config: Any) -> Daemon:
    """A daemon that looks for models only in `models` (never in this machine's ~/models)."""
    roots = (ModelRoot(models, "--models-dir"),) if models is not None else ()
    return Daemon(
        DaemonConfig(
            data_dir=data_dir,
            model_roots=roots,
            write_demo=config.pop("write_demo", False),
            **config,
        )
    )


def asgi_client(daemon: Daemon, address: str, host: str) -> TestClient:
    """An in-process client whose requests come from `address` and name `host` in Host."""
    return TestClient(build_app(daemon), base_url=f"http://{host}", client=(address, 50123))


@pytest.fixture(scope="session")
def session_daemon(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Daemon]:
    """One daemon over a real SQLite file, bound (in its config) to all interfaces."""
    daemon = make_daemon(
        tmp_path_factory.mktemp("mgr-data"),
        demo_model.parent,
        host="0.0.0.0",
        allow_hosts=("mgr.lan",),
        retention=Retention(),
    )
    daemon.start()
    yield daemon
    daemon.close()


# ---- real mgr processes ----------------------------------------------------------------------


@dataclass
class MgrProcess:
    """A running `mgr` and how to talk to it."""

    process: subprocess.Popen
    data_dir: Path
    port: int
    host: str
    token: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        return http(method, self.url + path, body, headers)

    def get(self, path: str) -> Any:
        status, body = self.request("GET", path)
        assert status == 200, (path, status, body)
        return body

    def post(self, path: str, body: Any = None, expect: tuple[int, ...] = (200, 201, 202)) -> Any:
        status, reply = self.request("POST", path, body)
        assert status in expect, (path, status, reply)
        return reply

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def mgr_env(home: Path) -> dict[str, str]:
    """An environment where ~/models and the HF cache are empty folders of the test's own. The
    user's cache folder stays the real one: the native CPU kernel's build there (kernels/
    native_build.py, keyed by its source) serves every engine, where an empty home would
    compile it again for each test's engines (a minute or more a build on two cores)."""
    env = dict(os.environ)
    env.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    env.update(HOME=str(home), HF_HOME=str(home / "hf"), PYTHONUNBUFFERED="1")
    env.pop("HF_HUB_CACHE", None)
    return env


def start_mgr(
    data_dir: Path,
    *extra: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    home: Path | None = None,
    wait: bool = True,
) -> MgrProcess:
    """Start `mgr` as its own process and wait until its API answers."""
    port = port or free_port()
    home = home or data_dir.parent / "home"
    home.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / f"mgr-{port}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moelab.console.main", "--host", host, "--port", str(port),
             "--data-dir", str(data_dir), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=mgr_env(home),
        )  # fmt: skip
    mgr = MgrProcess(process, data_dir, port, host, "", log_path)
    if not wait:
        return mgr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"mgr exited with {process.returncode}: {mgr.output()}")
        try:
            status, _ = mgr.request("GET", "/api/status")
            if status == 200:
                break
        except OSError:
            pass
        time.sleep(0.05)
    else:
        mgr.kill()
        raise AssertionError(f"mgr did not answer within 30 s: {mgr.output()}")
    mgr.token = (data_dir / "control-token").read_text().strip()
    return mgr


def wait_for(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.2) -> Any:
    """Poll until `predicate()` returns something truthy; fail with `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target
