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

from . import moe_kernels
from .bank import ExpertBank
from .cache import SCALE_INV


class PrefillStream:
    """The two-layer buffer and the copies into it; `run` computes one layer of a long chunk."""

    def __init__(
        self,
        bank: ExpertBank,
        device: torch.device,
        copy_stream: torch.cuda.Stream | None,
        compute_stream: torch.cuda.Stream | None,
        *,
        overlap: bool,
    ) -> None:
        self.bank = bank
        self.device = device
        self.copy_stream = copy_stream
        self.compute_stream = compute_stream
        self.overlap = overlap  # copy layer l+1 while layer l computes
        # per buffer: the layer's tensors as the bank holds them (`ExpertBank.layer_tensors`)
        self._buffers: list[list[torch.Tensor]] = []
        self._staged: dict[int, tuple[int, object]] = {}  # moe layer -> (buffer, ready event)
        self._buffer_free: list[object | None] = [None, None]  # event: compute done reading it

    @staticmethod
    def buffer_bytes(bank: ExpertBank) -> int:
        return 2 * bank.num_experts * bank.expert_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the two-layer buffer while allocated."""
        return sum(t.nbytes for buffer in self._buffers for t in buffer)

    @property
    def allocated(self) -> bool:
        return bool(self._buffers)

    def allocate(self) -> None:
        dev = self.device
        self._buffers = [
            [torch.empty(t.shape, dtype=t.dtype, device=dev) for t in self.bank.layer_tensors(0)]
            for _ in range(2)
        ]

    def release(self) -> None:
        self._buffers = []
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
        w13, w2, *extra = self._buffers[buffer]
        args = self._kernel_args(extra)
        out = moe_kernels.prefill(x, ids, weights, w13, w2, checked=False, **args)
        if self.copy_stream is not None:
            done = torch.cuda.Event()
            done.record(self.compute_stream)
            self._buffer_free[buffer] = done
        return out

    def _kernel_args(self, extra: list[torch.Tensor]) -> dict[str, torch.Tensor | float]:
        """A buffer's tensors past w13 and w2 (an FP8 bank's factors or an MXFP4 or NVFP4 one's
        scales, NVFP4's per-tensor ones, then any biases) named as moe_kernels.prefill takes
        them, with the bank's SwiGLU limit."""
        bank = self.bank
        scales = list(SCALE_INV) if bank.fmt == "fp8" else ["w13_scale", "w2_scale"]
        names = (
            (scales if bank.w13_scale else [])
            + (["w13_scale_2", "w2_scale_2"] if bank.w13_scale_2 else [])
            + (["w13_bias", "w2_bias"] if bank.w13_bias else [])
        )
        args: dict[str, torch.Tensor | float] = dict(zip(names, extra, strict=True))
        if bank.swiglu_limit:
            args["swiglu_limit"] = bank.swiglu_limit
        return args

    def _stage(self, moe_layer: int) -> None:
        """Start copying a whole layer's experts into the buffer not in use."""
        buffer = moe_layer % 2
        pairs = zip(self._buffers[buffer], self.bank.layer_tensors(moe_layer), strict=True)
        if self.copy_stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            self._staged[moe_layer] = (buffer, None)
            return
        with torch.cuda.stream(self.copy_stream):
            if self._buffer_free[buffer] is not None:
                self.copy_stream.wait_event(self._buffer_free[buffer])
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
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
