"""The MoE kernels over the expert slots (or the prefill buffer) in the bank's format.

bf16 and FP8 experts go to kernels/fused_moe.py's decode launches and kernels/grouped_moe.py's
prefill GEMM (an FP8 bank passes its block factors as w13_scale_inv and w2_scale_inv). MXFP4
experts (`w13_scale` and `w2_scale`: their E8M0 scales, cache.py) go on CUDA to
kernels/mxfp4_moe.py's, which widen the blocks in registers (gpt_oss's biases and clamped SwiGLU
with them); NVFP4 experts (their e4m3 scales as `w13_scale` and `w2_scale`, their per-tensor
scales as `w13_scale_2` and `w2_scale_2`) to kernels/nvfp4_moe.py's. Off CUDA a 4-bit call
widens the experts it routes to, each once, and runs the torch references of the bf16 kernels
on them (the 4-bit references widen every slot of the bank).
"""

from __future__ import annotations

import torch

from ...kernels import mxfp4
from ...kernels.fused_moe import fused_moe_decode
from ...kernels.grouped_moe import grouped_moe
from ...kernels.mxfp4_moe import fused_moe_decode_mxfp4, grouped_moe_mxfp4
from ...kernels.nvfp4_moe import dequantized, fused_moe_decode_nvfp4, grouped_moe_nvfp4

Args = torch.Tensor | float | None


def decode(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    reduce: bool = True,
    few_routes: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_scale_2: torch.Tensor | None = None,
    w2_scale_2: torch.Tensor | None = None,
    **args: Args,
) -> torch.Tensor:
    """fused_moe_decode over the slots, MXFP4 and NVFP4 ones with their scales: fp32 [T, H], or
    each route's weighted output [T, K, H] with reduce=False (few_routes: one token's tiles for
    few live routes)."""
    if w13_scale is None or w2_scale is None:
        return fused_moe_decode(
            x, slot_ids, weights, w13, w2, reduce=reduce, few_routes=few_routes, **args
        )
    scales = (w13_scale, w2_scale, w13_scale_2, w2_scale_2)
    if x.is_cuda and w13_scale_2 is not None:
        return fused_moe_decode_nvfp4(
            x, slot_ids, weights, w13, w2, *scales, reduce=reduce, few_routes=few_routes
        )
    if x.is_cuda:
        return fused_moe_decode_mxfp4(
            x, slot_ids, weights, w13, w2, w13_scale, w2_scale, reduce=reduce,
            few_routes=few_routes, **args,
        )  # fmt: skip
    ids, dense13, dense2, extras = _widened(x, slot_ids, w13, w2, scales, args)
    return fused_moe_decode(x, ids, weights, dense13, dense2, reduce=reduce, **extras)


def prefill(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    layer_experts: int | None = None,
    checked: bool = True,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_scale_2: torch.Tensor | None = None,
    w2_scale_2: torch.Tensor | None = None,
    **args: Args,
) -> torch.Tensor:
    """grouped_moe over one layer's experts (or slots), MXFP4 and NVFP4 ones with their scales:
    fp32 [T, H]."""
    if w13_scale is None or w2_scale is None:
        return grouped_moe(
            x, expert_ids, weights, w13, w2, layer_experts=layer_experts, checked=checked, **args
        )
    scales = (w13_scale, w2_scale, w13_scale_2, w2_scale_2)
    if x.is_cuda and w13_scale_2 is not None:
        return grouped_moe_nvfp4(
            x, expert_ids, weights, w13, w2, *scales, layer_experts=layer_experts,
            checked=checked,
        )  # fmt: skip
    if x.is_cuda:
        return grouped_moe_mxfp4(
            x, expert_ids, weights, w13, w2, w13_scale, w2_scale,
            layer_experts=layer_experts, checked=checked, **args,
        )  # fmt: skip
    ids, dense13, dense2, extras = _widened(x, expert_ids, w13, w2, scales, args)
    return grouped_moe(x, ids, weights, dense13, dense2, **extras)


def _widened(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    args: dict[str, Args],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Args]]:
    """The experts `ids` names (-1: no route), each widened once to x's dtype (`scales`: the
    block scales, then NVFP4's per-tensor ones or None for MXFP4), with the ids renumbered into
    them and the biases (`args`) taken along."""
    flat = ids.reshape(-1).long()
    live = flat >= 0
    used, inverse = torch.unique(torch.where(live, flat, 0), return_inverse=True)
    s13, s2, t13, t2 = scales
    if t13 is None or t2 is None:
        dense13 = mxfp4.dequantize(w13[used], s13[used])
        dense2 = mxfp4.dequantize(w2[used], s2[used])
    else:
        dense13 = dequantized(w13[used], s13[used], t13[used])
        dense2 = dequantized(w2[used], s2[used], t2[used])
    renumbered = torch.where(live, inverse, -1).view(ids.shape).to(ids.dtype)
    extras = {
        name: value[used] if isinstance(value, torch.Tensor) else value
        for name, value in args.items()
    }
    return renumbered, dense13.to(x.dtype), dense2.to(x.dtype), extras
