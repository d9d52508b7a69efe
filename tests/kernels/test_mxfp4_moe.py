"""The MoE kernels over MXFP4 expert banks against the reference on the dequantized weights
(interpreter on CPU, fp32 activations, small shapes; natively on a GPU, bf16 too)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import common, e2m1, fp4_widen, grouped_moe, mxfp4, mxfp4_moe
from moelab.kernels.common import tl, triton
from moelab.kernels.fp4_one_token import OneTokenFP4Config, choose_config
from moelab.kernels.grouped_moe import GroupedMoEConfig
from moelab.kernels.mxfp4_moe import DotDecodeConfig

from .kernel_inputs import DEVICE, assert_matches, randn, route_table, route_weights

pytestmark = pytest.mark.usefixtures("triton_runs")

# Whole 32-blocks, but not whole steps of the tiles: the last step ends inside a block pair.
HIDDEN, INTER = 160, 96
GROUPED = GroupedMoEConfig(16, 32, 32, 64, num_warps=4, num_stages=2)
# The one-token launches' tiles: steps of one block and of several (each thread a 16-byte vector
# or sharing one), a step wider than the rows (H = 160, I = 96), one stage and three, down's
# loads in flight or not.
ONE_TOKEN = [
    OneTokenFP4Config(8, 32, 16, 32, num_warps=1, num_stages=1),
    OneTokenFP4Config(8, 128, 16, 64, num_warps=2, num_stages=3, down_stages=2),
    OneTokenFP4Config(16, 512, 2, 256, num_warps=4, num_stages=2),
]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def mxfp4_bank(gen: torch.Generator, slots: int, hidden: int = HIDDEN, inter: int = INTER):
    """Random experts quantized to MXFP4 (mxfp4.quantize), rows of scales a few binades apart,
    so that a scale taken from the wrong block or row shows: (w13, w2, w13_scale, w2_scale)."""

    def quantized(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
        rows = torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float())
        cols = torch.exp2(torch.randint(-3, 4, (shape[-1],), generator=gen).float())
        blocks, scales = mxfp4.quantize(w * rows * cols)
        return blocks.to(DEVICE), scales.to(DEVICE)

    w13, w13_scale = quantized(slots, 2 * inter, hidden)
    w2, w2_scale = quantized(slots, hidden, inter)
    return w13, w2, w13_scale, w2_scale


@triton.jit
def _values_kernel(codes_ptr, scales_ptr, values_ptr, factors_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(values_ptr + i, fp4_widen.values(tl.load(codes_ptr + i).to(tl.int32)))
    tl.store(factors_ptr + i, fp4_widen.scales(tl.load(scales_ptr + i).to(tl.int32)))


def test_widening_builds_every_code_and_every_scale_exactly():
    codes = torch.arange(256, dtype=torch.int32).remainder(16).to(torch.uint8).to(DEVICE)
    scale_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    values = torch.empty(256, device=DEVICE)
    factors = torch.empty(256, device=DEVICE)
    _values_kernel[(1,)](codes, scale_codes, values, factors, N=256)
    # the references decode by the definitions: e2m1 from its fields, E8M0 by exp2
    assert torch.equal(values.cpu(), e2m1.widen(codes.cpu()))
    assert torch.equal(torch.signbit(values.cpu()[:16]), torch.arange(16) >= 8)
    expected = mxfp4.scale_values(scale_codes.cpu())
    assert torch.equal(factors.cpu()[:255], expected[:255])
    assert factors[255].isnan() and factors[0].item() == 2.0**-127


@triton.jit
def _halves_kernel(words_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    words = tl.load(words_ptr + rows * WORDS + tl.arange(0, WORDS)[None, :])
    out = fp4_widen.halves(words, tl.float16)
    tl.store(out_ptr + rows * 8 * WORDS + tl.arange(0, 8 * WORDS)[None, :], out)


def test_halves_widen_every_code_in_column_order_times_2_to_the_minus_14():
    """Every byte (both nibbles), read four to a word, as fp16 in column order (byte j: columns
    2j and 2j + 1); the e = 0 codes (±0, ±0.5) among fp16's subnormals."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16).to(DEVICE)
    out = torch.empty(16, 32, dtype=torch.float16, device=DEVICE)
    _halves_kernel[(1,)](packed.view(torch.int32), out, ROWS=16, WORDS=4)
    codes = packed.cpu()
    ref = torch.stack([e2m1.widen(codes & 15), e2m1.widen(codes >> 4)], dim=-1).view(16, 32)
    assert torch.equal(out.cpu().float(), ref * 2.0**-14)
    assert torch.equal(torch.signbit(out.cpu()), torch.signbit(ref))  # -0 too
    assert out.cpu()[0, 2].item() == 2.0**-15  # byte 1's low code, 0.5: an fp16 subnormal


