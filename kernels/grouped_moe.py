"""Prefill MoE over one layer's experts: routes grouped by expert, two tiled-GEMM launches.

Routes (token, k) are grouped by expert and padded to whole row blocks, so that each program of a
launch multiplies one block of routes of one expert by one column block of its weights with tl.dot.
The grouping runs on the device without the host waiting for it: the grid is the most row blocks
the routes can need, and the programs past the real blocks return at once. (A prefill is host-bound
at a few thousand tokens: a sync a layer would add the device's time to the host's.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import common, fp8, fp8_moe, swiglu
from .common import tl, triton


@dataclass(frozen=True, slots=True)
class GroupedMoEConfig:
    """Tile sizes of the two prefill launches: routes per block, output columns, reduction step."""

    block_m: int
    gate_up_block_n: int
    down_block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "gate_up_block_n", "down_block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {value}")


# Row-block sizes config_for picks from.
BLOCK_M_CHOICES = (16, 32, 64, 128)


def config_for(routes_per_expert: float) -> GroupedMoEConfig:
    """Tiles for an average number of routes per expert: small blocks waste less padding."""
    if routes_per_expert <= 16:
        return GroupedMoEConfig(16, 64, 64, 128, num_warps=4, num_stages=4)
    if routes_per_expert <= 32:
        return GroupedMoEConfig(32, 64, 64, 128, num_warps=4, num_stages=4)
    if routes_per_expert <= 96:
        return GroupedMoEConfig(64, 64, 128, 64, num_warps=4, num_stages=4)
    return GroupedMoEConfig(128, 64, 128, 64, num_warps=8, num_stages=3)


def grouped_moe_ref(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Reference: for each expert, its routed tokens through gate/up, SiLU·up and down, weighted
    (an FP8 bank dequantized to fp32 expert by expert; gpt-oss's biases and clamped SwiGLU:
    kernels/swiglu.py)."""
    fp8_bank = _check(x, expert_ids, route_weights, w13, w2, w13_scale_inv, w2_scale_inv)
    biased = swiglu.check_biases(w13, w2, w13_bias, w2_bias)
    dtype = compute_dtype or x.dtype
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

    def weight(w: torch.Tensor, scale_inv: torch.Tensor | None, expert: int) -> torch.Tensor:
        return fp8_moe.dequantized(w[expert], scale_inv[expert] if fp8_bank else None).to(dtype)

    for expert in expert_ids.unique().tolist():
        if expert < 0:
            continue
        tokens, ks = (expert_ids == expert).nonzero(as_tuple=True)
        gate_up = x[tokens].to(dtype) @ weight(w13, w13_scale_inv, expert).t()
        if biased:
            gate_up = gate_up + w13_bias[expert].to(dtype)
        act = swiglu.activate(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
        y = act @ weight(w2, w2_scale_inv, expert).t()
        if biased:
            y = y + w2_bias[expert].to(dtype)
        y = y.float()
        out.index_add_(0, tokens, y * route_weights[tokens, ks].float()[:, None])
    return out


@triton.jit
def _gate_up_kernel(
    x_ptr,
    routes_ptr,
    block_expert_ptr,
    w13_ptr,
    s13_ptr,
    b13_ptr,
    act_ptr,
    hidden,
    inter,
    limit,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_ar,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    FP8: tl.constexpr,
    BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the routes' blocks
        return
    routes = tl.load(routes_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    r_ok = routes >= 0
    tokens = routes // TOP_K
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < inter
    gate_base = w13_ptr + expert * stride_we + n_idx[None, :].to(tl.int64) * stride_wn
    up_base = gate_base + inter * stride_wn
    x_base = x_ptr + tokens[:, None] * stride_xt
    # FP8: the factors of the step's 128-column block (BLOCK_K <= 128), one per row
    gate_factors = s13_ptr + expert * stride_se + (n_idx // 128) * stride_sn
    up_factors = s13_ptr + expert * stride_se + ((inter + n_idx) // 128) * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_idx < hidden
        xs = tl.load(x_base + k_idx[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.load(gate_base + k_idx[:, None], mask=w_mask, other=0.0)
        up = tl.load(up_base + k_idx[:, None], mask=w_mask, other=0.0)
        xs = xs.to(COMPUTE)
        if FP8:  # exact e4m3 values into the dot, the block's factor on its fp32 result
            gate_f = tl.load(gate_factors + k0 // 128, mask=n_ok, other=0.0)
            up_f = tl.load(up_factors + k0 // 128, mask=n_ok, other=0.0)
            gate = fp8_moe.values(gate).to(COMPUTE)
            up = fp8_moe.values(up).to(COMPUTE)
            acc_gate += tl.dot(xs, gate, input_precision="ieee") * gate_f[None, :]
            acc_up += tl.dot(xs, up, input_precision="ieee") * up_f[None, :]
        else:
            # "ieee": an fp32 compute dtype multiplies exactly, not in TF32; bf16/fp16 ignore it.
            acc_gate += tl.dot(xs, gate.to(COMPUTE), input_precision="ieee")
            acc_up += tl.dot(xs, up.to(COMPUTE), input_precision="ieee")
    if BIAS:
        biases = b13_ptr + expert * stride_be
        acc_gate += tl.load(biases + n_idx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(biases + inter + n_idx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    act = swiglu.activate_tl(acc_gate, acc_up, limit, CLAMPED)
    act_ptrs = act_ptr + routes[:, None] * stride_ar + n_idx[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    routes_ptr,
    block_expert_ptr,
    weights_ptr,
    w2_ptr,
    s2_ptr,
    b2_ptr,
    y_ptr,
    hidden,
    inter,
    stride_ar,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_yr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    FP8: tl.constexpr,
    BIAS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the routes' blocks
        return
    routes = tl.load(routes_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    r_ok = routes >= 0
    route_w = tl.load(weights_ptr + routes, mask=r_ok, other=0.0).to(tl.float32)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < hidden
    w_base = w2_ptr + expert * stride_we + n_idx[None, :].to(tl.int64) * stride_wn
    a_base = act_ptr + routes[:, None] * stride_ar
    row_factors = s2_ptr + expert * stride_se + (n_idx // 128) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_idx < inter
        a = tl.load(a_base + k_idx[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + k_idx[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:  # as in _gate_up_kernel
            f = tl.load(row_factors + k0 // 128, mask=n_ok, other=0.0)
            w = fp8_moe.values(w).to(COMPUTE)
            acc += tl.dot(a.to(COMPUTE), w, input_precision="ieee") * f[None, :]
        else:
            acc += tl.dot(a.to(COMPUTE), w.to(COMPUTE), input_precision="ieee")
    if BIAS:
        biases = b2_ptr + expert * stride_be
        acc += tl.load(biases + n_idx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + routes[:, None] * stride_yr + n_idx[None, :]
    tl.store(y_ptrs, acc * route_w[:, None], mask=r_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True, slots=True)
class _RouteBlocks:
    """Routes grouped by expert and padded to whole blocks: what the two GEMM launches iterate
    over."""

    routes: torch.Tensor  # int32 [num_blocks * block_m] flat route index t*K+k, -1 for padding
    block_expert: torch.Tensor  # int32 [num_blocks] the expert of each block, -1 past the last
    skipped: torch.Tensor  # [T*K] True for the routes with expert id -1
    num_blocks: int  # the grid: the most blocks the routes can need


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_routes, BLOCK_R: tl.constexpr):
    """Routes per expert: counts [E] (zeroed) += 1 for each kept route."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    expert = tl.load(ids_ptr + r, mask=r < num_routes, other=-1)
    tl.atomic_add(counts_ptr + expert, 1, mask=expert >= 0)


@triton.jit
def _blocks_kernel(
    counts_ptr,
    block_expert_ptr,
    routes_ptr,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program: each expert's run of row blocks, its first row into counts (the scatter's
    cursor), the expert of every block of the grid (-1 past the last run), every row -1."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    counts = tl.load(counts_ptr + e, mask=e_ok, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    tl.store(counts_ptr + e, (block_end - blocks) * BLOCK_M, mask=e_ok)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        # a block's expert: how many runs end at or before it
        ended = (block_end[None, :] <= b[:, None]) & e_ok[None, :]
        expert = tl.sum(ended.to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_expert_ptr + b, expert, mask=b < num_blocks)
    rows = num_blocks * BLOCK_M
    for r0 in range(0, rows, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(routes_ptr + r, tl.full((FILL,), -1, tl.int32), mask=r < rows)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, routes_ptr, num_routes, BLOCK_R: tl.constexpr):
    """Each kept route into the next free row of its expert's run (the order within a run is
    the atomics'; each row's result does not depend on it)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    expert = tl.load(ids_ptr + r, mask=r < num_routes, other=-1)
    kept = expert >= 0
    row = tl.atomic_add(cursor_ptr + expert, 1, mask=kept)
    tl.store(routes_ptr + row, r, mask=kept)


_BLOCK_R = 1024  # routes per program of the count and the scatter


def _group_routes(
    expert_ids: torch.Tensor, num_experts: int, config: GroupedMoEConfig, distinct: int
) -> _RouteBlocks:
    """Group routes by expert and pad each expert's run to whole row blocks: three small launches,
    nothing the host waits for.

    distinct: the most different experts the routes can name. Each expert's run wastes less than a
    block, so T*K/block_m + distinct blocks hold them all; the blocks past the last run get -1.
    """
    device = expert_ids.device
    block_m = config.block_m
    flat = expert_ids.reshape(-1)
    num_routes = flat.numel()
    num_blocks = -(-num_routes // block_m) + min(distinct, num_experts, num_routes)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    routes = common.alloc((num_blocks * block_m,), torch.int32, device)
    block_expert = common.alloc((num_blocks,), torch.int32, device)
    route_programs = (triton.cdiv(num_routes, _BLOCK_R),)
    if num_routes:
        _count_kernel[route_programs](flat, counts, num_routes, BLOCK_R=_BLOCK_R)
    if num_blocks:
        block_e = common.next_pow2(num_experts)
        _blocks_kernel[(1,)](
            counts, block_expert, routes, num_experts, num_blocks, BLOCK_M=block_m,
            BLOCK_E=block_e, BLOCK_B=max(2, min(32, 8192 // block_e)), FILL=4096,
        )  # fmt: skip
        _scatter_kernel[route_programs](flat, counts, routes, num_routes, BLOCK_R=_BLOCK_R)
    return _RouteBlocks(routes, block_expert, flat < 0, num_blocks)


def _check_expert_range(expert_ids: torch.Tensor, num_experts: int) -> None:
    """Refuse expert ids beyond w13's experts (a host sync)."""
    if expert_ids.numel() and int(expert_ids.max()) >= num_experts:
        raise ValueError(f"expert_ids name an expert >= {num_experts}, the experts in w13")


def grouped_moe_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    config: GroupedMoEConfig | None = None,
    layer_experts: int | None = None,
    checked: bool = True,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Triton prefill MoE: fp32 [T, H].

    w13/w2: bf16/fp16/fp32, or FP8 (float8_e4m3fn or its uint8 bits) with their block factors
    w13_scale_inv/w2_scale_inv (fp8_moe: the layout), widened in registers; an FP8 bank's
    reduction steps are at most 128 wide. layer_experts: the experts of one layer, the most
    different ids the routes can hold (w13 may be the whole expert cache, most of whose slots one
    layer's routes cannot name); the tiles follow the routes per expert this gives, unless
    `config` names them. checked: refuse ids beyond w13 first, which waits for the device; the
    engine's own routes need no check and pass False, so that nothing in a prefill's layer waits
    for the device. gpt-oss's experts: their biases, added to the fp32 sums, and the clamped
    SwiGLU (kernels/swiglu.py).
    """
    fp8_bank = _check(x, expert_ids, route_weights, w13, w2, w13_scale_inv, w2_scale_inv)
    biased = swiglu.check_biases(w13, w2, w13_bias, w2_bias)
    num_tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    num_experts = w13.shape[0]
    if checked:
        _check_expert_range(expert_ids, num_experts)
    inter = w13.shape[1] // 2
    compute = common.tl_dtype(compute_dtype or x.dtype)
    num_routes = num_tokens * top_k
    distinct = min(layer_experts or num_experts, num_experts)
    cfg = config or config_for(num_routes / max(min(distinct, num_routes), 1))
    grouped = _group_routes(expert_ids, num_experts, cfg, distinct)
    act = common.alloc((num_routes, inter), compute_dtype or x.dtype, x.device)
    y = common.alloc((num_routes, hidden), torch.float32, x.device)
    if fp8_bank:
        w13, w2 = fp8_moe.bits(w13), fp8_moe.bits(w2)
    gate_up_k = min(cfg.block_k, common.next_pow2(hidden, 16))
    down_k = min(cfg.block_k, common.next_pow2(inter, 16))
    if fp8_bank:  # one factor per row in each reduction step
        gate_up_k, down_k = min(gate_up_k, fp8.BLOCK), min(down_k, fp8.BLOCK)
    # (a bf16 bank passes its weights as the factors, never read)
    s13, s2 = (w13_scale_inv, w2_scale_inv) if fp8_bank else (w13, w2)
    b13, b2 = (w13_bias, w2_bias) if biased else (w13, w2)  # likewise
    if grouped.num_blocks:
        _gate_up_kernel[(grouped.num_blocks, triton.cdiv(inter, cfg.gate_up_block_n))](
            x,
            grouped.routes,
            grouped.block_expert,
            w13,
            s13,
            b13,
            act,
            hidden,
            inter,
            float(swiglu_limit),
            x.stride(0),
            w13.stride(0),
            w13.stride(1),
            s13.stride(0),
            s13.stride(1),
            b13.stride(0),
            act.stride(0),
            TOP_K=top_k,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.gate_up_block_n,
            BLOCK_K=gate_up_k,
            COMPUTE=compute,
            FP8=fp8_bank,
            BIAS=biased,
            CLAMPED=swiglu_limit > 0,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        _down_kernel[(grouped.num_blocks, triton.cdiv(hidden, cfg.down_block_n))](
            act,
            grouped.routes,
            grouped.block_expert,
            route_weights.contiguous(),
            w2,
            s2,
            b2,
            y,
            hidden,
            inter,
            act.stride(0),
            w2.stride(0),
            w2.stride(1),
            s2.stride(0),
            s2.stride(1),
            b2.stride(0),
            y.stride(0),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.down_block_n,
            BLOCK_K=down_k,
            COMPUTE=compute,
            FP8=fp8_bank,
            BIAS=biased,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    y.masked_fill_(grouped.skipped[:, None], 0.0)  # no block wrote the skipped routes' rows
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def grouped_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    layer_experts: int | None = None,
    checked: bool = True,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Prefill MoE over one layer's experts: the Triton kernels on CUDA, the reference elsewhere
    (an FP8 bank's factors, layer_experts and checked: see grouped_moe_triton; gpt-oss's biases
    and clamped SwiGLU: kernels/swiglu.py)."""
    scales = {
        "w13_scale_inv": w13_scale_inv,
        "w2_scale_inv": w2_scale_inv,
        "w13_bias": w13_bias,
        "w2_bias": w2_bias,
        "swiglu_limit": swiglu_limit,
    }
    if x.is_cuda:
        return grouped_moe_triton(
            x, expert_ids, route_weights, w13, w2, compute_dtype=compute_dtype,
            layer_experts=layer_experts, checked=checked, **scales,
        )  # fmt: skip
    return grouped_moe_ref(
        x, expert_ids, route_weights, w13, w2, compute_dtype=compute_dtype, **scales
    )


def _check(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2_scale_inv: torch.Tensor | None,
) -> bool:
    """Validate the arguments (no device sync); whether the bank is FP8."""
    common.check_routes(x, expert_ids, route_weights, w13, w2, ids_name="expert_ids")
    return fp8_moe.check_bank(w13, w2, w13_scale_inv, w2_scale_inv)
