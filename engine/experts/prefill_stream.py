"""Prefill streaming: a long chunk's MoE layers run from a two-layer device buffer.

A chunk long enough to route to most of a layer's experts would miss in the cache anyway; instead
each layer's experts are copied whole into one of two buffers on the copy stream, layer l+1's
while layer l computes (l+1's routing is not known yet, so the whole layer is the only choice).
The cache is left alone. Short chunks route first and treat their misses as decode does
(engine/experts/moe.py).
"""

from __future__ import annotations

import math

import torch

from ...kernels.grouped_moe import grouped_moe
from .bank import ExpertBank


class PrefillStream:
    """The two-layer buffer and the copies into it; `run` computes one layer of a long chunk."""

    def __init__(
        self,
        bank: ExpertBank,
        dtype: torch.dtype,
        device: torch.device,
        copy_stream: torch.cuda.Stream | None,
        compute_stream: torch.cuda.Stream | None,
        *,
        overlap: bool,
    ) -> None:
        self.bank = bank
        self.dtype = dtype
        self.device = device
        self.copy_stream = copy_stream
        self.compute_stream = compute_stream
        self.overlap = overlap  # copy layer l+1 while layer l computes
        self._w13: list[torch.Tensor] = []
        self._w2: list[torch.Tensor] = []
        self._staged: dict[int, tuple[int, object]] = {}  # moe layer -> (buffer, ready event)
        self._buffer_free: list[object | None] = [None, None]  # event: compute done reading it

    @staticmethod
    def buffer_bytes(bank: ExpertBank) -> int:
        return 2 * bank.num_experts * bank.expert_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the two-layer buffer while allocated."""
        return sum(t.nbytes for t in self._w13 + self._w2)

    @property
    def allocated(self) -> bool:
        return bool(self._w13)

    def allocate(self) -> None:
        e = self.bank.num_experts
        shape13 = (e, *self.bank.w13[0].shape[1:])
        shape2 = (e, *self.bank.w2[0].shape[1:])
        self._w13 = [torch.empty(shape13, dtype=self.dtype, device=self.device) for _ in range(2)]
        self._w2 = [torch.empty(shape2, dtype=self.dtype, device=self.device) for _ in range(2)]

    def release(self) -> None:
        self._w13, self._w2 = [], []
        self._staged.clear()
        self._buffer_free = [None, None]

    def reset(self) -> None:
        """Forget staged layers (a prefill chunk ended early or the step failed)."""
        self._staged.clear()

    def run(self, moe_layer: int, x, ids, weights) -> torch.Tensor:
        """A long prefill chunk's layer: the whole layer from the two-layer buffer."""
        if moe_layer not in self._staged:
            self._stage(moe_layer)
        if self.overlap and moe_layer + 1 < self.bank.num_layers:
            self._stage(moe_layer + 1)
        buffer, ready = self._staged.pop(moe_layer)
        if ready is not None:
            self.compute_stream.wait_event(ready)
        # the router's ids name this layer's experts, the buffer's: no check (a host sync)
        out = grouped_moe(x, ids, weights, self._w13[buffer], self._w2[buffer], checked=False)
        if self.copy_stream is not None:
            done = torch.cuda.Event()
            done.record(self.compute_stream)
            self._buffer_free[buffer] = done
        return out

    def _stage(self, moe_layer: int) -> None:
        """Start copying a whole layer's experts into the buffer not in use."""
        buffer = moe_layer % 2
        if self.copy_stream is None:
            self._w13[buffer].copy_(self.bank.w13[moe_layer])
            self._w2[buffer].copy_(self.bank.w2[moe_layer])
            self._staged[moe_layer] = (buffer, None)
            return
        with torch.cuda.stream(self.copy_stream):
            if self._buffer_free[buffer] is not None:
                self.copy_stream.wait_event(self._buffer_free[buffer])
            self._w13[buffer].copy_(self.bank.w13[moe_layer], non_blocking=True)
            self._w2[buffer].copy_(self.bank.w2[moe_layer], non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(self.copy_stream)
        self._staged[moe_layer] = (buffer, ready)


def expected_unique_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """Experts a chunk of `tokens` routes to under uniform routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def stream_threshold_tokens(num_experts: int, top_k: int, share: float = 0.5) -> int:
    """Fewest tokens whose chunk is expected to need `share` of a layer's experts."""
    if top_k >= num_experts:
        return 1
    return max(1, math.ceil(math.log(1 - share) / math.log(1 - top_k / num_experts)))
