"""How long a benchmark run of each mode would take on this PC, shown on the plan before it starts.

A run's trials are counted as its time left counts them before the first trial
(`autotune.eta.planned_trials`). A trial lasts a restart (start-up, warm-up and stop) plus the
mode's target for the sized workload, and the calibration trial runs a first estimate of the
target besides its minimum. The restart is measured where this PC has measured it: the trials of
this model's earlier runs here, else this model's server starts by this mgr; else it is a first
guess from an engine's start and the checkpoint's size.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from ..autotune.eta import planned_trials
from ..autotune.modes import MODES
from .benchmark_setup import Setup, fresh_rates
from .schema import BenchmarkRun, Model, Server, Trial
from .service import Daemon

# a first guess of a restart where nothing was measured: an engine's start without its weights,
# warm-up and stop (longer on a GPU, where most of it is CUDA starting), and the checkpoint read
# at this rate
GUESS_START_S = {"cpu": 2.0, "gpu": 8.0}
GUESS_READ_GBPS = 2.0
RECENT = 30  # the newest readings the median is taken over


@dataclass(frozen=True, slots=True)
class Restart:
    """What one trial's restart takes, and where that figure comes from."""

    seconds: float
    source: str  # "trials": earlier runs' trials; "servers": server starts; "guess"
    readings: int

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "source": self.source, "readings": self.readings}


def restart_time(daemon: Daemon, model: Model, on_cpu: bool) -> Restart:
    """A trial's restart on this PC for `model`: measured if it was, else a first guess."""
    machine_id = daemon.hardware.inventory(max_age_s=3600.0).machine_id
    with daemon.store.session() as session:
        trials = session.scalars(
            select(Trial)
            .join(BenchmarkRun, Trial.run_id == BenchmarkRun.id)
            .where(
                BenchmarkRun.model == model.path,
                BenchmarkRun.machine_id == machine_id,
                Trial.verdict != "failed",
            )
            .order_by(Trial.id.desc())
            .limit(2 * RECENT)
        )
        restarts = [
            t.duration_s - workload_s
            for t in trials
            if (t.stats or {}).get("role") != "calibration"  # its engine may have compiled
            and t.duration_s is not None
            and (workload_s := ((t.stats or {}).get("details") or {}).get("workload_s"))
        ][:RECENT]
        if restarts:
            return Restart(statistics.median(restarts), "trials", len(restarts))
        servers = session.scalars(
            select(Server)
            .where(Server.model == model.path, Server.started.is_not(None))
            .where(Server.ready.is_not(None))
            .order_by(Server.id.desc())
            .limit(RECENT)
        )
        starts = [s.ready - s.started for s in servers if s.ready >= s.started]
    if starts:
        return Restart(statistics.median(starts), "servers", len(starts))
    checkpoint_bytes = (model.dense_bytes or 0) + (model.expert_bytes or 0)
    guess = GUESS_START_S["cpu" if on_cpu else "gpu"] + checkpoint_bytes / (GUESS_READ_GBPS * 1e9)
    return Restart(guess, "guess", 0)


def mode_durations(daemon: Daemon, setup: Setup) -> dict[str, Any]:
    """Every mode's trials and expected seconds for this start, and what they rest on."""
    restart = restart_time(daemon, setup.model, setup.on_cpu)
    modes = {}
    for name, mode in MODES.items():
        trials = planned_trials(
            setup.plans[name],
            setup.base_flags,
            mode,
            setup.model.max_context,
            pick_up=setup.pick_up_from is not None,
        )
        trial_s = restart.seconds + mode.target_s
        modes[name] = {
            "trials": trials,
            "trial_s": trial_s,
            "expected_s": trials * trial_s + mode.target_s,
        }
    return {
        "modes": modes,
        "restart": restart.to_json(),
        # phase (a) runs `moelab bench bw` first, unless a fresh reading (or the run picked up)
        "hardware_first": setup.hardware is None and fresh_rates(daemon, setup.spec) is None,
    }
