"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5/3.6 MoE: its math past the projections.

A linear layer runs, per token: a short causal depthwise convolution (width W, SiLU) over the
concatenated q, k, v channels; the gated delta rule, a recurrence over a state S [HV, DK, DV] per
value head; and an RMSNorm of each head's output gated by SiLU(z). The two models differ only in
how their projections lay out q, k, v, z, a, b, which the model code splits before calling here.

Each sequence's state lives in a fixed slot of two pools, so that decode steps address it by slot
id (and can be captured in CUDA graphs):

- conv state [slots, W-1, C]: the sequence's last W-1 convolution inputs, oldest first, rows as
  the engine holds tokens (C = 2·H·DK + HV·DV channels, q then k then v);
- recurrent state [slots, HV, DK, DV]: S, as transformers and fla keep it; fp32 keeps a state
  exact across any number of steps, a narrower dtype is read and written rounded.

An all-zero slot is the state of an empty prefix (the convolution's zero padding, S = 0), so a
new sequence starts from a zeroed slot, and a prefill continues from whatever its slot holds:
prefilling a prompt in pieces, or decoding after it, gives what one prefill of the whole would.

The recurrence, per value head h (query/key head h // (HV/H)) and token t, with q, k
L2-normalized and q scaled by DK^-1/2:

    S ← S·exp(g_t);  S ← S + k_t ⊗ β_t (v_t − Sᵀk_t);  o_t = Sᵀq_t

`delta_rule_prefill` computes it by chunks (the WY form: a triangular solve per chunk, then one
sequential pass over chunks), `delta_rule_decode` one step for a batch of slots. On CUDA the
prefill calls fla's (flash-linear-attention's) chunked Triton kernel where fla is installed; the
decode step and the convolution run in this module's own kernels (one launch each, the pools read
and written in place, a decode step's slots read from a device tensor: fla's recurrent kernel
takes and returns states by batch row, not by slot). The `_ref` functions are the definition and
the CPU path.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import common
from .common import tl, triton

