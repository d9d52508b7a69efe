"""MXFP4 expert banks in the MoE kernels: the decode launches and the grouped prefill GEMM,
reading gpt-oss's blocks and scales (kernels/mxfp4.py) and widening them in registers.

A bank is w13 [S, 2I, H/32, 16] and w2 [S, H, I/32, 16] uint8 (two e2m1 values a byte, the
even-indexed one in the low nibble) with their E8M0 scales w13_scale [S, 2I, H/32] and w2_scale
[S, H, I/32] uint8: a weight is its e2m1 value times 2^(scale − 127) (0xFF: NaN). The kernels
read each byte once and split it into its two codes with integer ops, no FP4 or FP8 instruction,
so that the same code runs on Turing, Ampere and later GPUs and under the Triton interpreter.

- The decode (`launch_decode`) of one token is fp4_one_token's launches (no tl.dot: a few rows a
  program, each byte read once in 16-byte vectors, products summed per scale block in the thread
  that read them), with `fp4_one_token.choose_config`'s tiles unless told otherwise.
- The decode of more tokens is the bf16 and FP8 decode's tl.dot launches (kernels/fused_moe.py:
  a slot named by several tokens read once, by its first route) over one scale block at a time:
  each code becomes an fp16 with three integer ops (fp4_widen.halves: the value times 2^-14,
  exact), the block goes into tl.dot unscaled, and the block's scale multiplies the fp32 product
  per row and token (`block_dot`); the 2^14 is given back once at the end. Per weight: a byte
  extract, the three ops, the conversion to the compute dtype and its share of the tensor-core
  product (`DotDecodeConfig`: its tiles).
- The prefill (`launch_grouped`) builds each code's fp32 bits (`values`) and its block's scale
  (`scales`) per weight and multiplies them (a power of two: exact in fp32 and bf16), then
  tl.dot's the even and odd columns apart (low and high nibbles), against the activations' even
  and odd columns.

The launches read NVFP4 banks too (kernels/nvfp4_moe.py): the same bytes, an e4m3 scale per 16
values built from its bits (`e4m3_scales`), and the per-tensor scales multiplied into the fp32
sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import common, fp4_one_token, fused_moe, mxfp4, swiglu
from .common import tl, triton
from .fp4_one_token import OneTokenFP4Config
from .fp4_widen import e4m3_scales, halves, scales, values
from .grouped_moe import GroupedMoEConfig, _check_expert_range, _group_routes, config_for
from .nvfp4 import BLOCK as NVFP4_BLOCK


@dataclass(frozen=True, slots=True)
class DotDecodeConfig:
    """Tiles of the tl.dot decode launches: a program reads block_n rows of gate and of up (or of
    down) a step of block_k columns: 2 x 16 x 128 bytes with the defaults, in flight for
    num_stages steps at once; 16 rows a warp, so that no two warps widen the same weights."""

    block_n: int = 16
    block_k: int = 256
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, least in (("block_n", 16), ("block_k", 32)):
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(
                    f"{name} must be a power of two >= {least} (block_n: tl.dot's least rows), "
                    f"got {value}"
                )
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


# what picks a decode's launches: one token's (T=1 only) or the tl.dot ones, with their tiles
DecodeConfig = DotDecodeConfig | OneTokenFP4Config


def check_bank(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor
) -> tuple[int, int, int]:
    """(S, H, I) of an MXFP4 bank, after checking its blocks and scales fit each other (metadata
    only: no device sync)."""
    for name, w, s in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if w.dtype != torch.uint8 or w.dim() != 4 or w.shape[3] != mxfp4.BLOCK // 2:
            raise ValueError(
                f"{name} must be MXFP4 blocks, uint8 [S, N, K/32, 16], got {w.dtype} "
                f"{tuple(w.shape)}"
            )
        if s.dtype != torch.uint8 or tuple(s.shape) != tuple(w.shape[:3]):
            raise ValueError(
                f"{name}_scale must be the E8M0 scales of {name}, uint8 {tuple(w.shape[:3])}, "
                f"got {s.dtype} {tuple(s.shape)}"
            )
        if not (w.is_contiguous() and s.is_contiguous()):
            raise ValueError(f"{name} and {name}_scale must be contiguous")
        if s.device != w.device:
            raise ValueError(f"{name}_scale is on {s.device} and {name} on {w.device}")
    slots, two_inter, hidden_blocks = w13.shape[:3]
    hidden, inter = hidden_blocks * mxfp4.BLOCK, two_inter // 2
    if w2.shape[:3] != (slots, hidden, inter // mxfp4.BLOCK) or two_inter != 2 * inter:
        raise ValueError(
            f"w2 {tuple(w2.shape)} does not fit w13 {tuple(w13.shape)}: with H={hidden} and "
            f"I={inter}, w2 is [{slots}, {hidden}, {inter // mxfp4.BLOCK}, 16]"
        )
    return slots, hidden, inter


def _check(
    x: torch.Tensor,
    ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    ids_name: str,
) -> tuple[int, int, int]:
    """Validate a call (metadata only: no device sync); the bank's (S, H, I)."""
    slots, hidden, inter = check_bank(w13, w2, w13_scale, w2_scale)
    if x.dim() != 2 or x.shape[1] != hidden or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"x must be [T, H={hidden}] and {ids_name} [T, K]: got {tuple(x.shape)} and "
            f"{tuple(ids.shape)}"
        )
    if route_weights.shape != ids.shape or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{ids_name} must be int32 or int64 and route_weights of its shape "
            f"{tuple(ids.shape)}: got {ids.dtype} and {tuple(route_weights.shape)}"
        )
    common.check_same_device(x=x, **{ids_name: ids}, route_weights=route_weights, w13=w13, w2=w2)
    return slots, hidden, inter


