"""`moelab bench decode` and `moelab bench prefill`: their flags, the engine they time, and the
result: a few lines on stderr (engine/bench/report.py) and, with --json, the JSON on stdout.

The runs are engine/bench/runner.py's, their bound engine/bench/bound.py's, the instruments
around them engine/bench/host_watch.py's, an --alternate-... comparison engine/bench/alternate.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.args import (
    CACHE_ADMISSIONS,
    _non_negative_int,
    _positive_int,
    add_engine_flags,
    parse_prefetch_rounds,
    parse_share,
)


def add_decode_parsers(kinds: argparse._SubParsersAction) -> None:
    for name, helptext in (
        ("decode", "decode tok/s at a batch size, beside the bound"),
        ("prefill", "prefill tok/s for a prompt length, beside the bound"),
    ):
        p = kinds.add_parser(name, help=helptext)
        p.add_argument(
            "--preset",
            help="a synthetic geometry (with --dummy-weights implied) "
            "instead of --model-path: tiny, small, qwen3-30b-a3b, qwen3.6-35b-a3b, "
            "qwen3-next-80b-a3b, gpt-oss-20b, gpt-oss-120b",
        )
        p.add_argument(
            "--arch", help="the preset's architecture by default (moelab synth's --arch)"
        )
        p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
        p.add_argument("--routing-skew", type=float, default=0.0)
        p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        p.add_argument(
            "--profile",
            action="store_true",
            help="print where the host spends its time (cProfile) to stderr",
        )
        p.add_argument(
            "--kernel-profile",
            action="store_true",
            help="print the device kernels of a few steps (torch.profiler) to stderr",
        )
        p.add_argument(
            "--trace",
            type=Path,
            default=None,
            metavar="FILE",
            help="with --kernel-profile: also write its timeline (host calls and device "
            "kernels) to FILE as a Chrome trace (Perfetto, chrome://tracing)",
        )
        if name == "decode":
            p.add_argument("--batch", type=int, default=1)
            p.add_argument("--tokens", type=int, default=64, help="timed tokens per sequence")
            p.add_argument("--warmup", type=int, default=32, help="untimed tokens first")
            p.add_argument(
                "--temperature",
                type=float,
                default=0.0,
                help="draw each token at this temperature, seeded per sequence (0: greedy); with "
                "CUDA graphs the draws run on the GPU (engine/runtime/graphs.py)",
            )
            p.add_argument(
                "--top-p", type=float, default=1.0, help="with --temperature: the draws' top-p"
            )
            p.add_argument(
                "--top-k",
                type=int,
                default=0,
                help="with --temperature: the draws' top-k (0: off; Qwen3 recommends 20)",
            )
            p.add_argument(
                "--repeats",
                type=_positive_int,
                default=1,
                help="timed runs in this process, each against the rates measured before and "
                "after it; the median run's figures are printed, and each run's tok/s "
                "(--profile profiles the first run)",
            )
            p.add_argument(
                "--alternate-prefetch-rounds",
                type=parse_prefetch_rounds,
                default=None,
                metavar="N",
                help="compare two settings in one process: the timed runs alternate between "
                "--moe-cpu-prefetch-rounds (A) and N (B) in the order A B B A, repeated (the "
                "pieces send their guesses in both; with 0 the wait ignores them); each pair's "
                "tok/s ratio and each side's periods by plan are printed",
            )
            p.add_argument(
                "--alternate-cpu-pin",
                choices=("cores", "isolate"),
                default=None,
                metavar="MODE",
                help="as --alternate-prefetch-rounds, between --moe-cpu-pin (A, cores or isolate) "
                "and MODE (B): the rest of the engine's threads are moved off the CPU expert "
                "workers' cores, or back, between runs",
            )
            p.add_argument(
                "--alternate-copy-ahead",
                type=parse_share,
                default=None,
                metavar="SHARE",
                help="as --alternate-prefetch-rounds, between --moe-copy-ahead (A) and SHARE (B): "
                "the share of the guesses' lead in which the guessed first device miss is copied "
                "ahead of the routing",
            )
            p.add_argument(
                "--alternate-cache-admission",
                choices=CACHE_ADMISSIONS,
                default=None,
                metavar="MODE",
                help="as --alternate-prefetch-rounds, between --moe-cache-admission (A) and MODE "
                "(B): where a decode step's fill goes in the expert cache's recency order "
                "(the cache's contents carry over from run to run)",
            )
            p.add_argument(
                "--alternate-cpu-redo-us",
                type=_non_negative_int,
                default=None,
                metavar="US",
                help="as --alternate-prefetch-rounds, between --moe-cpu-redo-us (A) and US (B): "
                "how long a CPU task may be in flight before an idle worker runs it again",
            )
        else:
            p.add_argument("--repeats", type=int, default=3)
            p.add_argument(
                "--warmup-tokens",
                type=_positive_int,
                default=None,
                metavar="N",
                help="the untimed first prompt's tokens (default: --prompt-tokens; a shorter one "
                "compiles the same chunks' kernels, where a long prompt's proof need not wait "
                "for it twice)",
            )
            p.add_argument(
                "--crossover",
                action="store_true",
                help="time short prompts both ways (route then fetch, or stream whole layers), "
                "and write the crossover into the bandwidth profile the engine reads",
            )
        p.add_argument(
            "--prompt-tokens",
            type=prompt_length,
            default=16 if name == "decode" else 2048,
            metavar="N|context[-N]",
            help="the prompts' tokens; `context-N` N tokens short of the context the engine "
            "advertises (max_context in the JSON), known once it has planned its memory, so "
            "that a context's proof, or decode after a near-full context, takes one process; "
            "`context`: the longest prompt that leaves room for the tokens each sequence "
            "generates",
        )
        add_engine_flags(p)
        for action in p._actions:
            if action.dest == "model_path":
                action.required = False
        p.set_defaults(run=_run)


@dataclass(frozen=True)
class ContextShort:
    """`--prompt-tokens context-N`: the advertised context less `tokens` (None: `context`,
    less the tokens each sequence generates), known once the engine has planned its memory."""

    tokens: int | None

    def length(self, max_context: int, generated: int) -> int:
        """The prompt's tokens against the engine's advertised context, where each sequence
        generates `generated` tokens after it; ValueError where they do not fit."""
        short = generated if self.tokens is None else self.tokens
        name = "context" if self.tokens is None else f"context-{self.tokens}"
        if short < generated:
            raise ValueError(
                f"--prompt-tokens {name} leaves room for {short} tokens, and each sequence "
                f"generates {generated}: give context-{generated} or more"
            )
        if short >= max_context:
            raise ValueError(
                f"--prompt-tokens {name} leaves no prompt: the engine advertises a context of "
                f"{max_context} tokens"
            )
        return max_context - short


def prompt_length(text: str) -> int | ContextShort:
    """--prompt-tokens of bench decode and prefill: a positive count, `context` or
    `context-N`."""
    word, dash, short = text.partition("-")
    if word == "context":
        try:
            return ContextShort(_positive_int(short) if dash else None)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected context-N with N a positive number of tokens, got {text!r}"
            ) from None
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of tokens, `context` or `context-N`, got {text!r}"
        ) from None


def preset_config(args: argparse.Namespace) -> dict:
    """The config.json of a --preset's synthetic geometry: of --arch, else of the architecture
    the preset is the geometry of (moelab synth's rule)."""
    from ..model.synth import make_config, parse_overrides, preset_arch

    config = make_config(
        args.arch or preset_arch(args.preset), args.preset, parse_overrides(args.set)
    )
    config["moelab_synth"] = {
        "preset": args.preset,
        "seed": args.seed,
        "routing_skew": args.routing_skew,
    }
    return config


def open_engine(args: argparse.Namespace, workdir: Path):
    """The engine a bench command times: --model-path's, or a --preset's synthetic geometry
    (its config.json written into `workdir`, dummy weights)."""
    from ..config.config import EngineConfig
    from ..model.spec import ModelSpec
    from ..runtime.engine import Engine

    if args.preset:
        config = preset_config(args)
        (workdir / "config.json").write_text(json.dumps(config))
        args.model_path = str(workdir)
        args.dummy_weights = True
        return Engine(EngineConfig.from_args(args), spec=ModelSpec.from_config(config))
    if not args.model_path:
        raise ValueError("give --model-path DIR or --preset NAME")
    return Engine(EngineConfig.from_args(args))


# the flags whose runs need pieces that send routing guesses: the --alternate-... flag of each,
# and its own dest (the engine starts with the larger of the two sides)
_GUESSING = {
    "--moe-cpu-prefetch-rounds": ("--alternate-prefetch-rounds", "moe_cpu_prefetch_rounds"),
    "--moe-copy-ahead": ("--alternate-copy-ahead", "moe_copy_ahead"),
}


def _run(args: argparse.Namespace) -> int:
    from .alternate import alternated_sides
    from .report import decode_text, prefill_text
    from .runner import decode_runs, prefill_run, sampling_params

    if getattr(args, "trace", None) is not None and not args.kernel_profile:
        print("moelab bench decode: --trace needs --kernel-profile", file=sys.stderr)
        return 2
    if args.bench == "decode":
        try:  # a wrong --temperature, --top-p or --top-k, before the model loads
            sampling_params(args, 1)
        except ValueError as err:
            print(f"moelab bench decode: {err}", file=sys.stderr)
            return 2
    sides = alternated_sides(args) if args.bench == "decode" else None
    if isinstance(sides, str):
        print(f"moelab bench decode: {sides}", file=sys.stderr)
        return 2
    guessing = sides is not None and sides.flag in _GUESSING
    if guessing:  # the pieces are captured sending guesses
        setattr(args, _GUESSING[sides.flag][1], max(sides.values))
    with tempfile.TemporaryDirectory() as workdir:
        engine = open_engine(args, Path(workdir))
        try:
            if guessing and (engine.graphs is None or engine.graphs.routing_guess is None):
                print(
                    f"moelab bench decode: {_GUESSING[sides.flag][0]} needs pieces that send "
                    "routing guesses: offloaded decode on CUDA with its graphs and the native "
                    "planner",
                    file=sys.stderr,
                )
                return 2
            if sides is not None:
                try:  # each side once, so that one the engine cannot take is refused now
                    for value in reversed(sides.values):
                        sides.apply(engine, value)
                except ValueError as err:
                    print(f"moelab bench decode: {sides.flag} {value}: {err}", file=sys.stderr)
                    return 2
            if isinstance(args.prompt_tokens, ContextShort):
                # a decode run's sequences generate its warm-up, or its timed tokens and one
                generated = max(args.warmup, args.tokens + 1) if args.bench == "decode" else 1
                try:
                    args.prompt_tokens = args.prompt_tokens.length(
                        engine.plan.max_context, generated
                    )
                except ValueError as err:
                    print(f"moelab bench {args.bench}: {err}", file=sys.stderr)
                    return 2
            if args.bench == "decode":
                result = decode_runs(engine, args, sides)
            else:
                result = prefill_run(engine, args)
        finally:
            engine.close()
    spec = engine.spec
    plan = engine.plan
    result.update(
        model=spec.arch,
        layers=spec.num_layers,
        experts=spec.num_experts,
        top_k=spec.top_k,
        slots=plan.slots,
        experts_total=plan.experts_total,
        kv_cache_dtype=engine.config.memory.kv_cache_dtype,
        kv_tokens=plan.kv_tokens,
        max_context=plan.max_context,
        device=str(engine.device),
        dtype=str(engine.dtype)[6:],
        expert_dtype=engine.bank.fmt,  # "fp8", "mxfp4", "nvfp4" or "bf16": the compute dtype
        expert_bytes=engine.bank.expert_bytes,
        gpu=torch.cuda.get_device_name(0) if engine.device.type == "cuda" else None,
        policy=engine.policy.mode,
        fetch_fraction=engine.policy.fetch_fraction,  # at the end: auto follows the CPU rate
        policy_bh_gbps=engine.policy.bh_gbps,
        budget_bytes=plan.budget_bytes,
        # the most device memory torch held at once (None off CUDA): what the plan's budget
        # really cost, transients included
        peak_device_bytes=(
            torch.cuda.max_memory_allocated(engine.device) if engine.device.type == "cuda" else None
        ),
    )
    if args.bench == "decode":
        print(decode_text(result, args, engine.policy), file=sys.stderr)
    else:
        print(prefill_text(result), file=sys.stderr)
    if result["peak_device_bytes"] is not None:
        peak, budget = result["peak_device_bytes"] / 2**30, plan.budget_bytes / 2**30
        print(f"device memory: {peak:.2f} GiB held at most, of a {budget:.2f} GiB budget",
              file=sys.stderr)  # fmt: skip
    if args.json:
        print(json.dumps(result))
    return 0
