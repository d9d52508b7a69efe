"""Telemetry: the sampler's compaction against a fake stats source, roll-up, retention, size cap."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from moelab.daemon.retention import Retention, maintain, total_bytes
from moelab.daemon.sampler import Sampler
from moelab.daemon.schema import Server, TelemetrySample
from moelab.daemon.store import Store
from moelab.daemon.telemetry import (
    PICKS,
    STATS,
    Compactor,
    read_samples,
    write_rows,
)


@dataclass
class FakeEngine:
    """Produces /v1/stats bodies of the engine's shape with counters that only go up."""

    layers: int = 4
    experts: int = 8
    uptime_s: float = 0.0
    completed: int = 0
    seed: int = 0
    counts: dict[str, list[int]] = field(default_factory=dict)
    picks: list[list[int]] = field(default_factory=list)
    running: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.counts = {k: [0] * self.layers for k in ("reads", "hits", "fills", "cpu")}
        self.picks = [[0] * self.experts for _ in range(self.layers)]

    def advance(self, seconds: float, tokens: int) -> None:
        self.uptime_s += seconds
        self.running = 1 if tokens else 0
        for _ in range(tokens):
            for layer in range(self.layers):
                for expert in self.rng.sample(range(self.experts), 2):
                    self.picks[layer][expert] += 1
                    self.counts["reads"][layer] += 1
                    if self.rng.random() < 0.7:
                        self.counts["hits"][layer] += 1
                    elif self.rng.random() < 0.5:
                        self.counts["fills"][layer] += 1
                    else:
                        self.counts["cpu"][layer] += 1
        if tokens:
            self.completed += 1

    def stats(self) -> dict[str, Any]:
        rate = 25.0 if self.running else 0.0
        return {
            "model": "fake",
            "uptime_s": self.uptime_s,
            "throughput": {
                "decode_tok_s_10s": rate, "prefill_tok_s_10s": 0.0,
                "decode_tok_s_60s": rate, "prefill_tok_s_60s": 0.0,
            },
            "requests": {
                "running": self.running, "queued": 0, "completed": self.completed,
                "ttft_mean_s": 0.1, "ttft_p95_s": 0.2,
            },
            "memory": {
                "device": [{"index": 0, "total": 100, "weights": 10, "kv": 20, "expert_cache": 30,
                            "prefill_buffer": 1, "activations": 2, "graphs": 0, "other": 3}],
                "host_rss": 1000, "expert_bank": 500,
            },
            "kv": {"tokens_total": 4096, "tokens_used": 10, "tokens_peak": 20, "max_context": 4096},
            "experts": {
                "num_layers": self.layers, "num_experts": self.experts, "top_k": 2, "slots": 8,
                "layers": [
                    {"layer": i, "resident": 2, **{k: v[i] for k, v in self.counts.items()}}
                    for i in range(self.layers)
                ],
                "picks": [list(row) for row in self.picks],
                "hit_rate_60s": 0.7,
            },
            "breakdown": {"route": 0.1, "copy": 0.2, "gpu_experts": 0.3, "cpu_experts": 0.3,
                          "other": 0.1, "step_s": 0.04},
        }  # fmt: skip


def summed(rows: list[Any], key: str) -> list[int]:
    total = [0] * 4
    for row in rows:
        for i, v in enumerate(row.payload.get("d", {}).get(key, [])):
            total[i] += v
    return total


def test_a_fresh_engines_deltas_add_up_to_its_counters() -> None:
    engine = FakeEngine()
    compactor = Compactor(fresh=True)
    rows = []
    t = 1000.0
    for step in range(50):
        engine.advance(2.0, tokens=5 if step % 3 else 0)
        t += 2.0
        rows += [r for r in compactor.ingest(engine.stats(), t) if r.kind == STATS]
    for key in ("reads", "hits", "fills", "cpu"):
        assert summed(rows, key) == engine.counts[key]
    assert sum(r.payload.get("d", {}).get("completed", 0) for r in rows) == engine.completed
    assert rows[-1].payload["g"]["decode_tok_s_10s"] in (0.0, 25.0)


