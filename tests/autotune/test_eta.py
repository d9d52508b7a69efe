"""A run's time left: trials expected times a trial's measured time, damped by a clock the tests
drive, so that it does not swing when the measured trials replace the first guess."""

from __future__ import annotations

import statistics
from dataclasses import replace
from itertools import pairwise

import pytest

from moelab.autotune.eta import TimeLeft, candidate_trials, planned_trials
from moelab.autotune.modes import MODES
from moelab.autotune.noise import NoiseRule, Objective
from moelab.autotune.search import Search
from moelab.autotune.search_records import SearchSettings
from moelab.autotune.trial_record import TrialRequest, TrialResult

from .fake import MODEL_MAX_CONTEXT, FakeEngine, Interrupted, MemoryJournal
from .test_search import POOR, plan_for

# beyond the clock's count-down, one update moves the time shown by at most this share of it
MOST_MOVED = 0.35


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def moved(before: float, after: float, elapsed: float) -> float:
    """How far the time shown moved beyond the count-down, as a share of the larger side."""
    counted = max(0.0, before - elapsed)
    return abs(after - counted) / max(counted, after)


def test_the_time_left_does_not_swing_when_measured_trials_replace_the_guess() -> None:
    # the run: the calibration trial's engine compiled its kernels, so a trial was
    # foreseen at 30.7 s and 18 trials at 9 min 12 s; the trials then took 6.1 s each, and the
    # plain product fell to 1 min 44 s after one of them (to 1 min 56 s in the 40 s)
    clock = Clock()
    left = TimeLeft(clock)
    shown = [(clock.now, left.update(18, 30.7))]
    assert shown[0][1] == pytest.approx(552.6)
    plain = [18 * 30.7]
    for trials_left in range(17, 0, -1):
        clock.now += 6.1
        shown.append((clock.now, left.update(trials_left, 6.1)))
        plain.append(trials_left * 6.1)
    # the plain product swings by more than 80% in one trial; the time shown never by more
    # than a third beyond the count-down of the clock
    assert moved(plain[0], plain[1], 6.1) > 0.8
    for (t0, before), (t1, after) in pairwise(shown):
        assert moved(before, after, t1 - t0) <= MOST_MOVED, (before, after)
        assert after < before  # it only counts down: the run is getting shorter
    # and it meets the measured trials' time within about ten trials
    assert shown[9][1] < 1.4 * 9 * 6.1
    assert shown[-1][1] == pytest.approx(6.1, rel=0.25)
    clock.now += 6.1
    assert left.update(0, 6.1) == 0.0  # the end of the run shows nothing left


def test_updates_in_one_instant_do_not_move_it() -> None:
    clock = Clock()
    left = TimeLeft(clock)
    assert left.update(10, None) is None  # nothing tells a trial's time yet
    assert left.update(10, 5.0) == 50.0
    # a walk turned and its next steps were skipped in the same instant: nothing moves yet
    assert left.update(4, 5.0) == 50.0
    clock.now += 5.0
    after = left.update(3, 5.0)
    assert 15.0 < after < 45.0


def test_a_walk_that_stops_at_its_turn_counts_its_next_step_each_way() -> None:
    plan = plan_for([], Objective("decode"), "standard")
    walked = [c for c in plan.candidates if c.walk is not None]
    flags = {c.change.flag for c in walked}
    directions = {(c.change.flag, c.walk) for c in walked}
    assert len(walked) > len(directions)  # some walks have several steps each way
    others = len(plan.candidates) - len(walked)
    assert candidate_trials(plan.candidates, stop_at_turn=True) == others + len(directions)
    assert candidate_trials(plan.candidates, stop_at_turn=False) == len(plan.candidates)
    # a walk that turned counts nothing more; one whose walk up won is not walked down
    turned = frozenset(directions)
    assert candidate_trials(plan.candidates, True, turned=turned) == others
    downs = sum(1 for _f, walk in directions if walk == "down")
    assert candidate_trials(plan.candidates, True, raised=frozenset(flags)) == (
        others + len(directions) - downs
    )


class SlowFirstStart:
    """A fake engine whose first engine starts `extra_s` slower (it compiles its kernels), on a
    clock that moves by each trial's duration."""

    def __init__(self, engine: FakeEngine, clock: Clock, extra_s: float) -> None:
        self.engine = engine
        self.clock = clock
        self.extra_s = extra_s

    def __call__(self, request: TrialRequest, n: int) -> TrialResult:
        result = self.engine(request, n)
        if n == 1:
            result = replace(
                result,
                duration_s=result.duration_s + self.extra_s,
                startup_s=(result.startup_s or 0.0) + self.extra_s,
            )
        self.clock.now += result.duration_s
        return result


