"""Benchmark: start a run (after seeing its plan), watch it live, its result with "Save as profile",
the run history, and two runs side by side."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import plotly.graph_objects as go
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...autotune.modes import MODES
from ...autotune.noise import OBJECTIVES
from ...daemon.benchmark_views import (
    compare_runs,
    full_run,
    options_of,
    plan_json,
    run_summary,
    service_of,
)
from ...daemon.benchmarks import BenchmarkService
from ...daemon.catalog import model_json
from ...daemon.errors import BadRequest
from ...daemon.http import blocking, daemon_of, path_id
from ...daemon.service import Daemon
from ...engine.text import Text
from .. import charts
from ..i18n import Translator, _
from ..web import NavEntry, render

FIGURES = (
    ("prefill", _("Prefill")),
    ("decode", _("Decode")),
    ("aggregate", _("Aggregate")),
    ("agent", _("Agent session")),
)
VERDICT_COLOURS = {
    "base": "#5d6677",
    "kept": "#1f7a3e",
    "confirm": "#4c72b0",
    "rejected": "#dd8452",
    "pending": "#8172b3",
    "failed": "#b3261e",
}
OBJECTIVE_LABELS = {
    "decode": _("Decode tok/s (one request)"),
    "prefill": _("Prefill tok/s (one long prompt)"),
    "both": _("Both (geometric mean of prefill and decode)"),
    "aggregate": _("Aggregate tok/s (concurrent clients)"),
    "agent": _("Agent session tok/s (a coding agent's turns over a growing prompt)"),
}
MODE_LABELS = {
    "quick": _("Quick: a few values of the flags that move the objective"),
    "standard": _("Standard: every tunable flag, ordered values walked while they win"),
    "thorough": _("Thorough: every value of every flag, longer workloads, every context tier"),
}
# words the templates translate from data (statuses, phases, verdicts, roles)
WORDS = (
    _("running"), _("done"), _("failed"), _("cancelled"), _("interrupted"),
    _("starting"), _("hardware"), _("baseline"), _("candidates"), _("context"), _("result"),
    _("base"), _("kept"), _("rejected"), _("confirm"), _("pending"),
    _("candidate"), _("quick"), _("standard"), _("thorough"), _("calibration"),
)  # fmt: skip
LABELS = {"objectives": OBJECTIVE_LABELS, "modes": MODE_LABELS}


def benchmark_data(daemon: Daemon, service: BenchmarkService) -> dict[str, Any]:
    active = service.active_id
    runs = [run_summary(r, active) for r in service.runs()]
    models = [model_json(m) for m in daemon.catalog.list()]
    return {
        "models": models,
        "runs": runs,
        "running": active,
        "modes": list(MODES),
        "objectives": list(OBJECTIVES),
        "labels": LABELS,
    }


async def benchmark_page(request: Request) -> Response:
    daemon = daemon_of(request)
    data = await blocking(benchmark_data, daemon, service_of(request))
    return render(request, "benchmark.html", data, parts=("benchmark_runs",))


def plan_data(service: BenchmarkService, request: Request) -> dict[str, Any]:
    options = options_of(request)
    plan = plan_json(service, options, request.state.access.control)
    path, name, mode = plan.pop("model"), plan.pop("model_name"), plan.pop("mode")
    asked = {k: v for k, v in request.query_params.items() if k not in ("format", "part")}
    links = {each: "/benchmark/plan?" + urlencode({**asked, "mode": each}) for each in MODES}
    return {
        **plan,
        "mode_links": links,
        "model": {"path": path, "name": name},
        "run_mode": mode,
        "objective": options.objective,
        "clients": options.clients,
        "pick_up": options.pick_up,
        "running": service.active_id,
        "labels": LABELS,
    }


async def plan_page(request: Request) -> Response:
    data = await blocking(plan_data, service_of(request), request)
    return render(request, "benchmark_plan.html", data)


def run_data(
    daemon: Daemon, service: BenchmarkService, run_id: int, reveal: bool
) -> dict[str, Any]:
    run = full_run(service, run_id, reveal)
    saved = daemon.profiles.with_origin(f"benchmark run {run_id}")
    profiles = [{"id": p.id, "name": p.name} for p in saved]
    return {"run": run, "saved_profiles": profiles, "labels": LABELS}


async def run_page(request: Request) -> Response:
    daemon = daemon_of(request)
    data = await blocking(
        run_data, daemon, service_of(request), path_id(request), request.state.access.control
    )
    return render(request, "benchmark_run.html", data, charts=run_charts, parts=("benchmark_live",))


async def compare_page(request: Request) -> Response:
    service = service_of(request)
    raw_a, raw_b = request.query_params.get("a", ""), request.query_params.get("b", "")
    if not raw_a.isdigit() or not raw_b.isdigit():
        raise BadRequest(Text("choose two runs to compare (?a=ID&b=ID)"))
    data = await blocking(
        compare_runs, service, int(raw_a), int(raw_b), request.state.access.control
    )
    data["labels"] = LABELS
    return render(request, "benchmark_compare.html", data, charts=compare_charts)


def _readings(trials: list[dict[str, Any]], name: str, t: Translator) -> list[go.Scatter]:
    """One trace per verdict: the figure `name` of each trial, by trial number."""
    traces = []
    for verdict, colour in VERDICT_COLOURS.items():
        points = [x for x in trials if x["verdict"] == verdict and x[f"{name}_tok_s"] is not None]
        if not points:
            continue
        traces.append(
            go.Scatter(
                x=[p["n"] for p in points],
                y=[p[f"{name}_tok_s"] for p in points],
                mode="markers",
                name=t(verdict),
                marker={"color": colour, "size": 9},
                text=[(p["change"] or {}).get("flag", t("baseline")) for p in points],
                hovertemplate="%{text}: %{y:,.1f} tok/s<extra></extra>",
            )
        )
    return traces


def run_charts(data: dict[str, Any], t: Translator) -> Mapping[str, go.Figure]:
    """Each measured figure of every trial, coloured by verdict."""
    trials = data["run"]["trials"]
    figures = {}
    for name, label in FIGURES:
        traces = _readings(trials, name, t)
        if traces:
            figures[name] = charts.figure(
                traces,
                charts.layout(
                    t,
                    title=t("{figure} tok/s by trial", figure=t(label)),
                    xaxis={"title": t("trial"), "dtick": 1},
                    hovermode="closest",
                ),
            )
    return figures


def compare_charts(data: dict[str, Any], t: Translator) -> Mapping[str, go.Figure]:
    """Baseline and final figures of both runs, side by side."""
    bars = []
    for side in ("a", "b"):
        result = data[side]["result"] or {}
        for stage, label in (("baseline", _("start")), ("final", _("result"))):
            values = result.get(stage) or {}
            shown = [(n, lbl) for n, lbl in FIGURES if values.get(f"{n}_tok_s") is not None]
            bars.append(
                go.Bar(
                    name=t("run {id}, {stage}", id=data[side]["id"], stage=t(label)),
                    x=[t(lbl) for _n, lbl in shown],
                    y=[values[f"{n}_tok_s"] for n, _l in shown],
                )
            )
    return {"figures": charts.figure(bars, charts.layout(t, title=t("tok/s"), barmode="group"))}


ROUTES = [
    Route("/benchmark", benchmark_page),
    Route("/benchmark/plan", plan_page),
    Route("/benchmark/compare", compare_page),
    Route("/benchmark/{id:int}", run_page),
]
NAV = (NavEntry("/benchmark", _("Benchmark"), 50),)
