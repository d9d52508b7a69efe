"""How well the engine's guess of an MoE layer's routing names the experts the layer routes to.

Usage: python scripts/guess_accuracy.py [--tokens 256] -- BENCH_DECODE_FLAGS...
e.g.   python scripts/guess_accuracy.py -- --preset qwen3-30b-a3b --set num_hidden_layers=4 \\
           --routing-skew 1 --device cpu --dtype bfloat16 --device-memory 24GiB

The engine is built as `moelab bench decode` builds it (the same flags) and reads one prompt of
random tokens. For every MoE layer, the guess `--moe-cpu-prefetch-rounds` sends
(kernels/route_guess.py, `Model._guess`: the layer's router on the first attention input after
the MoE layer before, or for the first MoE layer after the embedding, rescaled to the router's
norm) is taken from the same forward pass and compared with the routing the layer then makes;
so is, after the first, the guess from an earlier input, the router input of the MoE layer
before (rescaled the same way), which would be ready sooner.
One JSON line per layer and input: the share of the routed experts the guess names, the share
of tokens whose routed experts outside the layer's 25% most picked (the misses of a 25% cache,
roughly) it names exactly, and the share of those it names.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from moelab.engine import model as model_module
from moelab.engine.bench import add_bench_parser
from moelab.engine.bench_decode import open_engine
from moelab.kernels.host_handoff import routing_signal
from moelab.kernels.rmsnorm import rmsnorm_ref
from moelab.kernels.route_guess import GUESS_MAX_TOKENS, guess_scale, guess_to_host_ref


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    split = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:split], argv[split + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256, help="the prompt's length")
    script = p.parse_args(own)
    top = argparse.ArgumentParser(prog="moelab")
    add_bench_parser(top.add_subparsers(dest="command", required=True))
    return script, top.parse_args(["bench", "decode", *flags])


def guess_ids(x: torch.Tensor, scale: torch.Tensor, router: torch.Tensor, k: int) -> np.ndarray:
    """The top-k of the guessed logits, as the planner takes them (`guess_to_host_ref`'s)."""
    logits = torch.empty(x.shape[0], router.shape[0])
    for at in range(0, x.shape[0], GUESS_MAX_TOKENS):
        rows = slice(at, at + GUESS_MAX_TOKENS)
        guess_to_host_ref(x[rows], scale, router, logits[rows], routing_signal(pin=False))
    return logits.topk(k, dim=1).indices.numpy()


def compare(guess: np.ndarray, real: np.ndarray, experts: int) -> dict:
    picks = np.bincount(real.ravel(), minlength=experts)
    hot = set(np.argsort(-picks, kind="stable")[: experts // 4].tolist())
    pairs = list(zip(guess.tolist(), real.tolist(), strict=True))
    named = [len(set(g) & set(r)) / len(r) for g, r in pairs]
    tails = [(set(r) - hot, set(g) - hot) for g, r in pairs]
    return {
        "routed_named": float(np.mean(named)),
        "tail_exact": float(np.mean([r == g for r, g in tails])),
        "tail_named": float(np.mean([len(r & g) / len(r) for r, g in tails if r])),
    }


def main(argv: list[str]) -> int:
    script, bench = parse(argv)
    with tempfile.TemporaryDirectory() as workdir:
        engine = open_engine(bench, Path(workdir))
        model, spec = engine.model, engine.spec
        layers, moe = model.weights.layers, spec.moe_layers
        firsts = {moe[p - 1] + 1: p for p in range(1, len(moe))}  # a piece's first layer
        attention_in: dict[int, torch.Tensor] = {}  # per piece: its first attention input
        routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per MoE layer: x, ids
        norm_of = {id(layers[i].input_norm): i for i in firsts}
        next_norm = model_module.Model._next_norm

        def recorded_next_norm(self, weight, state):
            x = next_norm(self, weight, state)
            if id(weight) in norm_of:
                attention_in[firsts[norm_of[id(weight)]]] = x.clone()
            return x

        model_module.Model._next_norm = recorded_next_norm
        model.on_router = lambda layer, x, ids: routed.__setitem__(layer, (x.clone(), ids.clone()))
        try:
            gen = torch.Generator().manual_seed(bench.seed)
            prompt = torch.randint(0, spec.vocab_size, (script.tokens,), generator=gen)
            engine.score(prompt.tolist())
        finally:
            model_module.Model._next_norm = next_norm
            model.on_router = None
        # piece 0's first attention input: the embedding, normalized by layer 0's input norm
        embedded = model.weights.embed.index_select(0, prompt.to(model.device))
        attention_in[0] = rmsnorm_ref(embedded, layers[0].input_norm, spec.rms_norm_eps)
        for p in range(len(moe)):
            router, real = layers[moe[p]].router, routed[moe[p]][1].long().cpu().numpy()
            name = "after the sum" if p else "embedding"
            inputs = {name: (attention_in[p], model._guess_scales[p])}
            if p:
                inputs["router input before"] = (
                    routed[moe[p - 1]][0],
                    guess_scale(layers[moe[p - 1]].post_norm, layers[moe[p]].post_norm),
                )
            for name, (x, scale) in inputs.items():
                ids = guess_ids(x.cpu(), scale.cpu(), router.cpu(), spec.top_k)
                row = {"layer": moe[p], "guess_from": name, **compare(ids, real, spec.num_experts)}
                print(json.dumps(row), flush=True)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
