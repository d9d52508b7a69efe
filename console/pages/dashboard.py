"""The dashboard: each running engine's speed, requests and hit rate over time; memory in use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...daemon.catalog import DEMO_FLAGS
from ...daemon.http import blocking, daemon_of
from ...daemon.service import Daemon
from .. import charts, engines
from ..i18n import Translator, _
from ..series import gauge_series
from ..web import WINDOWS_MIN, NavEntry, render, window_minutes


def now_figures(stats: dict[str, Any] | None) -> dict[str, Any]:
    """The gauges shown as numbers at the top of an engine's card."""
    stats = stats or {}
    throughput = stats.get("throughput") or {}
    requests = stats.get("requests") or {}
    kv = stats.get("kv") or {}
    experts = stats.get("experts") or {}
    return {
        "decode_tok_s": throughput.get("decode_tok_s_10s"),
        "prefill_tok_s": throughput.get("prefill_tok_s_10s"),
        "ttft_mean_s": requests.get("ttft_mean_s"),
        "ttft_p95_s": requests.get("ttft_p95_s"),
        "running": requests.get("running"),
        "queued": requests.get("queued"),
        "completed": requests.get("completed"),
        "preempted": requests.get("preempted"),
        "hit_rate_60s": experts.get("hit_rate_60s"),
        "kv_tokens_used": kv.get("tokens_used"),
        "kv_tokens_total": kv.get("tokens_total"),
        "prefix_cached_share": prefix_cached_share(kv.get("prefix_cache")),
    }


def prefix_cached_share(prefix: dict[str, Any] | None) -> float | None:
    """The share of the prompt tokens admitted so far that the prefix cache held (None before
    any prompt, with the cache off, or from an engine that does not report it)."""
    if not prefix or not prefix.get("enabled") or not prefix.get("prompt_tokens"):
        return None
    return prefix["cached_tokens"] / prefix["prompt_tokens"]


def dashboard_data(daemon: Daemon, reveal: bool, minutes: int) -> dict[str, Any]:
    everything = engines.servers(daemon, reveal)
    live = [s for s in everything if s["status"] in engines.LIVE]
    cards = []
    for server in live:
        sampled_at, stats = engines.latest_stats(daemon, server["id"])
        running = server["status"] == "running"
        rows = engines.samples(daemon, server["id"], window_s=minutes * 60) if running else []
        cards.append(
            {
                "server": server,
                "sampled_at": sampled_at if running else None,
                "now": now_figures(stats if running else None),
                "series": gauge_series(rows),
                "window_cut": engines.window_cut(rows),
                "devices": engines.device_split(stats) if running and stats else [],
                "expert_bank": ((stats or {}).get("memory") or {}).get("expert_bank")
                if running
                else None,
            }
        )
    inventory = daemon.hardware.inventory()
    models = daemon.catalog.list()
    demo_job = daemon.jobs.latest("demo-model")
    return {
        "minutes": minutes,
        "windows_min": list(WINDOWS_MIN),
        "engines": cards,
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "total": g.vram_total_bytes,
                "free": g.vram_free_bytes,
            }
            for g in inventory.gpus
        ],
        "host_ram": engines.host_split(
            inventory.ram_total_bytes,
            inventory.ram_available_bytes,
            [c["expert_bank"] or 0 for c in cards],
        ),
        "models_found": len(models),
        "demo_model": next((m.path for m in models if m.is_demo), None),
        "demo_flags": DEMO_FLAGS,
        "demo_job": demo_job.to_json() if demo_job else None,
        "ended": [s for s in everything if s["status"] in ("crashed", "failed", "dead")][:3],
    }


async def dashboard(request: Request) -> Response:
    minutes = window_minutes(request)
    data = await blocking(dashboard_data, daemon_of(request), request.state.access.control, minutes)
    return render(request, "dashboard.html", data, charts=dashboard_charts, parts=("engines",))


# ---- charts -----------------------------------------------------------------------------------

PART_LABELS = {
    "weights": _("weights"),
    "kv": _("KV cache"),
    "states": _("recurrent states"),
    "expert_cache": _("expert cache"),
    "activations": _("activations"),
    "other": _("other"),
    "free": _("free"),
    "expert_bank": _("expert bank"),
}


