"""The context planner's models: hit rates from a what-if curve, speed from bandwidths or a run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moelab.engine.config.memory import MemoryPlanError
from moelab.engine.config.split import DeviceBudget, plan_devices
from moelab.profiles.flags import FlagError, engine_config, validate_flags
from moelab.profiles.machine import GIB, Gpu, Machine, Rates, choose_device, plan_for
from moelab.profiles.planner import (
    HitModel,
    RunObservation,
    miss_seconds,
    plan_context,
    planner_tiers,
)

from .geometry import GPT_OSS, HYBRID, SPECS


def run(**overrides) -> RunObservation:
    """A run of the tiny geometry (3 MoE layers x 16 experts) with a 24-slot cache."""
    fields = dict(
        slots=24,
        experts_total=48,
        reads_per_token=4.0,
        hit_rate=0.7,
        whatif=((12, 0.2), (24, 0.6), (36, 0.8), (48, 1.0)),
        popular_shares=tuple(min(1.0, (i + 1) / 30) for i in range(48)),  # top 30 take all
        decode_tok_s=100.0,
        bp_gbps=2.0,
        bh_gbps=2.0,
        fetch_fraction=0.5,
        slot_bytes=12288,
        server_id=7,
    )
    return RunObservation(**{**fields, **overrides})


def test_hit_rate_sits_where_the_run_was_between_lru_and_the_most_picked() -> None:
    hits = HitModel.from_run(run())
    # at 24 slots LRU gives 0.6, the 24 most picked experts 0.8: the run's 0.7 is half way
    assert hits.blend == pytest.approx(0.5)
    assert hits.hit_rate(24) == pytest.approx(0.7)
    assert hits.hit_rate(12) == pytest.approx(0.2 + 0.5 * (0.4 - 0.2))
    assert hits.hit_rate(18) == pytest.approx(0.4 + 0.5 * (0.6 - 0.4))  # LRU interpolated
    assert hits.hit_rate(48) == 1.0  # everything resident: no misses at all
    assert hits.hit_rate(0) == 0.0
    assert "server 7 (24 slots, hit rate 70%), placed 50% of the way" in str(hits.basis)
    # without picks, the what-if curve alone
    assert HitModel.from_run(run(popular_shares=())).hit_rate(12) == pytest.approx(0.2)


def test_hit_rate_without_a_run_is_a_stated_assumption() -> None:
    hits = HitModel.assumed(48)
    assert hits.hit_rate(12) == 0.25 and hits.hit_rate(48) == 1.0
    assert str(hits.basis).startswith("assumed: uniform routing")


def test_miss_cost_per_policy() -> None:
    # one 9 MiB expert, copies at 24 GB/s, CPU experts at 12 GB/s
    e = 9_437_184
    assert miss_seconds(e, "auto", 24.0, 12.0) == pytest.approx(e / 36e9)
    assert miss_seconds(e, "gpu", 24.0, 12.0) == pytest.approx(e / 24e9)
    assert miss_seconds(e, "cpu", 24.0, 12.0) == pytest.approx(e / 12e9)
    # split:0.25 fetches a quarter: the CPU's three quarters take longer
    assert miss_seconds(e, "split:0.25", 24.0, 12.0) == pytest.approx(e * 0.75 / 12e9)


DEMO_BASE = ["--device", "cpu", "--device-memory", "72383232", "--memory-headroom", "0",
             "--prefill-chunk-tokens", "256", "--max-running-requests", "4"]  # fmt: skip
CPU_PC = Machine("pc", "0.1.0", 2, 24 * GIB)


def test_a_run_predicts_its_own_speed_and_slower_with_fewer_slots() -> None:
    spec = SPECS["tiny"]
    observed = run(slot_bytes=spec.expert_params * 4)
    plan = plan_context(spec, CPU_PC, [*DEMO_BASE, "--kv-reserve-tokens", "1536"], run=observed)
    assert plan.device == "cpu" and plan.budget_source == "--device-memory"
    assert plan.kv_bytes_per_token == 2 * 4 * 32 * 4  # float32 on a CPU
    points = {p.kv_reserve_tokens: p for p in plan.points}
    # every point is a context the engine would plan: slots fall as the KV grows (until it
    # leaves no room at all)
    assert points[1024].slots == 48 and points[1024].all_resident
    assert points[2048].slots < points[1536].slots < 48
    assert not points[4096].fits and "cannot hold" in (points[4096].error or "")
    # the speed model: per token, fixed + 4 reads x (1 - hit) x miss; the fixed part is what
    # the run's 100 tok/s leaves after its own 4 x 0.3 misses
    miss_s = spec.expert_params * 4 / 4e9
    fixed = 1 / 100.0 - 4 * 0.3 * miss_s
    for p in plan.points:
        if p.fits:
            expected = 1 / (fixed + 4 * (1 - p.hit_rate) * miss_s)
            assert p.decode_tok_s == pytest.approx(expected, abs=0.01)
    assert points[2048].decode_tok_s < points[1536].decode_tok_s < points[1024].decode_tok_s
    assert str(plan.speed_basis).startswith(
        "server 7 decoded 100.0 tok/s with 1.20 misses per token"
    )
    assert points[2048].to_json()["flags"] == ["--kv-reserve-tokens", "2048"]


def test_a_run_prices_a_miss_as_its_own_steps_did() -> None:
    spec = SPECS["tiny"]
    flags = [*DEMO_BASE, "--kv-reserve-tokens", "1536"]
    measured = run(slot_bytes=spec.expert_params * 4, policy="auto",
                   miss_cost=(300e-6, 20e-6, 1000))  # fmt: skip
    plan = plan_context(spec, CPU_PC, flags, run=measured)
    # the fit's lower bound, two standard errors below its slope
    fixed = 1 / 100.0 - 4 * 0.3 * 260e-6
    for p in plan.points:
        if p.fits:
            expected = 1 / (fixed + 4 * (1 - p.hit_rate) * 260e-6)
            assert p.decode_tok_s == pytest.approx(expected, abs=0.01)
    bytes_only = spec.expert_params * 4 / 4e9 * 1e6
    assert (
        "each miss costs 260 µs as its own decode steps show (they fitted 300 ± 20 µs over 1000 "
        "steps, taken at 2 standard errors below; the bytes alone, expert of 0.02 MiB at Bp 2.0 "
        f"+ Bh 2.0 GB/s: {bytes_only:.0f} µs)" in str(plan.speed_basis)
    )
    # what the fit cannot vouch for is priced by bandwidth, and the basis says so
    for unusable in (
        replace(measured, policy="gpu"),  # another miss policy
        replace(measured, miss_cost=(300e-6, 200e-6, 1000)),  # lost in its noise
        replace(measured, miss_cost=(300e-6, 20e-6, 100)),  # too few steps
        replace(measured, miss_cost=(4e-6, 1e-7, 1000)),  # clear, but below the bytes' price
        replace(measured, miss_cost=None),  # an engine without the fit
    ):
        basis = str(plan_context(spec, CPU_PC, flags, run=unusable).speed_basis)
        assert f"each miss costs {bytes_only:.0f} µs" in basis and "no clear price" in basis
        if unusable.miss_cost is not None:
            slope, stderr, steps = unusable.miss_cost
            assert f"they fitted {slope * 1e6:.0f} ± {stderr * 1e6:.0f} µs over {steps}" in basis
    # a slope of 2.6 standard errors, as a run that missed nearly every read fitted by chance
    # (213 ± 82 µs for a 4 µs expert), moves the prediction by its lower bound, not its face
    chance = plan_context(
        spec, CPU_PC, flags, run=replace(measured, miss_cost=(213e-6, 82e-6, 2000))
    )
    assert "each miss costs 49 µs as its own" in str(chance.speed_basis)


def test_without_a_run_the_bound_or_nothing() -> None:
    spec = SPECS["30b"]
    gpu = (Gpu(0, "24 GB card", "u", 24 * GIB, 23 * GIB),)
    rates = Rates(h2d_gbps=24.0, device_gbps=900.0, cpu_experts_gbps={15: 24.0})
    plan = plan_context(spec, Machine("pc", "0.1.0", 16, 64 * GIB, gpu, rates), [])
    fits = [p for p in plan.points if p.fits]
    assert plan.device == "cuda:0" and fits
    assert str(plan.speed_basis).startswith("bandwidth bound of one request")
    # 48 layers x 8 experts a token; hit rate assumed S / 6144
    point = fits[-1]
    dense = (spec.dense_params - spec.vocab_size * spec.hidden_size) * 2
    base_slots = next(p.slots for p in plan.points if p.kv_reserve_tokens == 8192)
    hits_bytes = 384 * (base_slots / 6144) * spec.expert_bytes
    fixed = (dense + hits_bytes) / 900e9
    miss = spec.expert_bytes / 48e9
    expected = 1 / (fixed + 384 * (1 - point.slots / 6144) * miss)
    assert point.decode_tok_s == pytest.approx(expected, rel=1e-3)
    # nothing measured: slots and hit rates, no speed
    bare = plan_context(spec, Machine("pc", "0.1.0", 16, 64 * GIB, gpu), [])
    assert bare.speed_basis is None and all(p.decode_tok_s is None for p in bare.points)


def test_run_observation_from_stats() -> None:
    stats = {
        "tokens": {"decode_total": 200},
        "config": {"bp_gbps": 3.0, "bh_gbps": 1.0, "fetch_fraction": 0.75, "policy": "auto"},
        "experts": {
            "num_layers": 2, "num_experts": 4, "slots": 4, "slot_bytes": 100,
            "layers": [{"reads": 300, "hits": 150}, {"reads": 100, "hits": 50}],
            "whatif": [{"slots": 4, "hit_rate": 0.4}, {"slots": 2, "hit_rate": 0.1}],
            "picks": [[5, 1, 0, 0], [3, 1, 0, 0]],
            "miss_cost": {"steps": 400, "us_per_miss": 250.0, "stderr_us": 10.0},
        },
    }  # fmt: skip
    seen = RunObservation.from_stats(stats, decode_tok_s=20.0, server_id=3)
    assert seen is not None
    assert (seen.experts_total, seen.reads_per_token, seen.hit_rate) == (8, 2.0, 0.5)
    assert seen.whatif == ((2, 0.1), (4, 0.4))
    assert seen.popular_shares[:3] == (0.5, 0.8, 0.9)
    assert (seen.bp_gbps, seen.bh_gbps, seen.decode_tok_s) == (3.0, 1.0, 20.0)
    assert seen.policy == "auto" and seen.miss_cost == (250e-6, 10e-6, 400)
    assert seen.measured_miss_s("auto") == pytest.approx(230e-6)
    assert seen.measured_miss_s("gpu") is None
    unfitted = {**stats["experts"], "miss_cost": {"steps": 9, "us_per_miss": None}}
    assert (
        RunObservation.from_stats({**stats, "experts": unfitted}, decode_tok_s=1.0).miss_cost
        is None
    )
    # no decode yet, or no what-if curve (telemetry off): nothing to learn from
    assert RunObservation.from_stats({**stats, "tokens": {}}, decode_tok_s=None) is None
    no_curve = {**stats, "experts": {**stats["experts"], "whatif": []}}
    assert RunObservation.from_stats(no_curve, decode_tok_s=None) is None


def test_tiers_on_the_chart() -> None:
    assert planner_tiers(4096) == [1024, 1536, 2048, 3072, 4096]
    assert planner_tiers(40960, (12000,))[-3:] == [32768, 36864, 40960]
    assert 12000 in planner_tiers(40960, (12000,))


def test_fp8_kv_pages_let_each_context_keep_more_expert_slots() -> None:
    """--kv-cache-dtype fp8 in the base flags: a token's KV costs FP8 bytes and a factor per head,
    so a context that fits in float32 pages leaves more slots, and a longer one fits."""
    spec = SPECS["tiny"]
    flags = [*DEMO_BASE, "--kv-reserve-tokens", "1536"]
    fp32 = plan_context(spec, CPU_PC, flags)
    fp8 = plan_context(spec, CPU_PC, [*flags, "--kv-cache-dtype", "fp8"])
    assert fp8.kv_bytes_per_token == 2 * 4 * 2 * (16 + 4)  # layers, KV heads, bits and factor
    fp32_points = {p.kv_reserve_tokens: p for p in fp32.points}
    fp8_points = {p.kv_reserve_tokens: p for p in fp8.points}
    assert fp8_points[2048].slots > fp32_points[2048].slots
    assert not fp32_points[4096].fits and fp8_points[4096].fits


def test_a_hybrid_models_contexts_count_kv_of_its_attention_layers_and_fixed_states() -> None:
    """Qwen3.6-35B-A3B on a 24 GB card: each point counts 20 KiB of KV a token (10 attention
    layers of 40) and the same states (61.4 MiB each: 8 running sequences, the graphs' padding
    slot and 8 state checkpoints), so the whole 262,144-token context fits beside 1,279 expert
    slots, where the same geometry with KV in every layer does not fit it and keeps 408 slots at
    196,608 tokens (the hybrid 1,514); each beside a last prefill chunk's keys and values
    gathered from the whole context."""
    spec = HYBRID
    gpu = (Gpu(0, "24 GB card", "u", 24 * GIB, 23 * GIB),)
    pc = Machine("pc", "0.1.0", 16, 96 * GIB, gpu)
    plan = plan_context(spec, pc, [])
    per_seq = 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    assert plan.kv_bytes_per_token == 2 * 10 * 2 * 256 * 2
    body = plan.to_json()
    assert (body["attention_layers"], body["linear_layers"]) == (10, 30)
    assert body["state_bytes_per_seq"] == per_seq
    assert (body["state_sequences"], body["state_checkpoints"]) == (8, 8)
    assert body["state_bytes"] == 17 * per_seq
    whole = plan.point(262144)
    assert whole is not None and whole.fits and whole.context_tokens == 262144
    assert whole.slots == 1279
    everywhere = replace(spec, layer_types=("full_attention",) * 40, linear_attention=None)
    dense = plan_context(everywhere, pc, [])
    assert dense.to_json()["state_bytes"] == 0
    assert not dense.point(262144).fits
    assert (dense.point(196608).slots, plan.point(196608).slots) == (408, 1514)


def test_a_split_plans_each_card_and_sums_their_kv_and_slots() -> None:
    """Two 12 GiB cards under --devices: the context planner's KV is the two cards' together
    (each holds its own layers' share of every token), and at each context the split keeps more
    than twice one card's expert slots (the dense weights are not held twice)."""
    spec = SPECS["30b"]
    cards = (Gpu(0, "RTX 3060", None, 12 * GIB, 12 * GIB), Gpu(1, "RTX 3060", None, 12 * GIB))
    pc = Machine("pc", "0.1.0", 16, 64 * GIB, cards)
    one = plan_context(spec, pc, [])
    two = plan_context(spec, pc, ["--devices", "cuda:0,cuda:1"])
    assert two.device == "cuda:0,cuda:1" and two.budget_bytes == 24 * GIB
    config = engine_config(["--devices", "cuda:0,cuda:1", "--kv-reserve-tokens", "8192"])
    split = plan_devices(
        spec,
        config.memory_request(budget_bytes=0, elem_bytes=2, cuda=False),
        (DeviceBudget("cuda:0", 12 * GIB, 1.0), DeviceBudget("cuda:1", 12 * GIB, 1.0)),
    )
    point = next(p for p in two.points if p.kv_reserve_tokens == 8192)
    assert point.kv_bytes == sum(p.kv_bytes for p in split.plans) == split.total.kv_bytes
    assert [p.kv_tokens for p in split.plans] == [point.context_tokens] * 2
    for a, b in zip(one.points, two.points, strict=True):
        assert b.slots > 2 * a.slots


def test_a_model_that_fits_neither_card_alone_is_planned_across_both() -> None:
    spec = SPECS["30b"]  # 2.9 GiB of dense weights in bf16
    cards = (Gpu(0, "a", None, int(2.6 * GIB), int(2.6 * GIB)), Gpu(1, "b", None, 3 * GIB))
    pc = Machine("pc", "0.1.0", 16, 64 * GIB, cards)
    flags = ["--kv-reserve-tokens", "4096"]
    alone = engine_config(["--device", "cuda:0", *flags])
    with pytest.raises(MemoryPlanError, match="cannot hold the dense weights"):
        plan_for(spec, choose_device(pc, spec, alone), alone)
    both = engine_config(["--devices", "cuda:0,cuda:1", *flags])
    plan = plan_for(spec, choose_device(pc, spec, both), both)
    assert plan.kv_tokens >= 4096 and plan.weights_bytes == spec.dense_params * 2
    missing = engine_config(["--devices", "cuda:0,cuda:2"])
    with pytest.raises(MemoryPlanError, match="this machine has no GPU 2"):
        choose_device(pc, spec, missing)


def test_a_gpt_oss_context_counts_its_sliding_layers_at_their_windows_pages() -> None:
    """gpt-oss-120b on a 12 GB card: each point counts 36 KiB of KV a token (the 18 full layers)
    and 4.5 MiB per sequence of the 18 sliding layers' 128-token windows, so 32K keeps 184
    expert slots and 48K 138, where pages for the whole context in every layer keep 104 and 10
    (and the windows' pages are no state of a linear layer); each beside a last prefill chunk's
    attention (the sliding layers' over their window, the full ones' keys gathered)."""
    gpu = (Gpu(0, "12 GB card", "u", 12 * GIB, 12 * GIB),)
    pc = Machine("pc", "0.1.0", 16, 64 * GIB, gpu)
    plan = plan_context(GPT_OSS, pc, [])
    per_seq = 18 * 128 * 2 * 8 * 64 * 2
    assert plan.kv_bytes_per_token == 2 * 18 * 8 * 64 * 2
    body = plan.to_json()
    assert (body["attention_layers"], body["sliding_layers"], body["linear_layers"]) == (18, 18, 0)
    assert body["window_tokens"] == 128 and body["state_bytes_per_seq"] == per_seq
    assert body["state_bytes"] == 17 * per_seq
    assert (plan.point(32768).slots, plan.point(49152).slots) == (184, 138)
    paged = plan_context(replace(GPT_OSS, sliding_layers=(), sliding_window=0), pc, [])
    assert paged.to_json()["state_bytes"] == 0
    assert (paged.point(32768).slots, paged.point(49152).slots) == (104, 10)


def test_a_split_plans_each_card_at_its_own_device_memory() -> None:
    spec = SPECS["30b"]
    cards = (Gpu(0, "RTX 4090", None, 24 * GIB, 24 * GIB), Gpu(1, "RTX 3060", None, 12 * GIB))
    pc = Machine("pc", "0.1.0", 16, 64 * GIB, cards)
    config = engine_config(["--devices", "cuda:0,cuda:1", "--device-memory", "12GiB,8GiB"])
    choice = choose_device(pc, spec, config)
    assert [d.budget_bytes for d in choice.split] == [12 * GIB, 8 * GIB]
    assert choice.budget_bytes == 20 * GIB and choice.budget_source == "--device-memory"
    with pytest.raises(FlagError, match="gives 3 sizes for 2 device"):
        validate_flags(["--devices", "cuda:0,cuda:1", "--device-memory", "1GiB,2GiB,3GiB"])


def _gpu_rows(index: int, name: str, vram: int, gen: int, width: int, memory: float) -> list:
    """The daemon's inventory rows of one GPU, as the API gives them."""
    return [
        {"kind": kind, "value": value, "params": {"gpu_index": index}, "gpu_name": name,
         "gpu_uuid": f"GPU-{index}"}
        for kind, value in (
            ("gpu.vram_total", vram), ("gpu.vram_free", vram), ("gpu.pcie_gen_max", gen),
            ("gpu.pcie_width_max", width), ("gpu.memory_gbps", memory),
        )
    ]  # fmt: skip


def test_a_split_weighs_each_card_by_its_own_link_and_memory() -> None:
    """An RTX 4090 (PCIe 4.0 x16, 1008 GB/s) and an RTX 3060 (PCIe 3.0 x8, 360 GB/s), the copy
    measured on the 4090 alone: the 3060's link is a quarter of its rate, and at the same 12
    GiB each the 3060 takes fewer layers; a copy measured on each card is its own."""
    spec = SPECS["30b"]
    rows = [
        *_gpu_rows(0, "RTX 4090", 24 * GIB, 4, 16, 1008.0),
        *_gpu_rows(1, "RTX 3060", 12 * GIB, 3, 8, 360.0),
        {"kind": "h2d_pinned", "value": 25.0, "params": {"gpu_index": 0}},
    ]
    identity = {"machine_id": "pc", "engine_version": "0.1.0", "physical_cores": 16,
                "ram_total_bytes": 64 * GIB}  # fmt: skip
    pc = Machine.from_measurements(rows, **identity)
    config = engine_config(["--devices", "cuda:0,cuda:1", "--device-memory", "12GiB"])
    choice = choose_device(pc, spec, config)
    assert [round(d.link_gbps, 2) for d in choice.split] == [25.0, 6.25]
    assert [d.memory_gbps for d in choice.split] == [1008.0, 360.0]
    request = config.memory_request(budget_bytes=0, elem_bytes=2, cuda=False)
    split = plan_devices(spec, request, choice.split)
    counts = [len(r) for r in split.ranges]
    assert counts[1] < counts[0] and sum(counts) == 48
    both = Machine.from_measurements(
        [*rows, {"kind": "h2d_pinned", "value": 12.0, "params": {"gpu_index": 1}}], **identity
    )
    assert [d.link_gbps for d in choose_device(both, spec, config).split] == [25.0, 12.0]
    # the context planner lists each card at the base flags and names the one that limits
    cards = plan_context(spec, pc, ["--devices", "cuda:0,cuda:1", "--device-memory", "12GiB"])
    listed = cards.to_json()["cards"]
    assert [c["device"] for c in listed] == ["cuda:0", "cuda:1"]
    assert [c["link_gbps"] for c in listed] == [25.0, 6.25]
    assert listed[0]["layers"][0] == 0 and listed[1]["layers"][1] == 47
    assert sum(c["limits"] for c in listed) == 1
    limit = next(c for c in listed if c["limits"])
    assert limit["limit"].startswith(f"{limit['device']} limits the step")
    assert plan_context(spec, pc, []).to_json()["cards"] == []
