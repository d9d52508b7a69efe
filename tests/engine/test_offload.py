"""Offloaded experts give the same results as all-resident ones, and the cache behaves as an LRU."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize

from .reference import make_engine, relative_error

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


@pytest.fixture(autouse=True)
def equal_rates(monkeypatch):
    """Bp = Bh, so the auto policy fetches half of the misses whatever machine runs the tests."""
    import moelab.engine.runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "measure_bp_gbps", lambda bank, device: 10.0)
    monkeypatch.setattr(engine_module, "measure_bh_gbps", lambda runner, bank: 10.0)


POLICIES = ["auto", "gpu", "cpu", "split:0.5"]
PROMPTS = [list(range(3, 23)), list(range(40, 47)), list(range(100, 131))]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = synthesize(
        tmp_path_factory.mktemp(request.param),
        arch=request.param,
        preset="tiny",
        routing_skew=0.8,
        seed=5,
        overrides={"num_experts": 16},
    )
    resident = make_engine(path, "--moe-cache-rate", "1.0")
    assert resident.cache.holds_everything
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs = resident.generate(PROMPTS, params)
    full = [p + o for p, o in zip(PROMPTS, outputs, strict=True)]
    logits = [resident.score(ids) for ids in full]
    resident.close()
    return path, outputs, full, logits


def _margins(logits: torch.Tensor) -> list[float]:
    top2 = torch.topk(logits, 2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def _assert_same_tokens(outputs, ref_outputs, ref_logits) -> None:
    """The greedy tokens are the resident engine's, up to the first near tie of its logits."""
    for prompt, out, ref, ref_full_logits in zip(
        PROMPTS, outputs, ref_outputs, ref_logits, strict=True
    ):
        margins = _margins(ref_full_logits)[len(prompt) - 1 :]
        for i, (a, b) in enumerate(zip(out, ref, strict=True)):
            if margins[i] <= 1e-3:
                break
            assert a == b, f"token {i}: offloaded {a} != resident {b}"


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompt", "chunked"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("slots", ["one-layer", "half"])
def test_offloaded_matches_all_resident(model, policy, slots, chunked):
    path, ref_outputs, full, ref_logits = model
    num_slots = 16 if slots == "one-layer" else 24  # tiny: 3 MoE layers x 16 experts
    flags = ["--moe-cache-size", str(num_slots), "--moe-miss-policy", policy]
    if chunked:
        flags += ["--prefill-chunk-tokens", "5"]
    engine = make_engine(path, *flags)
    try:
        assert not engine.cache.holds_everything and engine.cache.slots == num_slots
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
        c = engine.moe.counters
        fills, cpu, evictions = int(c.fills.sum()), int(c.cpu.sum()), engine.cache.evictions
        for ids, ref in zip(full, ref_logits, strict=True):
            assert relative_error(engine.score(ids), ref) < 1e-4
    finally:
        engine.close()
    _assert_same_tokens(outputs, ref_outputs, ref_logits)
    # the identity is not won by never missing
    if policy == "cpu":
        assert fills == 0 and cpu > 0
    elif policy == "gpu":
        assert fills > 0 and evictions > 0
    else:
        assert fills > 0 and evictions > 0 and cpu > 0


def test_cpu_tasks_run_again_decode_the_same_tokens(model):
    """--moe-cpu-redo-us 1, three CPU workers: an idle worker runs again nearly every task of a
    decode step's CPU job that it finds in flight, and the first run to finish writes it. The
    tokens are still the resident engine's; the config says what is in force."""
    path, ref_outputs, _, ref_logits = model
    flags = ["--moe-cache-size", "16", "--moe-miss-policy", "cpu"]
    engine = make_engine(path, *flags, "--moe-cpu-threads", "3", "--moe-cpu-redo-us", "1")
    try:
        assert engine.config_in_force()["cpu_redo_us"] == 1
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
        assert engine.moe.counters.cpu.sum() > 0 and engine.moe.cpu_times.jobs > 0
        engine.cpu.redo_us = 0
        assert engine.config_in_force()["cpu_redo_us"] == 0
    finally:
        engine.close()
    _assert_same_tokens(outputs, ref_outputs, ref_logits)


