"""Prefill grouped MoE kernel against its torch reference (interpreter on CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import fused_moe, grouped_moe
from moelab.kernels.grouped_moe import BLOCK_M_CHOICES, GroupedMoEConfig, config_for

from .kernel_inputs import DEVICE, assert_matches, randn, route_table, route_weights

pytestmark = pytest.mark.usefixtures("triton_runs")

SMALL = GroupedMoEConfig(16, 16, 32, 32, num_warps=4, num_stages=2)


def experts(gen: torch.Generator, num: int, hidden: int, inter: int, dtype=torch.float32):
    """w13 [E, 2I, H] and w2 [E, H, I] scaled so that activations stay near 1."""
    w13 = randn(gen, num, 2 * inter, hidden, scale=hidden**-0.5, dtype=dtype)
    w2 = randn(gen, num, hidden, inter, scale=inter**-0.5, dtype=dtype)
    return w13, w2


@pytest.mark.parametrize(
    ("tokens", "top_k", "hidden", "inter", "num_experts", "config", "masked"),
    [
        (37, 3, 72, 40, 5, SMALL, 0.1),  # odd sizes, runs longer than one block, skipped routes
        (9, 2, 48, 24, 8, None, 0.0),  # some experts get no tokens
        (20, 4, 40, 20, 6, GroupedMoEConfig(32, 32, 16, 16, 4, 2), 0.3),
    ],
)
def test_matches_reference(gen, tokens, top_k, hidden, inter, num_experts, config, masked):
    x = randn(gen, tokens, hidden)
    expert_ids = route_table(gen, tokens, top_k, num_experts, masked=masked)
    weights = route_weights(gen, tokens, top_k)
    w13, w2 = experts(gen, num_experts, hidden, inter)
    out = grouped_moe.grouped_moe_triton(x, expert_ids, weights, w13, w2, config=config)
    ref = grouped_moe.grouped_moe_ref(x, expert_ids, weights, w13, w2)
    assert ref.abs().max().item() > 0
    assert_matches(out, ref, tol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "top_k", "slots", "used", "first", "layer_experts"),
    [(50, 2, 40, 3, 30, None), (30, 3, 12, 4, 8, 4)],
    ids=["few-slots-of-a-cache-used", "one-layer-of-a-cache-named"],
)
def test_routes_into_a_larger_cache(gen, tokens, top_k, slots, used, first, layer_experts):
    # w13 may be the whole expert cache, of which the routes name `used` slots from `first`; told
    # how many experts a layer has, the tiles and the grid follow those, and every route still
    # lands in one block of its own expert.
    x = randn(gen, tokens, 32)
    picks = route_table(gen, tokens, top_k, used, masked=0.15)
    expert_ids = torch.where(picks >= 0, picks + first, -1).to(torch.int32)
    weights = route_weights(gen, tokens, top_k)
    w13, w2 = experts(gen, slots, 32, 16)
    out = grouped_moe.grouped_moe_triton(
        x, expert_ids, weights, w13, w2, layer_experts=layer_experts, checked=False
    )
    assert_matches(out, grouped_moe.grouped_moe_ref(x, expert_ids, weights, w13, w2), tol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(41, 4, 9, 16), (41, 4, 9, 32), (300, 8, 1500, 16)],
    ids=["few-experts", "wider-blocks", "a-whole-cache-many-programs"],
)
def test_route_blocks_hold_each_kept_route_once(gen, tokens, top_k, experts, block_m):
    ids = route_table(gen, tokens, top_k, experts, masked=0.15)
    config = GroupedMoEConfig(block_m, 16, 16, 16, num_warps=4, num_stages=2)
    grouped = grouped_moe._group_routes(ids, experts, config, distinct=experts)
    flat = ids.reshape(-1).cpu()
    routes = grouped.routes.view(grouped.num_blocks, block_m).cpu()
    block_expert = grouped.block_expert.cpu()
    real = block_expert >= 0
    # the real blocks come first, and the grid bound holds them
    assert real.sum() >= 1 and not real[int(real.sum()) :].any()
    assert grouped.num_blocks == -(-flat.numel() // block_m) + min(experts, flat.numel())
    placed = routes[real].reshape(-1)
    placed = placed[placed >= 0]
    assert sorted(placed.tolist()) == (flat >= 0).nonzero().reshape(-1).tolist()
    for b in range(int(real.sum())):
        members = routes[b][routes[b] >= 0]
        assert members.numel() and (flat[members] == block_expert[b]).all()
    assert not (routes[~real] >= 0).any()
    # every row written: a route, or -1 for padding (the tests' buffers start poisoned)
    assert ((routes == -1) | (routes >= 0)).all()
    assert torch.equal(grouped.skipped.cpu(), flat < 0)


def test_all_routes_skipped_gives_zeros(gen):
    x = randn(gen, 3, 32)
    expert_ids = torch.full((3, 2), -1, dtype=torch.int32, device=DEVICE)
    w13, w2 = experts(gen, 2, 32, 16)
    out = grouped_moe.grouped_moe_triton(x, expert_ids, route_weights(gen, 3, 2), w13, w2)
    assert torch.equal(out, torch.zeros_like(out))


def test_bf16_storage_with_fp32_compute(gen):
    x = randn(gen, 12, 64, dtype=torch.bfloat16)
    expert_ids = route_table(gen, 12, 2, 4)
    weights = route_weights(gen, 12, 2)
    w13, w2 = experts(gen, 4, 64, 32, dtype=torch.bfloat16)
    out = grouped_moe.grouped_moe_triton(
        x, expert_ids, weights, w13, w2, compute_dtype=torch.float32
    )
    ref = grouped_moe.grouped_moe_ref(x, expert_ids, weights, w13, w2, compute_dtype=torch.float32)
    assert_matches(out, ref, tol=1e-5)


def test_reference_agrees_with_decode_reference(gen):
    x = torch.randn(6, 32, generator=gen)
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [2, 1], [-1, -1], [0, 1]], dtype=torch.int32)
    weights = torch.rand(6, 2, generator=gen)
    w13 = torch.randn(3, 32, 32, generator=gen)
    w2 = torch.randn(3, 32, 16, generator=gen)
    grouped = grouped_moe.grouped_moe_ref(x, ids, weights, w13, w2)
    decode = fused_moe.fused_moe_decode_ref(x, ids, weights, w13, w2)
    assert_matches(grouped, decode, tol=1e-5)


def test_expert_id_out_of_range_is_refused(gen):
    x = randn(gen, 2, 32)
    ids = torch.tensor([[0, 5], [1, 0]], dtype=torch.int32, device=DEVICE)
    w13, w2 = experts(gen, 2, 32, 16)
    with pytest.raises(ValueError, match="expert >= 2"):
        grouped_moe.grouped_moe_triton(x, ids, route_weights(gen, 2, 2), w13, w2)


def test_cpu_tensors_go_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(grouped_moe, "grouped_moe_triton", refuse)
    x = torch.randn(4, 32, generator=gen)
    ids = torch.tensor([[0, 1], [1, -1], [0, 1], [1, 0]], dtype=torch.int32)
    weights = torch.rand(4, 2, generator=gen)
    w13 = torch.randn(2, 32, 32, generator=gen)
    w2 = torch.randn(2, 32, 16, generator=gen)
    out = grouped_moe.grouped_moe(x, ids, weights, w13, w2)
    assert torch.equal(out, grouped_moe.grouped_moe_ref(x, ids, weights, w13, w2))


@pytest.mark.parametrize(
    ("per_expert", "block_m"), [(1, 16), (16, 16), (30, 32), (64, 64), (500, 128)]
)
def test_block_rows_follow_tokens_per_expert(per_expert, block_m):
    assert config_for(per_expert).block_m == block_m
    assert block_m in BLOCK_M_CHOICES
