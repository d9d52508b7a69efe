"""The MoE kernels over NVFP4 expert banks against the reference on the weights nvfp4.dequantize
gives (interpreter on CPU, fp32 activations, small shapes; natively on a GPU, bf16 too)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import common, fp4_widen, fp8, grouped_moe, nvfp4, nvfp4_moe
from moelab.kernels.common import tl, triton
from moelab.kernels.fp4_one_token import OneTokenFP4Config
from moelab.kernels.grouped_moe import GroupedMoEConfig
from moelab.kernels.mxfp4_moe import DotDecodeConfig

from .kernel_inputs import DEVICE, assert_matches, randn, route_table, route_weights

pytestmark = pytest.mark.usefixtures("triton_runs")

# Whole 16-blocks, not whole 32-blocks nor whole steps of the tiles.
HIDDEN, INTER = 112, 48
GROUPED = GroupedMoEConfig(16, 32, 32, 64, num_warps=4, num_stages=2)
# The one-token launches' tiles: rows of 56 and 24 bytes, read in 8-byte vectors; a step of one
# vector a thread, and one wider than the rows.
ONE_TOKEN = [
    OneTokenFP4Config(4, 64, 8, 32, num_warps=1, num_stages=2),
    OneTokenFP4Config(16, 256, 4, 128, num_warps=2, num_stages=3, down_stages=3),
]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def nvfp4_bank(gen: torch.Generator, slots: int, hidden: int = HIDDEN, inter: int = INTER):
    """Random experts quantized to NVFP4 (nvfp4.quantize; gate and up apart, as ModelOpt does),
    rows and tensors of scales binades apart, so that a scale taken from the wrong block, row or
    tensor shows: (w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2)."""

    def quantized(*shape: int) -> tuple[torch.Tensor, ...]:
        w = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
        rows = torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float())
        tensors = torch.exp2(torch.randint(-6, 7, (shape[0], 1, 1), generator=gen).float())
        values, scale, scale_2 = nvfp4.quantize(w * rows * tensors)
        return values.to(DEVICE), scale.to(DEVICE), scale_2.to(DEVICE)

    gate, up = quantized(slots, inter, hidden), quantized(slots, inter, hidden)
    down = quantized(slots, hidden, inter)
    return (
        torch.cat([gate[0], up[0]], dim=1),
        down[0],
        torch.cat([gate[1], up[1]], dim=1),
        down[1],
        torch.stack([gate[2], up[2]], dim=1),
        down[2][:, None],
    )


@triton.jit
def _scales_kernel(codes_ptr, factors_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(factors_ptr + i, fp4_widen.e4m3_scales(tl.load(codes_ptr + i).to(tl.int32)))


def test_widening_builds_every_e4m3_scale_exactly():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    factors = torch.empty(256, device=DEVICE)
    _scales_kernel[(1,)](codes, factors, N=256)
    expected = fp8.widen(codes.cpu())  # e4m3 decoded by its definition
    finite = expected.isfinite()
    assert torch.equal(factors.cpu()[finite], expected[finite])
    assert factors.cpu()[~finite].isnan().all() and (~finite).sum() == 2
    assert torch.equal(torch.signbit(factors.cpu()[1:]), torch.arange(1, 256) >= 128)


@pytest.mark.parametrize("tokens, top_k, slots", [(1, 4, 6), (3, 2, 5)])
@pytest.mark.parametrize("block_n, block_k", [(16, 64), (32, 128)])
def test_decode_matches_the_dequantized_reference(gen, tokens, top_k, slots, block_n, block_k):
    x = randn(gen, tokens, HIDDEN)
    slot_ids = route_table(gen, tokens, top_k, slots, masked=0.2)
    weights = route_weights(gen, tokens, top_k)
    bank = nvfp4_bank(gen, slots)
    config = DotDecodeConfig(block_n, block_k)
    out = nvfp4_moe.fused_moe_decode_nvfp4(x, slot_ids, weights, *bank, config=config)
    ref = nvfp4_moe.fused_moe_decode_nvfp4_ref(x, slot_ids, weights, *bank)
    assert_matches(out, ref, tol=1e-5)


def test_decode_gives_each_route_its_output_unsummed(gen):
    x = randn(gen, 3, HIDDEN)
    slot_ids = route_table(gen, 3, 4, 6, masked=0.2)
    weights = route_weights(gen, 3, 4)
    bank = nvfp4_bank(gen, 6)
    out = nvfp4_moe.fused_moe_decode_nvfp4(x, slot_ids, weights, *bank, reduce=False)
    ref = nvfp4_moe.fused_moe_decode_nvfp4_ref(x, slot_ids, weights, *bank, reduce=False)
    assert out.shape == (3, 4, HIDDEN)
    assert_matches(out, ref, tol=1e-5)


@pytest.mark.parametrize("config", [*ONE_TOKEN, None], ids=["one-block", "wide", "chosen"])
def test_one_token_decode_matches_the_dequantized_reference(gen, monkeypatch, config):
    """One token through the one-token launches (also without a config: the default at T=1):
    each route's weighted output as the reference's, zeros where a route is masked."""
    # a device of one SM: the chosen tiles' widest row blocks, the fewest programs to interpret
    monkeypatch.setattr(common, "sm_count", lambda device: 1)
    x = randn(gen, 1, HIDDEN)
    slot_ids = route_table(gen, 1, 4, 6, masked=0.3)
    weights = route_weights(gen, 1, 4)
    bank = nvfp4_bank(gen, 6)
    parts = nvfp4_moe.fused_moe_decode_nvfp4(
        x, slot_ids, weights, *bank, config=config, reduce=False
    )
    ref = nvfp4_moe.fused_moe_decode_nvfp4_ref(x, slot_ids, weights, *bank, reduce=False)
    assert_matches(parts, ref, tol=1e-5)


def test_one_token_decode_reads_every_e4m3_scale_and_a_repeated_slot(gen):
    """Block scales over every finite e4m3 code (subnormals, both signs) and every byte of
    values, a slot named twice: each route's own weighted output, as the reference's."""
    x = randn(gen, 1, HIDDEN)
    # every slot routed, so that each of them holds every code
    slot_ids = torch.tensor([[1, 0, 1]], dtype=torch.int32, device=DEVICE)
    weights = route_weights(gen, 1, 3)
    w13, w2, s13, s2, t13, t2 = nvfp4_bank(gen, 2)
    finite = torch.tensor([c for c in range(256) if c & 127 != 127], dtype=torch.uint8)

    def every(t: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        tiled = codes.repeat(t.numel() // codes.numel() + 1)
        picked = tiled[torch.randperm(t.numel(), generator=gen)].view(t.shape)
        return picked.to(DEVICE).view(t.dtype)

    every_byte = torch.arange(256, dtype=torch.uint8)
    bank = (every(w13, every_byte), every(w2, every_byte), every(s13, finite), every(s2, finite))
    parts = nvfp4_moe.fused_moe_decode_nvfp4(
        x, slot_ids, weights, *bank, t13, t2, config=ONE_TOKEN[1], reduce=False
    )
    ref = nvfp4_moe.fused_moe_decode_nvfp4_ref(x, slot_ids, weights, *bank, t13, t2, reduce=False)
    assert_matches(parts, ref, tol=1e-5)
    assert parts[0, 0].abs().max() > 0 and parts[0, 2].abs().max() > 0


def test_one_token_decode_gives_nan_where_a_block_has_a_nan_scale(gen):
    """e4m3 0x7F in one block of a down row of a routed slot: that row of that route is NaN,
    every other output as the reference's."""
    x = randn(gen, 1, HIDDEN)
    slot_ids = route_table(gen, 1, 3, 5)
    weights = route_weights(gen, 1, 3)
    w13, w2, s13, s2, t13, t2 = nvfp4_bank(gen, 5)
    s2 = s2.clone()
    s2.view(torch.uint8)[int(slot_ids[0, 2]), 11, 1] = 0x7F
    bank = (w13, w2, s13, s2, t13, t2)
    parts = nvfp4_moe.fused_moe_decode_nvfp4(
        x, slot_ids, weights, *bank, config=ONE_TOKEN[0], reduce=False
    )
    ref = nvfp4_moe.fused_moe_decode_nvfp4_ref(x, slot_ids, weights, *bank, reduce=False)
    assert torch.equal(parts.isnan(), ref.isnan()) and parts.isnan().sum() == 1
    assert parts[0, 2, 11].isnan()
    assert_matches(parts.nan_to_num(), ref.nan_to_num(), tol=1e-5)


