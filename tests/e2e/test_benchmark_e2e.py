"""The benchmark end to end on the demo model, CPU: a quick run through a real mgr's API from a
deliberately poor baseline, every trial a fresh engine, a confirmed change kept, the saved profile
started, the result on the console's page."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

import pytest

from moelab.autotune.flagset import Change, apply_change, same_flags
from moelab.daemon.service import Daemon, DaemonConfig
from tests.autotune.conftest import record_fresh_rates
from tests.daemon.conftest import start_mgr, synth, wait_for

# prefill in chunks of 2 tokens reads a prompt in hundreds of steps, and a one-slot expert cache
# misses on nearly every read: there is something to find on any machine, however noisy. A KV
# reserve of a quarter of the model's context leaves the context step a tier to prove.
POOR = ["--device", "cpu", "--device-memory", "1GiB", "--prefill-chunk-tokens", "2",
        "--moe-cache-size", "1", "--kv-reserve-tokens", "1024"]  # fmt: skip
# A hang, not a speed test: the run takes about 2 min on a 2-core machine, and a CI run on a slow
# day (the whole suite 22 min against 15-16) ran out of 6.
RUN_TIMEOUT_S = 600.0
# what mgr prints to its terminal: the URL, the token, and a few lines of its own
MGR_LINES_MAX = 10


def assert_terminal_short(output: str, token: str) -> None:
    """mgr's terminal keeps its URL and token in sight: no line per HTTP request of a trial."""
    assert "HTTP Request" not in output, output[-2000:]
    assert len(output.splitlines()) <= MGR_LINES_MAX, output[-2000:]
    assert f"control token: {token}" in output


@pytest.mark.slow
def test_mgr_s_terminal_stays_short_while_trials_run(tmp_path: Path) -> None:
    models = tmp_path / "models"
    demo = synth(models / "demo-tiny")
    data = tmp_path / "data"
    # a fresh hardware reading: the run goes straight to its trials
    daemon = Daemon(DaemonConfig(data_dir=data, models_dirs=(models,), write_demo=False))
    record_fresh_rates(daemon, demo)
    daemon.close()
    mgr = start_mgr(data, "--models-dir", str(models))
    try:
        run = mgr.post(
            "/api/benchmarks",
            {"model": str(demo), "mode": "quick", "objective": "decode",
             "base_flags": ["--device", "cpu", "--device-memory", "1GiB"],
             "only_flags": ["--moe-miss-policy"]},
        )  # fmt: skip
        # the calibration trial and a baseline run: two engines started, each sent a warm-up
        # and its workloads over HTTP (dozens of requests), their stats read, stopped
        wait_for(
            lambda: len(mgr.get(f"/api/benchmarks/{run['id']}")["trials"]) >= 2,
            RUN_TIMEOUT_S,
            "two trials",
            poll_s=1.0,
        )
        mgr.post(f"/api/benchmarks/{run['id']}/cancel")
    finally:
        mgr.stop()
    assert_terminal_short(mgr.output(), mgr.token)


@pytest.mark.slow
def test_quick_run_on_the_demo_model_through_the_api(tmp_path: Path) -> None:
    models = tmp_path / "models"
    demo = synth(models / "demo-tiny")
    mgr = start_mgr(tmp_path / "data", "--models-dir", str(models))
    try:
        began = time.monotonic()
        # the two flags the poor baseline sets badly: every step of a run still happens
        # (calibration, baseline, candidates and their confirmations, the context tiers) with
        # fewer candidates; which flags a quick run tries is the planner's tests' (autotune)
        run = mgr.post(
            "/api/benchmarks",
            {"model": str(demo), "mode": "quick", "objective": "both", "base_flags": POOR,
             "only_flags": ["--prefill-chunk-tokens", "--moe-cache-rate"]},
        )  # fmt: skip
        run_id = run["id"]
        seen_eta = []

        def finished() -> dict | None:
            body = mgr.get(f"/api/benchmarks/{run_id}")
            if body["status"] == "running" and body["eta_s"] is not None:
                seen_eta.append(body["eta_s"])
            return body if body["status"] != "running" else None

        done = wait_for(finished, RUN_TIMEOUT_S, f"benchmark run {run_id} to finish", poll_s=1.0)
        elapsed_s = time.monotonic() - began
        assert done["status"] == "done", (done["error"], done["events"][-5:])
        assert seen_eta, "the time left was shown while the run went on"
        trials = done["trials"]

        # every trial was its own engine process
        pids = [t["engine_pid"] for t in trials]
        assert None not in pids and len(set(pids)) == len(pids), pids

        # at least one change kept, each one confirmed by a second run of the same flags
        result = done["result"]
        assert result["changes"], [(t["change"], t["verdict"], t["reason"]) for t in trials]
        by_n = {t["n"]: t for t in trials}
        flags = list(done["base_flags"])
        for change in result["changes"]:
            if change["flag"] == "--kv-reserve-tokens":
                # a context tier is confirmed by a real request of 95% of it
                (tier,) = (by_n[n] for n in change["trials"])
                proof = tier["context_proof"]
                assert tier["role"] == "context" and tier["verdict"] == "kept"
                assert proof["prompt_tokens"] >= 0.95 * int(change["value"])
            else:
                first, second = (by_n[n] for n in change["trials"])
                assert first["verdict"] == "kept" and first["role"] == "candidate"
                assert second["role"] == "confirm" and second["flags"] == first["flags"]
            flags = apply_change(flags, Change.from_json(change))
        assert any(c["flag"] != "--kv-reserve-tokens" for c in result["changes"])
        # the result is the baseline plus the confirmed changes and nothing else
        assert same_flags(flags, result["flags"])
        # the context step proved the usable context with a real request, then tried a tier
        # above it unless a kept change (dropping --moe-cache-size) already gave the model's own
        context = result["context"]
        proved = context["proof"]["target_tokens"]
        assert context["proven"] and proved >= 1024, context
        assert context["proof"]["prompt_tokens"] >= 0.95 * proved, context
        model_max = json.loads((demo / "config.json").read_text())["max_position_embeddings"]
        if proved < model_max:
            first_tier = min(2 * proved, model_max)
            assert context["tiers"] and context["tiers"][0]["tokens"] == first_tier, context

        share = result["overhead"]["share"]
        assert 0.0 < share < 1.0
        print(
            f"\nquick run: {len(trials)} trials in {elapsed_s:.0f} s, gain {result['gain']:+.0%}, "
            f"kept {[c['label'] for c in result['changes']]}, restart + warm-up {share:.0%} "
            "of trial time"
        )

        # save as profile, and the saved profile starts
        profile = mgr.post(f"/api/benchmarks/{run_id}/save-profile", {"name": "demo tuned"})
        assert profile["flags"] == result["flags"]
        server = mgr.post("/api/servers", {"profile_id": profile["id"]})
        wait_for(
            lambda: mgr.get(f"/api/servers/{server['id']}")["status"] in ("running", "crashed"),
            120,
            "the saved profile's engine to start",
        )
        assert mgr.get(f"/api/servers/{server['id']}")["status"] == "running"
        mgr.post(f"/api/servers/{server['id']}/stop")

        # the console's result page shows the result
        status, page = mgr.request("GET", f"/benchmark/{run_id}")
        assert status == 200
        text = html.unescape(page)
        assert " ".join(result["flags"]) in text
        assert all(c["label"] in text for c in result["changes"])
        assert "demo tuned" in text
    finally:
        mgr.stop()
    assert_terminal_short(mgr.output(), mgr.token)
