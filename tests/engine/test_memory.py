"""The VRAM plan: KV before experts, buffers, whole slots, the remainder to KV, clear refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moelab.engine.config.config import EngineConfig
from moelab.engine.config.memory import (
    GIB,
    MemoryPlanError,
    activation_bytes,
    kv_bytes_per_token,
    plan_vram,
    state_bytes_per_seq,
)
from moelab.engine.config.split import (
    DeviceBudget,
    dense_layer_bytes,
    layer_bytes,
    plan_devices,
    plan_graphed_devices,
)
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


# Qwen3.6-35B-A3B: 10 full-attention layers keep KV, 30 Gated DeltaNet layers a fixed state
HYBRID = ModelSpec.from_config(make_config("qwen3_5_moe", "qwen3.6-35b-a3b"))
# the same geometry with a KV cache in every layer
ALL_ATTENTION = replace(HYBRID, layer_types=("full_attention",) * 40, linear_attention=None)
HYBRID_KV_TOKEN = 2 * 10 * 2 * 256 * 2  # 20 KiB: 10 layers, 2 KV heads of 256, bf16
# per sequence and linear layer: the DeltaNet state 32 x 128 x 128 fp32 and the convolution's
# last 3 inputs of 2 x 2048 + 4096 channels in bf16
HYBRID_STATE = 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)


def hybrid_plan(spec: ModelSpec, *flags: str):
    """The plan `moelab serve --device-memory 24GiB FLAGS` makes on a GPU in bf16."""
    config = EngineConfig.from_flags(["--model-path", "/m", "--device-memory", "24GiB", *flags])
    request = config.memory_request(
        budget_bytes=config.memory.budget_bytes(None), elem_bytes=2, cuda=True
    )
    return request.plan(spec)


def test_a_hybrid_model_counts_kv_of_its_attention_layers_and_a_state_per_sequence():
    p = hybrid_plan(HYBRID)
    assert kv_bytes_per_token(HYBRID, 2) == HYBRID_KV_TOKEN == HYBRID.kv_bytes_per_token
    assert kv_bytes_per_token(ALL_ATTENTION, 2) == 4 * HYBRID_KV_TOKEN
    assert state_bytes_per_seq(HYBRID, 2) == HYBRID_STATE == HYBRID.state_bytes_per_seq
    # a slot for each of the 8 running sequences (the default), the graphs' padding one and the
    # prefix cache's 8 state checkpoints (the default), reserved before the expert cache:
    # 61.4 MiB each, 1.02 GiB in all
    assert (p.state_slots, p.state_checkpoints) == (8, 8)
    assert p.state_bytes == 17 * HYBRID_STATE and 1.01 * GIB < p.state_bytes < 1.03 * GIB
    assert p.unplanned_bytes >= 0 and p.unplanned_bytes < p.slot_bytes
    assert "recurrent states 1.02 GiB (8 sequences, 8 checkpoints)" in p.describe()
    more = hybrid_plan(HYBRID, "--max-running-requests", "32")
    assert more.state_bytes - p.state_bytes == 24 * HYBRID_STATE
    assert more.slots < p.slots  # the states come out of the expert cache
    # no checkpoints where there are none to keep, or no prefix cache to keep them for
    for flags in (("--state-checkpoints", "0"), ("--no-prefix-cache",)):
        fewer = hybrid_plan(HYBRID, *flags)
        assert fewer.state_checkpoints == 0 and fewer.state_bytes == 9 * HYBRID_STATE
    # a model without linear layers reserves none
    assert hybrid_plan(ALL_ATTENTION).state_bytes == hybrid_plan(ALL_ATTENTION).state_slots == 0


def test_the_whole_native_context_fits_a_24_gib_budget_beside_an_expert_cache():
    """Qwen3.6-35B-A3B on --device-memory 24GiB: 262,144 tokens of KV take 5.0 GiB in bf16
    (2.5 GiB in FP8) and leave an expert cache of 1,535 slots (1,955 in FP8) beside the states;
    with a KV cache in every layer the same context needs 20 GiB and is refused, and in FP8
    leaves 957 slots."""
    p = hybrid_plan(HYBRID, "--kv-reserve-tokens", "262144")
    assert p.max_context == 262144 == HYBRID.max_position_embeddings
    assert 4.9 * GIB < p.kv_bytes < 5.1 * GIB and p.slots == 1535
    fp8 = hybrid_plan(HYBRID, "--kv-reserve-tokens", "262144", "--kv-cache-dtype", "fp8")
    assert fp8.max_context == 262144 and fp8.slots == 1955
    with pytest.raises(MemoryPlanError, match=r"a KV reserve of 262144 tokens \(20.00 GiB\)"):
        hybrid_plan(ALL_ATTENTION, "--kv-reserve-tokens", "262144")
    dense_fp8 = hybrid_plan(
        ALL_ATTENTION, "--kv-reserve-tokens", "262144", "--kv-cache-dtype", "fp8"
    )
    assert dense_fp8.slots == 957


def test_a_hybrid_model_holds_about_four_times_the_context_of_an_all_attention_one():
    """The most KV tokens each model's plan holds on 24 GiB beside the prefill buffer and no
    expert slot: 733,005 against 205,774 (the search's 1,024-token step)."""

    def most_tokens(spec: ModelSpec) -> int:
        low, high = 1024, 4 << 20
        while high - low > 1024:
            mid = (low + high) // 2
            try:
                hybrid_plan(spec, "--kv-reserve-tokens", str(mid), "--moe-cache-size", "0")
            except MemoryPlanError:
                high = mid
            else:
                low = mid
        return low

    hybrid, dense = most_tokens(HYBRID), most_tokens(ALL_ATTENTION)
    assert 720_000 < hybrid < 745_000 and 190_000 < dense < 215_000, (hybrid, dense)
    assert hybrid > 3.5 * dense


def test_too_many_running_sequences_for_their_states_is_refused_naming_the_flag():
    with pytest.raises(
        MemoryPlanError, match="recurrent states of 256 running sequences and 8 state checkpoints"
    ) as err:
        hybrid_plan(HYBRID, "--kv-reserve-tokens", "262144", "--max-running-requests", "256")
    assert "lower --max-running-requests" in str(err.value)


# gpt-oss-120b: 18 sliding-window layers (window 128) and 18 full-attention ones
GPT_OSS = ModelSpec.from_config(make_config("gpt_oss", "gpt-oss-120b"))
# the same geometry with pages for the whole context in every layer
NO_WINDOW = replace(GPT_OSS, sliding_layers=(), sliding_window=0)


def gpt_oss_plan(spec: ModelSpec, *flags: str):
    """The plan `moelab serve --device-memory 12GiB FLAGS` makes on a GPU in bf16."""
    config = EngineConfig.from_flags(["--model-path", "/m", "--device-memory", "12GiB", *flags])
    request = config.memory_request(
        budget_bytes=config.memory.budget_bytes(None), elem_bytes=2, cuda=True
    )
    return request.plan(spec)


def test_gpt_oss_counts_its_sliding_layers_at_their_windows_pages():
    """gpt-oss-120b on 12 GiB: a token's KV is 36 KiB (18 full layers, 8 KV heads of 64, bf16),
    and each running sequence, the graphs' padding slot and the 8 checkpoints keep 128 tokens of
    the 18 sliding layers (4.5 MiB each); so the whole 131,072-token context fits (4.5 GiB of
    KV), where pages for it in every layer (9 GiB) do not, and 32K keeps 119 expert slots
    rather than 97."""
    assert kv_bytes_per_token(GPT_OSS, 2) == 2 * 18 * 8 * 64 * 2
    assert kv_bytes_per_token(NO_WINDOW, 2) == 2 * kv_bytes_per_token(GPT_OSS, 2)
    per_seq = 18 * 128 * 2 * 8 * 64 * 2
    assert state_bytes_per_seq(GPT_OSS, 2, "auto", 16) == per_seq
    # pages of 48 tokens hold the window in 3 pages: 144 tokens a layer
    assert state_bytes_per_seq(GPT_OSS, 2, "auto", 48) == per_seq * 144 // 128
    whole = gpt_oss_plan(GPT_OSS, "--kv-reserve-tokens", "131072")
    assert whole.max_context == 131072 and whole.state_bytes == 17 * per_seq
    assert "sliding-window pages (128 tokens a layer) 0.07 GiB (8 sequences" in whole.describe()
    with pytest.raises(MemoryPlanError, match=r"a KV reserve of 131072 tokens \(9.00 GiB\)"):
        gpt_oss_plan(NO_WINDOW, "--kv-reserve-tokens", "131072")
    windowed = gpt_oss_plan(GPT_OSS, "--kv-reserve-tokens", "32768")
    paged = gpt_oss_plan(NO_WINDOW, "--kv-reserve-tokens", "32768")
    assert (windowed.slots, paged.slots) == (119, 97)


def test_a_gpt_oss_split_plans_each_devices_windows_and_pages():
    """gpt-oss-120b across two 12 GiB cards at 18 layers each, FP8 KV: each card reserves the
    rings of its own 9 sliding layers and the KV of its own 9 full ones, half of one card's of
    the whole model each; and the split weighs each layer by its own: a sliding layer by its
    rings, a full one by its pages."""
    flags = ["--kv-reserve-tokens", "32768", "--kv-cache-dtype", "fp8"]
    config = EngineConfig.from_flags(
        ["--model-path", "/m", "--devices", "cuda:0,cuda:1", "--layer-split", "18,18", *flags]
    )
    request = config.memory_request(budget_bytes=0, elem_bytes=2, cuda=True)
    cards = (DeviceBudget("cuda:0", 12 * GIB, 10.0), DeviceBudget("cuda:1", 12 * GIB, 10.0))
    split = plan_devices(GPT_OSS, request, cards, config.memory.layer_split)
    whole = gpt_oss_plan(GPT_OSS, *flags)
    assert [p.state_bytes for p in split.plans] == [whole.state_bytes // 2] * 2
    per_token = kv_bytes_per_token(GPT_OSS, 2, "fp8") // 2
    assert [p.kv_bytes // p.kv_tokens for p in split.plans] == [per_token] * 2
    weighed = layer_bytes(GPT_OSS, request)
    dense = dense_layer_bytes(GPT_OSS, 2)
    sliding, full = GPT_OSS.sliding_layers[0], GPT_OSS.paged_layers[0]
    assert weighed[sliding].fixed_bytes - dense == whole.state_bytes // 18
    assert weighed[full].fixed_bytes - dense == 32768 * kv_bytes_per_token(GPT_OSS, 2, "fp8") // 18


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "tiny"])
def test_a_split_reserves_each_cards_graph_pool_only_where_every_expert_is_resident(preset):
    """Qwen3-30B-A3B on two 12 GiB cards misses experts, so its split steps eagerly: no card
    reserves a graphs' pool, its memory goes to slots. A tiny model holds every expert on both
    cards: each reserves the pool its decode graph needs."""
    spec = ModelSpec.from_config(make_config("qwen3_moe", preset))
    config = EngineConfig.from_flags(["--model-path", "/m", "--devices", "cuda:0,cuda:1"])
    request = config.memory_request(budget_bytes=0, elem_bytes=2, cuda=True)
    cards = (DeviceBudget("cuda:0", 12 * GIB, 10.0), DeviceBudget("cuda:1", 12 * GIB, 10.0))
    split = plan_graphed_devices(spec, request, cards)
    eager = plan_devices(spec, replace(request, cuda_graphs=False), cards)
    graphed = plan_devices(spec, request, cards)
    if preset == "tiny":
        assert all(p.all_resident for p in split.plans)
        assert split == graphed and all(p.graph_bytes > 0 for p in split.plans)
    else:
        assert split == eager and [p.graph_bytes for p in split.plans] == [0, 0]
        assert split.total.slots > graphed.total.slots
    # without CUDA graphs (--no-cuda-graph, or the CPU) no card reserves one
    assert plan_graphed_devices(spec, replace(request, cuda_graphs=False), cards) == eager


def test_a_gpt_oss_plan_that_does_not_fit_names_the_windows_pages():
    with pytest.raises(MemoryPlanError) as refused:
        gpt_oss_plan(GPT_OSS, "--kv-reserve-tokens", "262144")
    message = str(refused.value)
    assert "the sliding-window pages of 8 running sequences and 8 checkpoints (0.07 GiB)" in message
    assert "recurrent states" not in message


def test_a_model_whose_attention_layers_all_slide_keeps_no_pages():
    """Every layer a sliding-window one: no KV a token, the windows alone, the whole context."""
    sliding = replace(GPT_OSS, sliding_layers=tuple(range(GPT_OSS.num_layers)))
    assert kv_bytes_per_token(sliding, 2) == 0
    p = gpt_oss_plan(sliding)
    assert p.kv_bytes == 0 and p.max_context == GPT_OSS.max_position_embeddings
    assert p.state_bytes == 17 * 36 * 128 * 2 * 8 * 64 * 2
