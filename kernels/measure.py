"""Timing and ceilings for the kernel bench: CUDA events and graphs, copy and matmul rates.

A Result holds one measured call and derives its GB/s and TFLOP/s and their shares of the ceilings.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True, slots=True)
class Result:
    """One measured kernel call: its time, the bytes and flops it needs, the reference's time."""

    kernel: str
    shape: str
    time_us: float
    bytes_moved: int
    flops: int
    ref_us: float | None
    copy_gbps: float
    matmul_tflops: float

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.time_us / 1e3

    @property
    def tflops(self) -> float:
        return self.flops / self.time_us / 1e6

    @property
    def bw_share(self) -> float:
        return self.gbps / self.copy_gbps

    @property
    def mm_share(self) -> float:
        return self.tflops / self.matmul_tflops

    def to_json(self) -> dict[str, object]:
        derived = {
            "gbps": self.gbps,
            "tflops": self.tflops,
            "bw_share": self.bw_share,
            "mm_share": self.mm_share,
        }
        return {**asdict(self), **derived}


def median_event_us(fn: Callable[[], object], iters: int) -> float:
    """Median over iters of one call timed with CUDA events (after one warm-up call)."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_us_per_call(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Capture every call once in one CUDA graph; median replay time divided by the calls."""
    for call in calls:
        call()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_event_us(graph.replay, replays) / len(calls)


def eager_us_per_call(calls: Sequence[Callable[[], object]], rounds: int = 3) -> float:
    """Median time of a round over all the calls, eagerly, divided by the calls."""

    def one_round() -> None:
        for call in calls:
            call()

    return median_event_us(one_round, rounds) / len(calls)


def measure_copy_gbps() -> float:
    """Device-to-device copy rate of a 2 GiB buffer, counting the read and the write."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    us = median_event_us(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * src.element_size() / us / 1e3


def measure_matmul_tflops() -> float:
    """bf16 matmul rate of an 8192^3 product."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = median_event_us(lambda: a @ b, 10)
    return 2 * 8192**3 / us / 1e6
