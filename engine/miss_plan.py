"""Where the routes of one offloaded layer step run: from a slot (a hit, or a miss fetched now)
or on the CPU.

`plan_layer` is the Python planner; the native `DecodePlanner` (kernels/csrc/decode_planner.h)
makes the same decisions and is checked against it. Of a step's misses, `MissPolicy.fetch_count`
(misses.py) says how many to fetch; the fetched ones are those picked most often so far (the
likeliest to be reused from the cache), ties broken by more tokens now, then the lower expert id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .cache import ExpertCache
from .misses import MissPolicy


@dataclass(slots=True)
class Dispatch:
    """Where the routes of one offloaded layer step run (`plan_layer`, or the native planner),
    and the CPU job started for them."""

    experts: list[int]  # the layer's routed experts, ascending
    slots: list[int]  # their cache slots before this step, -1 where missing
    missing: list[int]
    admitted: list[tuple[int, int]]  # (expert, slot) to copy from the bank now
    on_cpu: list[int]  # experts run on the CPU
    # [T, K] cache slot of each route, -1 where it runs on the CPU; a staged decode step with the
    # planner's copies holds filled_mark(slot) (kernels/host_handoff.py) for a route its fills serve
    route_slots: np.ndarray
    cpu_mask: np.ndarray | None  # [T, K] routes run on the CPU (None: none, or already started)
    job: object | None = None  # the CPU job (CpuExpertJob)
    route_slots_host: torch.Tensor | None = None  # route_slots in a reusable (pinned) buffer
    # the split miss (native planner): (expert, borrowed slot, first row on the CPU); its expert is
    # in on_cpu too, and its share of rows on the device is split_share
    split: tuple[int, int, int] | None = None
    split_share: float = 0.0
    # the native planner's guess of this step (`prefetch_rounds`): whether one naming CPU work
    # came before the routing, and the gate/up blocks of the job its workers own, having fetched
    # them while they waited (0: none, or the guess did not match)
    guessed: bool = False
    owned_blocks: int = 0
    # the native planner's copy ahead (`copy_ahead`): rows of the device's first miss copied once
    # the guess came, before the routing (0: none served this step), and whether one was copied
    # for an expert the step did not miss
    ahead_rows: int = 0
    ahead_missed: bool = False
    # the wait's planning of this step's guess: its seconds (0: none), and whether the routing
    # came during it
    guess_s: float = 0.0
    guess_late: bool = False

    @property
    def cpu_experts(self) -> float:
        """Experts' worth of weights the CPU reads (a split miss counts its rows on the CPU)."""
        return len(self.on_cpu) - self.split_share


def plan_layer(
    cache: ExpertCache,
    policy: MissPolicy,
    moe_layer: int,
    ids_host: np.ndarray,
    picks: np.ndarray,
    ranked_picks: np.ndarray,
) -> Dispatch:
    """Look the routes up in the cache and admit the experts to fetch: which routes run from a
    slot, which slots to fill, which routes go to the CPU.

    ids_host [T, K]: the layer's routing. picks: the layer's pick counts, which this step's picks
    are added to; ranked_picks: the counts that rank the misses (decode's, also for prefill).
    On the serial path of every offloaded decode layer step: the per-expert work is on Python
    lists (a numpy call on eight numbers costs more than the loop), numpy only for the routes.
    """
    if ids_host.shape[0] == 1:  # one token: its experts are distinct, no counting needed
        picks[ids_host[0]] += 1
        experts = sorted(ids_host[0].tolist())
        tokens_of = None
    else:
        np.add.at(picks, ids_host.ravel(), 1)
        unique, counts = np.unique(ids_host, return_counts=True)
        experts = unique.tolist()
        tokens_of = dict(zip(experts, counts.tolist(), strict=True))
    slots = cache.lookup(moe_layer, experts)
    missing = [e for e, s in zip(experts, slots, strict=True) if s < 0]
    q = policy.fetch_count(len(missing))
    if q < len(missing):
        # fetch the most picked (likeliest reused); ties: more tokens now, then lower id
        seen = dict(zip(missing, ranked_picks[missing].tolist(), strict=True))
        ranked = sorted(missing, key=lambda e: (-seen[e], -(tokens_of[e] if tokens_of else 1), e))
        fetch, on_cpu = ranked[:q], ranked[q:]
    else:
        fetch, on_cpu = missing, []
    protected = {s for s in slots if s >= 0}
    admitted: list[tuple[int, int]] = []
    for expert in fetch:
        slot = cache.admit(moe_layer, expert, protected)
        if slot is None:
            break
        protected.add(slot)
        admitted.append((expert, slot))
    if len(admitted) < len(fetch):  # every slot is in use by this step: the rest go to the CPU
        on_cpu = on_cpu + fetch[len(admitted) :]
    route_slots = cache.slot_of[moe_layer][ids_host]
    cpu_mask = None
    if on_cpu:
        cpu_mask = expert_mask(len(picks), on_cpu)[ids_host]
        route_slots[cpu_mask] = -1
    return Dispatch(experts, slots, missing, admitted, on_cpu, route_slots, cpu_mask)


def expert_mask(num_experts: int, experts: list[int]) -> np.ndarray:
    """A layer's experts as a lookup table: True at `experts` (cheaper than np.isin)."""
    mask = np.zeros(num_experts, dtype=bool)
    mask[experts] = True
    return mask
