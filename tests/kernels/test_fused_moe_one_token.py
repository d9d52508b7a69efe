"""One-token decode MoE against the torch reference (interpreter on CPU, fp32, small shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelab.kernels import fused_moe, gemv
from moelab.kernels.fused_moe import DecodeMoEConfig
from moelab.kernels.fused_moe_one_token import OneTokenMoEConfig, choose_one_token_config

from .kernel_inputs import assert_matches, randn, route_table, route_weights
from .test_fused_moe import experts

pytestmark = pytest.mark.usefixtures("triton_runs")

# One-token tiles smaller than ONE_TOKEN_HIDDEN and ONE_TOKEN_INTER and not dividing them: several
# row blocks and reduction steps per route, the last of each partial.
ONE_TOKEN_BLOCKS = OneTokenMoEConfig(
    gate_up_block_n=8, gate_up_block_k=16, down_block_n=16, down_block_k=16
)
ONE_TOKEN_HIDDEN, ONE_TOKEN_INTER = 72, 44


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


@pytest.mark.parametrize("loop", [False, True], ids=["route-grid", "loop-routes"])
@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("case", ["all_gpu", "some_masked", "all_masked", "duplicate"])
def test_one_token_matches_reference(gen, case, reduce, loop):
    """loop: each program's row blocks loop over the routes (few live routes' launch)."""
    x = randn(gen, 1, ONE_TOKEN_HIDDEN)
    slot_ids = one_token_routes(case, gen, 4, 6)
    weights = route_weights(gen, 1, 4)
    w13, w2 = experts(gen, 6, ONE_TOKEN_HIDDEN, ONE_TOKEN_INTER)
    config = dataclasses.replace(ONE_TOKEN_BLOCKS, loop_routes=loop)
    out = fused_moe.fused_moe_decode_triton(
        x, slot_ids, weights, w13, w2, config=config, reduce=reduce
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
    config = choose_one_token_config(8, 2048, 768, sms)
    least = gemv.ROW_PROGRAMS_PER_SM * sms
    for block_n, rows in ((config.gate_up_block_n, 768), (config.down_block_n, 2048)):
        assert 8 * -(-rows // block_n) >= least
        assert block_n == 16 or 8 * -(-rows // (2 * block_n)) < least
    if sms == 132:
        assert config == OneTokenMoEConfig(8, 256, 16, 256, num_warps=4, num_stages=3)
    # an FP8 bank's programs take twice the rows, the steps by the same rule
    fp8 = choose_one_token_config(8, 2048, 768, sms, fp8=True)
    assert (fp8.gate_up_block_n, fp8.down_block_n) == (
        2 * config.gate_up_block_n,
        2 * config.down_block_n,
    )
    if sms == 132:
        assert fp8 == OneTokenMoEConfig(16, 256, 32, 256, num_warps=4, num_stages=3)
    assert choose_one_token_config(8, 2048, 768, sms, few_routes=True, fp8=True) == (
        choose_one_token_config(8, 2048, 768, sms, few_routes=True)
    ), "few live routes keep their tiles"


def test_few_routes_tiles_spread_one_route_over_the_sms():
    # the launch after a layer step's fills: one live route of 8 on 132 SMs gets as many
    # programs as 8 routes would at the route-grid tiles (768 and 1024)
    config = choose_one_token_config(8, 2048, 768, 132, few_routes=True)
    assert config == OneTokenMoEConfig(1, 2048, 2, 2048, loop_routes=True)
    assert -(-768 // config.gate_up_block_n) == 768 and -(-2048 // config.down_block_n) == 1024
