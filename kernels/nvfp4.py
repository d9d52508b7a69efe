"""NVFP4 weights as NVIDIA's ModelOpt checkpoints store them (`quant_algo: NVFP4` in
hf_quant_config.json, or `quantization_config` with `quant_method: modelopt` naming it).

A linear weight (..., N, K) is `weight` uint8 (..., N, K/2), e2m1 elements (kernels/e2m1.py) two
a byte, the even-indexed one in the low nibble; `weight_scale` float8_e4m3fn (..., N, K/16), one
scale per 16 consecutive values along K; and `weight_scale_2`, one fp32 per tensor. The value is
element × weight_scale × weight_scale_2. `input_scale` (fp32 per tensor) belongs to the
activations of FP4 tensor-core GEMMs; a kernel that widens the weights and multiplies in bf16 or
fp32 does not read it.

Quantizing follows ModelOpt: weight_scale_2 = amax / (6 · 448), the tensor's largest magnitude
over e2m1's and e4m3's largest values (1 for an all-zero tensor); each block's scale is its amax
/ 6 / weight_scale_2 rounded to e4m3 (to nearest, even); each value divided by both scales rounds
to the nearest element, ties to even, saturating at ±6. A block whose scale is zero is zeros. A
block holding a NaN or an infinity gets e4m3's NaN scale (0x7F) and the tensor's amax is taken
over its finite values.
"""

from __future__ import annotations

import torch

from . import e2m1, fp8

BLOCK = 16
SCALE_NAN = 0x7F


def check_shape(k: int) -> None:
    """Refuse a last dimension that NVFP4 blocks do not tile."""
    if k % BLOCK:
        raise ValueError(
            f"NVFP4 blocks {BLOCK} values of the last dimension, which is {k}: pad it to a "
            f"multiple of {BLOCK} or keep this weight in bf16"
        )


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` (..., N, K) as ModelOpt's (weight uint8 (..., N, K/2), weight_scale
    float8_e4m3fn (..., N, K/16), weight_scale_2 fp32 of shape (...): one per N×K matrix)."""
    k = weight.shape[-1]
    check_shape(k)
    tiles = weight.float().unflatten(-1, (k // BLOCK, BLOCK))
    finite = tiles.isfinite().all(-1)
    magnitude = torch.where(tiles.isfinite(), tiles.abs(), 0.0)
    amax = magnitude.amax(dim=(-1, -2, -3))
    scale_2 = torch.where(amax > 0, amax / (e2m1.MAX * fp8.E4M3_MAX), 1.0)
    block_scale = magnitude.amax(-1) / e2m1.MAX / scale_2[..., None, None]
    block_scale = block_scale.clamp(max=fp8.E4M3_MAX).to(torch.float8_e4m3fn)
    factor = block_scale.float() * scale_2[..., None, None]
    scaled = torch.where(factor[..., None] > 0, tiles / factor[..., None], 0.0)
    codes = e2m1.encode(torch.where(finite[..., None], scaled, 0.0).clamp(-e2m1.MAX, e2m1.MAX))
    nan = torch.tensor(SCALE_NAN, dtype=torch.uint8, device=weight.device)
    block_scale = torch.where(finite, block_scale.view(torch.uint8), nan)
    return (
        e2m1.pack(codes.flatten(-2)).contiguous(),
        block_scale.view(torch.float8_e4m3fn).contiguous(),
        scale_2.contiguous(),
    )


def dequantize(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """ModelOpt's (weight, weight_scale, weight_scale_2) as the fp32 weight (..., N, K), by the
    format's definition (e4m3 decoded from its bits by fp8.widen)."""
    n, half_k = weight.shape[-2:]
    assert weight_scale.shape[-2:] == (n, half_k * 2 // BLOCK), (weight.shape, weight_scale.shape)
    elements = e2m1.widen(e2m1.unpack(weight)).unflatten(-1, (-1, BLOCK))
    scale_2 = weight_scale_2.float().reshape(*weight_scale_2.shape, 1, 1)
    factor = fp8.widen(weight_scale) * scale_2
    return (elements * factor[..., None]).flatten(-2)
