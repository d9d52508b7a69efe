"""The parts of the MoE layer's runtime on their own: the miss split's controller fed a sequence of
CPU rates, the decode counters fed one call per layer step, the staged decode's host buffers, the
runner's settings, and telemetry given the parts."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moelab.engine.config import memory
from moelab.engine.config.memory import VramPlan
from moelab.engine.experts import misses
from moelab.engine.experts.bank import ExpertBank
from moelab.engine.experts.cache import ExpertCache
from moelab.engine.experts.miss_plan import Dispatch, Handoff
from moelab.engine.experts.misses import MissPolicy, MissSplit
from moelab.engine.experts.moe import MoERunner
from moelab.engine.experts.moe_stats import DecodeStats, StagedStep
from moelab.engine.experts.staged_decode import StagedBuffers
from moelab.engine.model.kv import KVCache
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.runtime.scheduler import Scheduler
from moelab.engine.runtime.telemetry import Telemetry

GB = 1_000_000_000


def _window(split: MissSplit, gbps: float, jobs: int, gb: float = 1.0) -> None:
    """`jobs` CPU jobs of `gb` GB each at `gbps`, by their own timing (reaction, run)."""
    for _ in range(jobs):
        split.job_done(int(gb * GB), (0.0, gb / gbps))


def test_the_auto_split_follows_a_sequence_of_cpu_rates(monkeypatch):
    """Each window of jobs blends half of the rate it shows into the rate the split plans with,
    and the share of misses copied follows it; a window not yet full changes nothing."""
    monkeypatch.setattr(misses, "ADAPT_EVERY_JOBS", 4)
    split = MissSplit(MissPolicy.auto(50.0, 100.0))
    _window(split, 60.0, 3)
    assert split.policy == MissPolicy.auto(50.0, 100.0)
    planned = []
    _window(split, 60.0, 1)
    planned.append(split.policy.bh_gbps)
    for gbps in (60.0, 200.0, 20.0):
        _window(split, gbps, 4)
        planned.append(split.policy.bh_gbps)
    assert planned == pytest.approx([80.0, 70.0, 135.0, 77.5])
    assert split.policy.fetch_fraction == pytest.approx(50.0 / (50.0 + 77.5))
    # jobs of 1 and 3 GB in 10 and 20 ms: 5 ms fixed and 200 GB/s beyond it, which the planner
    # prices apart from the fixed part (CPU_FIXED): the window's marginal rate, at most twice
    # its average (4 GB in 30 ms)
    for gb, seconds in ((1, 0.010), (3, 0.020), (1, 0.010), (3, 0.020)):
        split.job_done(gb * GB, (0.0, seconds))
    assert split.policy.bh_gbps == pytest.approx(0.5 * (77.5 + 200.0))


def test_a_fixed_split_stays_whatever_the_cpu_shows(monkeypatch):
    monkeypatch.setattr(misses, "ADAPT_EVERY_JOBS", 4)
    split = MissSplit(MissPolicy("split", 0.5))
    for gbps in (1.0, 500.0):
        _window(split, gbps, 8)
        split.note_cpu_use(False)
    assert split.policy == MissPolicy("split", 0.5)
    assert split.snapshot() == {"policy": "split"}


def test_the_auto_split_comes_back_to_a_cpu_no_job_measures(monkeypatch):
    """A rate so low that the CPU runs no miss moves half-way back to the start-up rate after
    RECOVER_AFTER_STEPS layer steps with misses and none on the CPU (steps with some on the CPU do
    not reset the count); each return the CPU's jobs do not confirm doubles the wait, and a
    window of jobs at a healthy rate makes it short again."""
    monkeypatch.setattr(misses, "RECOVER_AFTER_STEPS", 3)
    monkeypatch.setattr(misses, "ADAPT_EVERY_JOBS", 4)
    split = MissSplit(MissPolicy.auto(10.0, 10.0))
    _window(split, 1.0, 4)
    _window(split, 1.0, 4)
    _window(split, 1.0, 4)
    assert split.policy.bh_gbps == pytest.approx(2.125)  # collapsed: 10 -> 5.5 -> 3.25 -> 2.125
    for used in (False, True, False):
        split.note_cpu_use(used)
    assert split.policy.bh_gbps == pytest.approx(2.125)
    split.note_cpu_use(False)
    assert split.policy.bh_gbps == pytest.approx(6.0625)  # half-way back to 10
    for _ in range(5):
        split.note_cpu_use(False)
    assert split.policy.bh_gbps == pytest.approx(6.0625)  # the wait is 6 steps now
    split.note_cpu_use(False)
    assert split.policy.bh_gbps == pytest.approx(8.03125)
    # after a return the next window is judged after ADAPT_AFTER_RECOVERY_JOBS jobs
    _window(split, 9.0, misses.ADAPT_AFTER_RECOVERY_JOBS - 1)
    assert split.policy.bh_gbps == pytest.approx(8.03125)
    _window(split, 9.0, 1)
    assert split.policy.bh_gbps == pytest.approx(0.5 * (8.03125 + 9.0))
    # that window found the CPU healthy (at least half the start-up rate): a short wait again
    split.policy = MissPolicy.auto(10.0, 1.0)
    for _ in range(3):
        split.note_cpu_use(False)
    assert split.policy.bh_gbps == pytest.approx(5.5)
    # a rate at or above the start-up one stays where it is
    split.policy = MissPolicy.auto(10.0, 12.0)
    for _ in range(50):
        split.note_cpu_use(False)
    assert split.policy.bh_gbps == 12.0


def _dispatch(experts, slots, admitted, on_cpu, **fields) -> Dispatch:
    missing = [e for e, s in zip(experts, slots, strict=True) if s < 0]
    routes = np.zeros((1, len(experts)), dtype=np.int32)
    return Dispatch(experts, slots, missing, admitted, on_cpu, routes, None, **fields)


def test_one_call_a_launch_counts_and_times_its_staged_layer_steps():
    """`staged_steps`: each step counted, its stages, what its plan had (a CPU job, a guess,
    blocks fetched ahead, a split, a copy ahead), its period from the last layer step's routing
    keyed by that step's plan, and the boundary between two decode steps; then the launch's
    replay and the counting's own time; an eager layer breaks the chain."""
    stats = DecodeStats(num_layers=3, num_experts=8)
    guessed = _dispatch([1, 2, 5], [0, -1, -1], [(2, 3)], [5], job=object(), guessed=True,
                        owned_blocks=2, guess_s=1e-5)  # fmt: skip
    split = _dispatch([3, 4], [-1, -1], [], [3, 4], job=object(), split=(4, 6, 8), ahead_rows=4,
                      ahead_missed=True, guessed=True, guess_s=2e-5, guess_late=True)  # fmt: skip
    hits = _dispatch([6, 7], [1, 2], [], [])
    steps = [  # (dispatch, layer, routing's arrival, piece launched)
        (guessed, 0, 10.000, 9.990),
        (split, 1, 10.001, 10.0005),
        (hits, 2, 10.003, 10.002),
        (guessed, 0, 10.010, 10.006),  # the next decode step
    ]
    for i, (d, layer, arrived, launched) in enumerate(steps):
        step = StagedStep(d, layer, arrived - 1e-6 * i, arrived, 2e-6, 3e-6, 4e-6, launched)
        stats.staged_steps([step], 1e-6, time.perf_counter())
    stats.break_chain()  # an eager step between
    step = StagedStep(split, 1, 11.0 - 1e-6, 11.0, 2e-6, 3e-6, 0.0, None)
    stats.staged_steps([step], 0.0, time.perf_counter())
    t = stats.staged_times
    assert (t.layer_steps, t.cpu_jobs, t.split_misses, t.guesses, t.prefetched_jobs) == (
        5, 4, 2, 4, 2,
    )  # fmt: skip
    assert (t.copied_ahead, t.ahead_missed, t.guess_plans, t.guess_late) == (2, 2, 4, 2)
    assert t.guess_s == pytest.approx(2e-5 + 2 * 2e-5)
    assert (t.sync_s, t.plan_s, t.fill_s, t.replay_s) == pytest.approx((7e-6, 10e-6, 15e-6, 20e-6))
    assert t.count_s > 0
    assert set(t.periods) == {"1+1p", "0+2swa"}
    assert t.periods["1+1p"] == [1, pytest.approx(0.001)]
    assert t.periods["0+2swa"] == [1, pytest.approx(0.002)]
    assert (t.boundaries, t.boundary_s, t.boundary_host_s) == (
        1, pytest.approx(0.007), pytest.approx(0.003),
    )  # fmt: skip
    assert stats.counters.reads.tolist() == [6, 4, 2]  # each step counted once
    assert stats.snapshot()["staged_layer_us"] == t.to_dict()


