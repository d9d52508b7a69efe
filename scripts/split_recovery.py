"""The auto miss split's way back to the CPU, on a real engine: decode with the auto policy, then
set the CPU rate it plans with as low as a collapse left it, and watch it come back.

Usage: python scripts/split_recovery.py [--collapse 0.05] [--segments 8] [--segment-tokens 32]
           -- BENCH_DECODE_FLAGS...
e.g.   python scripts/split_recovery.py -- --preset qwen3-30b-a3b --set num_hidden_layers=12 \\
           --routing-skew 1 --moe-cache-rate 0.25

The engine is built as `moelab bench decode` builds it (the same flags), warmed up by
`--warmup` tokens, and then decodes a sequence in each segment of `--segment-tokens` tokens: the
first as the policy left it, then with the rate set to `--collapse` times the start-up one (as
low as a collapse leaves it: docs/performance.md), which `MoERunner._note_cpu_use` moves back
(docs/cpu-experts.md). One JSON line per segment: its tok/s
(its prefill untimed), its CPU jobs, the misses it fetched and ran on the CPU, the share of misses
the policy fetches and the CPU rate it plans with at the segment's end, and the returns logged
so far (the first line also the start-up CPU rate).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

from moelab.engine.bench import add_bench_parser
from moelab.engine.bench_decode import open_engine
from moelab.engine.bench_runner import timed_decode
from moelab.engine.misses import MissPolicy
from moelab.engine.sampling import SamplingParams


class Returns(logging.Handler):
    """Counts the split's returns to the CPU that the engine logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("auto miss split: "):
            self.count += 1


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    split = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:split], argv[split + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collapse", type=float, default=0.05, help="of the start-up CPU rate")
    p.add_argument("--segments", type=int, default=8, help="segments after the collapse")
    p.add_argument("--segment-tokens", type=int, default=32)
    script = p.parse_args(own)
    top = argparse.ArgumentParser(prog="moelab")
    add_bench_parser(top.add_subparsers(dest="command", required=True))
    bench = top.parse_args(["bench", "decode", *flags])
    bench.tokens = script.segment_tokens
    if bench.moe_miss_policy != "auto":
        p.error("the way back is the auto policy's: leave --moe-miss-policy at auto")
    return script, bench


def segment(engine, bench: argparse.Namespace, prompt: list[int]) -> dict:
    """One sequence of `bench.tokens` tokens, timed as `bench decode` times a run; the segment's
    figures."""
    timed = timed_decode(engine, bench, [prompt], profile=False)
    counts, policy = timed["counts"], engine.moe.policy
    return {
        "tok_s": round(bench.tokens / timed["elapsed"], 1),
        "cpu_jobs": timed["cpu_jobs"]["jobs"],
        "fetched": int(counts["fills"].sum()),
        "on_cpu": int(counts["cpu"].sum()),
        "fetch_fraction": round(policy.fetch_fraction, 3),
        "cpu_gbps_planned": policy.bh_gbps,
    }


def main(argv: list[str]) -> int:
    script, bench = parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    returns = Returns()
    logging.getLogger("moelab.engine").addHandler(returns)
    with tempfile.TemporaryDirectory() as workdir:
        engine = open_engine(bench, Path(workdir))
        try:
            moe = engine.moe
            if moe.policy.mode != "auto" or moe.policy.bh_gbps is None:
                print("split_recovery: this engine has no auto split (all experts resident?)",
                      file=sys.stderr)  # fmt: skip
                return 2
            gen = torch.Generator().manual_seed(1)
            prompt = torch.randint(0, engine.spec.vocab_size, (bench.prompt_tokens,),
                                   generator=gen).tolist()  # fmt: skip
            engine.generate([prompt], SamplingParams(max_tokens=bench.warmup, ignore_eos=True))
            first = segment(engine, bench, prompt)
            print(json.dumps({"segment": "before", **first, "returns": returns.count,
                              "cpu_gbps_start": moe._bh_start}), flush=True)  # fmt: skip
            collapsed = script.collapse * moe._bh_start
            moe.policy = MissPolicy.auto(moe.policy.bp_gbps, collapsed)
            for i in range(script.segments):
                row = segment(engine, bench, prompt)
                print(json.dumps({"segment": i, **row, "returns": returns.count}), flush=True)
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
