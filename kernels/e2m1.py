"""The 4-bit e2m1 element of the MXFP4 and NVFP4 formats (kernels/mxfp4.py, kernels/nvfp4.py).

e2m1 (OCP Microscaling spec v1.0, FP4): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit; no
infinities, no NaN, no subnormal but 0.5 (exponent 0: m/2). The eight magnitudes of codes 0-7 are
0, 0.5, 1, 1.5, 2, 3, 4 and 6; bit 3 is the sign. Both formats pack two values a byte along the
last dimension, the even-indexed value in the low nibble.
"""

from __future__ import annotations

import torch

MAX = 6.0
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between neighbouring magnitudes: a value at midpoint j lies between codes j and
# j + 1, and rounds to the even one of the two
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def widen(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (integers 0-15) as fp32, decoded from the bits: exponent e, mantissa m give
    m/2 for e = 0, else (1 + m/2) · 2^(e−1)."""
    c = codes.to(torch.int32)
    exponent = (c >> 1) & 0x3
    mantissa = (c & 0x1).to(torch.float32)
    normal = (1.0 + mantissa / 2.0) * torch.exp2((exponent - 1).to(torch.float32))
    value = torch.where(exponent == 0, mantissa / 2.0, normal)
    return torch.where((c & 0x8) != 0, -value, value)


def encode(values: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale as e2m1 codes (uint8 0-15): round to nearest, ties
    to the even code, magnitudes past 6 saturate to 6 (NaN encodes as 0: the formats mark it in
    the scale)."""
    v = values.float()
    sign = (v < 0) | ((v == 0) & torch.signbit(v))
    return encode_magnitudes(v.abs()) | torch.where(sign, 8, 0).to(torch.uint8)


def encode_magnitudes(magnitudes: torch.Tensor) -> torch.Tensor:
    """fp32 magnitudes (>= 0) as the codes 0-7 of their nearest element, ties to the even code,
    past 6 saturating to 7, NaN as 0: a count of the midpoints each lies past (at a midpoint, past
    it where the code above is the even one)."""
    m = magnitudes
    code = (m > _MIDPOINTS[0]).to(torch.uint8)
    for j, midpoint in enumerate(_MIDPOINTS[1:], start=1):
        code += (m >= midpoint) if j % 2 else (m > midpoint)
    return code


def pack(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (..., K), K even, as bytes (..., K/2): value 2i in the low nibble of byte i."""
    assert codes.shape[-1] % 2 == 0, codes.shape
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (..., K/2) as their e2m1 codes (..., K), low nibble first."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)
