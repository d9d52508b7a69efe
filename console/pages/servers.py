"""Servers: every engine with its status, and (with control) start, stop, restart; one engine's
page with its live log tail, and the exit code and last lines of one that crashed."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...daemon.catalog import DEMO_FLAGS, model_json
from ...daemon.flags import redact_flags
from ...daemon.http import blocking, daemon_of, path_id, query_number
from ...daemon.servers import server_json, server_log
from ...daemon.service import Daemon
from .. import engines
from ..i18n import _
from ..reach import Viewer, client_json
from ..web import NavEntry, render

LOG_LINES = 200


def profiles(daemon: Daemon, reveal: bool) -> list[dict[str, Any]]:
    """The launch profiles to start from (name, model, flags)."""
    return [
        {
            "id": p.id,
            "name": p.name,
            "model": p.model,
            "flags": p.flags if reveal else redact_flags(p.flags),
        }
        for p in daemon.profiles.list()
    ]


def servers_data(daemon: Daemon, reveal: bool) -> dict[str, Any]:
    models = [model_json(m) for m in daemon.catalog.list()]
    demo_job = daemon.jobs.latest("demo-model")
    return {
        "servers": engines.servers(daemon, reveal),
        "models": models,
        "profiles": profiles(daemon, reveal),
        "demo_job": demo_job.to_json() if demo_job else None,
        "demo_flags": DEMO_FLAGS,
    }


async def servers_page(request: Request) -> Response:
    data = await blocking(servers_data, daemon_of(request), request.state.access.control)
    return render(request, "servers.html", data, parts=("server_list",))


def server_data(
    daemon: Daemon, server_id: int, reveal: bool, lines: int, viewer: Viewer
) -> dict[str, Any]:
    row = daemon.supervisor.row(server_id)
    log = server_log(row, lines, reveal)
    sampled_at, stats = engines.latest_stats(daemon, server_id)
    return {
        "server": server_json(row, daemon, reveal),
        "command": ["moelab", "serve", "--model-path", row.model, *(
            row.flags if reveal else redact_flags(row.flags))],
        "client": client_json(row, viewer),
        "log": {"path": row.log_path, "lines": log.splitlines()},
        "sampled_at": sampled_at,
        "config": (stats or {}).get("config"),
        "held": engines.held_formats(stats),
    }  # fmt: skip


async def server_page(request: Request) -> Response:
    lines = int(query_number(request, "lines", LOG_LINES, 1, 5000) or LOG_LINES)
    access = request.state.access
    viewer = Viewer(request.url.hostname or "127.0.0.1", access.loopback_client)
    data = await blocking(
        server_data, daemon_of(request), path_id(request), access.control, lines, viewer
    )
    return render(request, "server.html", data, parts=("server_head", "log"))


ROUTES = [
    Route("/servers", servers_page),
    Route("/servers/{id:int}", server_page),
]
NAV = (NavEntry("/servers", _("Servers"), 20),)
