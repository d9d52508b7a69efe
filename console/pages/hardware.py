"""Hardware: this machine as probed now, the latest of every measurement with its history as
charts, and "measure again" with its progress."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...daemon.http import blocking, daemon_of
from ...daemon.measure import inventory_json, measurement_json
from ...daemon.service import Daemon
from .. import charts
from ..i18n import GIB, Translator, _
from ..web import NavEntry, render

HISTORY_LIMIT = 200
# what each kind measures, in words; kinds not listed show their name only
KIND_LABELS = {
    "cpu.physical_cores": _("CPU physical cores"),
    "cpu.logical_cores": _("CPU logical cores"),
    "ram.total": _("RAM total"),
    "ram.available": _("RAM available"),
    "gpu.vram_total": _("GPU memory total"),
    "gpu.vram_free": _("GPU memory free"),
    "gpu.pcie_gen_max": _("PCIe generation (max)"),
    "gpu.pcie_width_max": _("PCIe lanes (max)"),
    "gpu.pcie_gen_current": _("PCIe generation (now)"),
    "gpu.pcie_width_current": _("PCIe lanes (now)"),
    "gpu.pcie_gen_loaded": _("PCIe generation (under load)"),
    "gpu.pcie_width_loaded": _("PCIe lanes (under load)"),
    "gpu.memory_gbps": _("GPU memory peak rate"),
    "disk.read": _("disk read of a model file"),
    "host_read": _("host memory read"),
    "cpu_experts": _("CPU expert kernel"),
    "h2d_pinned": _("host to GPU copy (pinned)"),
    "h2d_pageable": _("host to GPU copy (pageable)"),
    "device_copy": _("copy within the GPU"),
    "device_experts": _("expert kernel on the GPU"),
    "h2d_pinned_concurrent": _("host to GPU copy while the CPU runs experts"),
    "cpu_experts_concurrent": _("CPU expert kernel while copies run"),
}
# units of the probe's readings, where readings come from, and a job's statuses, marked for the
# catalog (shown with t())
WORDS = (
    _("cores"), _("lanes"), _("generation"), _("probe"), _("disk read"), _("under load"),
    _("running"), _("done"), _("failed"),
)  # fmt: skip
# parameters that describe the workload's geometry, the same for every reading of a run
QUIET_PARAMS = frozenset(
    {"hidden", "intermediate", "dtype", "expert_bytes", "file", "mountpoint", "fstype", "bytes",
     "model", "pci_bus_id"}
)  # fmt: skip


def params_label(params: dict[str, Any]) -> str:
    """The parameters that tell readings of one kind apart (threads=2 experts=4, gpu_index=0)."""
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()) if k not in QUIET_PARAMS)


def hardware_data(daemon: Daemon) -> dict[str, Any]:
    latest = [measurement_json(m) for m in daemon.hardware.latest()]
    history: dict[str, list[dict[str, Any]]] = {}
    for kind in sorted({m["kind"] for m in latest}):
        history[kind] = [
            {"value": m.value, "params": m.params, "created": measurement_json(m)["created"]}
            for m in daemon.hardware.history(kind, HISTORY_LIMIT)
        ]
    job = daemon.jobs.latest("hardware")
    models = daemon.catalog.list()
    inventory = inventory_json(daemon.hardware.inventory())
    # each GPU's own measured host-to-GPU copy, beside its link
    copies = {m["gpu_uuid"]: m["value"] for m in latest if m["kind"] == "h2d_pinned"}
    for gpu in inventory["gpus"]:
        gpu["h2d_gbps"] = copies.get(gpu["uuid"])
    return {
        "inventory": inventory,
        "latest": [
            {**m, "what": KIND_LABELS.get(m["kind"]), "label": params_label(m["params"])}
            for m in latest
        ],
        "history": history,
        "job": job.to_json() if job else None,
        "models": [{"path": m.path, "name": m.name} for m in models],
    }


async def hardware_page(request: Request) -> Response:
    data = await blocking(hardware_data, daemon_of(request))
    return render(request, "hardware.html", data, charts=hardware_charts, parts=("measure_job",))


def hardware_charts(data: dict[str, Any], t: Translator) -> Mapping[str, go.Figure]:
    """One chart per unit: every kind (and parameter set) in that unit as a line over time."""
    units = {m["kind"]: m["unit"] for m in data["latest"]}
    by_unit: dict[str, list[go.Scatter]] = {}
    for kind, readings in data["history"].items():
        lines: dict[str, list[dict[str, Any]]] = {}
        for reading in readings:
            lines.setdefault(params_label(reading["params"]), []).append(reading)
        scale = GIB if units[kind] == "bytes" else 1.0
        for label, points in lines.items():
            points = sorted(points, key=lambda p: p["created"])
            name = t(KIND_LABELS[kind]) if kind in KIND_LABELS else kind
            by_unit.setdefault(units[kind], []).append(
                go.Scatter(
                    x=[charts.local_iso(p["created"]) for p in points],
                    y=[p["value"] / scale for p in points],
                    name=f"{name} {label}".strip(),
                    mode="lines+markers",
                )
            )
    figures = {}
    for unit, traces in sorted(by_unit.items()):
        shown = "GiB" if unit == "bytes" else unit
        figures[f"unit-{unit.replace('/', '_per_')}"] = charts.figure(
            traces,
            charts.layout(
                t,
                title=t(shown),
                xaxis=charts.time_axis(t),
                yaxis={"rangemode": "tozero"},
                hovermode="closest",
                height_px=300 + 18 * len(traces),
                legend={"font": {"size": 11}},
            ),
        )
    return figures


ROUTES = [Route("/hardware", hardware_page)]
NAV = (NavEntry("/hardware", _("Hardware"), 60),)
