"""How an engine ended: "killed by signal 9" unless the kernel says its OOM killer did it.

The OOM kills are real: a process is moved into a memory cgroup of its own with a small limit and
made to take more (root may make one here; elsewhere those tests are skipped with the reason).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from moelab.daemon.schema import Server
from moelab.daemon.supervisor import EngineHandle, Supervisor
from moelab.engine.process import launch
from moelab.engine.process.exits import OomWatch, exit_words, memory_counter

from .conftest import make_daemon, wait_for

_names = itertools.count()


@contextmanager
def memory_limited_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A child of this process's memory cgroup that holds at most `limit_bytes`."""
    counter = memory_counter(os.getpid())
    if counter is None:
        pytest.skip("this process's memory cgroup cannot be read here")
    child = counter.parent / f"moelab-test-{os.getpid()}-{next(_names)}"
    try:
        child.mkdir()
        limit = "memory.limit_in_bytes" if counter.name == "memory.oom_control" else "memory.max"
        (child / limit).write_text(str(limit_bytes))
    except OSError as err:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {err}")
    try:
        yield child
    finally:
        wait_for(lambda: not (child / "cgroup.procs").read_text().strip(), 30, "an empty cgroup")
        child.rmdir()


def start_in(cgroup: Path, code: str) -> tuple[subprocess.Popen, OomWatch]:
    """Python running `code` in `cgroup`, and the OOM watch taken once it is there."""
    move_then_run = f'echo $$ > {cgroup}/cgroup.procs && read go && exec "$0" -c "{code}"'
    process = subprocess.Popen(["sh", "-c", move_then_run, sys.executable], stdin=subprocess.PIPE)
    wait_for(lambda: cgroup.name in Path(f"/proc/{process.pid}/cgroup").read_text(), 30, "the move")
    watch = OomWatch.start(process.pid)
    assert process.stdin is not None
    process.stdin.write(b"go\n")
    process.stdin.close()
    return process, watch


TAKE_A_GIB = "taken = b'x' * (1 << 30)"


def test_a_sigkill_by_someone_else_is_not_called_out_of_memory() -> None:
    process = subprocess.Popen(["sleep", "60"])
    watch = OomWatch.start(process.pid)
    process.kill()
    assert process.wait() == -signal.SIGKILL
    assert watch.evidence() is None
    assert str(exit_words(process.returncode)) == "was killed by signal 9 (SIGKILL)"
    assert str(exit_words(3)) == "exited with code 3"


def test_the_oom_killer_is_named_with_the_kernels_count() -> None:
    with memory_limited_cgroup(64 * 1024**2) as cgroup:
        process, watch = start_in(cgroup, TAKE_A_GIB)
        assert process.wait(timeout=60) == -signal.SIGKILL
        evidence = str(watch.evidence())
    assert "OOM killer" in evidence
    assert "oom_kill" in evidence and "from 0 to 1" in evidence


def test_the_kernels_log_names_the_pid_where_the_count_is_gone() -> None:
    """An engine in a cgroup of its own (systemd's, say) that went with it: the kernel's log."""
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY))
    except OSError as err:
        pytest.skip(f"the kernel's log cannot be read here: {err}")
    with memory_limited_cgroup(64 * 1024**2) as cgroup:
        process, watch = start_in(cgroup, TAKE_A_GIB)
        assert process.wait(timeout=60) == -signal.SIGKILL
    evidence = str(watch.evidence())
    assert f"Killed process {process.pid} (" in evidence


def test_the_supervisor_says_out_of_memory_only_on_the_kernels_word(tmp_path: Path) -> None:
    daemon = make_daemon(tmp_path / "data", None)
    supervisor: Supervisor = daemon.supervisor
    with daemon.store.session() as session:
        for server_id in (1, 2):
            session.add(
                Server(id=server_id, name=f"s{server_id}", model="/m", flags=[],
                       host="127.0.0.1", port=8100 + server_id, device="cpu", status="stopped",
                       log_path="", created=0.0)
            )  # fmt: skip
    supervisor.open()
    try:
        with memory_limited_cgroup(64 * 1024**2) as cgroup:
            killed = subprocess.Popen(["sleep", "60"])
            hog, hog_watch = start_in(cgroup, "import time; time.sleep(1); " + TAKE_A_GIB)
            for server_id, process, watch in (
                (1, killed, OomWatch.start(killed.pid)),
                (2, hog, hog_watch),
            ):
                engine = launch.EngineProcess(process.pid, "127.0.0.1", 0, "", 0.0, popen=process)
                supervisor._handles[server_id] = EngineHandle(
                    server_id, engine, "cpu", None, fresh=True, ready=True, oom=watch
                )
            killed.kill()
            assert hog.wait(timeout=60) == killed.wait() == -signal.SIGKILL
            ended = [
                wait_for(lambda i=i: (r := supervisor.row(i)).status == "crashed" and r, 30, "end")
                for i in (1, 2)
            ]
    finally:
        daemon.close()
    assert ended[0].error == "the engine was killed by signal 9 (SIGKILL)"
    assert ended[1].error.startswith("the engine was killed by signal 9 (SIGKILL): the kernel's")
    assert "OOM killer" in ended[1].error and "oom_kill" in ended[1].error
