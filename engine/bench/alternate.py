"""Two settings of one flag compared in one decode benchmark process (`--alternate-...`): the
timed runs alternate between them, and each pair of runs is compared."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sides:
    """Two settings of one flag that the timed runs alternate between (`ab_side`'s order): A,
    the flag's own value, and B; `apply` sets one on the engine between runs."""

    flag: str
    values: tuple[object, object]
    apply: Callable[[object, object], None]


def alternated_sides(args: argparse.Namespace) -> Sides | str | None:
    """The --alternate-... flag's two sides, None without one, or why they cannot compare."""
    flags = {
        "--alternate-prefetch-rounds": "alternate_prefetch_rounds",
        "--alternate-cpu-pin": "alternate_cpu_pin",
        "--alternate-cpu-redo-us": "alternate_cpu_redo_us",
        "--alternate-copy-ahead": "alternate_copy_ahead",
        "--alternate-cache-admission": "alternate_cache_admission",
    }
    asked = [
        (flag, value)
        for flag, dest in flags.items()
        if (value := getattr(args, dest, None)) is not None
    ]
    if not asked:
        return None
    if len(asked) > 1:
        return "one --alternate-... flag at a time"
    flag, b = asked[0]
    if flag == "--alternate-prefetch-rounds":
        sides = Sides(
            "--moe-cpu-prefetch-rounds",
            (args.moe_cpu_prefetch_rounds, b),
            lambda engine, rounds: engine.moe.set_prefetch_rounds(rounds),
        )
    elif flag == "--alternate-cpu-pin":
        sides = Sides(
            "--moe-cpu-pin", (args.moe_cpu_pin, b), lambda engine, mode: engine.set_cpu_pin(mode)
        )
    elif flag == "--alternate-copy-ahead":
        sides = Sides(
            "--moe-copy-ahead",
            (args.moe_copy_ahead, b),
            lambda engine, share: engine.moe.set_copy_ahead(share),
        )
    elif flag == "--alternate-cache-admission":
        sides = Sides(
            "--moe-cache-admission",
            (args.moe_cache_admission, b),
            lambda engine, mode: engine.moe.set_cache_admission(mode),
        )
    else:
        sides = Sides(
            "--moe-cpu-redo-us",
            (args.moe_cpu_redo_us, b),
            lambda engine, us: setattr(engine.cpu, "redo_us", us),
        )
    if sides.values[0] == sides.values[1] or args.repeats < 2:
        return f"{flag} needs a value other than {sides.flag}'s and --repeats 2 or more"
    return sides


def ab_side(run: int) -> int:
    """The side (0: A, 1: B) of timed run `run` when two settings alternate: A B B A, repeated,
    so that each pair of runs (0 and 1, 2 and 3, ...) holds both, and a disturbance of the host
    that comes every other run falls on both sides alike."""
    return int(run % 4 in (1, 2))


def alternation(runs: list[dict], flag: str) -> dict:
    """An A/B comparison of runs alternating between two settings of `flag` (`ab_side`'s order,
    each run's `side` and `setting`): each pair's B/A tok/s and their mean, and each side's layer
    step periods by plan over all its runs (the steps' mean, weighted by their counts)."""
    a = [r for r in runs if r["side"] == 0]
    b = [r for r in runs if r["side"] == 1]
    # each pair's A and B are the same pair's (`ab_side`); an odd number of runs leaves the last
    # one unpaired
    ratios = [y["decode_tok_s"] / x["decode_tok_s"] for x, y in zip(a, b, strict=False)]

    def periods(side: list[dict]) -> dict[str, dict[str, float]]:
        merged: dict[str, list[float]] = {}
        for run in side:
            for plan, p in run["period_by_plan"].items():
                total = merged.setdefault(plan, [0.0, 0.0])
                total[0] += p["us"] * p["steps"]
                total[1] += p["steps"]
        return {plan: {"us": t / n, "steps": n} for plan, (t, n) in merged.items() if n}

    return {
        "flag": flag,
        "sides": [a[0]["setting"] if a else None, b[0]["setting"] if b else None],
        "ratios": ratios,
        "mean_ratio": float(np.mean(ratios)) if ratios else None,
        "tok_s": [[r["decode_tok_s"] for r in a], [r["decode_tok_s"] for r in b]],
        "period_by_plan": [periods(a), periods(b)],
    }
