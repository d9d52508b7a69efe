"""Decode attention over the paged KV cache (grouped-query), split over the context, in one launch.

Flash-decoding: each program takes one sequence, one KV head with all the query heads that share
it, and one slice of the context. A context of one slice (at most `min_slice` tokens, or more
where the slices are few) is written out by its program directly. Otherwise each slice writes a
normalized partial output and its log-sum-exp, then counts itself done on an integer atomic of its
(sequence, KV head); the last one merges them. (A second launch merged them before: on an H200 the
two launches of a decode step at a few hundred tokens of context took 7.3 us in the chain.) Slices
are sized on the device from seq_lens, so the grid depends only on the batch size, the heads and
the caller's max_blocks: the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import common

_LOG2E = 1.4426950408889634
# Elements of the slices' outputs the merge loads at a time (query heads x slices x head dim).
_MERGE_ELEMENTS = 8192
# One set of counters per device, of the slices done of each (sequence, KV head) in the launch
# in flight (see _slice_counters).
_SLICE_COUNTERS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tokens per inner step, context slices per (sequence, KV head), and launch options."""

    block_n: int = 64
    num_splits: int | None = None  # None: enough slices for about 4 programs per SM
    # Tokens a slice takes at least (a multiple of block_n): a short context is one slice, whose
    # program writes the output itself, with no merge.
    min_slice: int = 256
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {self.block_n}")
        if self.min_slice < self.block_n or self.min_slice % self.block_n:
            raise ValueError(
                f"min_slice must be a multiple of block_n ({self.block_n}), got {self.min_slice}"
            )
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
) -> torch.Tensor:
    """Reference: gather each sequence's pages, softmax(q·k·scale) in fp32, weighted sum of v."""
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    dtype = compute_dtype or q.dtype
    _, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pages = block_tables[b, : -(-seq_len // block_size)].long()
        keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(dtype)
        values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(dtype)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (keys @ q[b].to(dtype)[:, :, None]).squeeze(-1).float() * scale  # [Hq, L]
        probs = torch.softmax(scores, dim=-1)
        out[b] = (probs[:, None, :] @ values.float()).squeeze(1).to(q.dtype)
    return out


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr, out_ptr, counter_ptr,
    scale_log2, num_splits, min_part,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_tb, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GM: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr, COMPUTE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    common.pdl_start(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    part = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_part)
    num_used = tl.cdiv(seq_len, part)  # slices with tokens in them
    start = split * part
    end = tl.minimum(start + part, seq_len)
    g_idx = tl.arange(0, BLOCK_G)
    d_idx = tl.arange(0, BLOCK_D)
    g_ok = g_idx < GROUP
    d_ok = d_idx < HEAD_DIM
    heads = kv_head * GROUP + g_idx
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d_idx[None, :]
    gd_ok = g_ok[:, None] & d_ok[None, :]
    if start < end:
        q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d_idx[None, :]
        q = tl.load(q_ptrs, mask=gd_ok, other=0.0).to(tl.float32)
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
            # "ieee": an fp32 compute dtype multiplies exactly, not in TF32; bf16/fp16 ignore it.
            scores = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision="ieee")
            scores = tl.where(p_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(COMPUTE), v.to(COMPUTE), input_precision="ieee"
            )
            m_i = m_new
        if num_used == 1:  # the whole context in this slice: its output is the answer
            tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gd_ok)
        else:
            part_ptrs = (
                part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                + d_idx[None, :]
            )  # fmt: skip
            tl.store(part_ptrs, acc / l_i[:, None], mask=gd_ok)
            lse_ptrs = part_lse_ptr + b * stride_lb + heads * stride_lh + split
            tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=g_ok)
            # Every thread's stores before the one atomic, whose release then covers them; the
            # last slice to finish (its acquire sees the others') merges the (sequence, KV head).
            tl.debug_barrier()
            counter = counter_ptr + b * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_used - 1:
                _merge_slices(
                    part_out_ptr, part_lse_ptr, out_ptr, b, kv_head, num_used,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                    GROUP, BLOCK_GM, HEAD_DIM, BLOCK_D, BLOCK_S, CHUNK,
                )  # fmt: skip
                tl.store(counter, 0)  # every used slice has counted: zero for the next launch
    elif (split == 0) & (seq_len == 0):  # an empty sequence (a padding row): output 0
        tl.store(out_ptrs, tl.zeros((BLOCK_G, BLOCK_D), out_ptr.dtype.element_ty), mask=gd_ok)


