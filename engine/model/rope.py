"""Rotary position embeddings with the checkpoint's rope settings (default, linear, yarn), over
whole heads or, where the checkpoint says (partial_rotary_factor), their leading dimensions."""

from __future__ import annotations

import math

import torch

from .spec import ModelSpec


def inv_freq_and_scaling(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32) and the attention factor, computed as Hugging Face does."""
    dim = spec.rotary_dim
    base = spec.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if not scaling:
        return inv, 1.0
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor, 1.0
    original = int(scaling.get("original_max_position_embeddings") or spec.max_position_embeddings)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    return inv, float(attention_factor)


class Rotary:
    """cos/sin tables for every position up to a limit, on the compute device."""

    def __init__(
        self, spec: ModelSpec, max_positions: int, device: torch.device, dtype: torch.dtype
    ):
        inv, attention_factor = inv_freq_and_scaling(spec)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for a step's positions, gathered once for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] with a step's tables (rotate-half layout);
        tables narrower than D turn the leading dimensions and pass the rest through."""
        turned = cos.shape[-1]
        if turned < q.shape[-1]:
            (q, q_pass), (k, k_pass) = (t.split([turned, t.shape[-1] - turned], -1) for t in (q, k))
            q, k = Rotary.apply(q, k, cos, sin)
            return torch.cat([q, q_pass], dim=-1), torch.cat([k, k_pass], dim=-1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
