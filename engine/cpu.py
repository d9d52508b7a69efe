"""The CPU side of the miss split: the expert executor's threads and the two measured rates.

Bp is the rate of copying one expert from the host bank into a device slot; Bh is the rate at which
the CPU executor runs one expert for one token (weight bytes read per second). Their ratio decides
how many of a step's misses are fetched (`engine/moe.py`). Measured at start (when no profile from
`moelab bench bw` exists) as the best of several samples: a start-up measurement shares the machine
with loading, and a median was once a tenth of the real rate on the H200 host.
"""

from __future__ import annotations

import logging
import time

import torch

from ..kernels.cpu_experts import DEFAULT_TASK_KB, CpuExpertRunner
from .args import default_cpu_threads
from .bank import ExpertBank

log = logging.getLogger("moelab.cpu")


def start_cpu_executor(
    threads: int | None, kernel: str, spin_us: int = 1000, task_kb: int = DEFAULT_TASK_KB
) -> CpuExpertRunner:
    """Persistent CPU expert workers; `kernel` auto falls back to torch when native cannot build."""
    threads = threads or default_cpu_threads()
    runner = CpuExpertRunner(threads, kernel, spin_us=spin_us, task_kb=task_kb)
    log.info("CPU experts: %d threads, %s kernel", threads, runner.kernel)
    return runner


def measure_bp_gbps(bank: ExpertBank, device: torch.device, samples: int = 10) -> float:
    """Host-to-device rate for one expert (its two tensors), from the bank's own memory."""
    w13 = torch.empty_like(bank.w13[0][0], device=device)
    w2 = torch.empty_like(bank.w2[0][0], device=device)
    times = []
    for i in range(samples + 1):
        layer, expert = i % bank.num_layers, (7 * i) % bank.num_experts
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        w13.copy_(bank.w13[layer][expert], non_blocking=True)
        w2.copy_(bank.w2[layer][expert], non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first copy pays for first touches
            times.append(time.perf_counter() - t0)
    return bank.expert_bytes / min(times) / 1e9


def measure_bh_gbps(runner: CpuExpertRunner, bank: ExpertBank, samples: int = 10) -> float:
    """CPU expert rate (weight bytes per second) for one token through up to 4 experts at once,
    as a decode step hands its CPU share over."""
    hidden = bank.w13[0].shape[2]
    k = min(4, bank.num_experts)
    x = torch.randn(1, hidden)
    tokens = torch.zeros(k, dtype=torch.int32)
    weights = torch.full((k,), 1.0 / k)
    times = []
    for i in range(samples + 1):
        layer = i % bank.num_layers
        ids = (torch.arange(k, dtype=torch.int32) + 3 * i) % bank.num_experts
        t0 = time.perf_counter()
        runner.run(x, bank.w13[layer], bank.w2[layer], ids, tokens, weights)
        if i:
            times.append(time.perf_counter() - t0)
    return k * bank.expert_bytes / min(times) / 1e9
