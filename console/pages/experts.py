"""Experts, per engine: which layers miss over time, which experts each layer picks (with its cache
slots marked), where a decode step's time goes, what a larger cache would give, and advice."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...daemon.http import blocking, daemon_of, path_id
from ...daemon.servers import server_json
from ...daemon.service import Daemon
from .. import charts, engines
from ..advice import advise, whatif_hit_rate
from ..i18n import Translator, _
from ..series import BREAKDOWN_PARTS, breakdown_mean, miss_rates, pick_shares, summed_picks
from ..series import top_experts as most_picked
from ..web import WINDOWS_MIN, NavEntry, render, window_minutes

BREAKDOWN_LABELS = {
    "route": _("routing"),
    "copy": _("copies to the GPU"),
    "gpu_experts": _("experts on the GPU"),
    "cpu_experts": _("experts on the CPU"),
    "other": _("everything else"),
}


def experts_index_data(daemon: Daemon, reveal: bool) -> dict[str, Any]:
    everything = engines.servers(daemon, reveal)
    return {
        "running": [s for s in everything if s["status"] == "running"],
        "starting": [s for s in everything if s["status"] == "starting"],
        "recent": [s for s in everything if s["status"] not in engines.LIVE][:5],
    }


async def experts_index(request: Request) -> Response:
    data = await blocking(experts_index_data, daemon_of(request), request.state.access.control)
    return render(request, "experts_index.html", data, parts=("experts_index",))


def cache_points(experts: dict[str, Any]) -> list[dict[str, Any]]:
    """Today's slots, 1.5x and 2x (capped at every expert), with their bytes and hit rates."""
    slots = experts.get("slots") or 0
    total = (experts.get("num_layers") or 0) * (experts.get("num_experts") or 0)
    slot_bytes = experts.get("slot_bytes") or 0
    curve = experts.get("whatif") or []
    points = []
    for name, factor in (("now", 1.0), ("1.5x", 1.5), ("2x", 2.0)):
        n = min(total, round(slots * factor))
        points.append(
            {
                "name": name,
                "slots": n,
                "bytes": n * slot_bytes,
                "extra_bytes": (n - slots) * slot_bytes,
                "hit_rate": whatif_hit_rate(curve, n),
            }
        )
    return points


def expert_data(daemon: Daemon, server_id: int, reveal: bool, minutes: int) -> dict[str, Any]:
    row = daemon.supervisor.row(server_id)
    sampled_at, stats = engines.latest_stats(daemon, server_id)
    experts = (stats or {}).get("experts")
    data: dict[str, Any] = {
        "server": server_json(row, daemon, reveal),
        "minutes": minutes,
        "windows_min": list(WINDOWS_MIN),
        "sampled_at": sampled_at,
        "experts": None,
    }
    if not stats or not experts:
        data["no_stats"] = bool(stats)  # a body without experts: the engine runs with --no-stats
        return data
    num_layers = experts["num_layers"]
    rows = engines.samples(daemon, server_id, window_s=minutes * 60)
    picks = summed_picks(engines.picks_samples(daemon, server_id, minutes * 60))
    picks_source = "samples"
    if picks is None:  # the engine is younger than the first picks row: its own running total
        picks, picks_source = experts.get("picks") or [], "engine"
    resident = [layer.get("resident", 0) for layer in experts.get("layers") or []]
    inventory = daemon.hardware.inventory(max_age_s=3600.0)
    mean = breakdown_mean(rows)
    advised = dict(stats)
    if mean is not None:  # a minute's mean is steadier than the one step the body timed
        advised["breakdown"] = mean
    data.update(
        experts={
            key: experts.get(key)
            for key in (
                "num_layers",
                "layer_ids",
                "layer_types",
                "num_experts",
                "top_k",
                "slots",
                "slot_bytes",
                "policy",
                "hit_rate_60s",
                "hit_rate",
                "whatif",
                "whatif_accesses",
                "miss_cost",
            )
        },
        resident=resident,
        # a split engine's devices, each with its first and last layer, its link's and its
        # memory's rates, its slots and whether it limits the step (/v1/stats devices)
        devices=[
            {
                key: d.get(key)
                for key in ("device", "layers", "link_gbps", "memory_gbps", "slots", "limits")
            }
            for d in stats.get("devices") or []
            if isinstance(d, dict)
        ],
        miss_rates=miss_rates(rows, num_layers),
        window_cut=engines.window_cut(rows),
        picks={
            "source": picks_source,
            "matrix": picks,
            "most_picked": [most_picked(c, n) for c, n in zip(picks, resident, strict=False)],
        },
        breakdown={"latest": stats.get("breakdown"), "mean": mean},
        cache_points=cache_points(experts),
        advice=[c.to_json() for c in advise(advised, inventory.physical_cores)],
    )
    return data