class ClockedJournal(MemoryJournal):
    """Keeps when each time left was given, by the test's clock."""

    def __init__(self, runner: SlowFirstStart, previous: MemoryJournal | None = None) -> None:
        super().__init__(runner, previous)
        self.clock = runner.clock
        self.times: list[tuple[float, float | None, bool]] = []

    def progress(self, phase: str, eta_s: float | None) -> None:
        super().progress(phase, eta_s)
        self.times.append((self.clock.now, eta_s, self.replaying))


def test_a_run_s_time_left_glides_after_a_slow_first_engine() -> None:
    clock = Clock()
    # without noise: a trial's noise would make some changes win by chance and be confirmed by
    # trials no plan foresees, which this test of the slow first engine is not about
    engine = FakeEngine(seed=13, speed=5.0, noise=0.0)
    journal = ClockedJournal(SlowFirstStart(engine, clock, extra_s=60.0))
    objective = Objective("decode")
    settings = SearchSettings(MODES["quick"], objective, NoiseRule(), MODEL_MAX_CONTEXT)
    plan = plan_for([], objective, "quick")
    Search(plan, [], settings, journal, clock=clock).run()
    shown = [(t, eta) for t, eta, _replaying in journal.times if eta is not None]
    assert journal.phases[-1] == ("result", 0.0)
    # the slow first engine made the first estimate several times the time the run then took
    assert shown[0][1] > 5 * (clock.now - shown[0][0])
    for (t0, before), (t1, after) in pairwise(shown[:-1]):
        assert moved(before, after, t1 - t0) <= MOST_MOVED, (t1 - clock.now, before, after)
    # from half-way on, the time shown is within a fifth of the time the run still took
    for t, eta in shown[len(shown) // 2 : -1]:
        assert eta == pytest.approx(clock.now - t, rel=0.2)
    # the first estimate counted about the trials that ran (a walk counted a step each way)
    foreseen = planned_trials(plan, [], settings.mode, MODEL_MAX_CONTEXT)
    assert foreseen - 2 <= len(journal.trials) <= foreseen + 4


def test_the_first_estimate_comes_from_the_calibration_trial_then_the_measured_ones() -> None:
    clock = Clock()
    journal = ClockedJournal(SlowFirstStart(FakeEngine(seed=13, speed=5.0), clock, extra_s=0.0))
    objective = Objective("aggregate", clients=16)
    settings = SearchSettings(MODES["standard"], objective, NoiseRule(), MODEL_MAX_CONTEXT)
    plan = plan_for(POOR, objective, "standard")
    result = Search(plan, POOR, settings, journal, clock=clock).run()
    etas = [eta for _t, eta, _replaying in journal.times if eta is not None]
    assert etas[0] > etas[len(etas) // 2] > 0 and journal.phases[-1] == ("result", 0.0)
    # the first estimate, after the calibration trial: the planned trials at the time it
    # foresees for a trial of the sized workload, which the trials then take
    calibration = journal.trials[1].result
    foreseen_s = calibration.duration_s - calibration.workload_s + result["workload"]["expected_s"]
    assert etas[0] / foreseen_s == pytest.approx(round(etas[0] / foreseen_s))
    assert (
        round(etas[0] / foreseen_s)
        == planned_trials(plan, POOR, settings.mode, MODEL_MAX_CONTEXT) - 1
    )
    baseline_s = [journal.trials[n].result.duration_s for n in (2, 3, 4)]
    assert foreseen_s == pytest.approx(statistics.median(baseline_s), rel=0.1)


def test_a_resumed_run_takes_its_stored_trials_times_at_once() -> None:
    clock = Clock()
    engine = FakeEngine(seed=13, speed=5.0, interrupt_at=12)
    journal = ClockedJournal(SlowFirstStart(engine, clock, extra_s=60.0))
    objective = Objective("decode")
    settings = SearchSettings(MODES["quick"], objective, NoiseRule(), MODEL_MAX_CONTEXT)
    plan = plan_for([], objective, "quick")
    with pytest.raises(Interrupted):
        Search(plan, [], settings, journal, clock=clock).run()
    # the next mgr replays the 11 stored trials in an instant: their measured times stand at
    # once, rather than the first engine's slow guess that the time shown would glide from
    clock.now += 3600.0
    runner = SlowFirstStart(FakeEngine(seed=13, speed=5.0), clock, extra_s=0.0)
    again = ClockedJournal(runner, previous=journal)
    Search(plan, [], settings, again, clock=clock).run()
    live = [(t, eta) for t, eta, replaying in again.times if not replaying and eta]
    began, first_eta = live[0]
    assert first_eta == pytest.approx(clock.now - began, rel=0.3)
