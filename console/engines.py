"""What the pages read about engines: server rows as the API shows them, the latest stats body,
stored telemetry, and how device and host memory are split between uses.

Blocking (SQLite); page handlers call these through `daemon.http.blocking`.
"""

from __future__ import annotations

import time
from typing import Any

from ..daemon.servers import server_json
from ..daemon.service import Daemon
from ..daemon.store import iso_time
from ..daemon.telemetry import PICKS, STATS, read_samples
from .i18n import _

LIVE = ("starting", "running", "stopping")
# rows a chart reads at most: a busy engine writes one every 2 s, so about 2.8 hours of them
SAMPLE_LIMIT = 5000
# the statuses of daemon/supervisor.py, marked for the catalog; pages show them with t(status)
STATUSES = (
    _("starting"), _("running"), _("stopping"), _("stopped"), _("crashed"), _("failed"), _("dead"),
)  # fmt: skip
# device memory uses as the console groups them (prefill buffers and graph pools are activations;
# states: a hybrid model's recurrent states, one slot per running sequence)
DEVICE_PARTS = ("weights", "kv", "states", "expert_cache", "activations", "other")


def servers(daemon: Daemon, reveal: bool) -> list[dict[str, Any]]:
    """Every server, newest first, as GET /api/servers shows it to this caller."""
    return [server_json(row, daemon, reveal) for row in daemon.supervisor.servers()]


def latest_stats(daemon: Daemon, server_id: int) -> tuple[str | None, dict[str, Any] | None]:
    """(when it was sampled, the latest /v1/stats body) of a server, or (None, None)."""
    latest = daemon.sampler.latest(server_id)
    if latest is None:
        return None, None
    return iso_time(latest[0]), latest[1]


def samples(
    daemon: Daemon, server_id: int, kind: str = STATS, window_s: float = 3600.0
) -> list[dict[str, Any]]:
    """Stored rows of the window, oldest first; only the newest SAMPLE_LIMIT of a long one."""
    return read_samples(
        daemon.store, server_id, kind, since=time.time() - window_s, limit=SAMPLE_LIMIT
    )


def window_cut(rows: list[dict[str, Any]]) -> float | None:
    """When the rows begin if SAMPLE_LIMIT cut the window short (the page says so), else None."""
    return rows[0]["t"] if len(rows) >= SAMPLE_LIMIT else None


def picks_samples(daemon: Daemon, server_id: int, window_s: float) -> list[dict[str, Any]]:
    return samples(daemon, server_id, PICKS, window_s)


def held_formats(stats: dict[str, Any] | None) -> dict[str, str | None]:
    """How an engine holds its routed experts, its dense projections and its KV cache, as
    /v1/stats says: "fp8", "mxfp4" or "nvfp4", else a dtype's name (an expert format other than
    those is the compute dtype); None where unsaid."""
    stats = stats or {}
    config = stats.get("config") or {}
    experts = (stats.get("experts") or {}).get("dtype")
    if experts is not None and experts not in ("fp8", "mxfp4", "nvfp4"):
        experts = config.get("dtype") or experts
    return {
        "experts": experts,
        "dense": config.get("dense_dtype"),
        "kv": (stats.get("kv") or {}).get("dtype"),
    }


def device_split(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Each device's memory as the engine reports it, grouped into DEVICE_PARTS plus free."""
    out = []
    for device in (stats.get("memory") or {}).get("device") or []:
        parts = {
            "weights": device.get("weights") or 0,
            "kv": device.get("kv") or 0,
            "states": device.get("states") or 0,
            "expert_cache": device.get("expert_cache") or 0,
            "activations": (device.get("activations") or 0)
            + (device.get("prefill_buffer") or 0)
            + (device.get("graphs") or 0),
            "other": device.get("other") or 0,
        }
        total = device.get("total") or 0
        out.append(
            {
                "index": device.get("index", 0),
                "total": total,
                "parts": parts,
                "free": max(0, total - sum(parts.values())),
            }
        )
    return out


def host_split(ram_total: int, ram_available: int, bank_bytes: list[int]) -> dict[str, int]:
    """Host RAM: the running engines' expert banks, everything else in use, and what is free."""
    bank = sum(bank_bytes)
    used = max(0, ram_total - ram_available)
    return {
        "total": ram_total,
        "expert_bank": min(bank, used),
        "other": max(0, used - bank),
        "free": ram_available,
    }
