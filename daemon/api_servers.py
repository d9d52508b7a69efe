"""/api/servers: start, stop, restart and watch engines; their logs, latest stats and telemetry."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.text import Text
from .errors import BadRequest
from .flags import redact_flags
from .http import access_of, audit, blocking, body_id, daemon_of, json_body, path_id, query_number
from .servers import server_json, server_log
from .store import iso_time
from .telemetry import PICKS, STATS, read_samples


async def list_servers(request: Request) -> Response:
    daemon = daemon_of(request)
    rows = await blocking(daemon.supervisor.servers)
    return JSONResponse(
        {"servers": [server_json(r, daemon, access_of(request).control) for r in rows]}
    )


async def get_server(request: Request) -> Response:
    daemon = daemon_of(request)
    row = await blocking(daemon.supervisor.row, path_id(request))
    return JSONResponse(server_json(row, daemon, access_of(request).control))


async def start_server(request: Request) -> Response:
    """Start an engine: `{"profile_id": N}` or `{"model": PATH, "flags": [...], "name"?}`."""
    daemon = daemon_of(request)
    body = await json_body(request)
    if "profile_id" in body:
        if set(body) - {"profile_id"}:
            raise BadRequest(Text("give either profile_id alone, or model and flags"))
        profile_id = body_id(body, "profile_id")
        if profile_id is None:
            raise BadRequest(
                Text("profile_id must be a whole number, or leave it out and give model")
            )
        profile = await blocking(daemon.profiles.get_or_404, profile_id)
        model, flags, name = profile.model, list(profile.flags), profile.name
    else:
        unknown = set(body) - {"model", "flags", "name"}
        if unknown:
            raise BadRequest(
                Text(
                    "unknown field(s) {unknown}; give profile_id, or model and flags",
                    unknown=str(sorted(unknown)),
                )
            )
        model, flags, name, profile_id = (
            body.get("model"),
            body.get("flags", []),
            body.get("name"),
            None,
        )
        if not isinstance(model, str):
            raise BadRequest(
                Text("model must be the path of a checkpoint (GET /api/models lists them)")
            )
        if name is not None and not isinstance(name, str):
            raise BadRequest(Text("name must be a string"))
    row = await blocking(
        daemon.supervisor.start, model=model, flags=flags, name=name, profile_id=profile_id
    )
    audit(
        request,
        "start server",
        f"server {row.id}",
        model=row.model,
        flags=redact_flags(row.flags),
        pid=row.pid,
    )
    return JSONResponse(server_json(row, daemon, True), status_code=202)


async def stop_server(request: Request) -> Response:
    daemon = daemon_of(request)
    row = await blocking(daemon.supervisor.stop, path_id(request))
    audit(request, "stop server", f"server {row.id}", exit_code=row.exit_code)
    return JSONResponse(server_json(row, daemon, True))


async def restart_server(request: Request) -> Response:
    daemon = daemon_of(request)
    row = await blocking(daemon.supervisor.restart, path_id(request))
    audit(request, "restart server", f"server {row.id}", pid=row.pid)
    return JSONResponse(server_json(row, daemon, True), status_code=202)


async def delete_server(request: Request) -> Response:
    daemon = daemon_of(request)
    await blocking(daemon.supervisor.forget, path_id(request))
    audit(request, "delete server", f"server {path_id(request)}")
    return JSONResponse({"deleted": path_id(request)})


async def server_logs(request: Request) -> Response:
    daemon = daemon_of(request)
    row = await blocking(daemon.supervisor.row, path_id(request))
    lines = int(query_number(request, "lines", 200, 1, 5000) or 200)
    text = await blocking(server_log, row, lines, access_of(request).control)
    return JSONResponse({"server_id": row.id, "path": row.log_path, "lines": text.splitlines()})


async def server_stats(request: Request) -> Response:
    """The engine's latest /v1/stats body as the sampler read it (null before the first read)."""
    daemon = daemon_of(request)
    row = await blocking(daemon.supervisor.row, path_id(request))
    latest = await blocking(daemon.sampler.latest, row.id)
    sampled, stats = latest if latest is not None else (None, None)
    return JSONResponse(
        {
            "server_id": row.id,
            "status": row.status,
            "sampled_at": iso_time(sampled),
            "age_s": time.time() - sampled if sampled is not None else None,
            "stats": stats,
        }
    )


async def server_samples(request: Request) -> Response:
    """Stored telemetry: `?kind=stats|picks&since=EPOCH_S&until=EPOCH_S&limit=N`, oldest first."""
    daemon = daemon_of(request)
    row = await blocking(daemon.supervisor.row, path_id(request))
    kind = request.query_params.get("kind", STATS)
    if kind not in (STATS, PICKS):
        raise BadRequest(Text("kind must be {stats} or {picks}", stats=STATS, picks=PICKS))
    since = query_number(request, "since", None, 0, 1e12)
    until = query_number(request, "until", None, 0, 1e12)
    limit = int(query_number(request, "limit", 5000, 1, 50000) or 5000)
    samples = await blocking(read_samples, daemon.store, row.id, kind, since, until, limit)
    return JSONResponse({"server_id": row.id, "kind": kind, "samples": samples})


def routes() -> list[Route]:
    return [
        Route("/api/servers", list_servers),
        Route("/api/servers", start_server, methods=["POST"]),
        Route("/api/servers/{id:int}", get_server),
        Route("/api/servers/{id:int}", delete_server, methods=["DELETE"]),
        Route("/api/servers/{id:int}/stop", stop_server, methods=["POST"]),
        Route("/api/servers/{id:int}/restart", restart_server, methods=["POST"]),
        Route("/api/servers/{id:int}/logs", server_logs),
        Route("/api/servers/{id:int}/stats", server_stats),
        Route("/api/servers/{id:int}/samples", server_samples),
    ]