@triton.jit
def _merge_slices(
    part_out_ptr, part_lse_ptr, out_ptr, b, kv_head, num_used,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_GM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """The query heads of one (sequence, KV head): their slices' outputs weighted by their
    log-sum-exps, CHUNK slices of every head at a time. ".cg": read from L2, never from a line
    this SM's L1 might hold from before the other slices' stores."""
    g_idx = tl.arange(0, BLOCK_GM)
    g_ok = g_idx < GROUP
    heads = kv_head * GROUP + g_idx
    d_idx = tl.arange(0, BLOCK_D)
    d_ok = d_idx < HEAD_DIM
    s_idx = tl.arange(0, BLOCK_S)
    lse_rows = part_lse_ptr + b * stride_lb + heads * stride_lh
    lse = tl.load(
        lse_rows[:, None] + s_idx[None, :],
        mask=g_ok[:, None] & (s_idx < num_used)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    lse_max = tl.maximum(tl.max(lse, axis=1), -1e30)
    denom = tl.sum(tl.exp2(lse - lse_max[:, None]), axis=1)
    acc = tl.zeros((BLOCK_GM, BLOCK_D), dtype=tl.float32)
    out_rows = part_out_ptr + b * stride_pb + heads * stride_ph
    for s0 in range(0, num_used, CHUNK):
        c_idx = s0 + tl.arange(0, CHUNK)
        gc_ok = g_ok[:, None] & (c_idx < num_used)[None, :]
        lse_c = tl.load(
            lse_rows[:, None] + c_idx[None, :], mask=gc_ok, other=float("-inf"),
            cache_modifier=".cg",
        )  # fmt: skip
        parts = tl.load(
            out_rows[:, None, None] + c_idx[None, :, None] * stride_ps + d_idx[None, None, :],
            mask=gc_ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        weight = tl.exp2(lse_c - lse_max[:, None])
        acc += tl.sum(weight[:, :, None] * parts, axis=1)
    result = acc / tl.maximum(denom, 1e-30)[:, None]
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d_idx[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


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
) -> torch.Tensor:
    """Triton split-context decode attention in one launch: [B, Hq, D] in q's dtype,
    graph-capturable. Launches on one device share its slice counters: issue them one at a time
    (decode does), never concurrently on two streams."""
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    cfg = config or AttentionConfig()
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size
    num_splits = cfg.num_splits or default_num_splits(
        batch * num_kv_heads, max_tokens, cfg.block_n, common.sm_count(q.device)
    )
    block_d = common.next_pow2(head_dim, 16)
    block_gm = common.next_pow2(group)
    part_out = common.alloc((batch, num_q_heads, num_splits, head_dim), torch.float32, q.device)
    part_lse = common.alloc((batch, num_q_heads, num_splits), torch.float32, q.device)
    out = common.alloc(tuple(q.shape), q.dtype, q.device)
    pdl = common.pdl_launch(q.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out,
        _slice_counters(q.device, batch * num_kv_heads),
        scale * _LOG2E, num_splits, cfg.min_slice,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=common.next_pow2(group, 16), BLOCK_GM=block_gm, HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE=block_size, BLOCK_N=cfg.block_n,
        BLOCK_S=common.next_pow2(num_splits),
        CHUNK=max(1, min(common.next_pow2(num_splits), _MERGE_ELEMENTS // (block_gm * block_d))),
        COMPUTE=common.tl_dtype(compute_dtype or q.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    return out


def _slice_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's int32 counts of the slices done per (sequence, KV head): zeroed when made,
    and each back to zero by the launch that merged it. Grown outside a capture only."""
    counters = _SLICE_COUNTERS.get(device)
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made in a capture, its zeroing would run only at the graph's replays
            raise RuntimeError(
                "paged attention's first call of a batch size on a device must come before a "
                "CUDA graph capture (it makes the device's slice counters): call it once "
                "eagerly, as a warm-up does"
            )
        counters = torch.zeros(max(needed, 64), dtype=torch.int32, device=device)
        _SLICE_COUNTERS[device] = counters
    return counters


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
) -> torch.Tensor:
    """Decode attention over paged KV: the Triton kernels on CUDA, the reference elsewhere."""
    if q.is_cuda:
        return paged_attention_decode_triton(
            q, k_cache, v_cache, block_tables, seq_lens, scale, compute_dtype=compute_dtype
        )
    return paged_attention_decode_ref(
        q, k_cache, v_cache, block_tables, seq_lens, scale, compute_dtype=compute_dtype
    )


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Validate shapes (metadata only: no device sync, so the call stays graph-capturable)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    batch, num_q_heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
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
