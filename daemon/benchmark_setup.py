"""Where a benchmark run starts: the request checked, the starting flags, the plan, the hardware.

A run starts from Recommended (the profile rules), a profile, flags given, or the last result of
the model (pick up). Phase (a), the hardware, is here too: it reads and writes the daemon's
measurements, not the run's trials.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from ..autotune.flagset import Change, apply_change, effective_value, has_flag
from ..autotune.modes import MODES, mode_named
from ..autotune.noise import NoiseRule, Objective
from ..autotune.plan import MachineFacts, ModelFacts, Plan, make_plan
from ..autotune.trial_record import Cancelled
from ..engine.config.args import CPU_DEFAULT_BUDGET_BYTES, TUNABLE
from ..engine.model.spec import ModelSpec
from ..engine.text import Text, error_text
from .benchmark_store import add_event, update_run
from .errors import BadRequest
from .flags import FlagError, validate_flags
from .http import body_id
from .recommend import recommended_flags
from .schema import BenchmarkRun, Model
from .service import Daemon

HARDWARE_FRESH_S = 7 * 24 * 3600.0
# the engine's own budget on a CPU device, made explicit
CPU_DEVICE_MEMORY = f"{CPU_DEFAULT_BUDGET_BYTES // 1024**3}GiB"
TUNABLE_FLAGS = {t.flag for t in TUNABLE}


@dataclass(frozen=True, slots=True)
class RunOptions:
    """What a client asks of a run (POST /api/benchmarks), checked."""

    model: str
    mode: str | None = None  # None: quick on the demo model or without a GPU, else standard
    objective: str = "decode"
    clients: int = 0
    base_flags: tuple[str, ...] | None = None
    profile_id: int | None = None
    pick_up: bool = False
    only_flags: tuple[str, ...] | None = None
    rule: NoiseRule = field(default_factory=NoiseRule)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> RunOptions:
        known = {"model", "mode", "objective", "clients", "base_flags", "profile_id", "pick_up",
                 "only_flags", "min_gain", "side_tolerance"}  # fmt: skip
        unknown = set(body) - known
        if unknown:
            raise BadRequest(
                Text(
                    "unknown field(s) {unknown}; a run takes {known}",
                    unknown=str(sorted(unknown)),
                    known=str(sorted(known)),
                )
            )
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest(
                Text("model must be a checkpoint path or id (GET /api/models lists them)")
            )
        mode = body.get("mode") or None
        objective = body.get("objective", "decode")
        clients = body.get("clients", 8 if objective == "aggregate" else 0)
        if not isinstance(clients, int) or isinstance(clients, bool) or not 0 <= clients <= 256:
            raise BadRequest(Text("clients must be a whole number from 2 to 256"))
        try:
            if mode is not None:
                mode_named(str(mode))
            Objective(str(objective), clients if objective == "aggregate" else 0)
            rule = NoiseRule(
                min_gain=_share(body, "min_gain", 0.03),
                side_tolerance=_share(body, "side_tolerance", 0.05),
            )
        except ValueError as err:
            raise BadRequest(error_text(err)) from None
        base = body.get("base_flags")
        if base is not None and (
            not isinstance(base, list) or not all(isinstance(f, str) for f in base)
        ):
            raise BadRequest(
                Text('base_flags must be a list of strings, e.g. ["--moe-cache-rate", "0.5"]')
            )
        only = body.get("only_flags")
        if only is not None:
            if not isinstance(only, list) or not all(isinstance(f, str) for f in only):
                raise BadRequest(Text("only_flags must be a list of flag names"))
            wrong = sorted(set(only) - TUNABLE_FLAGS)
            if wrong:
                raise BadRequest(
                    Text(
                        "not tunable: {wrong}; the tunable flags are {tunable}",
                        wrong=", ".join(wrong),
                        tunable=", ".join(sorted(TUNABLE_FLAGS)),
                    )
                )
        profile_id = body_id(body, "profile_id")
        pick_up = body.get("pick_up", False)
        if not isinstance(pick_up, bool):
            raise BadRequest(Text("pick_up must be true or false"))
        if sum(x is not None and x is not False for x in (base, profile_id, pick_up or None)) > 1:
            raise BadRequest(Text("give at most one of base_flags, profile_id and pick_up"))
        return cls(
            model=model,
            mode=None if mode is None else str(mode),
            objective=str(objective),
            clients=clients if objective == "aggregate" else 0,
            base_flags=tuple(base) if base is not None else None,
            profile_id=profile_id,
            pick_up=pick_up,
            only_flags=tuple(only) if only is not None else None,
            rule=rule,
        )


def _share(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 0.5:
        raise ValueError(Text("{name} must be a share from 0 to 0.5 (e.g. 0.05 for 5%)", name=name))
    return float(value)


@dataclass(slots=True)
class Setup:
    """A run's starting point, resolved: model, flags, where they came from, its mode and the
    plan of every mode (the chosen one runs; the others are for the plan page's durations)."""

    model: Model
    spec: ModelSpec
    base_flags: list[str]
    base_origin: Text
    mode: str
    plans: dict[str, Plan]
    machine: MachineFacts
    pick_up_from: int | None = None
    tried_in: dict[str, int] = field(default_factory=dict)
    hardware: dict[str, Any] | None = None

    @property
    def plan(self) -> Plan:
        return self.plans[self.mode]

    @property
    def on_cpu(self) -> bool:
        return on_cpu(self.base_flags, self.machine)


def on_cpu(flags: list[str], machine: MachineFacts) -> bool:
    """Whether trials of `flags` run on the CPU: no GPU here, or the flags say --device cpu."""
    return machine.gpus == 0 or effective_value(flags, "--device") == "cpu"


def default_mode(is_demo: bool, on_cpu: bool) -> str:
    """The mode a run takes when none is asked for: quick on the demo model or on the CPU (a
    standard run's 60 s trials take an hour or more there), else standard."""
    return "quick" if is_demo or on_cpu else "standard"


def machine_facts(daemon: Daemon) -> MachineFacts:
    """This machine's cores and GPUs, as the plan reads them."""
    inventory = daemon.hardware.inventory(max_age_s=3600.0)
    return MachineFacts(physical_cores=inventory.physical_cores, gpus=len(inventory.gpus))


def resolve_setup(daemon: Daemon, options: RunOptions) -> Setup:
    """Resolve where a run starts and plan it (for a preview, or to start it)."""
    model, spec = daemon.catalog.resolve(options.model)
    machine = machine_facts(daemon)
    pick_up_from, tried_in, hardware = None, {}, None
    if options.pick_up:
        last = last_done(daemon, model.path, options.objective, options.clients)
        if last is None:
            raise BadRequest(
                Text(
                    "no finished {objective} run of {name} to pick up from; run a benchmark first",
                    objective=options.objective,
                    name=model.name,
                ),
                code="nothing_to_pick_up",
            )
        result = last.result or {}
        base, origin = list(result.get("flags", [])), Text("the result of run {run}", run=last.id)
        pick_up_from, hardware = last.id, (last.options or {}).get("hardware")
        tried_in = dict(result.get("tried_in") or {})
        for key in result.get("tried", []):
            tried_in.setdefault(key, last.id)
    elif options.profile_id is not None:
        profile = daemon.profiles.get_or_404(options.profile_id)
        base, origin = list(profile.flags), Text("profile {name!r}", name=profile.name)
    elif options.base_flags is not None:
        base, origin = list(options.base_flags), Text("the flags given")
    else:
        base, origin = recommended_flags(daemon, model.path), Text("Recommended")
    base = for_this_machine(base, machine)
    try:
        validate_flags(model.path, base)
    except FlagError as err:
        raise BadRequest(
            Text("the starting flags: {error}", error=error_text(err)), code="invalid_flags"
        ) from None
    plans = {
        name: make_plan(
            base,
            ModelFacts(model.path, spec.num_moe_layers, spec.num_experts, model.max_context),
            machine,
            each,
            Objective(options.objective, options.clients),
            only_flags=frozenset(options.only_flags) if options.only_flags else None,
            tried=tried_in,
        )
        for name, each in MODES.items()
    }
    mode = options.mode or default_mode(model.is_demo, on_cpu(base, machine))
    return Setup(model, spec, base, origin, mode, plans, machine, pick_up_from, tried_in, hardware)


def for_this_machine(flags: list[str], machine: MachineFacts) -> list[str]:
    """On a machine without a GPU the trials say `--device cpu --device-memory` outright."""
    if machine.gpus:
        return flags
    if effective_value(flags, "--device") == "auto":
        flags = apply_change(flags, Change("--device", "cpu"))
    if effective_value(flags, "--device") == "cpu" and not has_flag(flags, "--device-memory"):
        flags = apply_change(flags, Change("--device-memory", CPU_DEVICE_MEMORY))
    return flags


def last_done(daemon: Daemon, model_path: str, objective: str, clients: int) -> BenchmarkRun | None:
    """The newest finished run of a model with this objective (and clients)."""
    with daemon.store.session() as session:
        rows = session.scalars(
            select(BenchmarkRun)
            .where(
                BenchmarkRun.model == model_path,
                BenchmarkRun.status == "done",
                BenchmarkRun.objective == objective,
            )
            .order_by(BenchmarkRun.finished.desc(), BenchmarkRun.id.desc())
        )
        return next((r for r in rows if (r.options or {}).get("clients", 0) == clients), None)


def hardware_phase(
    daemon: Daemon, row: BenchmarkRun, cancelled: Callable[[], bool]
) -> dict[str, Any]:
    """Phase (a): `moelab bench bw` at this model's expert size, unless a fresh one exists."""
    _model, spec = daemon.catalog.resolve(row.model)
    fresh = fresh_rates(daemon, spec)
    if fresh is not None:
        add_event(
            daemon.store,
            row.id,
            "phase",
            Text(
                "hardware: measured {hours:.1f} h ago at this expert size; not measured again",
                hours=(time.time() - fresh) / 3600,
            ),
        )
    else:
        update_run(daemon.store, row.id, phase="hardware")
        add_event(
            daemon.store, row.id, "phase", Text("hardware: moelab bench bw at this expert size")
        )
        job, _new = daemon.hardware.start_measure([Path(row.model)], ["--model-path", row.model])
        while not daemon.jobs.wait(job, 0.5):
            if cancelled():
                raise Cancelled()
        if job.status != "done":
            add_event(
                daemon.store,
                row.id,
                "warning",
                Text(
                    "hardware: the measurement failed ({error}); the engines measure at start",
                    error=job.error,
                ),
            )
    inventory = daemon.hardware.inventory(max_age_s=3600.0)
    rates = {
        f"{m.kind} threads={m.params.get('threads')}": m.value
        for m in daemon.hardware.latest()
        if m.source == "moelab bench bw" and m.kind in ("cpu_experts", "h2d_pinned")
        and m.params.get("experts", 1) == 1
    }  # fmt: skip
    return {
        "measured": time.time() if fresh is None else fresh,
        "gpu_uuids": [g.uuid for g in inventory.gpus],
        "gpus": [g.name for g in inventory.gpus],
        "physical_cores": inventory.physical_cores,
        "ram_total_bytes": inventory.ram_total_bytes,
        "rates_gbps": rates,
    }


def fresh_rates(daemon: Daemon, spec: ModelSpec) -> float | None:
    """When the CPU expert rate was measured at this expert size with this moelab, if lately."""
    version = daemon.hardware.inventory(max_age_s=3600.0).engine_version
    times = [
        m.created
        for m in daemon.hardware.latest()
        if m.source == "moelab bench bw"
        and m.kind == "cpu_experts"
        and m.params.get("hidden") == spec.hidden_size
        and m.params.get("intermediate") == spec.moe_intermediate_size
        and m.engine_version == version
        and time.time() - m.created < HARDWARE_FRESH_S
    ]
    return max(times) if times else None
