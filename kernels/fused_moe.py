"""Decode MoE over the expert cache's slots: gate/up, SiLU·up, down and the weighted sum.

Two Triton launches plus one sum (or none: `reduce=False` hands the per-route outputs to a
consumer that sums them, the next residual add + RMSNorm in the engine). Each launch is a split-N
GEMV grid over (route, row block).
- One token (the batch-1 decode step): the launches of `fused_moe_one_token`, without tl.dot.
- More tokens: tl.dot with the tokens padded to 16. A slot that several tokens route to is read
  once: the first route naming a slot (its leader) computes it for every token that names it; the
  other routes' programs only write zeros where the sum expects them.
Nothing depends on the data on the host, so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import common, fp8, fp8_moe, fused_moe_one_token, swiglu
from .common import tl, triton
from .fused_moe_one_token import OneTokenMoEConfig, choose_one_token_config

# Tokens one program handles at once; larger batches are split into chunks of this many tokens.
MAX_TOKENS_PER_LAUNCH = 64


@dataclass(frozen=True, slots=True)
class DecodeMoEConfig:
    """Tile sizes of the two decode launches (rows per program and reduction step of each)."""

    gate_up_block_n: int = 16
    gate_up_block_k: int = 256
    down_block_n: int = 32
    down_block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("gate_up_block_n", "gate_up_block_k", "down_block_n", "down_block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {value}")


# The tl.dot path's tiles over an FP8 bank: rows 16 per warp (the weights are the dot's first
# operand, fp8_moe.dot_step: a warp that shared its rows with another would widen them twice).
FP8_DECODE_CONFIG = DecodeMoEConfig(
    gate_up_block_n=32, gate_up_block_k=128, down_block_n=32, down_block_k=128, num_warps=2
)


def fused_moe_decode_ref(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    reduce: bool = True,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Reference, a torch loop: sum over routes of weight * w2[s] @ (silu(gate·x) * (up·x)).

    An FP8 bank (with its block factors) is dequantized to fp32 slot by slot, then read as a
    bf16 one is. gpt-oss's experts pass their biases and the clamped SwiGLU's limit
    (kernels/swiglu.py). reduce=False: each route's weighted output, fp32 [T, K, H] (zeros where
    masked), for a consumer that sums them itself."""
    fp8_bank = _check(x, slot_ids, route_weights, w13, w2, w13_scale_inv, w2_scale_inv)
    biased = swiglu.check_biases(w13, w2, w13_bias, w2_bias)
    dtype = compute_dtype or x.dtype
    inter = w13.shape[1] // 2
    parts = torch.zeros((*slot_ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    slots = slot_ids.tolist()
    weights = route_weights.float()

    def expert(w: torch.Tensor, scale_inv: torch.Tensor | None, slot: int) -> torch.Tensor:
        return fp8_moe.dequantized(w[slot], scale_inv[slot] if fp8_bank else None).to(dtype)

    for t, row in enumerate(slots):
        xt = x[t].to(dtype)
        for k, slot in enumerate(row):
            if slot < 0:
                continue
            gate_up = expert(w13, w13_scale_inv, slot) @ xt
            if biased:
                gate_up = gate_up + w13_bias[slot].to(dtype)
            act = swiglu.activate(gate_up[:inter], gate_up[inter:], swiglu_limit)
            y = expert(w2, w2_scale_inv, slot) @ act
            if biased:
                y = y + w2_bias[slot].to(dtype)
            parts[t, k] = weights[t, k] * y.float()
    return parts.sum(dim=1) if reduce else parts


@triton.jit
def route_group(
    slots_ptr, route, num_tokens, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr
):
    """For this program's route: its slot, whether it leads that slot, and each token's first k."""
    slot = tl.load(slots_ptr + route)
    t_idx = tl.arange(0, BLOCK_T)
    k_idx = tl.arange(0, BLOCK_R)
    flat = t_idx[:, None] * TOP_K + k_idx[None, :]
    valid = (t_idx[:, None] < num_tokens) & (k_idx[None, :] < TOP_K)
    all_slots = tl.load(slots_ptr + flat, mask=valid, other=-1)
    match = (all_slots == slot) & valid
    earlier = tl.sum(tl.sum((match & (flat < route)).to(tl.int32), axis=1), axis=0)
    leads = (slot >= 0) & (earlier == 0)
    # The first k of each token naming this slot holds the token's result; later duplicates are 0.
    first_k = tl.min(tl.where(match, k_idx[None, :], BLOCK_R), axis=1)
    return slot, leads, match, first_k, t_idx


@triton.jit
def _gate_up_kernel(
    x_ptr,
    slots_ptr,
    w13_ptr,
    s13_ptr,
    b13_ptr,
    act_ptr,
    num_tokens,
    hidden,
    inter,
    limit,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_ss,
    stride_sn,
    stride_bs,
    stride_at,
    stride_ak,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    FP8: tl.constexpr,
    BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    route = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, leads, _, first_k, t_idx = route_group(
        slots_ptr, route, num_tokens, TOP_K, BLOCK_T, BLOCK_R
    )
    if leads:
        has = first_k < BLOCK_R
        n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n_idx < inter
        if FP8:  # the transposed product, act^T [BLOCK_N, BLOCK_T]: fp8_moe.dot_step
            expert = w13_ptr + slot.to(tl.int64) * stride_ws
            gate_rows = expert + n_idx[:, None].to(tl.int64) * stride_wn
            up_rows = expert + (inter + n_idx[:, None]).to(tl.int64) * stride_wn
            factors = s13_ptr + slot.to(tl.int64) * stride_ss
            gate_factors = factors + (n_idx // 128) * stride_sn
            up_factors = factors + ((inter + n_idx) // 128) * stride_sn
            xt_base = x_ptr + t_idx[None, :].to(tl.int64) * stride_xt
            acc_gate = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k_idx = k0 + tl.arange(0, BLOCK_K)
                k_ok = k_idx < hidden
                xt = tl.load(xt_base + k_idx[:, None], mask=k_ok[:, None] & has[None, :], other=0.0)
                xt = xt.to(COMPUTE)
                acc_gate = fp8_moe.dot_step(
                    acc_gate, gate_rows, gate_factors, n_ok, k_idx, k_ok, k0, xt, COMPUTE
                )
                acc_up = fp8_moe.dot_step(
                    acc_up, up_rows, up_factors, n_ok, k_idx, k_ok, k0, xt, COMPUTE
                )
            if BIAS:
                gate_bias, up_bias = gate_up_bias(b13_ptr, slot, stride_bs, inter, n_idx, n_ok)
                acc_gate += gate_bias[:, None]
                acc_up += up_bias[:, None]
            act = swiglu.activate_tl(acc_gate, acc_up, limit, CLAMPED)
            act_base = act_ptr + t_idx * stride_at + first_k * stride_ak
            act_ptrs = act_base[None, :] + n_idx[:, None]
            act_ok = n_ok[:, None] & has[None, :]
            tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=act_ok)
        else:
            gate_base = (
                w13_ptr + slot.to(tl.int64) * stride_ws + n_idx[None, :].to(tl.int64) * stride_wn
            )
            up_base = gate_base + inter * stride_wn
            x_base = x_ptr + t_idx[:, None].to(tl.int64) * stride_xt
            acc_gate = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k_idx = k0 + tl.arange(0, BLOCK_K)
                k_ok = k_idx < hidden
                xs = tl.load(x_base + k_idx[None, :], mask=has[:, None] & k_ok[None, :], other=0.0)
                w_mask = k_ok[:, None] & n_ok[None, :]
                gate = tl.load(gate_base + k_idx[:, None], mask=w_mask, other=0.0)
                up = tl.load(up_base + k_idx[:, None], mask=w_mask, other=0.0)
                xs = xs.to(COMPUTE)
                # "ieee": an fp32 compute dtype multiplies exactly, not in TF32; bf16/fp16
                # ignore it.
                acc_gate += tl.dot(xs, gate.to(COMPUTE), input_precision="ieee")
                acc_up += tl.dot(xs, up.to(COMPUTE), input_precision="ieee")
            if BIAS:
                gate_bias, up_bias = gate_up_bias(b13_ptr, slot, stride_bs, inter, n_idx, n_ok)
                acc_gate += gate_bias[None, :]
                acc_up += up_bias[None, :]
            act = swiglu.activate_tl(acc_gate, acc_up, limit, CLAMPED)
            act_ptrs = (
                act_ptr + t_idx[:, None] * stride_at + first_k[:, None] * stride_ak + n_idx[None, :]
            )
            tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=has[:, None] & n_ok[None, :])


@triton.jit
def zero_unled_route(
    y_ptr, route, slot, t_idx, first_k, n_idx, n_ok, stride_yt, stride_yk, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """This route's own row of y, zero where its slot is masked or named earlier by its token
    (the route that leads the slot wrote that token's output at its first k)."""
    own_t = route // TOP_K
    own_k = route % TOP_K
    own_first = tl.min(tl.where(t_idx == own_t, first_k, BLOCK_R), axis=0)
    if (slot < 0) | (own_k != own_first):
        zeros = tl.zeros((BLOCK_N,), dtype=tl.float32)
        tl.store(y_ptr + own_t * stride_yt + own_k * stride_yk + n_idx, zeros, mask=n_ok)


@triton.jit
def gate_up_bias(b13_ptr, slot, stride_bs, inter, n_idx, n_ok):
    """A slot's gate and up biases of the rows n_idx, fp32."""
    row = b13_ptr + slot.to(tl.int64) * stride_bs
    gate = tl.load(row + n_idx, mask=n_ok, other=0.0).to(tl.float32)
    up = tl.load(row + inter + n_idx, mask=n_ok, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def _down_kernel(
    act_ptr,
    slots_ptr,
    weights_ptr,
    w2_ptr,
    s2_ptr,
    b2_ptr,
    y_ptr,
    num_tokens,
    hidden,
    inter,
    stride_at,
    stride_ak,
    stride_ws,
    stride_wn,
    stride_ss,
    stride_sn,
    stride_bs,
    stride_yt,
    stride_yk,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    FP8: tl.constexpr,
    BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    route = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, leads, match, first_k, t_idx = route_group(
        slots_ptr, route, num_tokens, TOP_K, BLOCK_T, BLOCK_R
    )
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < hidden
    if leads:
        has = first_k < BLOCK_R
        k_all = tl.arange(0, BLOCK_R)
        flat = t_idx[:, None] * TOP_K + k_all[None, :]
        route_w = tl.load(weights_ptr + flat, mask=match, other=0.0).to(tl.float32)
        token_w = tl.sum(route_w, axis=1)
        if FP8:  # the transposed product, y^T [BLOCK_N, BLOCK_T]: fp8_moe.dot_step
            expert = w2_ptr + slot.to(tl.int64) * stride_ws
            w_rows = expert + n_idx[:, None].to(tl.int64) * stride_wn
            row_factors = s2_ptr + slot.to(tl.int64) * stride_ss + (n_idx // 128) * stride_sn
            at_base = (act_ptr + t_idx * stride_at + first_k * stride_ak)[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                k_idx = k0 + tl.arange(0, BLOCK_K)
                k_ok = k_idx < inter
                at = tl.load(at_base + k_idx[:, None], mask=k_ok[:, None] & has[None, :], other=0.0)
                acc = fp8_moe.dot_step(
                    acc, w_rows, row_factors, n_ok, k_idx, k_ok, k0, at.to(COMPUTE), COMPUTE
                )
            if BIAS:
                bias_row = b2_ptr + slot.to(tl.int64) * stride_bs
                acc += tl.load(bias_row + n_idx, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            y_ptrs = (y_ptr + t_idx * stride_yt + first_k * stride_yk)[None, :] + n_idx[:, None]
            tl.store(y_ptrs, acc * token_w[None, :], mask=n_ok[:, None] & has[None, :])
        else:
            w_base = (
                w2_ptr + slot.to(tl.int64) * stride_ws + n_idx[None, :].to(tl.int64) * stride_wn
            )
            a_base = act_ptr + t_idx[:, None] * stride_at + first_k[:, None] * stride_ak
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                k_idx = k0 + tl.arange(0, BLOCK_K)
                k_ok = k_idx < inter
                a = tl.load(a_base + k_idx[None, :], mask=has[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + k_idx[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc += tl.dot(a.to(COMPUTE), w.to(COMPUTE), input_precision="ieee")
            if BIAS:
                bias_row = b2_ptr + slot.to(tl.int64) * stride_bs
                acc += tl.load(bias_row + n_idx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y_ptrs = (
                y_ptr + t_idx[:, None] * stride_yt + first_k[:, None] * stride_yk + n_idx[None, :]
            )
            tl.store(y_ptrs, acc * token_w[:, None], mask=has[:, None] & n_ok[None, :])
    zero_unled_route(
        y_ptr, route, slot, t_idx, first_k, n_idx, n_ok, stride_yt, stride_yk, TOP_K, BLOCK_N,
        BLOCK_R,
    )  # fmt: skip


def fused_moe_decode_triton(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    config: DecodeMoEConfig | OneTokenMoEConfig | None = None,
    reduce: bool = True,
    few_routes: bool = False,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Triton decode MoE: fp32 [T, H], graph-capturable (no host sync, shapes fixed by T and K).

    w13/w2 are the slots' weights, bf16/fp16/fp32, or FP8 (float8_e4m3fn or its uint8 bits) with
    their block factors w13_scale_inv/w2_scale_inv (fp8_moe: the layout), widened in registers.
    config picks the path: a OneTokenMoEConfig the one-token kernels (T must be 1), a
    DecodeMoEConfig the tl.dot kernels (any T; an FP8 bank's reduction steps are at most 128
    wide); None the one-token kernels with `choose_one_token_config`'s tiles at T=1 (for few
    live routes if `few_routes`: the routes a layer step's fills serve; an FP8 bank's rows must
    split into 4-byte words, `fused_moe_one_token.fits`), else the tl.dot kernels with the
    default tiles.
    reduce=False: fp32 [T, K, H] whose sum over K is that result, without the sum's launch. How a
    slot named twice by one token splits between its routes depends on the path (one-token: each
    route holds its own weighted output, as the reference's parts do; tl.dot: the token's result
    at its first route, zeros at the other), so a consumer may rely on the sum over K only.
    gpt-oss's experts: their biases, added to the fp32 sums, and the clamped SwiGLU
    (kernels/swiglu.py)."""
    fp8_bank = _check(x, slot_ids, route_weights, w13, w2, w13_scale_inv, w2_scale_inv)
    biases = (w13_bias, w2_bias) if swiglu.check_biases(w13, w2, w13_bias, w2_bias) else None
    extras = swiglu.Extras(biases, float(swiglu_limit))
    num_tokens, hidden = x.shape
    top_k = slot_ids.shape[1]
    inter = w13.shape[1] // 2
    if config is None and num_tokens == 1 and fused_moe_one_token.fits(w13, w2, fp8_bank):
        sms = common.sm_count(x.device)
        config = choose_one_token_config(top_k, hidden, inter, sms, few_routes, fp8_bank)
    one_token = isinstance(config, OneTokenMoEConfig)
    if one_token and num_tokens != 1:
        raise ValueError(
            f"a OneTokenMoEConfig is for one token, got {num_tokens}: pass a DecodeMoEConfig "
            "or no config"
        )
    act_dtype = compute_dtype or x.dtype
    compute = common.tl_dtype(act_dtype)
    slot_ids = slot_ids.contiguous()
    route_weights = route_weights.contiguous()
    act = common.alloc((num_tokens, top_k, inter), act_dtype, x.device)
    y = common.alloc((num_tokens, top_k, hidden), torch.float32, x.device)
    if fp8_bank:
        w13, w2 = fp8_moe.bits(w13), fp8_moe.bits(w2)
    scales = (w13_scale_inv, w2_scale_inv) if fp8_bank else None
    if one_token:
        fused_moe_one_token.launch(
            x, slot_ids, route_weights, w13, w2, scales, act, y, compute, extras, config
        )
    else:
        cfg = config or (FP8_DECODE_CONFIG if fp8_bank else DecodeMoEConfig())
        _tokens(x, slot_ids, route_weights, w13, w2, scales, act, y, compute, extras, cfg)
    return y.sum(dim=1) if reduce else y


def _tokens(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    act: torch.Tensor,
    y: torch.Tensor,
    compute: tl.dtype,
    extras: swiglu.Extras,
    cfg: DecodeMoEConfig,
) -> None:
    """The tl.dot launches, MAX_TOKENS_PER_LAUNCH tokens at a time: act, then y. scales: the
    block factors of w13 and w2 where the bank is FP8 (uint8 bits), else None; extras:
    gpt-oss's biases and SwiGLU limit."""
    num_tokens, hidden = x.shape
    top_k = slot_ids.shape[1]
    inter = w13.shape[1] // 2
    pdl = common.pdl_launch(x.device)
    gate_up_k = min(cfg.gate_up_block_k, common.next_pow2(hidden, 16))
    down_k = min(cfg.down_block_k, common.next_pow2(inter, 16))
    if scales is not None:  # FP8: one factor per row in each reduction step
        gate_up_k, down_k = min(gate_up_k, fp8.BLOCK), min(down_k, fp8.BLOCK)
    # (a bf16 bank passes its weights as the factors, never read)
    s13, s2 = scales if scales is not None else (w13, w2)
    # (without biases, the weights stand in for them, never read)
    b13, b2 = extras.biases if extras.biases is not None else (w13, w2)
    for t0 in range(0, num_tokens, MAX_TOKENS_PER_LAUNCH):
        t1 = min(t0 + MAX_TOKENS_PER_LAUNCH, num_tokens)
        chunk = t1 - t0
        block_t = common.next_pow2(chunk, 16)
        # Wide token tiles take more shared memory per pipeline stage.
        num_stages = cfg.num_stages if block_t <= 32 else min(cfg.num_stages, 3)
        block_r = common.next_pow2(top_k)
        grid_a = (chunk * top_k, triton.cdiv(inter, cfg.gate_up_block_n))
        _gate_up_kernel[grid_a](
            x[t0:t1],
            slot_ids[t0:t1],
            w13,
            s13,
            b13,
            act[t0:t1],
            chunk,
            hidden,
            inter,
            extras.limit,
            x.stride(0),
            w13.stride(0),
            w13.stride(1),
            s13.stride(0),
            s13.stride(1),
            b13.stride(0),
            act.stride(0),
            act.stride(1),
            TOP_K=top_k,
            BLOCK_T=block_t,
            BLOCK_R=block_r,
            BLOCK_N=cfg.gate_up_block_n,
            BLOCK_K=gate_up_k,
            COMPUTE=compute,
            FP8=scales is not None,
            BIAS=extras.biases is not None,
            CLAMPED=extras.limit > 0,
            num_warps=cfg.num_warps,
            num_stages=num_stages,
            **pdl,
        )
        grid_b = (chunk * top_k, triton.cdiv(hidden, cfg.down_block_n))
        _down_kernel[grid_b](
            act[t0:t1],
            slot_ids[t0:t1],
            route_weights[t0:t1],
            w2,
            s2,
            b2,
            y[t0:t1],
            chunk,
            hidden,
            inter,
            act.stride(0),
            act.stride(1),
            w2.stride(0),
            w2.stride(1),
            s2.stride(0),
            s2.stride(1),
            b2.stride(0),
            y.stride(0),
            y.stride(1),
            TOP_K=top_k,
            BLOCK_T=block_t,
            BLOCK_R=block_r,
            BLOCK_N=cfg.down_block_n,
            BLOCK_K=down_k,
            COMPUTE=compute,
            FP8=scales is not None,
            BIAS=extras.biases is not None,
            num_warps=cfg.num_warps,
            num_stages=num_stages,
            **pdl,
        )


def fused_moe_decode(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    reduce: bool = True,
    few_routes: bool = False,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Decode MoE over cache slots: the Triton kernel on CUDA (few_routes: tiles for a launch
    where few routes are live), the torch reference elsewhere. An FP8 bank passes its block
    factors as w13_scale_inv and w2_scale_inv (fused_moe_decode_triton); gpt-oss's experts their
    biases and the clamped SwiGLU's limit (kernels/swiglu.py)."""
    kwargs = {
        "w13_scale_inv": w13_scale_inv,
        "w2_scale_inv": w2_scale_inv,
        "compute_dtype": compute_dtype,
        "reduce": reduce,
        "w13_bias": w13_bias,
        "w2_bias": w2_bias,
        "swiglu_limit": swiglu_limit,
    }
    if x.is_cuda:
        return fused_moe_decode_triton(
            x, slot_ids, route_weights, w13, w2, few_routes=few_routes, **kwargs
        )
    return fused_moe_decode_ref(x, slot_ids, route_weights, w13, w2, **kwargs)


def _check(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2_scale_inv: torch.Tensor | None,
) -> bool:
    """Validate the arguments (no device sync); whether the bank is FP8."""
    common.check_routes(x, slot_ids, route_weights, w13, w2, ids_name="slot_ids")
    return fp8_moe.check_bank(w13, w2, w13_scale_inv, w2_scale_inv)
