"""One trial: a fresh `moelab serve` with the trial's flags, the workload, its stats, then stop.

The engine is never reused: every trial starts a new process through engine/process/launch.py,
waits for /health, sends one warm-up request, runs the workload the request names (the same one for
every trial after the calibration trial, which runs its stages in its one engine:
autotune/sizing.py), reads /v1/stats and stops the process group. A crash, an out-of-memory (said
only on evidence: engine/process/exits.py) or a timeout becomes a failed trial with the log tail;
the run goes on.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from ..engine.process import launch
from ..engine.process.exits import OomWatch, exit_words
from ..engine.text import Text, error_text
from .client import EngineClient, WorkloadError
from .flagset import without
from .sizing import calibrate
from .trial_record import Cancelled, TrialRequest, TrialResult
from .workload import Workload, WorkloadResult, WorkloadSpec

TRIAL_PORTS = range(8200, 8300)  # the daemon's supervisor hands out 8100-8199
_OOM_MARKS = ("out of memory", "outofmemoryerror", "memoryplanerror", "does not fit")


def compact_stats(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """/v1/stats without the per-expert pick matrix and the 60 s window (kept small per trial)."""
    if not isinstance(stats, dict):
        return None
    out = dict(stats)
    experts = dict(out.get("experts") or {})
    experts.pop("picks", None)
    experts.pop("window_60s", None)
    out["experts"] = experts
    return out


def decode_hit_rate(stats: dict[str, Any] | None) -> float | None:
    """Share of decode expert reads served from the cache, over the whole trial."""
    layers = ((stats or {}).get("experts") or {}).get("layers") or []
    reads = sum(int(layer.get("reads", 0)) for layer in layers)
    hits = sum(int(layer.get("hits", 0)) for layer in layers)
    return hits / reads if reads else None


def classify_failure(
    message: Text | str, log_tail: str, exit_code: int | None, oom_evidence: Text | None = None
) -> str:
    """What ended a trial, in a few words. Out of memory only on evidence: the engine's own
    report in its log, or the kernel's (engine/process/exits.py); a SIGKILL alone says nothing of
    who sent it."""
    text = f"{message}\n{log_tail}".lower()
    if oom_evidence is not None or any(mark in text for mark in _OOM_MARKS):
        return "out of memory"
    if "not ready after" in text or "timed out" in text or "timeout" in str(message).lower():
        return "timeout"
    if exit_code == -signal.SIGKILL:
        return "killed by signal 9"
    if exit_code is not None:
        return "crash"
    return "error"


class EngineTrialRunner:
    """Runs trials of one model as fresh engine processes on ports of their own."""

    def __init__(
        self,
        model: str,
        workload: Workload,
        logs_dir: Path,
        cancel: threading.Event,
        *,
        ports: range = TRIAL_PORTS,
        ready_timeout_s: float = 3600.0,
        stall_s: float = 600.0,
        stop_grace_s: float = 15.0,
        on_step: Callable[[Text], None] = lambda _step: None,
    ) -> None:
        self.model = model
        self.workload = workload
        self.logs_dir = logs_dir
        self.cancel = cancel
        self.ports = ports
        self.ready_timeout_s = ready_timeout_s
        self.stall_s = stall_s
        self.stop_grace_s = stop_grace_s
        self.on_step = on_step

    def run(
        self,
        request: TrialRequest,
        log_name: str,
        on_started: Callable[[launch.EngineProcess], None] = lambda _engine: None,
    ) -> TrialResult:
        """Run one trial; raises Cancelled (engine stopped) when the run is cancelled meanwhile."""
        started = time.time()
        # bound here and handed to the engine: no other program can take it meanwhile
        listener = launch.listen_on("127.0.0.1", self.ports)
        if listener is None:
            raise RuntimeError(
                Text(
                    "no free port in {first}-{last} for a trial engine",
                    first=self.ports.start,
                    last=self.ports.stop - 1,
                )
            )
        with closing(listener):
            flags = [
                *without(list(request.flags), ("--port", "--host")),
                "--host",
                "127.0.0.1",
                "--port",
                str(listener.getsockname()[1]),
            ]
            self.on_step(Text("starting the engine"))
            engine = launch.start_engine(
                ["--model-path", self.model, *flags],
                self.logs_dir / f"{log_name}.log",
                listener=listener,
            )
        oom = OomWatch.start(engine.pid)
        on_started(engine)
        finished = threading.Event()
        watcher = threading.Thread(
            target=self._stop_on_cancel, args=(engine, finished), name="trial-cancel", daemon=True
        )
        watcher.start()
        times: dict[str, float] = {}
        workload = Workload(request.workload) if request.workload else self.workload
        try:
            result = self._measure(request, workload, engine, started, times)
        except (launch.EngineFailed, WorkloadError, httpx.HTTPError, OSError, KeyError) as err:
            result = self._failed(err, workload, engine, oom, started, times)
        finally:
            finished.set()
            stop_start = time.monotonic()
            launch.stop_engine(engine, grace_s=self.stop_grace_s)
            stop_s = time.monotonic() - stop_start
            watcher.join(timeout=5)
        if self.cancel.is_set():
            raise Cancelled()
        return replace(result, stop_s=stop_s, duration_s=result.duration_s + stop_s)

    def _failed(
        self,
        err: Exception,
        workload: Workload,
        engine: launch.EngineProcess,
        oom: OomWatch,
        started: float,
        times: dict[str, float],
    ) -> TrialResult:
        code = engine.exit_code()
        tail = getattr(err, "log_tail", "") or launch.log_tail(engine.log_path)
        exit_code = getattr(err, "exit_code", None) if code is None else code
        message: Text | str = error_text(err) or type(err).__name__
        if isinstance(err, httpx.TimeoutException):
            message = Text("a workload request timed out: {error}", error=message)
        if code is not None and not isinstance(err, launch.EngineFailed):
            message = Text(
                "the engine {how} during the workload ({error})",
                how=exit_words(code),
                error=message,
            )
        evidence = oom.evidence() if exit_code == -signal.SIGKILL else None
        if evidence is not None:
            message = Text("{message}: {evidence}", message=message, evidence=evidence)
        return TrialResult(
            ok=False,
            started=started,
            duration_s=time.time() - started,
            engine_pid=engine.pid,
            startup_s=times.get("startup_s"),
            failure=classify_failure(message, tail, exit_code, evidence),
            error=message,
            log_tail=tail,
            details={"workload": workload.spec.to_json()},
        )

    def _measure(
        self,
        request: TrialRequest,
        workload: Workload,
        engine: launch.EngineProcess,
        started: float,
        times: dict[str, float],
    ) -> TrialResult:
        health = self._wait_ready(engine)
        times["startup_s"] = time.time() - started
        usable = int(health.get("max_model_len") or 0)
        self.on_step(Text("warm-up request"))
        warm_start = time.monotonic()
        # the warm-up is sized to the engine's prefill settings, which /v1/stats tells
        before = launch.get_json(engine.base_url + "/v1/stats", timeout_s=30.0)
        config = (before or {}).get("config") or {}
        with EngineClient(engine.base_url, workload.spec.request_timeout_s) as client:
            chars_per_token = workload.warm_up(client, config)
            warmup_s = time.monotonic() - warm_start
            self.on_step(Text("workload"))

            def run(spec: WorkloadSpec) -> WorkloadResult:
                return Workload(spec).run(client, usable, chars_per_token, self.cancel.is_set)

            if request.role == "calibration" and request.target_s is not None:
                result = calibrate(workload.spec, request.target_s, run, self.on_step)
            else:
                result = run(workload.spec)
            proof = None
            if request.context_tokens:
                self.on_step(
                    Text("proving a context of {tokens} tokens", tokens=request.context_tokens)
                )
                counted = result.details["prompt_chars_per_token"]
                proof = workload.prove_context(client, request.context_tokens, counted)
        stats = compact_stats(launch.get_json(engine.base_url + "/v1/stats", timeout_s=30.0))
        self.on_step(Text("stopping the engine"))
        return TrialResult(
            ok=True,
            started=started,
            duration_s=time.time() - started,
            prefill_tok_s=result.prefill_tok_s,
            decode_tok_s=result.decode_tok_s,
            aggregate_tok_s=result.aggregate_tok_s,
            agent_tok_s=result.agent_tok_s,
            ttft_s=result.ttft_s,
            hit_rate=decode_hit_rate(stats),
            usable_context=usable,
            context_proof=proof,
            engine_pid=engine.pid,
            startup_s=times["startup_s"],
            warmup_s=warmup_s,
            stats=stats,
            details={
                **result.details,
                "prefill_prompt_tokens_median": result.prefill_prompt_tokens,
            },
        )

    def _wait_ready(self, engine: launch.EngineProcess) -> dict[str, Any]:
        """/health ok within the ready timeout, failing early when loading stops moving.

        An engine whose /health says the same thing for `stall_s` (no bytes loaded, no change of
        status) is not going to become ready; the trial fails then instead of at the timeout.
        """
        deadline = time.monotonic() + self.ready_timeout_s
        seen: dict[str, Any] = {"body": None, "at": time.monotonic()}

        def progress(health: dict[str, Any]) -> None:
            if health != seen["body"]:
                seen["body"], seen["at"] = health, time.monotonic()

        while True:
            slice_s = max(0.5, min(15.0, deadline - time.monotonic()))
            try:
                return launch.wait_ready(engine, slice_s, on_progress=progress)
            except launch.EngineFailed as err:
                if err.exit_code is not None or "not ready after" not in str(err):
                    raise
                now = time.monotonic()
                if now - seen["at"] > self.stall_s:
                    raise launch.EngineFailed(
                        Text(
                            "engine loading made no progress for {time_s:.0f} s "
                            "(/health: {health})",
                            time_s=self.stall_s,
                            health=str(seen["body"]),
                        ),
                        log_tail=launch.log_tail(engine.log_path),
                    ) from None
                if now >= deadline:
                    raise launch.EngineFailed(
                        Text("engine not ready after {time_s:.0f} s", time_s=self.ready_timeout_s),
                        log_tail=launch.log_tail(engine.log_path),
                    ) from None

    def _stop_on_cancel(self, engine: launch.EngineProcess, finished: threading.Event) -> None:
        while not finished.wait(0.2):
            if self.cancel.is_set():
                launch.stop_engine(engine, grace_s=5.0)
                return
