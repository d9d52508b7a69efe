"""Skinny GEMM for decode: x[T, K] @ weight[N, K]^T (+ bias) for a few tokens, at HBM speed.

A decode step's dense projections read a large weight for one to a few tokens, so their time is
the time to stream the weight; at one token this kernel streams it faster than cuBLAS does, at
eight cuBLAS is faster (kernels/bench.py), so the engine's `linear` takes the kernel for one token
only. Here each
program reads a block of weight rows once, along K, for every token of the batch:
- one token: a multiply and a row sum, no tl.dot, so a block can be as narrow as one row and a
  2048-row matrix still spreads over several programs per SM;
- 2 to MAX_TOKENS tokens: tl.dot with the tokens padded to 16 and blocks of 16 rows or more.
Where row blocks alone give too few programs, a second grid dimension splits K: each split writes
fp32 partials and a second launch adds them in a fixed order, so results are deterministic (no
float atomics) and a graph replay matches an eager call bit for bit. Nothing depends on data on
the host, so calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import common, fp8
from .common import tl, triton
from .fp8_moe import bits as fp8_bits
from .fp8_moe import dot_step, is_fp8, vector_sums
from .fp8_moe import words as fp8_words

# Largest batch the kernel takes: the tokens of one tl.dot tile. The engine calls it for decode
# batches only; `linear` sends larger inputs to F.linear.
MAX_TOKENS = 16
# Programs the row blocks of the one-token path should give per SM: enough resident programs to
# keep loads in flight on every SM, and a last wave that is a small share of the whole.
ROW_PROGRAMS_PER_SM = 4
# Programs per SM below which the multi-token path splits K (a split costs a second launch).
SPLIT_PROGRAMS_PER_SM = 2
# Weight elements one program of the one-token path loads per step: 8 KiB of bf16.
ROW_TILE_ELEMENTS = 4096
# Weight bytes a program of the one-token FP8 path reads at least: bf16's narrowest blocks (o: 2
# rows of 4,096 columns) read 16 KiB; with half the bytes a weight, 2 FP8 rows by 2,048 columns
# a step took 7.3 us and 4 rows by 1,024 5.2 (docs/kernels.md).
FP8_PROGRAM_BYTES = 16 * 1024
# Outputs each program of the split-adding launch writes.
SUM_BLOCK = 1024
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# Tokens up to which `linear` (the engine's call) takes the kernel rather than cuBLAS: at
# Qwen3-30B-A3B's shapes the kernel wins at one token (qkv, o, lm_head) and loses at eight
# (python -m moelab.kernels.bench; docs/performance.md).
DISPATCH_MAX_TOKENS = 1


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Tiles of one call: weight rows and reduction step per program, K splits, warps, stages.

    block_n may be below 16 only for one token (the multi-token path uses tl.dot). num_stages is
    how many reduction steps of weight loads are in flight at once (1: no pipelining).
    """

    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name, least in (("block_n", 1), ("block_k", 16), ("num_warps", 1)):
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(
                f"split_k and num_stages must be >= 1, got {self.split_k} and {self.num_stages}"
            )