@pytest.mark.parametrize("tokens, top_k, experts, masked", [(5, 2, 4, 0.0), (9, 3, 6, 0.2)])
def test_grouped_matches_the_dequantized_reference(gen, tokens, top_k, experts, masked):
    x = randn(gen, tokens, HIDDEN)
    expert_ids = route_table(gen, tokens, top_k, experts, masked=masked)
    weights = route_weights(gen, tokens, top_k)
    bank = nvfp4_bank(gen, experts)
    out = nvfp4_moe.grouped_moe_nvfp4(x, expert_ids, weights, *bank, config=GROUPED)
    ref = nvfp4_moe.grouped_moe_nvfp4_ref(x, expert_ids, weights, *bank)
    assert_matches(out, ref, tol=1e-5)


def test_reference_is_the_dense_kernels_on_each_tensors_dequantized_weights(gen):
    """The reference widens gate, up and down each by its own per-tensor scale (nvfp4's
    definition), then runs grouped_moe's reference."""
    x = randn(gen, 4, HIDDEN)
    expert_ids = route_table(gen, 4, 2, 5)
    weights = route_weights(gen, 4, 2)
    bank = nvfp4_bank(gen, 5)
    w13, w2, s13, s2, t13, t2 = bank
    gate = nvfp4.dequantize(w13[:, :INTER], s13[:, :INTER], t13[:, 0])
    up = nvfp4.dequantize(w13[:, INTER:], s13[:, INTER:], t13[:, 1])
    down = nvfp4.dequantize(w2, s2, t2[:, 0])
    dense = (torch.cat([gate, up], dim=1), down)
    ref = nvfp4_moe.grouped_moe_nvfp4_ref(x, expert_ids, weights, *bank)
    assert_matches(ref, grouped_moe.grouped_moe_ref(x, expert_ids, weights, *dense), tol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: (b[0].view(torch.int8), *b[1:]), r"w13 must be NVFP4 values"),
        (lambda b: (*b[:2], b[2].view(torch.uint8), *b[3:]), r"w13_scale must be the e4m3"),
        (lambda b: (*b[:4], b[4][:, :1].contiguous(), b[5]), r"w13_scale_2 must be fp32"),
        (
            lambda b: (b[0], b[1][:, :32].contiguous(), b[2], b[3][:, :32].contiguous(), *b[4:]),
            "does not fit",
        ),
    ],
)
def test_a_bank_that_does_not_fit_its_scales_is_refused(gen, change, message):
    bank = nvfp4_bank(gen, 3)
    x = randn(gen, 1, HIDDEN)
    with pytest.raises(ValueError, match=message):
        nvfp4_moe.fused_moe_decode_nvfp4(
            x, route_table(gen, 1, 2, 3), route_weights(gen, 1, 2), *change(bank)
        )


