"""Telemetry: the what-if curve against brute-force LRU, per-layer counters against a trace,
the miss cost fit on synthetic steps and over a real engine's."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moelab.engine.experts.moe_stats import (
    BLOCK_STEPS,
    MAX_BLOCKS,
    CpuJobTimes,
    MissCostFit,
    _fit_slope,
)
from moelab.engine.experts.whatif import StackDistances
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.serving.metrics import render_metrics
from moelab.engine.synth_checkpoint import synthesize

from .reference import make_engine


def brute_force_hit_rate(keys: list[int], slots: int) -> float:
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in keys:
        if key in lru:
            hits += 1
            lru.move_to_end(key)
        else:
            lru[key] = None
            if len(lru) > slots:
                lru.popitem(last=False)
    return hits / len(keys)


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_stack_distances_equal_brute_force_lru(native):
    rng = np.random.default_rng(0)
    keys = (rng.zipf(1.4, 6000) % 300).astype(np.int64)
    sd = StackDistances(300, window=10_000, native=native)
    for i in range(0, keys.size, 97):
        sd.add(keys[i : i + 97])
    for slots in (1, 2, 7, 30, 100, 299, 300):
        assert sd.hit_rate(slots) == pytest.approx(brute_force_hit_rate(keys.tolist(), slots))


def test_window_forgets_old_accesses_and_compaction_keeps_distances():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 50, 300_000)
    sd = StackDistances(50, window=1000)  # the time ring (65536) wraps several times
    sd.add(keys)
    assert sd.accesses == 1000
    assert sd.hit_rate(10) == pytest.approx(brute_force_hit_rate(keys.tolist(), 10), abs=0.05)
    recent = keys[-1000:].tolist()
    full = OrderedDict()
    hits = 0
    for i, key in enumerate(keys.tolist()):
        hit = key in full
        if hit:
            full.move_to_end(key)
        else:
            full[key] = None
            if len(full) > 10:
                full.popitem(last=False)
        if i >= keys.size - 1000:
            hits += hit
    assert sd.hit_rate(10) == pytest.approx(hits / len(recent))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(
        tmp_path_factory.mktemp("m"),
        preset="tiny",
        routing_skew=1.0,
        seed=11,
        overrides={"num_experts": 16},
    )


def test_whatif_at_todays_size_equals_observed_hit_rate_with_policy_gpu(model):
    """The what-if curve replays the reads through LRU caches: at today's size it is the
    engine's own hit rate where the engine's cache is LRU too (recent admission)."""
    flags = ["--moe-cache-size", "20", "--moe-miss-policy", "gpu", "--moe-cache-admission"]
    engine = make_engine(model, *flags, "recent")
    try:
        prompts = [list(range(10, 40)), list(range(60, 90))]
        engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
        whatif = engine.telemetry.whatif
        held_back = whatif.accesses  # handed over in batches, off the steps' path
        c = engine.moe.counters  # reading the counters hands over the rest
        observed = c.hits.sum() / c.reads.sum()
        assert held_back < whatif.accesses == c.reads.sum()
        assert whatif.hit_rate(20) == pytest.approx(observed)
        assert whatif.hit_rate(48) > whatif.hit_rate(20) > whatif.hit_rate(8)
    finally:
        engine.close()


def test_per_layer_counters_agree_with_a_router_trace(model):
    engine = make_engine(model, "--moe-cache-size", "24", "--moe-miss-policy", "split:0.5")
    spec = engine.spec
    reads = np.zeros(spec.num_moe_layers, dtype=np.int64)
    picks = np.zeros((spec.num_moe_layers, spec.num_experts), dtype=np.int64)

    def trace(layer, x, ids):
        if x.shape[0] == 1:  # decode steps of the single sequence
            m = spec.moe_index(layer)
            reads[m] += np.unique(ids.cpu().numpy()).size
            np.add.at(picks[m], ids.cpu().numpy().ravel(), 1)

    engine.model.on_router = trace
    try:
        engine.generate([list(range(5, 45))], SamplingParams(max_tokens=30, ignore_eos=True))
        c = engine.moe.counters
        assert (c.reads == reads).all() and (c.picks == picks).all()
        assert (c.hits + c.fills + c.cpu == c.reads).all()
        stats = engine.telemetry.stats(running=0, queued=0, model_name="m")
        layers = stats["experts"]["layers"]
        assert [row["reads"] for row in layers] == reads.tolist()
        assert stats["experts"]["picks"] == picks.tolist()
        assert sum(row["resident"] for row in layers) == engine.cache.resident
        window = stats["experts"]["window_60s"]["layers"]
        assert sum(r["reads"] for r in window) == reads.sum()
        jobs = stats["experts"]["cpu_jobs"]  # one native job per decode layer step with CPU work
        assert 0 < jobs["jobs"] <= int(c.cpu.sum())
        assert jobs["weight_bytes"] == int(c.cpu.sum()) * engine.bank.expert_bytes
        assert jobs["gbps"] > 0 and jobs["start_us_mean"] >= 0 and jobs["run_us_mean"] > 0
        # the pool's workers: the last began no sooner than the first, and were in tasks for a
        # share of their time
        assert jobs["last_worker_start_us_mean"] >= jobs["start_us_mean"]
        assert 0 < jobs["workers_busy_share"] <= 1.01
    finally:
        engine.close()


def test_resident_decode_counts_without_host_routing(model):
    engine = make_engine(model, "--moe-cache-rate", "1.0")
    spec = engine.spec
    picks = np.zeros((spec.num_moe_layers, spec.num_experts), dtype=np.int64)

    in_record = []

    def trace(layer, x, ids):
        if x.shape[0] == 1:
            np.add.at(picks[spec.moe_index(layer)], ids.cpu().numpy().ravel(), 1)
            # the router wrote the ids straight into the step's record: no copy to make
            record = engine.moe.routing_record(spec.moe_index(layer), 1, decode=True)
            in_record.append(record is not None and ids.data_ptr() == record.data_ptr())

    engine.model.on_router = trace
    try:
        engine.generate([list(range(5, 25))], SamplingParams(max_tokens=25, ignore_eos=True))
        c = engine.moe.counters
        assert (c.picks == picks).all() and (c.hits == c.reads).all() and c.reads.sum() > 0
        assert in_record and all(in_record)
        assert engine.telemetry.whatif.hit_rate(spec.experts_total) > 0.5
    finally:
        engine.close()


def test_breakdown_is_sampled_with_every_phase(model):
    engine = make_engine(model, "--moe-cache-size", "16")
    try:
        engine.generate([list(range(5, 25))], SamplingParams(max_tokens=8, ignore_eos=True))
        b = engine.telemetry.breakdown
        assert set(b) == {"route", "copy", "gpu_experts", "cpu_experts", "other", "step_s"}
        assert b["step_s"] > 0 and b["route"] > 0 and b["gpu_experts"] > 0
    finally:
        engine.close()


def test_one_step_in_thirty_seconds_is_timed_by_phase(model, monkeypatch):
    """The timed step runs eagerly and synchronizes at each phase (20-40 ms on the H200, against
    3-6 ms for a replayed one): sampled at the first decode step, then again 30 s later."""
    from moelab.engine.runtime import telemetry as telemetry_module

    engine = make_engine(model, "--moe-cache-size", "16")
    try:
        clock = [1000.0]
        monkeypatch.setattr(telemetry_module.time, "monotonic", lambda: clock[0])
        timed_at = []
        on_step = engine.telemetry.on_step

        def record(*args, timer=None, **kw):
            if timer is not None:
                timed_at.append(clock[0])
            on_step(*args, timer=timer, **kw)

        monkeypatch.setattr(engine.telemetry, "on_step", record)
        seq = engine.add(list(range(5, 25)), SamplingParams(max_tokens=70, ignore_eos=True))
        while not engine.idle:
            engine.step()
            clock[0] += 1.0  # a second a step
        assert len(seq.output_ids) == 70
        assert len(timed_at) == 3 and timed_at[1] - timed_at[0] == timed_at[2] - timed_at[1] == 31
        assert engine.telemetry.timed_steps == 3  # bench decode says how many fell in a run
    finally:
        engine.close()


def fitted_steps(seed: int, batches: tuple[int, ...], hit_rate: float, steps: int = 2000):
    """A fit over synthetic decode steps: 1 ms per token, 40 µs per expert read, 30 µs more per
    miss, 50 µs of noise; batch 1 always reads six experts, bigger batches 6-20."""
    rng = np.random.default_rng(seed)
    fit = MissCostFit()
    for _ in range(steps):
        batch = int(rng.choice(batches))
        reads = 6 if batch == 1 else int(rng.integers(6, 21))
        misses = int(rng.binomial(reads, 1 - hit_rate))
        step_s = 1e-3 * batch + 40e-6 * reads + 30e-6 * misses + rng.normal(0, 50e-6)
        fit.add(batch, misses, reads, step_s)
    return fit


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_miss_cost_fit_finds_a_miss_apart_from_a_read(seed):
    fit = fitted_steps(seed, (1, 2, 4), hit_rate=0.6)
    slope, stderr = fit.fit()
    assert stderr < 3e-6 and abs(slope - 30e-6) < 4 * stderr
    # misses alone would charge each miss part of the reads' cost too (more reads, more misses)
    sums = fit.sums[4]  # Σ z zᵀ, z = (1, misses, reads, seconds)
    n, m, t = sums[0, 0], sums[0, 1], sums[0, 3]
    alone = (sums[1, 3] - m * t / n) / (sums[1, 1] - m * m / n)
    assert alone > 50e-6


def test_miss_cost_fit_at_batch_one_uses_the_misses_alone():
    fit = fitted_steps(3, (1,), hit_rate=0.6)  # six reads every step
    slope, stderr = fit.fit()
    assert abs(slope - 30e-6) < 4 * stderr < 20e-6


def spells_fit(seed: int) -> MissCostFit:
    """4000 batch-2 steps in 16 spells of 250: each spell its own host delay (0-3 ms a step) and
    its own miss rate (0.3-0.6), drawn apart; a miss itself costs nothing, a read 40 µs."""
    rng = np.random.default_rng(seed)
    fit = MissCostFit()
    for _ in range(16):
        delay, rate = rng.uniform(0, 3e-3), rng.uniform(0.3, 0.6)
        for _ in range(250):
            reads = int(rng.integers(6, 21))
            misses = int(rng.binomial(reads, rate))
            fit.add(2, misses, reads, 2e-3 + 40e-6 * reads + delay + rng.normal(0, 50e-6))
    return fit


def test_miss_cost_fit_errors_count_spells_that_last():
    """Where a host's slow spells and a cache's miss rate last many steps, the steps are not
    independent draws: least squares calls a chance match of the spells a clear price of a miss
    in nearly every run; the jackknife over blocks of steps, in few."""
    fits = [spells_fit(seed) for seed in range(10)]
    clear = [(f := _fit_slope(fit.sums)) is not None and abs(f[0]) > 2 * f[1] for fit in fits]
    assert sum(clear) >= 8
    jackknifed = [fit.fit() for fit in fits]
    assert all(j is not None for j in jackknifed)
    assert sum(abs(slope) > 2 * stderr for slope, stderr in jackknifed) <= 3
    # the blocks hold every step, in at most MAX_BLOCKS runs of consecutive steps, each full
    # but the last, which was merging as they went
    fit = fits[0]
    counts = [int(block[2][0, 0]) for block in fit.blocks]
    assert len(counts) <= MAX_BLOCKS and fit.block_steps > BLOCK_STEPS
    assert sum(counts) == 4000 and set(counts[:-1]) == {fit.block_steps}


def test_miss_cost_fit_says_nothing_it_cannot_tell():
    assert fitted_steps(4, (1, 4), hit_rate=0.0).fit() is None  # every read a miss
    assert fitted_steps(5, (1, 4), hit_rate=1.0).fit() is None  # no misses at all
    assert fitted_steps(6, (4,), hit_rate=0.5, steps=3).fit() is None  # too few steps
    assert MissCostFit().to_dict() == {"steps": 0, "us_per_miss": None, "stderr_us": None,
                                       "misses_per_step": None, "step_us": None}  # fmt: skip


def test_miss_cost_fit_counts_every_untimed_decode_step(model, monkeypatch):
    engine = make_engine(model, "--moe-cache-size", "16", "--max-running-requests", "3")
    telemetry = engine.telemetry
    monkeypatch.setattr(telemetry, "want_timing", lambda: False)
    steps = []
    on_step = telemetry.on_step

    def recording(decode_tokens, prefill_tokens, step_s, timer=None):
        steps.append((decode_tokens, prefill_tokens))
        on_step(decode_tokens, prefill_tokens, step_s, timer)

    monkeypatch.setattr(telemetry, "on_step", recording)
    try:
        prompts = [list(range(5, 25)), list(range(30, 40)), list(range(50, 80))]
        for prompt, n in zip(prompts, (12, 24, 36), strict=True):
            engine.add(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        engine.run_until_idle()
        c = engine.moe.counters
        fit = telemetry.miss_cost
        decode_steps = [d for d, p in steps if d and not p]
        assert fit.steps == len(decode_steps) > 30
        assert sorted(fit.sums) == sorted(set(decode_steps)) == [1, 2, 3]  # the batch shrinks
        total = sum(fit.sums.values())
        assert total[0, 1] == c.reads.sum() - c.hits.sum() > 0  # every decode miss, once
        assert total[0, 2] == c.reads.sum()
        stats = telemetry.stats(running=0, queued=0, model_name="m")
        fitted = stats["experts"]["miss_cost"]
        assert fitted["steps"] == len(decode_steps)
        assert fitted["misses_per_step"] == pytest.approx(total[0, 1] / len(decode_steps))
        assert fitted["step_us"] == pytest.approx(1e6 * total[0, 3] / len(decode_steps))
        # /metrics carries the fitted cost once there is one (synthetic steps: 30 µs a miss)
        telemetry.miss_cost = fitted_steps(7, (1, 4), hit_rate=0.6)
        text = render_metrics(telemetry.stats(running=0, queued=0, model_name="m"))[0].decode()
        gauge = next(
            f for f in text_string_to_metric_families(text)
            if f.name == "moelab_expert_miss_cost_seconds"
        )  # fmt: skip
        assert gauge.samples[0].value == pytest.approx(30e-6, abs=3e-6)
    finally:
        engine.close()


def test_cpu_job_times_fit_the_marginal_rate_apart_from_the_fixed_part():
    """Jobs of 1 to 4 experts of 9.4 MB, each 25 µs plus 81 µs an expert (the H200's figures,
    in the tenth session): the marginal rate is 9.4 MB / 81 µs, where the average rate is
    slower, as it spreads the 25 µs over the bytes."""
    times = CpuJobTimes()
    rng = np.random.default_rng(0)
    for k in rng.integers(1, 5, size=64):
        times.add(int(k * 9.4e6), (5e-6, 20e-6 + k * 81e-6))
    want = 9.4e6 / 81e-6 / 1e9
    assert times.marginal_gbps() == pytest.approx(want, rel=1e-9)
    average = times.to_dict()["gbps"]
    assert average < want and times.to_dict()["marginal_gbps"] == times.marginal_gbps()
    # jobs all of one size: no slope to fit
    same = CpuJobTimes()
    for _ in range(8):
        same.add(18_800_000, (5e-6, 180e-6))
    assert same.marginal_gbps() is None and CpuJobTimes().marginal_gbps() is None


def test_cpu_job_times_mean_the_gate_up_phase_and_each_workers_wait():
    times = CpuJobTimes()
    times.add(9_400_000, (2e-6, 90e-6), (4e-6, 1.2e-3), threads=15, phases=(60e-6, 150e-6))
    times.add(9_400_000, (2e-6, 80e-6), (4e-6, 1.1e-3), threads=15, phases=(50e-6, 0.0))
    times.add(9_400_000, (2e-6, 70e-6))  # no workers' figures: in the rate, not in the phases
    d = times.to_dict()
    assert d["phase1_us_mean"] == pytest.approx(55.0)
    assert d["wait_us_mean"] == pytest.approx(5.0)  # 150 µs over 15 workers, over 2 jobs
    assert d["run_us_mean"] == pytest.approx(80.0)
    assert CpuJobTimes().to_dict()["phase1_us_mean"] is None
