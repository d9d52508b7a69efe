"""`mgr` as users run it: starts fast without torch, one per data dir, clear start-up errors."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from moelab.console.main import _listen

from .conftest import free_port, mgr_env, start_mgr, wait_for


def test_importing_mgr_loads_neither_torch_nor_numpy() -> None:
    code = (
        "import sys, moelab.console.main, moelab.daemon.service; "
        "print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_engine_modules_the_manager_reads_are_torch_free_and_the_only_ones() -> None:
    """docs/architecture.md lists them; each imports with torch absent, and mgr, the benchmark
    and the profiles load no other engine module."""
    doc = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    listed = re.search(r"the only ones the\s+manager reads:((?:\s*`[\w/]+\.py`,?)+)", doc)
    assert listed is not None
    modules = sorted(m.replace("/", ".") for m in re.findall(r"`([\w/]+)\.py`", listed.group(1)))
    code = (
        "import importlib, sys\n"
        "sys.modules['torch'] = None  # `import torch` raises ImportError\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module('moelab.engine.' + name)\n"
        "import moelab.console.main, moelab.autotune.__main__, moelab.profiles.recommend\n"
        "print(sorted(m.split('.', 2)[2] for m in sys.modules if m.startswith('moelab.engine.')\n"
        "             and not hasattr(sys.modules[m], '__path__')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr(modules)


def test_mgr_prints_the_url_and_token(tmp_path: Path, demo_model: Path) -> None:
    # what keeps its start short is test_importing_mgr_loads_neither_torch_nor_numpy's
    mgr = start_mgr(tmp_path / "data", "--models-dir", str(demo_model.parent))
    try:
        output = wait_for(lambda: "control token" in mgr.output() and mgr.output(), 5, "banner")
        assert f"http://127.0.0.1:{mgr.port}/" in output
        assert mgr.token in output
        status = mgr.get("/api/status")
        assert status["data_dir"] == str((tmp_path / "data").resolve())
    finally:
        mgr.stop()
    # uvicorn shuts down cleanly, then re-raises the signal it caught, as Unix tools do
    assert mgr.process.returncode in (0, -signal.SIGTERM)


def test_a_second_mgr_on_the_same_data_dir_names_the_first(tmp_path: Path) -> None:
    first = start_mgr(tmp_path / "data")
    try:
        second = subprocess.run(
            [sys.executable, "-m", "moelab.console.main", "--data-dir", str(tmp_path / "data"),
             "--port", str(free_port())],
            capture_output=True, text=True, timeout=60, env=mgr_env(tmp_path / "home"),
        )  # fmt: skip
        assert second.returncode == 1
        assert f"in use by process {first.process.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.get("/api/status")["pid"] == first.process.pid
    finally:
        first.stop()
    # once the first is gone the data dir is free again, even after a SIGKILL
    again = start_mgr(tmp_path / "data")
    again.kill()
    third = start_mgr(tmp_path / "data")
    third.stop()


def test_a_port_in_use_is_reported_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "moelab.console.main", "--data-dir", str(tmp_path / "d"),
             "--port", str(port)],
            capture_output=True, text=True, timeout=60, env=mgr_env(tmp_path / "home"),
        )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_first_start_without_models_writes_the_demo_model(tmp_path: Path) -> None:
    mgr = start_mgr(tmp_path / "data")
    try:
        models = wait_for(
            lambda: mgr.get("/api/models")["models"], 300, "the demo model to be listed", 1.0
        )
        (demo,) = models
        assert demo["is_demo"] and demo["is_moe"]
        assert demo["path"] == str((tmp_path / "data" / "models" / "moelab-demo-tiny").resolve())
        assert "writing a demo model" in mgr.output()
        # written into the private data dir, private itself
        folder = Path(demo["path"])
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(folder.parent).st_mode) == 0o700  # the data dir's models/
        files = list(folder.iterdir())
        assert files and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    finally:
        mgr.stop()
    # the next start finds it and writes nothing
    mgr = start_mgr(tmp_path / "data")
    try:
        assert mgr.get("/api/models")["demo_job"] is None
    finally:
        mgr.stop()


def test_connections_mgr_accepts_send_each_answer_at_once() -> None:
    # with Nagle on, an answer after the first on a kept-alive connection waits ~40 ms for the
    # browser's delayed ACK; asyncio turns it off only on sockets made as TCP
    listening = _listen("127.0.0.1", 0)

    async def nodelay_of_an_accepted_connection() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listening)
        async with server:
            _, writer = await asyncio.open_connection(*listening.getsockname()[:2])
            nodelay = await asyncio.wait_for(seen, 30)
            writer.close()
        return nodelay

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
