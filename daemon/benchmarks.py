"""Benchmark runs driven by the daemon: one at a time, stored as they go, resumable, cancellable.

A run is a thread of the daemon; its rows (benchmark_runs, trials, benchmark_events) are the truth.
A daemon that stops during a run stops the trial's engine and marks the run interrupted; the next
daemon marks runs still "running" in the file as interrupted and stops any trial engine a killed
daemon left behind. Resuming runs the search again over the stored trials (autotune/journal.py):
only the trials after the last stored one start engines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from ..autotune.flagset import Change, apply_change, effective_value, has_flag
from ..autotune.modes import MODES, mode_named
from ..autotune.noise import NoiseRule, Objective
from ..autotune.plan import MachineFacts, ModelFacts, Plan, make_plan
from ..autotune.search import Search, SearchFailed, SearchSettings
from ..autotune.trial import TRIAL_PORTS, Cancelled, EngineTrialRunner, TrialRequest
from ..autotune.workload import Workload
from ..engine import launch
from ..engine.args import TUNABLE
from ..engine.spec import CheckpointError, ModelSpec
from .benchmark_store import DbJournal, add_event, events_of, trials_of, update_run
from .errors import BadRequest, Conflict, NotFound
from .flags import FlagError, validate_flags
from .schema import BenchmarkRun, Model, Profile
from .service import Daemon
from .supervisor import resolve_device

log = logging.getLogger("moelab.mgr")

HARDWARE_FRESH_S = 7 * 24 * 3600.0
CPU_DEVICE_MEMORY = "2GiB"  # the engine's own budget on a CPU device, made explicit
TUNABLE_FLAGS = {t.flag for t in TUNABLE}


@dataclass(frozen=True, slots=True)
class RunOptions:
    """What a client asks of a run (POST /api/benchmarks), checked."""

    model: str
    mode: str = "standard"
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
            raise BadRequest(f"unknown field(s) {sorted(unknown)}; a run takes {sorted(known)}")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("model must be a checkpoint path or id (GET /api/models lists them)")
        mode = body.get("mode", "standard")
        objective = body.get("objective", "decode")
        clients = body.get("clients", 8 if objective == "aggregate" else 0)
        if not isinstance(clients, int) or isinstance(clients, bool) or not 0 <= clients <= 256:
            raise BadRequest("clients must be a whole number from 2 to 256")
        try:
            mode_named(str(mode))
            Objective(str(objective), clients if objective == "aggregate" else 0)
            rule = NoiseRule(
                min_gain=_share(body, "min_gain", 0.03),
                side_tolerance=_share(body, "side_tolerance", 0.05),
            )
        except ValueError as err:
            raise BadRequest(str(err)) from None
        base = body.get("base_flags")
        if base is not None and (
            not isinstance(base, list) or not all(isinstance(f, str) for f in base)
        ):
            raise BadRequest(
                'base_flags must be a list of strings, e.g. ["--moe-cache-rate", "0.5"]'
            )
        only = body.get("only_flags")
        if only is not None:
            if not isinstance(only, list) or not all(isinstance(f, str) for f in only):
                raise BadRequest("only_flags must be a list of flag names")
            wrong = sorted(set(only) - TUNABLE_FLAGS)
            if wrong:
                raise BadRequest(
                    f"not tunable: {', '.join(wrong)}; the tunable flags are "
                    f"{', '.join(sorted(TUNABLE_FLAGS))}"
                )
        profile_id = body.get("profile_id")
        if profile_id is not None and (
            not isinstance(profile_id, int) or isinstance(profile_id, bool)
        ):
            raise BadRequest("profile_id must be a whole number")
        pick_up = body.get("pick_up", False)
        if not isinstance(pick_up, bool):
            raise BadRequest("pick_up must be true or false")
        if sum(x is not None and x is not False for x in (base, profile_id, pick_up or None)) > 1:
            raise BadRequest("give at most one of base_flags, profile_id and pick_up")
        return cls(
            model=model,
            mode=str(mode),
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
        raise ValueError(f"{name} must be a share from 0 to 0.5 (e.g. 0.05 for 5%)")
    return float(value)


@dataclass(slots=True)
class Setup:
    """A run's starting point, resolved: model, flags, where they came from, and its plan."""

    model: Model
    spec: ModelSpec
    base_flags: list[str]
    base_origin: str
    plan: Plan
    machine: MachineFacts
    pick_up_from: int | None = None
    tried_in: dict[str, int] = field(default_factory=dict)
    hardware: dict[str, Any] | None = None


