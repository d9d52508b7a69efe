"""One trial with a real `moelab serve` on the demo model: how a failed engine is recorded."""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

from moelab.autotune.trial import EngineTrialRunner, classify_failure
from moelab.autotune.trial_record import TrialRequest
from moelab.autotune.workload import Workload, WorkloadSpec
from moelab.console.i18n import Translator
from moelab.engine.process import launch


def test_a_trial_engine_killed_with_sigkill_is_not_recorded_as_out_of_memory(
    tmp_path: Path, demo_model: Path
) -> None:
    workload = Workload(WorkloadSpec())
    runner = EngineTrialRunner(str(demo_model), workload, tmp_path, threading.Event())

    def kill(engine: launch.EngineProcess) -> None:
        os.kill(engine.pid, signal.SIGKILL)  # a user's kill -9: the kernel killed nothing

    result = runner.run(
        TrialRequest(("--device", "cpu"), None, "baseline"), "trial-1", on_started=kill
    )
    assert not result.ok
    assert result.failure == "killed by signal 9"
    assert "killed by signal 9 (SIGKILL)" in str(result.error)
    assert "memory" not in str(result.error)
    # the trials' "why" column on a Japanese page
    assert Translator("ja").plain(result.why_failed) == (
        "シグナル 9 で強制終了: エンジンが準備完了前にシグナル 9（SIGKILL）で強制終了した"
    )


def test_no_program_takes_a_trial_engines_port_before_it_serves(
    tmp_path: Path, demo_model: Path
) -> None:
    workload = Workload(WorkloadSpec())
    runner = EngineTrialRunner(str(demo_model), workload, tmp_path, threading.Event())
    late_binds: list[bool] = []

    def try_its_port(engine: launch.EngineProcess) -> None:
        # the engine is still importing torch: another program tries its port
        with socket.socket() as late:
            late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                late.bind(("127.0.0.1", engine.port))
                late.listen()
                late_binds.append(True)
            except OSError:
                late_binds.append(False)
        os.kill(engine.pid, signal.SIGKILL)  # that is all this trial is for

    runner.run(TrialRequest(("--device", "cpu"), None, "baseline"), "trial-1", try_its_port)
    assert late_binds == [False]


def test_out_of_memory_needs_evidence() -> None:
    killed = "engine was killed by signal 9 (SIGKILL) before it was ready"
    assert classify_failure(killed, "loading the expert bank", -signal.SIGKILL) == (
        "killed by signal 9"
    )
    kernel = "the kernel's OOM killer ended it (oom_kill in memory.events went from 0 to 1)"
    assert classify_failure(killed, "", -signal.SIGKILL, kernel) == "out of memory"
    # the engine's own report of an allocation that failed
    tail = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert classify_failure("engine exited with code 1", tail, 1) == "out of memory"
    assert classify_failure("engine was killed by signal 11 (SIGSEGV)", "", -11) == "crash"
