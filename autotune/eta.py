"""How many trials a run takes, and its time left: the trials still expected times a trial's
measured time, damped.

The trials are counted as they are expected to run: a walk that stops at its turning point one
step each way, the context step's tiers as the mode and the model allow. The plain product of
trials and a trial's time moves in steps: the first trials of the sized workload replace the
calibration trial's guess of a trial's time (a first engine that compiles its kernels makes that
guess several times too long), and a kept change adds its confirmation: shown as it is, a run's
time left can fall to a fraction of itself within a minute. So the time shown counts down with
the clock between two updates and moves towards each new product only by a share that grows
with the time since the last update: half of the way in two trials' time. Updates in one instant
(candidates skipped one after the other) do not move it; the last update of a run (nothing left)
shows 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .flagset import effective_value, value_of
from .modes import Mode
from .plan import Candidate, Plan

CONTEXT_FLAG = "--kv-reserve-tokens"  # the context step raises it by tiers
HALF_LIFE_TRIALS = 2.0  # the time shown goes half of the way to a new estimate in two trials


def candidate_trials(
    candidates: Sequence[Candidate],
    stop_at_turn: bool,
    turned: frozenset[tuple[str, str]] = frozenset(),
    raised: frozenset[str] = frozenset(),
) -> int:
    """The trials `candidates` are expected to take, one each, except that a walk that stops at
    its turning point counts only its next step each way: the steps after it run only when it
    wins (and a win adds its confirmation then). `turned` holds the (flag, direction) walks that
    ended, `raised` the flags whose walk up won (they are not walked down)."""
    if not stop_at_turn:
        return len(candidates)
    count = 0
    seen: set[tuple[str, str]] = set()
    for candidate in candidates:
        if candidate.walk is None:
            count += 1
            continue
        walk = (candidate.change.flag, candidate.walk)
        if walk in seen or walk in turned:
            continue
        if candidate.walk == "down" and candidate.change.flag in raised:
            continue
        seen.add(walk)
        count += 1
    return count


def context_tiers(
    usable: int, flags: list[str], model_max_context: int | None, mode: Mode
) -> list[int]:
    """The context tiers above `usable` tokens the context step tries: doubling up to the
    model's context (or `--max-context`), as many as the mode tries."""
    top = model_max_context
    cap = value_of(flags, "--max-context")
    if cap is not None:
        top = min(top or int(cap), int(cap))
    if not top or top <= usable:
        return []
    tiers = []
    tier = usable * 2
    while tier < top:
        tiers.append(tier)
        tier *= 2
    tiers.append(top)
    return tiers if mode.context_tiers is None else tiers[: mode.context_tiers]


def context_trials(flags: list[str], model_max_context: int | None, mode: Mode) -> int:
    """The context step's trials as foreseen before the engine says its context: the proof of
    the KV reserve in `flags`, then the tiers above it."""
    reserve = effective_value(flags, CONTEXT_FLAG)
    usable = int(str(reserve)) if reserve else 0
    return 1 + (len(context_tiers(usable, flags, model_max_context, mode)) if usable else 0)


def planned_trials(
    plan: Plan,
    base_flags: list[str],
    mode: Mode,
    model_max_context: int | None,
    pick_up: bool = False,
) -> int:
    """The trials a run of `plan` is expected to take, as its time left counts them before the
    first trial: the calibration trial, the baseline runs, the candidates and the context step
    (which a pick-up run takes only after a kept change)."""
    trials = 1 + mode.baseline_runs + candidate_trials(plan.candidates, mode.stop_at_turn)
    if not pick_up:
        trials += context_trials(base_flags, model_max_context, mode)
    return trials


class TimeLeft:
    """The time left to show for a run, damped; `clock` gives seconds (injected by tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.shown_s: float | None = None
        self._at = 0.0

    def update(
        self, trials_left: int, trial_s: float | None, *, settle: bool = False
    ) -> float | None:
        """The time left to show now that `trials_left` trials of `trial_s` seconds each are
        expected; None while nothing tells a trial's time. `settle` shows the estimate as it
        is (a resumed run replays its stored trials in an instant: their time has passed)."""
        if trial_s is None:
            return self.shown_s
        now = self.clock()
        estimate_s = trials_left * trial_s
        if self.shown_s is None or trials_left == 0 or settle:
            self.shown_s, self._at = estimate_s, now
            return estimate_s
        elapsed = max(0.0, now - self._at)
        counted = max(0.0, self.shown_s - elapsed)
        pull = 1.0 - 0.5 ** (elapsed / (HALF_LIFE_TRIALS * trial_s)) if trial_s > 0 else 1.0
        self.shown_s = counted + pull * (estimate_s - counted)
        self._at = now
        return self.shown_s
