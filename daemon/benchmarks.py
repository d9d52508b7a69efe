"""Benchmark runs driven by the daemon: one at a time, stored as they go, resumable, cancellable.

A run is a thread of the daemon; its rows (benchmark_runs, trials, benchmark_events) are the truth.
A daemon that stops during a run stops the trial's engine and marks the run interrupted; the next
daemon marks runs still "running" in the file as interrupted and stops any trial engine a killed
daemon left behind, on a thread of its own: an engine can take many seconds to stop (one that is
loading finishes its step first), and the daemon serves meanwhile. Resuming runs the search again
over the stored trials (autotune/journal.py): only the trials after the last stored one start
engines, and none before the left-behind engines are gone.
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

from ..autotune.modes import MODE_NAMES, mode_named
from ..autotune.noise import NoiseRule, Objective
from ..autotune.plan import Plan
from ..autotune.search import Search, SearchFailed
from ..autotune.search_records import STARTING_FLAGS, SearchSettings
from ..autotune.trial import TRIAL_PORTS, EngineTrialRunner
from ..autotune.trial_record import Cancelled, TrialRequest
from ..autotune.workload import Workload
from ..engine.process import launch
from ..engine.text import Text, error_text, text_columns, text_fields, text_of
from .benchmark_setup import RunOptions, Setup, hardware_phase, resolve_setup
from .benchmark_store import DbJournal, add_event, events_of, trials_of, update_run
from .errors import BadRequest, Conflict
from .schema import BenchmarkRun, Profile
from .service import Daemon
from .store import row_or_404
from .supervisor import resolve_device

log = logging.getLogger("moelab.mgr")


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
        # set once the trial engines a killed daemon left behind are gone
        self._orphans_gone = threading.Event()
        self._orphans_gone.set()

    # ---- life of the service ----------------------------------------------------------------

    def open(self) -> None:
        """Mark runs a previous daemon left "running" as interrupted; stop their trial engines
        on a thread of its own."""
        with self.store.session() as session:
            rows = list(
                session.scalars(select(BenchmarkRun).where(BenchmarkRun.status == "running"))
            )
        for row in rows:
            update_run(self.store, row.id, status="interrupted", eta_s=None)
            add_event(
                self.store,
                row.id,
                "status",
                Text("interrupted: mgr stopped during the run; resume it to go on"),
            )
        if rows:
            self._orphans_gone.clear()
            threading.Thread(
                target=self._stop_orphans,
                args=([row.id for row in rows],),
                name="benchmark-orphans",
                daemon=True,
            ).start()

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

    def _stop_orphans(self, run_ids: list[int]) -> None:
        try:
            for run_id in run_ids:
                stopped = self._stop_orphan(run_id)
                if stopped is not None:
                    add_event(
                        self.store,
                        run_id,
                        "status",
                        Text(
                            "the trial engine a stopped mgr left running (pid {pid}) was stopped",
                            pid=stopped,
                        ),
                    )
        finally:
            self._orphans_gone.set()

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

    # ---- start, resume, cancel --------------------------------------------------------------

    def setup(self, options: RunOptions) -> Setup:
        """Resolve where a run starts and plan it (for a preview, or to start it)."""
        return resolve_setup(self.daemon, options)

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
                Text(
                    "nothing new to try: every candidate was tried in run {pick_up_from} or before "
                    "(a newer engine or the thorough mode adds candidates)",
                    pick_up_from=setup.pick_up_from,
                ),
                code="nothing_new",
            )
        self._check_device(setup.base_flags)
        inventory = self.daemon.hardware.inventory(max_age_s=3600.0)
        now = time.time()
        with self._lock:
            if self._active is not None:
                raise Conflict(
                    Text("run {run_id} is running; one run at a time", run_id=self._active.run_id),
                    code="busy",
                )
            with self.store.session() as session:
                row = BenchmarkRun(
                    model=setup.model.path,
                    mode=setup.mode,
                    objective=options.objective,
                    status="running",
                    phase="starting",
                    base_flags=setup.base_flags,
                    options={
                        "clients": options.clients,
                        **text_fields("base_origin", setup.base_origin),
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
        add_event(
            self.store,
            run_id,
            "status",
            Text(
                "started: {mode} mode, {objective}, from {origin}",
                mode=MODE_NAMES[setup.mode],
                objective=Objective(options.objective, options.clients).label,
                origin=setup.base_origin,
            ),
        )
        # the start is the run's first event: its thread writes the next ones
        self._launch(run_id)
        self._warn_if_shared(run_id)
        return run_id

    def engines(self) -> list[dict[str, Any]]:
        """This mgr's engines that run (or start) now: they take the CPU, memory and GPU the
        trials need, and move their figures."""
        supervisor = self.daemon.supervisor
        out = []
        for handle in supervisor.handles():
            if handle.stopping:
                continue
            row = supervisor.row(handle.server_id)
            out.append(
                {
                    "id": row.id,
                    "name": row.name,
                    "model": row.model,
                    "device": handle.device,
                    "pid": handle.engine.pid,
                    "status": row.status,
                }
            )
        return out

    def stop_engines(self) -> list[int]:
        """Stop every engine of this mgr (before a run); returns the servers stopped."""
        stopped = []
        for engine in self.engines():
            self.daemon.supervisor.stop(engine["id"])
            stopped.append(engine["id"])
        return stopped

    def _warn_if_shared(self, run_id: int) -> None:
        engines = self.daemon.supervisor.handles()
        if engines:
            add_event(
                self.store,
                run_id,
                "warning",
                Text(
                    "{n} engine(s) of this mgr are running: they share this machine's CPU and "
                    "memory with the trials and move their figures",
                    n=len(engines),
                ),
            )

    def resume(self, run_id: int) -> None:
        """Go on with an interrupted (or cancelled, or failed) run from its last stored trial."""
        with self._lock:
            if self._active is not None:
                raise Conflict(
                    Text("run {run_id} is running; one run at a time", run_id=self._active.run_id),
                    code="busy",
                )
            row = self.get(run_id)
            if row.status in ("running", "done"):
                raise Conflict(
                    Text(
                        "run {run_id} is {status}; only a stopped run resumes",
                        run_id=run_id,
                        status=row.status,
                    ),
                    code="not_resumable",
                )
            self._check_device(row.base_flags)
            update_run(
                self.store, run_id, status="running", **text_columns("error", None), finished=None
            )
            self._launch(run_id)
        done = len(trials_of(self.store, run_id))
        add_event(self.store, run_id, "status", Text("resumed after {n} trials", n=done))
        self._warn_if_shared(run_id)

    def cancel(self, run_id: int) -> None:
        """Stop a running run now: its trial's engine is stopped and the run ends cancelled."""
        with self._lock:
            active = self._active
        if active is None or active.run_id != run_id:
            row = self.get(run_id)
            raise Conflict(
                Text("run {run_id} is {status}, not running", run_id=run_id, status=row.status),
                code="not_running",
            )
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
                    Text(
                        "{device} is used by server {server_id}; stop it before a benchmark "
                        "(trials need the GPU to themselves)",
                        device=device,
                        server_id=handle.server_id,
                    ),
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
        # a trial beside an engine left from before would share its GPU, memory and ports
        self._orphans_gone.wait()
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
                Text("done")
                if gain is None
                else Text("done: {gain:+.1%} over the starting flags", gain=gain),
            )
        except Cancelled:
            shutdown = active.shutdown.is_set()
            status = "interrupted" if shutdown else "cancelled"
            update_run(self.store, run_id, status=status, eta_s=None, finished=time.time())
            add_event(
                self.store,
                run_id,
                "status",
                Text("interrupted: the trial's engine was stopped")
                if shutdown
                else Text("cancelled: the trial's engine was stopped"),
            )
        except SearchFailed as err:
            self._failed(run_id, error_text(err))
        except Exception as err:  # a bug: the run fails with the type, the log keeps the trace
            log.exception("benchmark run %s failed", run_id)
            self._failed(run_id, f"{type(err).__name__}: {err}")
        finally:
            with self._lock:
                if self._active is active:
                    self._active = None

    def _failed(self, run_id: int, message: Text | str) -> None:
        update_run(
            self.store,
            run_id,
            status="failed",
            **text_columns("error", message),
            eta_s=None,
            finished=time.time(),
        )
        add_event(self.store, run_id, "status", Text("failed: {error}", error=message))

    def _search(self, active: ActiveRun) -> dict[str, Any]:
        """Run the search of the active run to its result: the hardware phase, then the trials
        through the run's journal."""
        row = self.get(active.run_id)
        options = self._hardware_phase(row, active)
        mode = mode_named(row.mode)
        objective = Objective(row.objective, options.get("clients", 0))
        settings = SearchSettings(
            mode,
            objective,
            NoiseRule(min_gain=options["min_gain"], side_tolerance=options["side_tolerance"]),
            model_max_context=options.get("model_max_context"),
            pick_up=bool(options.get("pick_up_from")),
            base_origin=text_of(options, "base_origin") or STARTING_FLAGS,
        )
        workload = Workload(mode.workload_for(objective.clients, objective.agent))
        journal = self._journal(row, active, workload)
        result = Search(Plan.from_json(options["plan"]), row.base_flags, settings, journal).run()
        tried_in = dict(options.get("tried_in") or {})
        for key in result["tried"]:
            tried_in.setdefault(key, row.id)
        result.update(
            tried_in=tried_in,
            hardware=options["hardware"],
            pick_up_from=options.get("pick_up_from"),
            **text_fields("base_origin", text_of(options, "base_origin")),
            mode=row.mode,
        )
        return result

    def _hardware_phase(self, row: BenchmarkRun, active: ActiveRun) -> dict[str, Any]:
        """The run's options with the hardware it runs on: measured now (phase (a)) unless a
        resumed run measured it already or a picked-up run's figures are used."""
        options = dict(row.options or {})
        if options.get("hardware") is None:
            options["hardware"] = hardware_phase(self.daemon, row, active.cancel.is_set)
            update_run(self.store, row.id, options=options)
        elif options.get("pick_up_from"):
            add_event(
                self.store,
                row.id,
                "phase",
                Text("hardware: the figures of run {run} are used", run=options["pick_up_from"]),
            )
        return options

    def _journal(self, row: BenchmarkRun, active: ActiveRun, workload: Workload) -> DbJournal:
        """The run's journal over the store, running each new trial as a fresh engine."""
        runner = self.make_runner(
            row.model,
            workload,
            self.logs_dir,
            active.cancel,
            ports=self.ports,
            on_step=lambda step: self._step(active, step),
        )

        def run_trial(request: TrialRequest, n: int) -> Any:
            return runner.run(
                request,
                f"bench-{row.id}-trial-{n}",
                on_started=lambda engine: self._engine_started(active, n, engine),
            )

        return DbJournal(
            self.store,
            row.id,
            run_trial,
            active.cancel.is_set,
            on_trial=lambda n, request: self._trial_starting(active, n, request),
            on_progress=lambda phase, eta: update_run(self.store, row.id, phase=phase, eta_s=eta),
        )

    def _engine_started(self, active: ActiveRun, n: int, engine: launch.EngineProcess) -> None:
        """Note a trial's engine: shown live, and kept so that a later mgr can stop it should
        this one die during the trial."""
        if active.current is not None:
            active.current["engine_pid"] = engine.pid
        add_event(
            self.store,
            active.run_id,
            "engine",
            Text(
                "trial {n}: engine pid {pid} on port {port}", n=n, pid=engine.pid, port=engine.port
            ),
            {
                "n": n,
                "pid": engine.pid,
                "process_started": launch.process_start_time(engine.pid),
                "port": engine.port,
                "log": engine.log_path,
            },
        )

    def _trial_starting(self, active: ActiveRun, n: int, request: TrialRequest) -> None:
        label = request.change.label if request.change else Text("the flags as they are")
        active.current = {
            "n": n,
            "role": request.role,
            "change": request.change.to_json() if request.change else None,
            **text_fields("label", label),
            "started": time.time(),
            **text_fields("step", Text("starting the engine")),
            "engine_pid": None,
        }

    @staticmethod
    def _step(active: ActiveRun, step: Text) -> None:
        if active.current is not None:
            active.current.update(text_fields("step", step))

    # ---- reading and keeping results --------------------------------------------------------

    def get(self, run_id: int) -> BenchmarkRun:
        return self.store.get_or_404(BenchmarkRun, run_id)

    def runs(self, model: str | None = None) -> list[BenchmarkRun]:
        with self.store.session() as session:
            query = select(BenchmarkRun).order_by(BenchmarkRun.id.desc())
            if model:
                query = query.where(BenchmarkRun.model == model)
            return list(session.scalars(query))

    def delete(self, run_id: int) -> None:
        """Forget a run that is not running, with its trials, events and trial logs."""
        if self.active_id == run_id:
            raise Conflict(
                Text("run {run_id} is running; cancel it first", run_id=run_id), code="running"
            )
        with self.store.session() as session:
            session.delete(row_or_404(session, BenchmarkRun, run_id))
        for path in self.logs_dir.glob(f"bench-{run_id}-trial-*.log"):
            path.unlink(missing_ok=True)

    def save_profile(self, run_id: int, name: str | None) -> Profile:
        """The run's result as a launch profile (origin "benchmark run N")."""
        row = self.get(run_id)
        if row.status != "done" or not row.result:
            raise Conflict(
                Text(
                    "run {run_id} is {status}: only a finished run has a result",
                    run_id=run_id,
                    status=row.status,
                ),
                code="no_result",
            )
        result = row.result
        name = (name or f"{Path(row.model).name} benchmark {run_id}").strip()
        if not name or len(name) > 200:
            raise BadRequest(Text("name must be a non-empty string of at most 200 characters"))
        gain = result.get("gain")
        lines = [
            f"Benchmark run {run_id} ({row.mode} mode, {row.objective}): "
            + (f"{gain:+.1%} over {result.get('base_origin')}." if gain is not None else "")
        ]
        lines += [f"{c['label']}: {c['reason']}" for c in result.get("changes", [])]
        return self.daemon.profiles.add(
            name=name,
            model=row.model,
            flags=list(result["flags"]),
            notes="\n".join(lines),
            origin=f"benchmark run {run_id}",
        )
