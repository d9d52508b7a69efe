"""The device's timeline of a decode step, from a kernel-profile trace.

    moelab bench decode ... --moe-cache-rate 0.25 --kernel-profile --trace trace.json
    python scripts/decode_timeline.py trace.json   (or trace.json.gz, as gpu_suite.sh keeps it)
    python scripts/decode_timeline.py --steps trace.json   (whole steps: all resident too)

Without --steps, offloaded layer steps (below). With --steps, whole decode steps, each the kernels
of one CUDA graph launch (a trace's kernels carry their launch's correlation id, which a graph's
kernels share): a resident step, whose graph is the whole step (an offloaded step's pieces are
launches of their own); in a trace without such launches, the runs of kernels that end with a step's
token pick (its argmax, or `_pick_kernel`). It prints one JSON line for the steps (medians in µs of
the period, from the end of one step's last kernel to the next's; the kernels' count; their busy
time; the device's idle time; the copies and memsets that start between the two steps, and their
time: a step's inputs and outputs where they are copies on its stream), then one per kernel name,
most time first: its launches a step and the medians a step of its own time (what it adds to the
chain: its run after the end of every kernel before it) and of the idle time just before it (the
device waiting for its launch, or for its programs to be placed). A step's own times add up to
its busy time and the idle times to the rest, so two traces (bf16 and FP8, say) compare kernel by
kernel.

An offloaded layer step runs from the end of the kernel that stores one layer's routing to the
host (the host may plan then) to the next's: `_route_kernel` (the router in one launch, one
token) or `_routing_to_host_kernel` (after the router, otherwise).
Prints one JSON line per kind of step (how many fill copies, and memsets, it has), with the
medians in µs of: the period; from the routing to the first fill copy (the host's wake, plan
and queueing), the fills' span, and from the fills' end to the end of the parts' sum (what
waited for them); from the routing to the cached routes' head (`_route_slots_from_host`); the
sum (`_sum_parts_kernel`, or at one token `_sum_norm_kernel`, which polls the CPU's epoch itself,
so its time holds the wait); the epoch wait, where a kernel of its own does it
(`_wait_epoch_kernel`); and from the sum to the next routing (attention, norms and router).
`kernels` and `kernel_busy_us` count the step's kernels (the next routing's included) and the
time at least one of them runs: the rest of the period the device waits (for the host, a copy,
a launch).
With programmatic dependent launch a kernel is placed while the one before still runs, so its
time also holds that wait.
`cached_moe_during_fills` counts the one-token MoE kernels that ran before the fills ended (2:
the cached routes' run during them).
"""

from __future__ import annotations

import gzip
import itertools
import json
import statistics
import sys
from pathlib import Path

FILL_MIN_US = 20  # copies shorter than this are not expert fills
# the kernels that end a layer's routing on the device (its store into pinned host memory)
ROUTING_KERNELS = ("_route_kernel", "_routing_to_host_kernel")
# a graph launch with fewer kernels is not a decode step (a layer has a dozen)
STEP_MIN_KERNELS = 8
# the last kernel of a decode step: its greedy tokens' argmax (torch's reduction), or the pick of
# its drawn ones (kernels/draw.py)
STEP_END_KERNELS = ("ArgMaxOps", "_pick_kernel")
# the profiler's categories of the device's copies and memsets
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")


def _end(e: dict) -> float:
    return e["ts"] + e["dur"]


def _busy(kernels: list[dict], t0: float) -> float:
    """The time from t0 on during which at least one of these kernels runs (their union)."""
    busy, end = 0.0, t0
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = max(e["ts"], end), _end(e)
        if stop > start:
            busy, end = busy + stop - start, stop
    return busy


def layer_steps(events: list[dict]) -> list[dict]:
    """One record per layer step with a head, an epoch wait and a sum inside it."""
    device = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")),
        key=lambda e: e["ts"],
    )
    routing = [e for e in device if e["name"].startswith(ROUTING_KERNELS)]
    steps = []
    for before, after in itertools.pairwise(routing):
        t0, t1 = _end(before), _end(after)
        inside = [e for e in device if t0 <= e["ts"] < t1]

        def first(prefix: str, inside=inside) -> dict | None:
            return next((e for e in inside if e["name"].startswith(prefix)), None)

        # the parts' sum: with its own epoch wait before it, or (one token, nothing to add to
        # the routed output) the sum, residual add and norm in one launch that polls the epoch
        head, wait = first("_route_slots_from_host"), first("_wait_epoch")
        total = first("_sum_parts") or first("_sum_norm")
        if head is None or total is None:
            continue
        fills = [e for e in inside if e["cat"] == "gpu_memcpy" and e["dur"] > FILL_MIN_US]
        memsets = [e for e in inside if e.get("cat") == "gpu_memset"]
        kernels = [e for e in inside if e["cat"] == "kernel"]
        step = {
            "kind": f"{len(fills)} copies" + (f", {len(memsets)} memsets" if memsets else ""),
            "period_us": t1 - t0,
            "kernels": len(kernels),  # the next routing's own kernel, which ends it, among them
            "kernel_busy_us": _busy(kernels, t0),
            "routing_to_cached_head_us": head["ts"] - t0,
            "sum_us": total["dur"],
            "sum_to_next_routing_us": t1 - _end(total),
        }
        if wait is not None:
            step["epoch_wait_us"] = wait["dur"]
        if fills:
            fills_end = _end(fills[-1])
            step |= {
                "routing_to_fill_us": fills[0]["ts"] - t0,
                "fill_span_us": fills_end - fills[0]["ts"],
                "fill_end_to_sum_end_us": _end(total) - fills_end,
                "cached_moe_during_fills": sum(
                    e["name"].startswith("_one_token") and _end(e) <= fills_end for e in inside
                ),
            }
        steps.append(step)
    return steps


