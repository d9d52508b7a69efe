"""RMSNorm, and residual add fused with RMSNorm, rounded exactly as Hugging Face computes them.

HF: upcast to fp32, x * rsqrt(mean(x^2) + eps), cast back to the input dtype, then multiply by the
weight (in the weight's and input's common dtype). The residual add is done in the input dtype.

The residual add may also take the routed experts' outputs as fp32 parts [..., P, H], one per
route: they are summed in fp32 and cast to the residual's dtype first, as the MoE layer would have
done in two launches of its own (a sum and a cast) per layer of every decode step.
"""

from __future__ import annotations

import torch

from . import common
from .common import tl, triton


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm over the last dimension, as HF's Qwen3/Llama RMSNorm."""
    _check(x, weight)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: new_residual = x + residual; (rmsnorm(new_residual) * weight, new_residual).

    x may be fp32 parts [..., P, H]: x.sum(-2), cast to the residual's dtype, is what is added."""
    if _is_parts(x, residual):
        x = x.sum(dim=-2).to(residual.dtype)
    _check_residual(x, residual)
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def _is_parts(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether x holds fp32 parts [..., P, H] to be summed into a residual [..., H]."""
    if x.dim() != residual.dim() + 1:
        return False
    if x.dtype != torch.float32 or x.shape[:-2] + x.shape[-1:] != residual.shape:
        raise ValueError(
            f"parts {tuple(x.shape)} {x.dtype} must be fp32 [..., P, H] for a residual "
            f"{tuple(residual.shape)}"
        )
    return True


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    hidden,
    eps,
    stride_x,
    stride_p,
    stride_r,
    stride_o,
    stride_n,
    HAS_RESIDUAL: tl.constexpr,
    PARTS: tl.constexpr,
    MODEL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    if PARTS:
        # the routes' fp32 outputs, added in route order, then cast as the MoE layer's sum was
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for part in tl.static_range(PARTS):
            acc += tl.load(x_ptr + row * stride_x + part * stride_p + cols, mask=ok, other=0.0)
        x = acc.to(MODEL)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = add_residual(x, residual, MODEL)
        tl.store(new_residual_ptr + row * stride_n + cols, x, mask=ok)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = norm_row(x, weight, hidden, eps, MODEL)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def add_residual(x, residual, MODEL: tl.constexpr):
    """x + residual, rounded to the model's dtype, as torch adds them in it."""
    return (x.to(tl.float32) + residual.to(tl.float32)).to(MODEL)


@triton.jit
def norm_row(x, weight, hidden, eps, MODEL: tl.constexpr):
    """One whole row x (model dtype; masked elements 0) normalized as HF does: in fp32, rounded to
    the model's dtype, then times the weight; fp32, for the caller to store in the output's
    dtype. (The fused residual add of host_handoff's `sum_norm_when_ready` shares it.)"""
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(MODEL)
    return normed.to(tl.float32) * weight.to(tl.float32)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernel over every row of x (any leading shape), with or without the residual add;
    with a residual, x may be fp32 parts [..., P, H] (summed into the residual's dtype first)."""
    _check(x, weight)
    hidden = x.shape[-1]
    parts = residual is not None and _is_parts(x, residual)
    like = residual if parts and residual is not None else x  # what the outputs look like
    model_dtype, shape = like.dtype, like.shape
    src = x.reshape(-1, x.shape[-2], hidden) if parts else x.reshape(-1, hidden)
    rows = src.shape[0]
    out_dtype = torch.promote_types(weight.dtype, model_dtype)
    out = common.alloc((rows, hidden), out_dtype, x.device)
    new_residual = None
    res_rows = src
    if residual is not None:
        res_rows = residual.reshape(-1, hidden)
        common.check_last_dim_contiguous("residual", res_rows)
        new_residual = common.alloc((rows, hidden), model_dtype, x.device)
    block = common.next_pow2(hidden)
    pdl = common.pdl_launch(x.device)
    _rmsnorm_kernel[(rows,)](
        src,
        res_rows,
        weight,
        out,
        new_residual if new_residual is not None else out,
        hidden,
        eps,
        src.stride(0),
        src.stride(1) if parts else 0,
        res_rows.stride(0),
        out.stride(0),
        new_residual.stride(0) if new_residual is not None else 0,
        HAS_RESIDUAL=residual is not None,
        PARTS=x.shape[-2] if parts else 0,
        MODEL=common.tl_dtype(model_dtype),
        BLOCK=block,
        num_warps=row_warps(block),
        **pdl,
    )
    if new_residual is None:
        return out.view(shape), None
    return out.view(shape), new_residual.view(shape)


def row_warps(block: int) -> int:
    """Warps of a program that holds one row of `block` elements: 8 elements a thread, 1 to 16."""
    return min(16, max(1, block // 256))


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm: one program per row."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm in one pass: (normed, new_residual); x may be fp32 parts
    [..., P, H], summed in the same pass."""
    if not _is_parts(x, residual):
        _check_residual(x, residual)
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: the Triton kernel on CUDA, the reference elsewhere."""
    if x.is_cuda:
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm: the Triton kernel on CUDA, the reference elsewhere."""
    if x.is_cuda:
        return fused_add_rmsnorm_triton(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Validate that weight covers x's last dimension and rows are contiguous."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"weight must be [{x.shape[-1]}] (x's last dimension), got {tuple(weight.shape)}"
        )
    common.check_last_dim_contiguous("x", x)
    common.check_same_device(x=x, weight=weight)