@triton.jit
def _word_dots_kernel(words_ptr, x_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr,
                      PTX: tl.constexpr):  # fmt: skip
    rows = tl.arange(0, ROWS)[:, None]
    words = tl.load(words_ptr + rows * WORDS + tl.arange(0, WORDS)[None, :])
    xs = tl.load(x_ptr + tl.arange(0, 8 * WORDS))[None, :]
    tl.store(
        out_ptr + rows * WORDS + tl.arange(0, WORDS)[None, :], fp4_widen.word_dots(words, xs, PTX)
    )


def test_word_dots_take_each_code_times_the_activation_of_its_column(gen):
    """Every byte (both nibbles), four to a word: each word's eight codes (times 2^-14) times the
    activations of their columns, summed; activations ± powers of two 2^3 apart (2^-6 to 2^6),
    so that a code put against another column's activation shows, and every product and sum
    stays exact in fp32 (all of a word's bits within 20 binary places)."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16).to(DEVICE)
    x = torch.exp2(3.0 * torch.randint(-2, 3, (32,), generator=gen).float())
    x = (x * torch.randint(0, 2, (32,), generator=gen).mul(2).sub(1)).to(DEVICE)
    out = torch.empty(16, 4, device=DEVICE)
    _word_dots_kernel[(1,)](
        packed.view(torch.int32), x, out, ROWS=16, WORDS=4, PTX=common.inline_ptx(x.device)
    )
    codes = packed.cpu()
    weights = torch.stack([e2m1.widen(codes & 15), e2m1.widen(codes >> 4)], dim=-1).view(16, 32)
    ref = (weights * 2.0**-14 * x.cpu()).view(16, 4, 8).double().sum(dim=2).float()
    assert torch.equal(out.cpu(), ref)


# One token, several, and several naming every slot; each tile class at least once (the routes
# do not change the tiles' loops, nor the tiles the routes' grouping).
@pytest.mark.parametrize(
    "tokens, top_k, slots, block_n, block_k",
    [(1, 4, 6, 32, 128), (3, 2, 5, 16, 64), (2, 4, 4, 32, 128)],
)
def test_decode_matches_the_dequantized_reference(gen, tokens, top_k, slots, block_n, block_k):
    x = randn(gen, tokens, HIDDEN)
    slot_ids = route_table(gen, tokens, top_k, slots, masked=0.2)
    weights = route_weights(gen, tokens, top_k)
    bank = mxfp4_bank(gen, slots)
    config = DotDecodeConfig(block_n, block_k)
    out = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank, config=config)
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank)
    assert_matches(out, ref, tol=1e-5)


def test_decode_reads_each_slot_once_for_the_tokens_naming_it(gen):
    """Ten tokens over three slots: every slot named by several tokens (and a route masked),
    computed once for all of them; the sum and the per-route parts' sum as the reference's."""
    x = randn(gen, 10, HIDDEN)
    slot_ids = route_table(gen, 10, 2, 3, masked=0.1)
    weights = route_weights(gen, 10, 2)
    bank = mxfp4_bank(gen, 3)
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank)
    config = DotDecodeConfig(32, 64)
    out = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank, config=config)
    assert_matches(out, ref, tol=1e-5)
    parts = mxfp4_moe.fused_moe_decode_mxfp4(
        x, slot_ids, weights, *bank, config=config, reduce=False
    )
    assert_matches(parts.sum(dim=1), ref, tol=1e-5)


def test_decode_reads_the_top_scale_code_exactly(gen):
    """gate/up blocks at E8M0 251-254, whose weights of magnitude 2 and more overflow fp32,
    against activations small enough that the sums do not: the output of the same blocks 100
    binades down with the activations 100 binades up, which the reference can form."""
    magnitudes = 0.5 + torch.rand(3, HIDDEN, generator=gen)
    x = (magnitudes * torch.randn(3, HIDDEN, generator=gen).sign()).to(DEVICE)
    slot_ids = route_table(gen, 3, 2, 4, masked=0.2)
    weights = route_weights(gen, 3, 2)
    w13, w2, s13, s2 = mxfp4_bank(gen, 4)
    top = (254 - torch.randint(0, 4, s13.shape, generator=gen)).to(torch.uint8).to(DEVICE)
    out = mxfp4_moe.fused_moe_decode_mxfp4(x * 2.0**-100, slot_ids, weights, w13, w2, top, s2)
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, w13, w2, top - 100, s2)
    assert_matches(out, ref, tol=1e-5)


def test_decode_gives_nan_where_a_block_has_the_nan_scale(gen):
    """E8M0 code 255 in one block of a down row of a routed slot: that row's output is NaN
    for the tokens routed there, as the format defines, and every other output is as before."""
    x = randn(gen, 3, HIDDEN)
    slot_ids = route_table(gen, 3, 2, 5)
    weights = route_weights(gen, 3, 2)
    w13, w2, s13, s2 = mxfp4_bank(gen, 5)
    slot, row = int(slot_ids[0, 0]), 7
    s2 = s2.clone()
    s2[slot, row, 1] = 255
    config = DotDecodeConfig(32, 64)
    out = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, w13, w2, s13, s2, config=config)
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, w13, w2, s13, s2)
    routed = (slot_ids == slot).any(dim=1)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[:, row].isnan().equal(routed) and out.isnan().sum() == routed.sum()
    keep = torch.ones(HIDDEN, dtype=torch.bool, device=out.device)
    keep[row] = False
    assert_matches(out[:, keep], ref[:, keep], tol=1e-5)


def test_decode_refuses_row_blocks_narrower_than_tl_dot_takes():
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        DotDecodeConfig(block_n=8)


# Each tile class once; several routes (one masked) and a lone route, each at least once (a
# route's program reads its slot the same at every tile).
@pytest.mark.parametrize(
    "config, top_k, masked",
    [(ONE_TOKEN[0], 1, 0.0), (ONE_TOKEN[1], 4, 0.3), (ONE_TOKEN[2], 1, 0.0)],
    ids=["one-block", "four-blocks", "wide"],
)
def test_one_token_decode_matches_the_dequantized_reference(gen, config, top_k, masked):
    """One token through the one-token launches: the sum, and each route's weighted output
    (reduce=False) as the reference's parts, zeros where a route is masked."""
    x = randn(gen, 1, HIDDEN)
    slot_ids = route_table(gen, 1, top_k, 6, masked=masked)
    weights = route_weights(gen, 1, top_k)
    bank = mxfp4_bank(gen, 6)
    parts = mxfp4_moe.fused_moe_decode_mxfp4(
        x, slot_ids, weights, *bank, config=config, reduce=False
    )
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank, reduce=False)
    assert_matches(parts, ref, tol=1e-5)
    out = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank, config=config)
    assert_matches(out, ref.sum(dim=1), tol=1e-5)