@pytest.mark.cuda
@needs_cuda
def test_bf16_activations_on_the_gpu(gen):
    """bf16 activations into tl.dot with the widened weights in bf16 (exact there), in the
    prefill and in the decode: within bf16's rounding of the activations and the gate/up
    outputs."""
    x = randn(gen, 40, HIDDEN, dtype=torch.bfloat16)
    expert_ids = route_table(gen, 40, 4, 8)
    weights = route_weights(gen, 40, 4)
    bank = nvfp4_bank(gen, 8)
    ref = nvfp4_moe.grouped_moe_nvfp4_ref(x, expert_ids, weights, *bank)
    out = nvfp4_moe.grouped_moe_nvfp4(x, expert_ids, weights, *bank)
    assert_matches(out, ref, tol=3e-2)
    decoded = nvfp4_moe.fused_moe_decode_nvfp4(x[:1], expert_ids[:1], weights[:1], *bank)
    ref1 = nvfp4_moe.fused_moe_decode_nvfp4_ref(x[:1], expert_ids[:1], weights[:1], *bank)
    assert_matches(decoded, ref1, tol=3e-2)


# Qwen3.6-35B-A3B's experts: H = 2048, I = 512, 256 of them, top-8 (32 here: the kernels' cost
# is per route, and 32 keep the test's memory small).
QWEN_HIDDEN, QWEN_INTER, QWEN_EXPERTS, QWEN_TOP_K = 2048, 512, 32, 8


