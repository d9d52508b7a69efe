"""The FP8 KV cache's format (`--kv-cache-dtype fp8`): every key and value head of every token as
e4m3fn bits (uint8, kernels/fp8.py defines the format) with one fp32 factor of its own, the
head's largest magnitude over 448 (an all-zero head keeps the factor 1): value = e4m3 · factor.

A factor per (token, KV head) is set when the token is written and never changes, so a page is
written once and read by every later step as it is, and one outlying token or head costs no
precision to the others (a factor per tensor, fixed ahead, maps a head's values at 0.01 into
e4m3's subnormals). It costs 4 bytes per head: at head_dim 128, the pages hold 1.94× the tokens
of bf16 pages in the same memory.

The kernels narrow and widen with integer ops and fp32 arithmetic, no FP8 instruction, so that
the same code runs on Turing, Ampere and later GPUs and under the Triton interpreter: `narrowed`
rounds an fp32 to the nearest e4m3 (ties to even, as torch's cast does), and the reads widen the
bits as kernels/fp8_moe.py's `values` does.
"""

from __future__ import annotations

import torch

from . import fp8_moe
from .common import round_to, tl, triton
from .fp8 import E4M3_MAX

SCALE_BYTES = 4  # one fp32 factor per (token, KV head)
# the int32 mask of fp8_moe.widened (0x87F00000) as torch holds int32: sign and e4m3's 7 bits
_WIDEN_MASK = 0x87F00000 - (1 << 32)
_TWO_POW_120 = 2.0**120


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads x [..., D] as (bits uint8 [..., D], factors fp32 [...]): each head divided by its
    largest magnitude over 448, rounded to the nearest e4m3 value."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # (divided by a tensor: CUDA divides by a Python number as a product with its reciprocal,
    # which is an ulp off the kernel's correctly rounded division)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def dequantize_heads(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(bits [..., D], factors [...]) back to values in `dtype`, widened as the kernels widen:
    the sign-extended byte shifted into fp32's exponent and mantissa, times 2^120 (exact)."""
    b = bits.view(torch.int8).to(torch.int32)
    values = ((b << 20) & _WIDEN_MASK).view(torch.float32) * _TWO_POW_120
    return (values * scale[..., None]).to(dtype)


@triton.jit
def narrowed(x):
    """e4m3fn bits (int32, 0..255) of fp32 `x` with |x| <= 448: the nearest e4m3 value, ties to
    even. At 2^-6 and above (e4m3's normals) fp32's bits are rounded to 3 mantissa bits (the carry
    runs into the exponent) and rebased (127 - 7 = 120 exponents); below, |x| · 2^9 is e4m3's
    subnormal mantissa, rounded to an integer by the addition of 2^23."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    sub = (tl.abs(x) * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(a >= 0x3C800000, normal, sub) | sign


@triton.jit
def head_factor(amax):
    """The factor of a head whose largest magnitude is `amax` (fp32): amax / 448, 1 for zero."""
    return tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)


@triton.jit
def head_bits(x, factor):
    """A head's values x (fp32) over its factor, as e4m3 bits (uint8) to store."""
    q = tl.minimum(tl.maximum(tl.div_rn(x, factor), -448.0), 448.0)
    return narrowed(q).to(tl.uint8)


def gather_ref(
    bits: torch.Tensor, factors: torch.Tensor, pages: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """Reference: the first `length` tokens [length, Hkv, D] of a sequence's FP8 `pages` (page
    ids into bits [num_blocks, block_size, Hkv, D] and factors [num_blocks, block_size, Hkv]),
    widened to `dtype`."""
    k = bits.index_select(0, pages).flatten(0, 1)[:length]
    f = factors.index_select(0, pages).flatten(0, 1)[:length]
    return dequantize_heads(k, f, dtype)


@triton.jit
def _gather_kernel(
    bits_ptr,
    factors_ptr,
    pages_ptr,
    out_ptr,
    length,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < length
    d = tl.arange(0, HEAD_DIM)
    page = tl.load(pages_ptr + t // PAGE, mask=t_ok, other=0).to(tl.int64)
    rows = (page * PAGE + t % PAGE) * NUM_KV_HEADS + head
    b = tl.load(bits_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=t_ok[:, None], other=0)
    factor = tl.load(factors_ptr + rows, mask=t_ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    value = round_to(fp8_moe.values(b) * factor[:, None], dtype)
    out_rows = t.to(tl.int64) * NUM_KV_HEADS + head
    tl.store(
        out_ptr + out_rows[:, None] * HEAD_DIM + d[None, :], value.to(dtype), mask=t_ok[:, None]
    )


def gather_triton(
    bits: torch.Tensor, factors: torch.Tensor, pages: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """Triton: one launch over (block of tokens, KV head), the bits widened in registers with
    integer ops; bit for bit the reference."""
    _, block_size, num_kv_heads, head_dim = bits.shape
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert bits.is_contiguous() and factors.is_contiguous() and pages.is_contiguous()
    out = torch.empty(length, num_kv_heads, head_dim, dtype=dtype, device=bits.device)
    block_t = 32
    _gather_kernel[(triton.cdiv(length, block_t), num_kv_heads)](
        fp8_moe.bits(bits), factors, pages, out, length,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_T=block_t,
    )  # fmt: skip
    return out


def gather(
    bits: torch.Tensor, factors: torch.Tensor, pages: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """A sequence's keys or values from FP8 pages, widened to `dtype` (what prefill attention
    reads): the Triton kernel on CUDA, the reference elsewhere."""
    fn = gather_triton if bits.is_cuda else gather_ref
    return fn(bits, factors, pages, length, dtype)