def test_one_token_is_the_default_at_one_token_and_reads_a_repeated_slot_per_route(
    gen, monkeypatch
):
    """Without a config one token takes the one-token launches, where a slot named twice holds
    each route's own weighted output (the tl.dot launches put the token's at the first route
    and zeros at the other); the sums agree."""
    # a device of one SM: the chosen tiles' widest row blocks, the fewest programs to interpret
    monkeypatch.setattr(common, "sm_count", lambda device: 1)
    x = randn(gen, 1, HIDDEN)
    slot_ids = torch.tensor([[2, 5, 2, -1]], dtype=torch.int32, device=DEVICE)
    weights = route_weights(gen, 1, 4)
    bank = mxfp4_bank(gen, 6)
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank, reduce=False)
    parts = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank, reduce=False)
    assert_matches(parts, ref, tol=1e-5)
    dot = mxfp4_moe.fused_moe_decode_mxfp4(
        x, slot_ids, weights, *bank, config=DotDecodeConfig(32, 64), reduce=False
    )
    assert dot[0, 2].abs().max() == 0 and parts[0, 2].abs().max() > 0
    assert_matches(dot.sum(dim=1), ref.sum(dim=1), tol=1e-5)


def test_one_token_decode_widens_every_byte_at_every_scale(gen):
    """Rows holding every byte (both nibbles of every code) at scale codes from 0 (the
    subnormal 2^-127) through 140 in every block: each block's sum times its own scale."""
    x = randn(gen, 1, HIDDEN)
    slot_ids = route_table(gen, 1, 3, 4)
    weights = route_weights(gen, 1, 3)
    w13, w2, s13, s2 = mxfp4_bank(gen, 4)
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(w13.numel() // 256 + 1)
    w13 = every_byte[torch.randperm(w13.numel(), generator=gen)].view(w13.shape).to(DEVICE)
    w2 = every_byte[torch.randperm(w2.numel(), generator=gen)].view(w2.shape).to(DEVICE)
    s13 = torch.randint(100, 141, s13.shape, generator=gen, dtype=torch.uint8).to(DEVICE)
    s13.view(-1)[::7] = 0
    s2 = torch.randint(100, 141, s2.shape, generator=gen, dtype=torch.uint8).to(DEVICE)
    s2.view(-1)[::5] = 0
    bank = (w13, w2, s13, s2)
    out = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank, config=ONE_TOKEN[1])
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank)
    assert_matches(out, ref, tol=1e-5)


