"""FP8 expert banks in the MoE kernels (fused_moe, fused_moe_one_token, grouped_moe): which bank is
FP8, the checks of its block factors, and the widening the kernels do in registers.

A bank is FP8 when its weights are float8_e4m3fn, or their bits as uint8 (kernels/fp8.py defines
the format). Each of w13 [S, N, K] and w2 then comes with its block factors, fp32
[S, ⌈N/128⌉, ⌈K/128⌉] (the checkpoint's `weight_scale_inv`): weight row n, column k of slot s is
its e4m3 value times factor[s, n // 128, k // 128]. For w13 that is w13's own blocks: gate and up
rows share a block only where I is not a multiple of 128.

The kernels read the bits as int8 and widen them with integer ops and fp32 multiplies, no FP8
instruction, so that the same code runs on Turing, Ampere and later GPUs and under the Triton
interpreter: the sign-extended byte shifted left by 20 and masked to bit 31 and bits 20-26 is an
fp32 whose exponent field is e4m3's exponent and whose mantissa starts with e4m3's three bits: the
e4m3 value times 2^-120 (the biases are 127 and 7). Exponent 0 lands among fp32's subnormals,
where the same holds (m/8 · 2^-126 = m/8 · 2^-6 · 2^-120), and a multiply by a power of two
restores the value exactly (the kernels compile without flush-to-zero). The two NaN codes, 0x7F
and 0xFF, widen to ±480: a checkpoint holds none (quantizers clamp to ±448).

The one-token launches read the bits four to a word instead (`word_dots`): two bytes 16 bits
apart become the two fp16 of one uint32 at once, each the e4m3 value times 2^-8, then fp32 (as
the 4-bit kernels' codes do, fp4_widen.fp32_pair), and a word's four products with the
activations are one chain of multiply-adds.
"""

from __future__ import annotations

import torch

from . import fp8
from .common import tl, triton
from .fp4_widen import fp32_pair

DTYPES = (torch.float8_e4m3fn, torch.uint8)


def is_fp8(weight: torch.Tensor) -> bool:
    """Whether a weight tensor holds FP8 values (float8_e4m3fn, or its bits as uint8)."""
    return weight.dtype in DTYPES


def bits(weight: torch.Tensor) -> torch.Tensor:
    """An FP8 weight (float8_e4m3fn or uint8 bits) as its bits in int8 (a view): what the
    kernels read, on every GPU (`widened`)."""
    assert is_fp8(weight), weight.dtype
    return weight.view(torch.int8)


def check_bank(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2_scale_inv: torch.Tensor | None,
) -> bool:
    """Whether the bank w13/w2 is FP8, after checking that its block factors fit it: both
    weights FP8 with both factors, or neither FP8 and no factors (metadata only: no device sync)."""
    fp8_weights = {name for name, w in (("w13", w13), ("w2", w2)) if is_fp8(w)}
    given = {
        name: s
        for name, s in (("w13_scale_inv", w13_scale_inv), ("w2_scale_inv", w2_scale_inv))
        if s is not None
    }
    if not fp8_weights:
        if given:
            raise ValueError(
                f"{' and '.join(given)} given for {w13.dtype} weights: block factors belong to "
                "FP8 weights (float8_e4m3fn or their uint8 bits)"
            )
        return False
    if len(fp8_weights) == 1:
        raise ValueError(
            f"w13 is {w13.dtype} and w2 {w2.dtype}: an expert bank is FP8 in both or in neither"
        )
    for name, weight, scale in (
        ("w13", w13, w13_scale_inv),
        ("w2", w2, w2_scale_inv),
    ):
        if scale is None:
            raise ValueError(
                f"{name} is FP8 ({weight.dtype}) and needs its block factors: pass "
                f"{name}_scale_inv, fp32 [S, ceil(N/128), ceil(K/128)]"
            )
        *lead, n, k = weight.shape
        expected = (*lead, fp8.blocks(n), fp8.blocks(k))
        if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
            raise ValueError(
                f"{name}_scale_inv must be float32 {expected} (one factor per 128x128 block of "
                f"{name} {tuple(weight.shape)}), got {scale.dtype} {tuple(scale.shape)}"
            )
        if not scale.is_contiguous():
            raise ValueError(f"{name}_scale_inv must be contiguous (got strides {scale.stride()})")
        if scale.device != weight.device:
            raise ValueError(
                f"{name}_scale_inv is on {scale.device} and {name} on {weight.device}: put them "
                "on one device"
            )
    return True


def words(weight: torch.Tensor) -> torch.Tensor | None:
    """An FP8 weight's bits as int32 words of four bytes (a view; column 4j + i is byte i of word
    j), as the one-token launches read them (`word_dots`); None where its rows do not split into
    words (a row length or stride not a multiple of 4 bytes)."""
    b = weight if weight.dtype == torch.int8 else bits(weight)  # bits already, or FP8
    aligned = b.stride(-1) == 1 and all(s % 4 == 0 for s in (*b.stride()[:-1], b.shape[-1]))
    if not aligned or b.storage_offset() % 4:
        return None
    return b.view(torch.int32)


