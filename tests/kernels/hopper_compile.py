"""Compile every Triton kernel at real shapes for sm_90 (H100/H200) without a GPU: a JSON line each.

Run in its own process with TRITON_INTERPRET unset (test_hopper_compile.py does): a stand-in driver
reports an sm_90 device, and launches only compile. Prints the shared memory, registers and local
(spilled) bytes of each compiled kernel, read from the cubin with the cuobjdump Triton ships, and
whether it waits for the kernel before it (programmatic dependent launch, which the kernels use on
a Hopper GPU: `common.pdl`, here forced on since the tensors are on the CPU).

`--arch 86` (a consumer Ampere GPU) or `--arch 75` (Turing): the kernels that read FP8 or FP4
(the MoE kernels over FP8, MXFP4 and NVFP4 banks, and the KV write, decode attention and prefill
gather over FP8 KV pages) alone, for that GPU, with bf16 (Ampere) or fp16 (Turing: no bf16)
activations, and whether their code holds an FP8 or FP4 instruction, which those GPUs do not have.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from moelab.kernels import (
    common,
    draw,
    fp8,
    fp8_kv,
    fused_moe,
    gated_deltanet,
    gemv,
    grouped_moe,
    host_handoff,
    mxfp4_moe,
    nvfp4_moe,
    paged_attention,
    rmsnorm,
    rope_kv,
    route,
    route_guess,
    router,
    shared_expert,
)

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
BF16 = torch.bfloat16


class HopperDriver:
    """Answers Triton's questions about the current device as an sm_90 GPU (or `arch`) would."""

    def __init__(self, arch: int = 90) -> None:
        self.arch = arch

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, SHARED and LOCAL of a cubin, as cuobjdump reports them."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|STACK):(\d+)", out)}


