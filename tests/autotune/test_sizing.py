"""The workload sized to a mode's duration by a calibration trial, then fixed for the whole run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moelab.autotune.modes import MODES, Mode
from moelab.autotune.noise import Objective
from moelab.autotune.sizing import MAX_GENERATION_TOKENS, size_workload
from moelab.autotune.trial import TrialRequest, TrialResult
from moelab.autotune.workload import WorkloadSpec

from .fake import DECODE_PROMPT_TOKENS, RESTART_S, FakeEngine, Interrupted, MemoryJournal
from .test_search import search

DECODE = Objective("decode")
AGGREGATE = Objective("aggregate", clients=8)


def calibrate(engine: FakeEngine, mode: Mode, objective: Objective, flags=()) -> TrialResult:
    minimum = mode.workload_for(objective.clients)
    return engine(TrialRequest(tuple(flags), None, "calibration", workload=minimum), 1)


def run_sized(engine: FakeEngine, spec: WorkloadSpec, flags=()) -> TrialResult:
    return engine(TrialRequest(tuple(flags), None, "baseline", workload=spec), 2)


@pytest.mark.parametrize("objective", [DECODE, AGGREGATE])
def test_a_faster_machine_gets_a_bigger_workload_and_both_last_the_target(
    objective: Objective,
) -> None:
    mode = MODES["standard"]
    specs = {}
    for speed in (1.0, 10.0):
        engine = FakeEngine(seed=40, noise=0.0, speed=speed)
        calibration = calibrate(engine, mode, objective)
        assert calibration.workload_s < mode.target_s / 2
        sizing = size_workload(mode.workload_for(objective.clients), calibration, mode.target_s)
        assert sizing.reason.startswith("calibration: workload sized to")
        sized = run_sized(engine, sizing.spec)
        assert sized.workload_s == pytest.approx(mode.target_s, rel=0.1)
        assert sizing.expected_s == pytest.approx(sized.workload_s, rel=0.02)
        specs[speed] = sizing.spec
    slow, fast = specs[1.0], specs[10.0]
    assert fast.decode_requests * fast.decode_tokens > 5 * slow.decode_requests * slow.decode_tokens
    assert fast.prefill_requests > 5 * slow.prefill_requests
    if objective.clients:
        assert fast.aggregate_rounds > 5 * slow.aggregate_rounds


def test_each_part_grows_its_own_way_and_none_shrinks() -> None:
    mode = MODES["quick"]
    minimum = mode.workload_for(AGGREGATE.clients)
    engine = FakeEngine(seed=41, noise=0.0, speed=50.0)
    spec = size_workload(minimum, calibrate(engine, mode, AGGREGATE), mode.target_s).spec
    # prefill: more of the same long prompt (the plan judges prefill chunks against its length)
    assert spec.prefill_tokens == minimum.prefill_tokens
    assert spec.prefill_requests > minimum.prefill_requests
    # decode: generations as long as the long prompt allows, then more of them
    longest = minimum.prefill_tokens - DECODE_PROMPT_TOKENS
    assert spec.decode_tokens == min(longest, MAX_GENERATION_TOKENS)
    assert spec.decode_requests > minimum.decode_requests
    # aggregate: more rounds of the same streams
    assert (spec.clients, spec.aggregate_tokens) == (minimum.clients, minimum.aggregate_tokens)
    assert spec.aggregate_rounds > minimum.aggregate_rounds


def test_a_small_context_keeps_every_request_within_it() -> None:
    mode = MODES["standard"]
    minimum = mode.workload_for(0)
    flags = ("--kv-reserve-tokens", "1024")
    calibration = calibrate(FakeEngine(seed=42, speed=50.0), mode, DECODE, flags)
    spec = size_workload(minimum, calibration, mode.target_s).spec
    assert spec.prefill_tokens == (1024 - 64) // 2
    assert DECODE_PROMPT_TOKENS + spec.decode_tokens <= spec.prefill_tokens


def test_a_slow_machine_keeps_the_minimum_and_a_failed_calibration_too() -> None:
    mode = MODES["standard"]
    minimum = mode.workload_for(0)
    slow = size_workload(minimum, calibrate(FakeEngine(seed=43, speed=0.1), mode, DECODE), 40.0)
    assert replace(slow.spec, prefill_chars=None) == minimum
    assert slow.spec.prefill_chars is not None, "the text is fixed all the same"
    assert "kept as it is" in slow.reason and slow.measured_s > mode.target_s
    failed = TrialResult(ok=False, started=0.0, duration_s=3.0, failure="crash", error="boom")
    sizing = size_workload(minimum, failed, mode.target_s)
    assert sizing.spec == minimum and "calibration failed (crash)" in sizing.reason


def test_the_calibration_trial_comes_first_and_is_not_a_baseline_run() -> None:
    # the first engine is cold (its figures 40% low): counted, it would widen the spread so
    # much that no change could clear the threshold
    result, journal = search(FakeEngine(seed=44, noise=0.005, cold=0.6), [], DECODE)
    first = journal.trials[1]
    assert first.request.role == "calibration" and first.verdict == "calibration"
    assert first.reason.startswith("calibration: workload sized to")
    assert first.request.workload == MODES["standard"].workload_for(0)
    assert result["workload"]["calibration_trial"] == 1
    bases = [t for t in journal.trials.values() if t.request.role == "baseline"]
    assert [t.n for t in bases[:3]] == [2, 3, 4]
    assert result["spreads"]["objective"] < 0.02 and result["threshold"] == pytest.approx(0.03)
    assert result["baseline"]["decode_tok_s"] == pytest.approx(100.0, rel=0.02)
    assert any(kind == "workload" and "sized to" in message for kind, message, _ in journal.events)


def test_every_trial_after_the_calibration_runs_the_same_workload() -> None:
    result, journal = search(FakeEngine(seed=45, speed=5.0))
    sized = WorkloadSpec.from_json(result["workload"]["spec"])
    assert sized != MODES["standard"].workload_for(16)
    later = [t for t in journal.trials.values() if t.n > 1]
    assert {t.request.role for t in later} >= {"baseline", "candidate", "confirm", "context"}
    assert all(t.request.workload == sized and t.result.workload == sized for t in later)


def test_the_overhead_share_is_small_when_restarts_are_small_against_the_target() -> None:
    mode = replace(MODES["quick"], target_s=20.0)
    engine = FakeEngine(seed=46, speed=20.0)
    result, journal = search(engine, [], DECODE, mode=mode)
    overhead = result["overhead"]
    baseline_s = [journal.trials[n].result.workload_s for n in (2, 3, 4)]
    assert baseline_s == pytest.approx([20.0] * 3, rel=0.1)
    # faster flags run the same workload in less time
    assert 0.5 * 20.0 < overhead["workload_s_per_trial"] <= max(baseline_s)
    trials = len(journal.trials)
    # restart + warm-up over all trial time, the calibration trial's included
    total_s = sum(t.result.duration_s for t in journal.trials.values())
    assert overhead["share"] == pytest.approx(RESTART_S * trials / total_s)
    assert overhead["share"] < 0.12


@pytest.mark.parametrize("stop_at", [2, 6])
def test_a_resumed_run_reuses_the_stored_workload(stop_at: int) -> None:
    engine = FakeEngine(seed=47, speed=5.0, interrupt_at=stop_at)
    journal = MemoryJournal(engine)
    with pytest.raises(Interrupted):
        search(engine, journal=journal)
    stored = journal.trials[2].request.workload if stop_at > 2 else None
    # the machine is twice as fast now: recalibrating would size another workload
    faster = FakeEngine(seed=47, speed=10.0)
    resumed, _ = search(faster, journal=MemoryJournal(faster, journal))
    assert faster.calls[0][0] == stop_at, "the calibration trial was not run again"
    spec = WorkloadSpec.from_json(resumed["workload"]["spec"])
    assert all(request.workload == spec for _n, request in faster.calls)
    assert stored is None or stored == spec


def test_a_stored_trial_that_ran_another_workload_is_run_again() -> None:
    engine = FakeEngine(seed=48, interrupt_at=6)
    journal = MemoryJournal(engine)
    with pytest.raises(Interrupted):
        search(engine, journal=journal)
    # trial 4 was stored by a version that sized the workload otherwise
    old = journal.trials[4]
    other = replace(old.request.workload, decode_tokens=old.request.workload.decode_tokens + 1)
    details = {**old.result.details, "workload": other.to_json()}
    journal.trials[4] = replace(old, result=replace(old.result, details=details))
    again = FakeEngine(seed=48)
    search(again, journal=MemoryJournal(again, journal))
    assert again.calls[0][0] == 4