def test_frequency_admission_decodes_the_same_tokens(model):
    """--moe-cache-admission frequency changes where fills go in the cache's recency order, not
    what a step computes: the resident engine's tokens, from other hits and fills than recent
    admission's over the same requests; the config says what is in force. An engine started
    with recent admission and switched to frequency (`set_cache_admission`, as bench decode's
    --alternate-cache-admission does between runs) makes frequency's hits and fills."""
    path, ref_outputs, _, ref_logits = model
    flags = ["--moe-cache-size", "16", "--moe-miss-policy", "split:0.5"]
    counts = {}
    for admission, switch in (("frequency", None), ("recent", None), ("recent", "frequency")):
        engine = make_engine(path, *flags, "--moe-cache-admission", admission)
        try:
            assert engine.config_in_force()["cache_admission"] == admission
            if switch is not None:
                engine.moe.set_cache_admission(switch)
            outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
            c = engine.moe.counters
            counts[switch or admission, switch is not None] = (
                int(c.hits.sum()),
                int(c.fills.sum()),
            )
        finally:
            engine.close()
        _assert_same_tokens(outputs, ref_outputs, ref_logits)
    frequency, recent = counts["frequency", False], counts["recent", False]
    assert frequency[1] > 0 and frequency != recent
    assert counts["frequency", True] == frequency


@pytest.mark.parametrize("policy", ["gpu", "split:0.5"])
def test_cache_matches_an_independent_lru_simulation(tmp_path, policy):
    """With recent admission (LRU) the cache's hits, fills and evictions are an LRU's over the
    routing the router saw."""
    path = synthesize(
        tmp_path / "m", preset="tiny", routing_skew=0.5, seed=6, overrides={"num_experts": 16}
    )
    flags = ["--moe-cache-size", "20", "--moe-miss-policy", policy]
    engine = make_engine(path, *flags, "--moe-cache-admission", "recent")
    spec = engine.spec
    trace: list[tuple[int, np.ndarray]] = []  # recorded from the router, step by step
    fetched_log: list[list[int]] = []

    def on_router(layer, x, ids):
        if x.shape[0] <= 3:  # decode steps of the three sequences below
            trace.append((spec.moe_index(layer), ids.cpu().numpy().copy()))

    engine.model.on_router = on_router
    engine.moe.stats.on_decode_step.append(
        lambda layer, experts, slots, fetched, cpu: fetched_log.append(list(fetched))
    )
    # prompts longer than the streaming threshold: prefill never touches the cache
    prompts = [list(range(10, 40)), list(range(50, 70)), list(range(80, 120))]
    engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.close()
    c = engine.moe.counters
    lru: OrderedDict[int, None] = OrderedDict()
    hits = fills = evictions = 0
    assert len(trace) == len(fetched_log)
    for (layer, ids), fetched in zip(trace, fetched_log, strict=True):
        experts = np.unique(ids)
        keys = [layer * spec.num_experts + int(e) for e in experts]
        protected = set()
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
                hits += 1
                protected.add(key)
        for e in fetched:
            key = layer * spec.num_experts + e
            assert key not in lru
            if len(lru) >= 20:
                victim = next(k for k in lru if k not in protected)
                del lru[victim]
                evictions += 1
            lru[key] = None
            protected.add(key)
            fills += 1
    assert (hits, fills, evictions) == (
        int(c.hits.sum()),
        int(c.fills.sum()),
        engine.cache.evictions,
    )
    assert fills > 20 and evictions > 0


def test_concurrent_sequences_match_running_alone(tmp_path):
    path = synthesize(tmp_path / "m", preset="tiny", routing_skew=1.0, seed=7)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 11, 25, 7, 60, 19, 2)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = make_engine(path, "--moe-cache-rate", "0.5", "--prefill-chunk-tokens", "16")
    try:
        alone = [engine.generate([p], params)[0] for p in prompts]
        together = engine.generate(prompts, params)
        assert together == alone
        assert engine.kv.used_blocks == 0
    finally:
        engine.close()