def summary(steps: list[dict]) -> list[dict]:
    """Medians of each field, for the steps of each kind (their fill copies and memsets), over
    the steps that have it (an epoch wait of its own: only where the sum has one)."""
    rows = []
    for kind in sorted({s["kind"] for s in steps}):
        chosen = [s for s in steps if s["kind"] == kind]
        keys = list(dict.fromkeys(k for s in chosen for k in s if k != "kind"))
        row = {"kind": kind, "layer_steps": len(chosen)}
        row |= {k: round(statistics.median(s[k] for s in chosen if k in s), 1) for k in keys}
        rows.append(row)
    return rows


def whole_steps(events: list[dict], min_kernels: int = STEP_MIN_KERNELS) -> list[list[dict]]:
    """The kernels of each graph launch of at least `min_kernels` kernels (a decode step; a
    smaller one is a prefill's or a copy's), each launch's sorted by start, in launch order.
    Where fewer than two launches are that large (kernels launched one by one, or a trace whose
    kernels carry no correlation), the runs of kernels that end with a step's token pick
    (`STEP_END_KERNELS`) instead."""
    kernels = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"),
        key=lambda e: e["ts"],
    )
    launches: dict[object, list[dict]] = {}
    for e in kernels:
        launches.setdefault((e.get("args") or {}).get("correlation"), []).append(e)
    launches.pop(None, None)
    steps = [k for k in launches.values() if len(k) >= min_kernels]
    if len(steps) >= 2:
        return sorted(steps, key=lambda k: k[0]["ts"])
    steps, run = [], []
    for e in kernels:
        run.append(e)
        if any(name in e["name"] for name in STEP_END_KERNELS):
            if len(run) >= min_kernels:
                steps.append(run)
            run = []
    return steps


def step_rows(steps: list[list[dict]], copies: list[dict] = ()) -> list[dict]:
    """The steps' line, then a line per kernel name (`main` prints them): medians over the steps
    after the first, each from the end of the last kernel of the step before to its own last
    kernel's end. copies: the trace's copies and memsets, of which those that start between two
    steps are counted on the steps' line (how many, and their time)."""
    periods, counts, busy, idle, between, between_us = [], [], [], [], [], []
    own: dict[str, list[float]] = {}
    before: dict[str, list[float]] = {}
    launches: dict[str, list[int]] = {}
    for previous, kernels in itertools.pairwise(steps):
        t0 = end = max(_end(e) for e in previous)
        per_own: dict[str, float] = {}
        per_before: dict[str, float] = {}
        per_count: dict[str, int] = {}
        for e in kernels:
            name = e["name"]
            per_before[name] = per_before.get(name, 0.0) + max(0.0, e["ts"] - end)
            per_own[name] = per_own.get(name, 0.0) + max(0.0, _end(e) - max(e["ts"], end))
            per_count[name] = per_count.get(name, 0) + 1
            end = max(end, _end(e))
        periods.append(end - t0)
        counts.append(len(kernels))
        gap = [c for c in copies if t0 <= c["ts"] < kernels[0]["ts"]]
        between.append(len(gap))
        between_us.append(sum(c["dur"] for c in gap))
        busy.append(sum(per_own.values()))
        idle.append(sum(per_before.values()))
        for name in per_own:
            own.setdefault(name, []).append(per_own[name])
            before.setdefault(name, []).append(per_before[name])
            launches.setdefault(name, []).append(per_count[name])
    if not periods:
        return []

    def med(values: list[float]) -> float:
        return round(statistics.median(values), 1)

    rows = [{
        "steps": len(periods), "period_us": med(periods), "kernels": med(counts),
        "kernel_busy_us": med(busy), "idle_us": med(idle), "copies_between": med(between),
        "copies_between_us": med(between_us),
    }]  # fmt: skip
    by_time = sorted(own, key=lambda name: -statistics.median(own[name]))
    rows += [
        {
            "kernel": name,
            "launches": med(launches[name]),
            "own_us": med(own[name]),
            "idle_before_us": med(before[name]),
        }
        for name in by_time
    ]
    return rows


def main(argv: list[str]) -> int:
    whole = argv[:1] == ["--steps"]
    argv = argv[1:] if whole else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0])
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    events = json.loads(text)["traceEvents"]
    if whole:
        copies = sorted(
            (e for e in events if e.get("ph") == "X" and e.get("cat") in COPY_CATEGORIES),
            key=lambda e: e["ts"],
        )
        rows = step_rows(whole_steps(events), copies)
        if not rows:
            print(
                f"no two decode steps in this trace: no graph launches of {STEP_MIN_KERNELS} "
                "kernels or more, and "
                "no runs of kernels ending with a token pick (a trace of the CPU has no kernels)",
                file=sys.stderr,
            )
            return 1
    else:
        rows = summary(layer_steps(events))
        if not rows:
            print("no offloaded decode layer steps in this trace", file=sys.stderr)
            return 1
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
