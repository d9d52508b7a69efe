"""/api/servers: start, stop, restart and watch engines; their logs, latest stats and telemetry."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine import launch
from ..engine.text import Text, text_fields
from .api import access_of, audit, blocking, body_id, daemon_of, json_body, path_id, query_number
from .errors import BadRequest, NotFound
from .flags import hide_secrets, redact_flags
from .schema import Profile, Server
from .service import Daemon
from .store import iso_time
from .telemetry import PICKS, STATS, read_samples


def server_json(row: Server, daemon: Daemon, reveal: bool) -> dict[str, Any]:
    """A server as the API shows it; secret flag values only to callers with control."""
    handle = daemon.supervisor.handle(row.id)
    ended = row.status in ("crashed", "failed", "dead")
    uptime_s = time.time() - row.started if row.status == "running" and row.started else None
    return {
        "id": row.id,
        "profile_id": row.profile_id,
        "name": row.name,
        "model": row.model,
        "flags": row.flags if reveal else redact_flags(row.flags),
        "host": row.host,
        "port": row.port,
        "url": f"http://{'127.0.0.1' if row.host in ('0.0.0.0', '') else row.host}:{row.port}",
        "device": row.device,
        "status": row.status,
        "pid": row.pid,
        "exit_code": row.exit_code,
        **text_fields("error", Text.from_json(row.error_text) if row.error_text else row.error),
        "log_tail": (row.log_tail if reveal else hide_secrets(row.log_tail or ""))
        if ended
        else None,
        "health": handle.health if handle else None,
        "created": iso_time(row.created),
        "started": iso_time(row.started),
        "ready": iso_time(row.ready),
        "stopped": iso_time(row.stopped),
        "uptime_s": uptime_s,
    }


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

        def profile() -> Profile:
            with daemon.store.session() as session:
                row = session.get(Profile, profile_id)
                if row is None:
                    raise NotFound(Text("no profile {profile_id}", profile_id=profile_id))
                return row

        p = await blocking(profile)
        model, flags, name = p.model, list(p.flags), p.name
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
    text = await blocking(launch.log_tail, row.log_path, lines)
    if not access_of(request).control:
        text = hide_secrets(text)
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
