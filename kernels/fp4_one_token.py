"""Decode MoE for one token over MXFP4 and NVFP4 banks: the two launches mxfp4_moe takes at T=1.

As fused_moe_one_token's FP8 launches: no tl.dot; a program reads a few weight rows of its
route's expert along their contiguous axis, BLOCK_K columns a step, and multiplies them by the
broadcast activations, so that blocks of a few rows spread the routes over several programs per
SM (`choose_config`). A step's bytes are read once, as 16-byte vectors of a row (32 values: one
MXFP4 scale block, two NVFP4 ones). Each word's eight codes become fp16s with integer ops
(fp4_widen._code_pairs: each value times 2^-14, exact, two to a word), then fp32 (with PTX, from
the words' halves in place), multiplied by the activations of their columns in one chain of
multiply-adds a word (fp4_widen.word_dots); each scale block's words are summed in the thread
that read them, that sum times the block's scale (E8M0, or NVFP4's e4m3) goes to the row's fp32
accumulators, and those are summed across the threads once, after the loop, where the 2^14 is
given back. No weight is formed: E8M0 254, whose weights of
magnitude 2 and more overflow fp32, gives the exact sums, as the tl.dot launches do.

Each route computes its own product, so a slot named twice by the token is read twice (the
router never names one twice), and reduce=False's parts are each route's own weighted output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import common, gemv, swiglu
from .common import tl, triton
from .fp4_widen import e4m3_scales, scales, word_dots
from .fused_moe_one_token import check_tiles

# Threads a program reads with at the chooser's tiles (4 warps): each step gives every thread at
# least one 16-byte vector (32 values) of the rows, so that no two threads read the same bytes.
CHOSEN_WARPS = 4
VECTOR_VALUES = 32
# The widest step of down's rows the chooser takes (its loads go straight to registers: 16 rows
# by 1024 hold 128 registers a thread)
DOWN_STEP = 1024


@dataclass(frozen=True, slots=True)
class OneTokenFP4Config:
    """Tiles of the one-token launches over a 4-bit bank: weight rows and columns a step per
    program of each, warps, and how many steps of weight loads are in flight at once in gate/up
    (num_stages) and in down (down_stages; 1: none, each step's loads straight to registers).
    A step's columns are whole scale blocks (32 is MXFP4's); rows x columns / 32 at least the
    program's threads, each a 16-byte vector, or threads read the same bytes twice."""

    gate_up_block_n: int = 16
    gate_up_block_k: int = 512
    down_block_n: int = 16
    down_block_k: int = 512
    num_warps: int = CHOSEN_WARPS
    num_stages: int = 3
    down_stages: int = 1

    def __post_init__(self) -> None:
        check_tiles(self, least_step=VECTOR_VALUES)
        if self.down_stages < 1:
            raise ValueError(f"down_stages must be >= 1, got {self.down_stages}")


