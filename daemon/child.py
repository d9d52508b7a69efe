"""Run a `moelab` subcommand as a child process, relaying its progress lines as they come."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChildResult:
    """How a `moelab` child ended: exit code, its stdout, and the last lines of its stderr."""

    returncode: int
    stdout: str
    stderr_tail: str


_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()


def stop_all() -> None:
    """Kill the children still running (the daemon is shutting down; their jobs die with it)."""
    with _running_lock:
        for process in _running:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)


def moelab_argv(args: list[str]) -> list[str]:
    """The command line of `moelab ARGS` under this Python (the same one that runs the daemon)."""
    return [sys.executable, "-m", "moelab.engine.cli", *args]


def run_moelab(
    args: list[str],
    on_line: Callable[[str], None],
    *,
    timeout_s: float = 3600.0,
    tail_lines: int = 30,
) -> ChildResult:
    """Run `moelab ARGS`; each stderr line goes to `on_line` while stdout is collected.

    A child that outlives `timeout_s` is killed and reported with returncode -9.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        moelab_argv(args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        start_new_session=True,
    )
    with _running_lock:
        _running.add(process)
    tail: deque[str] = deque(maxlen=tail_lines)

    def relay() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            tail.append(line.rstrip("\n"))
            on_line(line.rstrip("\n"))

    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        process.kill()

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    timer = threading.Timer(timeout_s, kill)
    timer.start()
    assert process.stdout is not None
    try:
        stdout = process.stdout.read()
        process.wait()
    finally:
        timer.cancel()
        with _running_lock:
            _running.discard(process)
    relay_thread.join(timeout=5)
    if timed_out.is_set():
        tail.append(f"killed after {timeout_s:.0f} s")
    return ChildResult(process.returncode, stdout, "\n".join(tail))
