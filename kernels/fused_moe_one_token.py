"""Decode MoE for one token (the batch-1 decode step): the two launches fused_moe takes at T=1.

`fused_moe.fused_moe_decode_triton` checks the arguments, allocates the buffers and picks this
path; `launch` fills them. Each program reads a few weight rows of its route's expert along their
contiguous axis, multiplies by the broadcast input and sums once after the loop, as gemv's
one-token kernel does; no tl.dot, so blocks of a few rows spread the 8 routes over several
programs per SM (`choose_one_token_config`). Each route computes its own product, so a slot named
twice by the token is read twice (the router never names one twice).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from . import common, fp8_moe, gemv, swiglu
from .common import tl, triton


@dataclass(frozen=True, slots=True)
class OneTokenMoEConfig:
    """Tiles of the one-token launches: weight rows and reduction step per program of each,
    warps, and how many reduction steps of weight loads are in flight at once (1: none).
    loop_routes: one program per row block, looping over the routes (for launches where few
    routes are live, as after a layer step's fills), instead of one per route and row block."""

    gate_up_block_n: int = 8
    gate_up_block_k: int = 256
    down_block_n: int = 16
    down_block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    loop_routes: bool = False

    def __post_init__(self) -> None:
        check_tiles(self, least_step=16)


def check_tiles(config: Any, least_step: int) -> None:
    """Raise a clear error unless a one-token config's rows, steps and warps are powers of two
    (its steps at least `least_step` columns) and it has a stage at least."""
    for name, least in (
        ("gate_up_block_n", 1),
        ("gate_up_block_k", least_step),
        ("down_block_n", 1),
        ("down_block_k", least_step),
        ("num_warps", 1),
    ):
        value = getattr(config, name)
        if value < least or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
    if config.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {config.num_stages}")


@functools.lru_cache(maxsize=32)
def choose_one_token_config(
    top_k: int, hidden: int, inter: int, sms: int, few_routes: bool = False, fp8: bool = False
) -> OneTokenMoEConfig:
    """One-token tiles for a geometry on a device with `sms` SMs, by gemv's rule for one token.

    Each launch takes the widest block of up to 16 rows whose grid (routes x row blocks) still
    gives gemv.ROW_PROGRAMS_PER_SM programs per SM, and a reduction step that keeps each step's
    weight loads at gemv.ROW_TILE_ELEMENTS (gate/up loads two tiles a step: gate and up rows).
    Qwen3-30B-A3B (H=2048, I=768, 8 routes) on 132 SMs: gate/up 8 rows by 256 (768 programs),
    down 16 rows by 256 (1024 programs).

    few_routes: for a launch where one or two routes are live (the routes a layer step's fills
    serve): the rule for one route, whose row blocks then loop over the routes (`loop_routes`),
    so that one live route's rows spread over the whole device: there, gate/up 1 row by 2048
    (768 programs), down 2 rows by 1024, all of I (1024 programs).

    fp8: an FP8 bank's route grid takes twice the rows in each launch (Qwen3-30B-A3B on 132
    SMs: gate/up 16 by 256, down 32 by 256), with steps by the same rule: on a GPU 18.6 us
    against 25.6 at bf16's tiles (docs/kernels.md).
    """
    routes = 1 if few_routes else top_k

    def rows_per_program(rows: int) -> int:
        block_n = 16
        while block_n > 1 and routes * triton.cdiv(rows, block_n) < gemv.ROW_PROGRAMS_PER_SM * sms:
            block_n //= 2
        return block_n

    widen = 2 if fp8 and not few_routes else 1
    gate_up_n = widen * rows_per_program(inter)
    down_n = widen * rows_per_program(hidden)
    return OneTokenMoEConfig(
        gate_up_block_n=gate_up_n,
        gate_up_block_k=max(256, gemv.ROW_TILE_ELEMENTS // (2 * gate_up_n)),
        down_block_n=down_n,
        down_block_k=max(256, gemv.ROW_TILE_ELEMENTS // down_n),
        loop_routes=few_routes,
    )


@triton.jit
def _gate_up_rows(
    x_ptr, slot, w13_ptr, s13_ptr, b13_ptr, act_ptr, hidden, inter, limit, stride_ws, stride_wn,
    stride_ss, stride_sn, stride_bs, n_idx, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr, STAGES: tl.constexpr, FP8: tl.constexpr, BIAS: tl.constexpr,
    CLAMPED: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """act rows n_idx (a route's act row at act_ptr) of the expert in `slot` (>= 0); with BIAS
    and CLAMPED, gpt-oss's biases and clamped SwiGLU (kernels/swiglu.py)."""
    if FP8:
        gate_row, up_row = _gate_up_sums_fp8(
            x_ptr, slot, w13_ptr, s13_ptr, hidden, inter, stride_ws, stride_wn, stride_ss,
            stride_sn, n_idx, BLOCK_N, BLOCK_K, COMPUTE, STAGES, PTX, EVEN,
        )  # fmt: skip
    else:
        gate_row, up_row = _gate_up_sums(
            x_ptr, slot, w13_ptr, hidden, inter, stride_ws, stride_wn, n_idx, BLOCK_N, BLOCK_K,
            COMPUTE, STAGES,
        )  # fmt: skip
    if BIAS:
        biases = b13_ptr + slot.to(tl.int64) * stride_bs
        gate_row += tl.load(biases + n_idx, mask=n_idx < inter, other=0.0).to(tl.float32)
        up_row += tl.load(biases + inter + n_idx, mask=n_idx < inter, other=0.0).to(tl.float32)
    act = swiglu.activate_tl(gate_row, up_row, limit, CLAMPED)
    tl.store(act_ptr + n_idx, act.to(act_ptr.dtype.element_ty), mask=n_idx < inter)


@triton.jit
def _gate_up_sums(
    x_ptr, slot, w13_ptr, hidden, inter, stride_ws, stride_wn, n_idx,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_N] gate and up rows n_idx of the expert in `slot` times x."""
    n_ok = n_idx < inter
    expert = w13_ptr + slot.to(tl.int64) * stride_ws
    gate_rows = expert + n_idx[:, None].to(tl.int64) * stride_wn
    up_rows = expert + (inter + n_idx[:, None]).to(tl.int64) * stride_wn
    # Products add up elementwise and are summed across K once, after the loop.
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # num_stages on the loop itself: the launch's num_stages pipelines only loads that feed tl.dot.
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_idx < hidden
        w_ok = n_ok[:, None] & k_ok[None, :]
        xs = tl.load(x_ptr + k_idx, mask=k_ok, other=0.0)
        gate = tl.load(gate_rows + k_idx[None, :], mask=w_ok, other=0.0)
        up = tl.load(up_rows + k_idx[None, :], mask=w_ok, other=0.0)
        # Operands rounded to the compute dtype, multiplied and added in fp32, as tl.dot does.
        xs = xs.to(COMPUTE).to(tl.float32)[None, :]
        acc_gate += gate.to(COMPUTE).to(tl.float32) * xs
        acc_up += up.to(COMPUTE).to(tl.float32) * xs
    return tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _gate_up_sums_fp8(
    x_ptr, slot, w13_ptr, s13_ptr, hidden, inter, stride_ws, stride_wn, stride_ss, stride_sn,
    n_idx, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr,
    STAGES: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """_gate_up_sums of an FP8 expert (w13 as int32 words of four bytes, strides in words): each
    word's bytes widened exactly and multiplied by x in one chain of multiply-adds, each 16
    columns' sum (a row's 16-byte vector, inside one 128-column block) times its row's block
    factor (fp8_moe.vector_sums), in fp32; only x is rounded to the compute dtype."""
    n_ok = n_idx < inter
    expert = w13_ptr + slot.to(tl.int64) * stride_ws
    gate_rows = expert + n_idx[:, None].to(tl.int64) * stride_wn
    up_rows = expert + (inter + n_idx[:, None]).to(tl.int64) * stride_wn
    factors = s13_ptr + slot.to(tl.int64) * stride_ss
    gate_factors = factors + (n_idx[:, None] // 128) * stride_sn
    up_factors = factors + ((inter + n_idx[:, None]) // 128) * stride_sn
    row_words = hidden // 4
    words: tl.constexpr = BLOCK_K // 4
    vectors = 16 * tl.arange(0, words // 4)  # each vector's first column in a step
    acc_gate = tl.zeros((BLOCK_N, words // 4), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, words // 4), dtype=tl.float32)
    for w0 in tl.range(0, row_words, words, num_stages=STAGES):
        j = w0 + tl.arange(0, words)
        cols = 4 * w0 + tl.arange(0, BLOCK_K)
        block = ((4 * w0 + vectors) // 128)[None, :]
        if EVEN:  # the tiles divide the rows: no load needs a mask
            xs = tl.load(x_ptr + cols).to(COMPUTE).to(tl.float32)
            gate = tl.load(gate_rows + j[None, :])
            up = tl.load(up_rows + j[None, :])
            gate_f = tl.load(gate_factors + block)
            up_f = tl.load(up_factors + block)
        else:
            w_ok = n_ok[:, None] & (j < row_words)[None, :]
            xs = tl.load(x_ptr + cols, mask=cols < hidden, other=0.0).to(COMPUTE).to(tl.float32)
            gate = tl.load(gate_rows + j[None, :], mask=w_ok, other=0)
            up = tl.load(up_rows + j[None, :], mask=w_ok, other=0)
            f_ok = n_ok[:, None] & (4 * w0 + vectors < hidden)[None, :]
            gate_f = tl.load(gate_factors + block, mask=f_ok, other=0.0)
            up_f = tl.load(up_factors + block, mask=f_ok, other=0.0)
        acc_gate += fp8_moe.vector_sums(gate, xs, PTX) * gate_f
        acc_up += fp8_moe.vector_sums(up, xs, PTX) * up_f
    # each weight was taken times 2^-8 (fp8_moe.word_dots): given back here
    return tl.sum(acc_gate, axis=1) * 256.0, tl.sum(acc_up, axis=1) * 256.0


@triton.jit
def _one_token_gate_up_kernel(
    x_ptr, slots_ptr, w13_ptr, s13_ptr, b13_ptr, act_ptr, hidden, inter, limit, stride_ws,
    stride_wn, stride_ss, stride_sn, stride_bs, TOP_K: tl.constexpr, LOOP_ROUTES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr,
    STAGES: tl.constexpr, FP8: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    PTX: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    common.pdl_start(PDL)
    # A masked route (run on the CPU) loads nothing, and its act row is left for no one to read.
    if LOOP_ROUTES:  # one program per row block, over every route: few are live
        n_idx = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        for route in range(TOP_K):
            slot = tl.load(slots_ptr + route)
            if slot >= 0:
                _gate_up_rows(
                    x_ptr, slot, w13_ptr, s13_ptr, b13_ptr, act_ptr + route * inter, hidden,
                    inter, limit, stride_ws, stride_wn, stride_ss, stride_sn, stride_bs, n_idx,
                    BLOCK_N, BLOCK_K, COMPUTE, STAGES, FP8, BIAS, CLAMPED, PTX, EVEN,
                )  # fmt: skip
    else:  # one program per route and row block
        route = tl.program_id(0)
        slot = tl.load(slots_ptr + route)
        if slot >= 0:
            n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            _gate_up_rows(
                x_ptr, slot, w13_ptr, s13_ptr, b13_ptr, act_ptr + route * inter, hidden, inter,
                limit, stride_ws, stride_wn, stride_ss, stride_sn, stride_bs, n_idx, BLOCK_N,
                BLOCK_K, COMPUTE, STAGES, FP8, BIAS, CLAMPED, PTX, EVEN,
            )  # fmt: skip


@triton.jit
def _down_rows(
    act_ptr, slot, w2_ptr, s2_ptr, inter, stride_ws, stride_wn, stride_ss, stride_sn, n_idx,
    n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr, STAGES: tl.constexpr, FP8: tl.constexpr, PTX: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_N]: rows n_idx of the down projection in `slot` (>= 0) times a route's act
    row (at act_ptr)."""
    expert = w2_ptr + slot.to(tl.int64) * stride_ws
    if FP8:  # as _gate_up_sums_fp8: words, a factor for each row's 16-column vector
        w_rows = expert + n_idx[:, None].to(tl.int64) * stride_wn
        row_factors = s2_ptr + slot.to(tl.int64) * stride_ss + (n_idx[:, None] // 128) * stride_sn
        row_words = inter // 4
        words: tl.constexpr = BLOCK_K // 4
        vectors = 16 * tl.arange(0, words // 4)
        acc = tl.zeros((BLOCK_N, words // 4), dtype=tl.float32)
        for w0 in tl.range(0, row_words, words, num_stages=STAGES):
            j = w0 + tl.arange(0, words)
            cols = 4 * w0 + tl.arange(0, BLOCK_K)
            block = ((4 * w0 + vectors) // 128)[None, :]
            if EVEN:  # the tiles divide the rows: no load needs a mask
                a = tl.load(act_ptr + cols).to(tl.float32)
                w = tl.load(w_rows + j[None, :])
                f = tl.load(row_factors + block)
            else:
                a = tl.load(act_ptr + cols, mask=cols < inter, other=0.0).to(tl.float32)
                w_ok = n_ok[:, None] & (j < row_words)[None, :]
                w = tl.load(w_rows + j[None, :], mask=w_ok, other=0)
                f_ok = n_ok[:, None] & (4 * w0 + vectors < inter)[None, :]
                f = tl.load(row_factors + block, mask=f_ok, other=0.0)
            acc += fp8_moe.vector_sums(w, a, PTX) * f
        sums = tl.sum(acc, axis=1) * 256.0  # the 2^-8 of fp8_moe.word_dots given back
    else:
        w_rows = expert + n_idx[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, inter, BLOCK_K, num_stages=STAGES):
            k_idx = k0 + tl.arange(0, BLOCK_K)
            k_ok = k_idx < inter
            a = tl.load(act_ptr + k_idx, mask=k_ok, other=0.0)
            w = tl.load(w_rows + k_idx[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(COMPUTE).to(tl.float32) * a.to(tl.float32)[None, :]
        sums = tl.sum(acc, axis=1)
    return sums


@triton.jit
def _down_bias(b2_ptr, slot, stride_bs, n_idx, n_ok, BIAS: tl.constexpr):
    """A slot's down-projection biases of rows n_idx (fp32), or zeros without BIAS."""
    if BIAS:
        row = b2_ptr + slot.to(tl.int64) * stride_bs
        return tl.load(row + n_idx, mask=n_ok, other=0.0).to(tl.float32)
    return (n_idx * 0).to(tl.float32)


@triton.jit
def _one_token_down_kernel(
    act_ptr, slots_ptr, weights_ptr, w2_ptr, s2_ptr, b2_ptr, y_ptr, hidden, inter, stride_ws,
    stride_wn, stride_ss, stride_sn, stride_bs, TOP_K: tl.constexpr, LOOP_ROUTES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr,
    STAGES: tl.constexpr, FP8: tl.constexpr, BIAS: tl.constexpr, PTX: tl.constexpr,
    EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    common.pdl_start(PDL)
    # A masked route's rows are zeros (its act row was never written).
    if LOOP_ROUTES:  # one program per row block, over every route: few are live
        n_idx = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n_idx < hidden
        for route in range(TOP_K):
            slot = tl.load(slots_ptr + route)
            out = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if slot >= 0:
                out = (_down_rows(
                    act_ptr + route * inter, slot, w2_ptr, s2_ptr, inter, stride_ws, stride_wn,
                    stride_ss, stride_sn, n_idx, n_ok, BLOCK_N, BLOCK_K, COMPUTE, STAGES, FP8,
                    PTX, EVEN,
                ) + _down_bias(b2_ptr, slot, stride_bs, n_idx, n_ok, BIAS)) * tl.load(
                    weights_ptr + route
                ).to(tl.float32)  # fmt: skip
            tl.store(y_ptr + route * hidden + n_idx, out, mask=n_ok)
    else:  # one program per route and row block
        route = tl.program_id(0)
        slot = tl.load(slots_ptr + route)
        n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n_idx < hidden
        out = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if slot >= 0:
            out = (_down_rows(
                act_ptr + route * inter, slot, w2_ptr, s2_ptr, inter, stride_ws, stride_wn,
                stride_ss, stride_sn, n_idx, n_ok, BLOCK_N, BLOCK_K, COMPUTE, STAGES, FP8,
                PTX, EVEN,
            ) + _down_bias(b2_ptr, slot, stride_bs, n_idx, n_ok, BIAS)) * tl.load(
                weights_ptr + route
            ).to(tl.float32)  # fmt: skip
        tl.store(y_ptr + route * hidden + n_idx, out, mask=n_ok)


def fits(w13: torch.Tensor, w2: torch.Tensor, fp8_bank: bool) -> bool:
    """Whether the one-token launches take this bank: any bf16/fp16/fp32 bank, an FP8 one whose
    rows split into words of four bytes (fp8_moe.words: H and I multiples of 4, as every
    published geometry's are)."""
    return not fp8_bank or (fp8_moe.words(w13) is not None and fp8_moe.words(w2) is not None)


def launch(
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
    cfg: OneTokenMoEConfig,
) -> None:
    """The one-token launches: act [1, K, I] from x, then y [1, K, H] from act. scales: the
    block factors of w13 and w2 where the bank is FP8 (int8 bits, read as words of four:
    `fits`), else None; extras: gpt-oss's biases and SwiGLU limit."""
    hidden = x.shape[1]
    top_k = slot_ids.shape[1]
    inter = w13.shape[1] // 2
    if scales is not None:
        w13, w2 = fp8_moe.words(w13), fp8_moe.words(w2)
        if w13 is None or w2 is None:
            raise ValueError(
                f"the one-token launches read an FP8 bank's rows as words of 4 bytes: H ({hidden})"
                f" and I ({inter}) must be multiples of 4, the rows 4-byte aligned; pass a "
                "DecodeMoEConfig for this bank"
            )
    loop = cfg.loop_routes  # a grid of row blocks only: each program loops over the routes
    gate_up_blocks = triton.cdiv(inter, cfg.gate_up_block_n)
    down_blocks = triton.cdiv(hidden, cfg.down_block_n)
    pdl = common.pdl_launch(x.device)
    gate_up_k = min(cfg.gate_up_block_k, common.next_pow2(hidden, 16))
    down_k = min(cfg.down_block_k, common.next_pow2(inter, 16))
    # FP8: factors and their strides (a bf16 bank passes its weights, never read as factors)
    s13, s2 = scales if scales is not None else (w13, w2)
    b13, b2 = extras.biases if extras.biases is not None else (w13, w2)  # likewise
    _one_token_gate_up_kernel[(gate_up_blocks,) if loop else (top_k, gate_up_blocks)](
        x,
        slot_ids,
        w13,
        s13,
        b13,
        act,
        hidden,
        inter,
        extras.limit,
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        b13.stride(0),
        TOP_K=top_k,
        LOOP_ROUTES=loop,
        BLOCK_N=cfg.gate_up_block_n,
        BLOCK_K=gate_up_k,
        COMPUTE=compute,
        STAGES=cfg.num_stages,
        FP8=scales is not None,
        BIAS=extras.biases is not None,
        CLAMPED=extras.limit > 0,
        PTX=common.inline_ptx(x.device),
        EVEN=inter % cfg.gate_up_block_n == 0 and hidden % gate_up_k == 0,
        num_warps=cfg.num_warps,
        **pdl,
    )
    _one_token_down_kernel[(down_blocks,) if loop else (top_k, down_blocks)](
        act,
        slot_ids,
        route_weights,
        w2,
        s2,
        b2,
        y,
        hidden,
        inter,
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        b2.stride(0),
        TOP_K=top_k,
        LOOP_ROUTES=loop,
        BLOCK_N=cfg.down_block_n,
        BLOCK_K=down_k,
        COMPUTE=compute,
        STAGES=cfg.num_stages,
        FP8=scales is not None,
        BIAS=extras.biases is not None,
        PTX=common.inline_ptx(x.device),
        EVEN=hidden % cfg.down_block_n == 0 and inter % down_k == 0,
        num_warps=cfg.num_warps,
        **pdl,
    )