@pytest.mark.parametrize(
    "tokens, config",
    [(1, None), (1, OneTokenFP4Config(4, 1024, 8, 512)), (1, DotDecodeConfig()), (4, None)],
    ids=["one-token", "one-token-4x1024", "tl.dot-1", "tl.dot-4"],
)
@pytest.mark.cuda
@needs_cuda
def test_decode_at_qwen3_6_shape_replays_in_a_cuda_graph(gen, tokens, config):
    """bf16 activations at the NVFP4 release's shapes, through the one-token launches (one
    token's default) and the tl.dot ones, captured once and replayed on new routes (within
    bf16's rounding, as the prefill's)."""
    bank = nvfp4_bank(gen, QWEN_EXPERTS, hidden=QWEN_HIDDEN, inter=QWEN_INTER)
    x = randn(gen, tokens, QWEN_HIDDEN, dtype=torch.bfloat16)
    slot_ids = route_table(gen, tokens, QWEN_TOP_K, QWEN_EXPERTS, masked=0.25)
    weights = route_weights(gen, tokens, QWEN_TOP_K)
    nvfp4_moe.fused_moe_decode_nvfp4(x, slot_ids, weights, *bank, config=config)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4_moe.fused_moe_decode_nvfp4(x, slot_ids, weights, *bank, config=config)
    slot_ids.copy_(route_table(gen, tokens, QWEN_TOP_K, QWEN_EXPERTS, masked=0.25))
    graph.replay()
    ref = nvfp4_moe.fused_moe_decode_nvfp4_ref(x, slot_ids, weights, *bank)
    assert_matches(out, ref, tol=3e-2)


@pytest.mark.parametrize("tokens", [64, 1024])
@pytest.mark.cuda
@needs_cuda
def test_grouped_at_qwen3_6_shape_never_waits_for_the_device(gen, tokens):
    bank = nvfp4_bank(gen, QWEN_EXPERTS, hidden=QWEN_HIDDEN, inter=QWEN_INTER)
    x = randn(gen, tokens, QWEN_HIDDEN, dtype=torch.bfloat16)
    expert_ids = route_table(gen, tokens, QWEN_TOP_K, QWEN_EXPERTS, masked=0.05)
    weights = route_weights(gen, tokens, QWEN_TOP_K)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = nvfp4_moe.grouped_moe_nvfp4(
            x, expert_ids, weights, *bank, layer_experts=QWEN_EXPERTS, checked=False
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = nvfp4_moe.grouped_moe_nvfp4_ref(x, expert_ids, weights, *bank)
    assert_matches(out, ref, tol=3e-2)
