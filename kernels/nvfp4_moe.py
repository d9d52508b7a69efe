"""NVFP4 expert banks in the MoE kernels: kernels/mxfp4_moe.py's decode launches and grouped
prefill GEMM, reading ModelOpt's weights (kernels/nvfp4.py) and widening them in registers.

A bank is w13 [S, 2I, H/2] and w2 [S, H, I/2] uint8 (two e2m1 values a byte, the even-indexed
one in the low nibble), their e4m3 block scales w13_scale [S, 2I, H/16] and w2_scale [S, H, I/16]
(float8_e4m3fn, one per 16 values), and their per-tensor fp32 scales w13_scale_2 [S, 2] (gate's,
then up's: ModelOpt quantizes the two projections apart) and w2_scale_2 [S, 1]. A weight is its
e2m1 value times its block's scale times its tensor's. The kernels build each e2m1 code's and
each block scale's fp32 bits with integer ops (no FP4 or FP8 instruction: Turing, Ampere and
later run the same code, as does the Triton interpreter), multiply the two (exact in bf16: 2
significant bits times 4), and apply the per-tensor scale to the fp32 sums.
"""

from __future__ import annotations

import torch

from . import common, nvfp4
from .fused_moe import fused_moe_decode_ref
from .grouped_moe import GroupedMoEConfig
from .mxfp4_moe import DecodeConfig, launch_decode, launch_grouped


def check_bank(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2_scale_2: torch.Tensor,
) -> tuple[int, int, int]:
    """(S, H, I) of an NVFP4 bank, after checking its values and scales fit each other
    (metadata only: no device sync)."""
    for name, w, s, parts, t in (
        ("w13", w13, w13_scale, 2, w13_scale_2),
        ("w2", w2, w2_scale, 1, w2_scale_2),
    ):
        if w.dtype != torch.uint8 or w.dim() != 3:
            raise ValueError(
                f"{name} must be NVFP4 values, uint8 [S, N, K/2], got {w.dtype} {tuple(w.shape)}"
            )
        blocks = w.shape[2] * 2 // nvfp4.BLOCK
        if s.dtype != torch.float8_e4m3fn or tuple(s.shape) != (*w.shape[:2], blocks):
            raise ValueError(
                f"{name}_scale must be the e4m3 scales of {name}, float8_e4m3fn "
                f"{(*w.shape[:2], blocks)}, got {s.dtype} {tuple(s.shape)}"
            )
        if t.dtype != torch.float32 or tuple(t.shape) != (w.shape[0], parts):
            raise ValueError(
                f"{name}_scale_2 must be fp32 [{w.shape[0]}, {parts}], got {t.dtype} "
                f"{tuple(t.shape)}"
            )
        if not (w.is_contiguous() and s.is_contiguous() and t.is_contiguous()):
            raise ValueError(f"{name}, {name}_scale and {name}_scale_2 must be contiguous")
        if not s.device == t.device == w.device:
            raise ValueError(f"{name}'s scales are on {s.device} and {t.device}, it on {w.device}")
    slots, two_inter, half_hidden = w13.shape
    hidden, inter = 2 * half_hidden, two_inter // 2
    if (
        w2.shape != (slots, hidden, inter // 2)
        or two_inter != 2 * inter
        or hidden % nvfp4.BLOCK
        or inter % nvfp4.BLOCK
    ):
        raise ValueError(
            f"w2 {tuple(w2.shape)} does not fit w13 {tuple(w13.shape)}: with H={hidden} and "
            f"I={inter} (multiples of {nvfp4.BLOCK}), w2 is [{slots}, {hidden}, {inter // 2}]"
        )
    return slots, hidden, inter


def _check(
    x: torch.Tensor,
    ids: torch.Tensor,
    route_weights: torch.Tensor,
    bank: tuple[torch.Tensor, ...],
    ids_name: str,
) -> tuple[int, int, int]:
    """Validate a call (metadata only: no device sync); the bank's (S, H, I)."""
    slots, hidden, inter = check_bank(*bank)
    if x.dim() != 2 or x.shape[1] != hidden or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"x must be [T, H={hidden}] and {ids_name} [T, K]: got {tuple(x.shape)} and "
            f"{tuple(ids.shape)}"
        )
    if route_weights.shape != ids.shape or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{ids_name} must be int32 or int64 and route_weights of its shape "
            f"{tuple(ids.shape)}: got {ids.dtype} and {tuple(route_weights.shape)}"
        )
    common.check_same_device(x=x, **{ids_name: ids}, route_weights=route_weights, w13=bank[0])
    return slots, hidden, inter


