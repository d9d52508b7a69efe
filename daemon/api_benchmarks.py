"""/api/benchmarks: start, watch, cancel and resume benchmark runs; their trials; save as profile.

The service (daemon/benchmarks.py) lives on the web app (`app.state.benchmarks`); the console's
pages read the same functions as these handlers.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..autotune.flagset import split_flags
from ..autotune.modes import MODES
from ..autotune.noise import OBJECTIVES
from ..engine.text import Text, text_fields, text_of, texts_fields
from .api import access_of, audit, blocking, json_body, path_id, query_number
from .api_profiles import profile_json
from .benchmark_estimate import mode_durations
from .benchmark_setup import RunOptions
from .benchmark_store import event_json, events_of, run_json, trial_json, trials_of
from .benchmarks import BenchmarkService
from .errors import BadRequest, NotFound
from .flags import redact_flags
from .schema import BenchmarkRun
from .store import iso_time
from .supervisor import resolve_device


def service_of(request: Request) -> BenchmarkService:
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
    flags_a = dict(split_flags((left["result"] or {}).get("flags", [])))
    flags_b = dict(split_flags((right["result"] or {}).get("flags", [])))
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


async def list_runs(request: Request) -> Response:
    service = service_of(request)
    rows = await blocking(service.runs, request.query_params.get("model"))
    active = service.active_id
    return JSONResponse(
        {
            "runs": [run_summary(r, active) for r in rows],
            "running": active,
            "modes": {name: mode.describe for name, mode in MODES.items()},
            "objectives": list(OBJECTIVES),
        }
    )


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


async def preview(request: Request) -> Response:
    """What a run would start from and try: `?model=&mode=&objective=&clients=&pick_up=1`."""
    service = service_of(request)
    options = options_of(request)
    body = await blocking(plan_json, service, options, access_of(request).control)
    if options.pick_up and not body["candidates"]:
        body["message"] = f"nothing new to try since run {body['pick_up_from']}"
    else:
        body["message"] = f"{len(body['candidates'])} candidate(s) to try"
    return JSONResponse(body)


async def start_run(request: Request) -> Response:
    service = service_of(request)
    options = RunOptions.from_body(await json_body(request))
    run_id = await blocking(service.start, options)
    body = await blocking(full_run, service, run_id, True)
    audit(request, "start benchmark", f"benchmark {run_id}", model=options.model, mode=body["mode"])
    return JSONResponse(body, status_code=202)


async def stop_engines(request: Request) -> Response:
    """Stop every engine of this mgr, so that a run's trials have the machine to themselves."""
    service = service_of(request)
    stopped = await blocking(service.stop_engines)
    audit(request, "stop engines for a benchmark", None, servers=stopped)
    return JSONResponse({"stopped": stopped})


async def get_run(request: Request) -> Response:
    service = service_of(request)
    body = await blocking(full_run, service, path_id(request), access_of(request).control)
    return JSONResponse(body)


async def get_trial(request: Request) -> Response:
    """One trial in full: the engine's stats, the workload's readings, the log tail."""
    service = service_of(request)
    run_id, n = path_id(request), path_id(request, "n")
    rows = await blocking(trials_of, service.store, run_id)
    row = next((t for t in rows if t.n == n), None)
    if row is None:
        raise NotFound(Text("run {run_id} has no trial {n}", run_id=run_id, n=n))
    return JSONResponse(trial_json(row, access_of(request).control, full=True))


async def get_events(request: Request) -> Response:
    service = service_of(request)
    await blocking(service.get, path_id(request))
    rows = await blocking(events_of, service.store, path_id(request))
    return JSONResponse({"events": [event_json(e) for e in rows]})


async def cancel_run(request: Request) -> Response:
    service = service_of(request)
    await blocking(service.cancel, path_id(request))
    audit(request, "cancel benchmark", f"benchmark {path_id(request)}")
    return JSONResponse(await blocking(full_run, service, path_id(request), True))


async def resume_run(request: Request) -> Response:
    service = service_of(request)
    await blocking(service.resume, path_id(request))
    audit(request, "resume benchmark", f"benchmark {path_id(request)}")
    return JSONResponse(await blocking(full_run, service, path_id(request), True), status_code=202)


async def save_profile(request: Request) -> Response:
    service = service_of(request)
    body = await json_body(request)
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRequest(Text("name must be a string"))
    profile = await blocking(service.save_profile, path_id(request), name or None)
    audit(request, "save benchmark as profile", f"profile {profile.id}", run=path_id(request))
    return JSONResponse(profile_json(profile, True), status_code=201)


async def delete_run(request: Request) -> Response:
    service = service_of(request)
    await blocking(service.delete, path_id(request))
    audit(request, "delete benchmark", f"benchmark {path_id(request)}")
    return JSONResponse({"deleted": path_id(request)})


async def compare(request: Request) -> Response:
    service = service_of(request)
    a = query_number(request, "a", None, 1, 2**62)
    b = query_number(request, "b", None, 1, 2**62)
    if a is None or b is None:
        raise BadRequest(Text("give two runs: ?a=ID&b=ID"))
    body = await blocking(compare_runs, service, int(a), int(b), access_of(request).control)
    return JSONResponse(body)


def routes() -> list[Route]:
    return [
        Route("/api/benchmarks", list_runs),
        Route("/api/benchmarks", start_run, methods=["POST"]),
        Route("/api/benchmarks/plan", preview),
        Route("/api/benchmarks/compare", compare),
        Route("/api/benchmarks/stop-engines", stop_engines, methods=["POST"]),
        Route("/api/benchmarks/{id:int}", get_run),
        Route("/api/benchmarks/{id:int}", delete_run, methods=["DELETE"]),
        Route("/api/benchmarks/{id:int}/trials/{n:int}", get_trial),
        Route("/api/benchmarks/{id:int}/events", get_events),
        Route("/api/benchmarks/{id:int}/cancel", cancel_run, methods=["POST"]),
        Route("/api/benchmarks/{id:int}/resume", resume_run, methods=["POST"]),
        Route("/api/benchmarks/{id:int}/save-profile", save_profile, methods=["POST"]),
    ]