QK_L2NORM_EPS = 1e-6  # transformers' and fla's l2norm: x / sqrt(sum(x²) + eps)


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head log decay g (fp32, <= 0) and write strength beta from the projections a, b."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def causal_conv_prefill_ref(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """SiLU(causal depthwise conv) over one sequence's tokens x [T, C], after its conv state.

    weight [C, W] (the checkpoint's conv1d.weight [C, 1, W] squeezed); state [W-1, C] is read, then
    overwritten with the last W-1 inputs. Accumulates in fp32; returns [T, C] in x's dtype."""
    _check_conv(x, weight, state.unsqueeze(0))
    if not len(x):
        return x.clone()
    window = torch.cat([state.to(x.dtype), x])
    out = F.conv1d(
        window.t().float().unsqueeze(0),
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        groups=x.shape[1],
    )[0].t()
    state.copy_(window[window.shape[0] - state.shape[0] :])
    return F.silu(out).to(x.dtype)


def causal_conv_decode_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slot_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of each of B sequences, x [B, C]: the convolution from their slots' conv states.

    states [slots, W-1, C]; slot_ids [B] (distinct); the slots are shifted by one token in place."""
    _check_conv(x, weight, states)
    slot_ids = slot_ids.long()
    window = torch.cat([states[slot_ids].to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, W, C]
    out = torch.einsum("bwc,cw->bc", window.float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    states.index_copy_(0, slot_ids, window[:, 1:].to(states.dtype))
    return F.silu(out).to(x.dtype)


# The convolution's tiles: a prefill program takes CONV_TOKENS tokens of CONV_CHANNELS channels
# (CONV_TOKENS >= W-1, so that only the first token block reads the state), a decode program
# CONV_CHANNELS channels of one sequence.
CONV_TOKENS = 32
CONV_CHANNELS = 128


@triton.jit
def _conv_prefill_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    out_ptr,
    tokens,
    channels,
    stride_x,
    stride_w,
    stride_s,
    stride_o,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    """One sequence: BLOCK_T tokens x BLOCK_C channels of SiLU(conv) from the window (state rows,
    then x); the first token block also writes the state after the last token."""
    common.pdl_start(PDL)
    pid_t = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(WIDTH):
        # the input this tap reads: x's row src, or (src < 0) the state's row src + WIDTH - 1
        src = rows + (tap - (WIDTH - 1))
        in_x = ((src >= 0) & (src < tokens))[:, None] & col_ok[None, :]
        in_state = (src < 0)[:, None] & col_ok[None, :]
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=in_x)
        sv = tl.load(
            state_ptr + (src + (WIDTH - 1))[:, None] * stride_s + cols[None, :], mask=in_state
        )
        w = tl.load(weight_ptr + cols * stride_w + tap, mask=col_ok, other=0.0).to(tl.float32)
        value = tl.where(in_state, sv.to(tl.float32), tl.where(in_x, xv.to(tl.float32), 0.0))
        acc += value * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = acc * tl.sigmoid(acc)
    ok = (rows < tokens)[:, None] & col_ok[None, :]
    out_at = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=ok)
    if pid_t == 0:  # the only programs that read these state columns
        _conv_final_state(
            x_ptr, state_ptr, cols, col_ok, tokens, stride_x, stride_s, WIDTH, BLOCK_W
        )


@triton.jit
def _conv_final_state(
    x_ptr, state_ptr, cols, col_ok, tokens, stride_x, stride_s, WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    """The state after a prefill's last token: the window's last W-1 rows, x's last rows or the
    old state's where x is shorter; loaded before any store."""
    r = tl.arange(0, BLOCK_W)
    src = r + (tokens - (WIDTH - 1))
    held = (r < WIDTH - 1)[:, None] & col_ok[None, :]
    from_x = held & (src >= 0)[:, None]
    from_state = held & (src < 0)[:, None]
    xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=from_x)
    state_src = state_ptr + (src + (WIDTH - 1))[:, None] * stride_s + cols[None, :]
    sv = tl.load(state_src, mask=from_state)
    new = tl.where(from_state, sv.to(tl.float32), xv.to(tl.float32))
    tl.debug_barrier()
    state_at = state_ptr + r[:, None] * stride_s + cols[None, :]
    tl.store(state_at, new.to(state_ptr.dtype.element_ty), mask=held)


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    states_ptr,
    slot_ptr,
    out_ptr,
    channels,
    stride_x,
    stride_w,
    stride_slot,
    stride_s,
    stride_o,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token of one sequence, BLOCK_C channels: SiLU(conv) of its slot's W-1 rows and x, and
    the slot shifted by one token in place."""
    common.pdl_start(PDL)
    seq = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    base = states_ptr + slot * stride_slot
    r = tl.arange(0, BLOCK_W)
    held = (r < WIDTH - 1)[:, None] & col_ok[None, :]
    state = tl.load(base + r[:, None] * stride_s + cols[None, :], mask=held, other=0.0)
    w = tl.load(weight_ptr + cols[None, :] * stride_w + r[:, None], mask=held, other=0.0)
    x = tl.load(x_ptr + seq.to(tl.int64) * stride_x + cols, mask=col_ok, other=0.0)
    w_last = tl.load(weight_ptr + cols * stride_w + (WIDTH - 1), mask=col_ok, other=0.0)
    acc = tl.sum(state.to(tl.float32) * w.to(tl.float32), axis=0)
    acc += x.to(tl.float32) * w_last.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o + cols, out.to(out_ptr.dtype.element_ty),
             mask=col_ok)  # fmt: skip
    # row r takes row r + 1, the last row x; loaded before any store
    later = tl.load(
        base + (r + 1)[:, None] * stride_s + cols[None, :],
        mask=(r + 1 < WIDTH - 1)[:, None] & col_ok[None, :],
        other=0.0,
    )
    shifted = tl.where((r == WIDTH - 2)[:, None], x.to(tl.float32)[None, :], later.to(tl.float32))
    tl.debug_barrier()
    tl.store(base + r[:, None] * stride_s + cols[None, :],
             shifted.to(states_ptr.dtype.element_ty), mask=held)  # fmt: skip


def causal_conv_prefill_triton(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`causal_conv_prefill_ref` in one launch: x [T, C] may be a view with strided rows (the
    projection's first C columns); state [W-1, C] must have contiguous rows."""
    _check_conv(x, weight, state.unsqueeze(0))
    _check_conv_layout(x, weight, state, bias)
    tokens, channels = x.shape
    width = weight.shape[1]
    out = common.alloc((tokens, channels), x.dtype, x.device)
    if not tokens:
        return out
    grid = (triton.cdiv(channels, CONV_CHANNELS), triton.cdiv(tokens, CONV_TOKENS))
    _conv_prefill_kernel[grid](
        x, weight, weight if bias is None else bias, state, out,
        tokens, channels, x.stride(0), weight.stride(0), state.stride(0), out.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, BLOCK_T=CONV_TOKENS, BLOCK_C=CONV_CHANNELS,
        BLOCK_W=common.next_pow2(width - 1), num_warps=4, **common.pdl_launch(x.device),
    )  # fmt: skip
    return out


