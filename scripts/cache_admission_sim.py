"""Hit rates of the expert cache under the synthetic models' routing, by admission rule.

Usage: python scripts/cache_admission_sim.py [--layers 36 --experts 128 --top-k 4 --slots 262]
       [--batch 1 8] [--fetch-fraction 0.3] [--steps 200] [--shift-at N] [--seed 0]

A model of the decode planner's cache, not the engine: each layer step routes `--batch` tokens
to `--top-k` distinct experts each, drawn independently with the Zipf(1) pick shares the
synthetic routers are calibrated to (each layer's own order of experts), as `bench decode
--routing-skew 1` routes. The routed experts found in the cache are hits and become most
recently used; of the misses, the `--fetch-fraction` most picked are admitted (the rest would
run on the CPU), each into the least recently used slot that the step does not read, as
`ExpertCache.admit` and the native planner choose it. Two rules for where an admitted expert
goes in the recency order:

- lru: at the most recently used end (`--moe-cache-admission recent`);
- frequency: there too, unless the expert it evicts was picked more often (pick counts since the
  start), in which case it takes the evicted expert's place at the least recently used end, so
  that the next fill takes its slot before any other (`--moe-cache-admission frequency`, the
  engine's default).

Prints each rule's hit rate over the steps after the first 50 (or, with --shift-at, over the
steps from 20 after a change of every layer's expert order, where the counts of the old hot
experts weigh against the new ones). Figures in docs/performance.md, "Known gaps".
"""

from __future__ import annotations

import argparse

import numpy as np

from moelab.engine.model.synth import zipf_shares  # the shares the routers are calibrated to


def hit_rate(args: argparse.Namespace, batch: int, rule: str) -> float:
    """One run's hits over lookups (a layer step's distinct routed experts)."""
    rng = np.random.default_rng(args.seed)
    layers, experts, slots = args.layers, args.experts, args.slots
    logits = np.log(zipf_shares(experts, 1.0))
    orders = [rng.permutation(experts) for _ in range(layers)]
    slot_of = -np.ones((layers, experts), dtype=np.int64)
    key_of = -np.ones(slots, dtype=np.int64)
    last_use = np.zeros(slots, dtype=np.int64)
    picks = np.zeros((layers, experts), dtype=np.int64)
    never = np.iinfo(np.int64).max
    tick = hits = lookups = 0
    first = 50 if args.shift_at is None else args.shift_at + 20
    for step in range(args.steps):
        if step == args.shift_at:
            orders = [rng.permutation(experts) for _ in range(layers)]
        counted = step >= first
        for layer in range(layers):
            # top-k distinct experts a token: Gumbel noise on the log shares
            noisy = logits[None, :] + rng.gumbel(size=(batch, experts))
            chosen = np.argpartition(-noisy, args.top_k - 1, axis=1)[:, : args.top_k]
            ids = orders[layer][chosen].ravel()
            np.add.at(picks[layer], ids, 1)
            protected = np.zeros(slots, dtype=bool)
            missing = []
            for e in np.unique(ids).tolist():
                s = slot_of[layer, e]
                if s >= 0:
                    tick += 1
                    last_use[s] = tick
                    protected[s] = True
                    hits += counted
                else:
                    missing.append(e)
                lookups += counted
            missing.sort(key=lambda e: -picks[layer, e])
            for e in missing[: round(len(missing) * args.fetch_fraction)]:
                candidates = np.where(protected, never, last_use)
                s = int(candidates.argmin())
                if candidates[s] == never:
                    break  # every slot is read by this step
                victim, victim_picks, victim_use = int(key_of[s]), -1, last_use[s]
                if victim >= 0:
                    slot_of[victim // experts, victim % experts] = -1
                    victim_picks = picks[victim // experts, victim % experts]
                key_of[s], slot_of[layer, e], protected[s] = layer * experts + e, s, True
                tick += 1
                keep_back = rule == "frequency" and picks[layer, e] < victim_picks
                last_use[s] = victim_use if keep_back else tick
    return hits / max(lookups, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--slots", type=int, default=262)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--fetch-fraction", type=float, default=0.3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--shift-at", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for batch in args.batch:
        rates = {rule: hit_rate(args, batch, rule) for rule in ("lru", "frequency")}
        print(f"batch {batch}: " + ", ".join(f"{r} {h:.3f}" for r, h in rates.items()), flush=True)


if __name__ == "__main__":
    main()