async def expert_page(request: Request) -> Response:
    minutes = window_minutes(request)
    data = await blocking(
        expert_data, daemon_of(request), path_id(request), request.state.access.control, minutes
    )
    return render(request, "experts.html", data, charts=expert_charts, parts=("expert_body",))


# ---- charts -----------------------------------------------------------------------------------


# the token mixers of a hybrid model's layers, as the heatmaps label them
MIXER_LABELS = {"full_attention": _("attention"), "linear_attention": _("DeltaNet")}


def _layer_names(data: dict[str, Any], t: Translator) -> list[str]:
    """The heatmaps' row names: "L12", and where the model mixes kinds of layers (a hybrid of
    Gated DeltaNet and attention layers), each one's kind: "L12 DeltaNet", "L15 attention";
    where the layers are split across devices, each one's device: "L12 cuda:1"."""
    experts = data["experts"]
    ids = experts.get("layer_ids") or list(range(experts["num_layers"]))
    kinds = experts.get("layer_types") or []
    names = [f"L{i}" for i in ids]
    if len(set(kinds)) > 1:
        names = [f"{n} {t(MIXER_LABELS[kind])}" for n, kind in zip(names, kinds, strict=True)]
    devices = data.get("devices") or []
    if len(devices) > 1:
        names = [f"{n} {_device_of(i, devices)}" for n, i in zip(names, ids, strict=True)]
    return names


def _device_of(layer: int, devices: list[dict[str, Any]]) -> str:
    """The device whose range of layers holds `layer`."""
    for device in devices:
        first, last = device.get("layers") or (0, -1)
        if first <= layer <= last:
            return str(device.get("device"))
    return "?"


def expert_charts(data: dict[str, Any], t: Translator) -> Mapping[str, go.Figure]:
    if not data.get("experts"):
        return {}
    figures: dict[str, go.Figure] = {}
    layers = _layer_names(data, t)
    misses = data["miss_rates"]
    if misses["t"]:
        figures["miss_heatmap"] = charts.figure(
            [
                go.Heatmap(
                    z=misses["z"],
                    x=charts.local_times(misses["t"]),
                    y=layers,
                    zmin=0,
                    zmax=1,
                    colorscale="YlOrRd",
                    colorbar={"title": {"text": t("misses")}, "tickformat": ".0%"},
                    hovertemplate=t("layer")
                    + " %{y} · %{x}<br>"
                    + t("misses")
                    + " %{z:.1%}"
                    + "<extra></extra>",
                )
            ],
            charts.layout(
                t,
                title=t("miss rate per layer over time"),
                xaxis=charts.time_axis(t),
                yaxis={"title": t("MoE layer"), "autorange": "reversed"},
                height_px=max(260, 120 + 14 * len(layers)),
                hovermode="closest",
            ),
        )
    picks = data["picks"]
    if picks["matrix"] and any(any(row) for row in picks["matrix"]):
        figures["pick_heatmap"] = _picks_figure(data, layers, t)
    breakdown = data["breakdown"]
    bars = [(t("latest step"), breakdown["latest"]), (t("mean over the window"), breakdown["mean"])]
    bars = [(label, b) for label, b in bars if b]
    if bars:
        figures["breakdown"] = charts.figure(
            [
                go.Bar(
                    y=[label for label, _b in bars],
                    x=[b.get(part, 0.0) * 1000 for _l, b in bars],
                    name=t(BREAKDOWN_LABELS[part]),
                    orientation="h",
                    marker={"color": charts.COLOURS[part]},
                    hovertemplate="%{x:.3f} ms",
                )
                for part in BREAKDOWN_PARTS
            ],
            charts.layout(
                t,
                title=t("one decode step (one token for each running request)"),
                barmode="stack",
                height_px=230,
                xaxis={"ticksuffix": " ms"},
                yaxis={"automargin": True},
                hovermode="y unified",
            ),
        )
    curve = data["experts"].get("whatif") or []
    if curve and data["experts"].get("whatif_accesses"):
        figures["whatif"] = _whatif_figure(data, curve, t)
    return figures


