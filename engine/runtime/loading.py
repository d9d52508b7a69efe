"""Where a loading engine stands: its start-up phase and the expert bytes loaded (/health)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class LoadProgress:
    """Written by the loading thread, read by /health: plain attributes, each set in one store.

    phase: the start-up phase running (Engine's, e.g. "expert bank", or the native kernel's build:
    kernels/native_build.py COMPILING and WAITING); build_holder_pid: while WAITING, the process
    that builds. The timings of the phases that ended go to `startup_s`.
    """

    phase: str = "starting"
    loaded_bytes: int = 0
    total_bytes: int = 0
    build_holder_pid: int | None = None
    startup_s: dict[str, float] = field(default_factory=dict)
    _engine_phase: str | None = None
    _phase_began_s: float = field(default_factory=time.perf_counter)

    def begin(self, name: str | None) -> None:
        """Ends the engine's phase in progress, timing it, and begins `name` (None: all done)."""
        now = time.perf_counter()
        if self._engine_phase is not None:
            self.startup_s[self._engine_phase] = now - self._phase_began_s
        self._engine_phase, self._phase_began_s = name, now
        if name is not None:
            self.phase, self.build_holder_pid = name, None

    def build(self, phase: str, holder_pid: int | None) -> None:
        """The native kernel's build reports a phase of its own (within the engine's)."""
        self.phase, self.build_holder_pid = phase, holder_pid

    def bytes(self, done: int, total: int) -> None:
        self.loaded_bytes, self.total_bytes = done, total

    def to_json(self) -> dict:
        body: dict = {
            "phase": self.phase,
            "loaded_bytes": self.loaded_bytes,
            "total_bytes": self.total_bytes,
        }
        if self.build_holder_pid is not None:
            body["build_holder_pid"] = self.build_holder_pid
        return body
