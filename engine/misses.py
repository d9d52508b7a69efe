"""How an offloaded decode layer step's cache misses are divided between copies and the CPU.

For the m missing experts of a layer step, q of them are copied into cache slots while the other
m − q run on the CPU at the same time; both would finish together at q = m · Bp / (Bp + Bh).
Experts are whole, so q is whichever of the two whole numbers around it ends the step sooner
(`MissPolicy.fetch_count`). One more miss may be divided (unless --no-split-misses), the first
rows of its gate and up projections and the same columns of its down projection copied and the
rest run on the CPU (`fetch_plan`). The native decode planner
(kernels/csrc/decode_planner.h) computes the same in the same double arithmetic.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# A split miss is divided between the copy and the CPU at a multiple of I / SPLIT_CHUNKS rows
SPLIT_CHUNKS = 16
# The fixed parts of a layer step's two sides, in the unit of `MissPolicy._ends` (one expert's
# copy time plus its CPU time, about 270 µs on the H200 of docs/performance.md), where that side
# has work, as the H200's layer step periods by plan gave them (docs/performance.md, tenth
# session): the copies' (from the routing to the first copy's start, and from the last one's end
# to the parts' sum: the filled routes' pass, the sum; ~40 µs), the CPU job's (its start and its
# end, ~25 µs), and a split's extra copy time (its 2D copies run slower than whole experts, and
# its memset; ~27 µs). The native planner has the same constants.
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
        (misses − q) · f) ends sooner; a tie fetches. The native planner computes the same."""
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
        where it ends the step sooner, by the same measure (`_ends`). The native planner computes
        the same."""
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
        lead > 0. The native planner computes the same."""
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
