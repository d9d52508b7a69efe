"""The VRAM plan: KV before experts, buffers, whole slots, the remainder to KV, clear refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moelab.engine.config.config import EngineConfig
from moelab.engine.config.memory import (
    GIB,
    MemoryPlanError,
    activation_bytes,
    chunk_attention_bytes,
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
from moelab.engine.model.spec import ModelSpec, flash_chunks_fit
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
        chunk_attention="masked",  # a GPU without flash attention
    )
    args.update(kw)
    return plan_vram(SPEC, **args)


def test_auto_plan_reserves_kv_then_buffers_then_whole_slots():
    p = plan(24)
    weights = SPEC.dense_params * ELEM
    assert p.kv_bytes >= 8192 * KV_TOKEN
    assert p.prefill_buffer_bytes == 2 * 128 * SLOT  # two whole layers of experts
    act = activation_bytes(SPEC, 2048, 8, ELEM)
    attention = chunk_attention_bytes(SPEC, 2048, 8192, ELEM, flash=False)
    left = 24 * GIB - weights - 8192 * KV_TOKEN - act - attention - GIB // 2
    left -= p.prefill_buffer_bytes
    assert p.slots == left // SLOT
    # what is left after whole slots went to KV (in whole blocks), each block paying for its
    # KV and for the longer context's chunk attention
    rest = left - p.slots * SLOT

    def cost(blocks: int) -> int:
        longer = chunk_attention_bytes(SPEC, 2048, 8192 + 16 * blocks, ELEM, flash=False)
        return blocks * 16 * KV_TOKEN + longer - attention

    extra_blocks = (p.kv_tokens - 8192) // 16
    assert cost(extra_blocks) <= rest < cost(extra_blocks + 1)
    assert p.activation_bytes == act + chunk_attention_bytes(
        SPEC, 2048, p.max_context, ELEM, flash=False
    )
    assert p.unplanned_bytes >= 0 and p.unplanned_bytes < SLOT


def test_a_chunks_attention_grows_with_the_context_unless_flash_takes_it():
    """chunk_attention_bytes: nothing for a prompt's first chunk; the gathered keys and values
    with flash attention; the repeated heads and the mask besides without; gpt-oss's sinks
    padded and joined to the keys without flash, and with it its windowed layers' masked
    attention over the window and the chunk at most; never flash in fp32."""
    kv = 2 * 4 * 128 * ELEM  # a context token's keys and values gathered
    assert chunk_attention_bytes(SPEC, 2048, 2048, ELEM, flash=True) == 0
    assert chunk_attention_bytes(SPEC, 2048, 40960, ELEM, flash=True) == 40960 * kv
    masked = chunk_attention_bytes(SPEC, 2048, 40960, ELEM, flash=False)
    repeated = 2 * 40960 * 32 * 128 * ELEM
    assert masked == 40960 * kv + repeated + 2048 * 40960 * (1 + 2 * ELEM)
    assert flash_chunks_fit(SPEC, 2) and not flash_chunks_fit(SPEC, 4)
    assert chunk_attention_bytes(SPEC, 2048, 40960, 4, flash=True) > masked
    oss = ModelSpec.from_config(make_config("gpt_oss", "gpt-oss-20b"))
    unpadded = chunk_attention_bytes(replace(oss, attention_sinks=False), 2048, 32768, 2, False)
    assert chunk_attention_bytes(oss, 2048, 32768, ELEM, flash=False) > unpadded
    window = chunk_attention_bytes(oss, 2048, 2048 + 128, ELEM, flash=False)
    gathered = 2 * 32768 * oss.kv_size * ELEM
    assert chunk_attention_bytes(oss, 2048, 32768, ELEM, flash=True) == max(gathered, window)


def test_the_long_context_transient_is_planned_on_a_hybrid_model():
    """Qwen3.6-35B-A3B on 24 GiB with 262,144 tokens of FP8 KV reserved: the plan holds a last
    chunk's attention at the whole context, with flash attention (the keys and values gathered:
    0.5 GiB) and without (the key/value heads repeated 8 times and the mask besides: several
    GiB), each taken from the experts, and the context stays the model's whole one."""
    spec = ModelSpec.from_config(make_config("qwen3_5_moe", "qwen3.6-35b-a3b"))
    args = dict(budget_bytes=24 * GIB, weights_bytes=spec.dense_params * ELEM, elem_bytes=ELEM,
                block_size=16, prefill_chunk_tokens=2048, headroom_bytes=GIB // 2,
                kv_reserve_tokens=262144, kv_cache_dtype="fp8", max_running=1)  # fmt: skip
    flash = plan_vram(spec, chunk_attention="flash", **args)
    masked = plan_vram(spec, chunk_attention="masked", **args)
    assert plan_vram(spec, **args).activation_bytes == activation_bytes(spec, 2048, 1, ELEM)
    assert flash.max_context == masked.max_context == 262144
    gathered = 2 * 262144 * spec.kv_size * ELEM
    assert flash.activation_bytes - activation_bytes(spec, 2048, 1, ELEM) == gathered
    assert masked.activation_bytes - flash.activation_bytes > 4 * GIB
    slot = flash.slot_bytes
    moved = masked.activation_bytes - flash.activation_bytes
    assert flash.slots - masked.slots in (moved // slot, moved // slot + 1)


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
    (2.5 GiB in FP8) and leave an expert cache of 1,450 slots (1,870 in FP8) beside the states
    and a last prefill chunk's keys and values gathered from the whole context (0.5 GiB);
    with a KV cache in every layer the same context needs 20 GiB and is refused, and in FP8
    leaves 872 slots."""
    p = hybrid_plan(HYBRID, "--kv-reserve-tokens", "262144")
    assert p.max_context == 262144 == HYBRID.max_position_embeddings
    assert 4.9 * GIB < p.kv_bytes < 5.1 * GIB and p.slots == 1450
    fp8 = hybrid_plan(HYBRID, "--kv-reserve-tokens", "262144", "--kv-cache-dtype", "fp8")
    assert fp8.max_context == 262144 and fp8.slots == 1870
    with pytest.raises(MemoryPlanError, match=r"a KV reserve of 262144 tokens \(20.00 GiB\)"):
        hybrid_plan(ALL_ATTENTION, "--kv-reserve-tokens", "262144")
    dense_fp8 = hybrid_plan(
        ALL_ATTENTION, "--kv-reserve-tokens", "262144", "--kv-cache-dtype", "fp8"
    )
    assert dense_fp8.slots == 872


def test_a_hybrid_model_holds_about_four_times_the_context_of_an_all_attention_one():
    """The most KV tokens each model's plan holds on 24 GiB beside the prefill buffer and no
    expert slot and a last chunk's keys and values gathered from the whole context: 707,411
    against 200,655 (the search's 1,024-token step)."""

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
    assert 700_000 < hybrid < 715_000 and 195_000 < dense < 210_000, (hybrid, dense)
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
    KV), where pages for it in every layer (9 GiB) do not, and 32K keeps 117 expert slots
    rather than 95 beside a last chunk's keys and values gathered from it."""
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
    assert (windowed.slots, paged.slots) == (117, 95)


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
def test_a_split_reserves_each_cards_graph_pool_resident_or_offloaded(preset):
    """Qwen3-30B-A3B on two 12 GiB cards misses experts: each card still reserves the pool of
    its decode pieces' graphs, out of its expert slots. A tiny model holds every expert on both
    cards: each reserves the pool its decode graph needs."""
    spec = ModelSpec.from_config(make_config("qwen3_moe", preset))
    config = EngineConfig.from_flags(["--model-path", "/m", "--devices", "cuda:0,cuda:1"])
    request = config.memory_request(budget_bytes=0, elem_bytes=2, cuda=True)
    cards = (DeviceBudget("cuda:0", 12 * GIB, 10.0), DeviceBudget("cuda:1", 12 * GIB, 10.0))
    split = plan_graphed_devices(spec, request, cards)
    eager = plan_devices(spec, replace(request, cuda_graphs=False), cards)
    graphed = plan_devices(spec, request, cards)
    assert split == graphed and all(p.graph_bytes > 0 for p in split.plans)
    if preset == "tiny":
        assert all(p.all_resident for p in split.plans)
    else:
        assert not any(p.all_resident for p in split.plans)
        assert eager.total.slots > split.total.slots
    # without CUDA graphs (--no-cuda-graph, or the CPU) no card reserves one
    assert plan_graphed_devices(spec, replace(request, cuda_graphs=False), cards) == eager


def test_a_split_that_holds_every_expert_only_without_graph_pools_keeps_them_all():
    """On the smallest cards that hold every expert of a tiny model without graph pools, the
    pools would cost some experts: the split reserves none and holds them all (decoding
    eagerly), rather than missing experts to decode from graphs."""
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    config = EngineConfig.from_flags(["--model-path", "/m", "--devices", "cuda:0,cuda:1"])
    request = config.memory_request(budget_bytes=0, elem_bytes=2, cuda=True)
    eager_request = replace(request, cuda_graphs=False)

    def cards(mib: int) -> tuple[DeviceBudget, ...]:
        return tuple(DeviceBudget(f"cuda:{i}", mib * 1024**2, 10.0) for i in range(2))

    def resident(mib: int) -> bool:
        try:
            plans = plan_devices(spec, eager_request, cards(mib)).plans
        except MemoryPlanError:
            return False
        return all(p.all_resident for p in plans)

    low, high = 1, 12 * 1024  # MiB: not resident, resident
    assert not resident(low) and resident(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if resident(mid) else (mid, high)
    split = plan_graphed_devices(spec, request, cards(high))
    assert split == plan_devices(spec, eager_request, cards(high))
    assert all(p.all_resident and p.graph_bytes == 0 for p in split.plans)


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


def peak_cpu_bytes(call) -> int:
    """The most bytes `call` holds at once on the CPU beyond what it started with: the
    profiler's allocations and frees, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sinks", [False, True], ids=["qwen", "gpt-oss"])
def test_the_chunk_attention_estimate_bounds_what_the_masked_path_holds(dtype, sinks):
    """A chunk of 128 queries after 4,096 tokens, 16 query heads and 2 KV heads of 128, through
    the masked path (Model._sdpa, or gpt_oss.attention with its sinks as a key): the memory it
    holds at once on the CPU, with the keys and values gathered for it, stays within
    chunk_attention_bytes and above 3/4 of it."""
    from types import SimpleNamespace

    import torch

    from moelab.engine.model import gpt_oss
    from moelab.engine.model.model import Model

    dt = getattr(torch, dtype)
    e = torch.empty((), dtype=dt).element_size()
    heads, kv_heads, d, n, length = 16, 2, 128, 128, 4096
    spec = replace(SPEC, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, attention_sinks=sinks)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n, heads, d, generator=gen).to(dt)
    k, v = (torch.randn(length, kv_heads, d, generator=gen).to(dt) for _ in range(2))
    if sinks:
        call = lambda: gpt_oss.attention(q, k, v, d**-0.5, torch.zeros(heads), 0)  # noqa: E731
    else:
        model = SimpleNamespace(spec=spec, scale=d**-0.5, _flash_chunks={})
        call = lambda: Model._sdpa(model, q, k, v)  # noqa: E731
    held = peak_cpu_bytes(call) + 2 * length * kv_heads * d * e  # and the gathered keys
    estimate = chunk_attention_bytes(spec, n, length, e, flash=False)
    assert 0.75 * estimate < held <= estimate, (held, estimate)