def dequantized_bank(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bank's fp32 weights [S, 2I, H] and [S, H, I], by the format's definition: what the
    references compute with."""
    return mxfp4.dequantize(w13, w13_scale), mxfp4.dequantize(w2, w2_scale)


def fused_moe_decode_mxfp4_ref(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    reduce: bool = True,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Reference of the decode launches: fp32 [T, H], sum over the routes (slot >= 0) of weight
    * w2[s] @ (silu(gate·x) * (up·x)) with the dequantized weights, in fp32; gpt-oss's experts
    add their biases and clamp the SwiGLU (kernels/swiglu.py). reduce=False: each route's
    weighted output [T, K, H] (zeros where masked)."""
    _check(x, slot_ids, route_weights, w13, w2, w13_scale, w2_scale, "slot_ids")
    biased = swiglu.check_biases(w13, w2, w13_bias, w2_bias)
    dense13, dense2 = dequantized_bank(w13, w2, w13_scale, w2_scale)
    inter = dense2.shape[2]
    parts = torch.zeros((*slot_ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for t, row in enumerate(slot_ids.tolist()):
        for k, slot in enumerate(row):
            if slot < 0:
                continue
            gate_up = dense13[slot] @ x[t].float()
            if biased:
                gate_up = gate_up + w13_bias[slot].float()
            act = swiglu.activate(gate_up[:inter], gate_up[inter:], swiglu_limit)
            y = dense2[slot] @ act
            if biased:
                y = y + w2_bias[slot].float()
            parts[t, k] = route_weights[t, k].float() * y
    return parts.sum(dim=1) if reduce else parts


def grouped_moe_mxfp4_ref(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    **extras: torch.Tensor | float | None,
) -> torch.Tensor:
    """Reference of the prefill GEMM: the decode reference's sum, the ids naming experts
    (extras: gpt-oss's biases and SwiGLU limit)."""
    return fused_moe_decode_mxfp4_ref(
        x, expert_ids, route_weights, w13, w2, w13_scale, w2_scale, **extras
    )


@triton.jit
def widened(byte_ptrs, scale_ptrs, mask, NVFP4: tl.constexpr):
    """The weights of a tile of bytes, fp32, each times its block's scale: (the even columns,
    the odd ones), of the pointers' shape. Byte j of a row holds columns 2j (low nibble) and
    2j + 1 (high), both in one block, whose scale `scale_ptrs` points at (E8M0, or NVFP4's
    e4m3)."""
    packed = tl.load(byte_ptrs, mask=mask, other=0).to(tl.int32)
    codes = tl.load(scale_ptrs, mask=mask, other=0).to(tl.int32)
    factor = e4m3_scales(codes) if NVFP4 else scales(codes)
    return values(packed & 15) * factor, values((packed >> 4) & 15) * factor


@triton.jit
def block_of(cols, NVFP4: tl.constexpr):
    """The scale block of columns `cols`: 16 values a block in NVFP4, 32 in MXFP4."""
    if NVFP4:
        return cols // 16
    return cols // 32


@triton.jit
def block_dot(acc, rows, row_scales, n_ok, block, blocks, columns, SCALE_BLOCK: tl.constexpr,
              COMPUTE: tl.constexpr, NVFP4: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_T] plus scale block `block` of the rows times `columns`: rows
    [BLOCK_N, 1] point at the rows' bytes as int32 words, row_scales [BLOCK_N] at their scale
    codes, `blocks` the blocks a row holds (none past it is read), `columns` [SCALE_BLOCK,
    BLOCK_T] the block's activations in the compute dtype. The block's weights (times 2^-14,
    `halves`) go into tl.dot unscaled, and its scale multiplies the fp32 product: one multiply
    per row and token a block, none per weight, and no weight is formed, so that E8M0 254
    (whose weights of magnitude 2 and more overflow fp32) gives the exact sums too. Only a
    block's product below 2^-112 (2^-126 carrying the 2^-14) loses bits, to fp32's
    subnormals."""
    row_ok = n_ok & (tl.zeros(n_ok.shape, tl.int32) + block < blocks)
    j = tl.arange(0, SCALE_BLOCK // 8)
    words = tl.load(rows + block * (SCALE_BLOCK // 8) + j[None, :], mask=row_ok[:, None], other=0)
    weights = halves(words, tl.float16)
    codes = tl.load(row_scales + block, mask=row_ok, other=0).to(tl.int32)
    factor = e4m3_scales(codes) if NVFP4 else scales(codes)
    # "ieee": an fp32 compute dtype multiplies exactly, not in TF32; bf16/fp16 ignore it. fp16
    # to fp32 to the compute dtype: both exact, and cheaper on a GPU than fp16 to bf16 at once.
    weights = weights.to(tl.float32).to(COMPUTE)
    product = tl.dot(weights, columns, input_precision="ieee")
    return acc + product * factor[:, None]


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, slots_ptr, w13_ptr, s13_ptr, t13_ptr, b13_ptr, act_ptr, num_tokens, hidden, inter,
    limit, stride_xt, stride_ws, stride_wn, stride_ss, stride_sn, stride_bs, stride_at, stride_ak,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    STEP_BLOCKS: tl.constexpr, SCALE_BLOCK: tl.constexpr, COMPUTE: tl.constexpr,
    BIAS: tl.constexpr, CLAMPED: tl.constexpr, NVFP4: tl.constexpr,
):  # fmt: skip
    """act[t, k, rows] = silu(gate·x[t]) * (up·x[t]) for a block of rows of the slot of route
    (t, k), computed by the slot's first route for every token naming it (fused_moe.route_group)
    and stored at each token's first route naming it. BIAS: plus the slot's gate and up biases;
    CLAMPED: gpt-oss's clamped SwiGLU; NVFP4: e4m3 scales per 16 values, the sums times the
    slot's per-tensor scales of gate and up, t13 [S, 2]."""
    slot, leads, _, first_k, t_idx = fused_moe.route_group(
        slots_ptr, tl.program_id(0), num_tokens, TOP_K, BLOCK_T, BLOCK_R
    )
    if leads:
        has = first_k < BLOCK_R
        n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n_idx < inter
        gate = w13_ptr + slot.to(tl.int64) * stride_ws + n_idx[:, None].to(tl.int64) * stride_wn
        up = gate + inter * stride_wn
        gate_s = s13_ptr + slot.to(tl.int64) * stride_ss + n_idx.to(tl.int64) * stride_sn
        up_s = gate_s + inter * stride_sn
        xt_base = x_ptr + t_idx[None, :].to(tl.int64) * stride_xt
        c_idx = tl.arange(0, SCALE_BLOCK)
        blocks = hidden // SCALE_BLOCK
        acc_gate = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for step in range(0, blocks, STEP_BLOCKS):
            for b in tl.static_range(STEP_BLOCKS):
                cols = (step + b) * SCALE_BLOCK + c_idx
                xt_mask = (cols < hidden)[:, None] & has[None, :]
                xt = tl.load(xt_base + cols[:, None], mask=xt_mask, other=0.0).to(COMPUTE)
                acc_gate = block_dot(
                    acc_gate, gate, gate_s, n_ok, step + b, blocks, xt, SCALE_BLOCK, COMPUTE, NVFP4
                )
                acc_up = block_dot(
                    acc_up, up, up_s, n_ok, step + b, blocks, xt, SCALE_BLOCK, COMPUTE, NVFP4
                )
        # `halves` gives each weight times 2^-14: the sums carry that factor until here
        g = acc_gate * 16384.0
        u = acc_up * 16384.0
        if NVFP4:
            g *= tl.load(t13_ptr + 2 * slot)
            u *= tl.load(t13_ptr + 2 * slot + 1)
        if BIAS:
            biases = fused_moe.gate_up_bias(b13_ptr, slot, stride_bs, inter, n_idx, n_ok)
            g += biases[0][:, None]
            u += biases[1][:, None]
        act = swiglu.activate_tl(g, u, limit, CLAMPED)
        act_ptrs = (act_ptr + t_idx * stride_at + first_k * stride_ak)[None, :] + n_idx[:, None]
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok[:, None] & has[None, :])


@triton.jit
def _decode_down_kernel(
    act_ptr, slots_ptr, weights_ptr, w2_ptr, s2_ptr, t2_ptr, b2_ptr, y_ptr, num_tokens, hidden,
    inter, stride_at, stride_ak, stride_ws, stride_wn, stride_ss, stride_sn, stride_bs,
    stride_yt, stride_yk, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, STEP_BLOCKS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    COMPUTE: tl.constexpr, BIAS: tl.constexpr, NVFP4: tl.constexpr,
):  # fmt: skip
    """y[t, k, rows] = (sum of token t's weights of the routes naming the slot) * (w2 rows ·
    act[t]) for a block of rows, computed by the slot's first route for every token naming it
    and stored at each token's first route naming it; the other routes' rows of y are zeros.
    BIAS: plus the slot's down bias before the weight; NVFP4: the sums times the slot's
    per-tensor scale, t2 [S, 1]."""
    route = tl.program_id(0)
    slot, leads, match, first_k, t_idx = fused_moe.route_group(
        slots_ptr, route, num_tokens, TOP_K, BLOCK_T, BLOCK_R
    )
    n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < hidden
    if leads:
        has = first_k < BLOCK_R
        flat = t_idx[:, None] * TOP_K + tl.arange(0, BLOCK_R)[None, :]
        token_w = tl.sum(tl.load(weights_ptr + flat, mask=match, other=0.0).to(tl.float32), axis=1)
        rows = w2_ptr + slot.to(tl.int64) * stride_ws + n_idx[:, None].to(tl.int64) * stride_wn
        row_s = s2_ptr + slot.to(tl.int64) * stride_ss + n_idx.to(tl.int64) * stride_sn
        at_base = (act_ptr + t_idx * stride_at + first_k * stride_ak)[None, :]
        c_idx = tl.arange(0, SCALE_BLOCK)
        blocks = inter // SCALE_BLOCK
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for step in range(0, blocks, STEP_BLOCKS):
            for b in tl.static_range(STEP_BLOCKS):
                cols = (step + b) * SCALE_BLOCK + c_idx
                at_mask = (cols < inter)[:, None] & has[None, :]
                at = tl.load(at_base + cols[:, None], mask=at_mask, other=0.0).to(COMPUTE)
                acc = block_dot(
                    acc, rows, row_s, n_ok, step + b, blocks, at, SCALE_BLOCK, COMPUTE, NVFP4
                )
        y = acc * 16384.0  # the 2^-14 of `halves` given back
        if NVFP4:
            y *= tl.load(t2_ptr + slot)
        if BIAS:
            bias_row = b2_ptr + slot.to(tl.int64) * stride_bs
            y += tl.load(bias_row + n_idx, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y_ptrs = (y_ptr + t_idx * stride_yt + first_k * stride_yk)[None, :] + n_idx[:, None]
        tl.store(y_ptrs, y * token_w[None, :], mask=n_ok[:, None] & has[None, :])
    fused_moe.zero_unled_route(
        y_ptr, route, slot, t_idx, first_k, n_idx, n_ok, stride_yt, stride_yk, TOP_K, BLOCK_N,
        BLOCK_R,
    )  # fmt: skip


def fused_moe_decode_mxfp4(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    config: DecodeConfig | None = None,
    reduce: bool = True,
    few_routes: bool = False,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Decode MoE over MXFP4 slots: fp32 [T, H], two launches over (route, row block) plus the
    sum over each token's routes (slot -1: no route). config picks the launches: a
    OneTokenFP4Config fp4_one_token's (T must be 1), a DotDecodeConfig the tl.dot ones (any T:
    a slot named by several tokens is read once, by its first route, which widens each block
    of its rows in registers and multiplies them by those tokens' activations in tl.dot, the
    tokens padded to 16; in x's dtype, fp32 exactly); None the one-token launches with
    `fp4_one_token.choose_config`'s tiles at T=1 (for few live routes if `few_routes`: the
    routes a layer step's fills serve), else the tl.dot ones with the default tiles.
    gpt-oss's experts pass their biases (fp32, added to the sums) and the clamped SwiGLU's
    limit. reduce=False: [T, K, H] whose sum over K is that result; how a slot named twice by
    one token splits between its routes depends on the launches (one token: each route holds
    its own weighted output; tl.dot: the token's output at its first route, zeros at the
    other), so a consumer may rely on the sum over K only."""
    _, hidden, inter = _check(x, slot_ids, route_weights, w13, w2, w13_scale, w2_scale, "slot_ids")
    return launch_decode(
        x, slot_ids, route_weights, (w13, w13_scale, None), (w2, w2_scale, None), hidden, inter,
        config=config, reduce=reduce, few_routes=few_routes, w13_bias=w13_bias, w2_bias=w2_bias,
        swiglu_limit=swiglu_limit,
    )  # fmt: skip


# a projection of a 4-bit bank as the launches take it: its bytes, its block scales (uint8 codes)
# and, for NVFP4, its per-tensor scales (fp32 [S, 2] for w13's gate and up, [S, 1] for w2)
Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def launch_decode(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: Packed,
    w2: Packed,
    hidden: int,
    inter: int,
    *,
    config: DecodeConfig | None,
    reduce: bool,
    few_routes: bool,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    swiglu_limit: float,
) -> torch.Tensor:
    """The decode launches over a checked MXFP4 or NVFP4 bank (NVFP4 where w13 brings its
    per-tensor scales): fused_moe_decode_mxfp4's result."""
    biased = swiglu.check_biases(w13[0], w2[0], w13_bias, w2_bias)
    num_tokens, top_k = slot_ids.shape
    if config is None and num_tokens == 1:
        sms = common.sm_count(x.device)
        config = fp4_one_token.choose_config(top_k, hidden, inter, sms, few_routes)
    if isinstance(config, OneTokenFP4Config) and num_tokens != 1:
        raise ValueError(
            f"a OneTokenFP4Config is for one token, got {num_tokens}: pass a DotDecodeConfig "
            "or no config"
        )
    slot_ids = slot_ids.contiguous()
    route_weights = route_weights.contiguous()
    x = x.contiguous()
    one_token = isinstance(config, OneTokenFP4Config)
    # the one-token launches keep act in fp32: its down launch multiplies in fp32 without
    # widening each activation in each thread that reads it
    act_dtype = torch.float32 if one_token else x.dtype
    act = common.alloc((num_tokens, top_k, inter), act_dtype, x.device)
    y = common.alloc((num_tokens, top_k, hidden), torch.float32, x.device)
    biases = (w13_bias, w2_bias) if biased else None
    if one_token:
        fp4_one_token.launch(
            x, slot_ids, route_weights, w13, w2, act, y, biases, float(swiglu_limit), config
        )
    else:
        _dot_launches(
            x, slot_ids, route_weights, w13, w2, act, y, biases, float(swiglu_limit),
            config or DotDecodeConfig(),
        )  # fmt: skip
    return y.sum(dim=1) if reduce else y


def _dot_launches(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: Packed,
    w2: Packed,
    act: torch.Tensor,
    y: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
    limit: float,
    cfg: DotDecodeConfig,
) -> None:
    """The tl.dot launches, fused_moe.MAX_TOKENS_PER_LAUNCH tokens at a time: act [T, K, I] from
    x, then y [T, K, H] from act."""
    (w13, s13, t13), (w2, s2, t2) = w13, w2
    nvfp4 = t13 is not None
    # without biases (or per-tensor scales) the weights stand in for them, never read
    b13, b2 = biases if biases is not None else (w13, w2)
    t13, t2 = (t13, t2) if nvfp4 else (w13, w2)
    scale_block = NVFP4_BLOCK if nvfp4 else mxfp4.BLOCK
    num_tokens, top_k = slot_ids.shape
    hidden, inter = x.shape[1], act.shape[2]
    # the kernels read the bytes four at a time (`halves`)
    words13, words2 = w13.view(torch.int32), w2.view(torch.int32)
    tiles = {
        "BLOCK_N": cfg.block_n,
        "SCALE_BLOCK": scale_block,
        "COMPUTE": common.tl_dtype(x.dtype),
        "BIAS": biases is not None,
        "NVFP4": nvfp4,
        "num_warps": cfg.block_n // 16,  # 16 rows a warp: no two warps widen the same weights
        "num_stages": cfg.num_stages,
    }
    block_r = common.next_pow2(top_k)
    for t0 in range(0, num_tokens, fused_moe.MAX_TOKENS_PER_LAUNCH):
        t1 = min(t0 + fused_moe.MAX_TOKENS_PER_LAUNCH, num_tokens)
        chunk, slots = t1 - t0, slot_ids[t0:t1]
        block_t = common.next_pow2(chunk, 16)
        _decode_gate_up_kernel[(chunk * top_k, triton.cdiv(inter, cfg.block_n))](
            x[t0:t1], slots, words13, s13, t13, b13, act[t0:t1], chunk, hidden, inter, limit,
            x.stride(0), words13.stride(0), words13.stride(1), s13.stride(0), s13.stride(1),
            b13.stride(0), act.stride(0), act.stride(1), TOP_K=top_k, BLOCK_T=block_t,
            BLOCK_R=block_r, STEP_BLOCKS=min(cfg.block_k, common.next_pow2(hidden)) // scale_block,
            CLAMPED=bool(limit), **tiles,
        )  # fmt: skip
        _decode_down_kernel[(chunk * top_k, triton.cdiv(hidden, cfg.block_n))](
            act[t0:t1], slots, route_weights[t0:t1], words2, s2, t2, b2, y[t0:t1], chunk,
            hidden, inter, act.stride(0), act.stride(1), words2.stride(0), words2.stride(1),
            s2.stride(0), s2.stride(1), b2.stride(0), y.stride(0), y.stride(1), TOP_K=top_k,
            BLOCK_T=block_t, BLOCK_R=block_r,
            STEP_BLOCKS=min(cfg.block_k, common.next_pow2(inter)) // scale_block, **tiles,
        )  # fmt: skip


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, routes_ptr, block_expert_ptr, w13_ptr, s13_ptr, t13_ptr, b13_ptr, act_ptr, hidden,
    inter, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ar, limit,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
    COMPUTE: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr, NVFP4: tl.constexpr,
):  # fmt: skip
    """grouped_moe's gate/up launch over MXFP4 (or NVFP4) weights: a block of one expert's routes
    times a block of its gate and up rows, the even and odd columns in two tl.dots a step."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the routes' blocks
        return
    routes = tl.load(routes_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    r_ok = routes >= 0
    x_rows = x_ptr + (routes // TOP_K)[:, None] * stride_xt
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (n_idx < inter)[None, :]
    gate = w13_ptr + expert * stride_we + n_idx[None, :].to(tl.int64) * stride_wn
    up = gate + inter * stride_wn
    gate_s = s13_ptr + expert * stride_se + n_idx[None, :].to(tl.int64) * stride_sn
    up_s = gate_s + inter * stride_sn
    j_idx = tl.arange(0, BLOCK_J)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, 2 * BLOCK_J):
        cols = k0 + 2 * j_idx
        k_ok = cols < hidden
        x_mask = r_ok[:, None] & k_ok[None, :]
        x_even = tl.load(x_rows + cols[None, :], mask=x_mask, other=0.0).to(COMPUTE)
        x_odd = tl.load(x_rows + cols[None, :] + 1, mask=x_mask, other=0.0).to(COMPUTE)
        w_mask = k_ok[:, None] & n_ok
        at = (k0 // 2 + j_idx)[:, None]
        block = block_of(cols, NVFP4)[:, None]
        g_even, g_odd = widened(gate + at, gate_s + block, w_mask, NVFP4)
        u_even, u_odd = widened(up + at, up_s + block, w_mask, NVFP4)
        # "ieee": an fp32 compute dtype multiplies exactly, not in TF32; bf16/fp16 ignore it.
        acc_gate += tl.dot(x_even, g_even.to(COMPUTE), input_precision="ieee")
        acc_gate += tl.dot(x_odd, g_odd.to(COMPUTE), input_precision="ieee")
        acc_up += tl.dot(x_even, u_even.to(COMPUTE), input_precision="ieee")
        acc_up += tl.dot(x_odd, u_odd.to(COMPUTE), input_precision="ieee")
    if NVFP4:
        acc_gate *= tl.load(t13_ptr + 2 * expert)
        acc_up *= tl.load(t13_ptr + 2 * expert + 1)
    if BIAS:
        bias = b13_ptr + expert * stride_be + n_idx
        acc_gate += tl.load(bias, mask=n_idx < inter, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias + inter, mask=n_idx < inter, other=0.0).to(tl.float32)[None, :]
    act = swiglu.activate_tl(acc_gate, acc_up, limit, CLAMPED)
    act_ptrs = act_ptr + routes[:, None] * stride_ar + n_idx[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok)


@triton.jit
def _grouped_down_kernel(
    act_ptr, routes_ptr, block_expert_ptr, weights_ptr, w2_ptr, s2_ptr, t2_ptr, b2_ptr, y_ptr,
    hidden, inter, stride_ar, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_yr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, COMPUTE: tl.constexpr,
    BIAS: tl.constexpr, NVFP4: tl.constexpr,
):  # fmt: skip
    """grouped_moe's down launch over MXFP4 (or NVFP4) weights, each route's output times its
    weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the routes' blocks
        return
    routes = tl.load(routes_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    r_ok = routes >= 0
    route_w = tl.load(weights_ptr + routes, mask=r_ok, other=0.0).to(tl.float32)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (n_idx < hidden)[None, :]
    rows = w2_ptr + expert * stride_we + n_idx[None, :].to(tl.int64) * stride_wn
    row_s = s2_ptr + expert * stride_se + n_idx[None, :].to(tl.int64) * stride_sn
    a_rows = act_ptr + routes[:, None] * stride_ar
    j_idx = tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, 2 * BLOCK_J):
        cols = k0 + 2 * j_idx
        k_ok = cols < inter
        a_mask = r_ok[:, None] & k_ok[None, :]
        a_even = tl.load(a_rows + cols[None, :], mask=a_mask, other=0.0).to(COMPUTE)
        a_odd = tl.load(a_rows + cols[None, :] + 1, mask=a_mask, other=0.0).to(COMPUTE)
        w_even, w_odd = widened(
            rows + (k0 // 2 + j_idx)[:, None],
            row_s + block_of(cols, NVFP4)[:, None],
            k_ok[:, None] & n_ok,
            NVFP4,
        )
        acc += tl.dot(a_even, w_even.to(COMPUTE), input_precision="ieee")
        acc += tl.dot(a_odd, w_odd.to(COMPUTE), input_precision="ieee")
    if NVFP4:
        acc *= tl.load(t2_ptr + expert)
    if BIAS:
        bias = b2_ptr + expert * stride_be + n_idx
        acc += tl.load(bias, mask=n_idx < hidden, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + routes[:, None] * stride_yr + n_idx[None, :]
    tl.store(y_ptrs, acc * route_w[:, None], mask=r_ok[:, None] & n_ok)


def grouped_moe_mxfp4(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
    config: GroupedMoEConfig | None = None,
    layer_experts: int | None = None,
    checked: bool = True,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Prefill MoE over one layer's MXFP4 experts: fp32 [T, H], grouped_moe_triton's routes
    grouped by expert and its tiles, the weights widened in registers (scaled, then in the
    compute dtype: exact in bf16 and fp32) into tl.dot. layer_experts and checked: as
    grouped_moe_triton takes them; gpt-oss's biases and SwiGLU limit as the decode's."""
    num_experts, hidden, inter = _check(
        x, expert_ids, route_weights, w13, w2, w13_scale, w2_scale, "expert_ids"
    )
    return launch_grouped(
        x, expert_ids, route_weights, (w13, w13_scale, None), (w2, w2_scale, None),
        num_experts, hidden, inter, compute_dtype=compute_dtype, config=config,
        layer_experts=layer_experts, checked=checked, w13_bias=w13_bias, w2_bias=w2_bias,
        swiglu_limit=swiglu_limit,
    )  # fmt: skip


def launch_grouped(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: Packed,
    w2: Packed,
    num_experts: int,
    hidden: int,
    inter: int,
    *,
    compute_dtype: torch.dtype | None,
    config: GroupedMoEConfig | None,
    layer_experts: int | None,
    checked: bool,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    swiglu_limit: float,
) -> torch.Tensor:
    """The prefill launches over a checked MXFP4 or NVFP4 bank (NVFP4 where w13 brings its
    per-tensor scales): grouped_moe_mxfp4's result."""
    (w13, s13, t13), (w2, s2, t2) = w13, w2
    nvfp4 = t13 is not None
    biased = swiglu.check_biases(w13, w2, w13_bias, w2_bias)
    b13, b2 = (w13_bias, w2_bias) if biased else (w13, w2)
    t13, t2 = (t13, t2) if nvfp4 else (w13, w2)
    num_tokens = x.shape[0]
    top_k = expert_ids.shape[1]
    if checked:
        _check_expert_range(expert_ids, num_experts)
    compute = common.tl_dtype(compute_dtype or x.dtype)
    num_routes = num_tokens * top_k
    distinct = min(layer_experts or num_experts, num_experts)
    cfg = config or config_for(num_routes / max(min(distinct, num_routes), 1))
    grouped = _group_routes(expert_ids, num_experts, cfg, distinct)
    act = common.alloc((num_routes, inter), compute_dtype or x.dtype, x.device)
    y = common.alloc((num_routes, hidden), torch.float32, x.device)
    # a step of 2 * BLOCK_J columns: BLOCK_J >= 16 for tl.dot, so steps of whole 32-blocks
    gate_up_j = max(16, min(cfg.block_k, common.next_pow2(hidden)) // 2)
    down_j = max(16, min(cfg.block_k, common.next_pow2(inter)) // 2)
    if grouped.num_blocks:
        _grouped_gate_up_kernel[(grouped.num_blocks, triton.cdiv(inter, cfg.gate_up_block_n))](
            x, grouped.routes, grouped.block_expert, w13, s13, t13, b13, act, hidden, inter,
            x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
            b13.stride(0), act.stride(0), float(swiglu_limit), TOP_K=top_k, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.gate_up_block_n, BLOCK_J=gate_up_j, COMPUTE=compute, BIAS=biased,
            CLAMPED=bool(swiglu_limit), NVFP4=nvfp4, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        _grouped_down_kernel[(grouped.num_blocks, triton.cdiv(hidden, cfg.down_block_n))](
            act, grouped.routes, grouped.block_expert, route_weights.contiguous(), w2, s2, t2,
            b2, y, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
            s2.stride(1), b2.stride(0), y.stride(0), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.down_block_n, BLOCK_J=down_j, COMPUTE=compute, BIAS=biased, NVFP4=nvfp4,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    y.masked_fill_(grouped.skipped[:, None], 0.0)  # no block wrote the skipped routes' rows
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
