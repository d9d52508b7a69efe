"""Decode MoE kernel against its torch reference (interpreter on CPU, fp32, small shapes)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import fused_moe, fused_moe_one_token
from moelab.kernels.fused_moe import DecodeMoEConfig
from moelab.kernels.fused_moe_one_token import OneTokenMoEConfig

from .kernel_inputs import DEVICE, assert_matches, randn, route_table, route_weights

pytestmark = pytest.mark.usefixtures("triton_runs")

SMALL_BLOCKS = DecodeMoEConfig(gate_up_block_k=64, down_block_k=16)


def experts(gen: torch.Generator, slots: int, hidden: int, inter: int, dtype=torch.float32):
    """w13 [S, 2I, H] and w2 [S, H, I] scaled so that activations stay near 1."""
    w13 = randn(gen, slots, 2 * inter, hidden, scale=hidden**-0.5, dtype=dtype)
    w2 = randn(gen, slots, hidden, inter, scale=inter**-0.5, dtype=dtype)
    return w13, w2


@pytest.mark.parametrize(
    ("tokens", "top_k", "hidden", "inter", "slots", "config"),
    [
        (1, 8, 64, 32, 10, None),  # one token, eight routes (the one-token kernels)
        (1, 8, 64, 32, 10, DecodeMoEConfig()),  # one token through the tl.dot kernels
        (3, 4, 200, 40, 6, SMALL_BLOCKS),  # odd sizes, several reduction steps, shared slots
        (5, 2, 48, 24, 3, None),  # every slot shared by several tokens
        (70, 2, 32, 16, 4, None),  # more tokens than one launch takes
    ],
)
def test_matches_reference_with_masked_routes(gen, tokens, top_k, hidden, inter, slots, config):
    x = randn(gen, tokens, hidden)
    slot_ids = route_table(gen, tokens, top_k, slots, masked=0.25)
    cpu_token = tokens // 2 if tokens > 1 else None
    if cpu_token is not None:
        slot_ids[cpu_token] = -1  # one token whose routes all run on the CPU
    weights = route_weights(gen, tokens, top_k)
    w13, w2 = experts(gen, slots, hidden, inter)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2)
    assert_matches(out, ref, tol=1e-5)
    assert ref.abs().max().item() > 0  # the comparison is not between zeros
    if cpu_token is not None:
        assert out[cpu_token].abs().max().item() == 0.0


def test_slot_named_twice_by_one_token_counts_twice(gen):
    x = randn(gen, 2, 64)
    slot_ids = torch.tensor([[3, 1, 3], [1, -1, 1]], dtype=torch.int32, device=DEVICE)
    weights = route_weights(gen, 2, 3)
    w13, w2 = experts(gen, 4, 64, 32)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2)
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2)
    assert_matches(out, ref, tol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_unreduced_parts_sum_to_the_result(gen, tokens):
    # reduce=False: one fp32 row per route, for the next residual add to sum (no sum launch)
    x = randn(gen, tokens, 48)
    slot_ids = route_table(gen, tokens, 4, 5, masked=0.25)
    slot_ids[0, 1] = slot_ids[0, 0] = 2  # a slot named twice by one token
    slot_ids[-1, 3] = -1  # a route that runs on the CPU
    weights = route_weights(gen, tokens, 4)
    w13, w2 = experts(gen, 5, 48, 24)
    parts = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, reduce=False)
    ref_parts = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2, reduce=False)
    assert parts.shape == ref_parts.shape == (tokens, 4, 48) and parts.dtype == torch.float32
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2)
    assert_matches(parts.sum(dim=1), ref, tol=1e-5)
    assert_matches(ref_parts.sum(dim=1), ref, tol=1e-6)
    # masked routes hold zeros in both
    masked = slot_ids < 0
    assert masked.any() and (parts[masked] == 0).all() and (ref_parts[masked] == 0).all()


def test_all_routes_masked_gives_zeros(gen):
    x = randn(gen, 4, 32)
    slot_ids = torch.full((4, 2), -1, dtype=torch.int32, device=DEVICE)
    w13, w2 = experts(gen, 2, 32, 16)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, route_weights(gen, 4, 2), w13, w2)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.zeros_like(out))


def test_bf16_storage_with_fp32_compute(gen):
    x = randn(gen, 2, 96, dtype=torch.bfloat16)
    slot_ids = route_table(gen, 2, 4, 5)
    weights = route_weights(gen, 2, 4)
    w13, w2 = experts(gen, 5, 96, 48, dtype=torch.bfloat16)
    out = fused_moe.fused_moe_decode_triton(
        x, slot_ids, weights, w13, w2, compute_dtype=torch.float32
    )
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2, compute_dtype=torch.float32)
    assert_matches(out, ref, tol=1e-5)


def test_int64_slot_ids_accepted(gen):
    x = randn(gen, 2, 32)
    slot_ids = route_table(gen, 2, 2, 3).long()
    weights = route_weights(gen, 2, 2)
    w13, w2 = experts(gen, 3, 32, 16)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2)
    assert_matches(out, fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2), tol=1e-5)


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


def test_config_rejects_block_too_small_for_tl_dot():
    with pytest.raises(ValueError, match="power of two >= 16"):
        DecodeMoEConfig(gate_up_block_n=8)


@pytest.mark.parametrize("tokens", [1, 3])
def test_masked_routes_weights_are_not_read(gen, tokens):
    # the CPU computes masked routes: whatever their weights hold, the GPU part ignores them
    x = randn(gen, tokens, 48)
    slot_ids = route_table(gen, tokens, 4, 5)
    slot_ids[:, 1] = -1
    weights = route_weights(gen, tokens, 4)
    weights[:, 1] = float("nan")
    w13, w2 = experts(gen, 5, 48, 24)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, reduce=False)
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2, reduce=False)
    assert_matches(out.sum(dim=1), ref.sum(dim=1), tol=1e-5)
    assert (out[:, 1] == 0).all()


def test_one_token_takes_the_one_token_kernels_unless_told(gen, monkeypatch):
    calls = []

    def spy(module: object, name: str) -> None:
        real = getattr(module, name)

        def run(*args: object) -> None:
            cfg = args[-1]
            calls.append(f"{name} looping" if getattr(cfg, "loop_routes", False) else name)
            real(*args)

        monkeypatch.setattr(module, name, run)

    spy(fused_moe_one_token, "launch")
    spy(fused_moe, "_tokens")
    x = randn(gen, 2, 32)
    slot_ids = route_table(gen, 2, 2, 3)
    weights = route_weights(gen, 2, 2)
    w13, w2 = experts(gen, 3, 32, 16)
    args = (slot_ids[:1], weights[:1], w13, w2)
    fused_moe.fused_moe_decode_triton(x[:1], *args)
    fused_moe.fused_moe_decode_triton(x[:1], *args, config=DecodeMoEConfig())
    fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2)
    # few live routes: the one-token kernels' row blocks loop over the routes; more tokens: tl.dot
    fused_moe.fused_moe_decode_triton(x[:1], *args, few_routes=True)
    fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, few_routes=True)
    assert calls == ["launch", "_tokens", "_tokens", "launch looping", "_tokens"]


def test_one_token_config_refuses_more_tokens(gen):
    x = randn(gen, 2, 32)
    w13, w2 = experts(gen, 3, 32, 16)
    with pytest.raises(ValueError, match="one token, got 2"):
        fused_moe.fused_moe_decode_triton(
            x,
            route_table(gen, 2, 2, 3),
            route_weights(gen, 2, 2),
            w13,
            w2,
            config=OneTokenMoEConfig(),
        )
