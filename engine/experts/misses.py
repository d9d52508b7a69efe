"""How an offloaded decode layer step's cache misses are divided between copies and the CPU.

For the m missing experts of a layer step, q of them are copied into cache slots while the other
m − q run on the CPU at the same time; both would finish together at q = m · Bp / (Bp + Bh).
Experts are whole, so q is whichever of the two whole numbers around it ends the step sooner
(`MissPolicy.fetch_count`). One more miss may be divided (unless --no-split-misses), the first
rows of its gate and up projections and the same columns of its down projection copied and the
rest run on the CPU (`fetch_plan`). The native decode planner reimplements these divisions
(engine/experts/miss_plan.py says which implementation is the specification).

`MissSplit` holds the policy in force; under the auto policy it moves the CPU rate the policy
plans with to the rate decode's CPU jobs show.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from .moe_stats import CpuJobTimes

# A split miss is divided between the copy and the CPU at a multiple of I / chunks rows, at most
# SPLIT_CHUNKS chunks (`split_chunks`)
SPLIT_CHUNKS = 16
# The fixed parts of a layer step's two sides, in the unit of `MissPolicy._ends` (one expert's
# copy time plus its CPU time), where that side has work, from the layer step periods by plan
# (docs/performance.md): the copies' (from the routing to the first copy's start, and from the
# last one's end to the parts' sum: the filled routes' pass, the sum), the CPU job's (its start
# and its end), and a split's extra copy time (its 2D copies run slower than whole experts, and
# its memset).
COPY_FIXED = 0.15
CPU_FIXED = 0.09
SPLIT_FIXED = 0.1
# The share of a row's bytes a copy ahead of the routing moves (the native planner's: the gate
# and up of the device's first miss's first rows, not the down projection's columns)
AHEAD_SHARE = 2.0 / 3.0


@dataclass(frozen=True, slots=True)
class MissPolicy:
    """How a layer step's cache misses are divided between GPU fills and CPU execution."""

    mode: str  # "auto" | "gpu" | "cpu" | "split"
    fetch_fraction: float  # share of misses fetched: from the bandwidths (auto) or fixed
    bp_gbps: float | None = None  # auto: the rates the fraction comes from
    bh_gbps: float | None = None

    @classmethod
    def parse(cls, text: str, bp_gbps: float, bh_gbps: float) -> MissPolicy:
        if text == "gpu":
            return cls("gpu", 1.0)
        if text == "cpu":
            return cls("cpu", 0.0)
        match = re.fullmatch(r"split:([0-9.]+)", text)
        if match:
            return cls("split", float(match.group(1)))
        assert text == "auto", text
        return cls.auto(bp_gbps, bh_gbps)

    @classmethod
    def auto(cls, bp_gbps: float, bh_gbps: float) -> MissPolicy:
        """Fetch Bp / (Bp + Bh) of the misses: the copies and the CPU then finish together."""
        return cls("auto", bp_gbps / (bp_gbps + bh_gbps), bp_gbps, bh_gbps)

    def fetch_count(self, misses: int) -> int:
        """q: how many of `misses` to copy into the cache, the rest running on the CPU.

        Of the two whole numbers around misses · f, the one whose later side (copies: q / Bp,
        the CPU: (misses − q) / Bh; with f = Bp / (Bp + Bh), in proportion q · (1 − f) and
        (misses − q) · f) ends sooner; a tie fetches."""
        low = min(misses, max(0, math.floor(misses * self.fetch_fraction)))
        high = min(misses, low + 1)
        return high if self._ends(high, misses - high) <= self._ends(low, misses - low) else low

    def _ends(self, copied: float, on_cpu: float, split: bool = False, lead: float = 0.0) -> float:
        """When a layer step's misses end, in proportion: the later of the copies of `copied`
        experts' worth (`split`: part of that is a split expert's; `lead`: the gate and up of that
        share of one expert's rows were copied ahead, AHEAD_SHARE of their bytes) and the CPU's
        `on_cpu`, each with its fixed part where it has work."""
        f = self.fetch_fraction
        copies = max(0.0, copied - lead * AHEAD_SHARE) * (1.0 - f)
        if copied > 0:
            copies += COPY_FIXED + (SPLIT_FIXED if split else 0.0)
        cpu = on_cpu * f + (CPU_FIXED if on_cpu > 0 else 0.0)
        return max(copies, cpu)

    def fetch_plan(self, misses: int, chunks: int) -> tuple[int, int]:
        """(q, j): copy q whole misses and, of one more, the first j / chunks of its gate and up
        rows with the same columns of its down projection, while the CPU runs its other rows and
        the rest; j = 0: no miss is split. The split replaces `fetch_count`'s whole split only
        where it ends the step sooner, by the same measure (`_ends`)."""
        best_q, best_j = self.fetch_count(misses), 0
        if chunks < 2:
            return best_q, best_j
        best = self._ends(best_q, misses - best_q)
        for q in range(misses):
            for j in range(1, chunks):
                u = j / chunks
                end = self._ends(q + u, misses - q - u, split=True)
                if end < best:
                    best, best_q, best_j = end, q, j
        return best_q, best_j

    def lead_plan(self, misses: int, chunks: int, lead: float) -> tuple[int, int] | None:
        """(q, j) as `fetch_plan`, where the gate and up of the share `lead` of the device's first
        miss's rows were copied ahead of the routing (the native planner's copy ahead): the
        device takes at least those rows (q >= 1, or a split at j / chunks >= lead), their copied
        bytes counted as copied. Of those divisions the one that ends soonest (the whole
        ones first, then the splits; the first of equal ends), where it ends no later than
        `fetch_plan`'s; else None (the copy ahead is left unused). misses > 0, chunks >= 2 and
        lead > 0."""
        best, best_q, best_j = math.inf, 0, 0
        for q in range(1, misses + 1):
            end = self._ends(q, misses - q, lead=lead)
            if end < best:
                best, best_q = end, q
        for q in range(misses):
            for j in range(1, chunks):
                u = j / chunks
                if q == 0 and u < lead:
                    continue
                end = self._ends(q + u, misses - q - u, split=True, lead=lead)
                if end < best:
                    best, best_q, best_j = end, q, j
        q0, j0 = self.fetch_plan(misses, chunks)
        u0 = j0 / chunks
        if self._ends(q0 + u0, misses - q0 - u0, split=j0 > 0) < best:
            return None
        return best_q, best_j


