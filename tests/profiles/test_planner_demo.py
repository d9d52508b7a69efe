"""The context planner against real engines: the demo model on the CPU at two contexts.

Each context is a profile; `mgr` starts a real `moelab serve` for it, four clients keep it busy,
and its telemetry is sampled as usual. After the first run, /api/recommend predicts the second
context from that run alone (its what-if curve, its speed, the engine's VRAM plan); then the
second run measures it. And the other way round. The device memory is chosen so that the two
contexts leave the expert cache 27 and 6 of the 48 experts.

What the test requires holds on any machine, however busy: the planner's slots are the engine's,
its prediction moves from the run it came from the right way, and its basis says how it priced a
miss. How close the predicted speed and hit rate come to the measured ones is this machine's
measurement, not the planner's logic: the test prints them (`-s`), and docs/profiles.md keeps
them.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from moelab.daemon.schema import Server
from moelab.daemon.service import Daemon
from moelab.engine.config.memory import activation_bytes
from moelab.engine.model.spec import ModelSpec
from moelab.engine.process.launch import get_json
from moelab.profiles.planner import FIT_SIGMAS, MIN_FIT_STEPS, miss_seconds
from tests.daemon.conftest import asgi_client, make_daemon, wait_for

CONTEXTS = (1536, 2048)
LOAD_S = 14.0  # long enough for several fully loaded 10 s throughput windows
LOAD_STEPS = 500  # and at least these decode steps in the engine's fit of a miss's cost
CLIENTS = 4


@pytest.fixture
def sampled_daemon(tmp_path: Path, demo_model: Path) -> Iterator[Daemon]:
    daemon = make_daemon(tmp_path / "data", demo_model.parent, sample_interval_s=0.5)
    daemon.start()
    yield daemon
    for row in daemon.supervisor.servers():
        if row.status in ("starting", "running"):
            daemon.supervisor.stop(row.id)
    daemon.close()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _decode_counts(stats: dict[str, Any]) -> tuple[int, int, int]:
    layers = stats["experts"]["layers"]
    return (
        stats["tokens"]["decode_total"],
        sum(layer["reads"] for layer in layers),
        sum(layer["hits"] for layer in layers),
    )


def measure(local: TestClient, daemon: Daemon, profile_id: int) -> dict[str, float]:
    """Serve a profile, keep it busy for LOAD_S and LOAD_STEPS decode steps, and return what it
    did; stopped afterwards."""
    server = local.post("/api/servers", json={"profile_id": profile_id}).json()

    def ready() -> dict | None:
        row = local.get(f"/api/servers/{server['id']}").json()
        assert row["status"] in ("starting", "running"), row
        return row if row["status"] == "running" else None

    url = wait_for(ready, 240, f"server {server['id']} to run", poll_s=0.25)["url"]
    _post(url + "/v1/completions", {"prompt": "warm up", "max_tokens": 16, "ignore_eos": True})
    before, t0 = get_json(url + "/v1/stats", timeout_s=10), time.monotonic()
    loaded = threading.Event()

    def client(i: int) -> None:
        n = 0
        while not loaded.is_set():
            body = {"prompt": f"{i} {n} the sea", "max_tokens": 64, "ignore_eos": True,
                    "temperature": 1.0, "seed": 1000 * i + n}  # fmt: skip
            _post(url + "/v1/completions", body)
            n += 1

    def enough() -> bool:
        steps = get_json(url + "/v1/stats", timeout_s=10)["experts"]["miss_cost"]["steps"]
        return time.monotonic() - t0 >= LOAD_S and steps >= LOAD_STEPS

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        wait_for(enough, 600, f"{LOAD_S:.0f} s and {LOAD_STEPS} decode steps of load", 0.5)
    finally:
        loaded.set()
        for t in threads:
            t.join()
    after, t1 = get_json(url + "/v1/stats", timeout_s=10), time.monotonic()
    assert before is not None and after is not None
    tokens, reads, hits = (
        b - a for a, b in zip(_decode_counts(before), _decode_counts(after), strict=True)
    )
    ended = time.time()
    wait_for(lambda: daemon.sampler.latest(server["id"])[0] > ended, 30, "a sample after the load")
    local.post(f"/api/servers/{server['id']}/stop")

    def kept() -> bool:  # a stopped engine's last stats body stays in its row
        with daemon.store.session() as session:
            row = session.get(Server, server["id"])
            return bool(row and row.last_stats_time and row.last_stats_time > ended)

    wait_for(kept, 30, "the last stats kept in the server's row")
    config = after["config"]
    # what bandwidth says a miss costs, with the rates this engine measured and used
    bytes_s = miss_seconds(
        after["experts"]["slot_bytes"], "auto", config["bp_gbps"], config["bh_gbps"]
    )
    return {
        "tok_s": tokens / (t1 - t0),
        "hit_rate": hits / reads,
        "slots": after["experts"]["slots"],
        "miss_cost": after["experts"]["miss_cost"],
        "bytes_us": 1e6 * bytes_s,
    }


@pytest.mark.slow
def test_planner_predicts_the_demo_at_two_contexts(
    sampled_daemon: Daemon, demo_model: Path
) -> None:
    local = asgi_client(sampled_daemon, "127.0.0.1", "127.0.0.1:1901")
    spec = ModelSpec.from_dir(demo_model)
    # float32 on the CPU: weights and activations, then 2200 KiB for KV and experts, where 1536
    # tokens of KV (1.5 MiB) leave 27 slots of 24 KiB and 2048 tokens leave 6
    budget = spec.dense_params * 4 + activation_bytes(spec, 256, 4, 4) + 2200 * 1024
    base = ["--device", "cpu", "--device-memory", str(budget), "--memory-headroom", "0",
            "--prefill-chunk-tokens", "256", "--max-running-requests", "4",
            "--moe-cpu-threads", "1"]  # fmt: skip
    profiles = {
        kv: local.post(
            "/api/profiles",
            json={"name": f"ctx-{kv}", "model": str(demo_model),
                  "flags": [*base, "--kv-reserve-tokens", str(kv)]},
        ).json()["id"]
        for kv in CONTEXTS
    }  # fmt: skip

    def predict(kv: int) -> dict[str, Any]:
        planner = local.get(f"/api/recommend?profile={profiles[kv]}").json()["planner"]
        assert planner["run"] is not None, planner
        point = next(p for p in planner["points"] if p["kv_reserve_tokens"] == kv)
        return {**point, "from_tok_s": planner["run"]["decode_tok_s"],
                "basis": planner["basis"]["speed"]}  # fmt: skip

    first, second = CONTEXTS
    measured = {first: measure(local, sampled_daemon, profiles[first])}
    predicted = {second: predict(second)}
    measured[second] = measure(local, sampled_daemon, profiles[second])
    predicted[first] = predict(first)

    lines = []
    for kv in CONTEXTS:
        p, m = predicted[kv], measured[kv]
        error = p["decode_tok_s"] / m["tok_s"] - 1
        lines.append(
            f"context {kv}: slots {p['slots']} (engine {m['slots']}), hit rate "
            f"{p['hit_rate']:.3f} predicted vs {m['hit_rate']:.3f}, decode "
            f"{p['decode_tok_s']:.1f} tok/s predicted vs {m['tok_s']:.1f} measured: "
            f"error {error:+.1%} (the other run as the daemon saw it: {p['from_tok_s']:.1f} tok/s)"
        )
    print("\n".join(["", "context planner on the demo model (CPU):", *lines]))
    for kv in CONTEXTS:
        print(f"context {kv}: miss cost {measured[kv]['miss_cost']}; {predicted[kv]['basis']}")
    assert measured[first]["slots"] == 27 and measured[second]["slots"] == 6
    # at 6 of 48 slots nearly every read misses (0-21% hits): the engine's fit can rarely tell a
    # miss from a read and mostly says nothing, or a slope within twice its own error, whose
    # jackknife counts the spells of slow steps (runs fitted 311 ± 175 and -256 ± 159 µs; least
    # squares alone called 62 ± 26 to 673 ± 45 clear), so that run's misses are priced by
    # bandwidth; where a run's slope does come out clear (CI's runs: 213 ± 82 µs for an expert
    # whose bytes take 4), the planner prices a miss at the fit's lower bound, two standard
    # errors below the slope, where that is above the bytes' price. The basis says which.
    fit = measured[second]["miss_cost"]
    basis = predicted[first]["basis"]
    lower = (
        fit["us_per_miss"] - FIT_SIGMAS * fit["stderr_us"]
        if fit["us_per_miss"] is not None and fit["steps"] >= MIN_FIT_STEPS
        else None
    )
    bytes_us = measured[second]["bytes_us"]
    if lower is None or lower < bytes_us * 0.99:
        assert "no clear price" in basis, lines
        assert f"each miss costs {bytes_us:.0f} µs (expert" in basis, lines
    elif lower > bytes_us * 1.01:
        assert f"each miss costs {lower:.0f} µs as its own" in basis, lines
    for kv, other in ((first, second), (second, first)):
        p = predicted[kv]
        assert p["slots"] == measured[kv]["slots"]  # the planner's VRAM arithmetic is the engine's
        # more slots, fewer misses: the prediction moves from that run in the right direction
        if p["slots"] > measured[other]["slots"]:
            assert p["decode_tok_s"] > p["from_tok_s"], lines
        else:
            assert p["decode_tok_s"] < p["from_tok_s"], lines