def compile_all() -> list[tuple[str, str, int | None, object]]:
    """Call every wrapper at the shapes the engine uses; returns (name, module, warps, kernel) of
    each kernel compiled."""
    compiled = []
    run = compile_only(
        lambda fn, kw, kernel: compiled.append(
            (fn.fn.__name__, fn.fn.__module__, kw.get("num_warps"), kernel)
        )
    )
    compile_moe(BF16, fp8_bank=False)
    compile_moe(BF16, fp8_bank=True)
    compile_mxfp4_moe(BF16)
    compile_nvfp4_moe(BF16)
    compile_gpt_oss()
    # the grouping over a whole expert cache of 12 layers' experts (its widest per-expert pass)
    ids = torch.randint(0, 12 * EXPERTS, (512, TOP_K), dtype=torch.int32)
    w13 = torch.empty(12 * EXPERTS, 2 * INTER, HIDDEN, dtype=BF16)
    w2 = torch.empty(12 * EXPERTS, HIDDEN, INTER, dtype=BF16)
    x = torch.randn(512, HIDDEN, dtype=BF16)
    grouped_moe.grouped_moe_triton(
        x, ids, torch.rand(512, TOP_K), w13, w2, layer_experts=EXPERTS, checked=False
    )
    for batch, context in ((1, 32768), (8, 4096)):
        q = torch.randn(batch, 32, 128, dtype=BF16)
        cache = torch.empty(batch * context // 16, 16, 4, 128, dtype=BF16)
        tables = torch.arange(batch * context // 16, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), context, dtype=torch.int32)
        paged_attention.paged_attention_decode_triton(q, cache, cache, tables, lens, 0.1)
    compile_fp8_kv(BF16)
    for tokens in (1, 2048):
        x = torch.randn(tokens, HIDDEN, dtype=BF16)
        rmsnorm.fused_add_rmsnorm_triton(x, x, torch.ones(HIDDEN, dtype=BF16), 1e-6)
        parts = torch.randn(tokens, TOP_K, HIDDEN)  # a decode step's routes, summed in the add
        rmsnorm.fused_add_rmsnorm_triton(parts, x, torch.ones(HIDDEN, dtype=BF16), 1e-6)
        rmsnorm.rmsnorm_triton(x, torch.ones(HIDDEN, dtype=BF16), 1e-6)
    router.topk_softmax_triton(torch.randn(4, EXPERTS, dtype=BF16), TOP_K, True)
    for tokens in (1, 8):  # q/k norm, rotary and the KV write of the 30B geometry's attention
        heads, kv_heads, head_dim = 32, 4, 128
        cache = torch.empty(64, 16, kv_heads, head_dim, dtype=BF16)
        table = torch.empty(4096, head_dim, dtype=BF16)
        rope_kv.qk_norm_rope_kv_triton(
            torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=BF16),
            torch.arange(tokens), table, table, torch.ones(head_dim, dtype=BF16),
            torch.ones(head_dim, dtype=BF16), 1e-6, cache, cache, torch.arange(tokens),
            heads, kv_heads, head_dim,
        )  # fmt: skip
    for tokens in (1, 8):  # a decode step's whole router, with and without the host's copy
        x, router_w = (
            torch.randn(tokens, HIDDEN, dtype=BF16),
            torch.randn(EXPERTS, HIDDEN, dtype=BF16),
        )
        host = (torch.zeros(tokens, TOP_K, dtype=torch.int32), torch.zeros(tokens, TOP_K),
                torch.zeros(tokens, HIDDEN))  # fmt: skip
        route.route_triton(x, router_w, TOP_K, True)
        route.route_triton(x, router_w, TOP_K, True, host=host)
        # offloaded decode's: then the routing's signal to the host
        signal = host_handoff.routing_signal(pin=False)
        route.route_triton(x, router_w, TOP_K, True, host=host, signal=signal)
        # (signal_routing's kernel: its wrapper wants pinned memory with a GPU's routing)
        host_handoff._signal_kernel[(1,)](signal, PTX=True, PDL=True, launch_pdl=True, num_warps=1)
    # a one-token piece's guess of its routing, ahead of it (--moe-cpu-prefetch-rounds)
    route_guess.guess_to_host_triton(
        torch.randn(1, HIDDEN, dtype=BF16), torch.ones(HIDDEN),
        torch.randn(EXPERTS, HIDDEN, dtype=BF16), torch.zeros(1, EXPERTS),
        host_handoff.routing_signal(pin=False),
    )  # fmt: skip
    for tokens in (1, 8):  # an offloaded decode layer's CPU part, awaited on the device
        part = torch.zeros(tokens, HIDDEN)
        for parts in (1, 2):  # the routes of the cached experts (and of the filled ones)
            ys = [torch.zeros(tokens, TOP_K, HIDDEN)] * parts
            host_handoff.sum_when_ready_triton(ys, part, host_handoff.handoff_sync(pin=False))
            # and, with no shared expert, into the residual and the next norm
            residual, norm_w = (
                torch.zeros(tokens, HIDDEN, dtype=BF16),
                torch.ones(HIDDEN, dtype=BF16),
            )
            host_handoff.sum_norm_when_ready_triton(
                ys, part, host_handoff.handoff_sync(pin=False), residual, norm_w, 1e-6
            )
        table = torch.zeros(tokens, TOP_K, dtype=torch.int32)
        host_handoff.route_slots_from_host_triton(table, table.clone(), table.clone())
        host_handoff.route_slots_from_map_triton(
            table, torch.zeros(EXPERTS, dtype=torch.int32), torch.ones(tokens, dtype=torch.int32),
            table.clone(),
        )  # fmt: skip
        ids, weights = torch.zeros(tokens, TOP_K, dtype=torch.int64), torch.zeros(tokens, TOP_K)
        host_handoff.routing_to_host_triton(
            ids, weights, torch.zeros(tokens, HIDDEN, dtype=BF16),
            torch.zeros(tokens, TOP_K, dtype=torch.int32), torch.zeros(tokens, TOP_K),
            torch.zeros(tokens, HIDDEN),
        )  # fmt: skip
        host_handoff.tokens_to_host_triton(
            torch.zeros(tokens, dtype=torch.int64), torch.zeros(tokens, dtype=torch.int64)
        )
    for tokens in (1, 8):  # a decode step's draws over the 30B geometry's vocabulary
        long = torch.zeros(tokens, dtype=torch.int64)
        draw.gumbel_argmax_triton(
            torch.randn(tokens, 151936), torch.ones(tokens), torch.zeros(tokens), long,
            torch.zeros(tokens, dtype=torch.int32),
        )  # fmt: skip
    # the decode projections of the 30B geometry (qkv, o, router, lm_head): one token, and eight
    # (the multi-token path, split over K for o)
    for n, k in ((5120, HIDDEN), (HIDDEN, 4096), (EXPERTS, HIDDEN), (151936, HIDDEN)):
        weight = torch.empty(n, k, dtype=BF16)
        for tokens in (1, 8):
            # as the engine calls it: the first weight tile read before the wait (one token)
            gemv.linear_decode(torch.randn(tokens, k, dtype=BF16), weight, early_weights=True)
    compile_fp8_linear(BF16)
    # the Gated DeltaNet's convolution over Qwen3.6-35B-A3B's 8,192 channels: a prompt from its
    # slot, and decode steps of 1 and 8 slots
    channels = 8192
    weight = torch.empty(channels, 4, dtype=BF16)
    states = torch.zeros(9, 3, channels, dtype=BF16)
    x = torch.randn(2048, channels + 4096, dtype=BF16)[:, :channels]  # the projection's columns
    gated_deltanet.causal_conv_prefill_triton(x, weight, states[0])
    for tokens in (1, 8):
        slots = torch.arange(tokens, dtype=torch.int32)
        gated_deltanet.causal_conv_decode_triton(x[:tokens], weight, states, slots)
        # the rule's decode step at its heads (16 of q and k, 32 of v, 128 wide), q, k and v
        # views of the convolution's output, the states fp32
        q, k, v = x[:tokens].split([2048, 2048, 4096], dim=-1)
        q, k = (t.unflatten(-1, (16, 128)) for t in (q, k))
        gated_deltanet.delta_rule_decode_triton(
            q, k, v.unflatten(-1, (32, 128)), torch.zeros(tokens, 32),
            torch.zeros(tokens, 32, dtype=BF16), torch.zeros(9, 32, 128, 128), slots,
        )  # fmt: skip
        # the engine's form: the decay and beta from the gates' projections a and b
        gated_deltanet.delta_rule_decode_triton(
            q, k, v.unflatten(-1, (32, 128)), torch.zeros(tokens, 32, dtype=BF16),
            torch.zeros(tokens, 32, dtype=BF16), torch.zeros(9, 32, 128, 128), slots,
            gates=(torch.zeros(32), torch.zeros(32, dtype=BF16)),
        )  # fmt: skip
        # the gated norm (z a view of the projections' output) and the shared expert's combine
        projected = torch.zeros(tokens, channels + 4096 + 64, dtype=BF16)
        z = projected[:, channels : channels + 4096].unflatten(-1, (32, 128))
        out = torch.zeros(tokens, 32, 128, dtype=BF16)
        gated_deltanet.gated_rmsnorm_triton(out, z, torch.zeros(128, dtype=BF16), 1e-6)
        shared_expert.combine_triton(
            torch.zeros(tokens, TOP_K, HIDDEN), torch.zeros(tokens, 1, dtype=BF16),
            torch.zeros(tokens, HIDDEN, dtype=BF16),
        )  # fmt: skip
    JITFunction.run = run
    return compiled


def compile_fp8_linear(dtype: torch.dtype) -> None:
    """The decode projections of the 30B geometry (qkv, o) over FP8 weights with their block
    factors: one token, and eight (split over K for o)."""
    for n, k in ((5120, HIDDEN), (HIDDEN, 4096)):
        weight = torch.empty(n, k, dtype=torch.uint8)
        scale = torch.ones(-(-n // 128), -(-k // 128))
        for tokens in (1, 8):  # as the engine calls it: one token's first step read early
            x = torch.randn(tokens, k, dtype=dtype)
            gemv.linear_decode_fp8(x, weight, scale, early_weights=True)


def compile_fp8_kv(dtype: torch.dtype) -> None:
    """The launches over FP8 KV pages of the 30B geometry's attention (32 q heads, 4 KV heads of
    128), activations in `dtype`: the KV write, decode attention, the prefill gather."""
    heads, kv_heads, head_dim, page = 32, 4, 128, 16
    bits = torch.empty(4096, page, kv_heads, head_dim, dtype=torch.uint8)
    factors = (torch.ones(4096, page, kv_heads), torch.ones(4096, page, kv_heads))
    table = torch.empty(4096, head_dim, dtype=dtype)
    for tokens in (1, 8):
        rope_kv.qk_norm_rope_kv_triton(
            torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype),
            torch.arange(tokens), table, table, torch.ones(head_dim, dtype=dtype),
            torch.ones(head_dim, dtype=dtype), 1e-6, bits, bits, torch.arange(tokens),
            heads, kv_heads, head_dim, factors,
        )  # fmt: skip
    for batch, context in ((1, 32768), (8, 4096)):
        q = torch.randn(batch, heads, head_dim, dtype=dtype)
        tables = torch.arange(batch * context // page, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), context, dtype=torch.int32)
        paged_attention.paged_attention_decode_triton(
            q, bits, bits, tables, lens, 0.1, kv_scales=factors
        )
    fp8_kv.gather_triton(bits, factors[0], torch.arange(512), 8192, dtype)


def compile_gpt_oss() -> None:
    """gpt-oss's variants: the MoE launches with the experts' biases and clamped SwiGLU (bf16, FP8
    and MXFP4 banks), decode attention with the sinks and the window (64 q heads, 8 KV heads of
    64)."""
    compile_moe(BF16, fp8_bank=False, biased=True)
    compile_moe(BF16, fp8_bank=True, biased=True)
    # gpt-oss-120b's MXFP4 experts (H = I = 2880, top-4): one token's launches, and the tl.dot ones
    hidden, experts = 2880, 128
    w13 = torch.empty(experts, 2 * hidden, hidden // 32, 16, dtype=torch.uint8)
    w2 = torch.empty(experts, hidden, hidden // 32, 16, dtype=torch.uint8)
    scales = (w13[..., 0].contiguous(), w2[..., 0].contiguous())
    extras = {"w13_bias": torch.zeros(experts, 2 * hidden), "w2_bias": torch.zeros(experts, hidden),
              "swiglu_limit": 7.0}  # fmt: skip
    for tokens in (1, 16):
        x = torch.randn(tokens, hidden, dtype=BF16)
        slots = torch.randint(0, experts, (tokens, 4), dtype=torch.int32)
        mxfp4_moe.fused_moe_decode_mxfp4(
            x, slots, torch.rand(tokens, 4), w13, w2, *scales, reduce=False, **extras
        )
    for batch, context in ((1, 32768), (8, 4096)):
        q = torch.randn(batch, 64, 64, dtype=BF16)
        cache = torch.empty(batch * context // 16, 16, 8, 64, dtype=BF16)
        tables = torch.arange(batch * context // 16, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), context, dtype=torch.int32)
        paged_attention.paged_attention_decode_triton(
            q, cache, cache, tables, lens, 0.1, sinks=torch.zeros(64, dtype=BF16), window=128
        )


def compile_moe(dtype: torch.dtype, fp8_bank: bool, biased: bool = False) -> None:
    """The decode and prefill MoE launches of the engine's shapes, activations in `dtype`, over a
    bank in `dtype` or FP8 (float8_e4m3fn with its block factors); `biased`: gpt-oss's experts,
    with their biases and the clamped SwiGLU."""

    def bank(experts: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
        weight = torch.float8_e4m3fn if fp8_bank else dtype
        w13 = torch.empty(experts, 2 * INTER, HIDDEN, dtype=weight)
        w2 = torch.empty(experts, HIDDEN, INTER, dtype=weight)
        extras: dict[str, object] = {}
        if biased:
            extras = {"w13_bias": torch.zeros(experts, 2 * INTER),
                      "w2_bias": torch.zeros(experts, HIDDEN), "swiglu_limit": 7.0}  # fmt: skip
        if not fp8_bank:
            return w13, w2, extras
        scales = {
            "w13_scale_inv": torch.ones(experts, fp8.blocks(2 * INTER), fp8.blocks(HIDDEN)),
            "w2_scale_inv": torch.ones(experts, fp8.blocks(HIDDEN), fp8.blocks(INTER)),
        }
        return w13, w2, {**scales, **extras}

    for tokens in (1, 16, 64):
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        slots = torch.randint(0, 16, (tokens, TOP_K), dtype=torch.int32)
        weights = torch.rand(tokens, TOP_K)
        w13, w2, scales = bank(16)
        fused_moe.fused_moe_decode_triton(x, slots, weights, w13, w2, **scales)
        if tokens == 1:  # the filled routes' launch: row blocks looping over the routes
            fused_moe.fused_moe_decode_triton(x, slots, weights, w13, w2, few_routes=True, **scales)
    w13, w2, scales = bank(EXPERTS)
    for tokens in (8, 300, 2048):
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)]).int()
        grouped_moe.grouped_moe_triton(
            x, ids, torch.rand(tokens, TOP_K), w13, w2, checked=False, **scales
        )


def compile_mxfp4_moe(dtype: torch.dtype) -> None:
    """The decode and prefill MoE launches over an MXFP4 bank (mxfp4_moe) at the engine's shapes,
    activations in `dtype`."""
    w13 = torch.empty(EXPERTS, 2 * INTER, HIDDEN // 32, 16, dtype=torch.uint8)
    w2 = torch.empty(EXPERTS, HIDDEN, INTER // 32, 16, dtype=torch.uint8)
    scales = (w13[..., 0].contiguous(), w2[..., 0].contiguous())
    for tokens in (1, 16):
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        slots = torch.randint(0, EXPERTS, (tokens, TOP_K), dtype=torch.int32)
        mxfp4_moe.fused_moe_decode_mxfp4(x, slots, torch.rand(tokens, TOP_K), w13, w2, *scales)
        if tokens == 1:  # the filled routes' launch: the tiles for few live routes
            mxfp4_moe.fused_moe_decode_mxfp4(
                x, slots, torch.rand(1, TOP_K), w13, w2, *scales, reduce=False, few_routes=True
            )
    for tokens in (8, 300, 2048):
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)]).int()
        mxfp4_moe.grouped_moe_mxfp4(
            x, ids, torch.rand(tokens, TOP_K), w13, w2, *scales, checked=False
        )


def compile_nvfp4_moe(dtype: torch.dtype) -> None:
    """The same launches over an NVFP4 bank (nvfp4_moe): e4m3 scales per 16 values, per-tensor
    scales."""
    w13 = torch.empty(EXPERTS, 2 * INTER, HIDDEN // 2, dtype=torch.uint8)
    w2 = torch.empty(EXPERTS, HIDDEN, INTER // 2, dtype=torch.uint8)
    e4m3 = torch.float8_e4m3fn
    scales = (
        torch.empty(EXPERTS, 2 * INTER, HIDDEN // 16, dtype=e4m3),
        torch.empty(EXPERTS, HIDDEN, INTER // 16, dtype=e4m3),
        torch.ones(EXPERTS, 2),
        torch.ones(EXPERTS, 1),
    )
    for tokens in (1, 16):
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        slots = torch.randint(0, EXPERTS, (tokens, TOP_K), dtype=torch.int32)
        nvfp4_moe.fused_moe_decode_nvfp4(x, slots, torch.rand(tokens, TOP_K), w13, w2, *scales)
    for tokens in (8, 300, 2048):
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)]).int()
        nvfp4_moe.grouped_moe_nvfp4(
            x, ids, torch.rand(tokens, TOP_K), w13, w2, *scales, checked=False
        )


def as_hopper() -> bool:
    """From here on, launches compile for sm_90 (the stand-in driver, and the GPU's launch
    options though the tensors are the CPU's); False, with why, under the interpreter."""
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for the GPU", file=sys.stderr)
        return False
    driver.set_active(HopperDriver())
    common.pdl = lambda device: True
    common.inline_ptx = lambda device: True
    return True


def compile_only(on_compile=None):
    """Make every launch compile its kernel and run nothing (`on_compile(jit_function, launch
    options, kernel)` told of each); returns the real `JITFunction.run`, to put back."""
    run = JITFunction.run

    def compiled_only(self: JITFunction, *args: object, grid: object, warmup: bool, **kw: object):
        kernel = run(self, *args, grid=grid, warmup=True, **kw)
        if on_compile is not None:
            on_compile(self, kw, kernel)
        return kernel

    JITFunction.run = compiled_only
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--arch", type=int, choices=(75, 86), help="FP8 and MXFP4 kernels for this GPU"
    )
    args = parser.parse_args(argv)
    if args.arch is not None:
        return main_fp8(args.arch)
    if not as_hopper():
        return 2
    for name, module, num_warps, kernel in compile_all():
        usage = resource_usage(kernel.asm["cubin"])
        print(
            json.dumps(
                {
                    "kernel": name,
                    "module": module,
                    "num_warps": num_warps,
                    "shared_bytes": kernel.metadata.shared,
                    "waits_for_previous": "griddepcontrol.wait" in kernel.asm["ptx"],
                    "releases_early": "griddepcontrol.launch_dependents" in kernel.asm["ptx"],
                    # the routing's signal: a system-wide fence, then one thread's store
                    "signals_host": "fence.sc.sys" in kernel.asm["ptx"]
                    and "st.relaxed.sys.global.b32" in kernel.asm["ptx"],
                    **usage,
                }
            )
        )
    return 0


def main_fp8(arch: int) -> int:
    """The kernels over FP8 and MXFP4 banks, FP8 KV pages and FP8 projections, compiled for an
    sm_86 or sm_75 GPU: a JSON line each."""
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for the GPU", file=sys.stderr)
        return 2
    driver.set_active(HopperDriver(arch))
    compiled = []
    run = compile_only(lambda fn, kw, kernel: compiled.append((fn, kernel)))
    dtype = torch.float16 if arch < 80 else BF16
    compile_moe(dtype, fp8_bank=True)
    compile_mxfp4_moe(dtype)
    compile_nvfp4_moe(dtype)
    compile_fp8_kv(dtype)
    compile_fp8_linear(dtype)
    JITFunction.run = run
    for fn, kernel in compiled:
        line = {
            "kernel": fn.fn.__name__,
            "module": fn.fn.__module__,
            "arch": arch,
            "shared_bytes": kernel.metadata.shared,
            "narrow_float_instructions": bool(re.search(r"e4m3|e5m2|e2m1", kernel.asm["ptx"])),
            **resource_usage(kernel.asm["cubin"]),
        }
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