def causal_conv_decode_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slot_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_conv_decode_ref` in one launch, reading the slot ids on the device (no host sync:
    capturable in a CUDA graph, the ids a fixed tensor refilled between replays)."""
    _check_conv(x, weight, states)
    _check_conv_layout(x, weight, states[0], bias)
    if slot_ids.shape != (x.shape[0],) or slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_ids must be int32 or int64 [{x.shape[0]}], got {slot_ids.dtype} "
            f"{tuple(slot_ids.shape)}"
        )
    common.check_last_dim_contiguous("slot_ids", slot_ids)
    batch, channels = x.shape
    width = weight.shape[1]
    out = common.alloc((batch, channels), x.dtype, x.device)
    if not batch:
        return out
    _conv_decode_kernel[(triton.cdiv(channels, CONV_CHANNELS), batch)](
        x, weight, weight if bias is None else bias, states, slot_ids, out,
        channels, x.stride(0), weight.stride(0), states.stride(0), states.stride(1),
        out.stride(0), WIDTH=width, HAS_BIAS=bias is not None, BLOCK_C=CONV_CHANNELS,
        BLOCK_W=common.next_pow2(width - 1), num_warps=2, **common.pdl_launch(x.device),
    )  # fmt: skip
    return out


def causal_conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`causal_conv_prefill_ref`'s result: the Triton kernel on CUDA."""
    if x.is_cuda:
        return causal_conv_prefill_triton(x, weight, state, bias)
    return causal_conv_prefill_ref(x, weight, state, bias)


def causal_conv_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slot_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_conv_decode_ref`'s result: the Triton kernel on CUDA."""
    if x.is_cuda:
        return causal_conv_decode_triton(x, weight, states, slot_ids, bias)
    return causal_conv_decode_ref(x, weight, states, slot_ids, bias)


def _check_conv(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> None:
    channels, width = weight.shape
    if x.shape[-1] != channels or states.shape[1:] != (width - 1, channels):
        raise ValueError(
            f"conv inputs [..., {x.shape[-1]}] and states {tuple(states.shape[1:])} must be "
            f"[..., {channels}] and [{width - 1}, {channels}] for a weight {tuple(weight.shape)}"
        )


def _check_conv_layout(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """What the kernels step by: rows of x, weight and state each contiguous, x 2-D."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C], got {tuple(x.shape)}")
    named = {"x": x, "weight": weight, "state": state}
    if bias is not None:
        named["bias"] = bias
    for name, tensor in named.items():
        common.check_last_dim_contiguous(name, tensor)
    common.check_same_device(**named)


def gated_rmsnorm_ref(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of each head's output x [..., DV], times weight, times SiLU(gate), as transformers
    rounds it: normalized in fp32, cast to x's dtype, weighted, gated in fp32, cast back."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


@triton.jit
def _gated_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, heads, dv, stride_xt, stride_xh, stride_zt, stride_zh,
    stride_ot, stride_oh, eps, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One head of one token: `gated_rmsnorm_ref`'s arithmetic and roundings, the mean over
    the head's DV values."""
    common.pdl_start(PDL)
    pid = tl.program_id(0)
    t = (pid // heads).to(tl.int64)
    h = pid % heads
    cols = tl.arange(0, BLOCK)
    ok = cols < dv
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / dv + eps)).to(dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    weighted = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype).to(tl.float32)
    z = tl.load(z_ptr + t * stride_zt + h * stride_zh + cols, mask=ok, other=0.0).to(tl.float32)
    out = weighted * (z * tl.sigmoid(z))
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, out.to(dtype), mask=ok)


