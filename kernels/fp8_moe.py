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
"""

from __future__ import annotations

import torch

from . import fp8
from .common import tl, triton

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
