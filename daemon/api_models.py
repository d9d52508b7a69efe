"""/api/models and /api/flags: the checkpoints found (rescan on request) and the engine's flags."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.config.args import describe_flags
from .catalog import model_json
from .http import audit, blocking, daemon_of, path_id


async def get_models(request: Request) -> Response:
    daemon = daemon_of(request)
    rows = await blocking(daemon.catalog.list, request.query_params.get("all") == "1")
    job = daemon.jobs.latest("demo-model")
    return JSONResponse(
        {
            "models": [model_json(m) for m in rows],
            "roots": [{"path": str(r.path), "source": r.source} for r in daemon.catalog.roots],
            "demo_job": job.to_json() if job else None,
        }
    )


async def get_model(request: Request) -> Response:
    row = await blocking(daemon_of(request).catalog.get_or_404, path_id(request))
    return JSONResponse(model_json(row))


async def rescan_models(request: Request) -> Response:
    rows = await blocking(daemon_of(request).catalog.rescan)
    audit(request, "rescan models", detail_count=len(rows))
    return JSONResponse({"models": [model_json(m) for m in rows]})


async def get_flags(_request: Request) -> Response:
    return JSONResponse({"flags": describe_flags()})


def routes() -> list[Route]:
    return [
        Route("/api/models", get_models),
        Route("/api/models/rescan", rescan_models, methods=["POST"]),
        Route("/api/models/{id:int}", get_model),
        Route("/api/flags", get_flags),
    ]