def gated_rmsnorm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`gated_rmsnorm_ref` in one launch, a program per token and head: x and gate [T, HV, DV]
    (gate may be a view with strided rows, as z is in the projections' output), weight [DV] of
    x's dtype; the output contiguous, in x's dtype."""
    if x.dim() != 3 or gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must be one [T, HV, DV] shape and "
            f"weight {tuple(weight.shape)} [DV]"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must be x's dtype {x.dtype}, got {weight.dtype}")
    for name, tensor in (("x", x), ("gate", gate), ("weight", weight)):
        common.check_last_dim_contiguous(name, tensor)
    common.check_same_device(x=x, gate=gate, weight=weight)
    tokens, heads, dv = x.shape
    out = common.alloc((tokens, heads, dv), x.dtype, x.device)
    if not tokens:
        return out
    _gated_norm_kernel[(tokens * heads,)](
        x, gate, weight, out, heads, dv, x.stride(0), x.stride(1), gate.stride(0),
        gate.stride(1), out.stride(0), out.stride(1), eps, BLOCK=common.next_pow2(dv),
        num_warps=1, **common.pdl_launch(x.device),
    )  # fmt: skip
    return out


def gated_rmsnorm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`gated_rmsnorm_ref`'s result: one Triton launch on CUDA (the reference is a dozen small
    torch kernels), the reference elsewhere."""
    if x.is_cuda and weight.dtype == x.dtype:
        return gated_rmsnorm_triton(x, gate, weight, eps)
    return gated_rmsnorm_ref(x, gate, weight, eps)


def _heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [..., H, DK] and v [..., HV, DV] in fp32; q, k normalized and repeated to HV heads."""
    heads, v_heads = q.shape[-2], v.shape[-2]
    if k.shape != q.shape or v.shape[:-2] != q.shape[:-2] or v_heads % heads:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k must be "
            f"[..., H, DK] and v [..., HV, DV] with HV a multiple of H"
        )
    q, k = (_l2norm(t.float()).repeat_interleave(v_heads // heads, dim=-2) for t in (q, k))
    return q * q.shape[-1] ** -0.5, k, v.float()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + QK_L2NORM_EPS)


def delta_rule_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The gated delta rule over one sequence's T tokens, by chunks, from its recurrent state.

    q, k [T, H, DK]; v [T, HV, DV]; g, beta [T, HV]; state [HV, DK, DV], read, then overwritten
    with the state after the last token. Returns o [T, HV, DV] in v's dtype."""
    out_dtype = v.dtype
    q, k, v = (t.transpose(0, 1) for t in _heads(q, k, v))  # [HV, T, D]
    g, beta = g.float().t(), beta.float().t()  # [HV, T]
    length = q.shape[1]
    pad = -length % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))  # padding: no decay, no write
    q, k, v = (t.unflatten(1, (-1, chunk_size)) for t in (q, k, v))  # [HV, N, C, D]
    g_sum = g.unflatten(1, (-1, chunk_size)).cumsum(-1)  # [HV, N, C]
    beta = beta.unflatten(1, (-1, chunk_size)).unsqueeze(-1)

    # decay[i, j] = exp(g_{j+1} + ... + g_i) for j <= i; masked before exp, where it could overflow
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g_sum.unsqueeze(-1) - g_sum.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    # WY form: within a chunk, the writes depend on each other through a unit lower-triangular
    # system; solving it gives u (values to write, before the old state's share) and w (the keys
    # through which the chunk's start state is subtracted).
    system = (beta * k) @ k.transpose(-1, -2) * decay
    u = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, beta * k * g_sum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    scores = q @ k.transpose(-1, -2) * decay
    q_decayed = q * g_sum.exp().unsqueeze(-1)
    k_to_end = k * (g_sum[..., -1:] - g_sum).exp().unsqueeze(-1)

    s = state.float()
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ v_new
        s = s * g_sum[:, i, -1, None, None].exp() + k_to_end[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.flatten(1, 2)[:, :length].transpose(0, 1).to(out_dtype)


def delta_rule_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """One step of the gated delta rule for one token of each of B sequences, from their slots.

    q, k [B, H, DK]; v [B, HV, DV]; g, beta [B, HV]; states [slots, HV, DK, DV]; slot_ids [B]
    (distinct), whose states are advanced in place. Returns o [B, HV, DV] in v's dtype."""
    out_dtype = v.dtype
    q, k, v = _heads(q, k, v)
    slot_ids = slot_ids.long()
    s = states[slot_ids].float() * g.float().exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    states.index_copy_(0, slot_ids, s.to(states.dtype))
    return torch.einsum("bhkv,bhk->bhv", s, q).to(out_dtype)


@dataclass(frozen=True, slots=True)
class DeltaDecodeConfig:
    """A decode step's launch: value columns per program, and warps per program. Each program
    holds a DK x block_v block of fp32 state in registers: 32 columns (a 128-byte line of each
    state row) over 4 warps keeps it to 32 values a thread (90 registers on sm_90, where 1 warp
    takes all 255)."""

    block_v: int = 32
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block_v < 1 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two, got {self.block_v}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")


@triton.jit
def _delta_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    a_log_ptr,
    dt_bias_ptr,
    states_ptr,
    slot_ptr,
    out_ptr,
    v_heads,
    group,
    dk,
    dv,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_betab,
    stride_slot,
    stride_sh,
    stride_sk,
    stride_ob,
    stride_oh,
    EPS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GATES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token of one sequence, one value head, BLOCK_V columns of its state: the state block
    read from the sequence's slot, advanced by one step and written back in place, and the
    output's columns. Each program holds all DK rows, so the reductions over DK stay in it.
    GATES: g_ptr and beta_ptr hold the gates' projections a and b, from which the program
    computes the decay and beta as `decay_and_beta` does (beta rounded to b's dtype)."""
    common.pdl_start(PDL)
    pid = tl.program_id(0)
    seq = (pid // v_heads).to(tl.int64)
    head = pid % v_heads
    key_head = head // group
    rows = tl.arange(0, BLOCK_K)
    row_ok = rows < dk
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < dv
    q = tl.load(q_ptr + seq * stride_qb + key_head * stride_qh + rows, mask=row_ok, other=0.0)
    k = tl.load(k_ptr + seq * stride_kb + key_head * stride_kh + rows, mask=row_ok, other=0.0)
    q, k = q.to(tl.float32), k.to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + EPS) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
    v = tl.load(v_ptr + seq * stride_vb + head * stride_vh + cols, mask=col_ok, other=0.0)
    g = tl.load(g_ptr + seq * stride_gb + head).to(tl.float32)
    beta = tl.load(beta_ptr + seq * stride_betab + head)
    if GATES:  # g = -exp(A_log) * softplus(a + dt_bias) (torch's threshold 20), beta = sigmoid(b)
        g += tl.load(dt_bias_ptr + head).to(tl.float32)
        g = tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
        g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * g
        beta = tl.sigmoid(beta.to(tl.float32)).to(beta_ptr.dtype.element_ty)
    beta = beta.to(tl.float32)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    at = states_ptr + slot * stride_slot + head * stride_sh
    at += rows[:, None] * stride_sk + cols[None, :]
    held = row_ok[:, None] & col_ok[None, :]
    s = tl.load(at, mask=held, other=0.0).to(tl.float32) * tl.exp(g)
    delta = (v.to(tl.float32) - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    tl.store(at, s.to(states_ptr.dtype.element_ty), mask=held)
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + cols,
             out.to(out_ptr.dtype.element_ty), mask=col_ok)  # fmt: skip


def delta_rule_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slot_ids: torch.Tensor,
    config: DeltaDecodeConfig | None = None,
    gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`delta_rule_decode_ref` in one launch that reads each sequence's state from its slot and
    writes it back in place (one read and one write of the states), the slot ids read on the
    device: no host sync, no allocation but the output's, so capturable in a CUDA graph with the
    ids a fixed tensor refilled between replays. q, k, v, g, beta may be views with strided
    rows (the convolution's output split into heads); each needs a contiguous last dimension, as
    does the states pool.

    gates (A_log, dt_bias [HV]): g and beta are the gates' projections a and b, which the kernel
    turns into the decay and beta itself (`decay_and_beta`; `gated_delta_rule_decode`)."""
    config = config or DeltaDecodeConfig()
    batch, heads, dk = q.shape
    v_heads, dv = v.shape[1:]
    if (
        k.shape != q.shape
        or v.shape[0] != batch
        or v_heads % heads
        or g.shape != (batch, v_heads)
        or beta.shape != (batch, v_heads)
        or states.shape[1:] != (v_heads, dk, dv)
    ):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, states {tuple(states.shape)}: q and k must be "
            f"[B, H, DK], v [B, HV, DV] with HV a multiple of H, g and beta [B, HV], states "
            f"[slots, HV, DK, DV]"
        )
    if slot_ids.shape != (batch,) or slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_ids must be int32 or int64 [{batch}], got {slot_ids.dtype} "
            f"{tuple(slot_ids.shape)}"
        )
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "states": states, "slot_ids": slot_ids}
    if gates is not None:
        a_log, dt_bias = gates
        if a_log.shape != (v_heads,) or dt_bias.shape != (v_heads,):
            raise ValueError(
                f"A_log {tuple(a_log.shape)} and dt_bias {tuple(dt_bias.shape)} must be [{v_heads}]"
            )
        named |= {"A_log": a_log, "dt_bias": dt_bias}
    for name, tensor in named.items():
        common.check_last_dim_contiguous(name, tensor)
    common.check_same_device(**named)
    a_log, dt_bias = gates if gates is not None else (g, g)
    out = common.alloc((batch, v_heads, dv), v.dtype, v.device)
    if not batch:
        return out
    grid = (batch * v_heads, triton.cdiv(dv, config.block_v))
    _delta_decode_kernel[grid](
        q, k, v, g, beta, a_log, dt_bias, states, slot_ids, out,
        v_heads, v_heads // heads, dk, dv, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), states.stride(0), states.stride(1), states.stride(2),
        out.stride(0), out.stride(1),
        EPS=QK_L2NORM_EPS, BLOCK_K=common.next_pow2(dk), BLOCK_V=config.block_v,
        GATES=gates is not None, num_warps=config.num_warps, **common.pdl_launch(q.device),
    )  # fmt: skip
    return out


@functools.cache
def fla_ops() -> types.ModuleType | None:
    """fla's gated delta rule ops (`fla.ops.gated_delta_rule`), or None where fla is absent."""
    try:
        from fla.ops import gated_delta_rule
    except ImportError:
        return None
    return gated_delta_rule


def delta_rule_prefill_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """`delta_rule_prefill_ref` by fla's `chunk_gated_delta_rule` (chunk_size 16, 32 or 64)."""
    out, final = fla_ops().chunk_gated_delta_rule(
        *(t.unsqueeze(0).contiguous() for t in (q, k, v, g.float(), beta)),
        initial_state=state.float().unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        chunk_size=chunk_size,
    )
    state.copy_(final[0])
    return out[0]


def delta_rule_decode_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """`delta_rule_decode_ref` by fla's `fused_recurrent_gated_delta_rule`: B sequences of one
    token each, their states gathered from the slots and written back."""
    slot_ids = slot_ids.long()
    out, final = fla_ops().fused_recurrent_gated_delta_rule(
        *(t.unsqueeze(1).contiguous() for t in (q, k, v)),
        g=g.float().unsqueeze(1),
        beta=beta.unsqueeze(1).contiguous(),
        initial_state=states[slot_ids].float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    states.index_copy_(0, slot_ids, final.to(states.dtype))
    return out[:, 0]


def _use_fla(x: torch.Tensor) -> bool:
    """fla for bf16 and fp16 on CUDA. fla's chunked kernels round fp32 operands to TF32 (its
    triangular solve asks for it by name), which on the test models' scaled-up weights moves
    the logits by 4-22% (the torch rule with its products' operands rounded to TF32 gives
    4-9%), so fp32 activations take the torch rule, fp32 throughout, on every device."""
    return x.is_cuda and x.dtype != torch.float32 and fla_ops() is not None


def delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """`delta_rule_prefill_ref`'s result: fla's kernel on CUDA where fla is installed and the
    activations are bf16 or fp16 (`_use_fla`)."""
    if _use_fla(q):
        return delta_rule_prefill_fla(q, k, v, g, beta, state, chunk_size)
    return delta_rule_prefill_ref(q, k, v, g, beta, state, chunk_size)


def delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """`delta_rule_decode_ref`'s result: the Triton kernel on CUDA, which updates the slots in
    place (fla's recurrent kernel cannot: `delta_rule_decode_fla`)."""
    if q.is_cuda:
        return delta_rule_decode_triton(q, k, v, g, beta, states, slot_ids)
    return delta_rule_decode_ref(q, k, v, g, beta, states, slot_ids)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """`delta_rule_decode` from the gates' projections a, b [B, HV] (`decay_and_beta`'s
    inputs). On CUDA the decode kernel computes the decay and beta itself, in the same launch:
    at batch 1 those are a few dozen values, and the seven small launches torch would take for
    them cost more than the step's state reads."""
    if q.is_cuda:
        return delta_rule_decode_triton(q, k, v, a, b, states, slot_ids, gates=(a_log, dt_bias))
    g, beta = decay_and_beta(a, b, a_log, dt_bias)
    return delta_rule_decode_ref(q, k, v, g, beta, states, slot_ids)
