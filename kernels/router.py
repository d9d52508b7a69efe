"""The MoE router: softmax, top-k and optional renormalizing, as HF's Qwen3/Qwen2/OLMoE/Mixtral.

`topk_softmax` routes logits already computed; `route` (kernels/route.py) is a decode step's whole
router in one launch.
"""

from __future__ import annotations

import torch

from . import common
from .common import tl, triton


def topk_softmax_ref(
    logits: torch.Tensor, k: int, renormalize: bool, ids_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: softmax in fp32 over experts, top-k, optionally rescaled to sum to 1."""
    _check(logits, k, ids_out)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if ids_out is None:
        return weights, ids.to(torch.int32)
    ids_out.copy_(ids)
    return weights, ids_out


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_l,
    stride_w,
    stride_i,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    e_idx = tl.arange(0, BLOCK_E)
    e_ok = e_idx < num_experts
    logits = tl.load(logits_ptr + row * stride_l + e_idx, mask=e_ok, other=float("-inf"))
    logits = logits.to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    k_idx = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
    # Padding lanes sit below every real probability (>= 0), so they are never picked; a NaN one
    # (a NaN or infinite logit in the row) at 2.0, above every one (<= 1), as torch.topk ranks
    # NaN, so that each pick names a real expert (a NaN equals nothing: no lane would match it).
    remaining = tl.where(e_ok, tl.where(probs == probs, probs, 2.0), -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        # Ties go to the lowest expert index, as torch.topk does on CPU.
        best_id = tl.min(tl.where(remaining == best, e_idx, BLOCK_E), axis=0)
        top_w = tl.where(k_idx == j, tl.where(best > 1.0, float("nan"), best), top_w)
        top_i = tl.where(k_idx == j, best_id, top_i)
        remaining = tl.where(e_idx == best_id, -2.0, remaining)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    k_ok = k_idx < TOP_K
    tl.store(weights_ptr + row * stride_w + k_idx, top_w, mask=k_ok)
    tl.store(ids_ptr + row * stride_i + k_idx, top_i, mask=k_ok)


def topk_softmax_triton(
    logits: torch.Tensor, k: int, renormalize: bool, ids_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton router: one program per token; weights fp32 [T, K] (descending), ids int32 [T, K]
    (written into `ids_out` when given: rows may be strided, e.g. a layer's column of a
    [tokens, layers, K] record)."""
    _check(logits, k, ids_out)
    num_tokens, num_experts = logits.shape
    weights = common.alloc((num_tokens, k), torch.float32, logits.device)
    ids = ids_out if ids_out is not None else common.alloc((num_tokens, k), torch.int32,
                                                           logits.device)  # fmt: skip
    block_e = common.next_pow2(num_experts)
    pdl = common.pdl_launch(logits.device)
    _topk_softmax_kernel[(num_tokens,)](
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        weights.stride(0),
        ids.stride(0),
        TOP_K=k,
        BLOCK_E=block_e,
        BLOCK_K=common.next_pow2(k),
        RENORMALIZE=renormalize,
        num_warps=max(1, min(8, block_e // 128)),
        **pdl,
    )
    return weights, ids


def topk_softmax(
    logits: torch.Tensor, k: int, renormalize: bool, ids_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router softmax + top-k: the Triton kernel on CUDA, the reference elsewhere."""
    if logits.is_cuda:
        return topk_softmax_triton(logits, k, renormalize, ids_out)
    return topk_softmax_ref(logits, k, renormalize, ids_out)


def _check(logits: torch.Tensor, k: int, ids_out: torch.Tensor | None) -> None:
    """Validate logits [T, E], 1 <= k <= E, and an int32 [T, k] ids_out with contiguous rows."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, num_experts], got {tuple(logits.shape)}")
    check_k_and_ids_out(logits.shape[0], logits.shape[1], k, ids_out)
    common.check_last_dim_contiguous("logits", logits)
    if ids_out is not None:
        common.check_same_device(logits=logits, ids_out=ids_out)


def check_k_and_ids_out(
    num_tokens: int, num_experts: int, k: int, ids_out: torch.Tensor | None
) -> None:
    """Validate 1 <= k <= num_experts and an int32 [T, k] ids_out with contiguous rows."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be between 1 and the number of experts ({num_experts}), got {k}")
    if ids_out is not None:
        if ids_out.shape != (num_tokens, k) or ids_out.dtype != torch.int32:
            raise ValueError(
                f"ids_out must be int32 [{num_tokens}, {k}], got "
                f"{tuple(ids_out.shape)} {ids_out.dtype}"
            )
        common.check_last_dim_contiguous("ids_out", ids_out)
