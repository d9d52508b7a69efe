"""Decode attention over the paged KV cache (grouped-query), split over the context, in one launch.

Flash-decoding: each program takes one sequence, one KV head with all the query heads that share it,
and one slice of the context. Slices are sized on the device from seq_lens, so the grid depends only
on the batch size, the heads and the caller's max_blocks, and the call can be captured in a CUDA
graph sized for the full context (slices past a sequence's end exit at once).

The slices are merged in the same launch, "last program reduces": a program writes its normalized
partial output and log-sum-exp, then increments a counter of its (sequence, KV head) with
acquire-release semantics; the program that brings the counter to the number of slices holding
tokens sees every other partial, merges them, writes the output and sets the counter back to zero
for the next call or graph replay. The merge is two-level so its serial tail stays short at long
contexts: slices are counted in groups of `merge_fan_in`, the last of a group merges the group, and
the last group merges the groups. A sequence whose tokens fit in one slice is written directly,
without counters; one whose tokens fit in one group skips the second level.

The counters are int32 device buffers kept by this module, one per device and size, allocated (zero)
on the first call of that size, which must come before any CUDA-graph capture of it (the engine's
warm-up does this). They are shared by every call of that size on the device, so calls on one
device must be ordered: one stream, as the engine's compute stream is, or streams synchronized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import common

_LOG2E = 1.4426950408889634
# Partial values a merge step loads at once (32 fp32 registers a thread at 4 warps): few steps,
# since each waits on its loads, but not so many that the merge sets the kernel's register count
# (8192 took it from 128 to 168 with triton 3.6: 3 programs an SM instead of 4).
_MERGE_TILE = 4096
# (device, size) -> int32 arrival counters, zero between calls (see _counters).
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tokens per inner step, context slices per (sequence, KV head), slices per first-level
    merge, and launch options."""

    block_n: int = 64
    num_splits: int | None = None  # None: enough slices for about 4 programs per SM
    num_warps: int = 4
    num_stages: int = 3
    merge_fan_in: int = 16  # the last of this many slices merges them

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {self.block_n}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.merge_fan_in < 2:
            raise ValueError(f"merge_fan_in must be >= 2, got {self.merge_fan_in}")


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
def _last_to_arrive(counter_ptr, arrivals):
    """Count this program in; True for the last of `arrivals` programs, which resets the counter.

    The increment is acquire-release at GPU scope: it publishes this program's stores above it and,
    for the last program, makes every earlier program's stores visible to the loads below it.
    """
    # One thread does the atomic: the barrier puts every thread's stores before its release
    # (Triton then hands the result to the other threads through shared memory and a barrier,
    # which orders their loads after the acquire).
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)  # everyone else has counted: the next call starts from zero
    return last


