"""MXFP4 weights (OCP Microscaling spec v1.0) as gpt-oss checkpoints store them.

A block of 32 consecutive values along the last dimension shares one scale X, an E8M0 byte
(an unsigned exponent, bias 127: 2^(code−127); 0xFF is NaN); each value is an e2m1 element
(kernels/e2m1.py), and the value is the element times X. A NaN scale makes all 32 values NaN.

gpt-oss's layout, as transformers reads it (integrations/mxfp4.py): a weight (..., N, K) is
`*_blocks` uint8 (..., N, K/32, 16), two elements a byte, the even-indexed one in the low nibble,
and `*_scales` uint8 (..., N, K/32), the E8M0 codes. For the experts, N is the output dimension
(gate_up's 2I rows, down's H) and K the input one.

Quantizing follows the spec's rule: X = 2^(⌊log2 amax⌋ − 2), amax the block's largest magnitude
and 2 the exponent of e2m1's largest value (6 = 1.5 · 2²), clamped to E8M0's range; each value /X
rounds to the nearest element, ties to even, and saturates at ±6 (a block's largest values,
amax/X in [4, 8), can pass 6). A block holding a NaN or an infinity gets the NaN scale; an all-
zero block the smallest, 2^-127.
"""

from __future__ import annotations

import torch

from . import e2m1

BLOCK = 32
SCALE_BIAS = 127
SCALE_NAN = 0xFF
_ELEMENT_EMAX = 2
# the values quantize works on at a time (fp32 and its temporaries: tens of MiB)
_CHUNK = 1 << 20


def check_shape(k: int) -> None:
    """Refuse a last dimension that MXFP4 blocks do not tile."""
    if k % BLOCK:
        raise ValueError(
            f"MXFP4 blocks {BLOCK} values of the last dimension, which is {k}: pad it to a "
            f"multiple of {BLOCK} or keep this weight in bf16"
        )


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (..., N, K) as gpt-oss's (blocks uint8 (..., N, K/32, 16), scales uint8
    (..., N, K/32)), by the spec's rule (above), _CHUNK values at a time. A float64 weight is
    rounded to fp32 first."""
    k = weight.shape[-1]
    check_shape(k)
    rows = weight.reshape(-1, k)
    blocks = rows.new_empty((rows.shape[0], k // BLOCK, BLOCK // 2), dtype=torch.uint8)
    scales = rows.new_empty((rows.shape[0], k // BLOCK), dtype=torch.uint8)
    step = max(1, _CHUNK // k)
    for start in range(0, rows.shape[0], step):
        part = slice(start, start + step)
        blocks[part], scales[part] = _quantize_rows(rows[part].float())
    lead = weight.shape[:-1]
    return blocks.reshape(*lead, k // BLOCK, BLOCK // 2), scales.reshape(*lead, k // BLOCK)


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows (R, K) as their blocks and scales. Exact in fp32: the shared exponent is read from
    the bits of amax, and a value times 2^-shared (a normal fp32 for every shared exponent an fp32
    amax gives) is the exact quotient, or its one rounding below fp32's normal range, far under
    e2m1's first midpoint."""
    bits = rows.view(torch.int32).unflatten(-1, (-1, BLOCK))
    magnitudes = bits & 0x7FFFFFFF
    # the largest magnitude's biased exponent (NaN's and infinity's bits sort above all finite
    # ones): ⌊log2 amax⌋ + 127 for a normal amax, 0 for zero and fp32's subnormals, 255 where the
    # block holds a NaN or an infinity
    field = magnitudes.amax(-1) >> 23
    shared = (field - SCALE_BIAS - _ELEMENT_EMAX).clamp_(min=-SCALE_BIAS)
    finite = field < 0xFF
    factor = ((SCALE_BIAS - shared) << 23).view(torch.float32)  # 2^-shared
    codes = e2m1.encode_magnitudes(magnitudes.view(torch.float32) * factor[..., None])
    codes |= ((bits >> 28) & 0x8).to(torch.uint8)  # the sign bit as the code's bit 3
    codes *= finite[..., None]
    scales = torch.where(finite, shared + SCALE_BIAS, SCALE_NAN).to(torch.uint8)
    return e2m1.pack(codes), scales


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes as fp32 (2^(code−127), 0xFF NaN)."""
    s = scales.to(torch.int32)
    value = torch.exp2((s - SCALE_BIAS).to(torch.float64)).float()
    return torch.where(s == SCALE_NAN, torch.nan, value)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's (blocks, scales) as the fp32 weight (..., N, K), by the format's definition."""
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == BLOCK // 2, (
        blocks.shape,
        scales.shape,
    )
    values = e2m1.widen(e2m1.unpack(blocks)) * scale_values(scales)[..., None]
    return values.flatten(-2)
