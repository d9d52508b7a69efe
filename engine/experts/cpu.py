"""The CPU side of the miss split: the expert executor's threads and the two measured rates.

Bp is the rate of copying one expert from the host bank into a device slot; Bh is the rate at which
the CPU executor runs one expert for one token (weight bytes read per second). Their ratio decides
how many of a step's misses are fetched (`engine/experts/moe.py`). Measured at start (when no
profile from `moelab bench bw` exists) as the best of several samples: a start-up measurement
shares the machine with loading, which can slow most samples to a small fraction of the real rate.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ...kernels.cpu_experts import (
    DEFAULT_REDO_US,
    DEFAULT_TASK_KB,
    CpuExpertRunner,
    process_thread_ids,
)
from ..config.args import default_cpu_threads
from .bank import ExpertBank

log = logging.getLogger("moelab.cpu")


def plan_worker_cpus(
    threads: int, allowed: Sequence[int], core_of: Mapping[int, object]
) -> list[int]:
    """One logical CPU per worker, each on a physical core of its own, none on the first core
    (left to the thread that feeds the GPU, and to the rest of the process); [] where the allowed
    CPUs have fewer cores than threads + 1 (the OS then places the workers).

    allowed: the logical CPUs this process may use; core_of: each one's physical core (any key
    that is equal for the logical CPUs of one core).
    """
    cores: dict[object, int] = {}
    for cpu in sorted(allowed):
        cores.setdefault(core_of.get(cpu, ("cpu", cpu)), cpu)
    firsts = list(cores.values())
    return firsts[1 : threads + 1] if len(firsts) > threads else []


def _core_of(cpu: int) -> tuple[str, str]:
    """The (package, core) of a logical CPU, from Linux's sysfs; the CPU itself if not there."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (
            (topology / "physical_package_id").read_text().strip(),
            (topology / "core_id").read_text().strip(),
        )
    except OSError:
        return ("cpu", str(cpu))


def spare_cpus(
    allowed: Sequence[int], core_of: Mapping[int, object], workers: Sequence[int]
) -> list[int]:
    """The allowed logical CPUs on cores that hold no worker (keys as in plan_worker_cpus)."""
    taken = {core_of.get(cpu, ("cpu", cpu)) for cpu in workers}
    return [cpu for cpu in sorted(allowed) if core_of.get(cpu, ("cpu", cpu)) not in taken]


def _allowed_cpus() -> dict[int, tuple[str, str]]:
    """The logical CPUs this thread may use, each with its physical core ({} off Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return {}
    return {cpu: _core_of(cpu) for cpu in sorted(os.sched_getaffinity(0))}


def worker_cpus(threads: int) -> list[int]:
    """This machine's placement for `threads` CPU expert workers (plan_worker_cpus)."""
    allowed = _allowed_cpus()
    return plan_worker_cpus(threads, list(allowed), allowed) if allowed else []


class ProcessPlacement:
    """`--moe-cpu-pin isolate`: every thread of this process but the CPU expert workers kept on
    the cores the workers leave, so that none of them (the thread feeding the GPU, the driver's,
    the server's) takes a worker's core for a while, and no job waits on a worker the OS set
    aside. restore() puts back each thread's earlier CPUs; threads started meanwhile by a kept
    thread were born with its CPUs and keep them.
    """

    def __init__(self, cpus: Sequence[int], keep_off: Sequence[int]) -> None:
        self.cpus = list(cpus)
        self._saved: dict[int, set[int]] = {}
        for tid in sorted(process_thread_ids() - set(keep_off)):
            try:
                self._saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, self.cpus)
            except OSError:  # the thread ended meanwhile
                self._saved.pop(tid, None)

    @classmethod
    def around(cls, runner: CpuExpertRunner) -> ProcessPlacement | None:
        """The rest of the process kept off `runner`'s pinned workers' cores; None where the
        workers are not pinned or leave no core."""
        allowed = _allowed_cpus()
        if not runner.cpus or not allowed:
            return None
        spare = spare_cpus(list(allowed), allowed, runner.cpus)
        if not spare:
            return None
        placement = cls(spare, runner.thread_ids)
        log.info(
            "the rest of the process (%d threads) kept on CPUs %s",
            len(placement._saved),
            cpu_ranges(spare),
        )
        return placement

    def restore(self) -> None:
        """Each moved thread back on the CPUs it had (those that still run)."""
        for tid, cpus in self._saved.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass
        self._saved = {}