def test_an_idle_engine_writes_one_row_a_minute_not_every_sample() -> None:
    engine = FakeEngine()
    compactor = Compactor(fresh=True, heartbeat_s=60.0)
    engine.advance(2.0, tokens=3)
    rows = compactor.ingest(engine.stats(), 2.0)
    t = 2.0
    for _ in range(300):  # ten idle minutes at one sample per 2 s
        engine.advance(2.0, tokens=0)
        t += 2.0
        rows += [r for r in compactor.ingest(engine.stats(), t) if r.kind == STATS]
    stats_rows = [r for r in rows if r.kind == STATS]
    # the busy sample, the first idle one (the edge), then one heartbeat a minute
    assert 10 <= len(stats_rows) <= 13
    # the rows still cover the time between them: intervals add up to the span
    span = stats_rows[-1].time - stats_rows[0].time
    assert sum(r.interval_s for r in stats_rows[1:]) == pytest.approx(span)
    assert t - stats_rows[-1].time < 60.0


def test_a_counter_reset_is_counted_from_zero_not_as_a_negative_delta() -> None:
    compactor = Compactor(fresh=True)
    first = FakeEngine(seed=1)
    first.advance(2.0, tokens=20)
    compactor.ingest(first.stats(), 2.0)
    second = FakeEngine(seed=2)  # the process restarted under the same pid (or counters reset)
    second.advance(1.0, tokens=3)
    rows = [r for r in compactor.ingest(second.stats(), 4.0) if r.kind == STATS]
    assert rows[0].payload["d"]["reads"] == second.counts["reads"]
    assert all(v >= 0 for v in rows[0].payload["d"]["reads"])


def test_an_adopted_engines_first_body_is_only_a_baseline() -> None:
    engine = FakeEngine()
    engine.advance(3600.0, tokens=100)  # counts from before this daemon started
    compactor = Compactor(fresh=False)
    first = compactor.ingest(engine.stats(), 10.0)
    assert all("d" not in r.payload for r in first if r.kind == STATS)
    assert [r for r in first if r.kind == PICKS] == []
    before = {k: list(v) for k, v in engine.counts.items()}
    engine.advance(2.0, tokens=4)
    rows = compactor.ingest(engine.stats(), 12.0)
    delta = rows[0].payload["d"]["reads"]
    assert delta == [a - b for a, b in zip(engine.counts["reads"], before["reads"], strict=True)]


def test_picks_are_stored_at_the_coarser_interval_and_add_up() -> None:
    engine = FakeEngine()
    compactor = Compactor(fresh=True, picks_every_s=60.0)
    picks_rows = []
    t = 0.0
    for _ in range(200):  # 400 s
        engine.advance(2.0, tokens=2)
        t += 2.0
        picks_rows += [r for r in compactor.ingest(engine.stats(), t) if r.kind == PICKS]
    assert 5 <= len(picks_rows) <= 7
    total = [[0] * engine.experts for _ in range(engine.layers)]
    for row in picks_rows:
        for layer, counts in enumerate(row.payload["picks"]):
            for expert, count in enumerate(counts):
                total[layer][expert] += count
    # everything up to the last picks row is accounted for, nothing twice
    assert all(sum(a) <= sum(b) for a, b in zip(total, engine.picks, strict=True))
    assert sum(map(sum, engine.picks)) - sum(map(sum, total)) <= 2 * 2 * engine.layers * 30


# ---- storage, roll-up and retention -----------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "mgr.sqlite3")
    with store.session() as session:
        session.add(
            Server(
                id=1, name="s", model="/m", flags=[], host="127.0.0.1", port=8100, device="cpu",
                status="running", log_path="/tmp/s.log", created=0.0,
            )
        )  # fmt: skip
    return store


def _fill(store: Store, seconds: float, start: float = 0.0, step_s: float = 2.0) -> FakeEngine:
    engine = FakeEngine()
    compactor = Compactor(fresh=True)
    t = start
    rows = []
    while t < start + seconds:
        engine.advance(step_s, tokens=3)
        t += step_s
        rows += compactor.ingest(engine.stats(), t)
    write_rows(store, 1, rows)
    return engine


