"""A MoE layer's output with a shared expert (qwen2_moe, Qwen3-Next, Qwen3.5/3.6): the routed
experts' sum plus the shared expert's output scaled by its sigmoid gate, in one launch.

The layer computes, as transformers rounds it (engine/model/model.py, `_after_experts`):

    routed = routes.sum(dim=1)            # fp32 [T, H] from the routes' fp32 outputs [T, K, H]
    gate = sigmoid(gate_logit)            # [T, 1] in the model's dtype
    out = (routed + (gate * shared).float()).to(dtype)

On CUDA `combine` does it in one program per token and column block; torch takes five to seven
small launches for it, which in a decode step cost more than the few kilobytes they touch.
"""

from __future__ import annotations

import torch

from . import common
from .common import tl, triton

BLOCK_H = 1024  # columns a program


def combine_ref(
    routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor
) -> torch.Tensor:
    """The definition: routed fp32 [T, K, H] (the routes' outputs) or [T, H] (their sum),
    gate_logit [T, 1] and shared [T, H] in the model's dtype; returns [T, H] in that dtype."""
    if routed.dim() == 3:
        routed = routed.sum(dim=1)
    gate = torch.sigmoid(gate_logit)
    return (routed + (gate * shared).float()).to(shared.dtype)


@triton.jit
def _combine_kernel(
    routed_ptr, gate_ptr, shared_ptr, out_ptr, hidden, stride_rt, stride_rk, stride_gt,
    stride_st, stride_ot, ROUTES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    common.pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    dtype = out_ptr.dtype.element_ty
    acc = tl.load(routed_ptr + t * stride_rt + cols, mask=ok, other=0.0)
    for k in tl.static_range(1, ROUTES):
        acc += tl.load(routed_ptr + t * stride_rt + k * stride_rk + cols, mask=ok, other=0.0)
    gate = tl.sigmoid(tl.load(gate_ptr + t * stride_gt).to(tl.float32)).to(dtype)
    shared = tl.load(shared_ptr + t * stride_st + cols, mask=ok, other=0.0)
    scaled = (gate.to(tl.float32) * shared.to(tl.float32)).to(dtype)
    tl.store(out_ptr + t * stride_ot + cols, (acc + scaled.to(tl.float32)).to(dtype), mask=ok)


def combine_triton(
    routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor
) -> torch.Tensor:
    """`combine_ref` in one launch (the routes summed in order, in fp32)."""
    tokens, hidden = shared.shape
    routes = routed.shape[1] if routed.dim() == 3 else 1
    if (
        routed.dtype != torch.float32
        or routed.shape[0] != tokens
        or routed.shape[-1] != hidden
        or routed.dim() not in (2, 3)
        or gate_logit.shape != (tokens, 1)
        or gate_logit.dtype != shared.dtype
    ):
        raise ValueError(
            f"routed {routed.dtype} {tuple(routed.shape)}, gate_logit {gate_logit.dtype} "
            f"{tuple(gate_logit.shape)}, shared {shared.dtype} {tuple(shared.shape)}: routed must "
            f"be float32 [T, K, H] or [T, H], gate_logit [T, 1] and shared [T, H] of one dtype"
        )
    for name, tensor in (("routed", routed), ("shared", shared)):
        common.check_last_dim_contiguous(name, tensor)
    common.check_same_device(routed=routed, gate_logit=gate_logit, shared=shared)
    out = common.alloc((tokens, hidden), shared.dtype, shared.device)
    if not tokens:
        return out
    route_stride = routed.stride(1) if routed.dim() == 3 else 0
    _combine_kernel[(tokens, triton.cdiv(hidden, BLOCK_H))](
        routed, gate_logit, shared, out, hidden, routed.stride(0), route_stride,
        gate_logit.stride(0), shared.stride(0), out.stride(0), ROUTES=routes, BLOCK=BLOCK_H,
        num_warps=4, **common.pdl_launch(shared.device),
    )  # fmt: skip
    return out


def combine(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """`combine_ref`'s result: one Triton launch on CUDA, the reference elsewhere."""
    if shared.is_cuda and routed.dtype == torch.float32:
        return combine_triton(routed, gate_logit, shared)
    return combine_ref(routed, gate_logit, shared)
