"""A run's result: the chosen flags with the measured reason for each, the figures, the evidence.

The result is what a run stores and what Recommended reads (`flags`, `notes`); it is JSON-ready.
"""

from __future__ import annotations

import statistics
from typing import Any, Protocol

from ..engine.config.flag_list import FlagList
from ..engine.text import Text, text_fields
from .noise import Figures, NoiseRule, Objective, Spreads
from .plan import Skipped
from .search_records import Incumbent, Kept, SearchSettings
from .sizing import Sizing
from .trial_record import TrialResult


class Search(Protocol):
    """What the result reads of a finished search (autotune/search.py)."""

    settings: SearchSettings
    objective: Objective
    rule: NoiseRule
    results: dict[int, TrialResult]
    kept: list[Kept]
    skipped: list[Skipped]
    tried: list[str]
    tries: dict[str, list[Text]]
    spreads: Spreads
    incumbent: Incumbent | None
    context: dict[str, Any]
    sizing: Sizing | None
    calibration_trial: int | None


def build_result(search: Search, baseline: Figures) -> dict[str, Any]:
    """The result of a finished search, measured against its baseline figures."""
    incumbent = search.incumbent
    assert incumbent is not None
    final = incumbent.figures
    old, new = search.objective.score(baseline), search.objective.score(final)
    assert search.sizing is not None
    results = list(search.results.values())
    overhead_s = sum(r.overhead_s for r in results)
    trial_s = sum(r.duration_s for r in results)
    # the sized trials: the calibration trial ran the minimum, and a failed one ran nothing
    sized = [
        r.workload_s
        for n, r in search.results.items()
        if n != search.calibration_trial and r.workload_s is not None
    ]
    # A trial's own restart cost: the trials after the calibration one. The calibration
    # trial's engine is the run's first, and on a fresh machine it compiles every kernel.
    later = [r for n, r in search.results.items() if n != search.calibration_trial]
    later_overhead_s = sum(r.overhead_s for r in later)
    later_s = sum(r.duration_s for r in later)
    first = search.results.get(search.calibration_trial) if search.calibration_trial else None
    return {
        "flags": incumbent.flags,
        "notes": notes(search),
        "changes": [k.to_json() for k in search.kept],
        "skipped": [s.to_json() for s in search.skipped],
        "tried": search.tried,
        "objective": search.objective.name,
        "clients": search.objective.clients,
        "baseline": baseline.to_json(),
        "final": final.to_json(),
        "gain": (new / old - 1.0) if old and new else None,
        "spreads": search.spreads.to_json(),
        "threshold": search.rule.threshold(search.spreads),
        "context": search.context,
        "workload": {**search.sizing.to_json(), "calibration_trial": search.calibration_trial},
        "overhead": {
            "overhead_s": overhead_s,
            "trial_s": trial_s,
            "share": overhead_s / trial_s if trial_s else None,
            "share_per_trial": later_overhead_s / later_s if later_s else None,
            "per_trial_s": later_overhead_s / len(later) if later else None,
            "first_start_s": first.overhead_s if first is not None else None,
            "trials": len(results),
            "workload_s": sum(r.workload_s or 0.0 for r in results),
            "workload_s_per_trial": statistics.median(sized) if sized else None,
        },
    }


def notes(search: Search) -> list[dict[str, Any]]:
    """The measured reason for each chosen flag, and for each flag whose default stayed.

    A note is `{"flag", "value", "reason", "source"}` (with the reason's stored form beside it,
    engine/text.py); source "measured" when trials decided it, "baseline" when the flag came
    with the starting flags and nothing beat it.
    """
    assert search.incumbent is not None
    by_flag = {k.change.flag: k for k in search.kept}
    out = []
    chosen = FlagList.parse(search.incumbent.flags)
    origin = search.settings.base_origin
    for flag, value in chosen:
        kept = by_flag.get(flag)
        reason: Text
        if kept is not None:
            reason, source = kept.reason, "measured"
        elif search.tries.get(flag):
            reason = Text(
                "from {origin}; tried instead: {tries}", origin=origin, tries=search.tries[flag]
            )
            source = "baseline"
        else:
            reason, source = Text("from {origin}", origin=origin), "baseline"
        note = {"flag": flag, "value": value, **text_fields("reason", reason), "source": source}
        out.append(note)
    names = {flag for flag, _value in chosen}
    for flag, tries in search.tries.items():
        if flag in names:
            continue
        kept = by_flag.get(flag)
        stayed = Text("the engine's default stayed; tried: {tries}", tries=tries)
        reason = kept.reason if kept else stayed
        out.append(
            {"flag": flag, "value": None, **text_fields("reason", reason), "source": "measured"}
        )
    return out
