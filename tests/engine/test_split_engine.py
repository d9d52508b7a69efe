"""A model split across devices (`--devices cpu,cpu` emulates two on the CPU): the same greedy
tokens and fp32 logits as one device and as transformers, resident and offloaded, each device
holding its own layers' KV and expert cache, the activations crossing once per boundary."""

from __future__ import annotations

import httpx
import pytest
import torch

from moelab.engine.config.config import EngineConfig
from moelab.engine.config.memory import MemoryPlanError
from moelab.engine.model.placement import LayerPlacement
from moelab.engine.process.launch import start_engine, stop_engine, wait_ready
from moelab.engine.runtime.engine import Engine
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from tests.ports import free_port

from .reference import (
    assert_same_greedy,
    build_reference,
    hf_greedy,
    hf_logits,
    relative_error,
)

pytest.importorskip(
    "transformers", reason="transformers is the reference (pip install -e '.[test]')"
)

# three architectures unlike each other: qwen3_moe (q/k norm, a dense layer among MoE ones),
# qwen2_moe (shared experts, attention biases) and gpt_oss (sinks, sliding windows on alternate
# layers, expert biases); four layers, so that a split has layers of each kind on either side
GEOMETRIES = {
    "qwen3_moe": dict(num_hidden_layers=4, mlp_only_layers=[2], num_experts=10),
    "qwen2_moe": dict(num_hidden_layers=4, decoder_sparse_step=1, num_experts=9),
    "gpt_oss": dict(
        num_hidden_layers=4,
        num_experts=8,
        sliding_window=6,
        swiglu_limit=1.5,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}
# resident: every expert in its device's cache; offloaded: 3 slots a device, the rest missed
CACHES = {"resident": [], "offloaded": ["--moe-cache-size", "3"]}


def engine(path, *flags: str) -> Engine:
    common = ["--dtype", "float32", "--moe-cpu-threads", "1", "--bank-dir", str(path / "bank")]
    return Engine(EngineConfig.from_flags(["--model-path", str(path), *common, *flags]))


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(GEOMETRIES))
def checkpoint(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    return arch, build_reference(arch, path, seed=7, **GEOMETRIES[arch]), path


@pytest.fixture(scope="module", params=list(CACHES))
def engines(request, checkpoint):
    arch, model, path = checkpoint
    cache = CACHES[request.param]
    one = engine(path, "--device", "cpu", *cache)
    split = engine(path, "--devices", "cpu,cpu", "--layer-split", "1,3", *cache)
    yield arch, model, one, split, request.param
    one.close()
    split.close()


def test_the_split_scores_a_prompt_as_one_device_and_transformers_do(engines):
    arch, model, one, split, _ = engines
    ids = prompt(1, 29)
    ours = split.score(ids)
    assert torch.equal(ours, one.score(ids)), arch
    assert relative_error(ours, hf_logits(model, ids)) < 1e-4, arch


def test_the_split_decodes_the_same_greedy_tokens(engines):
    arch, model, one, split, cache = engines
    ids = prompt(2, 9)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    counters = split.moe.counters  # live, as a benchmark reads them before and after a run
    before = counters.reads.copy()
    [ours] = split.generate([ids], params)
    # every MoE layer of both devices counted its reads into the model's counters
    assert ((split.moe.counters.reads - before) > 0).all() and split.moe.counters is counters
    assert ours == one.generate([ids], params)[0], (arch, cache)
    ref, margins = hf_greedy(model, ids, 24)
    assert_same_greedy(ours, ref, margins)
    # a batch of prompts of other lengths runs through the split as through one device
    prompts = [prompt(3, 5), prompt(4, 17), prompt(5, 11)]
    assert split.generate(prompts, params) == one.generate(prompts, params)
    if cache == "offloaded":  # the split's misses were fetched or run on the CPU
        reads, misses = split.moe.decode_reads
        assert misses > 0 and reads > misses


def test_each_device_holds_its_own_layers_kv_and_experts(engines):
    arch, _model, _one, split, cache = engines
    assert [(r.start, r.stop) for r in split.split.ranges] == [(0, 1), (1, 4)]
    # the KV of each device's paged attention layers, the same pages on both (gpt_oss's
    # sliding layers 0 and 2 keep their rings on their own devices instead)
    if arch == "gpt_oss":
        assert [part.k.shape[0] for part in split.kv_parts] == [0, 2]
        assert [part.k.shape[0] for part in split.states.parts] == [1, 1]
    else:
        assert [part.k.shape[0] for part in split.kv_parts] == [1, 3]
    assert split.kv_parts[0].num_blocks == split.kv_parts[1].num_blocks
    # each device's cache holds its own MoE layers' experts (qwen3_moe's layer 2 is dense)
    moe_on_second = 2 if arch == "qwen3_moe" else 3
    caches = split.cache.caches
    assert [c.num_layers for c in caches] == [1, moe_on_second]
    if cache == "resident":
        assert [c.slots for c in caches] == [c.num_layers * split.spec.num_experts for c in caches]
    else:
        assert [c.slots for c in caches] == [3, 3]
    # the counters come back per MoE layer of the whole model, in order
    assert len(split.moe.counters.reads) == split.spec.num_moe_layers


def test_activations_cross_once_per_boundary_and_logits_come_back(engines, monkeypatch):
    _arch, _model, _one, split, _cache = engines
    crossed, moved_back = [], []
    cross, to_first = LayerPlacement.cross, LayerPlacement.to_first
    monkeypatch.setattr(
        LayerPlacement, "cross", lambda self, layer, state: crossed.append(layer) or
        cross(self, layer, state),
    )  # fmt: skip
    monkeypatch.setattr(
        LayerPlacement, "to_first", lambda self, t: moved_back.append(t.shape) or
        to_first(self, t),
    )  # fmt: skip
    split.generate([prompt(6, 7)], SamplingParams(max_tokens=3, ignore_eos=True))
    steps = len(moved_back)
    assert steps == 3 and crossed == [1] * steps


def test_a_split_engine_resizes_each_device_and_decodes_the_same_tokens(checkpoint):
    """A resize plans each device again over its own layers: --moe-cache-size's slots on each
    device (at most its layers' experts; every expert where that is all of them), the same KV
    tokens on every device; the greedy tokens stay transformers'; a size that does not fit is
    refused in words and leaves the engine as it was."""
    arch, model, path = checkpoint
    split = engine(path, "--devices", "cpu,cpu", "--layer-split", "1,3", *CACHES["offloaded"])
    try:
        ids = prompt(2, 9)
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        ref, margins = hf_greedy(model, ids, 16)
        experts = [len(span) * split.spec.num_experts
                   for span in split.layers_on.moe_ranges(split.spec.moe_layers)]  # fmt: skip
        for slots in (5, 1, 10**6):
            split.resize_cache(slots)
            want = [min(slots, n) for n in experts]
            assert [c.slots for c in split.cache.caches] == want, arch
            assert [p.slots for p in split.split.plans] == want
            assert split.plan.slots == split.cache.slots == sum(want)
            assert split.cache.holds_everything == (slots >= max(experts))
            assert_same_greedy(split.generate([ids], params)[0], ref, margins)
        tokens = split.kv.capacity_tokens
        split.resize_kv(tokens + 64)
        assert [kv.capacity_tokens for kv in split.kv_parts] == [split.kv.capacity_tokens] * 2
        assert split.kv.capacity_tokens >= tokens + 64
        assert split.model.kv_parts is split.kv_parts
        assert split.max_context == split.plan.max_context
        assert_same_greedy(split.generate([ids], params)[0], ref, margins)
        before = [c.slots for c in split.cache.caches], split.kv.capacity_tokens
        with pytest.raises(MemoryPlanError, match="lower --kv-reserve-tokens"):
            split.resize_kv(10**9)
        assert ([c.slots for c in split.cache.caches], split.kv.capacity_tokens) == before
        assert_same_greedy(split.generate([ids], params)[0], ref, margins)
    finally:
        split.close()


def test_stats_report_each_device_and_the_plan_sums_them(engines):
    """/v1/stats: a `devices` list, one entry per device with its layers, link, slots and
    memory plan; memory.device one entry per device; the plan the devices' sum."""
    _arch, _model, one, split, _cache = engines
    stats = split.telemetry.stats(running=0, queued=0, model_name="m")
    devices = stats["devices"]
    assert [d["device"] for d in devices] == ["cpu", "cpu"]
    assert [d["layers"] for d in devices] == [[0, 0], [1, 3]]
    assert [d["slots"] for d in devices] == [c.slots for c in split.cache.caches]
    assert all(d["link_gbps"] > 0 for d in devices)
    # the planner's step estimate per device, and the one device named as what limits the step
    # (a CPU's memory rate is not measured)
    assert [d["memory_gbps"] for d in devices] == [None, None]
    assert sum(d["limits"] for d in devices) == 1 and all(d["step_ms"] >= 0 for d in devices)
    memory = stats["memory"]["device"]
    rings = split.states.part_bytes() if _arch == "gpt_oss" else [0, 0]
    assert [m["kv"] for m in memory] == [
        p.nbytes + r for p, r in zip(split.kv_parts, rings, strict=True)
    ]
    assert [m["expert_cache"] for m in memory] == [c.nbytes for c in split.cache.caches]
    plan = stats["memory"]["plan"]
    assert plan["kv_bytes"] == sum(d["plan"]["kv_bytes"] for d in devices)
    assert plan["slots"] == stats["experts"]["slots"] == split.cache.slots
    assert plan["kv_tokens"] == devices[0]["kv_tokens"] == devices[1]["kv_tokens"]
    # one device: a list of one, the whole model on it
    [alone] = one.telemetry.stats(running=0, queued=0, model_name="m")["devices"]
    assert alone["layers"] == [0, 3] and alone["slots"] == one.cache.slots


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("cache", list(CACHES))
def test_two_gpus_in_bf16_decode_as_one_does(checkpoint, cache):
    """On two GPUs in bf16 against one GPU (both eager): the same greedy tokens, logits within
    bf16's rounding; the activations cross between the cards, each card holds its own part."""
    arch, _model, path = checkpoint
    bf16 = ("--dtype", "bfloat16", "--no-cuda-graph", *CACHES[cache])
    one = engine(path, "--device", "cuda:0", *bf16)
    split = engine(path, "--devices", "cuda:0,cuda:1", "--layer-split", "1,3", *bf16)
    try:
        assert [part.k.device.index for part in split.kv_parts] == [0, 1]
        assert [c.device.index for c in split.cache.caches] == [0, 1]
        ids = prompt(8, 33)
        assert relative_error(split.score(ids), one.score(ids)) < 1e-2, arch
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        prompts = [prompt(9, 7), prompt(10, 19)]
        assert split.generate(prompts, params) == one.generate(prompts, params), arch
        # each card's cache and KV resized: the same tokens again
        split.resize_cache(5)
        split.resize_kv(split.kv.capacity_tokens + 64)
        assert [c.device.index for c in split.cache.caches] == [0, 1]
        assert split.generate(prompts, params) == one.generate(prompts, params), arch
    finally:
        one.close()
        split.close()


def test_a_hybrid_model_split_keeps_each_devices_states_and_matches(tmp_path):
    """Qwen3-Next split after its first attention layer: each device keeps its own linear
    layers' recurrent states and attention layers' KV; the same logits and tokens as one
    device and transformers, a second turn resumed from a state checkpoint on both devices."""
    from .test_hybrid import CHUNK, build_hybrid

    model = build_hybrid("qwen3_next", tmp_path, seed=2)
    one = engine(tmp_path, "--device", "cpu", "--prefill-chunk-tokens", CHUNK)
    split = engine(
        tmp_path, "--devices", "cpu,cpu", "--layer-split", "2,3", "--prefill-chunk-tokens", CHUNK
    )
    try:
        assert split.spec.linear_layers == (0, 2, 3) and split.spec.attention_layers == (1, 4)
        assert [part.k.shape[0] for part in split.kv_parts] == [1, 1]
        per_layer = split.states.bytes_per_slot // 3
        rows = split.states.num_slots + 1 + split.states.checkpoint_capacity
        assert split.states.part_bytes() == [per_layer * rows, 2 * per_layer * rows]
        ids = prompt(11, 90)
        ours = split.score(ids)
        assert torch.equal(ours, one.score(ids))
        assert relative_error(ours, hf_logits(model, ids)) < 1e-4
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        first, turn = prompt(12, 40), prompt(12, 40)[:32] + prompt(13, 9)
        outputs = []
        for eng in (one, split):
            # the first request keeps a state checkpoint after its 32nd token, where the
            # second (a chat's next turn) parts from it and resumes
            eng.add(first, params, boundaries=(32,))
            eng.run_until_idle()
            outputs.append(eng.add(turn, params))
            eng.run_until_idle()
        assert split.states.checkpoints_resumed == one.states.checkpoints_resumed == 1
        assert outputs[1].output_ids == outputs[0].output_ids
        ref, margins = hf_greedy(model, turn, 16)
        assert_same_greedy(outputs[1].output_ids, ref, margins)
    finally:
        one.close()
        split.close()


def test_a_gpt_oss_split_keeps_each_devices_rings_and_matches(tmp_path):
    """gpt-oss split after its first full layer, pages of 4 tokens (rings of 8 for a window of
    6): each device keeps its own sliding layer's rings and full layer's KV; the same logits and
    tokens as one device and transformers over prefill chunks longer than the window, and a
    second prompt resumed from a window checkpoint taken on both devices, each of its tokens
    with transformers' log probability."""
    from .test_gpt_oss import assert_logprobs_match

    model = build_reference("gpt_oss", tmp_path, seed=3, **GEOMETRIES["gpt_oss"])
    flags = ["--kv-block-size", "4", "--prefill-chunk-tokens", "7",
             "--state-checkpoint-interval", "8"]  # fmt: skip
    one = engine(tmp_path, "--device", "cpu", *flags)
    split = engine(tmp_path, "--devices", "cpu,cpu", "--layer-split", "2,2", *flags)
    try:
        rings = split.states
        assert split.spec.sliding_layers == (0, 2) and rings.ring_tokens == 8
        assert [part.k.shape[0] for part in rings.parts] == [1, 1]
        assert [part.k.shape[0] for part in split.kv_parts] == [1, 1]
        assert rings.part_bytes() == [rings.nbytes // 2] * 2
        ids = prompt(21, 29)
        ours = split.score(ids)
        assert torch.equal(ours, one.score(ids))
        assert relative_error(ours, hf_logits(model, ids)) < 1e-4
        params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
        first = prompt(22, 30)
        turn = first[:24] + prompt(23, 10)
        outputs = []
        for eng in (one, split):
            eng.generate([first], params)
            outputs.append(eng.add(turn, params))
            eng.run_until_idle()
            assert eng.scheduler.cached_tokens == 24
        assert split.states.checkpoints_resumed == one.states.checkpoints_resumed == 1
        assert outputs[1].output_ids == outputs[0].output_ids
        assert outputs[1].output_logprobs == outputs[0].output_logprobs
        assert_logprobs_match(model, outputs[1], 1e-4)
    finally:
        one.close()
        split.close()


def test_a_split_the_model_or_the_devices_cannot_take_is_refused_in_words(checkpoint):
    arch, _model, path = checkpoint
    with pytest.raises(MemoryPlanError) as err:
        engine(path, "--devices", "cpu,cpu", "--layer-split", "2,3")
    assert str(err.value).startswith("--layer-split 2,3 places 5 layers, but the model has 4")
    # a budget too small for a device's layers' share of a long KV reserve: the first such
    # device is named (cpu,cpu names both devices alike); gpt_oss's first device holds only a
    # sliding layer, whose window keeps no pages, so its second is the first that cannot
    named = 3 if arch == "gpt_oss" else 1
    refused = (
        rf"^cpu has 0\.\d\d GiB for its layers, but the dense weights and KV of its {named} of"
    )
    with pytest.raises(MemoryPlanError, match=refused):
        engine(path, "--devices", "cpu,cpu", "--layer-split", "1,3", "--device-memory", "600MiB",
               "--kv-reserve-tokens", "400000")  # fmt: skip


# a device whose layers are all dense: the first of the default split (qwen3_moe's layers 0 and 1
# dense), or the last of a split by hand (qwen3_moe's layer 3 dense)
DENSE_ONLY = {
    "first": (dict(mlp_only_layers=[0, 1]), [], [(0, 2), (2, 4)]),
    "last": (dict(mlp_only_layers=[3]), ["--layer-split", "3,1"], [(0, 3), (3, 4)]),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("layout", list(DENSE_ONLY))
def test_a_device_with_only_dense_layers_serves_without_an_expert_cache(tmp_path, layout, cache):
    """A device whose range of layers holds no MoE layer has no expert cache and no runner;
    the split scores and decodes as one device and transformers do, and /v1/stats reports the
    device with no slots."""
    dense, split_flags, ranges = DENSE_ONLY[layout]
    model = build_reference("qwen3_moe", tmp_path, seed=4, num_hidden_layers=4, num_experts=10,
                            **dense)  # fmt: skip
    one = engine(tmp_path, "--device", "cpu", *CACHES[cache])
    split = engine(tmp_path, "--devices", "cpu,cpu", *split_flags, *CACHES[cache])
    try:
        assert [(r.start, r.stop) for r in split.split.ranges] == ranges
        empty = 0 if layout == "first" else 1
        assert split.cache.caches[empty] is None and split.moe.runners[empty] is None
        assert split.split.plans[empty].slots == 0
        ids = prompt(31, 23)
        ours = split.score(ids)
        assert torch.equal(ours, one.score(ids))
        assert relative_error(ours, hf_logits(model, ids)) < 1e-4
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        prompts = [prompt(32, 9), prompt(33, 14)]
        assert split.generate(prompts, params) == one.generate(prompts, params)
        ref, margins = hf_greedy(model, prompts[0], 16)
        assert_same_greedy(split.generate(prompts[:1], params)[0], ref, margins)
        assert (split.moe.counters.reads > 0).all()
        stats = split.telemetry.stats(running=0, queued=0, model_name="m")
        assert stats["devices"][empty]["slots"] == 0
        assert stats["memory"]["device"][empty]["expert_cache"] == 0
        assert stats["experts"]["slots"] == split.cache.slots == one.cache.slots
    finally:
        one.close()
        split.close()


def test_a_split_engine_process_resizes_over_http(tmp_path):
    """`POST /v1/cache/resize` on a real split engine process: each device's slots in the
    answer and in /v1/stats, a size no device can hold refused with a 409 in words, and the
    engine serving afterwards."""
    model = synthesize(tmp_path / "model", preset="tiny", routing_skew=1.0, seed=5)
    port = free_port()
    process = start_engine(
        ["--model-path", str(model), "--port", str(port), "--devices", "cpu,cpu",
         "--device-memory", "1GiB", "--bank-dir", str(tmp_path / "bank"),
         "--moe-cache-size", "4", "--max-context", "64"],
        tmp_path / "engine.log",
    )  # fmt: skip
    try:
        wait_ready(process, timeout_s=300)
        with httpx.Client(base_url=process.base_url, timeout=120) as client:
            r = client.post("/v1/cache/resize", json={"moe_cache_size": 6})
            assert r.status_code == 200, r.text
            body = r.json()
            devices = client.get("/v1/stats").json()["devices"]
            assert [d["slots"] for d in body["devices"]] == [d["slots"] for d in devices]
            assert all(0 < d["slots"] <= 6 for d in body["devices"])
            assert body["moe_cache_size"] == sum(d["slots"] for d in devices)
            r = client.post("/v1/cache/resize", json={"kv_reserve_tokens": 2**30})
            assert r.status_code == 409 and "kv-reserve-tokens" in r.json()["error"]["message"]
            assert [d["slots"] for d in client.get("/v1/stats").json()["devices"]] == [
                d["slots"] for d in devices
            ]
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        stop_engine(process)
