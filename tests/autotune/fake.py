"""A fake engine with a known optimum and seeded noise, and a journal kept in memory.

The fake's trials take time as a real engine's would: the workload a trial is asked to run lasts
as long as its tokens take at the trial's speeds, plus a fixed time per request; start-up,
warm-up and stop take RESTART_S together. A calibration trial runs its stages as the real trial
runner does (autotune/sizing.py: calibrate), in one engine: only its first workload is cold.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

from moelab.autotune.flagset import effective_value, value_of
from moelab.autotune.journal import Journal, StoredTrial
from moelab.autotune.sizing import calibrate
from moelab.autotune.trial_record import Cancelled, TrialRequest, TrialResult
from moelab.autotune.workload import ContextProof, WorkloadResult, WorkloadSpec

POLICY = {"auto": 1.0, "gpu": 0.8, "cpu": 1.25, "split:0.25": 1.1, "split:0.75": 0.9}
THREADS = {1: 0.8, 2: 0.95, 3: 1.0, 4: 1.12}
RUNNING = {1: 1.0, 2: 1.8, 4: 3.0, 8: 3.6, 16: 3.1}  # more requests thrash the cache past 8
CHUNK = {512: 0.7, 1024: 0.9, 2048: 1.0, 4096: 1.1, 8192: 1.05}
MODEL_MAX_CONTEXT = 32768
REQUEST_S = 0.02  # a request's own time: HTTP, scheduling, the first step
DECODE_PROMPT_TOKENS = 100
CHARS_PER_TOKEN = 3.5
RESTART_S = 2.0


def true_figures(flags: list[str]) -> tuple[float, float, float]:
    """(prefill, decode, aggregate) tok/s this fake engine gives `flags`, without noise."""
    decode = 100.0 * POLICY[str(effective_value(flags, "--moe-miss-policy"))]
    decode *= THREADS[int(value_of(flags, "--moe-cpu-threads") or 3)]
    if value_of(flags, "--moe-cache-size") == "1":
        decode *= 0.5
    rate = value_of(flags, "--moe-cache-rate")
    if rate is not None:
        decode *= 0.7 + 0.3 * float(rate)
    if effective_value(flags, "--no-cuda-graph") is True:
        decode *= 0.9
    if value_of(flags, "--kv-block-size") == "32":
        decode *= 1.1
    prefill = 1000.0 * CHUNK[int(value_of(flags, "--prefill-chunk-tokens") or 2048)]
    if effective_value(flags, "--no-prefill-overlap") is True:
        prefill *= 0.9
    aggregate = decode * RUNNING[int(value_of(flags, "--max-running-requests") or 8)]
    return prefill, decode, aggregate


def usable_context(flags: list[str]) -> int:
    return min(MODEL_MAX_CONTEXT, int(value_of(flags, "--kv-reserve-tokens") or 8192))


class Interrupted(Exception):
    """The fake daemon went away in the middle of a run."""


class FakeEngine:
    """Trials against `true_figures` with multiplicative noise of `noise` (seeded by trial).

    `flukes` maps a change key to a factor applied to that change's first trial only (a one-off
    lucky run); `crash` lists change keys whose engine exits while loading; `interrupt_at`
    raises Interrupted instead of running that trial number; `drift` makes every trial that
    much faster than the one before (the machine getting quieter). The first workload of
    trial 1 is cold (the first engine compiles its kernels): its figures times `cold`, and its
    first request `compile_s` longer. Every request takes `request_s` besides its tokens.
    """

    def __init__(
        self,
        seed: int = 0,
        noise: float = 0.02,
        flukes: dict[str, float] | None = None,
        crash: tuple[str, ...] = (),
        interrupt_at: int | None = None,
        slow_above_context: int | None = None,
        drift: float = 0.0,
        speed: float = 1.0,
        cold: float = 1.0,
        compile_s: float = 0.0,
        request_s: float = REQUEST_S,
        other_s: float = 0.0,
    ) -> None:
        self.seed = seed
        self.speed = speed  # every figure times this: a faster or slower machine
        self.cold = cold
        self.compile_s = compile_s
        self.request_s = request_s
        self.other_s = other_s  # a workload's time outside its requests
        self.noise = noise
        self.flukes = dict(flukes or {})
        self.crash = crash
        self.interrupt_at = interrupt_at
        self.slow_above_context = slow_above_context
        self.drift = drift
        self.calls: list[tuple[int, TrialRequest]] = []

    def __call__(self, request: TrialRequest, n: int) -> TrialResult:
        if n == self.interrupt_at:
            raise Interrupted(n)
        self.calls.append((n, request))
        key = request.change.key if request.change else None
        spec = request.workload or WorkloadSpec()
        if key in self.crash:
            return TrialResult(
                ok=False, started=float(n), duration_s=3.0, failure="crash",
                error="engine exited with code 1 before it was ready",
                log_tail=f"# starting: moelab serve {' '.join(request.flags)}\nboom",
                details={"workload": spec.to_json()},
            )  # fmt: skip
        rng = random.Random(f"{self.seed}:{n}")
        fluke = self.flukes.pop(key, 1.0) if key else 1.0
        flags = list(request.flags)
        usable = usable_context(flags)
        slow = 0.8 if self.slow_above_context and usable > self.slow_above_context else 1.0
        slow *= (1 + self.drift) ** n
        figures = [
            v * self.speed * fluke * slow * (1 + rng.gauss(0, self.noise))
            for v in true_figures(flags)
        ]
        proof = None
        if request.context_tokens:
            served = request.context_tokens <= usable
            tokens = int(request.context_tokens * 0.97) if served else 0
            proof = ContextProof(request.context_tokens, tokens, served, f"served {tokens}")
        workloads = 0

        def run(spec: WorkloadSpec) -> WorkloadResult:
            nonlocal workloads
            cold = n == 1 and workloads == 0
            workloads += 1
            prefill, decode, aggregate = (v * (self.cold if cold else 1.0) for v in figures)
            details = timed_workload(
                spec, usable, prefill, decode, aggregate, self.request_s,
                self.compile_s if cold else 0.0, self.other_s,
            )  # fmt: skip
            agent = details.get("agent_tok_s")
            return WorkloadResult(prefill, spec.prefill_tokens, decode, 0.1, aggregate, agent,
                                  details)  # fmt: skip

        if request.role == "calibration" and request.target_s is not None:
            result = calibrate(spec, request.target_s, run)
        else:
            result = run(spec)
        return TrialResult(
            ok=True, started=float(n), duration_s=RESTART_S + result.details["workload_s"],
            prefill_tok_s=result.prefill_tok_s, decode_tok_s=result.decode_tok_s,
            aggregate_tok_s=result.aggregate_tok_s, agent_tok_s=result.agent_tok_s,
            ttft_s=result.ttft_s, hit_rate=0.5,
            usable_context=usable, context_proof=proof, engine_pid=1000 + n, startup_s=1.5,
            warmup_s=0.3, stop_s=0.2, details=result.details,
        )  # fmt: skip


def timed_workload(
    spec: WorkloadSpec,
    usable: int,
    prefill: float,
    decode: float,
    aggregate: float,
    request_s: float = REQUEST_S,
    first_request_s: float = 0.0,
    other_s: float = 0.0,
) -> dict[str, Any]:
    """The readings a trial of `spec` records (autotune/workload.py) at these speeds, each
    request `request_s` longer and the first `first_request_s` more, and `other_s` spent outside
    any request (building prompts); with agent sessions, their figure as `agent_tok_s`."""
    prompt = min(spec.prefill_tokens, (usable - 64) // 2)
    one_decode_s = request_s + DECODE_PROMPT_TOKENS / prefill + (spec.decode_tokens - 1) / decode
    parts = {
        "prefill": first_request_s + spec.prefill_requests * (request_s + prompt / prefill),
        "decode": spec.decode_requests * one_decode_s,
    }
    if spec.clients:
        tokens = spec.clients * spec.aggregate_tokens
        parts["aggregate"] = spec.aggregate_rounds * (request_s + tokens / aggregate)
    agent = {}
    if spec.agent_turns:
        # a session: each turn a request, its new prompt tokens (the rest cached) and its reply
        shape = spec.session(0).fitted(usable * 9 // 10)
        draws = shape.draws()
        replies = sum(reply for _, reply in draws)
        new_tokens = shape.system_tokens + sum(result for result, _ in draws)
        session_s = shape.turns * request_s + new_tokens / prefill + replies / decode
        parts["agent"] = spec.agent_sessions * session_s
        agent = {"agent_tok_s": replies / session_s}
    return {
        **agent,
        "prefill_tok_s": [prefill] * spec.prefill_requests,
        "prefill_target_tokens": prompt,
        "prefill_prompt_tokens": [prompt] * spec.prefill_requests,
        "decode_tok_s": [decode] * spec.decode_requests,
        "decode_prompt_tokens": [DECODE_PROMPT_TOKENS] * spec.decode_requests,
        "prefill_cuts": [(int(prompt * CHARS_PER_TOKEN), prompt)] * spec.prefill_requests,
        "prompt_chars_per_token": CHARS_PER_TOKEN,
        "parts_s": parts,
        "workload_s": other_s + sum(parts.values()),
        "workload": spec.to_json(),
    }


class MemoryJournal(Journal):
    """A journal whose records are lists (what the daemon keeps in its database)."""

    def __init__(self, runner: Any, previous: MemoryJournal | None = None) -> None:
        stored = list(previous.trials.values()) if previous else []
        events = [(k, m) for k, m, _d in previous.events] if previous else []
        super().__init__(runner, stored, events)
        self.trials: dict[int, StoredTrial] = {t.n: t for t in stored}
        self.events: list[tuple[str, str, dict]] = list(previous.events) if previous else []
        self.phases: list[tuple[str, float | None]] = []

    def trial_starting(self, n: int, request: TrialRequest) -> None:
        pass

    def save_trial(self, trial: StoredTrial) -> None:
        self.trials[trial.n] = trial

    def set_verdict(self, n: int, verdict: str, reason: str) -> None:
        old = self.trials[n]
        self.trials[n] = StoredTrial(n, old.request, old.result, verdict, reason)

    def save_event(self, kind: str, message: str, data: dict[str, Any]) -> None:
        self.events.append((kind, message, data))

    def forget_from(self, n: int) -> None:
        self.trials = {k: v for k, v in self.trials.items() if k < n}

    def progress(self, phase: str, eta_s: float | None) -> None:
        self.phases.append((phase, eta_s))

    def verdicts(self) -> list[tuple[int, str, str | None]]:
        """(n, verdict, change key) of every trial in order."""
        return [
            (t.n, t.verdict, t.request.change.key if t.request.change else None)
            for t in sorted(self.trials.values(), key=lambda t: t.n)
        ]


class FakeRunner:
    """Stands in for EngineTrialRunner inside the daemon: trials from a FakeEngine.

    With `block_at`, that trial waits until the run is cancelled (or the daemon stops), as a
    real trial's engine would be stopped.
    """

    def __init__(
        self,
        engine: FakeEngine,
        block_at: int | None,
        model: str,
        workload: Any,
        logs_dir: Path,
        cancel: threading.Event,
        **_options: Any,
    ) -> None:
        self.engine = engine
        self.block_at = block_at
        self.cancel = cancel
        self.blocked = threading.Event()

    def run(self, request: TrialRequest, log_name: str, on_started: Any = None) -> TrialResult:
        n = int(log_name.rsplit("-", 1)[1])
        if n == self.block_at:
            self.blocked.set()
            self.cancel.wait(60)
            raise Cancelled()
        return self.engine(request, n)
