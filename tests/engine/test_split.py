"""Layers split across devices: the flags, their checks, and the split plan (pure logic)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.engine.config.args import build_parser
from moelab.engine.config.config import ConfigError, EngineConfig
from moelab.engine.config.memory import MemoryPlanError, chunk_attention_bytes
from moelab.engine.config.split import (
    DeviceBudget,
    DeviceShare,
    LayerBytes,
    LayerSplit,
    SplitError,
    default_counts,
    layer_bytes,
    plan_devices,
    plan_split,
    step_estimates,
)
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config

GIB = 1024**3
A3B = ModelSpec.from_config(make_config("qwen3_moe", "qwen3-30b-a3b"))


def parse_error(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-path", "m", *flags])
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_devices_and_a_split_parse_as_counts_or_shares():
    args = build_parser().parse_args(
        ["--model-path", "m", "--devices", "cuda:0,cuda:1", "--layer-split", "20,28"]
    )
    assert args.devices == ("cuda:0", "cuda:1")
    assert args.layer_split.layer_counts(48) == (20, 28)
    shares = LayerSplit.parse("0.6,0.4")
    assert shares.layer_counts(48) == (29, 19) and shares.layer_counts(5) == (3, 2)
    assert LayerSplit.parse("0.34,0.33,0.33").layer_counts(48) == (16, 16, 16)
    assert build_parser().parse_args(["--model-path", "m", "--devices", "cpu,cpu"]).devices == (
        "cpu",
        "cpu",
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--devices", "cuda:0"], "a split needs two devices or more"),
        (["--devices", "cuda:0,gpu"], "'gpu' is not a device of a split"),
        (["--devices", "cuda,cuda:1"], "'cuda' is not a device of a split"),
        (["--devices", "cuda:1,cuda:1"], "cuda:1 is named twice; name each GPU once"),
        (["--devices", "cpu,cuda:0"], "split across GPUs or emulate a split on the CPU"),
        (["--layer-split", "20"], "'20' is not a layer split"),
        (["--layer-split", "20,x"], "'20,x' is not a layer split"),
        (["--layer-split", "20,0"], "20,0: give every device one layer or more"),
        (["--layer-split", "0.5,0.6"], "must each be above 0 and add up to 1"),
        (
            ["--devices", "cuda:0,cuda:1", "--device", "cuda:0"],
            "argument --device: not allowed with argument --devices",
        ),
    ],
)
def test_a_bad_device_list_or_split_is_refused_in_words(capsys, flags, message):
    assert message in parse_error(capsys, *flags)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--layer-split", "1,1"],
            "--layer-split 1,1 splits the layers across --devices; name two devices or more "
            "there (--devices cuda:0,cuda:1)",
        ),
        (
            ["--devices", "cuda:0,cuda:1", "--layer-split", "1,1,1"],
            "--layer-split 1,1,1 has 3 parts for 2 devices; give one per device of --devices",
        ),
    ],
)
def test_flags_that_contradict_each_other_are_refused_in_the_configuration(flags, message):
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_flags(["--model-path", "m", *flags])
    assert str(err.value) == message


def test_a_configuration_made_in_code_is_held_to_the_same_device_rules():
    memory = EngineConfig.from_flags(["--model-path", "m"]).memory
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(memory, devices=("cuda:0", "cuda:0"))
    assert str(err.value).startswith("--devices ")
    assert str(err.value).endswith(": cuda:0 is named twice; name each GPU once")
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(memory, device="cuda:0", devices=("cuda:0", "cuda:1"))
    assert str(err.value) == (
        "--devices cuda:0,cuda:1 takes the place of --device cuda:0; give one of them"
    )
    split = EngineConfig.from_flags(["--model-path", "m", "--devices", "cpu,cpu"]).memory
    assert split.device_names == ("cpu", "cpu") and memory.device_names == ("auto",)


def test_counts_that_miss_the_model_and_a_split_of_other_parts_are_refused():
    devices = (DeviceShare("cuda:0", 8 * GIB, 25.0), DeviceShare("cuda:1", 8 * GIB, 25.0))
    layers = (LayerBytes(GIB // 10, GIB // 4),) * 40
    with pytest.raises(SplitError) as err:
        plan_split(devices, layers, LayerSplit.parse("20,21"))
    assert str(err.value) == (
        "--layer-split 20,21 places 41 layers, but the model has 40; give counts that add up to "
        "40, or shares (0.5,0.5)"
    )
    with pytest.raises(SplitError, match="has 3 parts for 2 devices"):
        plan_split(devices, layers, LayerSplit.parse("10,10,20"))
    assert plan_split(devices, layers, LayerSplit.parse("15,25")) == (range(15), range(15, 40))


def test_a_device_too_small_for_its_share_is_named():
    devices = (DeviceShare("cuda:0", 8 * GIB, 25.0), DeviceShare("cuda:1", GIB, 12.0))
    layers = (LayerBytes(GIB // 10, GIB // 4),) * 40
    with pytest.raises(SplitError) as err:
        plan_split(devices, layers, LayerSplit.parse("20,20"))
    assert str(err.value).startswith(
        "cuda:1 has 1.00 GiB for its layers, but the dense weights and KV of its 20 of the "
        "model's layers need 2.00 GiB; give it fewer layers with --layer-split"
    )
    ranges = plan_split(devices, layers)  # the default split gives it what it holds
    assert len(ranges[1]) <= 10
    tiny = (devices[0], DeviceShare("cuda:1", GIB // 20, 12.0))
    with pytest.raises(SplitError, match=r"^cuda:1 has 0\.05 GiB for its layers"):
        plan_split(tiny, layers)


def test_two_devices_that_cannot_hold_the_model_together_are_both_named():
    devices = (DeviceShare("cuda:0", GIB, 25.0), DeviceShare("cuda:1", GIB, 25.0))
    with pytest.raises(SplitError) as err:
        plan_split(devices, (LayerBytes(GIB // 8, 0),) * 40)
    assert str(err.value).startswith(
        "cuda:0 (1.00 GiB) and cuda:1 (1.00 GiB) cannot hold the dense weights and KV of the "
        "model's 40 layers"
    )


def test_the_default_split_evens_out_the_step_between_a_new_and_an_old_card():
    """At Qwen3-30B-A3B's size a layer (about 0.05 GiB dense and KV, 1.1 GiB of experts): a
    24 GiB card with a 25 GB/s link beside a 12 GiB one at 6 GB/s takes more layers, and equal
    cards share them evenly."""
    layers = (LayerBytes(54 * 2**20, int(1.13 * GIB)),) * 48
    new, old = DeviceShare("cuda:0", 24 * GIB, 25.0), DeviceShare("cuda:1", 12 * GIB, 6.0)
    counts = tuple(len(r) for r in plan_split((new, old), layers))
    assert counts[0] > counts[1] + 8 and sum(counts) == 48
    same = DeviceShare("cuda:1", 24 * GIB, 25.0)
    assert default_counts((new, same), layers) == (24, 24)
    # equal memory: the card on the wider link takes more of the misses' layers
    wide, narrow = DeviceShare("cuda:0", 12 * GIB, 25.0), DeviceShare("cuda:1", 12 * GIB, 6.0)
    wide_counts = default_counts((narrow, wide), layers)
    assert wide_counts[1] > wide_counts[0] + 4


def test_where_every_expert_fits_the_layers_follow_the_memory():
    layers = (LayerBytes(GIB // 100, GIB // 50),) * 30
    big, small = DeviceShare("cuda:0", 20 * GIB, 10.0), DeviceShare("cuda:1", 10 * GIB, 30.0)
    assert default_counts((big, small), layers) == (20, 10)


def _devices(known_memory: bool) -> st.SearchStrategy[tuple[DeviceShare, ...]]:
    return st.lists(
        st.builds(
            DeviceShare,
            name=st.sampled_from(["cuda:0"]),
            free_bytes=st.integers(GIB // 4, 48 * GIB),
            link_gbps=st.floats(1.0, 64.0),
            memory_gbps=st.floats(100.0, 4000.0) if known_memory else st.none(),
        ),
        min_size=2,
        max_size=5,
    ).map(lambda ds: tuple(dataclasses.replace(d, name=f"cuda:{i}") for i, d in enumerate(ds)))


# the cards' memory rates known (the split weighs their compute) or not
devices_st = st.booleans().flatmap(_devices)
layers_st = st.builds(
    lambda n, fixed, experts, dense, active: (LayerBytes(fixed, experts, dense, active),) * n,
    st.integers(5, 96),
    st.integers(2**20, GIB // 4),
    st.integers(0, 2 * GIB),
    st.integers(0, GIB // 4),
    st.sampled_from([1.0, 8 / 128, 4 / 32]),
)


@settings(max_examples=300, deadline=None)
@given(devices=devices_st, layers=layers_st)
def test_every_layer_is_placed_once_in_contiguous_ranges(devices, layers):
    try:
        ranges = plan_split(devices, layers)
    except SplitError as err:
        # refused only where some device cannot hold even its share of the dense weights and KV
        assert any(d.name in str(err) for d in devices)
        return
    assert len(ranges) == len(devices)
    assert [i for r in ranges for i in r] == list(range(len(layers)))
    assert all(len(r) >= 1 for r in ranges)
    for device, span in zip(devices, ranges, strict=True):
        assert sum(layers[i].fixed_bytes for i in span) <= device.free_bytes


@settings(max_examples=300, deadline=None)
@given(devices=devices_st, layers=layers_st, data=st.data())
def test_a_faster_or_bigger_card_gets_no_fewer_layers(devices, layers, data):
    a, b = data.draw(st.permutations(range(len(devices))))[:2]
    # make device a at least as big and fast as b, and strictly more of one
    more_memory = data.draw(st.booleans())
    da, db = devices[a], devices[b]
    faster = None if da.memory_gbps is None else max(da.memory_gbps, db.memory_gbps or 0.0)
    da = dataclasses.replace(
        da,
        free_bytes=max(da.free_bytes, db.free_bytes) + (1 if more_memory else 0),
        link_gbps=max(da.link_gbps, db.link_gbps) + (0.0 if more_memory else 0.5),
        memory_gbps=faster,
    )
    devices = tuple(da if i == a else d for i, d in enumerate(devices))
    try:
        counts = default_counts(devices, layers)
    except SplitError:
        return
    assert counts[a] >= counts[b], (counts, a, b)


@settings(max_examples=200, deadline=None)
@given(devices=devices_st, layers=layers_st, data=st.data())
def test_a_card_given_less_than_its_share_needs_is_named(devices, layers, data):
    n, k = len(layers), len(devices)
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1,
                                     unique=True)))  # fmt: skip
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    split = LayerSplit(counts=tuple(counts))
    over = [
        d for d, n in zip(devices, counts, strict=True) if n * layers[0].fixed_bytes > d.free_bytes
    ]
    if not over:
        assert [len(r) for r in plan_split(devices, layers, split)] == counts
        return
    with pytest.raises(SplitError) as err:
        plan_split(devices, layers, split)
    assert str(err.value).startswith(f"{over[0].name} has ")


def test_device_memory_is_one_size_for_each_device_or_one_per_device():
    one = EngineConfig.from_flags(
        ["--model-path", "m", "--devices", "cpu,cpu", "--device-memory", "3GiB"]
    ).memory
    assert [one.budget_bytes(None, i) for i in range(2)] == [3 * GIB, 3 * GIB]
    each = EngineConfig.from_flags(
        ["--model-path", "m", "--devices", "cuda:0,cuda:1", "--device-memory", "12GiB,8GiB"]
    ).memory
    assert each.device_memory_bytes == (12 * GIB, 8 * GIB)
    # a GPU plans its free memory, at most its own size
    assert [each.budget_bytes(10 * GIB, i) for i in range(2)] == [10 * GIB, 8 * GIB]
    assert [each.budget_bytes(6 * GIB, i) for i in range(2)] == [6 * GIB, 6 * GIB]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--devices", "cuda:0,cuda:1", "--device-memory", "12GiB,8GiB,4GiB"],
            "--device-memory 12GiB,8GiB,4GiB gives 3 sizes for 2 device(s) (cuda:0,cuda:1); "
            "give one size for each device, or one per device of --devices",
        ),
        (
            ["--device", "cuda:0", "--device-memory", "12GiB,8GiB"],
            "--device-memory 12GiB,8GiB gives 2 sizes for 1 device(s) (cuda:0); give one size "
            "for each device, or one per device of --devices",
        ),
    ],
)
def test_device_memory_of_other_parts_than_the_devices_is_refused(flags, message):
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_flags(["--model-path", "m", *flags])
    assert str(err.value) == message


def test_a_device_memory_list_that_is_no_sizes_is_refused_in_words(capsys):
    assert "'lots' is not a size" in parse_error(capsys, "--device-memory", "12GiB,lots")


def test_an_older_smaller_card_on_a_narrower_link_gets_fewer_layers():
    """Qwen3-30B-A3B across an RTX 4090 (24 GiB, PCIe 4.0 x16, 1008 GB/s memory) and an RTX
    3060 (12 GiB, PCIe 3.0 x8, 360 GB/s): the old card takes fewer layers, the steps come out
    within one layer of each other, and the plan names the card that limits; two equal cards
    share the layers evenly."""
    request = EngineConfig.from_flags(["--model-path", "m"]).memory_request(
        budget_bytes=0, elem_bytes=2, cuda=False
    )
    new = DeviceBudget("cuda:0", 24 * GIB, 25.0, 1008.0)
    old = DeviceBudget("cuda:1", 12 * GIB, 6.0, 360.0)
    split = plan_devices(A3B, request, (new, old))
    counts = [len(r) for r in split.ranges]
    assert counts[0] > 2 * counts[1] and sum(counts) == 48
    limit = split.limit
    assert limit.seconds == max(step.seconds for step in split.steps)
    assert str(limit.limit_text()).startswith(f"{limit.device.name} limits the step: its layers'")
    # a layer moved off the card that limits leaves the other card's step as long or longer
    d = split.steps.index(limit)
    moved = list(counts)
    moved[d], moved[1 - d] = moved[d] - 1, moved[1 - d] + 1
    shares = tuple(step.device for step in split.steps)
    after = step_estimates(shares, layer_bytes(A3B, request), tuple(moved))
    assert max(step.seconds for step in after) >= limit.seconds
    same = plan_devices(A3B, request, (new, DeviceBudget("cuda:1", 24 * GIB, 25.0, 1008.0)))
    assert [len(r) for r in same.ranges] == [24, 24]


def test_each_card_of_a_split_plans_its_own_prefill_attention_path():
    """A newer card runs a later chunk's attention in flash attention, an older one (before
    compute capability 8.0) gathers, repeats and masks: with 40K tokens of KV reserved, the old
    card's plan keeps fewer expert slots than the same card planned with flash attention, by
    the two paths' difference in transient, and the new card's plan is unchanged by its
    neighbour's path."""
    request = EngineConfig.from_flags(
        ["--model-path", "m", "--kv-reserve-tokens", "40960"]
    ).memory_request(budget_bytes=0, elem_bytes=2, cuda=True)
    assert request.chunk_attention == "flash"
    new = DeviceBudget("cuda:0", 24 * GIB, 25.0, 1008.0, "flash")
    old = DeviceBudget("cuda:1", 24 * GIB, 25.0, 1008.0, "masked")
    mixed = plan_devices(A3B, request, (new, old), LayerSplit.parse("24,24"))
    same = plan_devices(A3B, request, (new, dataclasses.replace(old, chunk_attention=None)),
                        LayerSplit.parse("24,24"))  # fmt: skip
    assert mixed.plans[0] == same.plans[0]
    extra = chunk_attention_bytes(A3B, request.prefill_chunk_tokens, 40960, 2, False) - (
        chunk_attention_bytes(A3B, request.prefill_chunk_tokens, 40960, 2, True)
    )
    assert extra > 0
    fewer = same.plans[1].slots - mixed.plans[1].slots
    assert fewer == pytest.approx(extra / mixed.plans[1].slot_bytes, abs=1)


