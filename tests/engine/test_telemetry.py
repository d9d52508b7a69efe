"""Telemetry: the what-if curve against brute-force LRU, per-layer counters against a trace."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from moelab.engine.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from moelab.engine.whatif import StackDistances

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
    engine = make_engine(model, "--moe-cache-size", "20", "--moe-miss-policy", "gpu")
    try:
        prompts = [list(range(10, 40)), list(range(60, 90))]
        engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
        c = engine.moe.counters
        observed = c.hits.sum() / c.reads.sum()
        whatif = engine.telemetry.whatif
        assert whatif.accesses == c.reads.sum()
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