def start_cpu_executor(
    threads: int | None,
    kernel: str,
    spin_us: int = 1000,
    task_kb: int = DEFAULT_TASK_KB,
    pin: bool = True,
    redo_us: int = DEFAULT_REDO_US,
) -> CpuExpertRunner:
    """Persistent CPU expert workers; `kernel` auto falls back to torch when native cannot build.

    pin: keep each worker on a core of its own and off the first core (worker_cpus), where the
    machine has a core more than threads: unpinned, the OS may put a spinning worker on the core of
    another worker or of the thread that feeds the GPU for a while, slowing both.
    """
    threads = threads or default_cpu_threads()
    cpus = worker_cpus(threads) if pin and kernel != "torch" else []
    runner = CpuExpertRunner(
        threads, kernel, spin_us=spin_us, task_kb=task_kb, cpus=cpus or None, redo_us=redo_us
    )
    where = f"pinned to CPUs {cpu_ranges(runner.cpus)}" if runner.cpus else "unpinned"
    log.info("CPU experts: %d threads, %s, %s kernel%s", threads, where, runner.kernel,
             code_path(runner))  # fmt: skip
    return runner


def code_path(runner: CpuExpertRunner) -> str:
    """The native kernel's SIMD path as the start's log line gives it: " (avx2)", " (avx512,
    bf16 dot products)"; nothing for the torch kernel."""
    if runner.kernel != "native":
        return ""
    return f" ({runner.simd}{', bf16 dot products' if runner.bf16_dot else ''})"


def cpu_ranges(cpus: Sequence[int]) -> str:
    """CPU numbers as Linux writes them: [1, 2, 3, 5] -> '1-3,5'."""
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def measure_bp_gbps(bank: ExpertBank, device: torch.device, samples: int = 10) -> float:
    """Host-to-device rate for one expert (its two tensors, and an FP8 bank's factors), from the
    bank's own memory."""
    slots = [torch.empty_like(t[0], device=device) for t in bank.layer_tensors(0)]
    times = []
    for i in range(samples + 1):
        layer, expert = i % bank.num_layers, (7 * i) % bank.num_experts
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for slot, src in zip(slots, bank.layer_tensors(layer), strict=True):
            slot.copy_(src[expert], non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first copy pays for first touches
            times.append(time.perf_counter() - t0)
    return bank.expert_bytes / min(times) / 1e9


def measure_device_gbps(device: torch.device, nbytes: int = 256 * 2**20, samples: int = 5) -> float:
    """A GPU's memory rate: a copy within it of `nbytes`, read and write counted (what a decode
    step's dense work reads its weights at, to a first approximation)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(samples + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        if i:  # the first copy pays for first touches
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times) / 1e9


def measure_bh_gbps(runner: CpuExpertRunner, bank: ExpertBank, samples: int = 10) -> float:
    """CPU expert rate (weight bytes per second) for one token through up to 4 experts at once,
    as a decode step hands its CPU share over."""
    hidden = bank.hidden_size
    k = min(4, bank.num_experts)
    x = torch.randn(1, hidden)
    tokens = torch.zeros(k, dtype=torch.int32)
    weights = torch.full((k,), 1.0 / k)
    times = []
    for i in range(samples + 1):
        layer = i % bank.num_layers
        ids = (torch.arange(k, dtype=torch.int32) + 3 * i) % bank.num_experts
        t0 = time.perf_counter()
        w13, w2 = bank.w13[layer], bank.w2[layer]
        runner.run(x, w13, w2, ids, tokens, weights, **bank.cpu_args(layer))
        if i:
            times.append(time.perf_counter() - t0)
    return k * bank.expert_bytes / min(times) / 1e9