def test_one_call_a_counted_layer_step_counts_it_and_tells_the_observers():
    """`layer_step`: reads, hits, fills and CPU experts per layer, each observer told the step,
    and the accesses in the order the cache saw them, handed over in batches."""
    stats = DecodeStats(num_layers=2, num_experts=8)
    seen, handed = [], []
    stats.on_decode_step.append(lambda *step: seen.append(step))
    stats.on_accesses = handed.append
    stats.layer_step(_dispatch([1, 2, 5], [0, -1, -1], [(2, 3)], [5]), 1)
    stats.layer_step(_dispatch([0, 3], [4, 5], [], []), 0)
    c = stats.counters
    assert (c.reads.tolist(), c.hits.tolist(), c.fills.tolist(), c.cpu.tolist()) == (
        [2, 3], [2, 1], [0, 1], [0, 1],
    )  # fmt: skip
    assert seen == [(1, [1, 2, 5], [0, -1, -1], [2], [5]), (0, [0, 3], [4, 5], [], [])]
    stats.flush_accesses(at_least=6)  # 5 so far: kept
    assert handed == []
    stats.flush_accesses()
    assert [a.tolist() for a in handed] == [[9, 10, 13, 0, 3]]
    stats.flush_accesses()
    assert len(handed) == 1


def test_a_steps_staged_views_are_made_once_and_follow_a_larger_buffer():
    """`StagedBuffers.rows`: the same views for every step of a batch size (no view made per
    layer step), into the buffers the captured graphs read; a capture of a larger batch
    allocates larger buffers and the views follow them."""
    buffers = StagedBuffers(8, 2, 4, Handoff(pin=False), pin=False)
    ids, _, _ = buffers.routing(4)
    slots, cpu_out = buffers.route_slots(4), buffers.cpu_out(4)
    rows = buffers.rows(3, 1)
    assert buffers.rows(3, 1) is rows and buffers.rows(3, 0) is not rows
    assert rows.ids.shape == (3, 2) and rows.x.shape == (3, 4) and rows.pad_rows == 1
    assert rows.slots.data_ptr() == slots.data_ptr()
    assert rows.cpu_out.data_ptr() == cpu_out.data_ptr()
    rows.ids_np[2, 1] = 7  # the numpy views are the buffers the routers write
    rows.slots_np[0, 0] = 5
    assert ids[2, 1] == 7 and slots[0, 0] == 5
    bigger, _, _ = buffers.routing(8)
    again = buffers.rows(3, 1)
    assert again is not rows and again.ids.data_ptr() == bigger.data_ptr()