def test_one_token_decode_reads_the_top_scale_code_exactly(gen):
    """As the tl.dot launches: gate/up blocks at E8M0 251-254 against activations 100 binades
    down give the output of the same blocks 100 binades down against the activations."""
    magnitudes = 0.5 + torch.rand(1, HIDDEN, generator=gen)
    x = (magnitudes * torch.randn(1, HIDDEN, generator=gen).sign()).to(DEVICE)
    slot_ids = route_table(gen, 1, 4, 6, masked=0.2)
    weights = route_weights(gen, 1, 4)
    w13, w2, s13, s2 = mxfp4_bank(gen, 6)
    top = (254 - torch.randint(0, 4, s13.shape, generator=gen)).to(torch.uint8).to(DEVICE)
    out = mxfp4_moe.fused_moe_decode_mxfp4(
        x * 2.0**-100, slot_ids, weights, w13, w2, top, s2, config=ONE_TOKEN[1]
    )
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, w13, w2, top - 100, s2)
    assert_matches(out, ref, tol=1e-5)


def test_one_token_decode_gives_nan_where_a_block_has_the_nan_scale(gen):
    """E8M0 255 in one block of a gate row of a routed slot: that route's whole output is NaN
    (its NaN act feeds every down row), the other routes' outputs are as the reference's."""
    x = randn(gen, 1, HIDDEN)
    slot_ids = route_table(gen, 1, 3, 5)
    weights = route_weights(gen, 1, 3)
    w13, w2, s13, s2 = mxfp4_bank(gen, 5)
    s13 = s13.clone()
    s13[int(slot_ids[0, 1]), 3, 2] = 255
    parts = mxfp4_moe.fused_moe_decode_mxfp4(
        x, slot_ids, weights, w13, w2, s13, s2, config=ONE_TOKEN[1], reduce=False
    )
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, w13, w2, s13, s2, reduce=False)
    assert parts[0, 1].isnan().all() and ref[0, 1].isnan().all()
    assert_matches(parts[:, [0, 2]], ref[:, [0, 2]], tol=1e-5)


def test_a_one_token_config_is_for_one_token(gen):
    bank = mxfp4_bank(gen, 3)
    with pytest.raises(ValueError, match="OneTokenFP4Config is for one token, got 2"):
        mxfp4_moe.fused_moe_decode_mxfp4(
            randn(gen, 2, HIDDEN), route_table(gen, 2, 2, 3), route_weights(gen, 2, 2), *bank,
            config=ONE_TOKEN[0],
        )  # fmt: skip
    with pytest.raises(ValueError, match="gate_up_block_k must be a power of two >= 32"):
        OneTokenFP4Config(gate_up_block_k=16)
    with pytest.raises(ValueError, match="down_stages must be >= 1, got 0"):
        OneTokenFP4Config(down_stages=0)


