"""An FP8 checkpoint written by `moelab synth --dtype fp8` served through a real `mgr` on the CPU:
found in its models dir, listed as servable, started from a profile with FP8 KV pages, answering a
chat, and its server page naming both formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon.conftest import http, start_mgr, synth, wait_for
from tests.daemon.test_engines import READY_S, chat, wait_status


@pytest.mark.slow
def test_an_fp8_synth_checkpoint_serves_through_mgr(tmp_path: Path) -> None:
    models = tmp_path / "models"
    fp8 = synth(models / "tiny-fp8", "--dtype", "fp8")
    mgr = start_mgr(tmp_path / "data", "--models-dir", str(models))
    try:
        listed = {m["path"]: m for m in mgr.get("/api/models")["models"]}
        model = listed[str(fp8.resolve())]
        assert model["error"] is None, model
        profile = mgr.post(
            "/api/profiles",
            {
                "name": "fp8",
                "model": str(fp8),
                "flags": ["--device", "cpu", "--kv-cache-dtype", "fp8"],
            },
        )
        server = mgr.post("/api/servers", {"profile_id": profile["id"]}, expect=(202,))
        server = wait_status(mgr, server["id"], ("running", "crashed", "failed"), READY_S)
        assert server["status"] == "running", mgr.get(f"/api/servers/{server['id']}/logs")
        reply = chat(server, max_tokens=8)
        assert reply["usage"]["completion_tokens"] >= 1
        assert reply["choices"][0]["message"]["content"]
        stats = http("GET", server["url"] + "/v1/stats")[1]
        assert stats["experts"]["dtype"] == "fp8", stats["experts"]
        assert stats["kv"]["dtype"] == "fp8", stats["kv"]

        def sampled() -> dict | None:
            return mgr.get(f"/api/servers/{server['id']}/stats")["stats"]

        assert wait_for(sampled, 30, "stats sampled")["experts"]["dtype"] == "fp8"
        page = http("GET", f"{mgr.url}/servers/{server['id']}")[1]
        assert 'id="expert-format">FP8 (e4m3, one fp32 factor per 128×128 block)<' in page
        assert 'id="kv-format">FP8 (e4m3, one fp32 factor per token and KV head)<' in page
        mgr.post(f"/api/servers/{server['id']}/stop")
    finally:
        mgr.stop()
