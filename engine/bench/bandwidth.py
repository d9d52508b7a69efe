"""`moelab bench bw`: this machine's bandwidths, as the profile the engine's miss split reads
(engine/config/bandwidth.py keeps it).

Measured: host-to-device copies of one expert (pinned and pageable), device copy bandwidth, host
memory read rate and CPU expert rate per thread count, device expert rate, and copies with CPU
experts running at the same time (do they contend?). On a machine without CUDA it measures what
exists and says what it skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..config.args import physical_cores
from ..config.bandwidth import PROFILE_VERSION, save_profile

QWEN3_30B_EXPERT = (2048, 768)  # hidden, moe intermediate: the default geometry


def machine_identity() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "hostname": socket.gethostname(),
        "cpu": _cpu_name(),
        "cores": physical_cores(),
        "gpu": gpu,
    }


def versions() -> dict:
    try:
        moelab = version("moelab")
    except PackageNotFoundError:
        moelab = "dev"
    driver = None
    if torch.cuda.is_available():
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVML missing or refused: the driver version is simply unknown
            driver = None
    return {
        "moelab": moelab,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver,
        "python": platform.python_version(),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed(fn: Callable[[], None], sync: Callable[[], None], min_s: float = 0.3,
           min_runs: int = 5) -> float:  # fmt: skip
    """Median seconds of fn() over at least `min_runs` runs and `min_s` seconds."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run_bw(
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    threads: list[int],
    say: Callable[[str], None],
    min_s: float = 0.3,
) -> dict:
    """Measure every rate; returns the profile dict (results as rows of kind/params/value/unit)."""
    from ...kernels.cpu_experts import CpuExpertRunner
    from ...kernels.fused_moe import fused_moe_decode

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results: list[dict] = []
    skipped: list[str] = []
    elem = torch.empty((), dtype=dtype).element_size()
    expert_bytes = 3 * hidden * intermediate * elem
    num_experts = max(8, min(64, (2 * 1024**3) // expert_bytes))  # about 2 GiB: past every cache
    params = {
        "hidden": hidden,
        "intermediate": intermediate,
        "dtype": str(dtype)[6:],
        "expert_bytes": expert_bytes,
    }

    def row(kind: str, value: float, unit: str = "GB/s", **extra) -> None:
        results.append({"kind": kind, "params": {**params, **extra}, "value": value, "unit": unit})
        label = " ".join(f"{k}={v}" for k, v in extra.items())
        say(f"  {kind:<28} {label:<22} {value:>10.2f} {unit}")

    say(
        f"expert of {hidden}x{intermediate} {params['dtype']}: {expert_bytes / 2**20:.1f} MiB; "
        f"{num_experts} experts in the pool"
    )
    w13 = torch.randn(num_experts, 2 * intermediate, hidden).to(dtype)
    w2 = torch.randn(num_experts, hidden, intermediate).to(dtype)

    if cuda:
        pinned13, pinned2 = w13.pin_memory(), w2.pin_memory()
        d13 = torch.empty_like(w13[0], device=dev)
        d2 = torch.empty_like(w2[0], device=dev)
        # each GPU's own link and memory: a split weighs its cards by them (gpu_index)
        for index in range(torch.cuda.device_count()):
            gpu = torch.device("cuda", index)
            pairs = (("h2d_pinned", (pinned13, pinned2)), ("h2d_pageable", (w13, w2)))
            for kind, (s13, s2) in pairs if index == 0 else pairs[:1]:
                rate = _h2d_gbps(s13, s2, gpu, min_s)
                row(kind, rate, gpu_index=index)
            row("device_copy", _device_copy_gbps(gpu, min_s), gpu_index=index)
        k = 8
        dw13 = w13[:k].to(dev)
        dw2 = w2[:k].to(dev)
        x = torch.randn(1, hidden, device=dev, dtype=dtype)
        slots = torch.arange(k, device=dev, dtype=torch.int32).view(1, k)
        weights = torch.full((1, k), 1.0 / k, device=dev)
        t = _timed(lambda: fused_moe_decode(x, slots, weights, dw13, dw2), sync, min_s)
        row("device_experts", k * expert_bytes / t / 1e9, experts=k)
    else:
        skipped += ["h2d_pinned", "h2d_pageable", "device_copy", "device_experts"]
        say("  no CUDA device: skipped host-to-device, device copy and device expert rates")

    x_host = torch.randn(1, hidden)
    for n in threads:
        with CpuExpertRunner(n, "auto") as runner:
            row(
                "host_read",
                runner.read_gbps(min(1 << 30, 16 * expert_bytes * num_experts)),
                threads=n,
            )
            for k in (1, 4):
                counter = iter(range(10**9))

                def cpu_step(k=k, counter=counter) -> None:
                    start = (next(counter) * k) % (num_experts - k)
                    ids = torch.arange(start, start + k, dtype=torch.int32)
                    runner.run(
                        x_host,
                        w13,
                        w2,
                        ids,
                        torch.zeros(k, dtype=torch.int32),
                        torch.full((k,), 1.0 / k),
                    )

                row(
                    "cpu_experts",
                    k * expert_bytes / _timed(cpu_step, lambda: None, min_s) / 1e9,
                    threads=n,
                    experts=k,
                    kernel=runner.kernel,
                )
            if cuda and n == max(threads):
                _concurrent(
                    runner,
                    pinned13,
                    pinned2,
                    d13,
                    d2,
                    x_host,
                    w13,
                    w2,
                    num_experts,
                    expert_bytes,
                    min_s,
                    row,
                )
    return {
        "profile_version": PROFILE_VERSION,
        "created": time.time(),
        "machine": machine_identity(),
        "versions": versions(),
        "expert": params,
        "results": results,
        "skipped": skipped,
    }


def _concurrent(runner, pinned13, pinned2, d13, d2, x_host, w13, w2, num_experts, expert_bytes,
                min_s, row) -> None:  # fmt: skip
    """Copies on a side stream (in a thread) while the CPU runs experts: each rate, together."""
    import threading

    k = 4
    seconds = max(min_s, 0.5)
    copied = [0]
    stop = threading.Event()

    def copies() -> None:
        stream = torch.cuda.Stream()
        i = 0
        with torch.cuda.stream(stream):
            while not stop.is_set():
                d13.copy_(pinned13[i % num_experts], non_blocking=True)
                d2.copy_(pinned2[i % num_experts], non_blocking=True)
                stream.synchronize()
                copied[0] += 1
                i += 1

    thread = threading.Thread(target=copies)
    start = time.perf_counter()
    thread.start()
    cpu = 0
    while time.perf_counter() - start < seconds:
        s = (cpu * k) % (num_experts - k)
        runner.run(
            x_host,
            w13,
            w2,
            torch.arange(s, s + k, dtype=torch.int32),
            torch.zeros(k, dtype=torch.int32),
            torch.full((k,), 1.0 / k),
        )
        cpu += 1
    cpu_s = time.perf_counter() - start
    stop.set()
    thread.join()
    copy_s = time.perf_counter() - start
    row(
        "h2d_pinned_concurrent", copied[0] * expert_bytes / copy_s / 1e9, threads=runner.num_threads
    )
    row(
        "cpu_experts_concurrent",
        cpu * k * expert_bytes / cpu_s / 1e9,
        threads=runner.num_threads,
        experts=k,
    )


def _h2d_gbps(w13: torch.Tensor, w2: torch.Tensor, device: torch.device, min_s: float) -> float:
    """Host-to-device copies of one expert at a time onto `device`, cycling through the pool."""
    d13 = torch.empty_like(w13[0], device=device)
    d2 = torch.empty_like(w2[0], device=device)
    counter = iter(range(10**9))

    def copy() -> None:
        e = next(counter) % w13.shape[0]
        d13.copy_(w13[e], non_blocking=True)
        d2.copy_(w2[e], non_blocking=True)

    seconds = _timed(copy, lambda: torch.cuda.synchronize(device), min_s)
    return (d13.nbytes + d2.nbytes) / seconds / 1e9


def _device_copy_gbps(device: torch.device, min_s: float) -> float:
    """`device`'s memory bandwidth: a 1 GiB copy within it, read and write counted."""
    big = torch.empty(1024**3 // 2, dtype=torch.float16, device=device)
    out = torch.empty_like(big)
    seconds = _timed(lambda: out.copy_(big), lambda: torch.cuda.synchronize(device), min_s)
    return 2 * big.nbytes / seconds / 1e9


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench", help="measure bandwidths, decode and prefill speed, a coding agent's session"
    )
    kinds = bench.add_subparsers(dest="bench", required=True)
    bw = kinds.add_parser("bw", help="bandwidths the miss split and the bounds are built on")
    bw.add_argument("--model-path", help="measure at this checkpoint's expert size")
    bw.add_argument(
        "--threads",
        default=None,
        help="CPU thread counts, comma-separated (default: 1, 2, 4, ... cores)",
    )
    bw.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bw.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    bw.add_argument("--out", default=None, help="profile file (default: the user cache dir)")
    bw.set_defaults(run=_run_bw)
    from .agent import add_agent_parser
    from .decode import add_decode_parsers

    add_decode_parsers(kinds)
    add_agent_parser(kinds)


def _threads(text: str | None) -> list[int]:
    if text:
        try:
            values = sorted({int(t) for t in text.split(",") if t.strip()})
        except ValueError:
            raise ValueError("--threads takes comma-separated whole numbers, e.g. 1,2,4") from None
        if not values or values[0] < 1:
            raise ValueError("--threads values must be 1 or more")
        return values
    cores = physical_cores()
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return [*out, cores]


def _run_bw(args: argparse.Namespace) -> int:
    hidden, inter = QWEN3_30B_EXPERT
    if args.model_path:
        from ..model.spec import ModelSpec

        spec = ModelSpec.from_dir(args.model_path)
        hidden, inter = spec.hidden_size, spec.moe_intermediate_size
    threads = _threads(args.threads)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(f"moelab bench bw: threads {threads}")
    profile = run_bw(hidden, inter, getattr(torch, args.dtype), threads, say)
    out = save_profile(profile, args.out)
    say(f"profile written to {out}")
    if args.json:
        print(json.dumps(profile))
    return 0
