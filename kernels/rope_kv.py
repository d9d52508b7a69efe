"""Per-head q/k RMSNorm, rotary embedding and the KV-cache write of one layer, in one launch.

Around attention the engine normalizes each q and k head (Qwen3's qk norm), rotates them
(rotate-half RoPE) and stores k and v at their cache slots: a dozen small kernels per layer. The
kernel here does all of it in one launch and rounds every step exactly as the torch code it
replaces, so the engine's greedy tokens stay those of Hugging Face:

- each product and sum of two model-dtype values is rounded to the model dtype, as torch's
  elementwise ops do: round(fp32(a) * fp32(b)), round(fp32(a) + fp32(b)); fp32 multiply-adds are
  not fused (`enable_fp_fusion=False`), since torch runs them as separate kernels;
- the RMSNorm's sum of squares is added in the order of torch's CUDA reduction (`_torch_lanes`), and
  1/sqrt is the same approximate instruction as torch.rsqrt's, so 1/rms has the same last bit. The
  order is torch 2.11's (the GPU machine's); the CUDA tests in tests/kernels/test_rope_kv.py check
  it against the torch installed.
"""

from __future__ import annotations

import torch

from . import common, fp8_kv
from .common import round_to, tl, triton
from .rmsnorm import rmsnorm_ref

# torch's CUDA reduction (ATen/native/cuda/Reduce.cuh, torch 2.11): at most 512 threads per block;
# rows of 128 or more fp32 are read in vectors of 4.
_TORCH_MAX_THREADS = 512
_TORCH_WARP = 32
_TORCH_VEC_FROM = 128
_TORCH_VEC = 4
MAX_HEAD_DIM = 512  # beyond it torch splits a row across warps, which the kernel does not model
# the caches' dtypes besides FP8 (uint8 bits with their factors, kernels/fp8_kv.py)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qk_norm_rope_kv_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reference: split qkv, RMSNorm each q and k head (when norms are given), rotate q and k
    (rotate-half) with the tables' rows at `positions`, write k and v into the caches at the flat
    `slots` (in the caches' dtype; FP8 caches, uint8, with their factors in `kv_scales`,
    kernels/fp8_kv.py); returns the rotated q [T, Hq, D]."""
    _check(qkv, positions, cos_table, sin_table, q_norm, k_norm, k_cache, v_cache, slots,
           num_heads, num_kv_heads, head_dim, kv_scales)  # fmt: skip
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(tokens, num_heads, head_dim)
    k = k.reshape(tokens, num_kv_heads, head_dim)
    v = v.reshape(tokens, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q = rmsnorm_ref(q, q_norm, eps)
        k = rmsnorm_ref(k, k_norm, eps)
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    write_kv(k_cache, v_cache, kv_scales, slots, k, v)
    return q.contiguous()


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store k and v [T, Hkv, D] at the flat `slots` of the caches: in the caches' dtype, or as
    FP8 bits and their factors where `kv_scales` are given (kernels/fp8_kv.py)."""
    flat_slots = slots.long()
    heads = k.shape[1:]
    if kv_scales is None:
        k_cache.view(-1, *heads).index_copy_(0, flat_slots, k.to(k_cache.dtype))
        v_cache.view(-1, *heads).index_copy_(0, flat_slots, v.to(v_cache.dtype))
        return
    for cache, scales, x in ((k_cache, kv_scales[0], k), (v_cache, kv_scales[1], v)):
        bits, factors = fp8_kv.quantize_heads(x)
        cache.view(-1, *heads).index_copy_(0, flat_slots, bits)
        scales.view(-1, heads[0]).index_copy_(0, flat_slots, factors)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@triton.jit