@pytest.mark.parametrize(
    "top_k, hidden, inter, few_routes, tiles",
    [
        (8, 2048, 768, False, (16, 512, 16, 1024, 4)),
        (4, 2880, 2880, False, (16, 512, 16, 1024, 4)),
        (8, 2048, 768, True, (1, 2048, 2, 1024, 2)),
    ],
    ids=["qwen3-30b-a3b", "gpt-oss-120b", "qwen3-30b-a3b-filled"],
)
def test_the_chosen_tiles_give_each_thread_its_own_vector(top_k, hidden, inter, few_routes, tiles):
    """On 132 SMs: 2 programs an SM at least where the rows allow, and each step two 16-byte
    vectors (32 values each) for every thread of the program, down's whole row up to 1024
    columns a step with its loads straight to registers; for one route alone where few are
    live, 4 programs an SM and one vector a thread."""
    cfg = choose_config(top_k, hidden, inter, 132, few_routes)
    assert cfg.down_stages == 1
    chosen = (cfg.gate_up_block_n, cfg.gate_up_block_k, cfg.down_block_n, cfg.down_block_k)
    assert (*chosen, cfg.num_warps) == tiles
    threads = 32 * cfg.num_warps
    assert cfg.gate_up_block_n * cfg.gate_up_block_k // 32 >= threads
    assert cfg.down_block_n * cfg.down_block_k // 32 >= threads
    routes, programs, vectors = (1, 4, 1) if few_routes else (top_k, 2, 2)
    assert routes * -(-inter // cfg.gate_up_block_n) >= programs * 132
    assert cfg.gate_up_block_n * cfg.gate_up_block_k // 32 >= vectors * threads


def test_one_token_decode_for_few_live_routes_matches_the_reference(gen, monkeypatch):
    """A fill's launch: one live route of four, the tiles for few routes, biases and the
    clamp; its route's output as the reference's, zeros at the others."""
    # a device of 16 SMs: gate/up rows one a program and down rows two, as the chooser gives
    # Qwen3-30B-A3B's fills on 132 SMs, over fewer programs to interpret
    monkeypatch.setattr(common, "sm_count", lambda device: 16)
    x = randn(gen, 1, HIDDEN)
    slot_ids = torch.tensor([[-1, 4, -1, -1]], dtype=torch.int32, device=DEVICE)
    weights = route_weights(gen, 1, 4)
    bank = mxfp4_bank(gen, 6)
    extras = gpt_oss_extras(gen, 6)
    parts = mxfp4_moe.fused_moe_decode_mxfp4(
        x, slot_ids, weights, *bank, reduce=False, few_routes=True, **extras
    )
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank, reduce=False, **extras)
    assert_matches(parts, ref, tol=1e-5)
    assert parts[0, 1].abs().max() > 0


@pytest.mark.parametrize("tokens, top_k, experts, masked", [(5, 2, 4, 0.0), (9, 3, 6, 0.2)])
def test_grouped_matches_the_dequantized_reference(gen, tokens, top_k, experts, masked):
    x = randn(gen, tokens, HIDDEN)
    expert_ids = route_table(gen, tokens, top_k, experts, masked=masked)
    weights = route_weights(gen, tokens, top_k)
    bank = mxfp4_bank(gen, experts)
    out = mxfp4_moe.grouped_moe_mxfp4(x, expert_ids, weights, *bank, config=GROUPED)
    ref = mxfp4_moe.grouped_moe_mxfp4_ref(x, expert_ids, weights, *bank)
    assert_matches(out, ref, tol=1e-5)


def test_references_are_the_dense_kernels_on_the_dequantized_weights(gen):
    """The MXFP4 reference is grouped_moe's on the weights mxfp4.dequantize gives."""
    x = randn(gen, 4, HIDDEN)
    expert_ids = route_table(gen, 4, 2, 5)
    weights = route_weights(gen, 4, 2)
    bank = mxfp4_bank(gen, 5)
    dense = mxfp4_moe.dequantized_bank(*bank)
    ref = mxfp4_moe.grouped_moe_mxfp4_ref(x, expert_ids, weights, *bank)
    assert_matches(ref, grouped_moe.grouped_moe_ref(x, expert_ids, weights, *dense), tol=1e-6)


