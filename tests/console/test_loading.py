"""A starting server's page tells the engine's loading phase: here, that it waits for another
process's build of the CPU kernel (a real `mgr`, a real engine, a real process holding the lock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelab.kernels.native_build import WAITING, native_build_dir
from tests.daemon.conftest import http, start_mgr, wait_for
from tests.kernels.native_build_procs import hold_build_lock, release


def test_a_starting_server_shows_that_it_waits_for_another_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_model: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # mgr's and its engines'
    holder = hold_build_lock(native_build_dir() / "build.lock")
    mgr = start_mgr(tmp_path / "data", "--models-dir", str(demo_model.parent))
    try:
        started = mgr.post("/api/servers", {"model": str(demo_model), "flags": []}, expect=(202,))

        def waiting() -> dict | None:
            server = mgr.get(f"/api/servers/{started['id']}")
            return server if (server["health"] or {}).get("phase") == WAITING else None

        server = wait_for(waiting, 240, "the engine to wait for the build")
        assert server["status"] == "starting"
        assert server["health"]["build_holder_pid"] == holder.pid
        status, health = http("GET", server["url"] + "/health")
        assert status == 200 and health["phase"] == WAITING, health
        said = {
            "en": f"Waiting for another build of the CPU kernel (process {holder.pid}).",
            "ja": f"別の CPU カーネルのビルド（プロセス {holder.pid}）の完了を待っています。",
        }
        for lang, text in said.items():
            status, page = mgr.request(
                "GET", f"/servers/{server['id']}", headers={"Accept-Language": lang}
            )
            assert status == 200 and text in page, page
        log = Path(mgr.get(f"/servers/{server['id']}?format=json")["log"]["path"]).read_text()
        assert "waiting for another build of the native kernel" in log
        assert f"process {holder.pid} holds build.lock" in log
        mgr.post(f"/api/servers/{server['id']}/stop")
    finally:
        release(holder)
        mgr.stop()