def dequantized(w: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """A projection's fp32 weights [S, N, K] by the format's definition (nvfp4.dequantize), its
    per-tensor scales [S, P] each covering N/P rows (w13: gate's rows, then up's)."""
    parts = scale_2.shape[-1]
    split = zip(w.chunk(parts, dim=1), scale.chunk(parts, dim=1), scale_2.unbind(-1), strict=True)
    return torch.cat([nvfp4.dequantize(q, s, t) for q, s, t in split], dim=1)


def dequantized_bank(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2_scale_2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bank's fp32 weights [S, 2I, H] and [S, H, I]: what the references compute with."""
    return dequantized(w13, w13_scale, w13_scale_2), dequantized(w2, w2_scale, w2_scale_2)


def fused_moe_decode_nvfp4_ref(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    *bank: torch.Tensor,
    reduce: bool = True,
) -> torch.Tensor:
    """Reference of the decode launches: fp32 [T, H], sum over the routes (slot >= 0) of weight
    * w2[s] @ (silu(gate·x) * (up·x)) with the dequantized weights (`bank`: w13, w2, their
    block scales, their per-tensor scales), fused_moe's reference in fp32. reduce=False: each
    route's weighted output [T, K, H] (zeros where masked)."""
    _check(x, slot_ids, route_weights, bank, "slot_ids")
    dense13, dense2 = dequantized_bank(*bank)
    return fused_moe_decode_ref(
        x, slot_ids, route_weights, dense13, dense2, compute_dtype=torch.float32, reduce=reduce
    )


def grouped_moe_nvfp4_ref(
    x: torch.Tensor, expert_ids: torch.Tensor, route_weights: torch.Tensor, *bank: torch.Tensor
) -> torch.Tensor:
    """Reference of the prefill GEMM: the decode reference's sum, the ids naming experts."""
    return fused_moe_decode_nvfp4_ref(x, expert_ids, route_weights, *bank)


def fused_moe_decode_nvfp4(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2_scale_2: torch.Tensor,
    *,
    config: DecodeConfig | None = None,
    reduce: bool = True,
    few_routes: bool = False,
) -> torch.Tensor:
    """Decode MoE over NVFP4 slots: fp32 [T, H], as fused_moe_decode_mxfp4 computes it (slot -1:
    no route; config, the one-token launches at T=1 by default, reduce=False and few_routes as
    there)."""
    bank = (w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2)
    _, hidden, inter = _check(x, slot_ids, route_weights, bank, "slot_ids")
    return launch_decode(
        x, slot_ids, route_weights, _packed(w13, w13_scale, w13_scale_2),
        _packed(w2, w2_scale, w2_scale_2), hidden, inter, config=config, reduce=reduce,
        few_routes=few_routes, w13_bias=None, w2_bias=None, swiglu_limit=0.0,
    )  # fmt: skip


def grouped_moe_nvfp4(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2_scale_2: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
    config: GroupedMoEConfig | None = None,
    layer_experts: int | None = None,
    checked: bool = True,
) -> torch.Tensor:
    """Prefill MoE over one layer's NVFP4 experts: fp32 [T, H], as grouped_moe_mxfp4 computes it
    (the weights times their block scales in the compute dtype, exact in bf16 and fp32)."""
    bank = (w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2)
    num_experts, hidden, inter = _check(x, expert_ids, route_weights, bank, "expert_ids")
    return launch_grouped(
        x, expert_ids, route_weights, _packed(w13, w13_scale, w13_scale_2),
        _packed(w2, w2_scale, w2_scale_2), num_experts, hidden, inter,
        compute_dtype=compute_dtype, config=config, layer_experts=layer_experts, checked=checked,
        w13_bias=None, w2_bias=None, swiglu_limit=0.0,
    )  # fmt: skip


def _packed(
    w: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A projection as the launches take it: the e4m3 scales as their bytes (the kernels decode
    the bits, no FP8 load)."""
    return w, scale.view(torch.uint8), scale_2