@pytest.mark.cuda
@needs_cuda
def test_bf16_activations_on_the_gpu(gen):
    """bf16 activations into tl.dot with the widened weights in bf16 (exact there), in the
    prefill and in the decode: within bf16's rounding of the activations and the gate/up
    outputs."""
    x = randn(gen, 40, HIDDEN, dtype=torch.bfloat16)
    expert_ids = route_table(gen, 40, 4, 8)
    weights = route_weights(gen, 40, 4)
    bank = mxfp4_bank(gen, 8)
    ref = mxfp4_moe.grouped_moe_mxfp4_ref(x, expert_ids, weights, *bank)
    out = mxfp4_moe.grouped_moe_mxfp4(x, expert_ids, weights, *bank)
    assert_matches(out, ref, tol=3e-2)
    decoded = mxfp4_moe.fused_moe_decode_mxfp4(x[:1], expert_ids[:1], weights[:1], *bank)
    ref1 = mxfp4_moe.fused_moe_decode_mxfp4_ref(x[:1], expert_ids[:1], weights[:1], *bank)
    assert_matches(decoded, ref1, tol=3e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: (b[0].view(-1, INTER * 2, HIDDEN // 2), *b[1:]), r"w13 must be MXFP4 blocks"),
        (lambda b: (*b[:2], b[2].float(), b[3]), r"w13_scale must be the E8M0 scales"),
        (
            lambda b: (b[0], b[1][:, :32].contiguous(), b[2], b[3][:, :32].contiguous()),
            "does not fit",
        ),
    ],
)
def test_a_bank_that_does_not_fit_its_scales_is_refused(gen, change, message):
    bank = mxfp4_bank(gen, 3)
    x = randn(gen, 1, HIDDEN)
    with pytest.raises(ValueError, match=message):
        mxfp4_moe.fused_moe_decode_mxfp4(
            x, route_table(gen, 1, 2, 3), route_weights(gen, 1, 2), *change(bank)
        )


# gpt-oss-20b's experts: H = I = 2880 (90 blocks a row), 32 of them, top-4.
GPT_OSS_HIDDEN, GPT_OSS_EXPERTS, GPT_OSS_TOP_K = 2880, 32, 4


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.cuda
@needs_cuda
def test_decode_at_gpt_oss_shape_replays_in_a_cuda_graph(gen, tokens):
    """bf16 activations at gpt-oss's shapes, captured once and replayed on new routes (within
    bf16's rounding, as the prefill's)."""
    h = GPT_OSS_HIDDEN
    bank = mxfp4_bank(gen, GPT_OSS_EXPERTS, hidden=h, inter=h)
    x = randn(gen, tokens, h, dtype=torch.bfloat16)
    slot_ids = route_table(gen, tokens, GPT_OSS_TOP_K, GPT_OSS_EXPERTS, masked=0.25)
    weights = route_weights(gen, tokens, GPT_OSS_TOP_K)
    mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank)
    slot_ids.copy_(route_table(gen, tokens, GPT_OSS_TOP_K, GPT_OSS_EXPERTS, masked=0.25))
    graph.replay()
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank)
    assert_matches(out, ref, tol=3e-2)


# Qwen3-30B-A3B's experts (quantized to MXFP4 at load): H = 2048, I = 768, 128 of them, top-8.
QWEN_HIDDEN, QWEN_INTER, QWEN_EXPERTS, QWEN_TOP_K = 2048, 768, 128, 8


@pytest.mark.parametrize(
    "hidden, inter, experts, top_k, biased",
    [
        (GPT_OSS_HIDDEN, GPT_OSS_HIDDEN, GPT_OSS_EXPERTS, GPT_OSS_TOP_K, True),
        (QWEN_HIDDEN, QWEN_INTER, QWEN_EXPERTS, QWEN_TOP_K, False),
    ],
    ids=["gpt-oss", "qwen3-30b-a3b"],
)
@pytest.mark.parametrize(
    "config", [None, OneTokenFP4Config(4, 1024, 8, 512)], ids=["chosen", "4x1024"]
)
@pytest.mark.cuda
@needs_cuda
def test_one_token_decode_at_real_shapes_replays_in_a_cuda_graph(
    gen, hidden, inter, experts, top_k, biased, config
):
    """The one-token launches with bf16 activations, gpt-oss's with its biases and SwiGLU
    limit, captured once and replayed on new routes, per route (the engine's form): within
    bf16's rounding of the activations."""
    bank = mxfp4_bank(gen, experts, hidden=hidden, inter=inter)
    extras = {}
    if biased:
        extras = {
            "w13_bias": randn(gen, experts, 2 * inter) * 0.5,
            "w2_bias": randn(gen, experts, hidden) * 0.5,
            "swiglu_limit": 7.0,
        }
    x = randn(gen, 1, hidden, dtype=torch.bfloat16)
    slot_ids = route_table(gen, 1, top_k, experts, masked=0.25)
    weights = route_weights(gen, 1, top_k)

    def decode() -> torch.Tensor:
        return mxfp4_moe.fused_moe_decode_mxfp4(
            x, slot_ids, weights, *bank, config=config, reduce=False, **extras
        )

    decode()  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    slot_ids.copy_(route_table(gen, 1, top_k, experts, masked=0.25))
    graph.replay()
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank, reduce=False, **extras)
    assert_matches(out, ref, tol=3e-2)