@functools.lru_cache(maxsize=64)
def choose_config(tokens: int, n: int, k: int, sms: int) -> GemvConfig:
    """Tiles for a shape on a device with `sms` SMs.

    One token: the widest block of up to 16 rows that still gives ROW_PROGRAMS_PER_SM programs per
    SM (lm_head [151936, 2048]: 16 rows; qkv [5120, 2048]: 8; o [2048, 4096]: 2 on 132 SMs), and a
    reduction step that keeps each load at ROW_TILE_ELEMENTS; no split, so one launch.
    More tokens: 16 rows by 256 (tl.dot), K split in two until there are SPLIT_PROGRAMS_PER_SM
    programs per SM, keeping at least two reduction steps per split (o: 4 splits; qkv and
    lm_head: none).
    """
    if tokens == 1:
        block_n = 16
        while block_n > 1 and triton.cdiv(n, block_n) < ROW_PROGRAMS_PER_SM * sms:
            block_n //= 2
        return GemvConfig(block_n, max(256, ROW_TILE_ELEMENTS // block_n), 1, 4, 3)
    block_n, block_k = 16, 256
    split_k = 1
    row_blocks = triton.cdiv(n, block_n)
    while row_blocks * split_k < SPLIT_PROGRAMS_PER_SM * sms and k >= 4 * split_k * block_k:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k, 4, 4)


def choose_fp8_config(tokens: int, n: int, k: int, sms: int) -> GemvConfig:
    """Tiles for an FP8 weight: choose_config's, where one token's row blocks are widened until a
    program reads FP8_PROGRAM_BYTES of weights (o [2048, 4096] on 132 SMs: 4 rows by 1024; qkv
    and lm_head keep 8 and 16 rows), each step keeping ROW_TILE_ELEMENTS of them."""
    config = choose_config(tokens, n, k, sms)
    if tokens > 1:
        return config
    block_n = config.block_n
    while block_n < 16 and block_n * k < FP8_PROGRAM_BYTES:
        block_n *= 2
    return replace(config, block_n=block_n, block_k=max(256, ROW_TILE_ELEMENTS // block_n))


def linear_decode_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """Reference: F.linear in the compute dtype, returned in x's dtype (config is not used)."""
    _check(x, weight, bias)
    dtype = compute_dtype or x.dtype
    b = bias.to(dtype) if bias is not None else None
    return F.linear(x.to(dtype), weight.to(dtype), b).to(x.dtype)


@triton.jit
def _store(
    acc,
    t_idx,
    n_idx,
    pid_k,
    bias_ptr,
    out_ptr,
    part_ptr,
    num_tokens,
    n,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Write a [tokens, rows] fp32 block: to this split's partials, or (+ bias) to the output."""
    ok = (t_idx[:, None] < num_tokens) & (n_idx[None, :] < n)
    offsets = t_idx[:, None] * n + n_idx[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * num_tokens * n + offsets, acc, mask=ok)
    else:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + n_idx, mask=n_idx < n, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _one_token_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    n,
    k,
    k_per_split,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_W: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < n
    w_rows = w_ptr + n_idx[:, None].to(tl.int64) * stride_wn
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    # Products add up elementwise and are summed across K once, after the loop.
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if EARLY_W:
        # The first step's weights are loaded before the wait for the kernel before (they are
        # not its output), so they stream in while it still runs.
        k_idx = k_start + tl.arange(0, BLOCK_K)
        k_ok = k_idx < k
        w = tl.load(w_rows + k_idx[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        common.pdl_start(PDL)
        xs = tl.load(x_ptr + k_idx, mask=k_ok, other=0.0).to(COMPUTE).to(tl.float32)
        acc += w.to(COMPUTE).to(tl.float32) * xs[None, :]
        k_loop = k_start + BLOCK_K
    else:
        common.pdl_start(PDL)
        k_loop = k_start
    # num_stages on the loop itself: the launch's num_stages pipelines only loads that feed tl.dot.
    for k0 in tl.range(k_loop, k_end, BLOCK_K, num_stages=STAGES):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_idx < k
        xs = tl.load(x_ptr + k_idx, mask=k_ok, other=0.0)
        w = tl.load(w_rows + k_idx[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        # Operands rounded to the compute dtype, multiplied and added in fp32, as tl.dot does.
        xs = xs.to(COMPUTE).to(tl.float32)
        acc += w.to(COMPUTE).to(tl.float32) * xs[None, :]
    row = tl.sum(acc, axis=1)
    t_idx = tl.zeros((1,), dtype=tl.int32)
    _store(row[None, :], t_idx, n_idx, pid_k, bias_ptr, out_ptr, part_ptr, 1, n, HAS_BIAS, SPLIT)


@triton.jit
def _tokens_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    num_tokens,
    n,
    k,
    k_per_split,
    stride_xt,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t_idx = tl.arange(0, BLOCK_T)
    t_ok = t_idx < num_tokens
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < n
    x_rows = x_ptr + t_idx[:, None] * stride_xt
    w_cols = w_ptr + n_idx[None, :].to(tl.int64) * stride_wn
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_idx < k
        xs = tl.load(x_rows + k_idx[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k_idx[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        # "ieee": an fp32 compute dtype multiplies exactly, not in TF32; bf16/fp16 ignore it.
        acc += tl.dot(xs.to(COMPUTE), w.to(COMPUTE), input_precision="ieee")
    _store(acc, t_idx, n_idx, pid_k, bias_ptr, out_ptr, part_ptr, num_tokens, n, HAS_BIAS, SPLIT)


# FP8 weights (`scale_inv`): e4m3 bits with one fp32 factor per 128x128 block (kernels/fp8.py),
# widened in integer ops on every card (kernels/fp8_moe.py). A program's rows lie in one block of
# 128 rows (BLOCK_N divides 128), so a column block's factor is one number per program. One token
# takes the bf16 path's wide steps and reads the bits as int32 words of four: each word's bytes
# become fp16 pairs (the value times 2^-8, exact), multiplied by x in one chain of multiply-adds
# (fp8_moe.vector_sums), each 16 columns' sum times its block's factor in the thread that read
# them, and the row sum times 2^8 at the end. (Loading each column's factor beside its
# activation measured slower: docs/kernels.md.)


@triton.jit
def _fp8_loads(w_rows, n_ok, factors, k0, k, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """A step of `_one_token_fp8_kernel` from column k0: its words [BLOCK_N, BLOCK_K / 4] (at
    `w_rows` [BLOCK_N, 1], int32) and the factor of each 16 columns [1, BLOCK_K / 16]."""
    j = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    vectors = k0 + 16 * tl.arange(0, BLOCK_K // 16)
    if EVEN:  # the tiles divide the weight and each split: no load needs a mask
        words = tl.load(w_rows + j[None, :])
        f = tl.load(factors + (vectors // 128)[None, :])
    else:
        words = tl.load(w_rows + j[None, :], mask=n_ok[:, None] & (j < k // 4)[None, :], other=0)
        f = tl.load(factors + (vectors // 128)[None, :], mask=(vectors < k)[None, :], other=0.0)
    return words, f


@triton.jit
def _fp8_step(acc, words, f, x_ptr, k0, k, BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr,
              PTX: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """One step of `_one_token_fp8_kernel` onto acc [BLOCK_N, BLOCK_K / 16]: the products of its
    words and x's columns from k0, each 16 columns' sum times its factor (and 2^-8)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    if EVEN:
        xs = tl.load(x_ptr + cols).to(COMPUTE).to(tl.float32)
    else:
        xs = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(COMPUTE).to(tl.float32)
    return acc + vector_sums(words, xs, PTX) * f


@triton.jit
def _one_token_fp8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    n,
    k,
    k_per_split,
    stride_wn,
    stride_sn,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_W: tl.constexpr,
    PTX: tl.constexpr,
    EVEN: tl.constexpr,
):
    """One token times an FP8 weight read as int32 words (w_ptr; stride_wn in words), K a
    multiple of 4."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < n
    w_rows = w_ptr + n_idx[:, None].to(tl.int64) * stride_wn
    factors = s_ptr + (pid_n * BLOCK_N // 128) * stride_sn
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    if EARLY_W:
        # The first step's words and factors are loaded before the wait for the kernel before
        # (they are not its output), so they stream in while it still runs (as `_one_token_kernel`)
        words, f = _fp8_loads(w_rows, n_ok, factors, k_start, k, BLOCK_K, EVEN)
        common.pdl_start(PDL)
        acc = _fp8_step(acc, words, f, x_ptr, k_start, k, BLOCK_K, COMPUTE, PTX, EVEN)
        k_loop = k_start + BLOCK_K
    else:
        common.pdl_start(PDL)
        k_loop = k_start
    for k0 in tl.range(k_loop, k_end, BLOCK_K, num_stages=STAGES):
        words, f = _fp8_loads(w_rows, n_ok, factors, k0, k, BLOCK_K, EVEN)
        acc = _fp8_step(acc, words, f, x_ptr, k0, k, BLOCK_K, COMPUTE, PTX, EVEN)
    row = tl.sum(acc, axis=1) * 256.0  # the 2^-8 of fp8_moe.word_dots given back
    t_idx = tl.zeros((1,), dtype=tl.int32)
    _store(row[None, :], t_idx, n_idx, pid_k, bias_ptr, out_ptr, part_ptr, 1, n, HAS_BIAS, SPLIT)


@triton.jit
def _tokens_fp8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    num_tokens,
    n,
    k,
    k_per_split,
    stride_xt,
    stride_wn,
    stride_sn,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    PDL: tl.constexpr,
):
    """The weights are the dot's first operand (`dot_step`): acc is [rows, tokens]."""
    common.pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t_idx = tl.arange(0, BLOCK_T)
    t_ok = t_idx < num_tokens
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < n
    rows = w_ptr + n_idx[:, None].to(tl.int64) * stride_wn
    row_factors = s_ptr + (n_idx // 128) * stride_sn
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_idx < k
        columns = tl.load(
            x_ptr + t_idx[None, :] * stride_xt + k_idx[:, None],
            mask=k_ok[:, None] & t_ok[None, :],
            other=0.0,
        ).to(COMPUTE)
        acc = dot_step(acc, rows, row_factors, n_ok, k_idx, k_ok, k0, columns, COMPUTE)
    _store(
        tl.trans(acc), t_idx, n_idx, pid_k, bias_ptr, out_ptr, part_ptr, num_tokens, n, HAS_BIAS,
        SPLIT,
    )  # fmt: skip


@triton.jit
def _sum_splits_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    total,
    n,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # Always split 0 first, then 1, ...: the same sum every call.
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + idx, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + idx % n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=ok)


def linear_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
    early_weights: bool = False,
) -> torch.Tensor:
    """Triton x[T, K] @ weight[N, K]^T (+ bias) in x's dtype, fp32 accumulation, 1 <= T <=
    MAX_TOKENS; one launch, or two when the config splits K. Graph-capturable (no host sync).

    early_weights: with programmatic dependent launch (`common.pdl`), one token reads its first
    weight tile before it waits for the kernel before it in the stream, so the weights stream in
    while that kernel runs. Only for a weight that kernel does not write (a model's parameters,
    as `linear` passes them): what it writes is visible only after the wait."""
    _check(x, weight, bias)
    tokens, k = x.shape
    n = weight.shape[0]
    cfg = config or choose_config(tokens, n, k, common.sm_count(x.device))
    call = _prepare(x, n, bias, cfg, compute_dtype)
    if tokens == 1:
        _one_token_kernel[call.grid](
            x,
            weight,
            call.bias_arg,
            call.out,
            call.partials,
            n,
            k,
            call.k_per_split,
            weight.stride(0),
            STAGES=cfg.num_stages,
            EARLY_W=early_weights and call.flags["PDL"],
            **call.flags,
        )
    else:
        _tokens_kernel[call.grid](
            x,
            weight,
            call.bias_arg,
            call.out,
            call.partials,
            tokens,
            n,
            k,
            call.k_per_split,
            x.stride(0),
            weight.stride(0),
            BLOCK_T=MAX_TOKENS,
            **call.flags,
        )
    return _sum_splits(call, cfg, bias, tokens, n)


@dataclass(frozen=True, slots=True)
class _Call:
    """What a call's launches share, bf16 or FP8: its output, the fp32 partials of a split K
    (the output itself without one), the bias argument, the grid, each split's reduction span
    and the kernels' constexprs and launch settings."""

    out: torch.Tensor
    partials: torch.Tensor
    bias_arg: torch.Tensor
    grid: tuple[int, int]
    k_per_split: int
    flags: dict


def _prepare(
    x: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    cfg: GemvConfig,
    compute_dtype: torch.dtype | None,
) -> _Call:
    tokens, k = x.shape
    if tokens > 1 and cfg.block_n < 16:
        raise ValueError(
            f"config.block_n={cfg.block_n}: {tokens} tokens use tl.dot, which needs blocks of "
            "16 rows or more (narrower blocks are for one token only)"
        )
    block_k = min(cfg.block_k, common.next_pow2(k, 16))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split = cfg.split_k > 1
    out = common.alloc((tokens, n), x.dtype, x.device)
    partials = common.alloc((cfg.split_k, tokens, n), torch.float32, x.device) if split else out
    flags = {
        "HAS_BIAS": bias is not None,
        "SPLIT": split,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": block_k,
        "COMPUTE": common.tl_dtype(compute_dtype or x.dtype),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **common.pdl_launch(x.device),
    }
    # Triton needs a tensor for every pointer argument; HAS_BIAS keeps this one unread.
    bias_arg = bias if bias is not None else out
    return _Call(
        out, partials, bias_arg, (triton.cdiv(n, cfg.block_n), cfg.split_k), k_per_split, flags
    )


def _sum_splits(
    call: _Call, cfg: GemvConfig, bias: torch.Tensor | None, tokens: int, n: int
) -> torch.Tensor:
    """The output: a split K's partials added in a fixed order (+ bias) by a second launch."""
    if cfg.split_k > 1:
        total = tokens * n
        _sum_splits_kernel[(triton.cdiv(total, SUM_BLOCK),)](
            call.partials,
            call.bias_arg,
            call.out,
            total,
            n,
            SPLIT_K=cfg.split_k,
            HAS_BIAS=bias is not None,
            BLOCK=SUM_BLOCK,
            PDL=call.flags["PDL"],
            launch_pdl=call.flags["launch_pdl"],
        )
    return call.out


def fp8_config(config: GemvConfig, tokens: int) -> GemvConfig:
    """`config` as the FP8 kernels take it: rows within one block of 128, so that a block of
    columns has one factor per program; more than one token also steps within one block of 128
    columns (tl.dot's step, one factor per step), one token over the config's own step, which
    sums each block of 128 columns before its factor (`_one_token_fp8_kernel`)."""
    block_k = config.block_k if tokens == 1 else min(config.block_k, 128)
    return replace(config, block_n=min(config.block_n, 128), block_k=block_k)


def linear_decode_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """Reference: the weight dequantized by the format's definition (`fp8.dequantize`), then
    F.linear in fp32 over x rounded to the compute dtype, returned in x's dtype."""
    _check(x, weight, bias, scale_inv)
    xs = x.to(compute_dtype or x.dtype).float()
    b = bias.float() if bias is not None else None
    return F.linear(xs, fp8.dequantize(weight, scale_inv), b).to(x.dtype)


def linear_decode_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
    early_weights: bool = False,
) -> torch.Tensor:
    """`linear_decode` over an FP8 weight [N, K] (float8_e4m3fn or its uint8 bits) with its fp32
    factors scale_inv [ceil(N/128), ceil(K/128)], widened in registers with integer ops (any
    card, and the Triton interpreter), in x's dtype with fp32 accumulation. Graph-capturable.
    early_weights: as `linear_decode`'s, one token's first step's bits and factors read before
    the wait (for a weight and factors the kernel before does not write); without programmatic
    dependent launch that step is only taken before the loop, with the same result."""
    _check(x, weight, bias, scale_inv)
    tokens, k = x.shape
    n = weight.shape[0]
    # one token reads the bits as words of four bytes (rows of a multiple of 4 bytes; else the
    # tl.dot kernel takes it, as it does several tokens)
    words = fp8_words(weight) if tokens == 1 else None
    as_tokens = 1 if words is not None else max(tokens, 2)
    # powers of two (GemvConfig) at most 128 rows divide a block; one token's steps of more than
    # 128 columns are whole blocks
    cfg = config or choose_fp8_config(as_tokens, n, k, common.sm_count(x.device))
    if as_tokens > tokens and cfg.block_n < 16:
        raise ValueError(
            f"config.block_n={cfg.block_n}: a weight of rows of {k} bytes (not a multiple of 4) "
            "takes the tl.dot kernel for one token too, which needs blocks of 16 rows or more"
        )
    cfg = fp8_config(cfg, as_tokens)
    call = _prepare(x, n, bias, cfg, compute_dtype)
    if words is not None:
        _one_token_fp8_kernel[call.grid](
            x, words, scale_inv, call.bias_arg, call.out, call.partials, n, k, call.k_per_split,
            words.stride(0), scale_inv.stride(0), STAGES=cfg.num_stages,
            EARLY_W=early_weights, PTX=common.inline_ptx(x.device),
            EVEN=n % cfg.block_n == 0 and k == call.k_per_split * cfg.split_k, **call.flags,
        )  # fmt: skip
    else:
        bits = fp8_bits(weight)
        _tokens_fp8_kernel[call.grid](
            x, bits, scale_inv, call.bias_arg, call.out, call.partials, tokens, n, k,
            call.k_per_split, x.stride(0), bits.stride(0), scale_inv.stride(0),
            BLOCK_T=MAX_TOKENS, **call.flags,
        )  # fmt: skip
    return _sum_splits(call, cfg, bias, tokens, n)


def kernel_accepts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes this call wherever it runs: a decode batch x [1..MAX_TOKENS, K],
    contiguous bf16/fp16, with a weight [N, K] and bias [N] of the same dtype, rows contiguous."""
    if x.dim() != 2 or weight.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        return False
    if x.dtype not in _KERNEL_DTYPES or weight.dtype != x.dtype or not x.is_contiguous():
        return False
    if weight.shape[1] != x.shape[1] or weight.stride(1) != 1 or weight.device != x.device:
        return False
    if bias is None:
        return True
    return bias.dtype == x.dtype and bias.shape == (weight.shape[0],) and bias.stride(0) == 1


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear for the engine: the skinny GEMM for one token on CUDA, F.linear otherwise. The
    weight is a model parameter, which no kernel writes, so its first tile is read early
    (`linear_decode`'s early_weights, FP8's too). With `scale_inv` the weight is FP8 with those
    block factors (`--dense-dtype fp8`): the FP8 skinny GEMM for a decode batch on CUDA, else
    the weight dequantized for this call, then F.linear."""
    if scale_inv is not None:
        if x.is_cuda and x.shape[0] <= MAX_TOKENS and x.is_contiguous():
            return linear_decode_fp8(x, weight, scale_inv, bias, early_weights=True)
        return F.linear(x, _widened(weight, scale_inv, x.dtype), bias)
    if x.is_cuda and x.shape[0] <= DISPATCH_MAX_TOKENS and kernel_accepts(x, weight, bias):
        return linear_decode(x, weight, bias, early_weights=True)
    return F.linear(x, weight, bias)


def _widened(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight [N, K] times its block factors, in `dtype`: torch's e4m3 cast and one fp32
    product where N and K are whole blocks (every projection of the real geometries), else
    `fp8.dequantize` (the format's definition, slower)."""
    n, k = weight.shape
    if n % fp8.BLOCK or k % fp8.BLOCK or weight.dtype != torch.float8_e4m3fn:
        return fp8.dequantize(weight, scale_inv).to(dtype)
    tiles = weight.view(n // fp8.BLOCK, fp8.BLOCK, k // fp8.BLOCK, fp8.BLOCK).float()
    return (tiles * scale_inv[:, None, :, None]).view(n, k).to(dtype)


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale_inv: torch.Tensor | None = None,
) -> None:
    """Validate x [T, K] with 1 <= T <= MAX_TOKENS, weight [N, K] and bias [N] (metadata only);
    with scale_inv, the weight FP8 (float8_e4m3fn or its uint8 bits) and scale_inv its fp32
    factors [ceil(N/128), ceil(K/128)]."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [T, K] and weight [N, K]: got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(
            f"x has {x.shape[0]} tokens: the decode kernel takes 1 to {MAX_TOKENS} "
            "(use F.linear, or moelab.kernels.gemv.linear, which picks)"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}] (weight's N), got {tuple(bias.shape)}")
    tensors = {"x": x, "weight": weight}
    if scale_inv is not None:
        n, k = weight.shape
        if not is_fp8(weight):
            raise ValueError(
                f"weight must be FP8 (float8_e4m3fn or uint8 bits), got {weight.dtype}"
            )
        want = (fp8.blocks(n), fp8.blocks(k))
        if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
            raise ValueError(
                f"scale_inv must be fp32 {list(want)} for a [{n}, {k}] weight, got "
                f"{scale_inv.dtype} {list(scale_inv.shape)}"
            )
        common.check_last_dim_contiguous("scale_inv", scale_inv)
        tensors["scale_inv"] = scale_inv
    dtypes = {x.dtype} | ({weight.dtype} if scale_inv is None else set())
    dtypes |= {bias.dtype} if bias is not None else set()
    if len(dtypes) > 1:
        what = "x, weight and bias" if scale_inv is None else "x and bias"
        raise ValueError(f"{what} must share one dtype, got {sorted(str(d) for d in dtypes)}")
    common.tl_dtype(x.dtype)
    common.check_last_dim_contiguous("x", x)
    common.check_last_dim_contiguous("weight", weight)
    if bias is not None:
        common.check_last_dim_contiguous("bias", bias)
        tensors["bias"] = bias
    common.check_same_device(**tensors)