@functools.lru_cache(maxsize=32)
def choose_config(
    top_k: int, hidden: int, inter: int, sms: int, few_routes: bool = False
) -> OneTokenFP4Config:
    """One-token tiles for a geometry on a device with `sms` SMs.

    Each launch takes the widest block of up to 16 rows whose grid (routes x row blocks) still
    gives 2 programs per SM, and a step of columns that gives each of its threads two 16-byte
    vectors of the rows (no wider than the rows; fewer warps where the rows are too short for
    4); down, whose loads skip the pipeline's shared memory (`down_stages` 1), a step of its
    whole row up to DOWN_STEP columns. On a Hopper card at Qwen3-30B-A3B's shape (gate/up 16
    rows by 512 in 3 stages, down 16 by 1024 in one; 8 routes) down took 8.6-9.3 us under Nsight
    Compute against 13.8-15.6 with its loads through 2 or 3 stages (16 by 512 and 1024), whose
    warps waited on shared memory (`gpu_suite.sh OUT ncu_moe`, docs/performance.md).
    gpt-oss-120b (H=I=2880, 4 routes): gate/up 16 rows by 512, down 16 by 1024.

    few_routes: for a launch where one or two routes are live (the routes a layer step's fills
    serve): the rule for one route at gemv's 4 programs an SM and one vector a thread, so that
    one live route's rows spread over the whole device (the masked routes' programs return at
    once): there, gate/up 1 row by 2048 (768 programs a route), down 2 rows by 1024, 2 warps.
    """
    routes = 1 if few_routes else top_k
    programs = gemv.ROW_PROGRAMS_PER_SM * sms if few_routes else 2 * sms
    vectors_a_thread = 1 if few_routes else 2

    def rows_per_program(rows: int) -> int:
        block_n = 16
        while block_n > 1 and routes * triton.cdiv(rows, block_n) < programs:
            block_n //= 2
        return block_n

    def step(block_n: int, columns: int) -> int:
        every_thread = vectors_a_thread * VECTOR_VALUES * 32 * CHOSEN_WARPS // block_n
        return min(max(every_thread, 256), common.next_pow2(columns, VECTOR_VALUES))

    gate_up_n, down_n = rows_per_program(inter), rows_per_program(hidden)
    gate_up_k, down_k = step(gate_up_n, hidden), step(down_n, inter)
    if not few_routes:  # down's loads go straight to registers: its rows in steps of up to 1024
        down_k = min(max(down_k, common.next_pow2(inter, VECTOR_VALUES)), DOWN_STEP)
    vectors = min(gate_up_n * gate_up_k, down_n * down_k) // VECTOR_VALUES
    return OneTokenFP4Config(
        gate_up_block_n=gate_up_n,
        gate_up_block_k=gate_up_k,
        down_block_n=down_n,
        down_block_k=down_k,
        num_warps=max(1, min(CHOSEN_WARPS, vectors // 32)),
    )


@triton.jit
def _step_sums(rows, n_ok, w0, row_words, xs, codes, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
               SCALE_BLOCK: tl.constexpr, NVFP4: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """fp32 [BLOCK_N, 8 WORDS / SCALE_BLOCK]: each scale block of words w0 .. w0 + WORDS of the
    rows (int32 words at `rows` [BLOCK_N, 1]; `row_words` in a row, none past it read) times
    the activations `xs` of its columns (fp32 [8 WORDS]), times the block's scale (`codes`,
    int32, `_step_codes`) and 2^-14. Each word's products are one chain of multiply-adds
    (`word_dots`), a block's words then summed."""
    j = w0 + tl.arange(0, WORDS)
    words = tl.load(rows + j[None, :], mask=n_ok[:, None] & (j < row_words)[None, :], other=0)
    dots = word_dots(words, xs[None, :], PTX)
    blocks: tl.constexpr = 8 * WORDS // SCALE_BLOCK
    sums = tl.sum(tl.reshape(dots, (BLOCK_N, blocks, SCALE_BLOCK // 8)), axis=2)
    return sums * (e4m3_scales(codes) if NVFP4 else scales(codes))


@triton.jit
def _step_codes(row_scales, n_ok, w0, row_words, WORDS: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """int32 [BLOCK_N, 8 WORDS / SCALE_BLOCK]: the scale codes (at `row_scales` [BLOCK_N, 1]) of
    the blocks of words w0 .. w0 + WORDS, 0 past the row."""
    b = w0 * 8 // SCALE_BLOCK + tl.arange(0, 8 * WORDS // SCALE_BLOCK)
    b_ok = b < row_words * 8 // SCALE_BLOCK
    codes = tl.load(row_scales + b[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0)
    return codes.to(tl.int32)


@triton.jit
def _rows_pointers(w_ptr, s_ptr, slot, first_row, n_idx, stride_ws, stride_wn, stride_ss,
                   stride_sn, VEC: tl.constexpr):  # fmt: skip
    """Pointers [BLOCK_N, 1] at rows first_row + n_idx of the slot's words and scale codes. The
    words' strides come in VEC-word units, so that the compiler knows each row starts on a
    VEC-word boundary and reads it in vectors of VEC words."""
    rows = (first_row + n_idx[:, None]).to(tl.int64)
    words = w_ptr + slot.to(tl.int64) * stride_ws * VEC + rows * stride_wn * VEC
    return words, s_ptr + slot.to(tl.int64) * stride_ss + rows * stride_sn


@triton.jit
def _fp4_gate_up_kernel(
    x_ptr, slots_ptr, w13_ptr, s13_ptr, t13_ptr, b13_ptr, act_ptr, hidden, inter, limit,
    stride_ws, stride_wn, stride_ss, stride_sn, stride_bs, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
    BIAS: tl.constexpr, CLAMPED: tl.constexpr, NVFP4: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """act[route, rows] = silu(gate·x) * (up·x) for a block of rows of the route's slot. BIAS:
    plus the slot's gate and up biases; CLAMPED: gpt-oss's clamped SwiGLU; NVFP4: the sums
    times the slot's per-tensor scales of gate and up, t13 [S, 2]. A masked route (slot -1)
    loads nothing, and its act row is left for no one to read."""
    common.pdl_start(PDL)
    route = tl.program_id(0)
    slot = tl.load(slots_ptr + route)
    if slot >= 0:
        n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n_idx < inter
        gate, gate_s = _rows_pointers(
            w13_ptr, s13_ptr, slot, 0, n_idx, stride_ws, stride_wn, stride_ss, stride_sn, VEC
        )
        up, up_s = _rows_pointers(
            w13_ptr, s13_ptr, slot, inter, n_idx, stride_ws, stride_wn, stride_ss, stride_sn, VEC
        )
        row_words = hidden // (8 * VEC) * VEC  # a multiple of VEC: the masks keep the vectors
        words: tl.constexpr = BLOCK_K // 8
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K // SCALE_BLOCK), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K // SCALE_BLOCK), dtype=tl.float32)
        # The scale codes, a byte a thread, are loaded a step ahead by hand: the loop's stages
        # pipeline only the loads of 4 bytes or more.
        gate_codes = _step_codes(gate_s, n_ok, 0, row_words, words, SCALE_BLOCK)
        up_codes = _step_codes(up_s, n_ok, 0, row_words, words, SCALE_BLOCK)
        # num_stages on the loop itself: the launch's num_stages pipelines only loads that feed
        # tl.dot
        for w0 in tl.range(0, row_words, words, num_stages=STAGES):
            next_gate = _step_codes(gate_s, n_ok, w0 + words, row_words, words, SCALE_BLOCK)
            next_up = _step_codes(up_s, n_ok, w0 + words, row_words, words, SCALE_BLOCK)
            cols = w0 * 8 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
            acc_gate += _step_sums(
                gate, n_ok, w0, row_words, xs, gate_codes, BLOCK_N, words, SCALE_BLOCK, NVFP4, PTX
            )
            acc_up += _step_sums(
                up, n_ok, w0, row_words, xs, up_codes, BLOCK_N, words, SCALE_BLOCK, NVFP4, PTX
            )
            gate_codes, up_codes = next_gate, next_up
        # `word_dots` takes each weight times 2^-14: the sums carry that factor until here
        g = tl.sum(acc_gate, axis=1) * 16384.0
        u = tl.sum(acc_up, axis=1) * 16384.0
        if NVFP4:
            g *= tl.load(t13_ptr + 2 * slot)
            u *= tl.load(t13_ptr + 2 * slot + 1)
        if BIAS:
            biases = b13_ptr + slot.to(tl.int64) * stride_bs
            g += tl.load(biases + n_idx, mask=n_ok, other=0.0).to(tl.float32)
            u += tl.load(biases + inter + n_idx, mask=n_ok, other=0.0).to(tl.float32)
        act = swiglu.activate_tl(g, u, limit, CLAMPED)
        tl.store(act_ptr + route * inter + n_idx, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp4_down_kernel(
    act_ptr, slots_ptr, weights_ptr, w2_ptr, s2_ptr, t2_ptr, b2_ptr, y_ptr, hidden, inter,
    stride_ws, stride_wn, stride_ss, stride_sn, stride_bs, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
    BIAS: tl.constexpr, NVFP4: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y[route, rows] = route weight * (w2 rows · act[route]) for a block of rows of the
    route's slot. BIAS: plus the slot's down bias before the weight; NVFP4: the sums times the
    slot's per-tensor scale, t2 [S, 1]. A masked route's rows are zeros (its act row was never
    written)."""
    common.pdl_start(PDL)
    route = tl.program_id(0)
    slot = tl.load(slots_ptr + route)
    n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < hidden
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot >= 0:
        rows, row_s = _rows_pointers(
            w2_ptr, s2_ptr, slot, 0, n_idx, stride_ws, stride_wn, stride_ss, stride_sn, VEC
        )
        row_words = inter // (8 * VEC) * VEC
        words: tl.constexpr = BLOCK_K // 8
        acc = tl.zeros((BLOCK_N, BLOCK_K // SCALE_BLOCK), dtype=tl.float32)
        codes = _step_codes(row_s, n_ok, 0, row_words, words, SCALE_BLOCK)  # a step ahead
        for w0 in tl.range(0, row_words, words, num_stages=STAGES):
            next_codes = _step_codes(row_s, n_ok, w0 + words, row_words, words, SCALE_BLOCK)
            cols = w0 * 8 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + route * inter + cols, mask=cols < inter, other=0.0)
            acc += _step_sums(
                rows, n_ok, w0, row_words, a.to(tl.float32), codes, BLOCK_N, words, SCALE_BLOCK,
                NVFP4, PTX,
            )  # fmt: skip
            codes = next_codes
        y = tl.sum(acc, axis=1) * 16384.0  # the 2^-14 of `word_dots` given back
        if NVFP4:
            y *= tl.load(t2_ptr + slot)
        if BIAS:
            bias_row = b2_ptr + slot.to(tl.int64) * stride_bs
            y += tl.load(bias_row + n_idx, mask=n_ok, other=0.0).to(tl.float32)
        out = y * tl.load(weights_ptr + route).to(tl.float32)
    tl.store(y_ptr + route * hidden + n_idx, out, mask=n_ok)


def _vector_words(row_words: int) -> int:
    """Words a row's vectors hold: 4 (16 bytes) where every row starts on a 16-byte boundary
    (every MXFP4 row: 16 bytes a scale block), else 2 (an NVFP4 row of a multiple of 8 bytes)."""
    return 4 if row_words % 4 == 0 else 2


def launch(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    act: torch.Tensor,
    y: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
    limit: float,
    cfg: OneTokenFP4Config,
) -> None:
    """The one-token launches over a checked 4-bit bank: act [1, K, I] from x, then y [1, K, H]
    from act. w13 and w2: a projection's bytes, its block scales (uint8 codes) and, for NVFP4,
    its per-tensor scales (else None: MXFP4); biases: gpt-oss's, limit: its SwiGLU's (0:
    none)."""
    (w13, s13, t13), (w2, s2, t2) = w13, w2
    nvfp4 = t13 is not None
    scale_block = 16 if nvfp4 else 32
    hidden, inter = x.shape[1], act.shape[2]
    top_k = slot_ids.shape[1]
    # the kernels read the bytes four at a time (`word_dots`), in vectors of up to four words
    words13, words2 = w13.view(torch.int32), w2.view(torch.int32)
    vec13, vec2 = _vector_words(hidden // 8), _vector_words(inter // 8)
    # without biases (or per-tensor scales) the weights stand in for them, never read
    b13, b2 = biases if biases is not None else (w13, w2)
    t13, t2 = (t13, t2) if nvfp4 else (w13, w2)
    shared = {
        "SCALE_BLOCK": scale_block,
        "BIAS": biases is not None,
        "NVFP4": nvfp4,
        "PTX": common.inline_ptx(x.device),
        "num_warps": cfg.num_warps,
        **common.pdl_launch(x.device),
    }
    _fp4_gate_up_kernel[(top_k, triton.cdiv(inter, cfg.gate_up_block_n))](
        x, slot_ids, words13, s13, t13, b13, act, hidden, inter, float(limit),
        words13.stride(0) // vec13, words13.stride(1) // vec13, s13.stride(0), s13.stride(1),
        b13.stride(0), BLOCK_N=cfg.gate_up_block_n,
        BLOCK_K=min(cfg.gate_up_block_k, common.next_pow2(hidden, VECTOR_VALUES)), VEC=vec13,
        CLAMPED=limit > 0, STAGES=cfg.num_stages, **shared,
    )  # fmt: skip
    _fp4_down_kernel[(top_k, triton.cdiv(hidden, cfg.down_block_n))](
        act, slot_ids, route_weights, words2, s2, t2, b2, y, hidden, inter,
        words2.stride(0) // vec2, words2.stride(1) // vec2, s2.stride(0), s2.stride(1),
        b2.stride(0), BLOCK_N=cfg.down_block_n,
        BLOCK_K=min(cfg.down_block_k, common.next_pow2(inter, VECTOR_VALUES)), VEC=vec2,
        STAGES=cfg.down_stages, **shared,
    )  # fmt: skip
