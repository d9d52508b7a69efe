"""A run's record of trials: numbered, stored as they land, replayed when a run is resumed.

The search is deterministic given its plan and the figures its trials return, so resuming a run
means running the search again from the start while the journal hands back the trials already
stored instead of starting engines for them. Only the trials after the last stored one run. A
stored trial is handed back only when it ran what the search asks for now: the same role, flags
and workload (the workload sized by a replayed calibration trial is the same one again).
Events are stored once: a resumed search that says the same thing again is not repeated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.text import Text
from .flagset import same_flags
from .trial_record import Cancelled, TrialRequest, TrialResult

# provisional verdicts: a candidate waits for its confirmation, a context tier for its judgement
PROVISIONAL = {
    "calibration": "calibration",
    "baseline": "base",
    "candidate": "pending",
    "confirm": "confirm",
    "context": "pending",
}


@dataclass(frozen=True, slots=True)
class StoredTrial:
    """A trial as the journal keeps it."""

    n: int
    request: TrialRequest
    result: TrialResult
    verdict: str
    reason: Text | str = ""


class Journal(ABC):
    """Numbers trials, replays stored ones, runs and stores the rest; subclasses keep the records.

    `runner(request, n)` runs trial n for real.
    """

    def __init__(
        self,
        runner: Callable[[TrialRequest, int], TrialResult],
        stored: list[StoredTrial] | None = None,
        stored_events: list[tuple[str, str]] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        self.runner = runner
        self.stored = sorted(stored or [], key=lambda t: t.n)
        self._said = {(kind, str(message)) for kind, message in stored_events or []}
        self.cancelled = cancelled
        self.next_n = 1
        self.replayed = 0

    def run_trial(self, request: TrialRequest) -> tuple[int, TrialResult]:
        """Trial number n of the run: the stored one when it asked the same, else a real run."""
        n = self.next_n
        self.next_n += 1
        if self.stored and self.stored[0].n == n:
            kept = self.stored.pop(0)
            if (
                kept.request.role == request.role
                and same_flags(list(kept.request.flags), list(request.flags))
                and kept.result.workload == request.workload
            ):
                self.replayed += 1
                return n, kept.result
            # the search took another path than the stored run (a changed plan, a workload
            # sized otherwise by a newer version): forget the rest
            self.forget_from(n)
            self.stored = []
        if self.cancelled():
            raise Cancelled()
        self.trial_starting(n, request)
        result = self.runner(request, n)
        verdict = "failed" if not result.ok else PROVISIONAL[request.role]
        self.save_trial(StoredTrial(n, request, result, verdict, result.error or ""))
        return n, result

    @property
    def replaying(self) -> bool:
        """Whether stored trials are still being handed back (no time passes between them)."""
        return bool(self.stored)

    def event(self, kind: str, message: Text, **data: Any) -> None:
        """Record a line of the run's story, once (stored events are known by their English)."""
        if (kind, str(message)) in self._said:
            return
        self._said.add((kind, str(message)))
        self.save_event(kind, message, data)

    # ---- what subclasses keep ---------------------------------------------------------------

    @abstractmethod
    def trial_starting(self, n: int, request: TrialRequest) -> None:
        """Trial n is about to start its engine (for live progress)."""

    @abstractmethod
    def save_trial(self, trial: StoredTrial) -> None:
        """Store a trial that just ran, with its provisional verdict."""

    @abstractmethod
    def set_verdict(self, n: int, verdict: str, reason: Text) -> None:
        """Store trial n's final verdict and the measured reason for it."""

    @abstractmethod
    def save_event(self, kind: str, message: Text, data: dict[str, Any]) -> None:
        """Store a line of the run's story."""

    @abstractmethod
    def forget_from(self, n: int) -> None:
        """Delete stored trials numbered n and later."""

    @abstractmethod
    def progress(self, phase: str, eta_s: float | None) -> None:
        """The run's phase and its estimated time left."""