def test_a_card_with_slower_memory_gets_fewer_layers_where_every_expert_fits():
    """Equal memory and links, every expert resident: the step is the dense work, so the card
    whose memory reads at 360 GB/s takes fewer layers than the 1008 GB/s one and is named as
    what limits; where a card's memory rate is not known, the layers follow the memory."""
    layers = (LayerBytes(GIB // 100, GIB // 50, GIB // 100, 8 / 128),) * 30
    fast = DeviceShare("cuda:0", 20 * GIB, 25.0, 1008.0)
    slow = DeviceShare("cuda:1", 20 * GIB, 25.0, 360.0)
    counts = default_counts((fast, slow), layers)
    assert counts == (22, 8)
    steps = step_estimates((fast, slow), layers, counts)
    assert all(step.miss_s == 0 for step in steps)
    limit = max(steps, key=lambda step: step.seconds)
    assert str(limit.limit_text()) == (
        "cuda:1 limits the step: its layers' dense work reads its memory at 360 GB/s"
    )
    unknown = dataclasses.replace(slow, memory_gbps=None)
    assert default_counts((fast, unknown), layers) == (15, 15)


@settings(max_examples=200, deadline=None)
@given(device=_devices(True).map(lambda ds: ds[0]), k=st.integers(2, 4), layers=layers_st)
def test_equal_cards_share_the_layers_evenly(device, k, layers):
    cards = tuple(dataclasses.replace(device, name=f"cuda:{i}") for i in range(k))
    try:
        counts = default_counts(cards, layers)
    except SplitError:
        return
    assert max(counts) - min(counts) <= 1


def test_a_device_given_only_dense_layers_plans_no_expert_slots():
    """Qwen3-30B-A3B with its first six layers dense, split 6,42: the first card plans no expert
    slots and no prefill buffer (it holds every expert of its layers: none), the second card's
    slots are the split's; the default split gives the first card MoE layers too."""
    spec = ModelSpec.from_config(
        dict(make_config("qwen3_moe", "qwen3-30b-a3b"), mlp_only_layers=list(range(6)))
    )
    request = EngineConfig.from_flags(["--model-path", "m"]).memory_request(
        budget_bytes=0, elem_bytes=2, cuda=False
    )
    cards = (DeviceBudget("cuda:0", 12 * GIB, 25.0, 1008.0),
             DeviceBudget("cuda:1", 24 * GIB, 25.0, 1008.0))  # fmt: skip
    split = plan_devices(spec, request, cards, LayerSplit(counts=(6, 42)))
    first, second = split.plans
    assert (first.slots, first.experts_total, first.prefill_buffer_bytes) == (0, 0, 0)
    assert first.all_resident and not second.all_resident
    assert split.total.slots == second.slots > 0
    assert split.total.experts_total == 42 * spec.num_experts
    assert len(plan_devices(spec, request, cards).ranges[0]) > 6


def test_a_device_that_cannot_hold_its_slots_is_named():
    """--moe-cache-size is each device's slots (at most its layers' experts): where one device
    cannot hold them, the refusal names that device before the plan's own words."""
    config = EngineConfig.from_flags(["--model-path", "m", "--moe-cache-size", "1000"])
    request = config.memory_request(budget_bytes=0, elem_bytes=2, cuda=False)
    cards = (DeviceBudget("cuda:0", 24 * GIB, 25.0, 1008.0),
             DeviceBudget("cuda:1", 8 * GIB, 25.0, 1008.0))  # fmt: skip
    with pytest.raises(MemoryPlanError, match=r"^cuda:1: 1000 expert slots \("):
        plan_devices(A3B, request, cards, LayerSplit(counts=(24, 24)))
    big = (cards[0], DeviceBudget("cuda:1", 24 * GIB, 25.0, 1008.0))
    split = plan_devices(A3B, request, big, LayerSplit(counts=(40, 8)))
    assert [p.slots for p in split.plans] == [1000, 1000]
    split = plan_devices(A3B, request, big, LayerSplit(counts=(47, 1)))
    assert [p.slots for p in split.plans] == [1000, A3B.num_experts]
    assert split.plans[1].all_resident and not split.plans[0].all_resident
