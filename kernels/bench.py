"""Kernel benchmark at Qwen3-30B-A3B shapes (the Gated DeltaNet's at Qwen3.6-35B-A3B's): time,
GB/s and TFLOP/s against the device's ceilings.

    python -m moelab.kernels.bench [--json] [--sweep]

Measures the device's copy bandwidth and bf16 matmul rate first, then each kernel. Decode kernels
run as they do in the engine, captured in a CUDA graph, and each call of the graph reads different
weights or KV pages (as successive layers do), so the L2 cache does not serve them. The torch
reference runs eagerly on the same inputs beside it; the dense projections' reference, cuBLAS
(F.linear), runs in graphs too and has rows of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import (
    draw,
    fp8,
    fp8_kv,
    fused_moe,
    gated_deltanet,
    gemv,
    grouped_moe,
    host_handoff,
    mxfp4,
    mxfp4_moe,
    nvfp4,
    nvfp4_moe,
    paged_attention,
    rmsnorm,
    rope_kv,
    route,
    router,
)
from .fp4_one_token import OneTokenFP4Config
from .fused_moe_one_token import OneTokenMoEConfig
from .measure import (
    Result,
    eager_us_per_call,
    graph_us_per_call,
    measure_copy_gbps,
    measure_matmul_tflops,
    median_event_us,
)

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 128, 16
VOCAB = 151936
# Dense projections of a decode step, weight [N, K]: the fused qkv, o, and lm_head.
PROJECTIONS = {
    "qkv": ((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, Q_HEADS * HEAD_DIM),
    "lm_head": (VOCAB, HIDDEN),
}
# Qwen3.6-35B-A3B's Gated DeltaNet layers: H key heads and HV value heads of DK = DV, a convolution
# W wide over the q, k and v channels
LINEAR_HEADS, LINEAR_V_HEADS, LINEAR_HEAD_DIM, CONV_WIDTH = 16, 32, 128, 4
DEVICE = "cuda"
DTYPE = torch.bfloat16
ELEM_BYTES = 2
EXPERT_BYTES = 3 * HIDDEN * INTER * ELEM_BYTES
# An FP8 expert: its values and the fp32 factors of its 128x128 blocks.
FP8_EXPERT_BYTES = 3 * HIDDEN * INTER + 4 * (
    fp8.blocks(2 * INTER) * fp8.blocks(HIDDEN) + fp8.blocks(HIDDEN) * fp8.blocks(INTER)
)
# An MXFP4 expert: two values a byte and an E8M0 scale byte per 32 values.
MXFP4_EXPERT_BYTES = 3 * HIDDEN * INTER // 2 + 3 * HIDDEN * INTER // mxfp4.BLOCK
# An NVFP4 expert: two values a byte, an e4m3 scale byte per 16 values, three fp32 tensor scales.
NVFP4_EXPERT_BYTES = 3 * HIDDEN * INTER // 2 + 3 * HIDDEN * INTER // nvfp4.BLOCK + 3 * 4
# gpt-oss-120b's experts (docs/models.md): H = I = 2880, 4 routes a token, a bias on each
# projection and the SwiGLU clamped at 7. A layer's bank holds 16 experts rather than 128, so that
# the layers' copies the graph cycles through fit beside each other; each call reads the same 4
# experts' bytes either way.
GPT_OSS_EXPERTS = {"hidden": 2880, "inter": 2880, "experts": 16, "top_k": 4, "limit": 7.0}
# Bytes each graph of calls reads at least, so that the GPU's L2 cache (tens of MiB) cannot hold
# them; calls that read less over MAX_CALLS_PER_GRAPH are bound by launches, not by memory.
MIN_WORKING_SET_BYTES = 512 << 20
MAX_CALLS_PER_GRAPH = 64
FUSED_SDPA = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
)


# The 4-bit decode's launches that --sweep times at T=1 beside the default (the one-token
# launches at choose_config's tiles): the one-token ones at other tiles (OneTokenFP4Config
# fields: gate/up rows and columns a step, down rows and columns a step, warps, gate/up's stages,
# down's at the config's one; rows x columns / 32 at least the threads, each a 16-byte vector a
# step), and the tl.dot ones at their
# default tiles and others (DotDecodeConfig: rows a program, columns a step).
FP4_ONE_TOKEN_SWEEP = (
    (8, 512, 16, 256, 4, 2),
    (8, 512, 16, 256, 4, 4),
    (8, 512, 16, 256, 4, 3),
    (4, 1024, 8, 512, 4, 3),
    (8, 256, 8, 256, 2, 3),
    (16, 512, 32, 256, 8, 3),
    (8, 1024, 16, 512, 4, 2),
    (16, 1024, 32, 512, 8, 2),
    (32, 256, 16, 512, 4, 3),  # gpt-oss-120b's gate/up rows in one wave of programs
)
FP4_DOT_SWEEP = ((16, 256), (32, 256), (16, 512), (32, 512))

# Tiles of the one-token decode MoE that --sweep times (OneTokenMoEConfig fields: gate/up rows
# and step, down rows and step, warps, stages), beside the chooser's pick.
ONE_TOKEN_MOE_SWEEP = (
    (8, 256, 16, 256, 4, 3),
    (8, 256, 32, 256, 4, 3),
    (16, 128, 32, 128, 4, 3),
    (4, 512, 8, 256, 4, 3),
    (8, 256, 16, 256, 4, 4),
    (8, 512, 16, 256, 8, 3),
    (8, 256, 16, 256, 2, 3),
)

# The same for an FP8 bank (the engine's form: reduce=False), whose steps of a given width read
# half the bytes: the 4-byte words' loops take about 5 instructions a weight at steps of 512
# (16 rows) against 5.8 at 256, and one stage keeps the loads in registers as 4-bit down's do.
ONE_TOKEN_FP8_MOE_SWEEP = (
    (8, 256, 16, 256, 4, 3),
    (8, 512, 16, 512, 4, 3),
    (4, 512, 8, 512, 4, 4),
    (16, 256, 32, 256, 4, 2),
    (16, 256, 32, 256, 4, 1),
    (16, 512, 32, 512, 4, 3),
    (16, 512, 32, 512, 4, 2),
    (16, 512, 32, 512, 4, 1),
    (16, 512, 16, 1024, 4, 1),
    (32, 256, 32, 512, 4, 1),
    (16, 512, 32, 256, 8, 3),
    (16, 256, 64, 256, 8, 3),
)

# route's launch shapes that --sweep times (RouteConfig: program bytes, tile elements, warps,
# stages), one token with the host's copy
ROUTE_SWEEP = (
    (8 * 1024, 2048, 1, 3),
    (4 * 1024, 2048, 1, 3),
    (16 * 1024, 4096, 1, 3),
    (8 * 1024, 4096, 2, 3),
    (16 * 1024, 8192, 4, 3),
    (4 * 1024, 1024, 1, 2),
)
# The delta rule's decode launches that --sweep times (DeltaDecodeConfig: value columns per
# program, warps), beside the default's row.
DELTA_DECODE_SWEEP = ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (64, 4), (64, 8), (128, 8))
# Tiles of the skinny GEMM that --sweep times at each batch size, beside the heuristic's pick.
GEMV_SWEEP = {
    1: [
        gemv.GemvConfig(block_n, block_k, split_k, warps, stages)
        for block_n, block_k, split_k, warps, stages in (
            (2, 2048, 1, 4, 3),
            (4, 1024, 1, 4, 3),
            (8, 512, 1, 4, 3),
            (16, 256, 1, 4, 3),
            (8, 512, 1, 4, 1),
            (8, 1024, 1, 8, 4),
            (16, 512, 2, 4, 3),
        )
    ],
    8: [
        gemv.GemvConfig(block_n, block_k, split_k, warps, stages)
        for block_n, block_k, split_k, warps, stages in (
            (16, 256, 1, 4, 4),
            (16, 256, 2, 4, 4),
            (16, 256, 4, 4, 4),
            (32, 256, 2, 4, 4),
            (16, 512, 4, 4, 3),
        )
    ],
}


def layers_for(bytes_per_call: int) -> int:
    """How many distinct copies (layers) of the data one graph cycles through."""
    wanted = math.ceil(MIN_WORKING_SET_BYTES / max(bytes_per_call, 1))
    return max(2, min(MAX_CALLS_PER_GRAPH, wanted))


class Bench:
    """Runs the kernels at real shapes and collects one Result per case."""

    def __init__(self, copy_gbps: float, matmul_tflops: float) -> None:
        self.copy_gbps = copy_gbps
        self.matmul_tflops = matmul_tflops
        self.results: list[Result] = []
        self.notes: list[str] = []
        self.gen = torch.Generator(device=DEVICE).manual_seed(0)

    def add(
        self,
        kernel: str,
        shape: str,
        time_us: float,
        bytes_moved: int,
        flops: int,
        ref_us: float | None,
    ) -> None:
        result = Result(
            kernel, shape, time_us, bytes_moved, flops, ref_us, self.copy_gbps, self.matmul_tflops
        )
        self.results.append(result)
        print(
            f"  {kernel:<18} {shape:<40} {time_us:9.1f} us  {result.gbps:7.0f} GB/s "
            f"({result.bw_share:4.0%})",
            file=sys.stderr,
            flush=True,
        )

    def note(self, text: str) -> None:
        if text in self.notes:  # said once, for every row it concerns
            return
        self.notes.append(text)
        print(f"  note: {text}", file=sys.stderr, flush=True)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        out = torch.empty(*shape, device=DEVICE, dtype=DTYPE)
        return out.normal_(0.0, scale, generator=self.gen)

    def routes(self, tokens: int, first: int, count: int, top_k: int | None = None) -> torch.Tensor:
        """[tokens, top_k] distinct picks per token from range(first, first + count); top_k
        TOP_K where None."""
        keys = torch.rand(tokens, count, generator=self.gen, device=DEVICE)
        return (keys.topk(top_k or TOP_K, dim=1).indices + first).to(torch.int32)

    def fused_moe(
        self,
        tokens: int,
        config: fused_moe.DecodeMoEConfig | OneTokenMoEConfig | None = None,
        with_ref: bool = True,
        reduce: bool = True,
    ) -> None:
        """Decode MoE: each call is one layer's 128 experts, all resident in slots. reduce=False
        times the engine's form (the routes' outputs unsummed; the next norm sums them)."""
        layers = layers_for(EXPERT_BYTES * min(EXPERTS, tokens * TOP_K))
        w13 = self.randn(layers * EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
        w2 = self.randn(layers * EXPERTS, HIDDEN, INTER, scale=INTER**-0.5)
        x = self.randn(tokens, HIDDEN)
        weights = torch.rand(tokens, TOP_K, generator=self.gen, device=DEVICE)
        slot_sets = [self.routes(tokens, layer * EXPERTS, EXPERTS) for layer in range(layers)]
        unique = sum(s.unique().numel() for s in slot_sets) / layers
        out_bytes = tokens * HIDDEN * 4 * (1 if reduce else TOP_K)
        bytes_moved = int(unique * EXPERT_BYTES) + tokens * HIDDEN * ELEM_BYTES + out_bytes
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER

        def call(slots: torch.Tensor) -> Callable[[], object]:
            return lambda: fused_moe.fused_moe_decode_triton(
                x, slots, weights, w13, w2, config=config, reduce=reduce
            )

        time_us = graph_us_per_call([call(s) for s in slot_sets])
        ref_us = None
        if with_ref:
            ref_calls = [self._moe_ref(x, s, weights, w13, w2) for s in slot_sets[:2]]
            ref_us = eager_us_per_call(ref_calls)
        label = f"T={tokens} K={TOP_K} H={HIDDEN} I={INTER}" + ("" if reduce else " parts")
        if config is not None:
            path = "one-token" if isinstance(config, OneTokenMoEConfig) else "tl.dot"
            label += f" {path} {_short(config)}"
        self.add(
            "fused_moe_decode",
            label,
            time_us,
            bytes_moved,
            flops,
            ref_us,
        )

    def handoff(self, tokens: int, parts: int = 1) -> None:
        """The end of an offloaded decode layer step: the routes' sum of the fused MoE's parts
        plus the CPU experts' part, read over PCIe from pinned memory once its epoch is done
        (here done before the launch, so what is timed is the handoff's own cost). The
        reference is torch's sum of the device parts alone: the launch the handoff costs above."""
        ys = [
            torch.randn(tokens, TOP_K, HIDDEN, device=DEVICE, generator=self.gen)
            for _ in range(parts)
        ]
        cpu_part = torch.randn(tokens, HIDDEN).pin_memory()
        sync = host_handoff.handoff_sync(pin=True)
        sync[host_handoff.DONE] = sync[host_handoff.EXPECTED] = 1
        calls = [lambda: host_handoff.sum_when_ready_triton(ys, cpu_part, sync)] * 16
        time_us = graph_us_per_call(calls)
        if sync[host_handoff.TIMED_OUT]:
            raise RuntimeError("sum_when_ready timed out with its epoch done")

        def device_sum() -> torch.Tensor:
            out = ys[0].sum(dim=1)
            for y in ys[1:]:
                out += y.sum(dim=1)
            return out

        ref_us = graph_us_per_call([device_sum] * 16)
        bytes_moved = tokens * HIDDEN * 4 * (parts * TOP_K + 2)  # the parts, the CPU's, out
        label = f"T={tokens} K={TOP_K} H={HIDDEN}, {parts} device part{'s' * (parts > 1)}"
        self.add("sum_when_ready", label, time_us, bytes_moved, 0, ref_us)

    def handoff_norm(self, tokens: int) -> None:
        """The handoff as the engine runs it where nothing is added to the routed output (no
        shared expert): the cached and the filled routes' parts plus the CPU's part, into the
        residual and the next RMSNorm, in one launch at one token (the epoch done before it). The
        reference is the launches it replaces: sum_when_ready in the model's dtype, then the
        fused residual add and norm."""
        ys = [
            torch.randn(tokens, TOP_K, HIDDEN, device=DEVICE, generator=self.gen) for _ in range(2)
        ]
        cpu_part = torch.randn(tokens, HIDDEN).pin_memory()
        residual, weight = self.randn(tokens, HIDDEN), self.randn(HIDDEN)
        sync = host_handoff.handoff_sync(pin=True)
        sync[host_handoff.DONE] = sync[host_handoff.EXPECTED] = 1

        def fused() -> object:
            return host_handoff.sum_norm_when_ready_triton(
                ys, cpu_part, sync, residual, weight, 1e-6
            )

        def replaced() -> object:
            routed = host_handoff.sum_when_ready_triton(ys, cpu_part, sync, dtype=DTYPE)
            return rmsnorm.fused_add_rmsnorm_triton(routed, residual, weight, 1e-6)

        time_us = graph_us_per_call([fused] * 16)
        ref_us = graph_us_per_call([replaced] * 16)
        if sync[host_handoff.TIMED_OUT]:
            raise RuntimeError("sum_norm_when_ready timed out with its epoch done")
        # the parts, the CPU's, the residual in and out, the norm's output
        bytes_moved = tokens * HIDDEN * (4 * (2 * TOP_K + 1) + 3 * ELEM_BYTES)
        label = f"T={tokens} K={TOP_K} H={HIDDEN}, 2 device parts, + norm"
        self.add("sum_norm_when_ready", label, time_us, bytes_moved, 0, ref_us)

    def fused_moe_fp8(
        self,
        tokens: int,
        config: fused_moe.DecodeMoEConfig | OneTokenMoEConfig | None = None,
        reduce: bool = True,
    ) -> None:
        """Decode MoE over an FP8 bank, as `fused_moe` over a bf16 one; the bytes are the FP8
        values and their factors. The reference column holds the bf16 kernel's time on a bf16
        bank of as many layers, the same routes and x."""
        layers = layers_for(FP8_EXPERT_BYTES * min(EXPERTS, tokens * TOP_K))
        w13, w2, scales = self.fp8_bank(layers)
        x = self.randn(tokens, HIDDEN)
        weights = torch.rand(tokens, TOP_K, generator=self.gen, device=DEVICE)
        slot_sets = [self.routes(tokens, layer * EXPERTS, EXPERTS) for layer in range(layers)]
        unique = sum(s.unique().numel() for s in slot_sets) / layers
        out_bytes = tokens * HIDDEN * 4 * (1 if reduce else TOP_K)
        bytes_moved = int(unique * FP8_EXPERT_BYTES) + tokens * HIDDEN * ELEM_BYTES + out_bytes
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER

        def call(slots: torch.Tensor, bank: tuple, **kwargs: object) -> Callable[[], object]:
            return lambda: fused_moe.fused_moe_decode_triton(
                x, slots, weights, *bank, config=config, reduce=reduce, **kwargs
            )

        time_us = graph_us_per_call([call(s, (w13, w2), **scales) for s in slot_sets])
        bf16_us = None
        if config is None:
            del w13, w2, scales
            bf16 = (
                self.randn(layers * EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
                self.randn(layers * EXPERTS, HIDDEN, INTER, scale=INTER**-0.5),
            )
            bf16_us = graph_us_per_call([call(s, bf16) for s in slot_sets])
        label = f"T={tokens} K={TOP_K} H={HIDDEN} I={INTER}" + ("" if reduce else " parts")
        if config is not None:
            path = "one-token" if isinstance(config, OneTokenMoEConfig) else "tl.dot"
            label += f" {path} {_short(config)}"
        self.add("fused_moe_decode_fp8", label, time_us, bytes_moved, flops, bf16_us)

    def fp8_bank(self, copies: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """w13, w2 and their block factors of one layer's experts quantized by fp8.quantize, in
        `copies` copies of their own memory (one per layer): float8_e4m3fn, as a loader holds."""
        w13, s13 = fp8.quantize(self.randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5))
        w2, s2 = fp8.quantize(self.randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5))

        def copied(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.float8_e4m3fn:
                return t.view(torch.uint8).repeat(copies, 1, 1).view(t.dtype)
            return t.repeat(copies, 1, 1)

        scales = {"w13_scale_inv": copied(s13), "w2_scale_inv": copied(s2)}
        return copied(w13), copied(w2), scales

    def fused_moe_mxfp4(
        self, tokens: int, config: mxfp4_moe.DecodeConfig | None = None, reduce: bool = True
    ) -> None:
        """Decode MoE over an MXFP4 bank (mxfp4_moe.fused_moe_decode_mxfp4), with its default
        launches or those `config` names; reduce=False: each route's output (no sum launch)."""
        self._fused_moe_4bit(
            tokens, "mxfp4", MXFP4_EXPERT_BYTES, self.mxfp4_bank, mxfp4_moe.fused_moe_decode_mxfp4,
            config, reduce,
        )  # fmt: skip

    def fused_moe_mxfp4_gpt_oss(
        self,
        tokens: int,
        config: mxfp4_moe.DecodeConfig | None = None,
        geometry: dict | None = None,
    ) -> None:
        """Decode MoE over an MXFP4 bank at gpt-oss-120b's expert shape (GPT_OSS_EXPERTS, or
        `geometry`), its biases and clamped SwiGLU included, with the default launches or those
        `config` names; the bytes are the routed experts' values, scales and biases."""
        g = geometry or GPT_OSS_EXPERTS
        hidden, inter, experts, top_k = g["hidden"], g["inter"], g["experts"], g["top_k"]
        w13_bytes = 2 * inter * hidden // 2 + 2 * inter * hidden // mxfp4.BLOCK
        w2_bytes = hidden * inter // 2 + hidden * inter // mxfp4.BLOCK
        expert_bytes = w13_bytes + w2_bytes + (2 * inter + hidden) * ELEM_BYTES
        layers = layers_for(expert_bytes * min(experts, tokens * top_k))
        w13, s13 = mxfp4.quantize(self.randn(experts, 2 * inter, hidden, scale=hidden**-0.5))
        w2, s2 = mxfp4.quantize(self.randn(experts, hidden, inter, scale=inter**-0.5))
        bank = [t.repeat(layers, *([1] * (t.dim() - 1))) for t in (w13, w2, s13, s2)]
        del w13, w2, s13, s2
        b13 = self.randn(layers * experts, 2 * inter, scale=0.1)
        b2 = self.randn(layers * experts, hidden, scale=0.1)
        x = self.randn(tokens, hidden)
        weights = torch.rand(tokens, top_k, generator=self.gen, device=DEVICE)
        slot_sets = [
            self.routes(tokens, layer * experts, experts, top_k) for layer in range(layers)
        ]
        unique = sum(s.unique().numel() for s in slot_sets) / layers
        bytes_moved = int(unique * expert_bytes) + tokens * hidden * (ELEM_BYTES + 4)
        flops = 2 * tokens * top_k * 3 * hidden * inter
        kwargs = {"w13_bias": b13, "w2_bias": b2, "swiglu_limit": g["limit"], "config": config}
        calls = [
            partial(mxfp4_moe.fused_moe_decode_mxfp4, x, s, weights, *bank, **kwargs)
            for s in slot_sets
        ]
        time_us = graph_us_per_call(calls)
        label = f"T={tokens} K={top_k} H={hidden} I={inter} biased"
        if config is not None:
            path = "one-token" if isinstance(config, OneTokenFP4Config) else "tl.dot"
            label += f" {path} {_short(config)}"
        self.add("fused_moe_decode_mxfp4", label, time_us, bytes_moved, flops, None)

    def grouped_moe_mxfp4(self, tokens: int) -> None:
        """Prefill MoE over one layer's MXFP4 experts (mxfp4_moe.grouped_moe_mxfp4)."""
        self._grouped_moe_4bit(
            tokens, "mxfp4", MXFP4_EXPERT_BYTES, self.mxfp4_bank, mxfp4_moe.grouped_moe_mxfp4
        )

    def _fused_moe_4bit(
        self,
        tokens: int,
        fmt: str,
        expert_bytes: int,
        make_bank: Callable[[int], tuple[torch.Tensor, ...]],
        decode: Callable[..., torch.Tensor],
        config: mxfp4_moe.DecodeConfig | None = None,
        reduce: bool = True,
    ) -> None:
        """Decode MoE over a 4-bit bank (MXFP4 or NVFP4); the bytes are its values and their
        scales, of each slot the routes name (read once however many tokens name it). config:
        the decode's launches and tiles, its default where None; reduce=False: each route's
        output, without the sum's launch (as the engine calls it). The reference column holds
        the bf16 kernel's time on a bf16 bank of as many layers, the same routes and x."""
        layers = layers_for(expert_bytes * min(EXPERTS, tokens * TOP_K))
        bank = make_bank(layers)
        x = self.randn(tokens, HIDDEN)
        weights = torch.rand(tokens, TOP_K, generator=self.gen, device=DEVICE)
        slot_sets = [self.routes(tokens, layer * EXPERTS, EXPERTS) for layer in range(layers)]
        unique = sum(s.unique().numel() for s in slot_sets) / layers
        out_bytes = tokens * HIDDEN * 4 * (1 if reduce else TOP_K)
        bytes_moved = int(unique * expert_bytes) + tokens * HIDDEN * ELEM_BYTES + out_bytes
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        calls = [
            partial(decode, x, s, weights, *bank, config=config, reduce=reduce) for s in slot_sets
        ]
        time_us = graph_us_per_call(calls)
        del bank
        w13 = self.randn(layers * EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
        w2 = self.randn(layers * EXPERTS, HIDDEN, INTER, scale=INTER**-0.5)
        bf16 = partial(fused_moe.fused_moe_decode_triton, reduce=reduce)
        bf16_us = graph_us_per_call([partial(bf16, x, s, weights, w13, w2) for s in slot_sets])
        label = f"T={tokens} K={TOP_K} H={HIDDEN} I={INTER}" + ("" if reduce else " parts")
        if config is not None:
            path = "one-token" if isinstance(config, OneTokenFP4Config) else "tl.dot"
            label += f" {path} {_short(config)}"
        self.add(f"fused_moe_decode_{fmt}", label, time_us, bytes_moved, flops, bf16_us)

    def _grouped_moe_4bit(
        self,
        tokens: int,
        fmt: str,
        expert_bytes: int,
        make_bank: Callable[[int], tuple[torch.Tensor, ...]],
        grouped: Callable[..., torch.Tensor],
    ) -> None:
        """Prefill MoE over one layer's 4-bit experts (MXFP4 or NVFP4); the reference column
        holds the bf16 kernel's time on the same routes and x."""
        bank = make_bank(1)
        x = self.randn(tokens, HIDDEN)
        ids = self.routes(tokens, 0, EXPERTS)
        weights = torch.rand(tokens, TOP_K, generator=self.gen, device=DEVICE)
        used = ids.unique().numel()
        bytes_moved = used * expert_bytes + tokens * HIDDEN * (ELEM_BYTES + 4)
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        time_us = median_event_us(
            lambda: grouped(x, ids, weights, *bank, layer_experts=EXPERTS, checked=False), 10
        )
        bf16 = (
            self.randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
            self.randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5),
        )
        bf16_us = self._grouped_us(x, ids, weights, *bf16)
        label = f"T={tokens} K={TOP_K} E={EXPERTS}"
        self.add(f"grouped_moe_{fmt}", label, time_us, bytes_moved, flops, bf16_us)

    def mxfp4_bank(self, copies: int) -> tuple[torch.Tensor, ...]:
        """w13, w2 and their scales of one layer's experts quantized by mxfp4.quantize, in
        `copies` copies of their own memory (one per layer)."""
        w13, s13 = mxfp4.quantize(self.randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5))
        w2, s2 = mxfp4.quantize(self.randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5))
        return tuple(t.repeat(copies, *([1] * (t.dim() - 1))) for t in (w13, w2, s13, s2))

    def fused_moe_nvfp4(
        self, tokens: int, config: mxfp4_moe.DecodeConfig | None = None, reduce: bool = True
    ) -> None:
        """Decode MoE over an NVFP4 bank (nvfp4_moe.fused_moe_decode_nvfp4), with its default
        launches or those `config` names; reduce=False: each route's output (no sum launch)."""
        self._fused_moe_4bit(
            tokens, "nvfp4", NVFP4_EXPERT_BYTES, self.nvfp4_bank, nvfp4_moe.fused_moe_decode_nvfp4,
            config, reduce,
        )  # fmt: skip

    def grouped_moe_nvfp4(self, tokens: int) -> None:
        """Prefill MoE over one layer's NVFP4 experts (nvfp4_moe.grouped_moe_nvfp4)."""
        self._grouped_moe_4bit(
            tokens, "nvfp4", NVFP4_EXPERT_BYTES, self.nvfp4_bank, nvfp4_moe.grouped_moe_nvfp4
        )

    def nvfp4_bank(self, copies: int) -> tuple[torch.Tensor, ...]:
        """w13, w2, their block scales and their per-tensor scales of one layer's experts
        quantized by nvfp4.quantize (gate and up apart, as ModelOpt does), in `copies` copies of
        their own memory (one per layer)."""
        gate, up = (
            nvfp4.quantize(self.randn(EXPERTS, INTER, HIDDEN, scale=HIDDEN**-0.5)) for _ in range(2)
        )
        w2, s2, t2 = nvfp4.quantize(self.randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5))
        bank = (
            torch.cat([gate[0], up[0]], dim=1),
            w2,
            torch.cat([gate[1], up[1]], dim=1).view(torch.uint8),
            s2.view(torch.uint8),
            torch.stack([gate[2], up[2]], dim=1),
            t2[:, None],
        )
        copied = [t.repeat(copies, *([1] * (t.dim() - 1))) for t in bank]
        copied[2:4] = [t.view(torch.float8_e4m3fn) for t in copied[2:4]]
        return tuple(copied)

    @staticmethod
    def _moe_ref(
        x: torch.Tensor,
        slots: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> Callable[[], object]:
        return lambda: fused_moe.fused_moe_decode_ref(x, slots, weights, w13, w2)

    def grouped_moe(self, tokens: int) -> None:
        """Prefill MoE over one layer's experts in the prefill buffer."""
        w13 = self.randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
        w2 = self.randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5)
        x = self.randn(tokens, HIDDEN)
        ids = self.routes(tokens, 0, EXPERTS)
        weights = torch.rand(tokens, TOP_K, generator=self.gen, device=DEVICE)
        used = ids.unique().numel()
        bytes_moved = used * EXPERT_BYTES + tokens * HIDDEN * (ELEM_BYTES + 4)
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        time_us = self._grouped_us(x, ids, weights, w13, w2)
        ref_us = median_event_us(lambda: grouped_moe.grouped_moe_ref(x, ids, weights, w13, w2), 3)
        self.add(
            "grouped_moe", f"T={tokens} K={TOP_K} E={EXPERTS}", time_us, bytes_moved, flops, ref_us
        )

    def grouped_moe_fp8(self, tokens: int) -> None:
        """Prefill MoE over one layer's FP8 experts; the reference column holds the bf16
        kernel's time on the same routes and x."""
        w13, w2, scales = self.fp8_bank(1)
        x = self.randn(tokens, HIDDEN)
        ids = self.routes(tokens, 0, EXPERTS)
        weights = torch.rand(tokens, TOP_K, generator=self.gen, device=DEVICE)
        used = ids.unique().numel()
        bytes_moved = used * FP8_EXPERT_BYTES + tokens * HIDDEN * (ELEM_BYTES + 4)
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        time_us = self._grouped_us(x, ids, weights, w13, w2, **scales)
        bf16 = (
            self.randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
            self.randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5),
        )
        bf16_us = self._grouped_us(x, ids, weights, *bf16)
        label = f"T={tokens} K={TOP_K} E={EXPERTS}"
        self.add("grouped_moe_fp8", label, time_us, bytes_moved, flops, bf16_us)

    @staticmethod
    def _grouped_us(
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        **scales: torch.Tensor,
    ) -> float:
        """The engine's call: no range check, so no host sync."""
        return median_event_us(
            lambda: grouped_moe.grouped_moe_triton(
                x, ids, weights, w13, w2, layer_experts=EXPERTS, checked=False, **scales
            ),
            10,
        )

    def paged_attention(
        self,
        seq_lens: list[int],
        config: paged_attention.AttentionConfig | None = None,
        with_ref: bool = True,
        fp8: bool = False,
    ) -> None:
        """Decode attention: each call reads one layer's KV pages (`fp8`: e4m3 pages and their
        factors, kernels/fp8_kv.py)."""
        batch = len(seq_lens)
        head_bytes = HEAD_DIM + fp8_kv.SCALE_BYTES if fp8 else HEAD_DIM * ELEM_BYTES
        kv_bytes = sum(seq_lens) * KV_HEADS * 2 * head_bytes
        layers = layers_for(kv_bytes)
        max_blocks = -(-max(seq_lens) // PAGE)
        blocks = batch * max_blocks

        def pages() -> tuple[torch.Tensor, torch.Tensor | None]:
            values = self.randn(blocks, PAGE, KV_HEADS, HEAD_DIM)
            return fp8_kv.quantize_heads(values) if fp8 else (values, None)

        caches = [(pages(), pages()) for _ in range(layers)]
        tables = torch.randperm(blocks, device=DEVICE).view(batch, max_blocks).int()
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        q = self.randn(batch, Q_HEADS, HEAD_DIM)
        scale = HEAD_DIM**-0.5

        def call(k_pages, v_pages, fn=paged_attention.paged_attention_decode_triton, **kw):
            (k, k_scale), (v, v_scale) = k_pages, v_pages
            kv_scales = (k_scale, v_scale) if fp8 else None
            return lambda: fn(q, k, v, tables, lens, scale, kv_scales=kv_scales, **kw)

        time_us = graph_us_per_call([call(k, v, config=config) for k, v in caches])
        ref_us = None
        if with_ref:
            ref = paged_attention.paged_attention_decode_ref
            ref_us = eager_us_per_call([call(k, v, ref) for k, v in caches[:2]])
        bytes_moved = kv_bytes + 2 * q.numel() * ELEM_BYTES
        flops = 4 * sum(seq_lens) * Q_HEADS * HEAD_DIM
        lens_label = str(seq_lens[0]) if len(set(seq_lens)) == 1 else "mixed"
        label = f"B={batch} ctx={lens_label} Hq={Q_HEADS} Hkv={KV_HEADS}"
        self.add(
            "paged_attention_fp8" if fp8 else "paged_attention",
            label + (f" {_short(config)}" if config else ""),
            time_us,
            bytes_moved,
            flops,
            ref_us,
        )

    def paged_attention_fp8(self, seq_lens: list[int]) -> None:
        """Decode attention over FP8 pages (`paged_attention` with `fp8`)."""
        self.paged_attention(seq_lens, fp8=True)

    def sdpa_prefill(self, length: int, backends: Sequence[SDPBackend] = FUSED_SDPA) -> None:
        """torch SDPA for prefill (causal, GQA): what the engine uses unless a kernel beats it.

        The math backend is left out: at long contexts it materializes the score matrix and runs
        out of memory, and a case no fused backend takes is worth a note, not a crash.
        """
        q = self.randn(1, Q_HEADS, length, HEAD_DIM)
        k = self.randn(1, KV_HEADS, length, HEAD_DIM)
        v = self.randn(1, KV_HEADS, length, HEAD_DIM)
        group = Q_HEADS // KV_HEADS
        cases = {
            "enable_gqa": (k, v, True),
            "kv repeated": (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False),
        }
        flops = 2 * length * length * HEAD_DIM * Q_HEADS  # causal: half of 4 * L^2 * D per head
        bytes_moved = (2 * q.numel() + k.numel() + v.numel()) * ELEM_BYTES
        names = "auto" if backends == FUSED_SDPA else "+".join(b.name for b in backends)
        for mode, (keys, values, gqa) in cases.items():
            call = _sdpa_call(q, keys, values, gqa, backends)
            try:
                time_us = median_event_us(call, 3 if length > 16384 else 10)
            except RuntimeError as e:
                self.note(
                    f"sdpa L={length} {mode} {names}: no backend ran ({str(e).splitlines()[0]})"
                )
                continue
            self.add(
                "sdpa_prefill", f"L={length} {mode} {names}", time_us, bytes_moved, flops, None
            )

    def rmsnorm(self, tokens: int) -> None:
        """Residual add + RMSNorm over the hidden size."""
        layers = layers_for(tokens * HIDDEN * ELEM_BYTES * 4)
        sets = [(self.randn(tokens, HIDDEN), self.randn(tokens, HIDDEN)) for _ in range(layers)]
        weight = self.randn(HIDDEN)
        time_us = graph_us_per_call(
            [self._norm(x, r, weight, rmsnorm.fused_add_rmsnorm_triton) for x, r in sets]
        )
        ref_us = graph_us_per_call(
            [self._norm(x, r, weight, rmsnorm.fused_add_rmsnorm_ref) for x, r in sets[:2]]
        )
        bytes_moved = tokens * HIDDEN * ELEM_BYTES * 4 + HIDDEN * ELEM_BYTES
        self.add(
            "fused_add_rmsnorm",
            f"T={tokens} H={HIDDEN}",
            time_us,
            bytes_moved,
            5 * tokens * HIDDEN,
            ref_us,
        )

    @staticmethod
    def _norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, fn: Callable[..., object]
    ) -> Callable[[], object]:
        return lambda: fn(x, residual, weight, 1e-6)

    def rope_kv(self, tokens: int, fp8: bool = False) -> None:
        """Per-head qk RMSNorm, RoPE and the KV write of one layer (Qwen3), fused in one launch;
        the reference is the dozen torch ops the engine ran before (`fp8`: into FP8 pages, each
        head quantized, kernels/fp8_kv.py)."""
        width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
        cache_shape = (-(-tokens // PAGE) + 1, PAGE, KV_HEADS, HEAD_DIM)
        layers = layers_for(tokens * width * ELEM_BYTES)

        def cache() -> torch.Tensor:
            if fp8:
                return torch.zeros(cache_shape, dtype=torch.uint8, device=DEVICE)
            return self.randn(*cache_shape)

        sets = [(self.randn(tokens, width), cache(), cache()) for _ in range(layers)]
        factors = None
        if fp8:
            factors = tuple(torch.ones(cache_shape[:-1], device=DEVICE) for _ in range(2))
        tables = (self.randn(4096, HEAD_DIM), self.randn(4096, HEAD_DIM))
        norms = (self.randn(HEAD_DIM), self.randn(HEAD_DIM))
        positions = torch.randint(0, 4096, (tokens,), generator=self.gen, device=DEVICE)
        slots = torch.arange(tokens, device=DEVICE)

        def call(
            fn: Callable[..., torch.Tensor],
            qkv: torch.Tensor,
            k_cache: torch.Tensor,
            v_cache: torch.Tensor,
        ) -> Callable[[], object]:
            return lambda: fn(qkv, positions, *tables, *norms, 1e-6, k_cache, v_cache, slots,
                              Q_HEADS, KV_HEADS, HEAD_DIM, factors)  # fmt: skip

        time_us = graph_us_per_call([call(rope_kv.qk_norm_rope_kv_triton, *s) for s in sets])
        ref_us = graph_us_per_call([call(rope_kv.qk_norm_rope_kv_ref, *s) for s in sets[:2]])
        # read qkv, a cos and a sin row per token and the norms; write q, k and v (FP8: k and v
        # as bits and a factor a head)
        bytes_moved = (2 * tokens * width + 2 * tokens * HEAD_DIM + 2 * HEAD_DIM) * ELEM_BYTES
        if fp8:
            head_saved = HEAD_DIM * ELEM_BYTES - (HEAD_DIM + fp8_kv.SCALE_BYTES)
            bytes_moved -= 2 * tokens * KV_HEADS * head_saved
        # per q or k element: square and add, two scalings, two products and a sum
        flops = 7 * tokens * (Q_HEADS + KV_HEADS) * HEAD_DIM
        self.add(
            "qk_norm_rope_kv_fp8" if fp8 else "qk_norm_rope_kv",
            f"T={tokens} Hq={Q_HEADS} Hkv={KV_HEADS} D={HEAD_DIM} qk norm",
            time_us,
            bytes_moved,
            flops,
            ref_us,
        )

    def rope_kv_fp8(self, tokens: int) -> None:
        """The KV write into FP8 pages (`rope_kv` with `fp8`)."""
        self.rope_kv(tokens, fp8=True)

    def linear(
        self, tokens: int, name: str, config: gemv.GemvConfig | None = None, early: bool = False
    ) -> None:
        """A decode batch through a dense projection: the skinny GEMM, and beside it (unless a
        config is swept, or `early`) cuBLAS's F.linear on the same inputs in a row of its own;
        each call reads another layer's weight. early: the kernel as the engine's `linear`
        launches one token (its first weights loaded before the PDL wait, which in this chain
        of launches overlaps the call before), in a row labelled "early"."""
        n, k = PROJECTIONS[name]
        weight_bytes = n * k * ELEM_BYTES
        weights = [self.randn(n, k, scale=k**-0.5) for _ in range(layers_for(weight_bytes))]
        x = self.randn(tokens, k)
        bytes_moved = weight_bytes + tokens * (n + k) * ELEM_BYTES
        flops = 2 * tokens * n * k
        label = f"T={tokens} {name} N={n} K={k}"

        def kernel(weight: torch.Tensor) -> Callable[[], object]:
            return lambda: gemv.linear_decode(x, weight, config=config, early_weights=early)

        def cublas(weight: torch.Tensor) -> Callable[[], object]:
            return lambda: F.linear(x, weight)

        time_us = graph_us_per_call([kernel(w) for w in weights])
        if early:
            self.add("linear_decode", f"{label} early", time_us, bytes_moved, flops, None)
            return
        if config is not None:
            self.add(
                "linear_decode", f"{label} {_short(config)}", time_us, bytes_moved, flops, None
            )
            return
        cublas_us = graph_us_per_call([cublas(w) for w in weights])
        self.add("linear_decode", label, time_us, bytes_moved, flops, cublas_us)
        self.add("cublas_linear", label, cublas_us, bytes_moved, flops, None)

    def linear_fp8(
        self, tokens: int, name: str, config: gemv.GemvConfig | None = None, early: bool = False
    ) -> None:
        """The skinny GEMM over the projection's weight in FP8 with its 128x128 block factors
        (`gemv.linear_decode_fp8`), beside the `linear` row of the same shape in bf16: the bytes
        it reads are the FP8 weight, its factors and the activations. early: as `linear`'s."""
        n, k = PROJECTIONS[name]
        weight_bytes = n * k + fp8.blocks(n) * fp8.blocks(k) * 4
        weights = [
            fp8.quantize(self.randn(n, k, scale=k**-0.5)) for _ in range(layers_for(weight_bytes))
        ]
        x = self.randn(tokens, k)
        bytes_moved = weight_bytes + tokens * (n + k) * ELEM_BYTES
        label = f"T={tokens} {name} N={n} K={k}"
        if config is not None:
            label = f"{label} {_short(gemv.fp8_config(config, tokens))}"
        if early:
            label = f"{label} early"

        def kernel(weight: torch.Tensor, scale: torch.Tensor) -> Callable[[], object]:
            return lambda: gemv.linear_decode_fp8(
                x, weight, scale, config=config, early_weights=early
            )

        time_us = graph_us_per_call([kernel(w, s) for w, s in weights])
        self.add("linear_decode_fp8", label, time_us, bytes_moved, 2 * tokens * n * k, None)

    def router(self, tokens: int) -> None:
        """Softmax + top-8 of 128 experts, renormalized (Qwen3)."""
        logits = self.randn(tokens, EXPERTS)
        time_us = graph_us_per_call([lambda: router.topk_softmax_triton(logits, TOP_K, True)] * 8)
        ref_us = graph_us_per_call([lambda: router.topk_softmax_ref(logits, TOP_K, True)] * 8)
        bytes_moved = tokens * (EXPERTS * ELEM_BYTES + TOP_K * 8)
        self.add(
            "topk_softmax",
            f"T={tokens} E={EXPERTS} K={TOP_K}",
            time_us,
            bytes_moved,
            5 * tokens * EXPERTS,
            ref_us,
        )

    def draw(self, tokens: int, cut: str) -> None:
        """A decode step's token draws over the 30B geometry's vocabulary (fp32 logits). cut
        "top": the Gumbel-max kernels, beside their torch reference. "top_k" and "top_p": the
        whole device draw (`draw.draw_tokens`, as the decode graphs replay it) at Qwen3's
        defaults, top-k 20 and top-p 0.95 (torch.topk of `draw.TOP_K_WIDTH`), and at top-p 0.95
        alone (torch's vocabulary sort)."""
        logits = self.randn(tokens, VOCAB).float()
        inv_t = torch.full((tokens,), 1 / 0.8, device=DEVICE)  # temperature 0.8
        seed = torch.arange(tokens, device=DEVICE)
        position = torch.arange(100, 100 + tokens, device=DEVICE)
        if cut == "top":
            threshold = torch.full((tokens,), -math.inf, device=DEVICE)
            call, ref = (partial(f, logits, inv_t, threshold, seed, position)
                         for f in (draw.gumbel_argmax_triton, draw.gumbel_argmax_ref))  # fmt: skip
        else:
            top_k, top_p, rows_cut = {"top_k": (20, 0.95, draw.Cut.NARROW),
                                      "top_p": (0, 0.95, draw.Cut.SORT)}[cut]  # fmt: skip
            filters = (
                torch.full((tokens,), top_k, device=DEVICE),
                torch.full((tokens,), top_p, device=DEVICE),
                torch.full((tokens,), -math.inf, device=DEVICE),  # min-p off
            )
            call = partial(draw.draw_tokens, logits, inv_t, *filters, seed, position, cut=rows_cut)
            ref = None
        time_us = graph_us_per_call([call] * 8)
        ref_us = graph_us_per_call([ref] * 8) if ref is not None else None
        name = "draw" if cut == "top" else f"draw_{cut}"
        # per token: the score's multiply and add, the noise's two logs, negations and scale
        flops = 8 * tokens * VOCAB
        self.add(name, f"T={tokens} V={VOCAB}", time_us, tokens * VOCAB * 4, flops, ref_us)

    def short_conv(self, tokens: int, prefill: bool) -> None:
        """The Gated DeltaNet's causal convolution (SiLU) at Qwen3.6-35B-A3B's channels, in bf16:
        `prefill`, one sequence of `tokens` from its slot, the input a view of the projection's
        columns as the engine passes it; else a decode step of `tokens` sequences over their
        slots, each call another layer's conv pool. The reference column holds the torch
        reference's time; fla's convolution (its [N, C, W] state layout, states indexed by batch
        row) has rows of its own where fla is installed."""
        channels = _linear_channels()
        state_rows = CONV_WIDTH - 1
        weight = self.randn(channels, CONV_WIDTH, scale=0.5)
        if prefill:
            x = self.randn(tokens, channels + LINEAR_V_HEADS * LINEAR_HEAD_DIM)[:, :channels]
            state = self.randn(state_rows, channels)
            time_us = median_event_us(
                lambda: gated_deltanet.causal_conv_prefill_triton(x, weight, state), 10
            )
            ref_us = median_event_us(
                lambda: gated_deltanet.causal_conv_prefill_ref(x, weight, state), 3
            )
        else:
            x = self.randn(tokens, channels)
            slot_ids = torch.randperm(tokens + 1, device=DEVICE)[:tokens].int()
            pool_bytes = (tokens + 1) * state_rows * channels * ELEM_BYTES
            pools = [
                self.randn(tokens + 1, state_rows, channels) for _ in range(layers_for(pool_bytes))
            ]

            def call(fn: Callable[..., torch.Tensor], pool: torch.Tensor) -> Callable[[], object]:
                return lambda: fn(x, weight, pool, slot_ids)

            time_us = graph_us_per_call(
                [call(gated_deltanet.causal_conv_decode_triton, pool) for pool in pools]
            )
            ref_us = graph_us_per_call(
                [call(gated_deltanet.causal_conv_decode_ref, pool) for pool in pools[:2]]
            )
        # x read and the output written; each sequence's state rows read and written
        states = 1 if prefill else tokens
        bytes_moved = (2 * tokens + 2 * states * state_rows) * channels * ELEM_BYTES
        flops = 2 * tokens * channels * CONV_WIDTH
        label = f"{'T' if prefill else 'B'}={tokens} C={channels} W={CONV_WIDTH}"
        self.add("short_conv", label, time_us, bytes_moved, flops, ref_us)
        fla_conv = _fla_conv()
        if fla_conv is None:
            self.note("short_conv: fla is not installed (no fla rows)")
            return
        if prefill:
            fla_state = self.randn(1, channels, CONV_WIDTH)

            def fla_call() -> object:
                return fla_conv.causal_conv1d(
                    x.unsqueeze(0), weight, initial_state=fla_state, output_final_state=True,
                    activation="silu",
                )  # fmt: skip

            fla_us = median_event_us(fla_call, 10)
        else:
            caches = [self.randn(tokens, channels, CONV_WIDTH) for _ in range(len(pools))]

            def fla_update(cache: torch.Tensor) -> Callable[[], object]:
                return lambda: fla_conv.causal_conv1d_update(
                    x, cache, weight=weight, activation="silu"
                )

            fla_us = graph_us_per_call([fla_update(cache) for cache in caches])
        self.add("short_conv_fla", label, fla_us, bytes_moved, flops, time_us)

    def delta_rule(
        self, tokens: int, prefill: bool, config: gated_deltanet.DeltaDecodeConfig | None = None
    ) -> None:
        """The gated delta rule at Qwen3.6-35B-A3B's heads, as the engine calls it (bf16 q, k, v,
        fp32 states): `prefill`, fla's chunked kernel over one sequence of `tokens` from its
        state; else a decode step of `tokens` sequences over their slots in a layer's pool, each
        call another layer's pool: the Triton kernel that updates the slots in place (reference
        column: the torch reference), then, where fla is installed, fla's recurrent kernel as
        its adapter calls it (the states gathered from the slots and written back) and that
        kernel alone on states already gathered (reference column: the in-place kernel's time).
        Every row counts the bytes the step needs, one read and one write of the states, so
        fla's rows show what its extra passes cost. With a `config` (--sweep), the in-place
        kernel alone at that launch."""
        fla = gated_deltanet.fla_ops()
        heads, v_heads, dim = LINEAR_HEADS, LINEAR_V_HEADS, LINEAR_HEAD_DIM
        q, k = self.randn(tokens, heads, dim), self.randn(tokens, heads, dim)
        v = self.randn(tokens, v_heads, dim)
        g = -torch.rand(tokens, v_heads, generator=self.gen, device=DEVICE)
        beta = torch.rand(tokens, v_heads, generator=self.gen, device=DEVICE).to(DTYPE)
        state_bytes = v_heads * dim * dim * 4
        # q, k, v and the output; the states read and written once
        states = 1 if prefill else tokens
        bytes_moved = (
            tokens * (2 * heads + 2 * v_heads) * dim * ELEM_BYTES + 2 * states * state_bytes
        )
        flops = 6 * tokens * v_heads * dim * dim  # the recurrence's products per token
        label = f"{'T' if prefill else 'B'}={tokens} H={heads} HV={v_heads} D={dim}"
        if prefill:
            if fla is None:
                self.note("delta_rule: fla is not installed (no prefill rows)")
                return
            state = torch.zeros(v_heads, dim, dim, device=DEVICE)
            time_us = median_event_us(
                lambda: gated_deltanet.delta_rule_prefill_fla(q, k, v, g, beta, state), 10
            )
            self.add("delta_rule_fla", label, time_us, bytes_moved, flops, None)
            return
        slot_ids = torch.randperm(tokens + 1, device=DEVICE)[:tokens].int()
        pools = [
            torch.zeros(tokens + 1, v_heads, dim, dim, device=DEVICE)
            for _ in range(layers_for(states * state_bytes))
        ]

        def call(fn: Callable[..., torch.Tensor], pool: torch.Tensor) -> Callable[[], object]:
            return lambda: fn(q, k, v, g, beta, pool, slot_ids)

        def in_place(pool: torch.Tensor) -> Callable[[], object]:
            return lambda: gated_deltanet.delta_rule_decode_triton(
                q, k, v, g, beta, pool, slot_ids, config
            )

        time_us = graph_us_per_call([in_place(pool) for pool in pools])
        if config is not None:
            self.add("delta_rule", f"{label} {_short(config)}", time_us, bytes_moved, flops, None)
            return
        ref_us = graph_us_per_call(
            [call(gated_deltanet.delta_rule_decode_ref, p) for p in pools[:2]]
        )
        self.add("delta_rule", label, time_us, bytes_moved, flops, ref_us)
        if fla is None:
            self.note("delta_rule: fla is not installed (no fla rows)")
            return
        fla_us = graph_us_per_call([call(gated_deltanet.delta_rule_decode_fla, p) for p in pools])
        self.add("delta_rule_fla", label, fla_us, bytes_moved, flops, time_us)
        gathered = [pool[:tokens] for pool in pools]

        def alone(initial: torch.Tensor) -> Callable[[], object]:
            return lambda: fla.fused_recurrent_gated_delta_rule(
                *(t.unsqueeze(1) for t in (q, k, v)), g=g.unsqueeze(1), beta=beta.unsqueeze(1),
                initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip

        alone_us = graph_us_per_call([alone(initial) for initial in gathered])
        self.add("delta_rule_fla", f"{label} kernel alone", alone_us, bytes_moved, flops, time_us)

    def route(self, tokens: int, host: bool, config: route.RouteConfig | None = None) -> None:
        """A decode step's whole router (Qwen3: 128 experts of H=2048, top-8, renormalized) in
        one launch; beside it (unless a config is swept) the launches it replaced: the skinny GEMM,
        softmax + top-k and, with `host`, the routing's store into pinned memory."""
        weight = self.randn(EXPERTS, HIDDEN, scale=HIDDEN**-0.5)
        x = self.randn(tokens, HIDDEN)
        store = (
            (
                torch.zeros(tokens, TOP_K, dtype=torch.int32, pin_memory=True),
                torch.zeros(tokens, TOP_K, pin_memory=True),
                torch.zeros(tokens, HIDDEN, pin_memory=True),
            )
            if host
            else None
        )

        def fused() -> object:
            return route.route_triton(x, weight, TOP_K, True, host=store, config=config)

        def chain() -> object:
            weights, ids = router.topk_softmax_triton(gemv.linear_decode(x, weight), TOP_K, True)
            if store is not None:
                host_handoff.routing_to_host_triton(ids, weights, x, *store)
            return ids

        time_us = graph_us_per_call([fused] * 8)
        chain_us = None if config is not None else graph_us_per_call([chain] * 8)
        label = f"T={tokens} E={EXPERTS} H={HIDDEN} K={TOP_K}" + (" + host" if host else "")
        if config is not None:
            label += f" {_short(config)}"
        bytes_moved = EXPERTS * HIDDEN * ELEM_BYTES + tokens * HIDDEN * ELEM_BYTES
        self.add("route", label, time_us, bytes_moved, 2 * tokens * EXPERTS * HIDDEN, chain_us)


def _linear_channels() -> int:
    """The convolution's channels: q and k of every key head, v of every value head."""
    return (2 * LINEAR_HEADS + LINEAR_V_HEADS) * LINEAR_HEAD_DIM


def _fla_conv() -> object | None:
    """fla's causal convolution module, or None where fla is absent."""
    try:
        from fla.modules import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def _sdpa_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, backends: Sequence[SDPBackend]
) -> Callable[[], object]:
    """One causal SDPA call restricted to the given backends."""

    def call() -> torch.Tensor:
        with sdpa_kernel(list(backends)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return call


def _short(config: object) -> str:
    """A config's fields in a few characters, for sweep rows."""
    return "/".join(str(v) for v in asdict(config).values())


# The kernels `--only` can pick: the Bench methods whose rows `run` times.
KERNELS = (
    "fused_moe", "fused_moe_fp8", "fused_moe_mxfp4", "fused_moe_mxfp4_gpt_oss", "fused_moe_nvfp4",
    "grouped_moe", "grouped_moe_fp8", "grouped_moe_mxfp4", "grouped_moe_nvfp4", "paged_attention",
    "paged_attention_fp8", "sdpa_prefill", "rmsnorm", "router", "route", "rope_kv", "rope_kv_fp8",
    "handoff", "linear", "linear_fp8", "draw", "short_conv", "delta_rule",
)  # fmt: skip


def run(
    sweep: bool, only: Sequence[str] | None = None
) -> tuple[dict[str, object], list[Result], list[str]]:
    """Measure the ceilings, then every kernel (or those named in `only`, from KERNELS); returns
    the device summary, results and notes."""
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}; measuring copy bandwidth and matmul rate", file=sys.stderr)
    bench = Bench(measure_copy_gbps(), measure_matmul_tflops())
    device = {
        "name": props.name,
        "copy_gbps": bench.copy_gbps,
        "matmul_tflops": bench.matmul_tflops,
        "torch": torch.__version__,
    }
    print(
        f"copy {bench.copy_gbps:.0f} GB/s, bf16 matmul {bench.matmul_tflops:.0f} TFLOP/s",
        file=sys.stderr,
    )
    wanted = set(KERNELS if only is None else only)
    if "fused_moe" in wanted:
        for tokens in (1, 4, 8, 16):
            bench.fused_moe(tokens)
        bench.fused_moe(1, with_ref=False, reduce=False)
    if "fused_moe_fp8" in wanted:
        for tokens in (1, 4, 8, 16):
            bench.fused_moe_fp8(tokens)
        bench.fused_moe_fp8(1, reduce=False)
    if "fused_moe_mxfp4" in wanted:
        for tokens in (1, 4, 8):
            bench.fused_moe_mxfp4(tokens)
        bench.fused_moe_mxfp4(1, reduce=False)
    if "fused_moe_mxfp4_gpt_oss" in wanted:
        for tokens in (1, 8):
            bench.fused_moe_mxfp4_gpt_oss(tokens)
    if "fused_moe_nvfp4" in wanted:
        for tokens in (1, 4, 8):
            bench.fused_moe_nvfp4(tokens)
        bench.fused_moe_nvfp4(1, reduce=False)
    for tokens in (512, 2048):
        if "grouped_moe" in wanted:
            bench.grouped_moe(tokens)
        if "grouped_moe_fp8" in wanted:
            bench.grouped_moe_fp8(tokens)
        if "grouped_moe_mxfp4" in wanted:
            bench.grouped_moe_mxfp4(tokens)
        if "grouped_moe_nvfp4" in wanted:
            bench.grouped_moe_nvfp4(tokens)
    for seq_lens in ([2048], [8192], [32768], [4096] * 8):
        if "paged_attention" in wanted:
            bench.paged_attention(seq_lens)
        if "paged_attention_fp8" in wanted:
            bench.paged_attention_fp8(seq_lens)
    if "sdpa_prefill" in wanted:
        for length in (2048, 8192, 32768):
            bench.sdpa_prefill(length)
    for tokens in (1, 2048):
        if "rmsnorm" in wanted:
            bench.rmsnorm(tokens)
        if "router" in wanted:
            bench.router(tokens)
    if "route" in wanted:
        for tokens in (1, 8):
            for host in (False, True):
                bench.route(tokens, host)
    for tokens in (1, 8):
        if "rope_kv" in wanted:
            bench.rope_kv(tokens)
        if "rope_kv_fp8" in wanted:
            bench.rope_kv_fp8(tokens)
        if "handoff" in wanted:
            for parts in (1, 2):
                bench.handoff(tokens, parts)
            bench.handoff_norm(tokens)
    if "linear" in wanted:
        for tokens in (1, 8):
            for name in PROJECTIONS:
                bench.linear(tokens, name)
        for name in PROJECTIONS:  # one token as the engine launches it
            bench.linear(1, name, early=True)
    if "linear_fp8" in wanted:
        for tokens in (1, 8):
            for name in PROJECTIONS:
                bench.linear_fp8(tokens, name)
        for name in PROJECTIONS:
            bench.linear_fp8(1, name, early=True)
    if "draw" in wanted:
        for tokens in (1, 8):
            for cut in ("top", "top_k", "top_p"):
                bench.draw(tokens, cut)
    for prefill, sizes in ((False, (1, 8)), (True, (512, 8192))):
        for tokens in sizes:
            if "short_conv" in wanted:
                bench.short_conv(tokens, prefill)
            if "delta_rule" in wanted:
                bench.delta_rule(tokens, prefill)
    if sweep:
        _sweep(bench, wanted)
    return device, bench.results, bench.notes


def _sweep(bench: Bench, wanted: set[str]) -> None:
    """--sweep's rows of the kernels in `wanted`: each at other tiles than its default's."""
    if "fused_moe" in wanted:
        for block_n, block_k, down_n, warps, stages in (
            (16, 128, 16, 4, 4),
            (16, 256, 32, 4, 3),
            (32, 256, 32, 4, 4),
            (32, 128, 64, 8, 4),
            (16, 512, 16, 4, 3),
            (64, 128, 64, 4, 4),
        ):
            config = fused_moe.DecodeMoEConfig(block_n, block_k, down_n, 256, warps, stages)
            bench.fused_moe(1, config, with_ref=False)
        for fields in ONE_TOKEN_MOE_SWEEP:
            bench.fused_moe(1, OneTokenMoEConfig(*fields), with_ref=False)
    if "fused_moe_fp8" in wanted:
        for fields in ONE_TOKEN_FP8_MOE_SWEEP:
            bench.fused_moe_fp8(1, OneTokenMoEConfig(*fields), reduce=False)
    fp4_configs = [
        *(OneTokenFP4Config(*fields) for fields in FP4_ONE_TOKEN_SWEEP),
        *(mxfp4_moe.DotDecodeConfig(*tiles) for tiles in FP4_DOT_SWEEP),
    ]
    for config in fp4_configs:
        if "fused_moe_mxfp4" in wanted:
            bench.fused_moe_mxfp4(1, config)
        if "fused_moe_mxfp4_gpt_oss" in wanted:
            bench.fused_moe_mxfp4_gpt_oss(1, config)
        if "fused_moe_nvfp4" in wanted:
            bench.fused_moe_nvfp4(1, config)
    if "paged_attention" in wanted:
        for block_n in (32, 64, 128):
            for splits in (64, 128, 256):
                config = paged_attention.AttentionConfig(block_n, splits)
                bench.paged_attention([32768], config, with_ref=False)
    if "linear" in wanted:
        for tokens, configs in GEMV_SWEEP.items():
            for config in configs:
                for name in ("qkv", "o"):
                    bench.linear(tokens, name, config)
    if "linear_fp8" in wanted:  # the bf16 sweep's tiles as the FP8 kernels take them, each once
        for tokens, configs in GEMV_SWEEP.items():
            # one token's steps also twice as wide: the bf16 step's bytes in FP8
            wider = [replace(c, block_k=2 * c.block_k) for c in configs] if tokens == 1 else []
            for config in dict.fromkeys(gemv.fp8_config(c, tokens) for c in configs + wider):
                for name in ("qkv", "o"):
                    bench.linear_fp8(tokens, name, config)
    if "route" in wanted:
        for fields in ROUTE_SWEEP:
            bench.route(1, True, route.RouteConfig(*fields))
    if "delta_rule" in wanted:
        for tokens in (1, 8):
            for fields in DELTA_DECODE_SWEEP:
                bench.delta_rule(tokens, False, gated_deltanet.DeltaDecodeConfig(*fields))
    if "sdpa_prefill" in wanted:
        for backend in FUSED_SDPA:
            for length in (8192, 32768):
                bench.sdpa_prefill(length, (backend,))


def table(device: dict[str, object], results: list[Result], notes: Sequence[str] = ()) -> str:
    """The results as a fixed-width table with the device's ceilings in the title, notes below."""
    lines = [
        f"{device['name']}: copy {device['copy_gbps']:.0f} GB/s, bf16 matmul "
        f"{device['matmul_tflops']:.0f} TFLOP/s (torch {device['torch']})",
        f"{'kernel':<18} {'shape':<40} {'us':>9} {'GB/s':>7} {'%bw':>5} {'TFLOP/s':>8} {'%mm':>5} "
        f"{'ref us':>9} {'x ref':>6}",
    ]
    for r in results:
        ref = f"{r.ref_us:9.1f} {r.ref_us / r.time_us:6.1f}" if r.ref_us else f"{'-':>9} {'-':>6}"
        lines.append(
            f"{r.kernel:<18} {r.shape:<40} {r.time_us:9.1f} {r.gbps:7.0f} "
            f"{r.bw_share:5.0%} {r.tflops:8.1f} {r.mm_share:5.0%} {ref}"
        )
    lines.extend(f"note: {note}" for note in notes)
    return "\n".join(lines)


def _kernel_names(text: str) -> list[str]:
    """`--only`'s value: known kernel names, comma-separated."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in KERNELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown kernel {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(KERNELS)}"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moelab.kernels.bench`."""
    parser = argparse.ArgumentParser(
        prog="python -m moelab.kernels.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time tile configs of decode MoE, attention and the skinny GEMM, and each SDPA "
        "backend",
    )
    parser.add_argument(
        "--only",
        type=_kernel_names,
        default=None,
        metavar="NAMES",
        help=f"time only these kernels, comma-separated: {', '.join(KERNELS)}",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the kernel benchmark needs a GPU (nothing measured)")
        return 0
    device, results, notes = run(args.sweep, args.only)
    if args.json:
        rows = [r.to_json() for r in results]
        print(json.dumps({"device": device, "results": rows, "notes": notes}, indent=2))
    else:
        print(table(device, results, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
