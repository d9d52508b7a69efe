"""Routings that come while the native planner waits for them, as a GPU's do, with no timer.

On the CPU the stand-in pieces have stored their routing (and its guess) before the planner's wait
begins. `LateRouting` takes the routing's signal back (`arm`) and sets it again from the stand-in
stream query (`query`, the planner's cuStreamQuery, which its wait asks every 128 polls), so that a
guess stored ahead of the routing is always seen first and planned in the wait. The wait's clock
(`clock`, given to `DecodePlanner.set_clock`) moves 1 µs a reading and `late_s` more as the
routing comes: a guess's lead over the routing is late_s (and the few µs of readings) on any
machine, however busy.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from moelab.engine.experts.h2d import QUERY_FUNCTION, address_of
from moelab.kernels.host_handoff import ROUTED

CLOCK_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_double)
NOT_READY = 600  # CUDA_ERROR_NOT_READY: the stream is busy, the signals decide
TICK_S = 1e-6  # the wait's clock between two readings


class LateRouting:
    """The device's side of the wait: `arm(signal)` takes a routing's signal back, and the next
    call of `query` sets it, `late_s` after by `clock`."""

    def __init__(self, late_s: float) -> None:
        self.late_s = late_s
        self.now_s = 0.0
        self.arrivals = 0  # routings that came late
        self._signal: torch.Tensor | np.ndarray | None = None
        self.query = QUERY_FUNCTION(self._query)
        self.clock = CLOCK_FUNCTION(self._clock)

    def arm(self, signal: torch.Tensor | np.ndarray) -> None:
        """The routing whose signal this is comes at the wait's next query of the stream."""
        signal[0] = 0
        self._signal = signal

    def come(self, after_s: float | None = None) -> None:
        """The armed routing comes now (its signal set), `after_s` (default late_s) after by the
        clock; once."""
        if self._signal is None:
            return
        self.now_s += self.late_s if after_s is None else after_s
        self._signal[0] = ROUTED
        self._signal = None
        self.arrivals += 1

    def set_clock_of(self, planner) -> None:
        """Makes this the clock of the native planner's wait."""
        planner.set_clock(address_of(self.clock))

    def _query(self, stream: int) -> int:
        self.come()
        return NOT_READY

    def _clock(self) -> float:
        self.now_s += TICK_S
        return self.now_s
