"""The host's time planning an offloaded decode layer step in the native planner, on the CPU.

Usage: python scripts/plan_time.py [--slots N] [--layers N] [--experts N] [--top-k N]
       [--hidden N] [--inter N] [--rounds N] [--skew S]
One token at a time, layer after layer, through `DecodePlanner::step` (`MoERunner.planner
.native_step`) over an expert cache of N slots and a bf16 bank of small experts (the plan reads
no weights, so their size matters only to the CPU job it starts, which each step waits for
before the next). The routing picks each layer's experts with Zipf weights (exponent S) over a
permutation of its own. The first quarter of the rounds fills the cache; of the rest it prints
the plan's time a layer step (the step's `seconds[1]`: the plan, the CPU job's assign and its
push to the workers): median, mean and 90th percentile, and the cache's hit rate.
Defaults: Qwen3.6-35B-A3B's FP8 cache on 24 GiB (40 layers of 256 experts, 8 routed, 5,234
slots; docs/cpu-experts.md, "The slot a fill takes").
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from moelab.engine.experts.bank import ExpertBank
from moelab.engine.experts.cache import ExpertCache
from moelab.engine.experts.misses import MissPolicy
from moelab.engine.experts.moe import MoERunner
from moelab.kernels.cpu_experts import CpuExpertRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=5234)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=60, help="passes over the layers")
    ap.add_argument("--skew", type=float, default=1.1)
    args = ap.parse_args()
    L, E, K, H, inter = args.layers, args.experts, args.top_k, args.hidden, args.inter
    if not 0 < args.slots <= L * E:
        ap.error(f"--slots must be in 1..{L * E} (the experts of every layer)")
    if not 0 < K <= E:
        ap.error("--top-k must be in 1..--experts")
    if args.rounds < 4:
        ap.error("--rounds must be at least 4 (a quarter of them fill the cache)")
    gen = torch.Generator().manual_seed(0)
    bank = ExpertBank(
        [torch.randn(E, 2 * inter, H, generator=gen).bfloat16() for _ in range(L)],
        [torch.randn(E, H, inter, generator=gen).bfloat16() for _ in range(L)],
    )
    cache = ExpertCache(L, E, args.slots, H, inter, torch.bfloat16, torch.device("cpu"))
    rng = np.random.default_rng(1)
    p = 1.0 / np.arange(1, E + 1) ** args.skew
    p /= p.sum()
    orders = [rng.permutation(E) for _ in range(L)]
    with CpuExpertRunner(2, "native") as cpu:
        runner = MoERunner(
            bank, cache, MissPolicy("split", 0.5), cpu, top_k=K, prefill_overlap=False,
            prefill_stream_min_tokens=64,
        )  # fmt: skip
        native = runner.planner.native()
        if native is None:
            raise SystemExit("the native CPU kernel did not build; see the log above")
        out = torch.empty(1, H)
        times, warm = [], L * args.rounds // 4
        for step in range(L * args.rounds):
            layer = step % L
            picked = orders[layer][rng.choice(E, K, replace=False, p=p)]
            ids = torch.from_numpy(picked[None].astype(np.int32))
            d, seconds = runner.planner.native_step(
                native, layer, ids, torch.rand(1, K), torch.randn(1, H), out, False
            )
            if d.job is not None:
                d.job.wait()
            if step == warm - 1:
                hits = cache.hits
            if step >= warm:
                times.append(seconds[1])
    us = np.array(times) * 1e6
    hit_rate = (cache.hits - hits) / (K * len(us))  # each step routes K distinct experts
    print(f"{len(us)} layer steps over {args.slots} slots, hits {hit_rate:.2f}: plan "
          f"{np.median(us):.2f} us median, {us.mean():.2f} mean, "
          f"{np.percentile(us, 90):.2f} 90th percentile")  # fmt: skip


if __name__ == "__main__":
    main()
