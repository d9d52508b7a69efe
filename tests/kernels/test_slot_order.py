"""The decode planner's slot order (kernels/csrc/slot_order.h) against its definition: the
first unblocked slot is a free one (last use -1) of the lowest index, else the unblocked one of
the least last use, the lowest index on ties (ExpertCache.admit's argmin). The order follows the
planner's writes (a slot used: its last use the largest yet; a slot freed) one at a time,
catches up with the Python planner's (last uses raised past what it had seen), and is rebuilt
from any last-use array."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.kernels.cpu_experts import load_native


def first_by_definition(last_use: np.ndarray, blocked: np.ndarray) -> int:
    """The planner's choice written as ExpertCache.admit makes it."""
    if blocked.all():
        return -1
    candidates = np.where(blocked.astype(bool), np.iinfo(np.int64).max, last_use)
    return int(candidates.argmin())


def order_by_definition(last_use: np.ndarray) -> list[int]:
    free = np.flatnonzero(last_use < 0)
    used = np.flatnonzero(last_use >= 0)
    return free.tolist() + used[np.argsort(last_use[used], kind="stable")].tolist()


# an op: (kind, slot): 0 the planner uses the slot, 1 frees it, 2 the Python planner uses it
# (the array written, the order told nothing until it catches up), 3 the order rebuilt whole
OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10_000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(
    slots=st.integers(1, 150),
    start=st.lists(st.integers(-1, 40), min_size=150, max_size=150),
    ops=OPS,
    blocked_seed=st.integers(0, 2**32 - 1),
)
def test_the_first_unblocked_slot_is_the_one_the_definition_picks(slots, start, ops, blocked_seed):
    native = load_native()
    last_use = np.array(start[:slots], dtype=np.int64)  # ties among the used slots too
    clock = int(last_use.max()) + 1
    order = native.SlotOrder(slots)
    order.rebuild(last_use.ctypes.data)
    seen = clock  # the largest last use the order has been told of
    rng = np.random.default_rng(blocked_seed)
    for i, (kind, at) in enumerate(ops):
        slot = at % slots
        clock += 1
        if kind == 2:
            last_use[slot] = clock
            # the Python planner's steps write several slots before the native one's next step
            if i + 1 < len(ops) and ops[i + 1][0] == 2:
                continue
            order.catch_up(last_use.ctypes.data, seen)
        elif kind == 0:
            last_use[slot] = clock
            order.use(slot)
        elif kind == 1:
            last_use[slot] = -1
            order.release(slot)
        else:
            order.rebuild(last_use.ctypes.data)
        seen = clock
        assert order.slots() == order_by_definition(last_use)
        # a few slots blocked (a step's own), or most of them, or all
        share = rng.choice([0.0, 0.05, 0.9, 1.0])
        blocked = (rng.random(slots) < share).astype(np.int8)
        assert order.first(blocked.ctypes.data) == first_by_definition(last_use, blocked)
