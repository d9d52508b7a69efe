"""Quick, standard and thorough: how long a run may take, and how widely it looks.

A mode's `workload` is the least a trial sends (the calibration trial sends exactly that); its
`target_s` is how long the measured part of every later trial should last (autotune/sizing.py).
The targets, against the restart + warm-up R of a trial (a few seconds for the demo model on a
CPU, up to about 10 s for the small preset on a GPU, most of it start-up; docs/benchmark.md),
give an overhead share of R / (R + target):
- quick, 4 s: the demo's quick run stays a few minutes on a CPU, and a GPU's one-second workload
  becomes four; restarts still take most of the time;
- standard, 60 s: restart + warm-up at most 15% of a trial while they take up to 10 s;
- thorough, 90 s: at most 10% up to 10 s restarts, and the steadiest figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..engine.text import Text
from .workload import WorkloadSpec

# each mode's name as a word inside sentences (plan reasons, events)
MODE_NAMES = {"quick": Text("quick"), "standard": Text("standard"), "thorough": Text("thorough")}


@dataclass(frozen=True, slots=True)
class Mode:
    """How many baseline runs, how many values per flag, how long a workload, how many tiers."""

    name: str
    baseline_runs: int
    workload: WorkloadSpec  # the least a trial sends: the calibration trial's workload
    target_s: float  # the measured part of every later trial lasts about this long
    values_per_flag: int | None  # unordered choices tried per flag; None: all
    walk_steps: int | None  # steps of an ordered walk per direction; None: to the end
    stop_at_turn: bool  # end a walk at the first step that does not win
    context_tiers: int | None  # context tiers tried above the usable one; None: up to the model's
    skip_off_objective: bool  # leave out flags that cannot move the objective's figures
    describe: str
    # the agent objective's sessions: turns, system prompt, the most a result and a reply take
    agent: tuple[int, int, int, int] = (20, 12_000, 4_000, 300)

    def __post_init__(self) -> None:
        assert self.baseline_runs >= 2, "the noise rule needs at least two baseline runs"
        assert self.target_s > 0, self.target_s

    def workload_for(self, clients: int, agent: bool = False) -> WorkloadSpec:
        """This mode's minimum workload, with `clients` concurrent streams for the aggregate
        figure and (`agent`) its agent sessions for the agent figure."""
        spec = replace(self.workload, clients=clients)
        if not agent:
            return spec
        turns, system, result, reply = self.agent
        return replace(spec, agent_turns=turns, agent_system_tokens=system,
                       agent_result_tokens=result, agent_reply_tokens=reply)  # fmt: skip


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode(
            "quick",
            baseline_runs=3,
            workload=WorkloadSpec(
                prefill_tokens=512,
                prefill_requests=2,
                decode_requests=3,
                decode_tokens=64,
                aggregate_tokens=48,
            ),
            target_s=4.0,
            values_per_flag=2,
            walk_steps=3,
            stop_at_turn=True,
            context_tiers=1,
            skip_off_objective=True,
            describe="a few values of the flags that move the objective",
            agent=(6, 2_048, 1_024, 64),
        ),
        Mode(
            "standard",
            baseline_runs=3,
            workload=WorkloadSpec(
                prefill_tokens=2048,
                prefill_requests=2,
                decode_requests=5,
                decode_tokens=128,
                aggregate_tokens=96,
            ),
            target_s=60.0,
            values_per_flag=None,
            walk_steps=None,
            stop_at_turn=True,
            context_tiers=3,
            skip_off_objective=False,
            describe="every tunable flag; ordered values walked until they stop winning",
        ),
        Mode(
            "thorough",
            baseline_runs=4,
            workload=WorkloadSpec(
                prefill_tokens=8192,
                prefill_requests=3,
                decode_requests=7,
                decode_tokens=256,
                aggregate_tokens=128,
            ),
            target_s=90.0,
            values_per_flag=None,
            walk_steps=None,
            stop_at_turn=False,
            context_tiers=None,
            skip_off_objective=False,
            describe="every value of every tunable flag, longer workloads, every context tier",
        ),
    )
}


def mode_named(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(
            Text("mode must be one of {choices}, not {name!r}", choices=", ".join(MODES), name=name)
        ) from None
