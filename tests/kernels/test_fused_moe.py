"""Decode MoE kernel against its torch reference (interpreter on CPU, fp32, small shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelab.kernels import fused_moe
from moelab.kernels.fused_moe import DecodeMoEConfig

from .kernel_inputs import DEVICE, assert_matches, randn, route_table, route_weights

pytestmark = pytest.mark.usefixtures("triton_runs")

# Several reduction steps in every launch, and (fused) several batches of routes per program.
SMALL_BLOCKS = DecodeMoEConfig(
    gate_up_block_k=64, down_block_k=16, down_sum_block_k=16, down_sum_route_batch=4
)
# The down projection's two ways: one launch that also sums over routes, or a launch and a sum.
BOTH_PATHS = pytest.mark.parametrize("fuse_sum", [True, False], ids=["fused", "unfused"])


def with_path(config: DecodeMoEConfig | None, fuse_sum: bool) -> DecodeMoEConfig:
    return dataclasses.replace(config or DecodeMoEConfig(), fuse_sum=fuse_sum)


def experts(gen: torch.Generator, slots: int, hidden: int, inter: int, dtype=torch.float32):
    """w13 [S, 2I, H] and w2 [S, H, I] scaled so that activations stay near 1."""
    w13 = randn(gen, slots, 2 * inter, hidden, scale=hidden**-0.5, dtype=dtype)
    w2 = randn(gen, slots, hidden, inter, scale=inter**-0.5, dtype=dtype)
    return w13, w2


@BOTH_PATHS
@pytest.mark.parametrize(
    ("tokens", "top_k", "hidden", "inter", "slots", "config"),
    [
        (1, 8, 64, 32, 10, None),  # one token, eight routes
        (1, 1, 32, 16, 2, None),  # one route in all
        (3, 4, 200, 40, 6, SMALL_BLOCKS),  # odd sizes, several reduction steps, shared slots
        (5, 2, 48, 24, 3, None),  # every slot shared by several tokens
        (64, 8, 32, 16, 12, None),  # one full launch, each slot named by ~40 tokens
        (70, 2, 32, 16, 4, None),  # more tokens than one launch takes
        (131, 3, 32, 16, 9, SMALL_BLOCKS),  # three launches, the last of three tokens
    ],
)
def test_matches_reference_with_masked_routes(
    gen, tokens, top_k, hidden, inter, slots, config, fuse_sum
):
    x = randn(gen, tokens, hidden)
    # With one route a token, masking at random could leave nothing to compare.
    slot_ids = route_table(gen, tokens, top_k, slots, masked=0.25 if top_k > 1 else 0.0)
    cpu_token = tokens // 2 if tokens > 1 else None
    if cpu_token is not None:
        slot_ids[cpu_token] = -1  # one token whose routes all run on the CPU
    weights = route_weights(gen, tokens, top_k)
    w13, w2 = experts(gen, slots, hidden, inter)
    config = with_path(config, fuse_sum)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2)
    assert_matches(out, ref, tol=1e-5)
    assert ref.abs().max().item() > 0  # the comparison is not between zeros
    if cpu_token is not None:
        assert out[cpu_token].abs().max().item() == 0.0


@BOTH_PATHS
def test_slot_named_twice_by_one_token_counts_twice(gen, fuse_sum):
    x = randn(gen, 2, 64)
    slot_ids = torch.tensor([[3, 1, 3], [1, -1, 1]], dtype=torch.int32, device=DEVICE)
    weights = route_weights(gen, 2, 3)
    w13, w2 = experts(gen, 4, 64, 32)
    config = with_path(None, fuse_sum)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2)
    assert_matches(out, ref, tol=1e-5)


@BOTH_PATHS
def test_all_routes_masked_gives_zeros(gen, fuse_sum):
    x = randn(gen, 4, 32)
    slot_ids = torch.full((4, 2), -1, dtype=torch.int32, device=DEVICE)
    w13, w2 = experts(gen, 2, 32, 16)
    weights = route_weights(gen, 4, 2)
    config = with_path(None, fuse_sum)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.zeros_like(out))


@BOTH_PATHS
def test_repeated_calls_give_identical_bits(gen, fuse_sum):
    """CUDA graph replay is compared with eager steps token for token: no run-to-run noise."""
    x = randn(gen, 6, 64)
    slot_ids = route_table(gen, 6, 4, 5, masked=0.25)
    weights = route_weights(gen, 6, 4)
    w13, w2 = experts(gen, 5, 64, 32)
    config = with_path(None, fuse_sum)
    first = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    second = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)


@BOTH_PATHS
def test_bf16_storage_with_fp32_compute(gen, fuse_sum):
    x = randn(gen, 2, 96, dtype=torch.bfloat16)
    slot_ids = route_table(gen, 2, 4, 5)
    weights = route_weights(gen, 2, 4)
    w13, w2 = experts(gen, 5, 96, 48, dtype=torch.bfloat16)
    config = with_path(None, fuse_sum)
    out = fused_moe.fused_moe_decode_triton(
        x, slot_ids, weights, w13, w2, compute_dtype=torch.float32, config=config
    )
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2, compute_dtype=torch.float32)
    assert_matches(out, ref, tol=1e-5)


@BOTH_PATHS
def test_int64_slot_ids_accepted(gen, fuse_sum):
    x = randn(gen, 2, 32)
    slot_ids = route_table(gen, 2, 2, 3).long()
    weights = route_weights(gen, 2, 2)
    w13, w2 = experts(gen, 3, 32, 16)
    config = with_path(None, fuse_sum)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    assert_matches(out, fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2), tol=1e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Qwen3-30B-A3B's MoE: what the engine runs in bf16 each decode step.
HIDDEN, INTER, TOP_K = 2048, 768, 8


def qwen3_layer(gen: torch.Generator, tokens: int, slots: int):
    """bf16 inputs at the real shape: x, slot ids with a quarter masked, weights, w13, w2."""
    x = randn(gen, tokens, HIDDEN, dtype=torch.bfloat16)
    slot_ids = route_table(gen, tokens, TOP_K, slots, masked=0.25)
    weights = route_weights(gen, tokens, TOP_K)
    w13, w2 = experts(gen, slots, HIDDEN, INTER, dtype=torch.bfloat16)
    return x, slot_ids, weights, w13, w2


@pytest.mark.cuda
@needs_cuda
@BOTH_PATHS
@pytest.mark.parametrize(("tokens", "slots"), [(1, 64), (16, 24), (64, 128), (80, 16)])
def test_real_shapes_in_bf16(gen, tokens, slots, fuse_sum):
    args = qwen3_layer(gen, tokens, slots)
    config = with_path(None, fuse_sum)
    out = fused_moe.fused_moe_decode_triton(*args, config=config)
    ref_args = [t.float() if t.is_floating_point() else t for t in args]
    assert_matches(out, fused_moe.fused_moe_decode_ref(*ref_args), tol=2e-2)


@pytest.mark.cuda
@needs_cuda
@BOTH_PATHS
def test_graph_replay_gives_the_eager_bits(gen, fuse_sum):
    """The engine compares CUDA graph replay with eager steps token for token."""
    x, slot_ids, weights, w13, w2 = qwen3_layer(gen, 4, 32)
    config = with_path(None, fuse_sum)
    eager = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    graph.replay()
    assert torch.equal(replayed, eager)
    # New routing in the captured buffers, as each step brings.
    slot_ids.copy_(route_table(gen, 4, TOP_K, 32, masked=0.25))
    graph.replay()
    eager = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    assert torch.equal(replayed, eager)


def test_cpu_tensors_go_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(fused_moe, "fused_moe_decode_triton", refuse)
    x = torch.randn(2, 32, generator=gen)
    slot_ids = torch.tensor([[0, -1], [1, 0]], dtype=torch.int32)
    weights = torch.rand(2, 2, generator=gen)
    w13 = torch.randn(2, 32, 32, generator=gen)
    w2 = torch.randn(2, 32, 16, generator=gen)
    out = fused_moe.fused_moe_decode(x, slot_ids, weights, w13, w2)
    assert torch.equal(out, fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2))


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((2, 32), (2, 2), (2, 2), (3, 32, 32), (3, 32, 16)), None),
        (((2, 32), (3, 2), (3, 2), (3, 32, 32), (3, 32, 16)), "slot_ids"),
        (((2, 32), (2, 2), (2, 3), (3, 32, 32), (3, 32, 16)), "route_weights"),
        (((2, 32), (2, 2), (2, 2), (3, 31, 32), (3, 32, 16)), "w13"),
        (((2, 32), (2, 2), (2, 2), (3, 32, 32), (3, 32, 15)), "w2"),
    ],
)
def test_shape_errors_name_the_argument(shapes, message):
    x, slots, weights, w13, w2 = (torch.ones(s) for s in shapes)
    slots = slots.int()
    if message is None:
        fused_moe.fused_moe_decode_ref(x, slots, weights, w13, w2)
        return
    with pytest.raises(ValueError, match=message):
        fused_moe.fused_moe_decode_ref(x, slots, weights, w13, w2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gate_up_block_n", 8, "power of two >= 16"),
        ("down_sum_block_n", 8, "power of two >= 16"),
        ("down_sum_block_k", 48, "power of two >= 16"),
        ("down_sum_route_batch", 3, "power of two"),
        ("down_sum_num_stages", 0, "at least 1"),
    ],
)
def test_config_rejects_unusable_tiles(field, value, message):
    with pytest.raises(ValueError, match=f"{field} must be a {message}|{field} must be {message}"):
        DecodeMoEConfig(**{field: value})
