"""/api/hardware and /api/jobs: this machine as probed, its measurements and their history,
"measure again", and the jobs that measure."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.text import Text
from .errors import BadRequest, Conflict, NotFound
from .http import audit, blocking, daemon_of, json_body, path_id, query_number
from .measure import inventory_json, measurement_json


async def get_hardware(request: Request) -> Response:
    daemon = daemon_of(request)
    inventory = await blocking(daemon.hardware.inventory)
    latest = await blocking(daemon.hardware.latest)
    job = daemon.jobs.latest("hardware")
    return JSONResponse(
        {
            "inventory": inventory_json(inventory),
            "latest": [measurement_json(m) for m in latest],
            "job": job.to_json() if job else None,
        }
    )


async def get_hardware_history(request: Request) -> Response:
    kind = request.query_params.get("kind")
    if not kind:
        raise BadRequest(
            Text("give ?kind=, e.g. ?kind=disk.read (GET /api/hardware lists the kinds)")
        )
    limit = int(query_number(request, "limit", 500, 1, 10000) or 500)
    rows = await blocking(daemon_of(request).hardware.history, kind, limit)
    return JSONResponse({"kind": kind, "measurements": [measurement_json(m) for m in rows]})


async def measure_hardware(request: Request) -> Response:
    """Start "measure again": inventory, disk reads, `moelab bench bw` (body: model, threads)."""
    daemon = daemon_of(request)
    body = await json_body(request)
    bench_args: list[str] = []
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise BadRequest(
                Text("model must be the path of a checkpoint folder (see GET /api/models)")
            )
        if await blocking(daemon.catalog.by_path, model) is None:
            raise BadRequest(
                Text("unknown model {model!r}; GET /api/models lists them", model=model)
            )
        bench_args += ["--model-path", model]
    threads = body.get("threads")
    if threads is not None:
        if not isinstance(threads, list) or not all(isinstance(t, int) and t > 0 for t in threads):
            raise BadRequest(
                Text("threads must be a list of positive whole numbers, e.g. [1, 2, 4]")
            )
        bench_args += ["--threads", ",".join(str(t) for t in threads)]
    paths = [m.path for m in await blocking(daemon.catalog.list)]
    job, new = daemon.hardware.start_measure([Path(p) for p in paths], bench_args)
    if not new:
        raise Conflict(Text("a measurement is already running (job {id})", id=job.id), code="busy")
    audit(request, "measure hardware", f"job {job.id}", bench_args=bench_args)
    return JSONResponse({"job": job.to_json()}, status_code=202)


async def get_job(request: Request) -> Response:
    job = daemon_of(request).jobs.get(path_id(request))
    if job is None:
        raise NotFound(
            Text("no job {id} (jobs last as long as the daemon process)", id=path_id(request))
        )
    return JSONResponse(job.to_json())


def routes() -> list[Route]:
    return [
        Route("/api/hardware", get_hardware),
        Route("/api/hardware/history", get_hardware_history),
        Route("/api/hardware/measure", measure_hardware, methods=["POST"]),
        Route("/api/jobs/{id:int}", get_job),
    ]
