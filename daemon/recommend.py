"""Recommended settings and the context planner for one model on this machine.

What the rules rest on is gathered here (the latest measurements, the model's config, its latest
finished benchmark, the stats of a real run of it), and answered with profiles.recommend's advice
and profiles.planner's chart data. With a profile, the planner varies the context on top of that
profile's flags and each advised flag is compared with the profile's; without one, on top of the
Recommended flags. `GET /api/recommend` (api_recommend.py), a profile's page, applying
Recommended to a profile and a benchmark run that starts from Recommended all read it here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from ..engine.config.bandwidth import pcie_gbps
from ..engine.config.memory import MemoryPlanError
from ..engine.model.spec import ModelSpec
from ..engine.text import Text, error_text, text_fields
from ..profiles.flags import FlagChange, FlagError
from ..profiles.machine import Gpu, Machine
from ..profiles.planner import RunObservation, plan_context
from ..profiles.recommend import BenchmarkResult, Recommendation, compare, recommend
from .benchmark_store import newest_result
from .errors import BadRequest
from .flags import redact_flags
from .measure import measurement_json
from .schema import Model, Profile
from .service import Daemon
from .store import iso_time
from .telemetry import STATS, read_samples

WINDOW_S = 10.0  # the engine's short throughput window, decode_tok_s_10s


@dataclass(frozen=True, slots=True)
class Inputs:
    """Everything Recommended and the planner need, read from the store in one go."""

    model: Model
    spec: ModelSpec
    machine: Machine
    benchmark: BenchmarkResult | None
    run: RunObservation | None
    profile: Profile | None


def machine_of(daemon: Daemon) -> Machine:
    """This machine from its stored measurements (the live probe fills in what was never stored)."""
    inventory = daemon.hardware.inventory(max_age_s=3600.0)
    rows = [measurement_json(m) for m in daemon.hardware.latest()]
    machine = Machine.from_measurements(
        rows,
        machine_id=inventory.machine_id,
        engine_version=inventory.engine_version,
        physical_cores=inventory.physical_cores,
        ram_total_bytes=inventory.ram_total_bytes,
    )
    if not machine.gpus and inventory.gpus:
        gpus = tuple(
            Gpu(
                g.index,
                g.name,
                g.uuid,
                g.vram_total_bytes,
                g.vram_free_bytes,
                pcie_gbps(g.pcie_gen_max, g.pcie_width_max),
                g.memory_gbps,
            )
            for g in inventory.gpus
            if g.vram_total_bytes
        )
        machine = Machine(
            machine.machine_id,
            machine.engine_version,
            machine.physical_cores,
            machine.ram_total_bytes,
            gpus,
            machine.rates,
        )
    return machine


def loaded_decode_tok_s(samples: list[dict[str, Any]]) -> float | None:
    """A server's decode speed under load, from its telemetry: the median of the 10 s rates
    whose whole window had requests running (the first seconds of a load average in idle
    time); the best rate seen when no window was fully loaded."""
    loaded = [
        (s["t"], s["g"]["decode_tok_s_10s"])
        for s in samples
        if (s.get("g") or {}).get("running") and (s.get("g") or {}).get("decode_tok_s_10s")
    ]
    if not loaded:
        return None
    times = [s["t"] for s in samples]
    running = {s["t"]: bool((s.get("g") or {}).get("running")) for s in samples}
    full = []
    for t, rate in loaded:
        window = [u for u in times if t - WINDOW_S <= u <= t]
        if window and window[0] <= t - WINDOW_S + 2.5 and all(running[u] for u in window):
            full.append(rate)
    return statistics.median(full) if full else max(rate for _t, rate in loaded)


def _run_of(daemon: Daemon, model_path: str, experts_total: int) -> RunObservation | None:
    """The newest real run of the model with a what-if curve: running servers first."""
    rows = daemon.supervisor.servers_with_stats(model_path)
    rows.sort(key=lambda r: r.status != "running")
    for row in rows:
        # a running engine's newest body is in the sampler's memory; the row's is a minute old
        latest = daemon.sampler.latest(row.id)
        stats = latest[1] if latest else row.last_stats or {}
        speed = loaded_decode_tok_s(read_samples(daemon.store, row.id, STATS))
        if speed is None:
            speed = (stats.get("throughput") or {}).get("decode_tok_s_60s") or None
        run = RunObservation.from_stats(stats, decode_tok_s=speed, server_id=row.id)
        if run is not None and run.experts_total == experts_total:
            return run
    return None


def _benchmark_of(daemon: Daemon, model_path: str) -> BenchmarkResult | None:
    row = newest_result(daemon.store, model_path)
    if row is None or not isinstance(row.result, dict):
        return None
    return BenchmarkResult.from_result(
        row.id,
        row.result,
        engine_version=row.engine_version,
        machine_id=row.machine_id,
        finished=iso_time(row.finished),
    )


def gather(daemon: Daemon, model: str | None, profile_id: int | None) -> Inputs:
    """Read the model (by path or id), the profile, the machine, benchmark and run."""
    profile = None
    if profile_id is not None:
        profile = daemon.profiles.get_or_404(profile_id)
        model = model or profile.model
    if not model:
        raise BadRequest(Text("give ?model= (a path or an id from GET /api/models) or ?profile="))
    row, spec = daemon.catalog.resolve(model)
    return Inputs(
        model=row,
        spec=spec,
        machine=machine_of(daemon),
        benchmark=_benchmark_of(daemon, row.path),
        run=_run_of(daemon, row.path, spec.experts_total),
        profile=profile,
    )


def recommendation_of(inputs: Inputs, context_tokens: int | None) -> Recommendation:
    return recommend(
        inputs.machine,
        inputs.spec,
        model=inputs.model.path,
        context_tokens=context_tokens,
        benchmark=inputs.benchmark,
    )


def recommendation_json(
    inputs: Inputs, context_tokens: int | None, reveal: bool = False
) -> dict[str, Any]:
    """The whole answer: advice, VRAM split, staleness, planner, and the profile comparison
    (secret flag values only when `reveal`)."""
    rec = recommendation_of(inputs, context_tokens)
    body = rec.to_json()
    machine = inputs.machine
    body["model_id"] = inputs.model.id
    body["model_name"] = inputs.model.name
    body["hardware"] = {
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "vram_total_bytes": g.vram_total_bytes,
                "vram_free_bytes": g.vram_free_bytes,
            }
            for g in machine.gpus
        ],
        "ram_total_bytes": machine.ram_total_bytes,
        "physical_cores": machine.physical_cores,
        "rates_measured": machine.rates.measured if machine.rates else None,
        "engine_version": machine.engine_version,
    }
    base = inputs.profile.flags if inputs.profile is not None else rec.flags
    try:
        planner = plan_context(inputs.spec, machine, base, run=inputs.run).to_json()
        planner["base_flags"] = base if reveal else redact_flags(base)
    except (FlagError, MemoryPlanError) as err:
        planner = text_fields("error", error_text(err))
    run = inputs.run
    planner["run"] = (
        {
            "server_id": run.server_id,
            "slots": run.slots,
            "hit_rate": round(run.hit_rate, 4),
            "decode_tok_s": run.decode_tok_s,
            "reads_per_token": round(run.reads_per_token, 3),
        }
        if run is not None
        else None
    )
    body["planner"] = planner
    if inputs.profile is not None:
        body["profile"] = {
            "id": inputs.profile.id,
            "name": inputs.profile.name,
            "comparison": compare(
                rec.advice, inputs.profile.flags if reveal else redact_flags(inputs.profile.flags)
            ),
        }
    return body


def recommended_changes(
    daemon: Daemon, model: str | None, profile_id: int | None
) -> tuple[list[FlagChange], str]:
    """Recommended for a model (or a profile's model) as changes, and the origin to record."""
    rec = recommendation_of(gather(daemon, model, profile_id), None)
    origin = f"benchmark run {rec.benchmark_run}" if rec.benchmark_run else "Recommended"
    return rec.changes(), origin


def recommended_flags(daemon: Daemon, model_path: str) -> list[str]:
    """The Recommended flags from the rules (an earlier benchmark's result is for pick-up)."""
    inputs = gather(daemon, model_path, None)
    return recommend(inputs.machine, inputs.spec, model=model_path).flags
