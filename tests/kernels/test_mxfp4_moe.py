"""The MoE kernels over MXFP4 expert banks against the reference on the dequantized weights
(interpreter on CPU, fp32 activations, small shapes; natively on a GPU, bf16 too)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import e2m1, grouped_moe, mxfp4, mxfp4_moe
from moelab.kernels.common import tl, triton
from moelab.kernels.grouped_moe import GroupedMoEConfig

from .kernel_inputs import DEVICE, assert_matches, randn, route_table, route_weights

pytestmark = pytest.mark.usefixtures("triton_runs")

# Whole 32-blocks, but not whole steps of the tiles: the last step ends inside a block pair.
HIDDEN, INTER = 224, 96
GROUPED = GroupedMoEConfig(16, 32, 32, 64, num_warps=4, num_stages=2)
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
    tl.store(values_ptr + i, mxfp4_moe.values(tl.load(codes_ptr + i).to(tl.int32)))
    tl.store(factors_ptr + i, mxfp4_moe.scales(tl.load(scales_ptr + i).to(tl.int32)))


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
    tl.store(out_ptr + rows * 8 * WORDS + tl.arange(0, 8 * WORDS)[None, :], mxfp4_moe.halves(words))


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


@pytest.mark.parametrize("tokens, top_k, slots", [(1, 4, 6), (3, 2, 5), (2, 4, 4)])
@pytest.mark.parametrize("block_n, block_k", [(16, 64), (32, 128)])
def test_decode_matches_the_dequantized_reference(gen, tokens, top_k, slots, block_n, block_k):
    x = randn(gen, tokens, HIDDEN)
    slot_ids = route_table(gen, tokens, top_k, slots, masked=0.2)
    weights = route_weights(gen, tokens, top_k)
    bank = mxfp4_bank(gen, slots)
    out = mxfp4_moe.fused_moe_decode_mxfp4(
        x, slot_ids, weights, *bank, block_n=block_n, block_k=block_k
    )
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
    out = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank, block_k=64)
    assert_matches(out, ref, tol=1e-5)
    parts = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, *bank, reduce=False)
    assert_matches(parts.sum(dim=1), ref, tol=1e-5)


def test_decode_reads_the_top_scale_code_exactly(gen):
    """gate/up blocks at E8M0 251-254, whose weights of magnitude 2 and more overflow fp32,
    against activations small enough that the sums do not: the output of the same blocks 100
    binades down with the activations 100 binades up, which the reference can form."""
    magnitudes = 0.5 + torch.rand(3, HIDDEN, generator=gen)
    x = (magnitudes * torch.randn(3, HIDDEN, generator=gen).sign()).to(DEVICE)
    slot_ids = route_table(gen, 3, 4, 6, masked=0.2)
    weights = route_weights(gen, 3, 4)
    w13, w2, s13, s2 = mxfp4_bank(gen, 6)
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
    out = mxfp4_moe.fused_moe_decode_mxfp4(x, slot_ids, weights, w13, w2, s13, s2, block_k=64)
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slot_ids, weights, w13, w2, s13, s2)
    routed = (slot_ids == slot).any(dim=1)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[:, row].isnan().equal(routed) and out.isnan().sum() == routed.sum()
    keep = torch.ones(HIDDEN, dtype=torch.bool, device=out.device)
    keep[row] = False
    assert_matches(out[:, keep], ref[:, keep], tol=1e-5)


def test_decode_refuses_row_blocks_narrower_than_tl_dot_takes(gen):
    bank = mxfp4_bank(gen, 3)
    with pytest.raises(ValueError, match="block_n one >= 16"):
        mxfp4_moe.fused_moe_decode_mxfp4(
            randn(gen, 1, HIDDEN), route_table(gen, 1, 2, 3), route_weights(gen, 1, 2), *bank,
            block_n=8,
        )  # fmt: skip


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
    out = mxfp4_moe.fused_moe_decode_mxfp4(
        x, slot_ids, weights, *bank, block_n=16, block_k=64, reduce=reduce, **extras
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
