"""FP8 weights as Hugging Face's fine-grained FP8 checkpoints store them: `float8_e4m3fn` values
with one fp32 factor per 128×128 block of the last two dimensions (`weight_scale_inv`: despite
the name, the factor the values are multiplied by, W = q · s), the scheme Qwen's `-FP8` builds
and DeepSeek-V3 use. A block at a ragged edge covers what is left of it.

e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7F/0xFF are NaN,
448 the largest finite value. `widen` decodes the bits by that definition alone, so that the
tests' reference does not lean on torch's own float8 cast, and so that kernels on cards without
FP8 instructions (and under the Triton interpreter) can follow the same integer steps.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0


def blocks(n: int, block: int = BLOCK) -> int:
    """How many blocks cover n values."""
    return -(-n // block)


def quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (..., N, K) as (q, scale_inv): q float8_e4m3fn of the same shape, scale_inv fp32
    (..., ⌈N/block⌉, ⌈K/block⌉), each block's largest magnitude mapped to 448 (an all-zero
    block keeps the factor 1)."""
    *lead, n, k = weight.shape
    nb, kb = blocks(n, block), blocks(k, block)
    if n % block == 0 and k % block == 0:  # whole blocks: no padded copy (the bank's experts)
        padded = weight.float().contiguous()
    else:
        padded = torch.zeros(
            *lead, nb * block, kb * block, dtype=torch.float32, device=weight.device
        )
        padded[..., :n, :k] = weight.float()
    tiles = padded.unflatten(-1, (kb, block)).unflatten(-3, (nb, block))  # (..., nb, b, kb, b)
    amax = tiles.abs().amax(dim=(-3, -1))
    # (divided by a tensor: CUDA divides by a Python number as a product with its reciprocal)
    scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (tiles / scale_inv[..., :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.contiguous()


def widen(bits: torch.Tensor) -> torch.Tensor:
    """e4m3fn values (uint8 bits, or a float8_e4m3fn tensor) as fp32, decoded from the bits:
    exponent 0 is subnormal (m/8 · 2⁻⁶), else (1 + m/8) · 2^(e−7); 0x7F and 0xFF are NaN."""
    if bits.dtype == torch.float8_e4m3fn:
        bits = bits.view(torch.uint8)
    b = bits.to(torch.int32)
    exponent = (b >> 3) & 0xF
    mantissa = (b & 0x7).to(torch.float32)
    normal = (1.0 + mantissa / 8.0) * torch.exp2((exponent - 7).to(torch.float32))
    value = torch.where(exponent == 0, mantissa / 8.0 * 2.0**-6, normal)
    value = torch.where((b & 0x7F) == 0x7F, torch.nan, value)
    return torch.where((b & 0x80) != 0, -value, value)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(q, scale_inv) as quantize writes them, back to fp32 by the format's definition."""
    n, k = q.shape[-2:]
    factors = scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return widen(q) * factors[..., :n, :k]