def split_chunks(inter: int, block_rows: int) -> int:
    """How many equal chunks a split miss's I intermediate rows are cut into (`fetch_plan`'s
    chunks; 0: no miss is split): as many as divide I into whole blocks of `block_rows` rows, at
    most SPLIT_CHUNKS. block_rows: the rows of gate and up (columns of the down projection) one
    scale factor covers (FP8: 128; 1 for weights without factors), so that the device's part and
    the CPU's each read whole blocks, values and factors alike. Fewer than 2 chunks: none."""
    if inter % block_rows:
        return 0
    blocks = inter // block_rows
    chunks = max(c for c in range(1, SPLIT_CHUNKS + 1) if blocks % c == 0)
    return chunks if chunks >= 2 else 0


# CPU jobs of decode between two updates of the auto split from their measured rate
ADAPT_EVERY_JOBS = 48
# The auto split's way back from a CPU rate so low that the CPU gets no job, or a rare one: jobs
# made rare by a low rate find their workers asleep (waking them takes milliseconds on a busy
# host), measure slow and keep the rate low, so one slow stretch of the host would send every miss
# to the copies for good. After this many layer steps with misses that ran none on the CPU, before
# a window of jobs measured it, the rate moves half-way back to the start-up measurement and the
# next few jobs are judged at once; each return the CPU did not confirm doubles the wait.
RECOVER_AFTER_STEPS = 96
RECOVER_AFTER_STEPS_MAX = 96 * 64
ADAPT_AFTER_RECOVERY_JOBS = 8

log = logging.getLogger("moelab.engine")


