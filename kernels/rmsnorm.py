"""RMSNorm, and residual add fused with RMSNorm, rounded exactly as Hugging Face computes them.

HF: upcast to fp32, x * rsqrt(mean(x^2) + eps), cast back to the input dtype, then multiply by the
weight (in the weight's and input's common dtype). The residual add is done in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm over the last dimension, as HF's Qwen3/Llama RMSNorm."""
    _check(x, weight)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: new_residual = x + residual; (rmsnorm(new_residual) * weight, new_residual)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


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
    stride_r,
    stride_o,
    stride_n,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # Rounded to the input dtype first, as x + residual is in torch.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_n + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernel over every row of x (any leading shape), with or without the residual add."""
    _check(x, weight)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = common.alloc(tuple(rows.shape), out_dtype, x.device)
    new_residual = None
    res_rows = rows
    if residual is not None:
        res_rows = residual.reshape(-1, hidden)
        common.check_last_dim_contiguous("residual", res_rows)
        new_residual = common.alloc(tuple(rows.shape), x.dtype, x.device)
    block = common.next_pow2(hidden)
    _rmsnorm_kernel[(rows.shape[0],)](
        rows,
        res_rows,
        weight,
        out,
        new_residual if new_residual is not None else out,
        hidden,
        eps,
        rows.stride(0),
        res_rows.stride(0),
        out.stride(0),
        new_residual.stride(0) if new_residual is not None else 0,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    if new_residual is None:
        return out.view(x.shape), None
    return out.view(x.shape), new_residual.view(x.shape)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm: one program per row."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm in one pass: (normed, new_residual)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )
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
