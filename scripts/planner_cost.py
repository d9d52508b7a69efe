"""The host's cost of planning one offloaded decode layer step: the Python planner against the
native one (`DecodePlanner`), with warm caches and after a sweep that evicts them (as the CPU job
of the layer before does, streaming its experts through the shared last-level cache).

Usage: python scripts/planner_cost.py [STEPS]  (prints one JSON line per case; docs/cpu-experts.md)
Python: `_plan` and `_start`; native: `_native_step` as the staged step calls it, the whole call
and the part inside native code (which, with CUDA, is all that lies between the routing's arrival
and the CPU job's start).
The geometry's counts are Qwen3-30B-A3B's (12 layers, 128 experts, top-8, 25% of the experts
cached, skewed routing); the experts are small, since only the planning and the job's start are
timed, not the job.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from moelab.engine.bank import ExpertBank
from moelab.engine.cache import ExpertCache
from moelab.engine.misses import MissPolicy
from moelab.engine.moe import MoERunner
from moelab.kernels.cpu_experts import CpuExpertRunner

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER = 12, 128, 8, 256, 64


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    gen = torch.Generator().manual_seed(0)
    w13 = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).bfloat16() for _ in range(LAYERS)]
    w2 = [torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).bfloat16() for _ in range(LAYERS)]
    p = 1.0 / np.arange(1, EXPERTS + 1)
    p /= p.sum()
    sweep = torch.ones(16 * 1024 * 1024)  # 64 MB
    with CpuExpertRunner(1, "native", spin_us=1000) as cpu:
        for planner in ("python", "native"):
            for cold in (False, True):
                cache = ExpertCache(LAYERS, EXPERTS, LAYERS * EXPERTS // 4, HIDDEN, INTER,
                                    torch.bfloat16, torch.device("cpu"))  # fmt: skip
                runner = MoERunner(
                    ExpertBank(w13, w2), cache, MissPolicy.auto(47.0, 89.0), cpu, top_k=TOP_K,
                    prefill_overlap=False, prefill_stream_min_tokens=64,
                )  # fmt: skip
                rng = np.random.default_rng(1)
                x, weights = torch.randn(1, HIDDEN), torch.rand(1, TOP_K)
                out = torch.zeros(1, HIDDEN)
                total, native = [], []
                for step in range(steps):
                    ids = np.sort(rng.choice(EXPERTS, TOP_K, replace=False, p=p))[None]
                    ids = torch.from_numpy(ids.astype(np.int32))
                    if cold:
                        sweep.sum()
                    t0 = time.perf_counter()
                    if planner == "python":
                        d = runner._plan(step % LAYERS, ids.numpy(), decode=True)
                        runner._start(d, step % LAYERS, ids.numpy(), weights, x)
                    else:  # as the staged step calls it, its tensors ready
                        d, (_, plan_s, _) = runner._native_step(
                            runner._decode_planner(), step % LAYERS, ids, weights, x, out, False
                        )
                        native.append(plan_s)
                    total.append(time.perf_counter() - t0)
                    if d.job is not None:
                        d.job.wait()
                result = {"planner": planner, "caches": "swept" if cold else "warm",
                          "call_us": _median_us(total)}  # fmt: skip
                if native:
                    result["native_part_us"] = _median_us(native)
                print(json.dumps(result), flush=True)


def _median_us(seconds: list[float]) -> float:
    return round(1e6 * float(np.median(seconds[len(seconds) // 10 :])), 1)


if __name__ == "__main__":
    main()
