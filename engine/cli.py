"""`moelab`: synth, generate, serve and bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config.args import add_engine_flags, parse_bytes
from .model.spec import CheckpointError


def _synth_parser(sub: argparse._SubParsersAction) -> None:
    from .model.synth import ARCHS, PRESETS
    from .model.synth_tokenizer import CHAT_TEMPLATES
    from .synth_checkpoint import DTYPES as SYNTH_DTYPES

    p = sub.add_parser("synth", help="write a synthetic checkpoint in Hugging Face layout")
    p.add_argument("--out", required=True, help="directory to write the checkpoint into")
    p.add_argument(
        "--arch",
        choices=ARCHS,
        help="the architecture (qwen3_5_moe: Qwen3.5/3.6 MoE's multimodal layout, "
        "qwen3_5_moe_text: its text-only one); by default the preset's, qwen3_moe for tiny "
        "and small; a real geometry's preset takes only its own",
    )
    p.add_argument(
        "--preset",
        default="tiny",
        choices=list(PRESETS),
        help="tiny (CI-sized), small (~1 GB); the real geometries qwen3-30b-a3b, "
        "qwen3.6-35b-a3b (qwen3_5_moe), qwen3-next-80b-a3b (qwen3_next), gpt-oss-20b and "
        "gpt-oss-120b (gpt_oss)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field, e.g. --set num_experts=64 (repeatable)",
    )
    p.add_argument(
        "--routing-skew",
        type=float,
        default=0.0,
        help="expert popularity follows a Zipf law of this exponent; 0 = uniform",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat-template",
        choices=list(CHAT_TEMPLATES),
        help="qwen3 (tool calls as JSON in <tool_call> blocks, <think> reasoning), "
        "qwen3_thinking (the same, the reply's reasoning opened by the prompt), qwen3_coder "
        "(tool calls as <function=...> blocks), qwen3_5 (tool calls as <function=...> blocks, "
        "the reasoning opened by the prompt unless enable_thinking is false) or gpt_oss "
        "(gpt-oss's harmony format, with its special tokens: channels for the reasoning, the "
        "answer and the calls); by default qwen3_5 for qwen3_5_moe, gpt_oss for gpt_oss, else "
        "qwen3",
    )
    p.add_argument(
        "--no-weights",
        action="store_true",
        help="write all but the weights: serve the checkpoint with --dummy-weights, which builds "
        "them in memory (for benchmarks of a geometry too big to write out)",
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        choices=list(SYNTH_DTYPES),
        help="fp8: linear weights in Hugging Face's fine-grained FP8 layout (e4m3, one fp32 "
        "factor per 128x128 block); embeddings, norms, routers and lm_head stay bf16. mxfp4 "
        "(--arch gpt_oss): the experts in MXFP4 _blocks and _scales, as gpt-oss ships. nvfp4: "
        "the fp8 layout's linear weights in NVIDIA's ModelOpt NVFP4 layout (e2m1, one e4m3 scale "
        "per 16 values and an fp32 scale per tensor)",
    )
    p.add_argument(
        "--shard-size",
        type=parse_bytes,
        default=parse_bytes("2GiB"),
        help="largest safetensors shard (bigger checkpoints get an index)",
    )


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run one prompt through the engine (greedy by default)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--min-p", type=float, default=0.0, help="0: off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"prompt_ids": [...], "output_ids": [...], "text": ...}',
    )
    add_engine_flags(p)


def build_parser() -> argparse.ArgumentParser:
    """`moelab` and every subcommand."""
    from .bench.bandwidth import add_bench_parser
    from .serving.serve_cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="moelab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _synth_parser(sub)
    _generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return args.run(args) if hasattr(args, "run") else _dispatch(args)
    except (CheckpointError, ValueError) as err:
        print(f"moelab {args.command}: {err}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "synth":
        from .model.synth import parse_overrides
        from .synth_checkpoint import synthesize

        out = synthesize(
            args.out,
            arch=args.arch,
            preset=args.preset,
            overrides=parse_overrides(args.set),
            seed=args.seed,
            routing_skew=args.routing_skew,
            shard_bytes=args.shard_size,
            chat_template=args.chat_template,
            weights=not args.no_weights,
            dtype=args.dtype,
        )
        print(out)
        return 0
    if args.command == "generate":
        return _generate(args)
    raise AssertionError(args.command)


def _generate(args: argparse.Namespace) -> int:
    from .config.config import EngineConfig
    from .runtime.engine import Engine
    from .runtime.sampling import SamplingParams

    # the sampling first: a wrong value is refused before the model loads
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
    )
    engine = Engine(EngineConfig.from_args(args))
    try:
        if args.prompt_ids is not None:
            try:
                prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
            except ValueError:
                raise ValueError("--prompt-ids takes comma-separated integers") from None
            bad = [t for t in prompt_ids if not 0 <= t < engine.spec.vocab_size]
            if bad:
                raise ValueError(
                    f"--prompt-ids {bad[:5]} outside the vocabulary "
                    f"(0..{engine.spec.vocab_size - 1})"
                )
        else:
            if engine.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json; use --prompt-ids")
            text = args.prompt
            if args.chat:
                text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            # a plain prompt gets the tokenizer's BOS, as /v1/completions gives it; a chat
            # template writes its own
            prompt_ids = engine.tokenizer.encode(text, add_special_tokens=not args.chat)
        [output] = engine.generate([prompt_ids], params)
        text = engine.tokenizer.decode(output) if engine.tokenizer else ""
        if args.json:
            print(
                json.dumps(
                    {"prompt_ids": prompt_ids, "output_ids": output, "text": text},
                    ensure_ascii=False,
                )
            )
        else:
            print(text)
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
