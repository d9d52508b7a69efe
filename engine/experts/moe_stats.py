"""What the offloaded MoE step counts and times: per-layer decode counters, the CPU jobs' own
timing, the host's stages between two captured pieces, and what a miss adds to a step.

`DecodeStats` holds them for one runner and is fed one call per layer step: `layer_step` for an
eager decode layer step, `staged_steps` for the staged ones a piece's launch ends (their records,
`StagedStep`, are reused, not made per step); telemetry reads its `snapshot`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

# the least share of the misses' variation a fit needs apart from the reads': a cache that
# misses nearly every read leaves little, and the few steps that hit then set the slope far off
# what a miss costs; a cache that holds about half of the experts leaves most of it
MIN_INDEPENDENT_SHARE = 0.1
# MissCostFit's jackknife: blocks of this many consecutive decode steps at first; at most
# MAX_BLOCKS (then neighbours merge), and at least MIN_BLOCKS before it says anything
BLOCK_STEPS = 64
MAX_BLOCKS = 16
MIN_BLOCKS = 4
# Offloaded decode accesses handed to `on_accesses` (the what-if stream) at once: handing them
# over every step costs the host about half of what landing a step costs
ACCESS_BATCH = 4096


@dataclass(slots=True)
class CpuJobTimes:
    """What the CPU expert workers did in decode steps, timed by the native kernel itself.

    Besides the totals it keeps the sums of a straight-line fit of each job's busy time (its
    reaction and its run) against its weight bytes: the slope is the time a byte more costs (the
    marginal rate, `marginal_gbps`), the intercept what any job costs (the workers' start, the
    gate/up rows' last wave before the down projection, the end). The average rate folds that
    fixed part into every byte."""

    jobs: int = 0
    weight_bytes: int = 0
    start_s: float = 0.0  # queueing to the first task taken: the workers' reaction time
    run_s: float = 0.0  # first task taken to last task done
    # the fit's sums, over jobs: bytes in GB, busy time in seconds
    sum_gb_sq: float = 0.0
    sum_gb_s: float = 0.0
    # the pool's workers (native jobs): queueing to the last worker's first task; their seconds in
    # tasks, and their seconds in all (workers times the run)
    timed_jobs: int = 0
    last_start_s: float = 0.0
    busy_s: float = 0.0
    worker_run_s: float = 0.0
    # the same jobs' gate/up phase (first task to its end), and what each worker waited for it
    # (CpuExpertJob.phase_seconds' wait over the pool's threads)
    phase1_s: float = 0.0
    wait_s: float = 0.0
    # tasks an idle worker ran again and finished first, the one that began them having stalled
    # (CpuExpertJob.redone)
    redone_tasks: int = 0

    def add(
        self,
        weight_bytes: int,
        seconds: tuple[float, float] | None,
        workers: tuple[float, float] | None = None,
        threads: int = 0,
        phases: tuple[float, float] | None = None,
        redone: int = 0,
    ) -> None:
        """One finished job: its bytes, its (start_s, run_s), and where known its workers'
        (last_start_s, busy_s) from a pool of `threads` (CpuExpertJob.worker_seconds), its
        (phase1_s, wait_s) (CpuExpertJob.phase_seconds) and its tasks run again (redone)."""
        if seconds is None:
            return
        self.redone_tasks += redone
        if workers is not None and threads > 0:
            self.timed_jobs += 1
            self.last_start_s += workers[0]
            self.busy_s += workers[1]
            self.worker_run_s += threads * seconds[1]
            if phases is not None:
                self.phase1_s += phases[0]
                self.wait_s += phases[1] / threads
        self.jobs += 1
        self.weight_bytes += weight_bytes
        self.start_s += seconds[0]
        self.run_s += seconds[1]
        gb = weight_bytes / 1e9
        self.sum_gb_sq += gb * gb
        self.sum_gb_s += gb * (seconds[0] + seconds[1])

    def marginal_gbps(self) -> float | None:
        """GB/s of a job's bytes beyond its fixed part: the inverse of the fit's slope; None
        where the jobs' sizes barely vary (the slope is then noise) or the slope is not
        positive."""
        n = self.jobs
        if n < 2:
            return None
        mean_gb = self.weight_bytes / 1e9 / n
        mean_s = (self.start_s + self.run_s) / n
        var_gb = self.sum_gb_sq / n - mean_gb * mean_gb
        if var_gb <= (0.05 * mean_gb) ** 2:  # sizes within about 5% of each other
            return None
        slope = (self.sum_gb_s / n - mean_gb * mean_s) / var_gb  # seconds per GB
        return 1.0 / slope if slope > 0 else None

    def to_dict(self) -> dict:
        return {
            "jobs": self.jobs,
            "weight_bytes": self.weight_bytes,
            "gbps": self.weight_bytes / self.run_s / 1e9 if self.run_s else None,
            "marginal_gbps": self.marginal_gbps(),
            "start_us_mean": 1e6 * self.start_s / self.jobs if self.jobs else None,
            "run_us_mean": 1e6 * self.run_s / self.jobs if self.jobs else None,
            # how together the workers began a job, and the share of their time in its tasks
            "last_worker_start_us_mean": (
                1e6 * self.last_start_s / self.timed_jobs if self.timed_jobs else None
            ),
            "workers_busy_share": self.busy_s / self.worker_run_s if self.worker_run_s else None,
            # a job's gate/up phase, and what each worker waited for it (µs, means)
            "phase1_us_mean": 1e6 * self.phase1_s / self.timed_jobs if self.timed_jobs else None,
            "wait_us_mean": 1e6 * self.wait_s / self.timed_jobs if self.timed_jobs else None,
            "redone_tasks": self.redone_tasks,
        }


@dataclass(slots=True)
class StagedStepTimes:
    """Where the host's time goes in offloaded decode layer steps between two captured pieces.

    The chain of one layer step is serial: the piece's graph is launched (`replay_s`), the host
    waits for its routing (`sync_s`: the piece's GPU work still running, which includes waiting
    for the previous layer's fills and CPU job, then the routing's store), decides hits, fills and
    CPU work and starts the CPU job (`plan_s`), queues the fills and the routes' slots
    (`fill_s`); then the next piece is launched, without waiting for the CPU job (its first kernel
    does, on the GPU), and only then does the host count the step (`count_s`, `after_launch`).
    Timed by the host's clock, a few reads of it per layer step; with the native planner on CUDA,
    plan and fill are the planner's own timing inside its one call.
    """

    layer_steps: int = 0
    split_misses: int = 0  # misses split between the copy and the CPU
    # steps with a CPU job; steps whose guess of the routing named CPU work (the workers were
    # told what to fetch); CPU jobs whose first blocks their workers had fetched (the guess's
    # plan was the step's)
    cpu_jobs: int = 0
    guesses: int = 0
    prefetched_jobs: int = 0
    # steps whose device took a miss copied in part ahead of the routing (the guess's first
    # device miss, `copy_ahead`), and copies ahead of an expert the step did not miss
    copied_ahead: int = 0
    ahead_missed: int = 0
    # guesses the wait planned (with their copies ahead), the host's time on them, and how many
    # times the routing came during that planning (its step then started late)
    guess_plans: int = 0
    guess_s: float = 0.0
    guess_late: int = 0
    replay_s: float = 0.0
    sync_s: float = 0.0
    plan_s: float = 0.0
    fill_s: float = 0.0
    count_s: float = 0.0
    # the layer step's period, from its routing's arrival on the host to the next layer's, by
    # its plan ("q+c": q experts copied, c run on the CPU; "s": one of those split): [steps, s]
    periods: dict[str, list] = field(default_factory=dict)
    # from the last MoE layer's routing of one decode step to the first of the next replayed one
    # (not across a prefill or an eager step): its layer step, the logits, the host's work
    # between steps and the next step's first dense work
    boundaries: int = 0
    boundary_s: float = 0.0
    # of that, from the last layer's routing to the launch of the next step's first piece: the
    # host's part (the last layer's plan, the last piece's launch, the work between steps); the
    # rest runs from that launch to the first routing's arrival
    boundary_host_s: float = 0.0

    STAGES = ("replay", "sync", "plan", "fill", "count")

    def add_period(self, plan: str, seconds: float) -> None:
        entry = self.periods.get(plan)
        if entry is None:
            entry = self.periods[plan] = [0, 0.0]
        entry[0] += 1
        entry[1] += seconds

    def to_dict(self) -> dict:
        """Microseconds per layer step of each stage, and their sum."""
        n = self.layer_steps
        per_step = {
            f"{s}_us": 1e6 * getattr(self, f"{s}_s") / n if n else None for s in self.STAGES
        }
        total = sum(v for v in per_step.values() if v is not None) if n else None
        periods = {
            plan: {"steps": k, "us": 1e6 * seconds / k}
            for plan, (k, seconds) in sorted(self.periods.items())
        }
        k = self.boundaries
        boundary = 1e6 * self.boundary_s / k if k else None
        boundary_host = 1e6 * self.boundary_host_s / k if k else None
        return {
            "layer_steps": n, "split_misses": self.split_misses, "cpu_jobs": self.cpu_jobs,
            "guesses": self.guesses, "prefetched_jobs": self.prefetched_jobs,
            "copied_ahead": self.copied_ahead, "ahead_missed": self.ahead_missed,
            "guess_plans": self.guess_plans, "guess_late": self.guess_late,
            "guess_plan_us": 1e6 * self.guess_s / self.guess_plans if self.guess_plans else None,
            **per_step, "total_us": total,
            "period_by_plan": periods, "boundary_us": boundary, "boundary_host_us": boundary_host,
        }  # fmt: skip


@dataclass(slots=True)
class LayerCounters:
    """Decode counters per MoE layer: expert reads and where each one ran."""

    reads: np.ndarray
    hits: np.ndarray
    fills: np.ndarray
    cpu: np.ndarray
    picks: np.ndarray  # [layers, experts]: how often each expert was routed to

    @classmethod
    def zeros(cls, layers: int, experts: int) -> LayerCounters:
        z = lambda: np.zeros(layers, dtype=np.int64)  # noqa: E731
        return cls(z(), z(), z(), z(), np.zeros((layers, experts), dtype=np.int64))


@dataclass(slots=True)
class MissCostFit:
    """What one more expert miss adds to a decode step, from the engine's own steps.

    Least squares of step seconds on the step's misses and its expert reads, within each batch
    size (a batch's own means are taken out: bigger batches both miss more and take longer for
    other reasons). Reads are held apart because a step that reads more experts also misses
    more; the misses' slope is then the marginal cost of a miss as this engine pays it, copies,
    CPU work and the host's bookkeeping together, where bandwidth prices only the bytes. When a
    batch size always reads the same number of experts (batch 1: top-k per layer), misses alone.
    Running sums of z zᵀ, z = (1, misses, reads, seconds), per batch size: a step costs one outer
    product of four numbers.

    The slope's error is the larger of least squares' and a delete-one-block jackknife's over
    runs of consecutive steps (`blocks`): a host's slow spells and a cache's state last many
    steps, so neighbouring steps are not independent draws, and least squares alone overstates
    what a few thousand steps know (processes of the same flags fit slopes far apart).
    """

    # Σ z zᵀ (4 x 4) per batch size over runs of block_steps consecutive steps, oldest first,
    # the last one filling
    blocks: list[dict[int, np.ndarray]] = field(default_factory=list)
    block_steps: int = BLOCK_STEPS
    _in_block: int = 0

    def add(self, batch: int, misses: int, reads: int, step_s: float) -> None:
        z = np.array((1.0, misses, reads, step_s))
        if not self.blocks or self._in_block == self.block_steps:
            if len(self.blocks) == MAX_BLOCKS:  # every block full: pairs merge, twice as long
                self.blocks = [
                    _merged(a, b) for a, b in zip(self.blocks[::2], self.blocks[1::2], strict=True)
                ]
                self.block_steps *= 2
            self.blocks.append({})
            self._in_block = 0
        block = self.blocks[-1]
        if batch in block:
            block[batch] += np.outer(z, z)
        else:
            block[batch] = np.outer(z, z)
        self._in_block += 1

    @property
    def sums(self) -> dict[int, np.ndarray]:
        """Σ z zᵀ per batch size over every step."""
        return functools.reduce(_merged, self.blocks, {})

    @property
    def steps(self) -> int:
        return int(sum(s[0, 0] for s in self.sums.values()))

    def fit(self, sums: dict[int, np.ndarray] | None = None) -> tuple[float, float] | None:
        """(seconds per miss, its standard error); None while the misses have not varied
        apart from the reads within a batch size, or there are too few steps to say, or (with
        MIN_BLOCKS blocks or more) without one of the blocks. sums: `self.sums`, if at hand."""
        sums = self.sums if sums is None else sums
        fitted = _fit_slope(sums)
        if fitted is None or len(self.blocks) < MIN_BLOCKS:
            return fitted
        slope, stderr = fitted
        left_out = []
        for block in self.blocks:
            rest = {b: s - block[b] if b in block else s for b, s in sums.items()}
            without = _fit_slope({b: s for b, s in rest.items() if s[0, 0] > 0.5})
            if without is None:
                return None
            left_out.append(without[0])
        g = len(left_out)
        jackknife = float(
            ((g - 1) / g * np.sum((np.array(left_out) - np.mean(left_out)) ** 2)) ** 0.5
        )
        return slope, max(stderr, jackknife)

    def to_dict(self) -> dict:
        """The fit, and the mean step it was fitted over (what share of a step misses take)."""
        sums = self.sums
        fitted = self.fit(sums)
        total = sum(sums.values(), start=np.zeros((4, 4)))
        n = int(total[0, 0])
        return {
            "steps": n,
            "us_per_miss": 1e6 * fitted[0] if fitted else None,
            "stderr_us": 1e6 * fitted[1] if fitted else None,
            "misses_per_step": float(total[0, 1]) / n if n else None,
            "step_us": 1e6 * float(total[0, 3]) / n if n else None,
        }


def _merged(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Two blocks' sums as one."""
    out = {k: v.copy() for k, v in a.items()}
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v.copy()
    return out


def _fit_slope(sums: dict[int, np.ndarray]) -> tuple[float, float] | None:
    """MissCostFit's least squares over these per-batch sums: (seconds per miss, its standard
    error), or None (see `MissCostFit.fit`)."""
    steps = sum(float(s[0, 0]) for s in sums.values())
    centered = sum(
        (s[1:, 1:] - np.outer(s[0, 1:], s[0, 1:]) / s[0, 0] for s in sums.values()),
        start=np.zeros((3, 3)),
    )
    xx, xt, tt = centered[:2, :2], centered[:2, 2], centered[2, 2]
    scale = max(1.0, steps)
    if xx[0, 0] <= 1e-9 * scale:
        return None  # the misses never varied
    if xx[1, 1] <= 1e-9 * scale:  # the reads never varied: misses alone
        xx, xt = xx[:1, :1], xt[:1]
    elif np.linalg.det(xx) < MIN_INDEPENDENT_SHARE * xx[0, 0] * xx[1, 1]:
        return None  # misses move with the reads: nearly every read a miss, or none
    dof = round(steps) - len(sums) - len(xt)
    if dof < 1:
        return None
    inverse = np.linalg.inv(xx)
    beta = inverse @ xt
    residual = max(0.0, float(tt - beta @ xt))
    return float(beta[0]), float((residual / dof * inverse[0, 0]) ** 0.5)


class PlannedStep(Protocol):
    """What the counters read of a planned layer step (`miss_plan.Dispatch`)."""

    experts: list[int]
    slots: list[int]
    missing: list[int]
    admitted: list[tuple[int, int]]
    on_cpu: list[int]
    job: object | None
    split: tuple[int, int, int] | None
    guessed: bool
    owned_blocks: int
    ahead_rows: int
    ahead_missed: bool
    guess_s: float
    guess_late: bool


@dataclass(slots=True)
class StagedStep:
    """The host's record of one staged decode layer step, for `DecodeStats.staged_steps`: the
    planned step, its MoE layer, and on the host's clock when its stage began (`started`), when
    its routing arrived, its planning, its fills and the native launch of the next piece
    (`replay_s`, 0 where Python launches it), and the launch of the piece it follows
    (`launched`, None where unknown). The staged decode reuses these records."""

    d: PlannedStep | None = None
    moe_layer: int = 0
    started: float = 0.0
    arrived: float = 0.0
    plan_s: float = 0.0
    fill_s: float = 0.0
    replay_s: float = 0.0
    launched: float | None = None


class DecodeStats:
    """One runner's decode counters and timers, fed once per layer step, and the observers of
    its decode steps (the what-if curve's access stream)."""

    def __init__(
        self, num_layers: int, num_experts: int, counters: LayerCounters | None = None
    ) -> None:
        """`counters`: where to count (views of a split model's counters), else new ones."""
        self.num_experts = num_experts
        self.counters = counters or LayerCounters.zeros(num_layers, num_experts)
        # what the planner adds a split prefill layer's picks to (decode's counters rank misses);
        # a resident or streamed prefill does not count, which would cost a host sync a layer
        self.prefill_picks = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.cpu_times = CpuJobTimes()
        self.staged_times = StagedStepTimes()
        # decode-step observers: (layer, experts, slots before the step, fetched, run on CPU)
        self.on_decode_step: list[Callable] = []
        # the decode access stream, keys layer * E + expert in the order the cache sees them
        self.on_accesses: Callable[[np.ndarray], None] | None = None
        # offloaded steps' accesses, handed over in batches (`flush_accesses`)
        self._accesses: list[int] = []
        # the last staged layer step of the chain: its MoE layer (None: no chain), when its
        # routing arrived on the host, its plan's key
        self._last_layer: int | None = None
        self._last_arrived = 0.0
        self._last_plan = ""

    def snapshot(self) -> dict:
        """The CPU jobs' and the staged layer steps' figures, as `/v1/stats` reports them."""
        return {
            "cpu_jobs": self.cpu_times.to_dict(),
            "staged_layer_us": self.staged_times.to_dict(),
        }

    def layer_step(self, d: PlannedStep, moe_layer: int) -> None:
        """Count a planned decode layer step, and tell the observers."""
        experts, slots, missing = d.experts, d.slots, d.missing
        fetched = [expert for expert, _ in d.admitted]
        c = self.counters
        c.reads[moe_layer] += len(experts)
        c.hits[moe_layer] += len(experts) - len(missing)
        c.fills[moe_layer] += len(fetched)
        c.cpu[moe_layer] += len(d.on_cpu)
        for callback in self.on_decode_step:
            callback(moe_layer, experts, slots, fetched, d.on_cpu)
        if self.on_accesses is not None:
            base = moe_layer * self.num_experts
            self._accesses += [base + e for e, s in zip(experts, slots, strict=True) if s >= 0]
            self._accesses += [base + e for e in missing]

    def staged_steps(self, steps: list[StagedStep], replay_s: float, started: float) -> None:
        """Count the staged decode layer steps a piece's launch ends (`layer_step`) and time them
        (`StagedStepTimes`): each one's stages, and its routing's arrival, which ends the last
        layer step's period (or, at layer 0, the boundary from the decode step before, whose
        host part ends at the launch of the piece it follows); then the launch's replay_s where
        Python launched the piece, and the host's counting since `started`."""
        times = self.staged_times
        for step in steps:
            d, moe_layer, arrived = step.d, step.moe_layer, step.arrived
            self.layer_step(d, moe_layer)
            times.layer_steps += 1
            times.split_misses += d.split is not None
            times.cpu_jobs += d.job is not None
            times.guesses += d.guessed
            times.prefetched_jobs += d.owned_blocks > 0
            times.copied_ahead += d.ahead_rows > 0
            times.ahead_missed += d.ahead_missed
            times.guess_plans += d.guess_s > 0
            times.guess_s += d.guess_s
            times.guess_late += d.guess_late
            times.sync_s += arrived - step.started
            times.plan_s += step.plan_s
            times.fill_s += step.fill_s
            times.replay_s += step.replay_s
            # the last layer step's period ends as this one's routing arrives (within one token)
            last = self._last_layer
            if last == moe_layer - 1:
                times.add_period(self._last_plan, arrived - self._last_arrived)
            elif last is not None and moe_layer == 0:  # the previous step's last layer
                times.boundaries += 1
                times.boundary_s += arrived - self._last_arrived
                if step.launched is not None:
                    times.boundary_host_s += step.launched - self._last_arrived
            self._last_layer, self._last_arrived, self._last_plan = moe_layer, arrived, plan_key(d)
        times.replay_s += replay_s
        times.count_s += time.perf_counter() - started

    def break_chain(self) -> None:
        """An eager MoE layer ran (a prefill, a decode step not replayed): the next staged layer
        step starts no period and no boundary."""
        self._last_layer = None

    def flush_accesses(self, at_least: int = 0) -> None:
        """Hand the offloaded steps' accesses to `on_accesses`, where there are `at_least`."""
        accesses = self._accesses
        if len(accesses) < at_least or not accesses:
            return
        if self.on_accesses is not None:
            self.on_accesses(np.array(accesses, dtype=np.int64))
        self._accesses = []


def plan_key(d: PlannedStep) -> str:
    """A layer step's plan as `StagedStepTimes.periods` keys it: "q+c", q experts copied and c
    run on the CPU, with "s" when one of those is split between the two, then "p" when its CPU
    job's first blocks were fetched by their workers ahead of it (a guessed plan), or "w" when a
    guess of CPU work came and the job was another (the workers fetched for nothing); no mark
    where no such guess came (prefetch off, a batch of several tokens, a guess that came late);
    then "a" when the device's first miss was copied in part ahead of the routing (`copy_ahead`)."""
    key = f"{len(d.admitted)}+{len(d.on_cpu)}" + ("s" if d.split is not None else "")
    key += "p" if d.owned_blocks else "w" if d.guessed else ""
    return key + ("a" if d.ahead_rows else "")