@triton.jit
def _merge(
    out_ptr,
    lse_ptr,
    count,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MERGE_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Merge `count` consecutive partials ([count, GROUP, HEAD_DIM] normalized outputs and their
    [count, GROUP] log2-sum-exp): the merged [MERGE_G, BLOCK_D] output and its log2-sum-exp."""
    c_idx = tl.arange(0, CHUNK)
    g_idx = tl.arange(0, MERGE_G)
    d_idx = tl.arange(0, BLOCK_D)
    g_ok = g_idx < GROUP
    d_ok = d_idx < HEAD_DIM
    # finite, so that exp2(m - m_new) is 0 rather than NaN on the first step
    m = tl.full((MERGE_G,), -1e30, dtype=tl.float32)
    total = tl.zeros((MERGE_G,), dtype=tl.float32)
    acc = tl.zeros((MERGE_G, BLOCK_D), dtype=tl.float32)
    for s0 in range(0, count, CHUNK):
        slots = s0 + c_idx
        lse_mask = (slots < count)[:, None] & g_ok[None, :]
        # ".cg": read at L2, where the other SMs' stores are, not from this SM's L1
        lse = tl.load(
            lse_ptr + slots[:, None] * GROUP + g_idx[None, :],
            mask=lse_mask,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        parts = tl.load(
            out_ptr
            + slots[:, None, None] * (GROUP * HEAD_DIM)
            + g_idx[None, :, None] * HEAD_DIM
            + d_idx[None, None, :],
            mask=lse_mask[:, :, None] & d_ok[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new[None, :])
        total = total * alpha + tl.sum(weight, axis=0)
        acc = acc * alpha[:, None] + tl.sum(weight[:, :, None] * parts, axis=0)
        m = m_new
    total = tl.where(g_ok, total, 1.0)  # heads past the group merge nothing and are not stored
    return acc / total[:, None], m + tl.log2(total)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    group_out_ptr,
    group_lse_ptr,
    counters_ptr,
    scale_log2,
    num_splits,
    max_groups,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    MERGE_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FAN_IN: tl.constexpr,
    CHUNK: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = b * tl.num_programs(1) + kv_head  # this (sequence, KV head) in the partial buffers
    seq_len = tl.load(lens_ptr + b)
    part = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    # Slices past the end of the sequence hold no tokens and take no part in the count; every
    # program of a sequence computes the same number from the same seq_len.
    num_used = tl.cdiv(seq_len, tl.maximum(part, 1))
    g_idx = tl.arange(0, BLOCK_G)
    d_idx = tl.arange(0, BLOCK_D)
    g_ok = g_idx < GROUP
    d_ok = d_idx < HEAD_DIM
    heads = kv_head * GROUP + g_idx
    out_row = out_ptr + b * stride_ob
    out_ptrs = out_row + heads[:, None] * stride_oh + d_idx[None, :]
    if split < num_used:
        start = split * part
        end = tl.minimum(start + part, seq_len)
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
        out_mask = g_ok[:, None] & d_ok[None, :]
        if num_used == 1:
            tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # partials are [rows, slices, GROUP, HEAD_DIM]: one slice's heads are contiguous
            slot = row * num_splits + split
            part_ptrs = part_out_ptr + slot * (GROUP * HEAD_DIM)
            part_ptrs += g_idx[:, None] * HEAD_DIM + d_idx[None, :]
            tl.store(part_ptrs, acc / l_i[:, None], mask=out_mask)
            tl.store(part_lse_ptr + slot * GROUP + g_idx, m_i + tl.log2(l_i), mask=g_ok)
            group = split // FAN_IN
            num_groups = tl.cdiv(num_used, FAN_IN)
            in_group = tl.minimum(num_used - group * FAN_IN, FAN_IN)
            # counters are [rows, 1 + max_groups]: the groups' count, then each group's
            counter_row = counters_ptr + row * (1 + max_groups)
            if _last_to_arrive(counter_row + 1 + group, in_group):
                first = row * num_splits + group * FAN_IN
                merged, merged_lse = _merge(
                    part_out_ptr + first * (GROUP * HEAD_DIM),
                    part_lse_ptr + first * GROUP,
                    in_group,
                    GROUP,
                    HEAD_DIM,
                    MERGE_G,
                    BLOCK_D,
                    CHUNK,
                )
                mg_idx = tl.arange(0, MERGE_G)
                mg_ok = mg_idx < GROUP
                merged_mask = mg_ok[:, None] & d_ok[None, :]
                merged_ptrs = (
                    out_row + (kv_head * GROUP + mg_idx)[:, None] * stride_oh + d_idx[None, :]
                )
                if num_groups == 1:
                    merged_out = merged.to(out_ptr.dtype.element_ty)
                    tl.store(merged_ptrs, merged_out, mask=merged_mask)
                else:
                    group_slot = row * max_groups + group
                    group_ptrs = group_out_ptr + group_slot * (GROUP * HEAD_DIM)
                    group_ptrs += mg_idx[:, None] * HEAD_DIM + d_idx[None, :]
                    tl.store(group_ptrs, merged, mask=merged_mask)
                    lse_ptrs = group_lse_ptr + group_slot * GROUP + mg_idx
                    tl.store(lse_ptrs, merged_lse, mask=mg_ok)
                    if _last_to_arrive(counter_row, num_groups):
                        first_group = row * max_groups
                        final, _ = _merge(
                            group_out_ptr + first_group * (GROUP * HEAD_DIM),
                            group_lse_ptr + first_group * GROUP,
                            num_groups,
                            GROUP,
                            HEAD_DIM,
                            MERGE_G,
                            BLOCK_D,
                            CHUNK,
                        )
                        final = final.to(out_ptr.dtype.element_ty)
                        tl.store(merged_ptrs, final, mask=merged_mask)
    elif split == 0:
        # an empty sequence attends to nothing: its output is zero
        zeros = tl.zeros((BLOCK_G, BLOCK_D), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptrs, zeros, mask=g_ok[:, None] & d_ok[None, :])


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
    graph-capturable (after a first call of the same shape outside the capture)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    cfg = config or AttentionConfig()
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size
    num_splits = cfg.num_splits or default_num_splits(
        batch * num_kv_heads, max_tokens, cfg.block_n, common.sm_count(q.device)
    )
    max_groups = triton.cdiv(num_splits, cfg.merge_fan_in)
    rows = batch * num_kv_heads
    block_d = common.next_pow2(head_dim, 16)
    merge_g = common.next_pow2(group)
    chunk = max(1, _MERGE_TILE // (merge_g * block_d))
    chunk = min(chunk, common.next_pow2(max(min(cfg.merge_fan_in, num_splits), max_groups)))
    f32 = torch.float32
    part_out = common.alloc((rows, num_splits, group, head_dim), f32, q.device)
    part_lse = common.alloc((rows, num_splits, group), f32, q.device)
    group_out = common.alloc((rows, max_groups, group, head_dim), f32, q.device)
    group_lse = common.alloc((rows, max_groups, group), f32, q.device)
    counters = _counters(q.device, rows * (1 + max_groups))
    out = common.alloc(tuple(q.shape), q.dtype, q.device)
    _paged_attention_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        group_out,
        group_lse,
        counters,
        scale * _LOG2E,
        num_splits,
        max_groups,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=common.next_pow2(group, 16),
        MERGE_G=merge_g,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=block_size,
        BLOCK_N=cfg.block_n,
        FAN_IN=cfg.merge_fan_in,
        CHUNK=chunk,
        COMPUTE=common.tl_dtype(compute_dtype or q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """The zeroed int32 arrival counters of calls with `size` counters on `device`.

    One buffer per size, kept for good: a CUDA graph captured with it replays with its address, so
    it is never freed or replaced (growing one buffer would free the smaller one a graph holds).
    """
    key = (device, size)
    counters = _COUNTERS.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Made in the capture, its zeroing would run only in replays, not before eager calls.
            raise RuntimeError(
                "paged attention: run this call once before capturing it in a CUDA graph, so "
                f"that its {size} arrival counters are allocated outside the capture"
            )
        counters = torch.zeros(size, dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
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
