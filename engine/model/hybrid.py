"""The layers of the hybrid architectures (Qwen3-Next, Qwen3.5/3.6 MoE) that the others lack: the
Gated DeltaNet token mixer over the state pool, and how their weights are laid out at load.

A linear layer's weights live in its LayerWeights as an attention layer's do: `qkv` is the fused
input projection [C + HV·DV + 2·HV, H], rows q, k, v (the C convolution channels), then z (the
gated norm's gate), then b and a (per value head); `o` is the output projection. Qwen3-Next
interleaves q, k, v, z per key head in `in_proj_qkvz` and b, a in `in_proj_ba`; Qwen3.5 stores
them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); both load into this one
layout. The gated full-attention layers stack their output gate's rows after q, k and v in `qkv`
(q_proj holds each head's query, then its gate).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ...kernels.gated_deltanet import (
    causal_conv_decode,
    causal_conv_prefill,
    decay_and_beta,
    delta_rule_prefill,
    gated_delta_rule_decode,
    gated_rmsnorm,
)
from ...kernels.gemv import linear
from .spec import LinearAttention, ModelSpec

Getter = Callable[..., torch.Tensor]  # (name, *shape) -> the checked tensor on the device


class LinearLayer(Protocol):
    """A Gated DeltaNet layer's weights, as model.LayerWeights holds them."""

    qkv: torch.Tensor
    o: torch.Tensor
    o_scale: torch.Tensor | None  # o's block factors where o is FP8 (`--dense-dtype fp8`)
    conv: torch.Tensor | None
    a_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    gated_norm: torch.Tensor | None


def linear_layer_weights(spec: ModelSpec, get: Getter, prefix: str) -> dict[str, torch.Tensor]:
    """A Gated DeltaNet layer's weights (LayerWeights fields) from `prefix` (`...linear_attn.`)."""
    la = spec.linear_attention
    assert la is not None
    h, dk, dv = spec.hidden_size, la.head_k_dim, la.head_v_dim
    per_k = la.num_v_heads // la.num_k_heads  # value heads per key head
    if spec.arch == "qwen3_next":
        qkvz = get(prefix + "in_proj_qkvz.weight", 2 * la.key_dim + 2 * la.value_dim, h)
        q, k, v, z = qkvz.view(la.num_k_heads, -1, h).split([dk, dk, per_k * dv, per_k * dv], dim=1)
        ba = get(prefix + "in_proj_ba.weight", 2 * la.num_v_heads, h)
        b, a = ba.view(la.num_k_heads, 2 * per_k, h).split([per_k, per_k], dim=1)
        parts = [t.reshape(-1, h) for t in (q, k, v, z, b, a)]
    else:
        parts = [
            get(prefix + "in_proj_qkv.weight", la.conv_dim, h),
            get(prefix + "in_proj_z.weight", la.value_dim, h),
            get(prefix + "in_proj_b.weight", la.num_v_heads, h),
            get(prefix + "in_proj_a.weight", la.num_v_heads, h),
        ]
    conv = get(prefix + "conv1d.weight", la.conv_dim, 1, la.conv_kernel)
    return {
        "qkv": torch.cat(parts),
        "o": get(prefix + "out_proj.weight", h, la.value_dim),
        "conv": conv[:, 0].contiguous(),
        "a_log": get(prefix + "A_log", la.num_v_heads),
        "dt_bias": get(prefix + "dt_bias", la.num_v_heads),
        "gated_norm": get(prefix + "norm.weight", dv),
    }


def gated_q_proj(spec: ModelSpec, q_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows and the output gate's rows of a gated attention layer's q_proj
    [heads · 2 · D, H] (each head's D query rows, then its D gate rows)."""
    q, gate = q_proj.view(spec.num_heads, 2, spec.head_dim, -1).unbind(1)
    return q.reshape(spec.q_size, -1), gate.reshape(spec.q_size, -1)


def linear_attention(
    spec: ModelSpec,
    weights: LinearLayer,
    x: torch.Tensor,
    states: tuple[torch.Tensor, torch.Tensor],
    seq_slots: list[tuple[slice, int]],
    decode_slots: torch.Tensor | None,
) -> torch.Tensor:
    """A Gated DeltaNet layer on x [T, H]: the token mixer's output [T, H].

    states: the layer's conv and recurrent pools (StatePool.layer). A decode step (one token per
    sequence) reads and advances the slots `decode_slots` [T] (a device tensor, fixed in a CUDA
    graph); a prefill step runs each sequence's rows from its slot (`seq_slots`: rows, slot)."""
    la = spec.linear_attention
    assert la is not None
    tokens, hv, dv = x.shape[0], la.num_v_heads, la.head_v_dim
    conv_states, recurrent_states = states
    projected = linear(x, weights.qkv)
    mixed, z, b, a = projected.split([la.conv_dim, la.value_dim, hv, hv], dim=-1)
    if decode_slots is not None:
        mixed = causal_conv_decode(mixed, weights.conv, conv_states, decode_slots)
        q, k, v = _heads(la, mixed)
        out = gated_delta_rule_decode(
            q, k, v, a, b, weights.a_log, weights.dt_bias, recurrent_states, decode_slots
        )
    else:
        g, beta = decay_and_beta(a, b, weights.a_log, weights.dt_bias)
        out = x.new_empty(tokens, hv, dv)
        for rows, slot in seq_slots:
            conv = causal_conv_prefill(mixed[rows], weights.conv, conv_states[slot])
            q, k, v = _heads(la, conv)
            out[rows] = delta_rule_prefill(q, k, v, g[rows], beta[rows], recurrent_states[slot])
    out = gated_rmsnorm(out, z.reshape(tokens, hv, dv), weights.gated_norm, spec.rms_norm_eps)
    return linear(out.reshape(tokens, la.value_dim), weights.o, None, weights.o_scale)


def _heads(
    la: LinearAttention, mixed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [T, H, DK] and v [T, HV, DV] from the convolution's output [T, C]."""
    q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
    tokens = mixed.shape[0]
    return (
        q.reshape(tokens, la.num_k_heads, la.head_k_dim),
        k.reshape(tokens, la.num_k_heads, la.head_k_dim),
        v.reshape(tokens, la.num_v_heads, la.head_v_dim),
    )
