"""CPU expert kernel benchmark: weight GB/s of the native kernel and of torch, bf16, FP8,
MXFP4 and NVFP4, against the host's memory read rate measured by the same threads.

Usage: python -m moelab.kernels.cpu_experts_bench --threads 1,2,4 [--dtype bf16,fp8,mxfp4,nvfp4]
       [--task-kb 48,96] [--gap-us 30 --own-rounds 0,2] [--x bf16|fp32] [--json]
(docs/cpu-experts.md)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import fp8, mxfp4, nvfp4
from .cpu_experts import DEFAULT_TASK_KB, SIMD_LEVELS, CpuExpertRunner
from .native_build import NativeKernelError

DTYPES = ("bf16", "fp8", "mxfp4", "nvfp4")


class Bank:
    """The experts of one layer as the host bank holds them: w13 [E, 2I, H] and w2 [E, H, I], bf16,
    or FP8 with their block factors, or MXFP4 blocks or NVFP4 values with their scales
    (`factors`, the keywords the runner takes)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, dtype: str) -> None:
        self.dtype = dtype
        self.hidden = w13.shape[2]
        self.factors: dict[str, torch.Tensor] = {}
        if dtype == "bf16":
            self.w13, self.w2 = w13, w2
            return
        if dtype == "nvfp4":
            self._nvfp4(w13, w2)
            return
        # one expert at a time: the bank in fp32 at once would take 4x its bf16 size
        quantize = fp8.quantize if dtype == "fp8" else mxfp4.quantize
        parts = [[quantize(w[e]) for e in range(w.shape[0])] for w in (w13, w2)]
        self.w13, self.w2 = (torch.stack([q for q, _ in p]) for p in parts)
        scales = [torch.stack([s for _, s in p]) for p in parts]
        self.factors = {"w13_scale": scales[0], "w2_scale": scales[1]}

    def _nvfp4(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """ModelOpt's layout, one expert at a time: gate, up and down quantized apart (w13's
        per-tensor scales [E, 2], w2's [E, 1])."""
        projections = {"w13": (w13, 2), "w2": (w2, 1)}
        for name, (w, parts) in projections.items():
            quantized = [nvfp4.quantize(w[e].unflatten(0, (parts, -1))) for e in range(w.shape[0])]
            values, scales, tensor_scales = (torch.stack(t) for t in zip(*quantized, strict=True))
            setattr(self, name, values.flatten(1, 2))
            self.factors[f"{name}_scale"] = scales.flatten(1, 2)
            self.factors[f"{name}_scale_2"] = tensor_scales

    @property
    def expert_bytes(self) -> int:
        """What one expert's weights (and factors) take: what a run reads for it."""
        tensors = (self.w13, self.w2, *self.factors.values())
        return sum(t[0].nbytes for t in tensors)


def _expert_gbps(runner: CpuExpertRunner, bank: Bank, k: int, min_s: float, x_bf16: bool) -> float:
    """Weight GB/s of one-token steps of k experts each (x: bf16 values with x_bf16).

    Consecutive steps take disjoint experts in a fixed shuffled order and come back to an expert
    only after the whole bank, so the weights come from memory, not from the last-level cache.
    """
    num_experts, hidden = bank.w13.shape[0], bank.hidden
    x = torch.randn(1, hidden)
    if x_bf16:
        x = x.bfloat16().float()
    pair_token = torch.zeros(k, dtype=torch.int32)
    pair_weight = torch.full((k,), 1.0 / k)
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(0)).int()
    steps = [order.roll(-k * s)[:k].clone() for s in range(num_experts // k)]

    def step(s: int) -> None:
        runner.run(x, bank.w13, bank.w2, steps[s % len(steps)], pair_token, pair_weight,
                   **bank.factors)  # fmt: skip

    for s in range(3):
        step(s)
    done, started_s = 0, time.perf_counter()
    while done < 10 or time.perf_counter() - started_s < min_s:
        step(done)
        done += 1
    return done * k * bank.expert_bytes / (time.perf_counter() - started_s) / 1e9


def _native_profile(
    runner: CpuExpertRunner,
    bank: Bank,
    k: int,
    min_s: float,
    gap_us: float = 0.0,
    own_rounds: int = 0,
    x_bf16: bool = True,
) -> dict[str, float]:
    """Weight GB/s of one-token jobs of k experts queued in native code as decode queues them
    (gap_us apart; with own_rounds, the workers own and fetch their first rounds of blocks in
    the gap), for about min_s seconds, with where a job's run went
    (`CpuExpertRunner.jobs_profile`)."""
    probe = runner.jobs_gbps(bank.w13, bank.w2, k, 10, bf16_x=x_bf16, **bank.factors)
    step_bytes = k * bank.expert_bytes
    iterations = max(10, int(min_s / (step_bytes / (probe * 1e9) + gap_us * 1e-6)))
    return runner.jobs_profile(
        bank.w13, bank.w2, k, iterations, gap_us=gap_us, own_rounds=own_rounds,
        fetch_own=own_rounds > 0, bf16_x=x_bf16, **bank.factors,
    )  # fmt: skip


def bench(
    threads: Sequence[int],
    experts: Sequence[int],
    shape: tuple[int, int, int],
    simd: str,
    min_s: float,
    read_bytes: int,
    say: Callable[[str], None],
    task_kbs: Sequence[int] = (DEFAULT_TASK_KB,),
    gap_us: float = 0.0,
    own_rounds: Sequence[int] = (0,),
    dtypes: Sequence[str] = DTYPES,
    x_bf16: bool = True,
) -> dict:
    """Per thread count, weight dtype, task size and owned rounds: host read rate, native and
    torch expert weight rates, in GB/s. The native jobs are timed in native code (no Python
    between them, as in decode; gap_us apart, the workers owning and fetching their first
    own_rounds rounds of gate/up blocks in the gap), the torch ones through Python, one step at a
    time.

    shape: (hidden, intermediate, experts in the bank). dtypes: "bf16", "fp8", "mxfp4" and
    "nvfp4" (the same weights quantized, kernels/fp8.py, kernels/mxfp4.py and kernels/nvfp4.py:
    their rates count the bytes as stored, factors and scales included). x_bf16: the
    activations are bf16 values, as the engine's bf16 models hand them to the kernel (which then
    takes its bf16 dot products where it has them: `dot` in the results), else fp32 values. The
    host read rate is measured before and after the expert runs and the higher one kept, so that
    a busy machine lowers the share rather than raising it.
    """
    hidden, inter, num_experts = shape
    gen = torch.Generator().manual_seed(0)
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.empty(num_experts, hidden, inter, dtype=torch.bfloat16)
    w13.normal_(0, 0.02, generator=gen)
    w2.normal_(0, 0.02, generator=gen)
    banks = [Bank(w13, w2, dtype) for dtype in dtypes]
    results = []
    for n, bank in ((n, bank) for n in threads for bank in banks):
        with CpuExpertRunner(n, "torch") as ref:
            torch_rates = {k: _expert_gbps(ref, bank, k, min_s, x_bf16) for k in experts}
        for kb, own in ((kb, own) for kb in task_kbs for own in own_rounds):
            with CpuExpertRunner(n, "native", simd, task_kb=kb) as native:
                read_before_gbps = native.read_gbps(read_bytes)
                profiles = {
                    k: _native_profile(native, bank, k, min_s, gap_us, own, x_bf16) for k in experts
                }
                host_gbps = max(read_before_gbps, native.read_gbps(read_bytes))
                simd_used = native.simd
            row = {"threads": n, "dtype": bank.dtype, "task_kb": kb, "gap_us": gap_us,
                   "own_rounds": own, "simd": simd_used, "host_read_gbps": host_gbps,
                   "experts": {}}  # fmt: skip
            for k, prof in profiles.items():
                share = prof["gbps"] / host_gbps
                dot = "bf16" if prof["bf16_dot"] else "fp32"
                row["experts"][k] = {
                    "dot": dot,
                    "native_gbps": prof["gbps"],
                    "torch_gbps": torch_rates[k],
                    "native_share_of_host": share,
                    # a job's run, its gate/up phase and each worker's wait for it, µs
                    "run_us": prof["run_us"],
                    "phase1_us": prof["phase1_us"],
                    "wait_us": prof["wait_us"],
                }
                say(
                    f"{n:>7} {bank.dtype:>5} {kb:>7} {own:>4} {host_gbps:>14.1f} {k:>7} "
                    f"{dot:>4} {prof['gbps']:>11.1f} "
                    f"{torch_rates[k]:>10.1f} {share:>11.0%} {prof['run_us']:>7.1f} "
                    f"{prof['phase1_us']:>9.1f} {prof['wait_us']:>7.1f}"
                )
            results.append(row)
    return {
        "cpu": _cpu_name(),
        "logical_cpus": os.cpu_count(),
        "shape": {"hidden": hidden, "intermediate": inter, "num_experts": num_experts},
        "tokens": 1,
        "results": results,
    }


def _cpu_name() -> str:
    try:
        found = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    return found.group(1) if found else platform.processor() or platform.machine()


def _dtype_list(text: str) -> list[str]:
    values = text.split(",")
    if not set(values) <= set(DTYPES):
        raise ValueError(text)
    return values


def _int_list(text: str, minimum: int = 1) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < minimum:
        raise ValueError(text)
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moelab.kernels.cpu_experts_bench",
        description="CPU expert kernel benchmark: weight GB/s against the host memory read rate.",
    )
    parser.add_argument("--threads", default="1,2,4", help="comma-separated thread counts")
    parser.add_argument("--experts", default="8,4", help="comma-separated experts per step")
    parser.add_argument("--hidden", type=int, default=2048, help="H (Qwen3-30B-A3B: 2048)")
    parser.add_argument("--intermediate", type=int, default=768, help="I (Qwen3-30B-A3B: 768)")
    parser.add_argument("--num-experts", type=int, default=128, help="experts in the bank")
    parser.add_argument("--simd", choices=SIMD_LEVELS, default="best", help="native code path")
    parser.add_argument(
        "--dtype", default=",".join(DTYPES),
        help="comma-separated expert weight types: bf16, fp8 (e4m3, 128x128 block factors), "
        "mxfp4 (e2m1, an E8M0 scale per 32 values)",
    )  # fmt: skip
    parser.add_argument(
        "--task-kb", default=str(DEFAULT_TASK_KB), help="comma-separated native task sizes, KiB"
    )
    parser.add_argument(
        "--gap-us", type=float, default=0.0,
        help="the workers' idle time before each native job, µs (decode's: ~30)",
    )  # fmt: skip
    parser.add_argument(
        "--own-rounds", default="0",
        help="comma-separated rounds of gate/up blocks the workers own and fetch in the gap",
    )  # fmt: skip
    parser.add_argument(
        "--x", choices=("bf16", "fp32"), default="bf16",
        help="the activations: bf16 values, as the engine's bf16 models give them (the native "
        "kernel's bf16 dot products, where it has them), or fp32 values (its fp32 path)",
    )  # fmt: skip
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time per measurement")
    parser.add_argument("--read-mib", type=int, default=1024, help="buffer of the host read test")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        threads, experts = _int_list(args.threads), _int_list(args.experts)
        task_kbs = _int_list(args.task_kb)
        own_rounds = _int_list(args.own_rounds, minimum=0)
    except ValueError:
        parser.error(
            "--threads, --experts and --task-kb take positive comma-separated integers, e.g. "
            "1,2,4; --own-rounds integers of 0 or more"
        )
    try:
        dtypes = _dtype_list(args.dtype)
    except ValueError:
        parser.error(f"--dtype takes a comma-separated list of {', '.join(DTYPES)}")
    if args.gap_us < 0:
        parser.error("--gap-us must be 0 or more")
    if max(experts) > args.num_experts:
        parser.error("--experts cannot exceed --num-experts")
    # each row as it is measured, also into a file or pipe (a run cut short keeps its rows)
    say = (lambda _: None) if args.json else functools.partial(print, flush=True)
    say(
        f"{_cpu_name()}, {os.cpu_count()} logical CPUs; experts H={args.hidden} "
        f"I={args.intermediate}, 1 token, bank of {args.num_experts}; native jobs "
        f"{args.gap_us:g} µs apart; x {args.x} values; GB/s of the weights as stored (with their "
        "factors or scales); dot: the native kernel's dot products"
    )
    say(
        f"{'threads':>7} {'dtype':>5} {'task KiB':>7} {'own':>4} {'host read GB/s':>14} "
        f"{'experts':>7} {'dot':>4} "
        f"{'native GB/s':>11} "
        f"{'torch GB/s':>10} {'native/host':>11} {'run µs':>7} {'gate/up µs':>9} {'wait µs':>7}"
    )
    shape = (args.hidden, args.intermediate, args.num_experts)
    try:
        result = bench(
            threads, experts, shape, args.simd, args.min_seconds, args.read_mib << 20, say,
            task_kbs, args.gap_us, own_rounds, dtypes, args.x == "bf16",
        )  # fmt: skip
    except (NativeKernelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