@dataclass(slots=True)
class ActiveRun:
    """The run this daemon is driving: its thread, cancel flags and the trial in progress."""

    run_id: int
    cancel: threading.Event = field(default_factory=threading.Event)
    shutdown: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    current: dict[str, Any] | None = None


class BenchmarkService:
    """Starts, drives, cancels and resumes benchmark runs of one daemon; one run at a time."""

    def __init__(self, daemon: Daemon, ports: range = TRIAL_PORTS) -> None:
        self.daemon = daemon
        self.store = daemon.store
        self.ports = ports
        self.logs_dir = daemon.data_dir / "logs"
        # how trials run: fresh engine processes (tests put a fake engine here)
        self.make_runner: Callable[..., EngineTrialRunner] = EngineTrialRunner
        self._lock = threading.Lock()
        self._active: ActiveRun | None = None

    # ---- life of the service ----------------------------------------------------------------

    def open(self) -> None:
        """Mark runs a previous daemon left "running" as interrupted; stop their trial engines."""
        with self.store.session() as session:
            rows = list(
                session.scalars(select(BenchmarkRun).where(BenchmarkRun.status == "running"))
            )
        for row in rows:
            stopped = self._stop_orphan(row.id)
            update_run(self.store, row.id, status="interrupted", eta_s=None)
            add_event(
                self.store,
                row.id,
                "status",
                "interrupted: mgr stopped during the run; resume it to go on"
                + (f" (its trial engine, pid {stopped}, was stopped)" if stopped else ""),
            )

    def close(self) -> None:
        """Stop the active run's trial (the run becomes interrupted, to be resumed later)."""
        with self._lock:
            active = self._active
        if active is None:
            return
        active.shutdown.set()
        active.cancel.set()
        if active.thread is not None:
            active.thread.join(timeout=60)

    def _stop_orphan(self, run_id: int) -> int | None:
        """Stop the engine of a trial that was running when its daemon died, if it still runs."""
        done = {t.n for t in trials_of(self.store, run_id)}
        for event in reversed(events_of(self.store, run_id)):
            if event.kind != "engine" or event.data.get("n") in done:
                continue
            pid, started = event.data.get("pid"), event.data.get("process_started")
            if not pid or not launch.pid_alive(pid):
                return None
            now_started = launch.process_start_time(pid)
            if started is None or now_started is None or abs(now_started - started) > 1.0:
                return None  # the pid was reused by another program
            launch.stop_engine(
                launch.EngineProcess(pid, "127.0.0.1", 0, event.data.get("log", ""), started)
            )
            return pid
        return None

    # ---- what a run starts from -------------------------------------------------------------

    def _model(self, model: str) -> tuple[Model, ModelSpec]:
        catalog = self.daemon.catalog
        row = catalog.get(int(model)) if model.isdigit() else catalog.by_path(model)
        if row is None:
            raise NotFound(
                f"unknown model {model!r}; GET /api/models lists them", code="model_not_found"
            )
        try:
            spec = ModelSpec.from_config(row.config or {})
        except CheckpointError as err:
            raise BadRequest(
                f"{row.name} cannot be served: {err}", code="unsupported_model"
            ) from None
        return row, spec

    def _machine(self) -> MachineFacts:
        inventory = self.daemon.hardware.inventory(max_age_s=3600.0)
        return MachineFacts(physical_cores=inventory.physical_cores, gpus=len(inventory.gpus))

    def setup(self, options: RunOptions) -> Setup:
        """Resolve where a run starts and plan it (for a preview, or to start it)."""
        model, spec = self._model(options.model)
        machine = self._machine()
        pick_up_from, tried_in, hardware = None, {}, None
        if options.pick_up:
            last = self._last_done(model.path, options.objective, options.clients)
            if last is None:
                raise BadRequest(
                    f"no finished {options.objective} run of {model.name} to pick up from; "
                    "run a benchmark first",
                    code="nothing_to_pick_up",
                )
            result = last.result or {}
            base, origin = list(result.get("flags", [])), f"the result of run {last.id}"
            pick_up_from, hardware = last.id, (last.options or {}).get("hardware")
            tried_in = dict(result.get("tried_in") or {})
            for key in result.get("tried", []):
                tried_in.setdefault(key, last.id)
        elif options.profile_id is not None:
            with self.store.session() as session:
                profile = session.get(Profile, options.profile_id)
            if profile is None:
                raise NotFound(f"no profile {options.profile_id}")
            base, origin = list(profile.flags), f"profile {profile.name!r}"
        elif options.base_flags is not None:
            base, origin = list(options.base_flags), "the flags given"
        else:
            base, origin = self._recommended(model.path), "Recommended"
        base = self._for_this_machine(base, machine)
        try:
            validate_flags(model.path, base)
        except FlagError as err:
            raise BadRequest(f"the starting flags: {err}", code="invalid_flags") from None
        plan = make_plan(
            base,
            ModelFacts(model.path, spec.num_moe_layers, spec.num_experts, model.max_context),
            machine,
            MODES[options.mode],
            Objective(options.objective, options.clients),
            only_flags=frozenset(options.only_flags) if options.only_flags else None,
            tried=tried_in,
        )
        return Setup(model, spec, base, origin, plan, machine, pick_up_from, tried_in, hardware)

    def _recommended(self, model_path: str) -> list[str]:
        """The Recommended flags from the rules (an earlier benchmark's result is for pick-up)."""
        from ..profiles.recommend import recommend
        from .api_recommend import gather

        inputs = gather(self.daemon, model_path, None)
        return recommend(inputs.machine, inputs.spec, model=model_path).flags

    @staticmethod
    def _for_this_machine(flags: list[str], machine: MachineFacts) -> list[str]:
        """On a machine without a GPU the trials say `--device cpu --device-memory` outright."""
        if machine.gpus:
            return flags
        if effective_value(flags, "--device") == "auto":
            flags = apply_change(flags, Change("--device", "cpu"))
        if effective_value(flags, "--device") == "cpu" and not has_flag(flags, "--device-memory"):
            flags = apply_change(flags, Change("--device-memory", CPU_DEVICE_MEMORY))
        return flags

    def _last_done(self, model_path: str, objective: str, clients: int) -> BenchmarkRun | None:
        with self.store.session() as session:
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

    # ---- start, resume, cancel --------------------------------------------------------------

    @property
    def active_id(self) -> int | None:
        with self._lock:
            return self._active.run_id if self._active else None

    def live(self, run_id: int) -> dict[str, Any] | None:
        with self._lock:
            active = self._active
        if active is None or active.run_id != run_id:
            return None
        return {"current": dict(active.current) if active.current else None}

    def start(self, options: RunOptions) -> int:
        """Create a run and start driving it; returns its id."""
        setup = self.setup(options)
        if options.pick_up and not setup.plan.candidates:
            raise Conflict(
                f"nothing new to try: every candidate was tried in run {setup.pick_up_from} or "
                "before (a newer engine or the thorough mode adds candidates)",
                code="nothing_new",
            )
        self._check_device(setup.base_flags)
        inventory = self.daemon.hardware.inventory(max_age_s=3600.0)
        now = time.time()
        with self._lock:
            if self._active is not None:
                raise Conflict(
                    f"run {self._active.run_id} is running; one run at a time", code="busy"
                )
            with self.store.session() as session:
                row = BenchmarkRun(
                    model=setup.model.path,
                    mode=options.mode,
                    objective=options.objective,
                    status="running",
                    phase="starting",
                    base_flags=setup.base_flags,
                    options={
                        "clients": options.clients,
                        "base_origin": setup.base_origin,
                        "pick_up_from": setup.pick_up_from,
                        "tried_in": setup.tried_in,
                        "only_flags": list(options.only_flags) if options.only_flags else None,
                        "min_gain": options.rule.min_gain,
                        "side_tolerance": options.rule.side_tolerance,
                        "model_max_context": setup.model.max_context,
                        "plan": setup.plan.to_json(),
                        "hardware": setup.hardware,
                    },
                    engine_version=inventory.engine_version,
                    machine_id=inventory.machine_id,
                    created=now,
                    updated=now,
                )
                session.add(row)
                session.flush()
                run_id = row.id
            self._launch(run_id)
        add_event(
            self.store,
            run_id,
            "status",
            f"started: {options.mode} mode, {Objective(options.objective, options.clients).label}, "
            f"from {setup.base_origin}",
        )
        self._warn_if_shared(run_id)
        return run_id

    def _warn_if_shared(self, run_id: int) -> None:
        engines = self.daemon.supervisor.handles()
        if engines:
            add_event(
                self.store,
                run_id,
                "warning",
                f"{len(engines)} engine(s) of this mgr are running: they share this machine's CPU "
                "and memory with the trials and move their figures",
            )

    def resume(self, run_id: int) -> None:
        """Go on with an interrupted (or cancelled, or failed) run from its last stored trial."""
        with self._lock:
            if self._active is not None:
                raise Conflict(
                    f"run {self._active.run_id} is running; one run at a time", code="busy"
                )
            row = self.get(run_id)
            if row.status in ("running", "done"):
                raise Conflict(
                    f"run {run_id} is {row.status}; only a stopped run resumes",
                    code="not_resumable",
                )
            self._check_device(row.base_flags)
            update_run(self.store, run_id, status="running", error=None, finished=None)
            self._launch(run_id)
        done = len(trials_of(self.store, run_id))
        add_event(self.store, run_id, "status", f"resumed after {done} trials")
        self._warn_if_shared(run_id)

    def cancel(self, run_id: int) -> None:
        """Stop a running run now: its trial's engine is stopped and the run ends cancelled."""
        with self._lock:
            active = self._active
        if active is None or active.run_id != run_id:
            row = self.get(run_id)
            raise Conflict(f"run {run_id} is {row.status}, not running", code="not_running")
        active.cancel.set()
        if active.thread is not None:
            active.thread.join(timeout=60)

    def _check_device(self, flags: list[str]) -> None:
        device = resolve_device(flags, len(self.daemon.hardware.inventory(max_age_s=3600.0).gpus))
        if device == "cpu":
            return
        for handle in self.daemon.supervisor.handles():
            if handle.device == device and not handle.stopping:
                raise Conflict(
                    f"{device} is used by server {handle.server_id}; stop it before a benchmark "
                    "(trials need the GPU to themselves)",
                    code="gpu_taken",
                )

    def _launch(self, run_id: int) -> None:
        active = ActiveRun(run_id)
        active.thread = threading.Thread(
            target=self._drive, args=(active,), name=f"benchmark-{run_id}", daemon=True
        )
        self._active = active
        active.thread.start()

    # ---- driving a run ----------------------------------------------------------------------

    def _drive(self, active: ActiveRun) -> None:
        run_id = active.run_id
        try:
            result = self._search(active)
            update_run(
                self.store,
                run_id,
                status="done",
                phase="done",
                eta_s=0.0,
                result=result,
                finished=time.time(),
            )
            gain = result.get("gain")
            add_event(
                self.store,
                run_id,
                "status",
                "done" + (f": {gain:+.1%} over the starting flags" if gain is not None else ""),
            )
        except Cancelled:
            status = "interrupted" if active.shutdown.is_set() else "cancelled"
            update_run(self.store, run_id, status=status, eta_s=None, finished=time.time())
            add_event(self.store, run_id, "status", f"{status}: the trial's engine was stopped")
        except SearchFailed as err:
            self._failed(run_id, str(err))
        except Exception as err:  # a bug: the run fails with the type, the log keeps the trace
            log.exception("benchmark run %s failed", run_id)
            self._failed(run_id, f"{type(err).__name__}: {err}")
        finally:
            with self._lock:
                if self._active is active:
                    self._active = None

    def _failed(self, run_id: int, message: str) -> None:
        update_run(
            self.store, run_id, status="failed", error=message, eta_s=None, finished=time.time()
        )
        add_event(self.store, run_id, "status", f"failed: {message}")

    def _search(self, active: ActiveRun) -> dict[str, Any]:
        row = self.get(active.run_id)
        options = dict(row.options or {})
        if options.get("hardware") is None:
            options["hardware"] = self._hardware(active, row)
            update_run(self.store, row.id, options=options)
        elif options.get("pick_up_from"):
            add_event(
                self.store,
                row.id,
                "phase",
                f"hardware: the figures of run {options['pick_up_from']} are used",
            )
        mode = mode_named(row.mode)
        objective = Objective(row.objective, options.get("clients", 0))
        runner = self.make_runner(
            row.model,
            Workload(mode.workload_for(objective.clients)),
            self.logs_dir,
            active.cancel,
            ports=self.ports,
            on_step=lambda step: self._step(active, step),
        )

        def run_trial(request: TrialRequest, n: int) -> Any:
            def started(engine: launch.EngineProcess) -> None:
                if active.current is not None:
                    active.current["engine_pid"] = engine.pid
                add_event(
                    self.store,
                    row.id,
                    "engine",
                    f"trial {n}: engine pid {engine.pid} on port {engine.port}",
                    {
                        "n": n,
                        "pid": engine.pid,
                        "process_started": launch.process_start_time(engine.pid),
                        "port": engine.port,
                        "log": engine.log_path,
                    },
                )

            return runner.run(request, f"bench-{row.id}-trial-{n}", on_started=started)

        journal = DbJournal(
            self.store,
            row.id,
            run_trial,
            active.cancel.is_set,
            on_trial=lambda n, request: self._trial_starting(active, n, request),
            on_progress=lambda phase, eta: update_run(self.store, row.id, phase=phase, eta_s=eta),
        )
        settings = SearchSettings(
            mode,
            objective,
            NoiseRule(min_gain=options["min_gain"], side_tolerance=options["side_tolerance"]),
            model_max_context=options.get("model_max_context"),
            pick_up=bool(options.get("pick_up_from")),
            base_origin=options.get("base_origin", "the starting flags"),
        )
        result = Search(Plan.from_json(options["plan"]), row.base_flags, settings, journal).run()
        tried_in = dict(options.get("tried_in") or {})
        for key in result["tried"]:
            tried_in.setdefault(key, row.id)
        result.update(
            tried_in=tried_in,
            hardware=options["hardware"],
            pick_up_from=options.get("pick_up_from"),
            base_origin=options.get("base_origin"),
            mode=row.mode,
        )
        return result

    def _trial_starting(self, active: ActiveRun, n: int, request: TrialRequest) -> None:
        active.current = {
            "n": n,
            "role": request.role,
            "change": request.change.to_json() if request.change else None,
            "label": request.change.label if request.change else "the flags as they are",
            "started": time.time(),
            "step": "starting the engine",
            "engine_pid": None,
        }

    @staticmethod
    def _step(active: ActiveRun, step: str) -> None:
        if active.current is not None:
            active.current["step"] = step

    def _hardware(self, active: ActiveRun, row: BenchmarkRun) -> dict[str, Any]:
        """Phase (a): `moelab bench bw` at this model's expert size, unless a fresh one exists."""
        _model, spec = self._model(row.model)
        fresh = self._fresh_rates(spec)
        if fresh is not None:
            add_event(
                self.store,
                row.id,
                "phase",
                f"hardware: measured {(time.time() - fresh) / 3600:.1f} h ago at this expert size; "
                "not measured again",
            )
        else:
            update_run(self.store, row.id, phase="hardware")
            add_event(self.store, row.id, "phase", "hardware: moelab bench bw at this expert size")
            job, _new = self.daemon.hardware.start_measure(
                [Path(row.model)], ["--model-path", row.model]
            )
            while not self.daemon.jobs.wait(job, 0.5):
                if active.cancel.is_set():
                    raise Cancelled()
            if job.status != "done":
                add_event(
                    self.store,
                    row.id,
                    "warning",
                    f"hardware: the measurement failed ({job.error}); the engines measure at start",
                )
        inventory = self.daemon.hardware.inventory(max_age_s=3600.0)
        rates = {
            f"{m.kind} threads={m.params.get('threads')}": m.value
            for m in self.daemon.hardware.latest()
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

    def _fresh_rates(self, spec: ModelSpec) -> float | None:
        """When the CPU expert rate was measured at this expert size with this moelab, if lately."""
        version = self.daemon.hardware.inventory(max_age_s=3600.0).engine_version
        times = [
            m.created
            for m in self.daemon.hardware.latest()
            if m.source == "moelab bench bw"
            and m.kind == "cpu_experts"
            and m.params.get("hidden") == spec.hidden_size
            and m.params.get("intermediate") == spec.moe_intermediate_size
            and m.engine_version == version
            and time.time() - m.created < HARDWARE_FRESH_S
        ]
        return max(times) if times else None

    # ---- reading and keeping results --------------------------------------------------------

    def get(self, run_id: int) -> BenchmarkRun:
        with self.store.session() as session:
            row = session.get(BenchmarkRun, run_id)
            if row is None:
                raise NotFound(f"no benchmark run {run_id}")
            return row

    def runs(self, model: str | None = None) -> list[BenchmarkRun]:
        with self.store.session() as session:
            query = select(BenchmarkRun).order_by(BenchmarkRun.id.desc())
            if model:
                query = query.where(BenchmarkRun.model == model)
            return list(session.scalars(query))

    def delete(self, run_id: int) -> None:
        """Forget a run that is not running, with its trials, events and trial logs."""
        if self.active_id == run_id:
            raise Conflict(f"run {run_id} is running; cancel it first", code="running")
        with self.store.session() as session:
            row = session.get(BenchmarkRun, run_id)
            if row is None:
                raise NotFound(f"no benchmark run {run_id}")
            session.delete(row)
        for path in self.logs_dir.glob(f"bench-{run_id}-trial-*.log"):
            path.unlink(missing_ok=True)

    def save_profile(self, run_id: int, name: str | None) -> Profile:
        """The run's result as a launch profile (origin "benchmark run N")."""
        row = self.get(run_id)
        if row.status != "done" or not row.result:
            raise Conflict(
                f"run {run_id} is {row.status}: only a finished run has a result", code="no_result"
            )
        result = row.result
        name = (name or f"{Path(row.model).name} benchmark {run_id}").strip()
        if not name or len(name) > 200:
            raise BadRequest("name must be a non-empty string of at most 200 characters")
        gain = result.get("gain")
        lines = [
            f"Benchmark run {run_id} ({row.mode} mode, {row.objective}): "
            + (f"{gain:+.1%} over {result.get('base_origin')}." if gain is not None else "")
        ]
        lines += [f"{c['label']}: {c['reason']}" for c in result.get("changes", [])]
        now = time.time()
        try:
            with self.store.session() as session:
                profile = Profile(
                    name=name,
                    model=row.model,
                    flags=list(result["flags"]),
                    notes="\n".join(lines),
                    origin=f"benchmark run {run_id}",
                    created=now,
                    updated=now,
                )
                session.add(profile)
                session.flush()
                return profile
        except IntegrityError:
            raise Conflict(f"a profile named {name!r} exists already", code="name_taken") from None
