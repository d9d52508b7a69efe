"""The one-token decode MoE launches over each expert format, eagerly, for a profiler to read.

Run under Nsight Compute (`gpu_suite.sh OUT ncu_moe` does): each format's two launches (gate/up
and down, `reduce=False`: no sum launch) at Qwen3-30B-A3B's expert shape (H 2048, I 768, 128
experts, 8 routes) or gpt-oss-120b's (`--shape gpt-oss`: H = I = 2880, 4 routes, biases and the
clamped SwiGLU), `--calls` times, with the tiles the engine chooses or those `--fp4-tiles` names.
Nothing is timed here: the profiler's per-kernel duration, DRAM throughput, occupancy and warp
stall reasons are the figures. `--device cpu --shape tiny` under TRITON_INTERPRET=1: a smoke
test.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from moelab.kernels import fp8, fused_moe, mxfp4, mxfp4_moe, nvfp4, nvfp4_moe
from moelab.kernels.fp4_one_token import OneTokenFP4Config

FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")
SHAPES = {
    "qwen3": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8, "limit": 0.0},
    # gpt-oss-120b's experts (the kernel bench's GPT_OSS_EXPERTS, with the model's 128 experts)
    "gpt-oss": {"hidden": 2880, "inter": 2880, "experts": 128, "top_k": 4, "limit": 7.0},
    "tiny": {"hidden": 256, "inter": 128, "experts": 8, "top_k": 2, "limit": 0.0},  # smoke test
}


def parse_tiles(text: str) -> OneTokenFP4Config:
    """'16x512,16x512,4w,3s[,1ds]': gate/up rows x step, down rows x step, warps, gate/up's
    stages and down's (1 where left out)."""
    gate_up, down, warps, stages, *down_stages = text.split(",")
    (gn, gk), (dn, dk) = (map(int, part.split("x")) for part in (gate_up, down))
    return OneTokenFP4Config(
        gn, gk, dn, dk, int(warps.rstrip("w")), int(stages.rstrip("s")),
        int(down_stages[0].rstrip("ds")) if down_stages else 1,
    )  # fmt: skip


def launches(fmt: str, shape: dict, fp4_tiles: OneTokenFP4Config | None, device: str):
    """A callable running one token through `fmt`'s one-token launches at `shape`."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, inter, experts, top_k = (shape[k] for k in ("hidden", "inter", "experts", "top_k"))

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        out = torch.empty(*size, device=device, dtype=torch.bfloat16)
        return out.normal_(0.0, scale, generator=gen)

    x = randn(1, hidden)
    keys = torch.rand(1, experts, generator=gen, device=device)
    slots = keys.topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(1, top_k, generator=gen, device=device)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    extra: dict = {"reduce": False}
    if shape["limit"]:
        extra |= {
            "w13_bias": randn(experts, 2 * inter, scale=0.1),
            "w2_bias": randn(experts, hidden, scale=0.1),
            "swiglu_limit": shape["limit"],
        }
    if fmt == "bf16":
        return partial(fused_moe.fused_moe_decode_triton, x, slots, weights, w13, w2, **extra)
    if fmt == "fp8":
        (q13, s13), (q2, s2) = fp8.quantize(w13), fp8.quantize(w2)
        return partial(
            fused_moe.fused_moe_decode_triton, x, slots, weights, q13, q2, w13_scale_inv=s13,
            w2_scale_inv=s2, **extra,
        )  # fmt: skip
    if fmt == "mxfp4":
        (q13, s13), (q2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        return partial(
            mxfp4_moe.fused_moe_decode_mxfp4, x, slots, weights, q13, q2, s13, s2,
            config=fp4_tiles, **extra,
        )  # fmt: skip
    # gate and up quantized apart, each with its per-tensor scale, as ModelOpt writes them
    gate, up = nvfp4.quantize(w13[:, :inter]), nvfp4.quantize(w13[:, inter:])
    q2, s2, t2 = nvfp4.quantize(w2)
    return partial(
        nvfp4_moe.fused_moe_decode_nvfp4, x, slots, weights, torch.cat([gate[0], up[0]], 1), q2,
        torch.cat([gate[1], up[1]], 1), s2, torch.stack([gate[2], up[2]], 1), t2[:, None],
        config=fp4_tiles, **extra,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--formats", default=",".join(FORMATS), help="of " + ", ".join(FORMATS))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    parser.add_argument("--calls", type=int, default=2, help="calls of each format (default 2)")
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda (default); cpu under TRITON_INTERPRET=1 (a smoke test)",
    )
    parser.add_argument(
        "--fp4-tiles", type=parse_tiles, help="the 4-bit launches' tiles: 16x512,16x512,4w,3s,1ds"
    )
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    shape = SHAPES[args.shape]
    if args.shape == "gpt-oss" and "nvfp4" in formats:
        parser.error("--shape gpt-oss: gpt-oss ships MXFP4; leave nvfp4 out")
    for fmt in formats:
        call = launches(fmt, shape, args.fp4_tiles, args.device)
        for _ in range(args.calls):
            call()
        if args.device != "cpu":
            torch.cuda.synchronize()
        print(f"{fmt}: {args.calls} calls at {args.shape}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
