"""What a trial is asked to run and what it measured: the records the search, the journal, the
workload's sizing and the daemon's store pass around (autotune/trial.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.text import Text
from .flagset import Change
from .workload import ContextProof, WorkloadSpec

FAILURES = {  # a failed trial's kind, in words
    "crash": Text("crash"),
    "out of memory": Text("out of memory"),
    "killed by signal 9": Text("killed by signal {signal}", signal=9),
    "timeout": Text("timeout"),
    "error": Text("error"),
}
ROLES = ("calibration", "baseline", "candidate", "confirm", "context")


class Cancelled(Exception):
    """The run was cancelled (or the daemon is stopping) during a trial; its engine is stopped."""


@dataclass(frozen=True, slots=True)
class TrialRequest:
    """What a trial runs: the flags, the one change they carry, why, a context to prove, and the
    workload (None: the runner's own, the mode's minimum).

    A calibration trial with `target_s` runs `workload` and then the stages sized from it for
    that target, in the same engine (autotune/sizing.py: calibrate).
    """

    flags: tuple[str, ...]
    change: Change | None
    role: str
    context_tokens: int | None = None
    workload: WorkloadSpec | None = None
    target_s: float | None = None

    def __post_init__(self) -> None:
        assert self.role in ROLES, self.role


@dataclass(frozen=True, slots=True)
class TrialResult:
    """What one trial measured, or how it failed."""

    ok: bool
    started: float
    duration_s: float
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    aggregate_tok_s: float | None = None
    agent_tok_s: float | None = None
    ttft_s: float | None = None
    hit_rate: float | None = None
    usable_context: int | None = None
    context_proof: ContextProof | None = None
    engine_pid: int | None = None
    startup_s: float | None = None
    warmup_s: float | None = None
    stop_s: float | None = None
    failure: str | None = None  # "crash", "out of memory", "killed by signal 9", "timeout", "error"
    error: Text | str | None = None
    log_tail: str | None = None
    stats: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def overhead_s(self) -> float:
        """Restart and warm-up: the time a trial spends on anything but the workload."""
        return (self.startup_s or 0.0) + (self.warmup_s or 0.0) + (self.stop_s or 0.0)

    @property
    def workload_s(self) -> float | None:
        """Seconds the measured workload took (kept in `details`, which every store keeps)."""
        return self.details.get("workload_s")

    @property
    def workload(self) -> WorkloadSpec | None:
        """The workload this trial was asked to run, as it recorded it."""
        spec = self.details.get("workload")
        return WorkloadSpec.from_json(spec) if spec else None

    def figure(self, name: str) -> float | None:
        return getattr(self, f"{name}_tok_s")

    @property
    def why_failed(self) -> Text:
        """The failure in words: its kind and the error."""
        failure = self.failure or "error"
        return Text(
            "{failure}: {error}", failure=FAILURES.get(failure, failure), error=self.error or ""
        )