def _picks_figure(data: dict[str, Any], layers: list[str], t: Translator) -> go.Figure:
    picks = data["picks"]
    matrix = picks["matrix"]
    num_experts = max(len(row) for row in matrix)
    marked_x, marked_y = [], []
    for layer, experts_ in enumerate(picks["most_picked"]):
        marked_x += experts_
        marked_y += [layers[layer]] * len(experts_)
    resident = data["resident"]
    return charts.figure(
        [
            go.Heatmap(
                z=pick_shares(matrix),
                x=list(range(num_experts)),
                y=layers,
                customdata=matrix,
                colorscale="Blues",
                colorbar={"title": {"text": t("share of the layer's picks")}, "tickformat": ".0%"},
                hovertemplate=t("layer")
                + " %{y} · "
                + t("expert")
                + " %{x}<br>"
                + t("picks")
                + " %{customdata} (%{z:.1%})<extra></extra>",
            ),
            go.Scatter(
                x=marked_x,
                y=marked_y,
                mode="markers",
                marker={
                    "symbol": "square-open",
                    "size": 12,
                    "color": "#1d2330",
                    "line": {"width": 2},
                },
                name=t(
                    "outlined: the most-picked experts, as many as the slots the layer holds now"
                ),
                hoverinfo="skip",
            ),
        ],
        charts.layout(
            t,
            title=t("expert picks per layer"),
            xaxis={"title": t("expert"), "dtick": 1 if num_experts <= 32 else None},
            yaxis={
                "title": t("MoE layer"),
                "autorange": "reversed",
                "ticktext": [
                    f"{name} ({resident[i] if i < len(resident) else 0})"
                    for i, name in enumerate(layers)
                ],
                "tickvals": layers,
            },
            height_px=max(300, 150 + 16 * len(layers)),
            hovermode="closest",
        ),
    )


def _whatif_figure(data: dict[str, Any], curve: list[dict[str, Any]], t: Translator) -> go.Figure:
    labels = {"now": t("today"), "1.5x": "1.5×", "2x": "2×"}
    points = []  # 1.5x and 2x may both be every expert: one marker for each size
    for point in data["cache_points"]:
        if all(p["slots"] != point["slots"] for p in points):
            points.append(point)
    return charts.figure(
        [
            go.Scatter(
                x=[p["slots"] for p in curve],
                y=[p["hit_rate"] for p in curve],
                mode="lines",
                name=t("hit rate if every miss were fetched (LRU)"),
                line={"color": "#4c72b0"},
                hovertemplate="%{x} " + t("slots") + ": %{y:.1%}<extra></extra>",
            ),
            go.Scatter(
                x=[p["slots"] for p in points],
                y=[p["hit_rate"] for p in points],
                mode="markers+text",
                name=t("today, 1.5× and 2× the slots"),
                text=[
                    f"{labels[p['name']]}: {t.percent(p['hit_rate'])}<br>{t.size(p['bytes'])}"
                    for p in points
                ],
                textposition=["bottom right"] * (len(points) - 1) + ["bottom left"],
                marker={"size": 10, "color": "#dd8452"},
                hoverinfo="skip",
            ),
        ],
        charts.layout(
            t,
            title=t("what a larger cache would give"),
            xaxis={"title": t("expert slots"), "rangemode": "tozero"},
            yaxis={"title": t("hit rate"), "range": [0, 1.02], "tickformat": ".0%"},
            height_px=320,
            hovermode="closest",
        ),
    )


ROUTES = [
    Route("/experts", experts_index),
    Route("/experts/{id:int}", expert_page),
]
NAV = (NavEntry("/experts", _("Experts"), 30),)