def test_roll_up_keeps_the_sums_and_the_time_covered(store: Store) -> None:
    engine = _fill(store, 2 * 3600.0)
    fine = read_samples(store, 1, STATS, limit=100000)
    span_before = sum(s["interval_s"] for s in fine)
    policy = Retention(fine_keep_s=3600.0, max_age_s=30 * 86400.0)
    report = maintain(store, policy, now=2 * 3600.0)
    assert report["rolled_stats"] > 1000
    after = read_samples(store, 1, STATS, limit=100000)
    old_before = [s for s in fine if s["t"] < 3600.0]
    old_after = [s for s in after if s["t"] < 3600.0]
    assert len(old_after) == 60 and len(old_before) == 1799
    assert [s for s in after if s["t"] >= 3600.0] == [s for s in fine if s["t"] >= 3600.0]
    assert sum(s["interval_s"] for s in after) == pytest.approx(span_before)
    reads = [0] * engine.layers
    for sample in after:
        for i, v in enumerate(sample.get("d", {}).get("reads", [])):
            reads[i] += v
    assert reads == engine.counts["reads"]
    # the last hour is still at full resolution; older rows are a minute each
    assert {s["resolution_s"] for s in after if s["t"] > 3600.0} == {2.0}
    assert {s["resolution_s"] for s in after if s["t"] <= 3540.0} == {60.0}
    # running again changes nothing
    assert maintain(store, policy, now=2 * 3600.0)["rolled_stats"] == 0


def test_rows_past_the_age_limit_are_deleted(store: Store) -> None:
    _fill(store, 600.0, start=0.0)
    _fill(store, 600.0, start=10_000.0)
    policy = Retention(fine_keep_s=100_000.0, max_age_s=100_000.0)
    maintain(store, policy, now=105_000.0)
    times = [s["t"] for s in read_samples(store, 1, STATS, limit=100000)]
    assert times and min(times) > 5_000.0


def test_the_size_cap_drops_the_oldest_rows_first(store: Store) -> None:
    _fill(store, 3600.0)
    size = total_bytes(store)
    cap = size // 3
    store.reclaim_space()  # (only checkpoints the WAL here, so the file size is comparable)
    file_before = store.path.stat().st_size
    maintain(store, Retention(max_bytes=cap, fine_keep_s=1e9, max_age_s=1e9), now=3600.0)
    assert total_bytes(store) <= cap
    # the freed pages go back to the file system, not only to SQLite's free list
    assert store.path.stat().st_size < file_before * 0.6
    with store.session() as session:
        oldest = session.scalar(select(func.min(TelemetrySample.time)))
        newest = session.scalar(select(func.max(TelemetrySample.time)))
    assert newest == pytest.approx(3600.0)
    assert oldest > 3600.0 / 2


# ---- the sampler with a fake stats source ------------------------------------------------------


@dataclass
class FakeHandle:
    server_id: int
    engine: Any
    device: str = "cpu"
    api_key: str | None = None
    fresh: bool = True
    ready: bool = True
    stopping: bool = False


@dataclass
class FakeProcess:
    pid: int


class FakeSupervisor:
    def __init__(self, handles: list[FakeHandle]) -> None:
        self._handles = handles

    def handles(self) -> list[FakeHandle]:
        return self._handles


def test_the_sampler_stores_rows_and_keeps_the_latest_body(store: Store) -> None:
    engine = FakeEngine()
    handle = FakeHandle(1, FakeProcess(4242))
    supervisor = FakeSupervisor([handle])
    sampler = Sampler(
        store, supervisor, None, interval_s=2.0, picks_every_s=10.0,  # type: ignore[arg-type]
        source=lambda h: engine.stats(),
    )  # fmt: skip
    t = 100.0
    for _ in range(20):
        engine.advance(2.0, tokens=2)
        t += 2.0
        assert sampler.poll_once(now=t) == 1
    assert len(read_samples(store, 1, STATS)) == 20
    assert read_samples(store, 1, PICKS)
    latest = sampler.latest(1)
    assert latest is not None and latest[0] == t
    assert latest[1]["requests"]["completed"] == engine.completed
    # the engine goes away: its last body stays in the server row for the console
    handle.ready = False
    sampler.poll_once(now=t + 2)
    with store.session() as session:
        row = session.get(Server, 1)
        assert row.last_stats["requests"]["completed"] == engine.completed
    fresh_sampler = Sampler(store, supervisor, None, source=lambda h: None)  # type: ignore[arg-type]
    assert fresh_sampler.latest(1)[1]["requests"]["completed"] == engine.completed


def test_an_engine_that_does_not_answer_writes_nothing(store: Store) -> None:
    supervisor = FakeSupervisor([FakeHandle(1, FakeProcess(1))])
    sampler = Sampler(store, supervisor, None, source=lambda h: None)  # type: ignore[arg-type]
    assert sampler.poll_once(now=5.0) == 0
    assert read_samples(store, 1, STATS) == []
    assert sampler.latest(1) is None