def _inv_rms(src, eps, HEAD_DIM: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of one head, its squares added in torch's CUDA order: lane l
    accumulates elements l*VEC + i + r*LANES*VEC over r in order, one accumulator per i; a lane's
    accumulators are added i = 0, 1, ...; lane totals are then folded in halves (the shared-memory
    steps, then the warp shuffles with decreasing offsets)."""
    lane = tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    acc = tl.zeros((LANES, VEC), dtype=tl.float32)
    for r in tl.static_range(HEAD_DIM // (LANES * VEC)):
        x = tl.load(src + r * LANES * VEC + lane).to(tl.float32)
        acc += x * x
    column = tl.arange(0, VEC)[None, :]
    # Picking a column by a masked sum adds only zeros to it: exact.
    total = tl.sum(tl.where(column == 0, acc, 0.0), axis=1)
    for i in tl.static_range(1, VEC):
        total += tl.sum(tl.where(column == i, acc, 0.0), axis=1)
    for _ in tl.static_range(LANES.bit_length() - 1):
        total = tl.sum(tl.reshape(total, (2, total.shape[0] // 2)), axis=0)
    mean = tl.sum(total, axis=0) * (1.0 / HEAD_DIM)
    return tl.rsqrt(mean + eps)


@triton.jit
def _norm_rope(
    src,
    norm_ptr,
    eps,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    LANES: tl.constexpr,
    VEC: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """One head: optional RMSNorm, then rotate-half RoPE; the two halves, in fp32 holding DTYPE
    values."""
    half = tl.arange(0, HEAD_DIM // 2)
    x_lo = tl.load(src + half).to(tl.float32)
    x_hi = tl.load(src + HEAD_DIM // 2 + half).to(tl.float32)
    if HAS_NORM:
        inv_rms = _inv_rms(src, eps, HEAD_DIM, LANES, VEC)
        w_lo = tl.load(norm_ptr + half).to(tl.float32)
        w_hi = tl.load(norm_ptr + HEAD_DIM // 2 + half).to(tl.float32)
        x_lo = round_to(round_to(x_lo * inv_rms, DTYPE) * w_lo, DTYPE)
        x_hi = round_to(round_to(x_hi * inv_rms, DTYPE) * w_hi, DTYPE)
    # x * cos + cat(-x_hi, x_lo) * sin, each product and the sum rounded to DTYPE
    out_lo = round_to(round_to(x_lo * cos_lo, DTYPE) + round_to(-x_hi * sin_lo, DTYPE), DTYPE)
    out_hi = round_to(round_to(x_hi * cos_hi, DTYPE) + round_to(x_lo * sin_hi, DTYPE), DTYPE)
    return out_lo, out_hi


@triton.jit
def _qk_norm_rope_kv_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_out_ptr,
    eps,
    stride_qkv,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    Q_LANES: tl.constexpr,
    K_LANES: tl.constexpr,
    VEC: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads first, then KV heads
    dtype = q_out_ptr.dtype.element_ty
    half = tl.arange(0, HEAD_DIM // 2)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_row = cos_ptr + position * stride_cos
    sin_row = sin_ptr + position * stride_sin
    cos_lo = tl.load(cos_row + half).to(tl.float32)
    cos_hi = tl.load(cos_row + HEAD_DIM // 2 + half).to(tl.float32)
    sin_lo = tl.load(sin_row + half).to(tl.float32)
    sin_hi = tl.load(sin_row + HEAD_DIM // 2 + half).to(tl.float32)
    row = qkv_ptr + token * stride_qkv
    if head < NUM_HEADS:
        out_lo, out_hi = _norm_rope(
            row + head * HEAD_DIM, q_norm_ptr, eps, cos_lo, cos_hi, sin_lo, sin_hi,
            HEAD_DIM, HAS_NORM, Q_LANES, VEC, dtype,
        )  # fmt: skip
        dst = q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM
        tl.store(dst + half, out_lo.to(dtype))
        tl.store(dst + HEAD_DIM // 2 + half, out_hi.to(dtype))
    else:
        kv_head = head - NUM_HEADS
        out_lo, out_hi = _norm_rope(
            row + (NUM_HEADS + kv_head) * HEAD_DIM, k_norm_ptr, eps, cos_lo, cos_hi, sin_lo,
            sin_hi, HEAD_DIM, HAS_NORM, K_LANES, VEC, dtype,
        )  # fmt: skip
        slot = tl.load(slots_ptr + token).to(tl.int64)
        offset = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
        cols = tl.arange(0, HEAD_DIM)
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + cols)
        if FP8:
            # the head's factor from its largest magnitude, then its values over it as e4m3
            k_amax = tl.maximum(tl.max(tl.abs(out_lo), axis=0), tl.max(tl.abs(out_hi), axis=0))
            k_factor = fp8_kv.head_factor(k_amax)
            v = v.to(tl.float32)
            v_factor = fp8_kv.head_factor(tl.max(tl.abs(v), axis=0))
            tl.store(k_cache_ptr + offset + half, fp8_kv.head_bits(out_lo, k_factor))
            tl.store(
                k_cache_ptr + offset + HEAD_DIM // 2 + half, fp8_kv.head_bits(out_hi, k_factor)
            )
            tl.store(v_cache_ptr + offset + cols, fp8_kv.head_bits(v, v_factor))
            tl.store(k_scale_ptr + slot * NUM_KV_HEADS + kv_head, k_factor)
            tl.store(v_scale_ptr + slot * NUM_KV_HEADS + kv_head, v_factor)
        else:
            # a cache narrower than the model's dtype (a bf16 cache under fp32) rounds to nearest
            cache_dtype = k_cache_ptr.dtype.element_ty
            out_lo = round_to(out_lo, cache_dtype)
            out_hi = round_to(out_hi, cache_dtype)
            v = round_to(v.to(tl.float32), cache_dtype)
            tl.store(k_cache_ptr + offset + half, out_lo.to(cache_dtype))
            tl.store(k_cache_ptr + offset + HEAD_DIM // 2 + half, out_hi.to(cache_dtype))
            tl.store(v_cache_ptr + offset + cols, v.to(cache_dtype))


def qk_norm_rope_kv_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton: one launch over (token, q and KV head), bit-exact with the reference; no host sync,
    so it can be captured in a CUDA graph."""
    _check(qkv, positions, cos_table, sin_table, q_norm, k_norm, k_cache, v_cache, slots,
           num_heads, num_kv_heads, head_dim, kv_scales)  # fmt: skip
    tokens = qkv.shape[0]
    q_out = common.alloc((tokens, num_heads, head_dim), qkv.dtype, qkv.device)
    q_lanes, vec = _torch_lanes(head_dim, tokens * num_heads)
    k_lanes, _ = _torch_lanes(head_dim, tokens * num_kv_heads)
    has_norm = q_norm is not None
    pdl = common.pdl_launch(qkv.device)
    _qk_norm_rope_kv_kernel[(tokens, num_heads + num_kv_heads)](
        qkv,
        positions,
        cos_table,
        sin_table,
        q_norm if has_norm else qkv,
        k_norm if has_norm else qkv,
        k_cache,
        v_cache,
        slots,
        *(kv_scales or (slots, slots)),
        q_out,
        eps,
        qkv.stride(0),
        cos_table.stride(0),
        sin_table.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HAS_NORM=has_norm,
        Q_LANES=q_lanes,
        K_LANES=k_lanes,
        VEC=vec,
        FP8=kv_scales is not None,
        num_warps=max(1, min(4, head_dim // 128)),
        enable_fp_fusion=False,
        **pdl,
    )
    return q_out


def qk_norm_rope_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """qk norm + RoPE + KV write: the Triton kernel on CUDA, the reference elsewhere."""
    fn = qk_norm_rope_kv_triton if qkv.is_cuda else qk_norm_rope_kv_ref
    return fn(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, k_cache, v_cache, slots,
              num_heads, num_kv_heads, head_dim, kv_scales)  # fmt: skip


def _torch_lanes(head_dim: int, rows: int) -> tuple[int, int]:
    """Threads across one row (lanes) and elements per load (vec) of torch's CUDA mean over the
    last dimension of [rows, head_dim] fp32: ReduceConfig.set_block_dimension of Reduce.cuh."""
    vec = _TORCH_VEC if head_dim >= _TORCH_VEC_FROM else 1
    dim0 = head_dim // vec
    dim0_pow2 = min(_last_pow2(dim0), _TORCH_MAX_THREADS)
    dim1_pow2 = min(_last_pow2(rows), _TORCH_MAX_THREADS)
    block_height = min(dim1_pow2, _TORCH_MAX_THREADS // min(dim0_pow2, _TORCH_WARP))
    lanes = min(dim0_pow2, _TORCH_MAX_THREADS // block_height)
    # Unvectorized, torch keeps 4 accumulators per lane and adds them at the end; the kernel adds
    # a lane's elements in one, the same sum while a lane has at most 4.
    assert vec > 1 or head_dim <= 4 * lanes
    return lanes, vec


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _check(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Validate shapes, dtypes and layouts (metadata only: no device sync, so graph-capturable)."""
    if head_dim < 16 or head_dim & (head_dim - 1) or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be a power of two from 16 to {MAX_HEAD_DIM}, got {head_dim}"
        )
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"need at least one q and one KV head, got {num_heads} and {num_kv_heads}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"qkv must be [T, (Hq + 2 Hkv) * D] = [T, {width}], got {tuple(qkv.shape)}"
        )
    common.tl_dtype(qkv.dtype)
    tokens = qkv.shape[0]
    for name, index in (("positions", positions), ("slots", slots)):
        if index.shape != (tokens,) or index.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be int32 or int64 [T={tokens}], got {index.dtype} "
                f"{tuple(index.shape)}"
            )
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        if table.dim() != 2 or table.shape[1] != head_dim or table.dtype != qkv.dtype:
            raise ValueError(
                f"{name} must be [max_positions, {head_dim}] {qkv.dtype}, got "
                f"{table.dtype} {tuple(table.shape)}"
            )
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together: give both or neither")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != qkv.dtype):
            raise ValueError(
                f"{name} must be [{head_dim}] {qkv.dtype} (one weight for every head), got "
                f"{weight.dtype} {tuple(weight.shape)}"
            )
    fp8 = kv_scales is not None
    cache_dtypes = (torch.uint8,) if fp8 else CACHE_DTYPES
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (
            cache.dim() < 3
            or tuple(cache.shape[-2:]) != (num_kv_heads, head_dim)
            or cache.dtype not in cache_dtypes
            or cache.dtype != k_cache.dtype
            or not cache.is_contiguous()
        ):
            kinds = "uint8 (FP8 bits, with kv_scales)" if fp8 else "float32, bfloat16 or float16"
            raise ValueError(
                f"{name} must be a contiguous [..., Hkv={num_kv_heads}, D={head_dim}] "
                f"{kinds} tensor (slots index its leading dimensions flattened), both caches of "
                f"one dtype; got {cache.dtype} {tuple(cache.shape)}"
            )
    named = dict(zip(("k_scale", "v_scale"), kv_scales, strict=True)) if kv_scales else {}
    for name, scale in named.items():
        if (
            tuple(scale.shape) != tuple(k_cache.shape[:-1])
            or scale.dtype != torch.float32
            or not scale.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous float32 {tuple(k_cache.shape[:-1])} tensor (one "
                f"factor per slot and KV head of the FP8 cache), got {scale.dtype} "
                f"{tuple(scale.shape)}"
            )
    for name, tensor in (("qkv", qkv), ("cos_table", cos_table), ("sin_table", sin_table)):
        common.check_last_dim_contiguous(name, tensor)
    norms = {"q_norm": q_norm, "k_norm": k_norm} if q_norm is not None else {}
    scales = {"k_scale": kv_scales[0], "v_scale": kv_scales[1]} if kv_scales else {}
    common.check_same_device(
        qkv=qkv, positions=positions, cos_table=cos_table, sin_table=sin_table,
        k_cache=k_cache, v_cache=v_cache, slots=slots, **norms, **scales,
    )  # fmt: skip