def dequantized(weight: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    """One expert's weight as the references read it: fp32 by the format's definition if FP8
    (`fp8.dequantize`), else as it is."""
    return weight if scale_inv is None else fp8.dequantize(weight, scale_inv)


@triton.jit
def widened(bits):
    """fp32 of e4m3fn `bits` (int8): the value times 2^-120, exact, subnormals too (above)."""
    # int8 sign-extends: the sign fills bits 31..27 after the shift, and the mask keeps bit 31
    b = bits.to(tl.int32).to(tl.uint32, bitcast=True)
    return ((b << 20) & 0x87F00000).to(tl.float32, bitcast=True)


@triton.jit
def values(bits):
    """fp32 e4m3fn values of `bits` (int8), exact: for tl.dot, whose operand they become (in bf16
    or fp16 too, which hold every e4m3 value)."""
    return widened(bits) * 1.329227995784916e36  # 2^120


@triton.jit
def weight_factor(scale_inv):
    """A block's factor as the one-token kernels multiply `widened` bits by: times 2^64, so that
    the product (the weight times 2^-56) stays a normal fp32 and cannot overflow below 2^64."""
    return scale_inv * 1.8446744073709552e19  # 2^64


@triton.jit
def activation(x):
    """An activation as the one-token kernels multiply `weight_factor`'s products by: times 2^56,
    which gives back the rest of the 2^120 (exact, a power of two)."""
    return x * 7.205759403792794e16  # 2^56


@triton.jit
def dot_step(acc, rows, row_factors, n_ok, k_idx, k_ok, k0, columns, COMPUTE: tl.constexpr):
    """One reduction step of a tl.dot kernel over FP8 weight rows: acc [N, M] plus the rows'
    step (`rows`: [N, 1] pointers to their bits, `row_factors`: [N] pointers to their factors'
    rows; columns k_idx, inside one 128-column block) times `columns` [BLOCK_K, M] in the compute
    dtype, the rows' factors on the fp32 product. The weights are the dot's first operand, so
    that each warp widens rows of its own (as the second, every warp along the first dimension
    would widen the same tile)."""
    w = tl.load(rows + k_idx[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    f = tl.load(row_factors + k0 // 128, mask=n_ok, other=0.0)
    return acc + tl.dot(values(w).to(COMPUTE), columns, input_precision="ieee") * f[:, None]


@triton.jit
def _byte_pairs(words):
    """The e4m3 bytes of `words` (int32, four each) as two uint32 of two fp16 each: bytes (0, 2)
    and (1, 3), each its value times 2^-8. A byte's magnitude bits (e3..e0 m2..m0) at fp16 bit 7
    and its sign at bit 15 make that fp16 exactly: exponent field e gives 2^(e − 15) · (1 + m/8)
    = 2^(e − 7) · (1 + m/8) · 2^-8 for e > 0, and for e = 0 the fp16 subnormal m/8 · 2^-14 =
    m/8 · 2^-6 · 2^-8. Bytes 16 bits apart go to their places in one uint32 at once."""
    w = words.to(tl.uint32, bitcast=True)
    magnitude = 0x3F803F80
    sign = 0x80008000
    b0_b2 = ((w << 7) & magnitude) | ((w << 8) & sign)
    b1_b3 = ((w >> 1) & magnitude) | (w & sign)
    return b0_b2, b1_b3


@triton.jit
def _word_columns(xs):
    """xs [N, 4W] in column order as the four columns of each word: [N, W] each, the i-th
    holding columns 4j + i."""
    v = tl.reshape(xs, (xs.shape[0], xs.shape[1] // 4, 2, 2))  # i = 2a + b
    even, odd = tl.split(v)  # by b: [N, W, a]
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def word_dots(words, xs, PTX: tl.constexpr):
    """fp32 [N, W]: each word's four e4m3 bytes (`_byte_pairs`: times 2^-8) times the
    activations of their columns, `xs` fp32 [N or 1, 4W] in column order, as one chain of fused
    multiply-adds a word. PTX: the fp16 converted in place (fp4_widen.fp32_pair)."""
    x0, x1, x2, x3 = _word_columns(xs)
    b0_b2, b1_b3 = _byte_pairs(words)
    v0, v2 = fp32_pair(b0_b2, PTX)
    v1, v3 = fp32_pair(b1_b3, PTX)
    dots = v0 * x0
    dots = tl.fma(v1, x1, dots)
    dots = tl.fma(v2, x2, dots)
    return tl.fma(v3, x3, dots)


@triton.jit
def vector_sums(words, xs, PTX: tl.constexpr):
    """fp32 [N, W / 4]: the rows' words [N, W] times `xs` [4W] (`word_dots`), summed over each
    four words (16 columns: one 16-byte vector of a row, which a thread reads whole and which
    never crosses a 128-column block), in the thread that read them. Each weight was taken
    times 2^-8: the sums carry that factor until the caller gives it back."""
    dots = word_dots(words, xs[None, :], PTX)
    return tl.sum(tl.reshape(dots, (words.shape[0], words.shape[1] // 4, 4)), axis=2)
