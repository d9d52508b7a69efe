"""Shared look of the console's Plotly figures: one layout, time axes, colours per memory use.

Figures are built here in Python and drawn by plotly.js in the browser (console.js reads each
`.chart` element's `data-figure`). Pages build their own figures with these helpers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import plotly.graph_objects as go

from .i18n import GIB, Translator

__all__ = ["COLOURS", "GIB", "figure", "layout", "line", "local_iso", "local_times", "time_axis"]

COLOURS = {
    "weights": "#4c72b0",
    "kv": "#55a868",
    "states": "#64b5cd",
    "expert_cache": "#dd8452",
    "activations": "#8172b3",
    "other": "#937860",
    "free": "#e5e8ee",
    "expert_bank": "#dd8452",
    "engine_other": "#c44e52",
    "decode": "#4c72b0",
    "prefill": "#55a868",
    "route": "#8172b3",
    "copy": "#dd8452",
    "gpu_experts": "#4c72b0",
    "cpu_experts": "#c44e52",
}


# The legend sits at the bottom of the chart's box (container coordinates), where Plotly makes
# room for it below the x axis's tick labels, however many rows it wraps into at phone width; in
# paper coordinates (y < 0) it is placed a share of the plot's height below the axis and meets
# rotated or two-line tick labels. It wraps within the plot's width: keep y-axis labels short.
LEGEND = {"orientation": "h", "x": 0, "xanchor": "left", "y": 0, "yref": "container",
          "yanchor": "bottom"}  # fmt: skip


def layout(t: Translator, *, title: str = "", height_px: int = 280, **extra: Any) -> dict[str, Any]:
    """The layout every console chart starts from: compact margins, legend below, no logo.

    `legend` and `xaxis` in `extra` are merged into the defaults rather than replacing them."""
    base: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "height": height_px,
        "margin": {"l": 55, "r": 15, "t": 36 if title else 12, "b": 10},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "#ffffff",
        "font": {"size": 12},
        "separators": ".,",
        "hovermode": "x unified",
    }
    base.update(extra)
    base["legend"] = {**LEGEND, **extra.get("legend", {})}
    base["xaxis"] = {"automargin": True, **extra.get("xaxis", {})}
    return base


def time_axis(t: Translator) -> dict[str, Any]:
    """An x axis of local clock times, written with digits only (no month names to translate)."""
    return {
        "type": "date",
        "hoverformat": "%H:%M:%S",
        "tickformatstops": [
            {"dtickrange": [None, 60_000], "value": "%H:%M:%S"},
            {"dtickrange": [60_000, 86_400_000], "value": "%H:%M"},
            {"dtickrange": [86_400_000, None], "value": "%m/%d"},
        ],
    }


def local_times(epochs: list[float]) -> list[str]:
    """Epoch seconds as local-time strings Plotly puts on a date axis without shifting them."""
    return [datetime.fromtimestamp(e).isoformat(timespec="seconds") for e in epochs]


def local_iso(when: str) -> str:
    """An API time (ISO 8601 UTC) as a local-time string for a date axis."""
    return (
        datetime.fromisoformat(when).astimezone().replace(tzinfo=None).isoformat(timespec="seconds")
    )


def figure(traces: list[Any], layout_: dict[str, Any]) -> go.Figure:
    return go.Figure(data=traces, layout=layout_)


def line(
    x: list[Any], y: list[Any], name: str, colour: str | None = None, **style: Any
) -> go.Scatter:
    """A line trace over time; `colour` a key of COLOURS, `style` further line settings."""
    line_style = {**({"color": COLOURS[colour]} if colour else {}), **style}
    return go.Scatter(x=x, y=y, name=name, mode="lines", line=line_style)
