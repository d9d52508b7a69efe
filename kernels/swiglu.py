"""The experts' activations: SwiGLU, and gpt-oss's clamped SwiGLU with biased projections.

gpt-oss (transformers' GptOssExperts) computes, from gate/up projections that carry biases,

    gate = min(gate, limit); up = clamp(up, -limit, limit)
    h = (up + 1) * gate * sigmoid(1.702 * gate)

and adds a bias to the down projection. `limit` 0 means the plain SwiGLU, silu(gate) * up, which
every other architecture uses. The MoE kernels take `w13_bias` [E, 2I] (gate's, then up's, as
w13's rows), `w2_bias` [E, H] and `swiglu_limit` beside their weights; each applies the same
arithmetic as `activate` here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import common
from .common import tl, triton

ALPHA = 1.702  # gpt-oss's sigmoid gain


def activate(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(gate) * up, or where limit > 0 gpt-oss's clamped form (in the inputs' dtype)."""
    if not limit:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


class Extras(NamedTuple):
    """What gpt-oss's experts add to a kernel launch: their biases (w13's, w2's; None for
    experts without) and the clamped SwiGLU's limit (0: SwiGLU)."""

    biases: tuple[torch.Tensor, torch.Tensor] | None = None
    limit: float = 0.0


def check_biases(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
) -> bool:
    """Validate the experts' biases against their weights (metadata only); whether there are."""
    if w13_bias is None and w2_bias is None:
        return False
    if w13_bias is None or w2_bias is None:
        raise ValueError("w13_bias and w2_bias come together")
    experts, two_inter, hidden = w13.shape[0], w13.shape[1], w2.shape[1]
    if tuple(w13_bias.shape) != (experts, two_inter) or tuple(w2_bias.shape) != (experts, hidden):
        raise ValueError(
            f"w13_bias must be [{experts}, {two_inter}] and w2_bias [{experts}, {hidden}]: got "
            f"{tuple(w13_bias.shape)} and {tuple(w2_bias.shape)}"
        )
    common.check_same_device(w13=w13, w13_bias=w13_bias, w2_bias=w2_bias)
    return True


@triton.jit
def activate_tl(gate, up, limit, CLAMPED: tl.constexpr):
    """`activate` in a kernel, fp32 in and out (limit read only where CLAMPED)."""
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate * tl.sigmoid(gate * 1.702))
    return gate * tl.sigmoid(gate) * up