def dashboard_charts(data: dict[str, Any], t: Translator) -> Mapping[str, go.Figure]:
    figures: dict[str, go.Figure] = {}
    for card in data["engines"]:
        series = card["series"]
        if len(series["t"]) < 1:
            continue
        sid = card["server"]["id"]
        x = charts.local_times(series["t"])
        figures[f"throughput-{sid}"] = charts.figure(
            [
                charts.line(x, series["decode_tok_s_10s"], t("generation"), "decode"),
                charts.line(x, series["prefill_tok_s_10s"], t("prompt"), "prefill"),
            ],
            charts.layout(
                t,
                title=t("tokens per second"),
                xaxis=charts.time_axis(t),
                yaxis={"rangemode": "tozero", "title": "tok/s"},
            ),
        )
        figures[f"hit_rate-{sid}"] = charts.figure(
            [charts.line(x, series["hit_rate_60s"], t("hit rate (60 s)"), "expert_cache")],
            charts.layout(
                t,
                title=t("expert cache hit rate"),
                xaxis=charts.time_axis(t),
                yaxis={"range": [0, 1], "tickformat": ".0%"},
                showlegend=False,
            ),
        )
        ttft_ms = [v * 1000 if v is not None else None for v in series["ttft_mean_s"]]
        ttft = charts.line(x, ttft_ms, t("time to first token (ms)"), dash="dot")
        ttft.update(yaxis="y2")
        figures[f"requests-{sid}"] = charts.figure(
            [
                charts.line(x, series["running"], t("running"), shape="hv"),
                charts.line(x, series["queued"], t("queued"), shape="hv"),
                ttft,
            ],
            charts.layout(
                t,
                title=t("requests and time to first token"),
                xaxis=charts.time_axis(t),
                yaxis={"rangemode": "tozero", "title": t("requests")},
                yaxis2={"overlaying": "y", "side": "right", "rangemode": "tozero", "title": "ms"},
            ),
        )
    if data["gpus"] or any(card["devices"] for card in data["engines"]):
        figures["vram"] = _vram_figure(data, t)
    figures["host_ram"] = _host_figure(data["host_ram"], t)
    return figures


def _vram_figure(data: dict[str, Any], t: Translator) -> go.Figure:
    """One stacked bar per device: the engines' own split, or a GPU's used/free when idle."""
    rows: list[tuple[str, dict[str, float]]] = []
    used_gpus = set()
    for card in data["engines"]:
        server = card["server"]
        split = "," in server["device"]  # --devices: a bar per card, each under its own name
        for device in card["devices"]:
            label = server["device"] if server["device"] != "cpu" else t("CPU (planned budget)")
            if split:
                label = f"cuda:{device['index']}" if server["device"].startswith("cuda") else "cpu"
            if server["device"].startswith("cuda"):
                used_gpus.add(device["index"])
            # two short lines: a long one-line label would narrow the plot and so its legend
            rows.append(
                (f"{server['name']}<br>{label}", {**device["parts"], "free": device["free"]})
            )
    for gpu in data["gpus"]:
        if gpu["index"] in used_gpus or gpu["total"] is None:
            continue
        free = gpu["free"] or 0
        rows.append(
            (f"cuda:{gpu['index']}<br>{gpu['name']}", {"other": gpu["total"] - free, "free": free})
        )
    traces = []
    for part in (*engines.DEVICE_PARTS, "free"):
        values = [parts.get(part, 0) / charts.GIB for _, parts in rows]
        if part == "states" and not any(values):
            continue  # no hybrid model's engine: no recurrent states in the legend
        traces.append(
            go.Bar(
                y=[label for label, _ in rows],
                x=values,
                name=t(PART_LABELS[part]),
                orientation="h",
                marker={"color": charts.COLOURS[part]},
                hovertemplate="%{x:.2f} GiB",
            ),
        )
    return charts.figure(
        traces,
        charts.layout(
            t,
            title=t("device memory"),
            barmode="stack",
            height_px=140 + 40 * len(rows),
            xaxis={"ticksuffix": " GiB", "rangemode": "tozero"},
            hovermode="y unified",
            yaxis={"automargin": True},
        ),
    )


def _host_figure(host: dict[str, int], t: Translator) -> go.Figure:
    traces = [
        go.Bar(
            y=[t("host RAM")],
            x=[host[part] / charts.GIB],
            name=t(label),
            orientation="h",
            marker={"color": charts.COLOURS[colour]},
            hovertemplate="%{x:.2f} GiB",
        )
        for part, label, colour in (
            ("expert_bank", PART_LABELS["expert_bank"], "expert_bank"),
            ("other", _("other programs and engine memory"), "other"),
            ("free", PART_LABELS["free"], "free"),
        )
    ]
    return charts.figure(
        traces,
        charts.layout(
            t,
            title=t("host RAM"),
            barmode="stack",
            height_px=170,
            xaxis={"ticksuffix": " GiB", "rangemode": "tozero"},
            hovermode="y unified",
            yaxis={"automargin": True},
        ),
    )


ROUTES = [Route("/", dashboard)]
NAV = (NavEntry("/", _("Dashboard"), 10),)
