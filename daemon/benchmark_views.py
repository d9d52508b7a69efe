"""Benchmark runs as the API and the console's pages show them: a run in the history, one run in
full, two side by side, and what a run would start from (its plan, read from a query string)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ..engine.config.flag_list import FlagList
from ..engine.text import text_fields, text_of, texts_fields
from .benchmark_estimate import mode_durations
from .benchmark_setup import RunOptions
from .benchmark_store import event_json, events_of, run_json, trials_of
from .benchmarks import BenchmarkService
from .flags import redact_flags
from .http import query_number
from .schema import BenchmarkRun
from .store import iso_time
from .supervisor import resolve_device


def service_of(request: Request) -> BenchmarkService:
    """The benchmark service, which lives with the web app (console/main.py)."""
    return request.app.state.benchmarks


def run_summary(row: BenchmarkRun, active_id: int | None) -> dict[str, Any]:
    """A run in the history list: no trials, the result's gain and flags."""
    result = row.result or {}
    return {
        "id": row.id,
        "model": row.model,
        "mode": row.mode,
        "objective": row.objective,
        "clients": (row.options or {}).get("clients", 0),
        "status": row.status,
        "active": row.id == active_id,
        "phase": row.phase,
        "eta_s": row.eta_s if row.status == "running" else None,
        "gain": result.get("gain"),
        **texts_fields("changes", [text_of(c, "label") for c in result.get("changes", [])]),
        "pick_up_from": (row.options or {}).get("pick_up_from"),
        "created": iso_time(row.created),
        "finished": iso_time(row.finished),
    }


def full_run(service: BenchmarkService, run_id: int, reveal: bool) -> dict[str, Any]:
    """One run with its trials, the trial in progress and its newest events."""
    row = service.get(run_id)
    body = run_json(row, trials_of(service.store, run_id), reveal, service.live(run_id))
    body["events"] = [event_json(e) for e in events_of(service.store, run_id, limit=200)]
    body["active"] = service.active_id == run_id
    return body


def compare_runs(service: BenchmarkService, a: int, b: int, reveal: bool) -> dict[str, Any]:
    """Two runs side by side: each one's figures and, flag by flag, what each chose."""
    left, right = full_run(service, a, reveal), full_run(service, b, reveal)
    flags_a = FlagList.parse((left["result"] or {}).get("flags", [])).as_dict()
    flags_b = FlagList.parse((right["result"] or {}).get("flags", [])).as_dict()
    rows = []
    for flag in dict.fromkeys([*flags_a, *flags_b]):
        in_a, in_b = flag in flags_a, flag in flags_b
        rows.append(
            {
                "flag": flag,
                "a": (flags_a[flag] or "on") if in_a else None,
                "b": (flags_b[flag] or "on") if in_b else None,
                "same": in_a == in_b and flags_a.get(flag) == flags_b.get(flag),
            }
        )
    return {"a": left, "b": right, "flags": rows}


def options_of(request: Request) -> RunOptions:
    """RunOptions from query parameters (for the plan preview)."""
    q = request.query_params
    body: dict[str, Any] = {k: q[k] for k in ("model", "mode", "objective") if k in q}
    if "clients" in q:
        body["clients"] = int(query_number(request, "clients", 8, 0, 256) or 0)
    if "profile_id" in q:
        body["profile_id"] = int(query_number(request, "profile_id", None, 1, 2**62) or 0)
    if q.get("pick_up") in ("1", "true"):
        body["pick_up"] = True
    if q.get("only_flags"):
        body["only_flags"] = [f for f in q["only_flags"].split(",") if f]
    return RunOptions.from_body(body)


def plan_json(service: BenchmarkService, options: RunOptions, reveal: bool) -> dict[str, Any]:
    """What a run would start from and try, each mode's expected duration, and the engines of
    this mgr that would share the machine with its trials."""
    setup = service.setup(options)
    trial_device = resolve_device(setup.base_flags, setup.machine.gpus)
    engines = [
        {**engine, "takes_the_gpu": trial_device != "cpu" and engine["device"] == trial_device}
        for engine in service.engines()
    ]
    return {
        "model": setup.model.path,
        "model_name": setup.model.name,
        "mode": setup.mode,
        "base_flags": setup.base_flags if reveal else redact_flags(setup.base_flags),
        **text_fields("base_origin", setup.base_origin),
        "pick_up_from": setup.pick_up_from,
        "candidates": [c.to_json() for c in setup.plan.candidates],
        "skipped": [s.to_json() for s in setup.plan.skipped],
        "durations": mode_durations(service.daemon, setup),
        "trial_device": trial_device,
        "engines": engines,
    }
