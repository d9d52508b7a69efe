"""Background jobs (measuring hardware, writing the demo model) with progress a client can poll."""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.text import Text, error_text, text_fields, texts_fields
from .store import iso_time


class JobError(RuntimeError):
    """A job failed for a reason the user can act on; its message (a Text) is shown as is."""


@dataclass(slots=True)
class Job:
    """One background task: its progress lines (the last 200), outcome and times.

    A line is a Text (engine/text.py) when the daemon says it, a string when a program it runs
    printed it."""

    id: int
    kind: str
    status: str = "running"  # running, done, failed
    lines: deque[Text | str] = field(default_factory=lambda: deque(maxlen=200))
    started: float = field(default_factory=time.time)
    finished: float | None = None
    error: Text | str | None = None
    result: Any = None

    def progress(self, line: Text | str) -> None:
        self.lines.append(line.rstrip() if isinstance(line, str) else line)

    @property
    def running(self) -> bool:
        return self.status == "running"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "status": self.status,
            **texts_fields("lines", list(self.lines)),
            "started": iso_time(self.started),
            "finished": iso_time(self.finished),
            **text_fields("error", self.error),
            "result": self.result,
        }


class Jobs:
    """The jobs of this daemon process (they do not outlive it), newest last."""

    def __init__(self, keep: int = 50) -> None:
        self._jobs: deque[Job] = deque(maxlen=keep)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def start(self, kind: str, work: Callable[[Job], Any]) -> Job:
        """Run `work(job)` on a thread; its return value becomes the job's result."""
        with self._lock:
            job = Job(next(self._ids), kind)
            self._jobs.append(job)
        threading.Thread(
            target=self._run, args=(job, work), name=f"job-{kind}", daemon=True
        ).start()
        return job

    def start_unless_running(self, kind: str, work: Callable[[Job], Any]) -> tuple[Job, bool]:
        """The running job of this kind if there is one (False), else a new one (True)."""
        with self._lock:
            current = self._latest_locked(kind)
            if current is not None and current.running:
                return current, False
        return self.start(kind, work), True

    def _run(self, job: Job, work: Callable[[Job], Any]) -> None:
        try:
            job.result = work(job)
            job.status = "done"
        except JobError as err:
            job.error = error_text(err)
            job.status = "failed"
        except Exception as err:  # a bug, not a user error: keep the trace for the report
            job.error = f"{type(err).__name__}: {err}"
            job.progress(traceback.format_exc())
            job.status = "failed"
        finally:
            job.finished = time.time()

    def get(self, job_id: int) -> Job | None:
        with self._lock:
            return next((j for j in self._jobs if j.id == job_id), None)

    def latest(self, kind: str) -> Job | None:
        with self._lock:
            return self._latest_locked(kind)

    def _latest_locked(self, kind: str) -> Job | None:
        return next((j for j in reversed(self._jobs) if j.kind == kind), None)

    def wait(self, job: Job, timeout_s: float) -> bool:
        """Block until the job ends (for tests and shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while job.running and time.monotonic() < deadline:
            time.sleep(0.05)
        return not job.running
