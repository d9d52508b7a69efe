"""Instruments around a timed run of the decode benchmark: what the host did besides the run
(hypervisor steal, interrupts, the waits of the thread that feeds the GPU and of the CPU expert
workers, the busiest other threads and processes), the cycle collector's pauses, the caching
allocators' trips to the driver, and the steps' durations with their stalls.

A run whose host stages are slow for no reason of its own shows it here; the engine never uses
these.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import psutil
import torch

from ...kernels.cpu_experts import process_thread_ids


def host_snapshot() -> dict:
    """What host_disturbance compares: the CPUs' ticks, the feeding thread's switches, this
    process's threads' CPU and wait times, the other processes' CPU times."""
    return {
        "ticks": _cpu_ticks(),
        "switches": _thread_switches(),
        "threads": _thread_times(),
        "procs": _process_times(),
    }


def host_disturbance(
    before: dict, after: dict, feeder: int | None = None, workers: Sequence[int] = ()
) -> dict | None:
    """What else the host did during a timed run, from two host_snapshot()s taken around it: the
    share of the CPUs' time the hypervisor took (steal), the busiest CPU's share spent on
    interrupts, the switches of the thread that feeds the GPU (`feeder`, this thread), how long it
    and the slowest CPU expert worker (`workers`: thread ids) waited for a CPU while runnable,
    and which other threads of this process and which other processes ran the most."""
    ticks0, ticks1 = before.get("ticks"), after.get("ticks")
    if not ticks0 or not ticks1:
        return None
    steal = total = 0
    irq_share = {}
    for cpu, t1 in ticks1.items():
        delta = {k: t1[k] - ticks0.get(cpu, t1).get(k, 0) for k in t1}
        cpu_total = sum(delta.values())
        steal += delta.get("steal", 0)
        total += cpu_total
        if cpu_total:
            irq_share[cpu] = (delta.get("irq", 0) + delta.get("softirq", 0)) / cpu_total
    busiest = max(irq_share, key=irq_share.get, default=None)
    out = {
        "steal_share": steal / total if total else 0.0,
        "irq_busiest_cpu": busiest,
        "irq_busiest_share": irq_share.get(busiest, 0.0),
    }
    switches0, switches1 = before.get("switches"), after.get("switches")
    if switches0 is not None and switches1 is not None:
        out["feeder_switches"] = switches1[0] - switches0[0]
        out["feeder_preemptions"] = switches1[1] - switches0[1]
    threads0, threads1 = before.get("threads") or {}, after.get("threads") or {}
    both = threads0.keys() & threads1.keys()
    if any(threads1[tid][1] != threads0[tid][1] for tid in both):  # a kernel that keeps schedstat
        waited = {tid: (threads1[tid][2] - threads0[tid][2]) / 1e6 for tid in both}
        if feeder in both:
            out["feeder_wait_ms"] = waited[feeder]
        worker_waits = [waited[tid] for tid in workers if tid in both]
        if worker_waits:
            out["worker_wait_ms_max"] = max(worker_waits)
        others: dict[str, float] = {}
        for tid in both - {feeder, *workers}:
            name = f"{threads1[tid][0]}/{tid}"
            others[name] = (threads1[tid][1] - threads0[tid][1]) / 1e6
        out["busiest_threads"] = _busiest(others)
    procs0, procs1 = before.get("procs") or {}, after.get("procs") or {}
    if procs1:
        out["busiest_processes"] = _busiest(
            {
                f"{procs1[pid][0]}/{pid}": 1e3 * (procs1[pid][1] - procs0[pid][1])
                for pid in procs0.keys() & procs1.keys()
            }
        )
    return out


def _cpu_ticks() -> dict[str, dict[str, float]]:
    """Each CPU's seconds by kind (user, idle, irq, steal, ... as the OS has them); guest time is
    left out, Linux counts it in user time already."""
    return {
        f"cpu{i}": {k: v for k, v in t._asdict().items() if not k.startswith("guest")}
        for i, t in enumerate(psutil.cpu_times(percpu=True))
    }


def _thread_switches() -> tuple[int, int] | None:
    """This thread's voluntary and involuntary context switches so far (None where unknown)."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (ImportError, AttributeError, OSError):
        return None
    return usage.ru_nvcsw, usage.ru_nivcsw


def _thread_times() -> dict[int, tuple[str, int, int]]:
    """Each thread of this process: its name, and its ns on a CPU and runnable but waiting for one
    so far (Linux's schedstat; {} elsewhere)."""
    out = {}
    for tid in process_thread_ids():
        task = Path(f"/proc/self/task/{tid}")
        try:
            run_ns, wait_ns = (int(v) for v in (task / "schedstat").read_text().split()[:2])
            out[tid] = ((task / "comm").read_text().strip(), run_ns, wait_ns)
        except (OSError, ValueError):  # ended meanwhile, or no schedstat on this kernel
            continue
    return out


def _process_times() -> dict[int, tuple[str, float]]:
    """Every other process this user can see: its name and CPU seconds so far."""
    me, out = os.getpid(), {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info["cpu_times"]
        if proc.pid != me and times is not None:
            out[proc.pid] = (proc.info["name"], times.user + times.system)
    return out


def _busiest(deltas: dict[str, float], n: int = 3, floor: float = 0.1) -> list[list]:
    """The n largest of name -> ms (those of at least `floor`), largest first."""
    top = sorted(deltas.items(), key=lambda kv: -kv[1])[:n]
    return [[name, round(ms, 2)] for name, ms in top if ms >= floor]


class GcPauses:
    """The cycle collector's runs while entered (through gc.callbacks): how many, their ms in all
    and the longest, and how many were full (generation 2) collections."""

    def __init__(self) -> None:
        self.runs = self.full = 0
        self.ms = self.max_ms = 0.0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            ms = 1e3 * (time.perf_counter() - self._start)
            self._start = None
            self.runs += 1
            self.full += info["generation"] == 2
            self.ms += ms
            self.max_ms = max(self.max_ms, ms)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def to_dict(self) -> dict:
        return {"runs": self.runs, "full": self.full, "ms": self.ms, "max_ms": self.max_ms}


def allocator_counts(device: torch.device) -> dict[str, int]:
    """How often torch's caching allocators went to the driver so far: device memory
    (cudaMalloc), and pinned host memory where this torch counts it; {} off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    out = {"device_allocs": stats.get("num_device_alloc", 0)}
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        out["host_allocs"] = host_stats().get("num_host_alloc", 0)
    return out


def step_times(seconds: Sequence[float]) -> dict:
    """A timed run's step durations: median, 99th percentile and longest, in ms, and the steps
    that took over three times the median with the time they took beyond it (a stall)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    if ms.size == 0:
        return {"steps": 0}
    median = float(np.median(ms))
    slow = ms > 3 * median
    return {
        "steps": int(ms.size),
        "median_ms": median,
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "slow_steps": int(slow.sum()),
        "slow_excess_ms": float((ms[slow] - median).sum()),
        "slow_at": np.flatnonzero(slow)[:8].tolist(),  # the first eight, counted from 0
    }