def test_cancel_frees_kv_at_once(tmp_path):
    path = synthesize(tmp_path / "m", preset="tiny", seed=8)
    engine = make_engine(path)
    try:
        seq = engine.add(list(range(1, 30)), SamplingParams(max_tokens=500, ignore_eos=True))
        for _ in range(3):
            engine.step()
        assert engine.kv.used_blocks > 0 and seq.output_ids
        engine.cancel(seq)
        assert engine.kv.used_blocks == 0 and seq.finish_reason == "cancelled"
        assert engine.scheduler.idle
    finally:
        engine.close()


def test_requests_that_do_not_fit_wait_instead_of_failing(tmp_path):
    path = synthesize(tmp_path / "m", preset="tiny", seed=9)
    engine = make_engine(
        path, "--kv-reserve-tokens", "128", "--moe-cache-rate", "0.5", "--kv-block-size", "16"
    )
    try:
        assert engine.kv.capacity_tokens == 128
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        seqs = [engine.add(list(range(1, 41)), params) for _ in range(3)]  # 80 tokens each
        engine.step()
        assert len(engine.scheduler.running) == 1 and len(engine.scheduler.waiting) == 2
        engine.run_until_idle()
        assert all(len(s.output_ids) == 40 for s in seqs)
    finally:
        engine.close()


def test_exactly_the_advertised_context_fits(tmp_path):
    path = synthesize(tmp_path / "m", preset="tiny", seed=10)
    engine = make_engine(path, "--kv-reserve-tokens", "96", "--moe-cache-rate", "0.5")
    try:
        assert engine.max_context == 96
        seq = engine.add(list(range(1, 81)), SamplingParams(max_tokens=16, ignore_eos=True))
        engine.run_until_idle()
        assert len(seq.output_ids) == 16
        with pytest.raises(ValueError, match="97 exceeds the usable context of 96"):
            engine.add(list(range(1, 82)), SamplingParams(max_tokens=16))
    finally:
        engine.close()


def test_the_auto_split_finds_its_way_back_to_the_cpu(tmp_path, monkeypatch, caplog):
    """A CPU rate so low that no miss runs on the CPU is never measured again by jobs: after
    RECOVER_AFTER_STEPS such layer steps the split moves it half-way back to the start-up rate
    (10 GB/s here), the CPU gets jobs again, and each return it makes doubles the next wait."""
    import moelab.engine.experts.misses as misses_module
    from moelab.engine.experts.misses import MissPolicy
    from moelab.engine.experts.moe_stats import CpuJobTimes

    path = synthesize(
        tmp_path / "m", preset="tiny", routing_skew=0.5, seed=6, overrides={"num_experts": 16}
    )
    monkeypatch.setattr(misses_module, "RECOVER_AFTER_STEPS", 3)
    engine = make_engine(path, "--moe-cache-size", "20", "--moe-miss-policy", "auto")
    try:
        moe, split = engine.moe, engine.moe.split
        # a collapsed rate: f = 10 / 10.5, every miss of a layer step is fetched
        split.policy = MissPolicy.auto(10.0, 0.5)
        assert moe.policy.fetch_count(2) == 2 and moe.policy.fetch_count(3) == 3
        jobs = moe.cpu_times.jobs
        with caplog.at_level("INFO", logger="moelab.engine"):
            engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
        returns = [r.getMessage() for r in caplog.records if "auto miss split" in r.getMessage()]
        assert returns, "the split never moved its CPU rate back"
        assert "3 layer steps with misses ran none on the CPU" in returns[0]
        assert "goes from 0.5 back to 5.2 GB/s (start-up 10.0)" in returns[0]
        assert moe.cpu_times.jobs > jobs  # the CPU ran misses again, and was measured
        assert moe.policy.bh_gbps > 0.5

        # the wait: counted over steps with misses that ran none on the CPU (one that ran some
        # does not reset it, a window of jobs measuring the CPU does), doubled by each return,
        # short again once a window measures the CPU healthy
        split.policy = MissPolicy.auto(10.0, 1.0)
        split._steps_without_cpu, split._recover_after = 0, 3
        for used in (False, True, False):
            split.note_cpu_use(used)
        assert moe.policy.bh_gbps == 1.0 and split._steps_without_cpu == 2
        window = CpuJobTimes()
        window.add(1_000_000_000, (0.0, 1.0))  # 1 GB/s: the rate stays, the count starts again
        split._window = window
        split._adapt()
        assert moe.policy.bh_gbps == 1.0 and split._steps_without_cpu == 0
        for _ in range(2):
            split.note_cpu_use(False)
        assert moe.policy.bh_gbps == 1.0
        split.note_cpu_use(False)
        assert moe.policy.bh_gbps == pytest.approx(5.5) and split._recover_after == 6
        assert split._adapt_every == misses_module.ADAPT_AFTER_RECOVERY_JOBS
        split.policy = MissPolicy.auto(10.0, 1.0)
        for _ in range(5):
            split.note_cpu_use(False)
        assert moe.policy.bh_gbps == 1.0  # 6 steps now
        split.note_cpu_use(False)
        assert moe.policy.bh_gbps == pytest.approx(5.5) and split._recover_after == 12
        window = CpuJobTimes()
        window.add(8_000_000_000, (0.0, 1.0))  # 8 GB/s: blended with 5.5, at least half of 10
        split._window = window
        split._adapt()
        assert moe.policy.bh_gbps == pytest.approx(6.75) and split._recover_after == 3
        assert split._adapt_every == misses_module.ADAPT_EVERY_JOBS
        # a rate at or above the start-up one is left where it is
        split.policy = MissPolicy.auto(10.0, 12.0)
        for _ in range(10):
            split.note_cpu_use(False)
        assert moe.policy.bh_gbps == 12.0
    finally:
        engine.close()


