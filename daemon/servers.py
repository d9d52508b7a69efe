"""A server as the API and the console show it: its JSON, its log's last lines, its model's name.

Both read engines through here and the supervisor, never through engine/process/launch.py
themselves.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..engine.process import launch
from ..engine.text import Text, text_fields
from .flags import hide_secrets, redact_flags
from .schema import Server
from .service import Daemon
from .store import iso_time


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


def server_log(row: Server, lines: int, reveal: bool) -> str:
    """The last `lines` of a server's log; secret flag values hidden unless `reveal`."""
    text = launch.log_tail(row.log_path, lines)
    return text if reveal else hide_secrets(text)


def served_model_name(row: Server) -> str:
    """The name clients put in `model`, by the engine's own rule (engine/serving/server.py)."""
    return launch.flag_value(row.flags, "--served-model-name") or Path(row.model).resolve().name
