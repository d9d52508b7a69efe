"""How three ways of dividing a decode layer step's misses between copies and the CPU would time
out, from the planners' own decisions over a real cache and Zipf routing (no GPU needed).

Usage: python scripts/miss_split_sim.py [--steps N] [--fraction F] [--skew S ...]  (one JSON line
per case; docs/performance.md, sixth session)

Rules: "round" copies round(m · f) of m misses (the rule before the sixth session), "whole" the
whole count that ends the step soonest (`MissPolicy.fetch_count`), "split" may also split one miss
(`fetch_plan`, the native planner with stand-in copies into a cache in host memory). The time of
one layer step's misses is the later of the copies (copied experts' worth · TF) and the CPU (CPU
experts' worth · TC), with TF and TC per expert as measured on the H200 (docs/performance.md);
f defaults to TC / (TF + TC), the auto policy's fraction at those rates (on the H200 the policy,
following the CPU's rate as decode sees it, ran at 0.36-0.39). Only the misses are modelled, not
the dense work, the host or the GPU's MoE.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from moelab.engine.bank import ExpertBank
from moelab.engine.cache import ExpertCache
from moelab.engine.h2d import address_of, host_functions
from moelab.engine.misses import SPLIT_CHUNKS, MissPolicy
from moelab.engine.moe import MoERunner
from moelab.engine.synth import zipf_shares
from moelab.kernels.cpu_experts import CpuExpertRunner

LAYERS, EXPERTS, TOP_K, SLOTS = 12, 128, 8, 384  # Qwen3-30B-A3B's counts, 12 layers, 25% cached
HIDDEN, INTER = 64, 2 * SPLIT_CHUNKS  # small experts: only the decisions matter here
TF_US, TC_US = 200.0, 108.0  # one expert copied at 47 GB/s; run by the CPU at ~87 GB/s


class RoundedPolicy(MissPolicy):
    """The rule before: round(m · f)."""

    def fetch_count(self, misses: int) -> int:
        return min(misses, max(0, round(misses * self.fetch_fraction)))


def simulate(rule: str, skew: float, steps: int, f: float, cpu: CpuExpertRunner) -> dict:
    gen = torch.Generator().manual_seed(0)
    w13 = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).bfloat16() for _ in range(LAYERS)]
    w2 = [torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).bfloat16() for _ in range(LAYERS)]
    cache = ExpertCache(LAYERS, EXPERTS, SLOTS, HIDDEN, INTER, torch.bfloat16, torch.device("cpu"))
    policy = (RoundedPolicy if rule == "round" else MissPolicy)("split", f)
    r = MoERunner(ExpertBank(w13, w2), cache, policy, cpu, top_k=TOP_K, prefill_overlap=False,
                  prefill_stream_min_tokens=64)  # fmt: skip
    planner = functions = None
    if rule == "split":
        r.split_misses = True
        planner = r._decode_planner()
        functions = host_functions()
        addresses = [address_of(fn) for fn in functions]
        planner.set_device(*addresses, 0, 0, cache.w13.data_ptr(), cache.w2.data_ptr(), 2)
    rng = np.random.default_rng(1)
    shares = zipf_shares(EXPERTS, skew)
    ranks = [rng.permutation(EXPERTS) for _ in range(LAYERS)]
    x, weights = torch.zeros(1, HIDDEN), torch.full((1, TOP_K), 1.0 / TOP_K)
    out = torch.zeros(1, HIDDEN)
    total_us = copied = on_cpu = 0.0
    hits = reads = splits = 0
    for _ in range(steps):
        for layer in range(LAYERS):
            picked = rng.choice(EXPERTS, TOP_K, replace=False, p=shares)
            ids = np.ascontiguousarray(ranks[layer][picked][None, :], dtype=np.int32)
            if planner is not None:
                d, _ = r._native_step(planner, layer, torch.from_numpy(ids), weights, x, out,
                                      False, copies=True)  # fmt: skip
                if d.job is not None:
                    d.job.wait()
            else:
                d = r._plan(layer, ids, decode=True)
            share = d.split_share
            step_copied = len(d.admitted) + share
            step_cpu = len(d.on_cpu) - share
            total_us += max(step_copied * TF_US, step_cpu * TC_US)
            copied += step_copied
            on_cpu += step_cpu
            reads += TOP_K
            hits += TOP_K - len(d.missing)
            splits += d.split is not None
    del functions
    n = steps * LAYERS
    return {"rule": rule, "skew": skew, "fraction": round(f, 3), "layer_steps": n,
            "hit_rate": round(hits / reads, 3), "copied_experts_per_step": round(copied / n, 3),
            "cpu_experts_per_step": round(on_cpu / n, 3), "split_share": round(splits / n, 3),
            "miss_us_per_layer_step": round(total_us / n, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="decode steps of 12 layer steps")
    parser.add_argument("--fraction", type=float, default=TC_US / (TF_US + TC_US))
    parser.add_argument("--skew", type=float, action="append", help="Zipf exponents (1 and 0)")
    args = parser.parse_args()
    with CpuExpertRunner(1, "native") as cpu:
        for skew in args.skew or [1.0, 0.0]:
            for rule in ("round", "whole", "split"):
                print(json.dumps(simulate(rule, skew, args.steps, args.fraction, cpu)), flush=True)


if __name__ == "__main__":
    main()
