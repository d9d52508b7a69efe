"""Time to first token of a multi-turn chat, with the prefix cache and without it.

Usage: python scripts/prefix_cache_ttft.py [--arch A] [--preset small] [--set FIELD=VALUE
...] [--turns 4] [--system 1024] [--question 64] [--reply 32] [--at-once N] [ENGINE FLAGS...]

Runs an engine on the preset's geometry (of --arch, as `moelab synth` writes it) with dummy
weights (or on --model-path), the same conversation twice, once with the prefix cache and once
with `--no-prefix-cache`. Each turn's prompt is the last prompt, its reply and a new question,
after a system prompt of --system tokens, whose end each request names as a chat's server does
(a hybrid model keeps its state there). Prints each turn's prompt tokens, the tokens the cache
held, and the time to the first token both ways. With --at-once N, instead: N requests sent at
once, each the system prompt and a question of its own (a few-shot prefix from an evaluation
harness), and the time until every one has its first token. Other flags go to both engines (for
example `--device cuda`). Each engine warms up on a conversation of its own first (a system
prompt of --warmup-system tokens, at most 4,096 by default: it compiles the same kernels as a
longer one, in a fraction of the time), and each engine's turns are printed as they are
measured, so that a run cut short still shows the side it finished.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from moelab.engine.config.config import EngineConfig
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config, parse_overrides, preset_arch
from moelab.engine.runtime.engine import Engine
from moelab.engine.runtime.sampling import SamplingParams


def conversation(
    engine: Engine, args: argparse.Namespace, seed: int
) -> list[tuple[int, int, float]]:
    """(prompt tokens, cached tokens, seconds to the first token) of each turn of a conversation
    of random tokens drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        return torch.randint(3, engine.spec.vocab_size, (n,), generator=gen).tolist()

    prompt = words(args.system)
    turns = []
    for _ in range(args.turns):
        prompt = prompt + words(args.question)
        t0 = time.perf_counter()
        # the system prompt's end, a message end a chat's server names: a hybrid model keeps
        # its state there (and every --state-checkpoint-interval tokens)
        params = SamplingParams(max_tokens=args.reply, ignore_eos=True)
        seq = engine.add(prompt, params, boundaries=(args.system,))
        while not seq.output_ids:
            engine.step()
        first = time.perf_counter() - t0
        engine.run_until_idle()
        turns.append((len(prompt), seq.cached_tokens, first))
        prompt = prompt + seq.output_ids
    return turns


def at_once(engine: Engine, args: argparse.Namespace, seed: int) -> list[tuple[int, int, float]]:
    """One row: (prompt tokens, cached tokens, seconds until every request has its first token)
    of --at-once requests sharing the system prompt, sent together."""
    gen = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        return torch.randint(3, engine.spec.vocab_size, (n,), generator=gen).tolist()

    system = words(args.system)
    params = SamplingParams(max_tokens=args.reply, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = [
        engine.add(system + words(args.question), params, boundaries=(args.system,))
        for _ in range(args.at_once)
    ]
    while not all(s.output_ids for s in seqs):
        engine.step()
    first = time.perf_counter() - t0
    engine.run_until_idle()
    prompt = sum(len(s.prompt_ids) for s in seqs)
    return [(prompt, sum(s.cached_tokens for s in seqs), first)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", help="the preset's architecture by default (moelab synth's --arch)")
    p.add_argument("--preset", default="small")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--model-path", default=None)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    p.add_argument("--question", type=int, default=64, help="tokens each turn adds")
    p.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    p.add_argument("--at-once", type=int, default=0, metavar="N",
                   help="N requests with the system prompt sent together, not a chat")  # fmt: skip
    p.add_argument(
        "--warmup-system",
        type=int,
        default=None,
        metavar="N",
        help="the warm-up's system prompt (default: --system, at most 4096)",
    )
    args, engine_flags = p.parse_known_args()
    warmup = argparse.Namespace(**vars(args))
    warmup.system = args.warmup_system or min(args.system, 4096)
    with tempfile.TemporaryDirectory() as tmp:
        spec = None
        path = args.model_path
        if path is None:  # the preset's geometry, dummy weights (as `moelab bench`)
            arch = args.arch or preset_arch(args.preset)
            config = make_config(arch, args.preset, parse_overrides(args.set))
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            path, spec = tmp, ModelSpec.from_config(config)
            engine_flags = ["--dummy-weights", *engine_flags]
        results = {}
        for cached in (True, False):
            flags = ["--model-path", path, "--bank-dir", f"{tmp}/bank", *engine_flags]
            if not cached:
                flags.append("--no-prefix-cache")
            engine = Engine(EngineConfig.from_flags(flags), spec=spec)
            try:
                run = at_once if args.at_once else conversation
                run(engine, warmup, 1)  # warm-up (other tokens: nothing to share)
                results[cached] = run(engine, args, 7)
            finally:
                engine.close()
            side = "with the prefix cache" if cached else "with --no-prefix-cache"
            for n, hit, first in results[cached]:
                print(f"{side}: {n} prompt tokens, {hit} cached, {first * 1e3:.1f} ms", flush=True)
    heads = ("turn", "prompt", "cached", "TTFT cached", "TTFT whole", "speed-up")
    if args.at_once:  # one row: every request's first token
        heads = ("requests", "prompts", "cached", "all cached", "all whole", "speed-up")
    print("  ".join(f"{h:>11}" for h in heads))
    for i, (with_cache, whole) in enumerate(zip(results[True], results[False], strict=True)):
        (n, hit, on), off = with_cache, whole[2]
        first = args.at_once or i + 1
        row = (first, n, hit, f"{on * 1e3:.1f} ms", f"{off * 1e3:.1f} ms", f"{off / on:.1f}x")
        print("  ".join(f"{v:>11}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