class MissSplit:
    """The miss split in force, and under the auto policy its controller: the CPU rate it plans
    with follows the rate decode's CPU jobs show (`job_done`), and comes back toward the start-up
    rate where no job measures the CPU any more (`note_cpu_use`)."""

    def __init__(self, policy: MissPolicy) -> None:
        self.policy = policy
        self.bh_start_gbps = policy.bh_gbps  # the start-up CPU rate (auto)
        self._window = CpuJobTimes()  # the CPU jobs since the split was last updated
        self._adapt_every = ADAPT_EVERY_JOBS
        # layer steps with misses that ran none on the CPU since a window of jobs measured it,
        # and how many of them make the rate return
        self._steps_without_cpu = 0
        self._recover_after = RECOVER_AFTER_STEPS

    def snapshot(self) -> dict:
        """The split as `/v1/stats` reports it."""
        return {"policy": self.policy.mode}

    def job_done(self, weight_bytes: int, seconds: tuple[float, float] | None) -> None:
        """A decode CPU job ended, its weight bytes read in (start_s, run_s) by its own timing;
        a full window of jobs updates the auto split."""
        window = self._window
        window.add(weight_bytes, seconds)
        if window.jobs >= self._adapt_every:
            self._adapt()

    def _adapt(self) -> None:
        """Auto policy: take the CPU's rate as decode sees it, reaction time included.

        The start-up Bh is the workers' best streaming rate; inside decode each job also waits
        for the workers to wake, so the start-up split sends too many misses to the CPU. Half
        the new reading is blended in per window, so one noisy window cannot swing the split.
        The reading is the window's marginal rate where its jobs' sizes vary enough to fit one
        (`CpuJobTimes`): the planner counts each job's fixed part apart (CPU_FIXED), so the
        average rate, which spreads that part over the bytes, would count it twice.
        """
        window, self._window = self._window, CpuJobTimes()
        self._steps_without_cpu = 0  # the CPU was measured: the way back's count starts again
        policy = self.policy
        busy_s = window.start_s + window.run_s
        if policy.mode != "auto" or not busy_s or policy.bp_gbps is None or not policy.bh_gbps:
            return
        average_gbps = window.weight_bytes / busy_s / 1e9
        # no faster than twice the average: a fit over few, noisy jobs may be steep
        seen_gbps = min(window.marginal_gbps() or average_gbps, 2.0 * average_gbps)
        self.policy = MissPolicy.auto(policy.bp_gbps, 0.5 * (policy.bh_gbps + seen_gbps))
        self._adapt_every = ADAPT_EVERY_JOBS
        if self.bh_start_gbps and self.policy.bh_gbps >= 0.5 * self.bh_start_gbps:
            self._recover_after = RECOVER_AFTER_STEPS  # the CPU is back: the next wait is short

    def note_cpu_use(self, used: bool) -> None:
        """Auto policy, after a decode layer step with misses that ran some (`used`) or none on
        the CPU: once RECOVER_AFTER_STEPS of them (doubled after each return the CPU's jobs did
        not confirm) ran none before a window of jobs measured the CPU, move its rate half-way
        back to the start-up measurement, so that it gets jobs again and is measured anew. Steps
        that ran some do not reset the count: a rate that leaves the CPU a job now and then is
        as stuck (those jobs find the workers asleep), and a healthy split fills a window long
        before (nearly every step with misses runs some on the CPU)."""
        if used:
            return
        self._steps_without_cpu += 1
        policy, start = self.policy, self.bh_start_gbps  # auto: its rates are set
        if self._steps_without_cpu < self._recover_after or policy.bh_gbps >= start:
            return
        bh_gbps = 0.5 * (policy.bh_gbps + start)
        log.info(
            "auto miss split: %d layer steps with misses ran none on the CPU since its rate "
            "was last measured; the rate it plans with goes from %.1f back to %.1f GB/s "
            "(start-up %.1f) to measure it again",
            self._steps_without_cpu, policy.bh_gbps, bh_gbps, start,
        )  # fmt: skip
        self.policy = MissPolicy.auto(policy.bp_gbps, bh_gbps)
        self._steps_without_cpu = 0
        self._recover_after = min(2 * self._recover_after, RECOVER_AFTER_STEPS_MAX)
        self._window = CpuJobTimes()
        self._adapt_every = ADAPT_AFTER_RECOVERY_JOBS
