"""Start a `moelab serve` process in its own process group, wait for it to be ready, stop it.

The caller binds the engine's port (`listen_on`) and the engine inherits the listening socket
(its file descriptor in MOELAB_LISTEN_FD), so no other program can take the port between the
choice and the engine's start. Torch-free: the daemon's supervisor and the benchmark's trials
both use it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..config.flag_list import FlagList
from ..text import Text
from .exits import exit_words
from .redact import redact_flags

LISTEN_FD_ENV = "MOELAB_LISTEN_FD"


class EngineFailed(RuntimeError):
    """The engine exited, reported an error, or never became ready."""

    def __init__(
        self, message: Text | str, *, exit_code: int | None = None, log_tail: str = ""
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.log_tail = log_tail


def flag_value(flags: list[str], name: str, default: str | None = None) -> str | None:
    """The value given to `name` in a flag list (`--port 8000` or `--port=8000`), last one wins."""
    return FlagList.parse(flags).get(name, default)


@dataclass(slots=True)
class EngineProcess:
    """A running (or finished) engine: enough to find it again after a restart of the caller."""

    pid: int
    host: str
    port: int
    log_path: str
    started: float
    argv: list[str] = field(default_factory=list)
    popen: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def exit_code(self) -> int | None:
        """The exit status if the process has ended, else None."""
        if self.popen is not None:
            return self.popen.poll()
        if pid_alive(self.pid):
            return None
        return -1  # ended while not our child: the status is gone with it

    def alive(self) -> bool:
        return self.exit_code() is None


def listen_on(host: str, ports: Iterable[int]) -> socket.socket | None:
    """A listening socket on the first of `ports` that `host` lets this process bind (the
    engine's server takes it over); None when every one is in use."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        # as the engine's server sets it: a port left in TIME_WAIT by a stopped engine is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(2048)
        except OSError:
            sock.close()
            continue
        return sock
    return None


def engine_argv(flags: list[str], python: str | None = None) -> list[str]:
    """The command line that runs `moelab serve` with `flags` under this Python."""
    return [python or sys.executable, "-m", "moelab.engine.cli", "serve", *flags]


def start_engine(
    flags: list[str],
    log_path: str | os.PathLike,
    *,
    env: dict[str, str] | None = None,
    python: str | None = None,
    listener: socket.socket | None = None,
) -> EngineProcess:
    """Start `moelab serve` with `flags` in a new process group, stdout and stderr to `log_path`.

    The log is readable by its owner only (mode 0600, in a folder made 0700), and its first line
    shows the command with the secret flags' values hidden. With `listener` (from listen_on;
    `flags` give its port as --port), the engine serves on that socket; the caller closes its own
    copy once this returns.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    argv = engine_argv(flags, python)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env.pop(LISTEN_FD_ENV, None)
    inherited: tuple[int, ...] = ()
    if listener is not None:
        child_env[LISTEN_FD_ENV] = str(listener.fileno())
        inherited = (listener.fileno(),)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)  # a log an older moelab created readable by all
    with os.fdopen(fd, "ab") as log:
        command = " ".join(redact_flags(argv))
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {command}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
            pass_fds=inherited,
        )
    given = FlagList.parse(flags)
    return EngineProcess(
        pid=popen.pid,
        host=given.get("--host") or "127.0.0.1",
        port=int(given.get("--port") or 8000),
        log_path=str(log_path),
        started=time.time(),
        argv=argv,
        popen=popen,
    )


def get_json(url: str, timeout_s: float = 2.0, api_key: str | None = None) -> dict | None:
    """GET `url` and parse its JSON body; None when it cannot be reached. HTTP errors included."""
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        try:
            return json.loads(err.read())
        except (ValueError, OSError):
            return None
    except (OSError, ValueError):
        return None


def log_tail(path: str | os.PathLike, lines: int = 30) -> str:
    """The last `lines` lines of a log file ('' when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(
    engine: EngineProcess,
    timeout_s: float = 600.0,
    *,
    on_progress: Callable[[dict], None] | None = None,
    poll_s: float = 0.2,
) -> dict:
    """Wait until the engine's /health says ok, watching the child the whole time.

    Returns the final health body. Raises EngineFailed at once if the process exits or reports
    an error, and after `timeout_s` if it never becomes ready (the process is left running).
    """
    deadline = time.monotonic() + timeout_s
    last: dict | None = None
    while True:
        code = engine.exit_code()
        if code is not None:
            how = (
                exit_words(code)
                if engine.popen is not None
                else Text("ended (its status is unknown)")
            )
            raise EngineFailed(
                Text("engine {how} before it was ready", how=how),
                exit_code=code,
                log_tail=log_tail(engine.log_path),
            )
        health = get_json(engine.base_url + "/health", timeout_s=2.0)
        if health is not None:
            if health != last and on_progress is not None:
                on_progress(health)
            last = health
            status = health.get("status")
            if status == "ok":
                return health
            if status == "error":
                raise EngineFailed(
                    Text("engine reported an error: {error}", error=health.get("error", "unknown")),
                    log_tail=log_tail(engine.log_path),
                )
        if time.monotonic() > deadline:
            raise EngineFailed(
                Text("engine not ready after {time_s:.0f} s", time_s=timeout_s),
                log_tail=log_tail(engine.log_path),
            )
        time.sleep(poll_s)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def process_start_time(pid: int) -> float | None:
    """When `pid` started, in seconds since the epoch (Linux); None when it cannot be told."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def stop_engine(engine: EngineProcess, grace_s: float = 15.0) -> int | None:
    """SIGTERM to the engine's process group, SIGKILL after `grace_s`; returns the exit code."""
    try:
        pgid = os.getpgid(engine.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None and pgid == engine.pid:
        _signal_group(pgid, signal.SIGTERM)
    elif pid_alive(engine.pid):
        os.kill(engine.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        code = engine.exit_code()
        if code is not None:
            break
        time.sleep(0.05)
    else:
        if pgid is not None and pgid == engine.pid:
            _signal_group(pgid, signal.SIGKILL)
        elif pid_alive(engine.pid):
            os.kill(engine.pid, signal.SIGKILL)
        if engine.popen is not None:
            engine.popen.wait(timeout=10)
    # the group may hold children of the engine (compile workers): leave none behind
    if pgid is not None and pgid == engine.pid:
        _signal_group(pgid, signal.SIGKILL)
    return engine.exit_code()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