def _runner(slots: int, **settings) -> tuple[ModelSpec, MoERunner]:
    """A tiny geometry's runner on the CPU (zero weights; no CPU executor)."""
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    layers = spec.num_moe_layers
    bank = ExpertBank([torch.zeros(e, 2 * i, h) for _ in range(layers)],
                      [torch.zeros(e, h, i) for _ in range(layers)])  # fmt: skip
    cache = ExpertCache(layers, e, slots, h, i, torch.float32, torch.device("cpu"))
    runner = MoERunner(bank, cache, MissPolicy.auto(20.0, 10.0), None, top_k=spec.top_k,
                       prefill_overlap=False, prefill_stream_min_tokens=64, **settings)  # fmt: skip
    return spec, runner


def test_a_late_routing_signal_is_cleared_before_a_piece_is_expected():
    """A router run outside a staged step (a capture's warm-ups) may set the signal and the
    guess's: `expect_routing` clears both before the next piece's wait is readied."""
    staged = _runner(8)[1].staged
    signal = staged.routing_signal()
    _, guess_signal = staged.buffers.guesses()
    signal[0] = guess_signal[0] = 1
    staged.expect_routing()
    assert signal[0] == 0 and guess_signal[0] == 0


def test_the_runner_takes_its_settings_where_it_is_built():
    _, runner = _runner(8, split_misses=True, prefetch_rounds=2, copy_ahead=0.5, copy_rate=4e10)
    planner = runner.planner
    assert (planner.split_misses, planner.prefetch_rounds) == (True, 2)
    assert (planner.copy_ahead, planner.copy_rate) == (0.5, 4e10)
    assert (runner.prefetch_rounds, runner.copy_ahead) == (2, 0.5)
    _, plain = _runner(8)
    assert (plain.planner.split_misses, plain.prefetch_rounds, plain.copy_ahead) == (False, 0, 0.0)