@pytest.mark.parametrize("tokens", [64, 1024])
@pytest.mark.cuda
@needs_cuda
def test_grouped_at_gpt_oss_shape_never_waits_for_the_device(gen, tokens):
    h = GPT_OSS_HIDDEN
    bank = mxfp4_bank(gen, GPT_OSS_EXPERTS, hidden=h, inter=h)
    x = randn(gen, tokens, h, dtype=torch.bfloat16)
    expert_ids = route_table(gen, tokens, GPT_OSS_TOP_K, GPT_OSS_EXPERTS, masked=0.05)
    weights = route_weights(gen, tokens, GPT_OSS_TOP_K)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mxfp4_moe.grouped_moe_mxfp4(
            x, expert_ids, weights, *bank, layer_experts=GPT_OSS_EXPERTS, checked=False
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = mxfp4_moe.grouped_moe_mxfp4_ref(x, expert_ids, weights, *bank)
    assert_matches(out, ref, tol=3e-2)


def gpt_oss_extras(gen: torch.Generator, slots: int, limit: float = 0.8) -> dict:
    """gpt-oss's biases (fp32, as the bank holds them) and a SwiGLU limit low enough to bite."""
    return {
        "w13_bias": randn(gen, slots, 2 * INTER).float() * 0.5,
        "w2_bias": randn(gen, slots, HIDDEN).float() * 0.5,
        "swiglu_limit": limit,
    }


def test_references_add_gpt_oss_biases_and_clamp_as_the_dense_ones(gen):
    x = randn(gen, 4, HIDDEN)
    expert_ids = route_table(gen, 4, 2, 5, masked=0.2)
    weights = route_weights(gen, 4, 2)
    bank = mxfp4_bank(gen, 5)
    extras = gpt_oss_extras(gen, 5)
    dense = mxfp4_moe.dequantized_bank(*bank)
    ref = mxfp4_moe.grouped_moe_mxfp4_ref(x, expert_ids, weights, *bank, **extras)
    dense_ref = grouped_moe.grouped_moe_ref(x, expert_ids, weights, *dense, **extras)
    assert_matches(ref, dense_ref, tol=1e-6)
    plain = mxfp4_moe.grouped_moe_mxfp4_ref(x, expert_ids, weights, *bank)
    assert (ref - plain).abs().max() > 0.1  # the biases and the clamp change the output


@pytest.mark.parametrize("reduce", [True, False])
def test_decode_adds_gpt_oss_biases_and_clamps(gen, reduce):
    """The biases added to the fp32 sums, the clamped SwiGLU, and reduce=False's per-route
    outputs (as the engine's decode takes them), against the reference."""
    x = randn(gen, 3, HIDDEN)
    slot_ids = route_table(gen, 3, 4, 6, masked=0.2)
    weights = route_weights(gen, 3, 4)
    bank = mxfp4_bank(gen, 6)
    extras = gpt_oss_extras(gen, 6)
    config = DotDecodeConfig(32, 64)
    out = mxfp4_moe.fused_moe_decode_mxfp4(
        x, slot_ids, weights, *bank, config=config, reduce=reduce, **extras
    )
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, *bank, reduce=reduce, **extras)
    assert out.shape == ref.shape == ((3, HIDDEN) if reduce else (3, 4, HIDDEN))
    assert_matches(out, ref, tol=1e-5)


def test_grouped_adds_gpt_oss_biases_and_clamps(gen):
    x = randn(gen, 9, HIDDEN)
    expert_ids = route_table(gen, 9, 3, 6, masked=0.2)
    weights = route_weights(gen, 9, 3)
    bank = mxfp4_bank(gen, 6)
    extras = gpt_oss_extras(gen, 6)
    out = mxfp4_moe.grouped_moe_mxfp4(x, expert_ids, weights, *bank, config=GROUPED, **extras)
    ref = mxfp4_moe.grouped_moe_mxfp4_ref(x, expert_ids, weights, *bank, **extras)
    assert_matches(out, ref, tol=1e-5)
