"""Decode attention over the paged KV cache (grouped-query), split over the context.

Flash-decoding: each program of the first launch takes one sequence, one KV head with all the query
heads that share it, and one slice of the context; it writes a normalized partial output and its
log-sum-exp. The second launch merges the slices. Slices are sized on the device from seq_lens, so
the grid depends only on the batch size, the heads and the caller's max_blocks: the call can be
captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import common, fp8_kv, fp8_moe
from .common import tl, triton

_LOG2E = 1.4426950408889634
# Partial results merged per step of the merge loop: few steps, since each waits on its loads.
_MERGE_CHUNK = 64


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tokens per inner step, context slices per (sequence, KV head), and launch options."""

    block_n: int = 64
    num_splits: int | None = None  # None: enough slices for about 4 programs per SM
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {self.block_n}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


def paged_attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    compute_dtype: torch.dtype | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Reference: gather each sequence's pages, softmax(q·k·scale) in fp32, weighted sum of v.
    FP8 caches (uint8 bits) come with their factors in `kv_scales` (kernels/fp8_kv.py) and are
    widened to fp32 first. gpt-oss's attention: `sinks` [Hq], a logit per head that joins the
    softmax's denominator (its value is zero), and `window` > 0, the last positions a query sees
    (its own included)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, kv_scales, sinks)
    dtype = compute_dtype or q.dtype
    if kv_scales is not None:
        k_cache = fp8_kv.dequantize_heads(k_cache, kv_scales[0], torch.float32)
        v_cache = fp8_kv.dequantize_heads(v_cache, kv_scales[1], torch.float32)
    _, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pages = block_tables[b, : -(-seq_len // block_size)].long()
        first = max(0, seq_len - window) if window else 0
        keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[first:seq_len].to(dtype)
        values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[first:seq_len].to(dtype)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (keys @ q[b].to(dtype)[:, :, None]).squeeze(-1).float() * scale  # [Hq, L]
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=-1)
        probs = torch.softmax(scores, dim=-1)[:, : values.shape[1]]
        out[b] = (probs[:, None, :] @ values.float()).squeeze(1).to(q.dtype)
    return out


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    num_splits,
    window,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_wait(PDL)  # a wide grid: see pdl_wait
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    first = _first_seen(seq_len, window)
    part = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * part
    end = tl.minimum(start + part, seq_len)
    if start < end:
        g_idx = tl.arange(0, BLOCK_G)
        d_idx = tl.arange(0, BLOCK_D)
        g_ok = g_idx < GROUP
        d_ok = d_idx < HEAD_DIM
        heads = kv_head * GROUP + g_idx
        q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d_idx[None, :]
        q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        q = (q * scale_log2).to(COMPUTE)
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        table_row = tables_ptr + b.to(tl.int64) * stride_tb
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            p_ok = pos < end
            page = tl.load(table_row + pos // PAGE, mask=p_ok, other=0).to(tl.int64)
            k_rows = page * stride_kb + (pos % PAGE) * stride_kt + kv_head * stride_kh
            v_rows = page * stride_vb + (pos % PAGE) * stride_vt + kv_head * stride_vh
            kv_mask = p_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + k_rows[:, None] + d_idx[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + v_rows[:, None] + d_idx[None, :], mask=kv_mask, other=0.0)
            if FP8:
                # e4m3 bits widened exactly (every e4m3 value is a bf16 and an fp16 one); each
                # token's factors go on its score and its probability, in fp32
                factor_rows = (page * PAGE + pos % PAGE) * NUM_KV_HEADS + kv_head
                k_factor = tl.load(k_scale_ptr + factor_rows, mask=p_ok, other=0.0)
                v_factor = tl.load(v_scale_ptr + factor_rows, mask=p_ok, other=0.0)
                k = fp8_moe.values(k).to(COMPUTE)
                v = fp8_moe.values(v).to(COMPUTE)
            # "ieee": an fp32 compute dtype multiplies exactly, not in TF32; bf16/fp16 ignore it.
            scores = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision="ieee")
            if FP8:
                scores = scores * k_factor[None, :]
            scores = tl.where(p_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if FP8:
                p = p * v_factor[None, :]
            acc = acc * alpha[:, None] + tl.dot(
                p.to(COMPUTE), v.to(COMPUTE), input_precision="ieee"
            )
            m_i = m_new
        out_ptrs = (
            part_out_ptr
            + b * stride_pb
            + heads[:, None] * stride_ph
            + split * stride_ps
            + d_idx[None, :]
        )
        tl.store(out_ptrs, acc / l_i[:, None], mask=g_ok[:, None] & d_ok[None, :])
        lse_ptrs = part_lse_ptr + b * stride_lb + heads * stride_lh + split
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=g_ok)


@triton.jit
def _first_seen(seq_len, window):
    """The first position a sequence's query sees: 0, or the window's first (window > 0)."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    lens_ptr,
    sinks_ptr,
    out_ptr,
    num_splits,
    window,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
    SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    span = seq_len - _first_seen(seq_len, window)
    part = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    # Slices past the end of the sequence wrote nothing; an empty sequence has none (output 0).
    num_used = tl.cdiv(span, tl.maximum(part, 1))
    s_idx = tl.arange(0, BLOCK_S)
    lse_row = part_lse_ptr + b * stride_lb + head * stride_lh
    lse = tl.load(lse_row + s_idx, mask=s_idx < num_used, other=float("-inf"))
    lse_max = tl.maximum(tl.max(lse, axis=0), -1e30)
    if SINKS:
        # the head's sink joins the denominator (in the partial results' log2 units)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    denom = tl.sum(tl.exp2(lse - lse_max), axis=0)
    if SINKS:
        denom += tl.where(num_used > 0, tl.exp2(sink - lse_max), 0.0)
    d_idx = tl.arange(0, BLOCK_D)
    d_ok = d_idx < HEAD_DIM
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    out_row = part_out_ptr + b * stride_pb + head * stride_ph
    for s0 in range(0, num_used, CHUNK):
        c_idx = s0 + tl.arange(0, CHUNK)
        c_ok = c_idx < num_used
        weight = tl.exp2(tl.load(lse_row + c_idx, mask=c_ok, other=float("-inf")) - lse_max)
        parts = tl.load(
            out_row + c_idx[:, None] * stride_ps + d_idx[None, :],
            mask=c_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc += tl.sum(weight[:, None] * parts, axis=0)
    result = tl.where(denom > 0, acc / tl.maximum(denom, 1e-30), 0.0)
    out_ptrs = out_ptr + b * stride_ob + head * stride_oh + d_idx
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    compute_dtype: torch.dtype | None = None,
    config: AttentionConfig | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Triton split-context decode attention: [B, Hq, D] in q's dtype, graph-capturable. FP8
    caches (uint8 bits, their factors in `kv_scales`) are widened in registers with integer
    ops. gpt-oss's sinks and window as in the reference: the slices cover the window only, and
    the merge adds the sink to the denominator."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, kv_scales, sinks)
    cfg = config or AttentionConfig()
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size
    if window:
        max_tokens = min(max_tokens, window)
    num_splits = cfg.num_splits or default_num_splits(
        batch * num_kv_heads, max_tokens, cfg.block_n, common.sm_count(q.device)
    )
    block_d = common.next_pow2(head_dim, 16)
    part_out = common.alloc((batch, num_q_heads, num_splits, head_dim), torch.float32, q.device)
    part_lse = common.alloc((batch, num_q_heads, num_splits), torch.float32, q.device)
    out = common.alloc(tuple(q.shape), q.dtype, q.device)
    pdl = common.pdl_launch(q.device)
    fp8 = kv_scales is not None
    _split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        fp8_moe.bits(k_cache) if fp8 else k_cache,
        fp8_moe.bits(v_cache) if fp8 else v_cache,
        block_tables,
        seq_lens,
        *(kv_scales or (seq_lens, seq_lens)),
        part_out,
        part_lse,
        scale * _LOG2E,
        num_splits,
        window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_G=common.next_pow2(group, 16),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=block_size,
        BLOCK_N=cfg.block_n,
        COMPUTE=common.tl_dtype(compute_dtype or q.dtype),
        FP8=fp8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )
    _merge_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        seq_lens,
        sinks if sinks is not None else seq_lens,
        out,
        num_splits,
        window,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        BLOCK_S=common.next_pow2(num_splits),
        CHUNK=min(_MERGE_CHUNK, common.next_pow2(num_splits)),
        SINKS=sinks is not None,
        num_warps=8,
        **pdl,
    )
    return out


def default_num_splits(rows: int, max_tokens: int, block_n: int, sms: int) -> int:
    """Context slices per (sequence, KV head) so that the grid holds about 4 programs per SM."""
    wanted = math.ceil(4 * sms / max(rows, 1))
    return max(1, min(wanted, triton.cdiv(max_tokens, block_n)))


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    compute_dtype: torch.dtype | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Decode attention over paged KV: the Triton kernels on CUDA, the reference elsewhere
    (gpt-oss's sinks and window: paged_attention_decode_ref)."""
    fn = paged_attention_decode_triton if q.is_cuda else paged_attention_decode_ref
    return fn(
        q, k_cache, v_cache, block_tables, seq_lens, scale,
        compute_dtype=compute_dtype, kv_scales=kv_scales, sinks=sinks, window=window,
    )  # fmt: skip


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Validate shapes (metadata only: no device sync, so the call stays graph-capturable)."""
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device):
        raise ValueError(
            f"sinks must be [Hq={q.shape[1]}] on {q.device}, got {tuple(sinks.shape)} on "
            f"{sinks.device}"
        )
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    batch, num_q_heads, head_dim = q.shape
    if (
        k_cache.dim() != 4
        or k_cache.shape[3] != head_dim
        or v_cache.shape != k_cache.shape
        or v_cache.dtype != k_cache.dtype
    ):
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, {head_dim}]:"
            f" got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables must be [B={batch}, max_blocks] and seq_lens [B]: got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    if (k_cache.dtype == torch.uint8) != (kv_scales is not None):
        raise ValueError(
            f"k_cache is {k_cache.dtype}: FP8 caches (uint8 bits) and only they come with "
            "kv_scales, their factors (kernels/fp8_kv.py)"
        )
    named = dict(zip(("k_scale", "v_scale"), kv_scales, strict=True)) if kv_scales else {}
    for name, factors in named.items():
        if (
            tuple(factors.shape) != tuple(k_cache.shape[:3])
            or factors.dtype != torch.float32
            or not factors.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous float32 {tuple(k_cache.shape[:3])} tensor (one "
                f"factor per slot and KV head), got {factors.dtype} {tuple(factors.shape)}"
            )
    for name, tensor in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
    ):
        common.check_last_dim_contiguous(name, tensor)
    common.check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens
    )