def test_telemetry_reports_the_parts_it_is_given():
    """No engine: given the runner, the expert cache, the bank, the scheduler and the engine's
    state (its device, plan, KV cache and settings), `/v1/stats` reports each part's own
    figures, and the runner's decode accesses reach the what-if curve."""
    spec, runner = _runner(8)
    kv = KVCache(spec, 4, 16, torch.device("cpu"), torch.float32)
    plan = VramPlan(budget_bytes=1 << 30, weights_bytes=1 << 20, kv_bytes=kv.nbytes, kv_tokens=64,
                    kv_blocks=4, state_bytes=0, state_slots=0, state_checkpoints=0,
                    prefill_buffer_bytes=0, activation_bytes=1 << 16, graph_bytes=0,
                    headroom_bytes=0, slots=8, slot_bytes=runner.cache.slot_bytes,
                    experts_total=spec.experts_total, max_context=64,
                    model_max_context=64)  # fmt: skip
    state = SimpleNamespace(device=torch.device("cpu"), plan=plan, kv=kv, max_context=64,
                            config_in_force=lambda: {"policy": "auto"})  # fmt: skip
    telemetry = Telemetry(spec, state, runner, runner.cache, runner.bank, Scheduler(kv, 2, 64))
    runner.stats.layer_step(_dispatch([1, 2, 5], [0, -1, -1], [(2, 3)], [5]), 1)
    telemetry.on_step(1, 0, 0.01)
    stats = telemetry.stats(running=0, queued=0, model_name="tiny")
    experts = stats["experts"]
    assert experts["slots"] == 8 and experts["policy"] == "auto"
    assert experts["layers"][1] == {"layer": 1, "reads": 3, "hits": 1, "fills": 1, "cpu": 1,
                                    "resident": 0}  # fmt: skip
    assert experts["cpu_jobs"]["jobs"] == 0 and experts["staged_layer_us"]["layer_steps"] == 0
    assert experts["whatif_accesses"] == 3
    device = stats["memory"]["device"][0]
    assert device["expert_cache"] == runner.cache.nbytes and device["kv"] == kv.nbytes
    assert stats["memory"]["expert_bank"] == runner.bank.nbytes
    assert stats["memory"]["expert_bank_pinned_layers"] == 0
    assert stats["kv"]["prefix_cache"] == {"enabled": True, "prompt_tokens": 0,
                                           "cached_tokens": 0, "tokens_held": 0}  # fmt: skip
    assert stats["kv"]["states"] is None and stats["kv"]["attention_layers"] == 4
    assert device["states"] == 0
    assert stats["config"] == {"policy": "auto"}


def test_telemetry_reports_a_hybrid_models_state_slots_and_their_memory():
    """A hybrid model's /v1/stats: `kv.states` gives the bytes a sequence's recurrent states
    take and the state pool's slots in use and in all; the device's memory counts the pool;
    the KV bytes per token count the attention layers alone."""
    _, runner = _runner(8)
    spec = ModelSpec.from_config(make_config("qwen3_5_moe", "tiny", {"num_experts": 16}))
    kv = KVCache(spec, 4, 16, torch.device("cpu"), torch.float32)
    per_seq = memory.state_bytes_per_seq(spec, 4)
    plan = memory.plan_vram(spec, budget_bytes=1 << 30, weights_bytes=1 << 20, elem_bytes=4,
                            kv_reserve_tokens=64, block_size=16, prefill_chunk_tokens=64,
                            max_running=2, headroom_bytes=0)  # fmt: skip
    assert plan.state_slots == 2 and plan.state_bytes == 3 * per_seq
    state = SimpleNamespace(device=torch.device("cpu"), plan=plan, kv=kv, max_context=64,
                            config_in_force=lambda: {})  # fmt: skip
    pool = SimpleNamespace(num_slots=2, used_slots=1, bytes_per_slot=per_seq, nbytes=3 * per_seq)
    parts = (runner, runner.cache, runner.bank, Scheduler(kv, 2, 64))
    stats = Telemetry(spec, state, *parts, states=pool).stats(
        running=1, queued=0, model_name="tiny"
    )
    assert stats["kv"]["states"] == {"linear_layers": 3, "bytes_per_seq": per_seq,
                                     "slots_total": 2, "slots_used": 1,
                                     "bytes": 3 * per_seq}  # fmt: skip
    assert stats["kv"]["attention_layers"] == 1
    assert stats["experts"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert stats["memory"]["device"][0]["states"] == 3 * per_seq


# the MoE layer's runtime and what reports it: comments say why, never when or on which host
