"""Engines the daemon runs: start, watch, stop, restart, and find again after the daemon restarts.

Each engine is a `moelab serve` process in its own process group (engine/process/launch.py),
logging to `<data dir>/logs/server-N.log`. Its row in the servers table is the truth a restarted
daemon reads: pid, port and the process's start time together tell a live engine from a reused pid.

Server statuses: starting (loading, /health not ok yet), running, stopping, stopped (by request),
crashed (exited on its own; exit code and last log lines kept), failed (never became ready: it
reported an error or timed out, and was stopped), dead (gone when the daemon restarted).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from ..engine.process import launch
from ..engine.process.exits import OomWatch, exit_words
from ..engine.text import Text, error_text, text_columns
from .errors import BadRequest, Conflict, DiskFull
from .flags import FlagError, validate_flags
from .models import read_checkpoint
from .schema import Server
from .store import Store, row_or_404

log = logging.getLogger("moelab.mgr")

LIVE = ("starting", "running", "stopping")
DEFAULT_PORTS = range(8100, 8200)
ADOPTED_READY_MIN_S = 120.0


@dataclass(slots=True)
class EngineHandle:
    """A live engine of ours: the process, how to reach it, and whether its counters began here."""

    server_id: int
    engine: launch.EngineProcess
    device: str
    api_key: str | None
    fresh: bool  # started by this daemon process, so its counters started at zero under our eyes
    ready: bool = False
    stopping: bool = False
    health: dict[str, Any] | None = None
    oom: OomWatch | None = None  # the kernel's OOM kills counted since it started (or was adopted)

    @property
    def base_url(self) -> str:
        return self.engine.base_url


def resolve_device(flags: list[str], gpu_count: int) -> str:
    """The device an engine with these flags will compute on: "cpu" or "cuda:N"; the devices
    of a split as --devices names them ("cuda:0,cuda:1")."""
    split = launch.flag_value(flags, "--devices")
    if split:
        return split
    device = launch.flag_value(flags, "--device", "auto") or "auto"
    if device == "auto":
        return "cuda:0" if gpu_count > 0 else "cpu"
    if device == "cuda":
        return "cuda:0"
    return device


def checkpoint_dir(model: str) -> Path:
    """The folder of a checkpoint to serve; BadRequest when it holds no config.json or moelab
    cannot serve what it holds."""
    model_dir = Path(model).expanduser()
    if not (model_dir / "config.json").is_file():
        raise BadRequest(
            Text(
                "no checkpoint at {model} (a folder with config.json); GET /api/models lists them",
                model=model,
            ),
            code="model_not_found",
        )
    problem = read_checkpoint(model_dir, "start").error
    if problem is not None:
        raise BadRequest(
            Text("{name} cannot be served: {error}", name=model_dir.name, error=problem),
            code="unsupported_model",
        )
    return model_dir


class Supervisor:
    """Starts and stops engines for servers, keeps their rows current, watches for crashes."""

    def __init__(
        self,
        store: Store,
        data_dir: Path,
        gpu_count: Callable[[], int],
        *,
        ports: range = DEFAULT_PORTS,
        ready_timeout_s: float = 3600.0,
        stop_grace_s: float = 15.0,
        watch_interval_s: float = 0.5,
    ) -> None:
        self.store = store
        self.logs_dir = data_dir / "logs"
        self.gpu_count = gpu_count
        self.ports = ports
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.watch_interval_s = watch_interval_s
        self._handles: dict[int, EngineHandle] = {}
        self._unrecorded: set[int] = set()  # ended engines the full disk kept from their rows
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    # ---- life of the supervisor -------------------------------------------------------------

    def open(self) -> None:
        """Re-adopt the engines a previous daemon left running, then start watching."""
        self.adopt()
        self._watcher.start()

    def close(self) -> None:
        """Stop watching; the engines keep running for the next daemon to adopt."""
        self._closing.set()
        if self._watcher.is_alive():
            self._watcher.join(timeout=5)

    def handles(self) -> list[EngineHandle]:
        """The live engines (ready or not) for the sampler and the API."""
        with self._lock:
            return list(self._handles.values())

    def handle(self, server_id: int) -> EngineHandle | None:
        with self._lock:
            return self._handles.get(server_id)

    # ---- start / stop / restart -------------------------------------------------------------

    def start(
        self,
        *,
        model: str,
        flags: list[str],
        name: str | None = None,
        profile_id: int | None = None,
    ) -> Server:
        """Start an engine for `model` with `flags`; returns its row with status "starting"."""
        model_dir = checkpoint_dir(model)
        try:
            validate_flags(str(model_dir), flags)
        except FlagError as err:
            raise BadRequest(error_text(err), code="invalid_flags") from None
        with self._lock:
            device = resolve_device(flags, self.gpu_count())
            self._check_device_free(device)
            host = launch.flag_value(flags, "--host", "127.0.0.1") or "127.0.0.1"
            explicit = launch.flag_value(flags, "--port")
            if explicit is not None:
                listener = self._listen(host, int(explicit))
                flags = list(flags)
            else:
                listener = self._listen_on_a_free_port(host)
                flags = [*flags, "--port", str(listener.getsockname()[1])]
            with closing(listener):
                now = time.time()
                with self.store.session() as session:
                    row = Server(
                        profile_id=profile_id,
                        name=name or model_dir.resolve().name,
                        model=str(model_dir.resolve()),
                        flags=flags,
                        host=host,
                        port=listener.getsockname()[1],
                        device=device,
                        status="starting",
                        log_path="",
                        created=now,
                    )
                    session.add(row)
                    session.flush()
                    row.log_path = str(self.logs_dir / f"server-{row.id}.log")
                return self._launch(row, listener)

    def _launch(self, row: Server, listener: socket.socket) -> Server:
        """Run the engine for a row (new or restarted) on the socket bound for it, and start
        waiting for it to be ready."""
        engine = launch.start_engine(
            ["--model-path", row.model, *row.flags], row.log_path, listener=listener
        )
        handle = EngineHandle(
            server_id=row.id,
            engine=engine,
            device=row.device,
            api_key=launch.flag_value(row.flags, "--api-key"),
            fresh=True,
            oom=OomWatch.start(engine.pid),
        )
        self._handles[row.id] = handle
        row = self._update(
            row.id,
            status="starting",
            pid=engine.pid,
            process_started=launch.process_start_time(engine.pid) or engine.started,
            started=engine.started,
            ready=None,
            stopped=None,
            exit_code=None,
            **text_columns("error", None),
            log_tail=None,
        )
        self._wait_in_background(handle, self.ready_timeout_s)
        return row

    def stop(self, server_id: int) -> Server:
        """SIGTERM to the engine's group, SIGKILL after the grace; the row ends "stopped"."""
        with self._lock:
            handle = self._handles.get(server_id)
            if handle is None:
                return self.row(server_id)
            handle.stopping = True
            self._update(server_id, status="stopping")
        code = launch.stop_engine(handle.engine, grace_s=self.stop_grace_s)
        with self._lock:
            self._handles.pop(server_id, None)
            return self._update(
                server_id,
                status="stopped",
                exit_code=code if handle.engine.popen is not None else None,
                stopped=time.time(),
            )

    def restart(self, server_id: int) -> Server:
        """Stop the engine if it runs, then start it again with the same model, flags and port."""
        checkpoint_dir(self.row(server_id).model)  # moved or deleted since: refused, not started
        row = self.stop(server_id)
        with self._lock:
            self._check_device_free(row.device)
            with closing(self._listen(row.host, row.port)) as listener:
                return self._launch(row, listener)

    def forget(self, server_id: int) -> None:
        """Delete a server that is not running (with its telemetry)."""
        with self._lock:
            if server_id in self._handles:
                raise Conflict(
                    Text("server {server_id} is running; stop it first", server_id=server_id),
                    code="running",
                )
            with self.store.session() as session:
                session.delete(row_or_404(session, Server, server_id))

    # ---- refusals ---------------------------------------------------------------------------

    def _check_device_free(self, device: str) -> None:
        """Conflict where a GPU of `device` (one, or a split's: "cuda:0,cuda:1") is another
        running engine's; the CPU is shared."""
        wanted = set(device.split(",")) - {"cpu"}
        for other in self._handles.values():
            taken = wanted & set(other.device.split(","))
            if taken and not other.stopping:
                row = self.row(other.server_id)
                raise Conflict(
                    Text(
                        "{device} is taken by server {id} ({name}, port {port}); stop it first or "
                        "choose another --device",
                        device=min(taken),
                        id=row.id,
                        name=row.name,
                        port=row.port,
                    ),
                    code="gpu_taken",
                )

    def _listen(self, host: str, port: int) -> socket.socket:
        """The engine's socket on `port`, bound here so that nothing takes the port before the
        engine serves on it."""
        for other in self._handles.values():
            if other.engine.port == port and not other.stopping:
                row = self.row(other.server_id)
                raise Conflict(
                    Text(
                        "port {port} is used by server {id} ({name}); choose another --port or "
                        "leave it out to get a free one",
                        port=port,
                        id=row.id,
                        name=row.name,
                    ),
                    code="port_in_use",
                )
        listener = launch.listen_on(host, [port])
        if listener is None:
            raise Conflict(
                Text(
                    "port {port} on {host} is in use by another program; choose another --port or "
                    "leave it out to get a free one",
                    port=port,
                    host=host,
                ),
                code="port_in_use",
            )
        return listener

    def _listen_on_a_free_port(self, host: str) -> socket.socket:
        taken = {h.engine.port for h in self._handles.values()}
        listener = launch.listen_on(host, (port for port in self.ports if port not in taken))
        if listener is None:
            raise Conflict(
                Text(
                    "no free port in {first}-{last}; stop a server or give --port",
                    first=self.ports.start,
                    last=self.ports.stop - 1,
                ),
                code="no_free_port",
            )
        return listener

    # ---- watching ---------------------------------------------------------------------------

    def _wait_in_background(self, handle: EngineHandle, timeout_s: float) -> None:
        threading.Thread(
            target=self._wait_ready, args=(handle, timeout_s), name="engine-ready", daemon=True
        ).start()

    def _wait_ready(self, handle: EngineHandle, timeout_s: float) -> None:
        def progress(health: dict[str, Any]) -> None:
            handle.health = health

        try:
            handle.health = launch.wait_ready(handle.engine, timeout_s, on_progress=progress)
        except launch.EngineFailed as err:
            with self._lock:
                if handle.stopping or self._handles.get(handle.server_id) is not handle:
                    return
                if err.exit_code is not None:
                    self._handles.pop(handle.server_id, None)
                    self._ended(handle, err.exit_code, error_text(err), err.log_tail)
                    return
                handle.stopping = True
            # an error report or a timeout: the process may still run; do not leave it behind
            launch.stop_engine(handle.engine, grace_s=self.stop_grace_s)
            with self._lock:
                self._handles.pop(handle.server_id, None)
                self._update(
                    handle.server_id,
                    status="failed",
                    **text_columns("error", error_text(err)),
                    log_tail=launch.log_tail(handle.engine.log_path),
                    stopped=time.time(),
                )
            return
        with self._lock:
            if self._handles.get(handle.server_id) is handle and not handle.stopping:
                handle.ready = True
                self._update(handle.server_id, status="running", ready=time.time())

    def _watch(self) -> None:
        while not self._closing.wait(self.watch_interval_s):
            with self._lock:
                for handle in list(self._handles.values()):
                    if handle.stopping or not handle.ready:
                        continue  # stop() and the ready waiter report those
                    code = handle.engine.exit_code()
                    if code is None:
                        continue
                    try:
                        self._ended(handle, code, None, launch.log_tail(handle.engine.log_path))
                    except DiskFull as full:  # recorded at a later round, once space is freed
                        if handle.server_id not in self._unrecorded:
                            self._unrecorded.add(handle.server_id)
                            log.error("server %d ended: %s", handle.server_id, full.message)
                        continue
                    self._unrecorded.discard(handle.server_id)
                    self._handles.pop(handle.server_id, None)

    def _ended(
        self, handle: EngineHandle, code: int, message: Text | str | None, tail: str
    ) -> None:
        adopted = handle.engine.popen is None
        exit_code = None if adopted else code
        if message is None:
            message = (
                Text(
                    "the engine exited (its exit code is unknown: it was adopted from an earlier "
                    "mgr)"
                )
                if adopted
                else Text("the engine {how}", how=exit_words(code))
            )
        # out of memory only on the kernel's word: a SIGKILL may as well be a user's kill -9
        if handle.oom is not None and (adopted or code == -signal.SIGKILL):
            evidence = handle.oom.evidence()
            if evidence is not None:
                message = Text("{message}: {evidence}", message=message, evidence=evidence)
        self._update(
            handle.server_id,
            status="crashed",
            exit_code=exit_code,
            **text_columns("error", message),
            log_tail=tail,
            stopped=time.time(),
        )

    # ---- adoption after a daemon restart ----------------------------------------------------

    def adopt(self) -> None:
        """Take over live engines recorded by an earlier daemon; mark the vanished ones dead.

        Only the process table is read here: asking each engine how it is goes to a thread of
        its own, so that engines slow to answer do not hold up the daemon's start.
        """
        with self.store.session() as session:
            rows = list(session.scalars(select(Server).where(Server.status.in_(LIVE))))
        for row in rows:
            if self._is_same_process(row):
                engine = launch.EngineProcess(
                    pid=row.pid or 0,
                    host=row.host,
                    port=row.port,
                    log_path=row.log_path,
                    started=row.started or time.time(),
                )
                handle = EngineHandle(
                    server_id=row.id,
                    engine=engine,
                    device=row.device,
                    api_key=launch.flag_value(row.flags, "--api-key"),
                    fresh=False,
                    oom=OomWatch.start(engine.pid),
                )
                with self._lock:
                    self._handles[row.id] = handle
                threading.Thread(
                    target=self._check_adopted,
                    args=(handle, row.started),
                    name="engine-adopt",
                    daemon=True,
                ).start()
            else:
                self._update(
                    row.id,
                    status="dead",
                    **text_columns(
                        "error",
                        Text("the engine (pid {pid}) was gone when mgr started again", pid=row.pid),
                    ),
                    log_tail=launch.log_tail(row.log_path),
                    stopped=time.time(),
                )

    def _check_adopted(self, handle: EngineHandle, started: float | None) -> None:
        health = launch.get_json(handle.base_url + "/health", timeout_s=2.0)
        with self._lock:
            if self._handles.get(handle.server_id) is not handle or handle.stopping:
                return
            if health is not None and health.get("status") == "ok":
                handle.health, handle.ready = health, True
                self._update(handle.server_id, status="running")
                return
            # still loading (or not answering): it gets what is left of its ready time
            self._update(handle.server_id, status="starting")
        waited_s = time.time() - (started or time.time())
        self._wait_ready(handle, max(ADOPTED_READY_MIN_S, self.ready_timeout_s - waited_s))

    @staticmethod
    def _is_same_process(row: Server) -> bool:
        """The recorded pid is alive and started when the recorded engine started."""
        if not row.pid or not launch.pid_alive(row.pid):
            return False
        started = launch.process_start_time(row.pid)
        return (
            started is not None
            and row.process_started is not None
            and (abs(started - row.process_started) < 1.0)
        )

    # ---- rows -------------------------------------------------------------------------------

    def servers(self) -> list[Server]:
        """Every server row, newest first."""
        with self.store.session() as session:
            return list(session.scalars(select(Server).order_by(Server.id.desc())))

    def row(self, server_id: int) -> Server:
        """One server's row; NotFound when there is none."""
        return self.store.get_or_404(Server, server_id)

    def servers_with_stats(self, model_path: str) -> list[Server]:
        """The servers of a model that kept a stats body, the newest body first."""
        with self.store.session() as session:
            return list(
                session.scalars(
                    select(Server)
                    .where(Server.model == model_path, Server.last_stats.is_not(None))
                    .order_by(Server.last_stats_time.desc())
                )
            )

    def _update(self, server_id: int, **fields: Any) -> Server:
        with self.store.session() as session:
            row = row_or_404(session, Server, server_id)
            for key, value in fields.items():
                setattr(row, key, value)
            return row
