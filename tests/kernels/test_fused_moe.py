"""Decode MoE kernel against its torch reference (interpreter on CPU, fp32, small shapes)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import fused_moe, gemv
from moelab.kernels.fused_moe import DecodeMoEConfig, OneTokenMoEConfig

from .kernel_inputs import DEVICE, assert_matches, randn, route_table, route_weights

pytestmark = pytest.mark.usefixtures("triton_runs")

SMALL_BLOCKS = DecodeMoEConfig(gate_up_block_k=64, down_block_k=16)
# One-token tiles smaller than ONE_TOKEN_HIDDEN and ONE_TOKEN_INTER and not dividing them: several
# row blocks and reduction steps per route, the last of each partial.
ONE_TOKEN_BLOCKS = OneTokenMoEConfig(
    gate_up_block_n=8, gate_up_block_k=16, down_block_n=16, down_block_k=16
)
ONE_TOKEN_HIDDEN, ONE_TOKEN_INTER = 72, 44


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


def one_token_routes(case: str, gen: torch.Generator, top_k: int, slots: int) -> torch.Tensor:
    """int32 [1, top_k] slot ids for a routing case of one token."""
    slot_ids = route_table(gen, 1, top_k, slots)
    if case == "some_masked":
        slot_ids[0, 1] = slot_ids[0, 3] = -1
    elif case == "all_masked":
        slot_ids[:] = -1
    elif case == "duplicate":
        slot_ids[0, 2] = slot_ids[0, 0]
    return slot_ids


@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("case", ["all_gpu", "some_masked", "all_masked", "duplicate"])
def test_one_token_matches_reference(gen, case, reduce):
    x = randn(gen, 1, ONE_TOKEN_HIDDEN)
    slot_ids = one_token_routes(case, gen, 4, 6)
    weights = route_weights(gen, 1, 4)
    w13, w2 = experts(gen, 6, ONE_TOKEN_HIDDEN, ONE_TOKEN_INTER)
    out = fused_moe.fused_moe_decode_triton(
        x, slot_ids, weights, w13, w2, config=ONE_TOKEN_BLOCKS, reduce=reduce
    )
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2, reduce=reduce)
    # reduce=False: each route's row is its own weighted output, a duplicate's included
    assert_matches(out, ref, tol=1e-5)
    if case == "all_masked":
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert ref.abs().max().item() > 0  # the comparison is not between zeros
    if not reduce:
        masked = slot_ids < 0
        assert (out[masked] == 0).all()


@pytest.mark.parametrize(
    ("dtype", "compute_dtype", "tol"),
    [
        (torch.float32, None, 1e-5),
        (torch.bfloat16, torch.float32, 1e-5),
        (torch.float16, torch.float32, 1e-5),
        # rounded to bf16/fp16 in different places from the reference's torch matmuls
        (torch.bfloat16, None, 2e-2),
        (torch.float16, None, 5e-3),
    ],
)
def test_one_token_storage_and_compute_dtypes(gen, dtype, compute_dtype, tol):
    x = randn(gen, 1, ONE_TOKEN_HIDDEN, dtype=dtype)
    slot_ids = one_token_routes("some_masked", gen, 4, 5)
    weights = route_weights(gen, 1, 4)
    w13, w2 = experts(gen, 5, ONE_TOKEN_HIDDEN, ONE_TOKEN_INTER, dtype=dtype)
    kwargs = {"compute_dtype": compute_dtype, "reduce": False}
    out = fused_moe.fused_moe_decode_triton(
        x, slot_ids, weights, w13, w2, config=ONE_TOKEN_BLOCKS, **kwargs
    )
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2, **kwargs)
    assert_matches(out, ref, tol=tol)


@pytest.mark.parametrize(
    "config", [None, DecodeMoEConfig(), OneTokenMoEConfig(1, 16, 1, 16, num_stages=1)]
)
def test_one_token_with_default_and_other_tiles(gen, config):
    # None: the chooser's tiles (at 132 SMs off-GPU: one row per program at this size)
    x = randn(gen, 1, 40)
    slot_ids = route_table(gen, 1, 8, 10, masked=0.25)
    weights = route_weights(gen, 1, 8)
    w13, w2 = experts(gen, 10, 40, 24)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2, config=config)
    assert_matches(out, fused_moe.fused_moe_decode_ref(x, slot_ids, weights, w13, w2), tol=1e-5)


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

    def spy(name: str) -> None:
        real = getattr(fused_moe, name)

        def run(*args: object) -> None:
            calls.append(name)
            real(*args)

        monkeypatch.setattr(fused_moe, name, run)

    spy("_one_token")
    spy("_tokens")
    x = randn(gen, 2, 32)
    slot_ids = route_table(gen, 2, 2, 3)
    weights = route_weights(gen, 2, 2)
    w13, w2 = experts(gen, 3, 32, 16)
    args = (slot_ids[:1], weights[:1], w13, w2)
    fused_moe.fused_moe_decode_triton(x[:1], *args)
    fused_moe.fused_moe_decode_triton(x[:1], *args, config=DecodeMoEConfig())
    fused_moe.fused_moe_decode_triton(x, slot_ids, weights, w13, w2)
    assert calls == ["_one_token", "_tokens", "_tokens"]


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


@pytest.mark.parametrize(
    "fields",
    [{"gate_up_block_n": 3}, {"down_block_n": 0}, {"down_block_k": 8}, {"num_stages": 0}],
)
def test_one_token_config_rejects_bad_tiles(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        OneTokenMoEConfig(**fields)


@pytest.mark.parametrize("sms", [16, 132])
def test_one_token_tiles_spread_routes_over_the_sms(sms):
    # Qwen3-30B-A3B: H=2048, I=768, 8 routes; each launch takes the widest block of up to 16
    # rows that still gives gemv.ROW_PROGRAMS_PER_SM programs per SM
    config = fused_moe.choose_one_token_config(8, 2048, 768, sms)
    least = gemv.ROW_PROGRAMS_PER_SM * sms
    for block_n, rows in ((config.gate_up_block_n, 768), (config.down_block_n, 2048)):
        assert 8 * -(-rows // block_n) >= least
        assert block_n == 16 or 8 * -(-rows // (2 * block_n)) < least
    if sms == 132:
        assert config == OneTokenMoEConfig(8, 256, 16, 256, num_warps=4, num_stages=3)
