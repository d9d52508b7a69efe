"""A full disk under the data dir: writes are refused with 507 naming the path, reads go on, and
the daemon's threads (telemetry, the engine watcher) carry on once space is freed.

The data dir lies on a tmpfs of a few MiB mounted for the test (root may mount; elsewhere the
tests are skipped with the reason), filled with a file until the kernel says ENOSPC.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.requests import Request

from moelab.console.main import build_app
from moelab.daemon.errors import DiskFull, disk_full
from moelab.daemon.http import EXCEPTION_HANDLERS
from moelab.daemon.sampler import Sampler
from moelab.daemon.schema import Profile, Server
from moelab.daemon.store import Store
from moelab.daemon.supervisor import EngineHandle, Supervisor
from moelab.daemon.telemetry import STATS, read_samples
from moelab.engine.process import launch

from .conftest import MgrProcess, make_daemon, start_mgr, wait_for
from .test_telemetry import FakeEngine, FakeHandle, FakeProcess, FakeSupervisor


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of the test's own."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path) -> Path:
    """Write a file until the disk is full; returns it (delete it to free the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def profile(n: int, model: Path) -> dict:
    return {"name": f"p{n}", "model": str(model), "flags": [], "notes": "x" * 20_000}


def test_a_full_disk_refuses_writes_with_507_naming_the_path_and_reads_go_on(
    small_disk: Path, demo_model: Path
) -> None:
    mgr: MgrProcess = start_mgr(small_disk / "data", "--models-dir", str(demo_model.parent))
    try:
        assert mgr.post("/api/profiles", profile(0, demo_model), expect=(201,))
        # the probe mgr stores at start, on a thread of its own, is in before the disk fills
        wait_for(lambda: mgr.get("/api/hardware")["latest"], 30, "the start's inventory")
        filler = fill(small_disk)
        # SQLite may still find room in its write-ahead log for a write or two: write until refused
        for n in range(1, 200):
            status, body = mgr.request("POST", "/api/profiles", profile(n, demo_model))
            if status != 201:
                break
        assert status == 507, body
        assert body["error"]["code"] == "disk_full"
        message = body["error"]["message"]
        assert str(small_disk / "data") in message and "full" in message
        assert "log" not in message
        # a page in Japanese asked: its scripts show the same in Japanese
        status, body = mgr.request(
            "POST", "/api/profiles", profile(n, demo_model), {"Accept-Language": "ja"}
        )
        assert status == 507 and body["error"]["code"] == "disk_full"
        assert f"{small_disk / 'data'}" in body["error"]["localized"]
        assert "ディスクがいっぱいです" in body["error"]["localized"]
        # reads go on, the console's pages too
        assert mgr.get("/api/status")["pid"] == mgr.process.pid
        names = [p["name"] for p in mgr.get("/api/profiles")["profiles"]]
        assert "p0" in names
        assert mgr.request("GET", "/profiles")[0] == 200
        # once space is freed, the same write succeeds
        filler.unlink()
        assert mgr.post("/api/profiles", profile(n, demo_model), expect=(201,))
        assert "Traceback" not in mgr.output()
    finally:
        mgr.stop()


def test_the_store_names_its_file_when_a_write_finds_the_disk_full(small_disk: Path) -> None:
    store = Store(small_disk / "mgr.sqlite3")
    fill(small_disk)
    with pytest.raises(DiskFull) as refused:
        for n in range(200):
            with store.session() as session:
                session.add(Profile(name=f"p{n}", model="/m", notes="x" * 20_000, created=0.0,
                                    updated=0.0))  # fmt: skip
    assert refused.value.path == str(small_disk / "mgr.sqlite3")
    assert refused.value.status == 507
    store.close()


def server_row(store: Store, status: str) -> None:
    with store.session() as session:
        session.add(
            Server(id=1, name="s", model="/m", flags=[], host="127.0.0.1", port=8100,
                   device="cpu", status=status, log_path="", created=0.0)
        )  # fmt: skip


def fill_past_the_wal(store: Store, disk: Path) -> Path:
    """Fill the disk once the write-ahead log is empty, so that the next write fails."""
    store.reclaim_space()
    return fill(disk)


def said(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in record.getMessage() for record in caplog.records)


def test_sampling_goes_on_once_space_is_freed(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(small_disk / "mgr.sqlite3")
    server_row(store, "running")
    engine, polls = FakeEngine(), []

    def source(_handle: object) -> dict:
        polls.append(1)
        engine.advance(2.0, tokens=2)
        return engine.stats()

    supervisor = FakeSupervisor([FakeHandle(1, FakeProcess(4242))])
    sampler = Sampler(store, supervisor, None, interval_s=0.05, source=source)  # type: ignore[arg-type]
    sampler.start()
    try:
        wait_for(lambda: read_samples(store, 1, STATS), 30, "a first sample")
        filler = fill_past_the_wal(store, small_disk)
        wait_for(lambda: said(caplog, "telemetry not stored"), 30, "a sample refused")
        polled = len(polls)
        wait_for(lambda: len(polls) > polled + 3, 30, "polls on the full disk")
        filler.unlink()
        stored = len(read_samples(store, 1, STATS, limit=100_000))
        wait_for(
            lambda: len(read_samples(store, 1, STATS, limit=100_000)) > stored,
            30,
            "samples stored once space is freed",
        )
    finally:
        sampler.close()
        store.close()


def test_an_engine_that_ends_on_a_full_disk_is_recorded_once_space_is_freed(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(small_disk / "mgr.sqlite3")
    server_row(store, "stopped")  # (not one for open() to adopt: the test hands it the engine)
    process = subprocess.Popen(["sleep", "60"])
    engine = launch.EngineProcess(process.pid, "127.0.0.1", 8100, "", 0.0, popen=process)
    supervisor = Supervisor(store, small_disk, gpu_count=lambda: 0, watch_interval_s=0.05)
    supervisor._handles[1] = EngineHandle(1, engine, "cpu", None, fresh=True, ready=True)
    supervisor.open()
    try:
        filler = fill_past_the_wal(store, small_disk)
        process.kill()
        process.wait()
        wait_for(lambda: said(caplog, "server 1 ended"), 30, "the watcher to see the end")
        filler.unlink()
        crashed = wait_for(
            lambda: (row := supervisor.row(1)).status == "crashed" and row, 30, "the crash row"
        )
        assert crashed.exit_code == -9
    finally:
        supervisor.close()
        store.close()


def test_a_file_write_on_a_full_disk_is_a_disk_full(small_disk: Path) -> None:
    """An engine's log written on a full disk: the refusal names the data dir (the write itself
    does not say which file), or the file where the error names one."""
    fill(small_disk)
    try:
        launch.start_engine(["--port", "1"], small_disk / "logs" / "server-3.log")
    except OSError as err:
        full = disk_full(err, small_disk)
    assert full is not None and full.status == 507 and full.code == "disk_full"
    assert f"the disk holding {small_disk} is full" in full.message
    named = OSError(errno.ENOSPC, "No space left on device", str(small_disk / "token"))
    assert str(small_disk / "token") in disk_full(named, small_disk).message
    assert disk_full(RuntimeError("not about the disk"), small_disk) is None


def test_an_oserror_of_a_full_disk_in_a_handler_is_answered_507(
    small_disk: Path, demo_model: Path
) -> None:
    """A handler's own file write (an engine's log) that finds the disk full: 507, not 500."""
    daemon = make_daemon(small_disk / "data", demo_model.parent)
    fill(small_disk)
    app = build_app(daemon)
    request = Request({"type": "http", "app": app, "method": "POST", "path": "/api/servers",
                       "headers": []})  # fmt: skip
    full = OSError(errno.ENOSPC, "No space left on device")
    response = asyncio.run(EXCEPTION_HANDLERS[Exception](request, full))
    body = json.loads(response.body)
    assert response.status_code == 507 and body["error"]["code"] == "disk_full"
    assert f"the disk holding {small_disk / 'data'} is full" in body["error"]["message"]
    daemon.close()