def test_the_auto_split_follows_the_cpu_rate_decode_sees(tmp_path, monkeypatch):
    import moelab.engine.experts.misses as misses_module
    from moelab.engine.experts.misses import MissPolicy
    from moelab.engine.experts.moe_stats import CpuJobTimes

    path = synthesize(
        tmp_path / "m", preset="tiny", routing_skew=0.5, seed=6, overrides={"num_experts": 16}
    )
    monkeypatch.setattr(misses_module, "ADAPT_EVERY_JOBS", 4)
    engines = {p: make_engine(path, "--moe-cache-size", "20", "--moe-miss-policy", p)
               for p in ("auto", "split:0.5")}  # fmt: skip
    try:
        for engine in engines.values():
            engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
        auto, fixed = engines["auto"].moe, engines["split:0.5"].moe
        # a window of jobs at least (how many more the moved split leaves the CPU is the
        # machine's)
        assert auto.cpu_times.jobs >= misses_module.ADAPT_EVERY_JOBS
        # the start-up rates were 10 and 10 GB/s; the workers' own timing moved Bh, and the
        # fraction fetched follows it
        assert auto.policy.bh_gbps != 10.0 and auto.policy.bp_gbps == 10.0
        assert auto.policy.fetch_fraction == pytest.approx(10.0 / (10.0 + auto.policy.bh_gbps))
        assert engines["auto"].config_in_force()["fetch_fraction"] == auto.policy.fetch_fraction
        assert fixed.policy == MissPolicy("split", 0.5)
        # one window: 6 GB in 0.1 s busy (reaction + run) is 60 GB/s, blended half with 100
        auto.split.policy = MissPolicy.auto(50.0, 100.0)
        auto.split._window = CpuJobTimes(
            jobs=4, weight_bytes=6_000_000_000, start_s=0.02, run_s=0.08
        )
        auto.split._adapt()
        assert auto.policy == MissPolicy.auto(50.0, 80.0)
        assert auto.policy.fetch_fraction == pytest.approx(50 / 130)
        # jobs of one and of three experts (1 and 3 GB), 10 ms and 20 ms: a fixed 5 ms, and
        # 200 GB/s beyond it; blended half with 80
        window = CpuJobTimes()
        for gb, seconds in ((1, 0.010), (3, 0.020), (1, 0.010), (3, 0.020)):
            window.add(gb * 1_000_000_000, (0.0, seconds))
        auto.split._window = window
        auto.split._adapt()
        assert auto.policy.bh_gbps == pytest.approx(140.0)
    finally:
        for engine in engines.values():
            engine.close()
