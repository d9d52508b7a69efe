"""/api/benchmarks: start, watch, cancel and resume benchmark runs; their trials; save as profile.

The service (daemon/benchmarks.py) lives on the web app (`app.state.benchmarks`); what these
handlers answer is shaped by benchmark_views.py, which the console's pages read too.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..autotune.modes import MODES
from ..autotune.noise import OBJECTIVES
from ..engine.text import Text
from .benchmark_setup import RunOptions
from .benchmark_store import event_json, events_of, trial_json, trials_of
from .benchmark_views import (
    compare_runs,
    full_run,
    options_of,
    plan_json,
    run_summary,
    service_of,
)
from .errors import BadRequest, NotFound
from .http import access_of, audit, blocking, json_body, path_id, query_number
from .profile_store import profile_json


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
