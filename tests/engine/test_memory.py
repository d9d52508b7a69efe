"""The VRAM plan: KV before experts, buffers, whole slots, the remainder to KV, clear refusals."""

from __future__ import annotations

import pytest

from moelab.engine.config.memory import GIB, MemoryPlanError, activation_bytes, plan_vram
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config

SPEC = ModelSpec.from_config(make_config("qwen3_moe", "qwen3-30b-a3b"))
ELEM = 2
SLOT = 3 * 2048 * 768 * 2  # 9 MiB
KV_TOKEN = 2 * 48 * 4 * 128 * 2  # 96 KiB


def plan(budget_gib: float, **kw):
    args = dict(
        budget_bytes=int(budget_gib * GIB),
        weights_bytes=SPEC.dense_params * ELEM,
        elem_bytes=ELEM,
        kv_reserve_tokens=8192,
        block_size=16,
        prefill_chunk_tokens=2048,
        max_running=8,
        headroom_bytes=GIB // 2,
    )
    args.update(kw)
    return plan_vram(SPEC, **args)


def test_auto_plan_reserves_kv_then_buffers_then_whole_slots():
    p = plan(24)
    weights = SPEC.dense_params * ELEM
    assert p.kv_bytes >= 8192 * KV_TOKEN
    assert p.prefill_buffer_bytes == 2 * 128 * SLOT  # two whole layers of experts
    act = activation_bytes(SPEC, 2048, 8, ELEM)
    left = 24 * GIB - weights - 8192 * KV_TOKEN - act - GIB // 2 - p.prefill_buffer_bytes
    assert p.slots == left // SLOT
    # what is left after whole slots went to KV (in whole blocks)
    extra_blocks = (left - p.slots * SLOT) // (16 * KV_TOKEN)
    assert p.kv_tokens == 8192 + 16 * extra_blocks
    assert p.unplanned_bytes >= 0 and p.unplanned_bytes < SLOT


def test_everything_resident_needs_no_prefill_buffer():
    p = plan(141)
    assert p.all_resident and p.slots == 48 * 128 and p.prefill_buffer_bytes == 0


def test_kv_reserve_is_taken_from_the_experts():
    small, large = plan(24), plan(24, kv_reserve_tokens=65536)
    assert large.kv_tokens >= 65536 and large.max_context == SPEC.max_position_embeddings
    moved = large.kv_bytes - small.kv_bytes
    assert small.slots - large.slots >= moved // SLOT - 1


def test_context_is_what_the_kv_holds_and_max_context_caps_it():
    p = plan(141, kv_reserve_tokens=1024, cache_size=100)
    assert p.kv_tokens == 1024 and p.max_context == 1024  # explicit slots: no remainder to KV
    assert plan(141, max_context=2000).max_context == 2000


def test_explicit_sizes_and_rates():
    assert plan(24, cache_size=300).slots == 300
    assert plan(141, cache_rate=0.25).slots == round(0.25 * 48 * 128)


def test_refusals_say_what_does_not_fit():
    with pytest.raises(MemoryPlanError, match=r"at most .* slots fit"):
        plan(24, cache_size=5000)
    with pytest.raises(MemoryPlanError, match="lower --kv-reserve-tokens"):
        plan(4)


def test_fp8_slots_count_values_and_factors_and_more_than_double():
    """An FP8 slot holds 1 byte a weight and w13's [12, 16] and w2's [16, 6] fp32 factors: the
    same budget plans more than twice the slots, the prefill buffer halving too (the dense
    weights stay in the compute dtype)."""
    fp8_slot = 3 * 2048 * 768 + 4 * (12 * 16 + 16 * 6)
    bf16, fp8 = plan(24), plan(24, expert_format="fp8")
    assert fp8.slot_bytes == fp8_slot == SPEC.expert_bytes_as("fp8")
    assert fp8.prefill_buffer_bytes == 2 * 128 * fp8_slot
    assert fp8.weights_bytes == bf16.weights_bytes
    # slots beside the prefill buffer, from the same bytes left after weights, KV and activations
    left = bf16.slots * SLOT + bf16.prefill_buffer_bytes + bf16.unplanned_bytes
    assert fp8.slots == (left - fp8.prefill_buffer_bytes) // fp8_slot
    assert 2.0 < fp8.slots / bf16.slots < 2.2
    # every expert resident in FP8 at a budget where bf16 holds about half of them
    assert plan(40, expert_format="fp8").all_resident and not plan(40).all_resident
