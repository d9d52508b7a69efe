"""Recommended on a matrix of machines and checkpoints, against numbers worked out by hand."""

from __future__ import annotations

import itertools
import math

import pytest

from moelab.engine.config.memory import MemoryPlanError
from moelab.profiles.flags import engine_config, validate_flags
from moelab.profiles.machine import GIB, Gpu, Machine, Rates, choose_device, plan_for
from moelab.profiles.recommend import BenchmarkResult, compare, recommend

from .geometry import HYBRID, SPECS

MIB = 1024**2

# what `moelab bench bw` might report on a 16-core PC with a PCIe 4 x16 GPU
RATES = Rates(
    h2d_gbps=24.0,
    device_gbps=900.0,
    cpu_experts_gbps={1: 6.0, 2: 11.0, 4: 19.0, 8: 24.0, 15: 25.0},
    host_read_gbps={1: 10.0, 15: 60.0},
    engine_version="0.1.0",
)

# ---- Qwen3-30B-A3B worked out by hand (bfloat16, 2 bytes a weight) ---------------------------
# dense parameters: per layer attention 2048*(4096+2*512) + 4096*2048 + 2*2048 + 2*128 (q/k norm)
# = 18,878,720, times 48 = 906,178,560; routers 2048*128*48 = 12,582,912; embeddings and head
# 151936*2048*2 = 622,329,856; final norm 2048: 1,541,093,376 parameters.
A3B_WEIGHTS = 1_541_093_376 * 2
A3B_EXPERT = 3 * 2048 * 768 * 2  # 9,437,184 bytes
A3B_EXPERTS = 48 * 128  # 6144; 10% of them is 615 slots
A3B_KV_PER_TOKEN = 2 * 48 * 4 * 128 * 2  # 98,304 bytes
A3B_BUFFER = 2 * 128 * A3B_EXPERT  # two whole layers streamed during prefill
HEADROOM = 512 * MIB
# activation bytes per prompt token: residual etc. 6*2048*2, qkv and rotated copies
# (4096+2*512)*2*2, router 128*4*2, grouped MoE 8*3*768*4, fp32 output 2048*4*2, dense 2*6144*2
A3B_ACT_PER_TOKEN = 24576 + 20480 + 1024 + 73728 + 16384 + 24576  # 160,768


def a3b_activations(chunk: int, running: int) -> int:
    return int(chunk * A3B_ACT_PER_TOKEN * 1.25) + running * 151936 * 4 * 2 + 64 * MIB


def a3b_chunk_attention(kv_tokens: int, chunk: int) -> int:
    """A later prefill chunk's attention on a card with flash attention: the keys and values of
    the whole context (4 KV heads of 128) gathered from the pages."""
    return 2 * kv_tokens * 4 * 128 * 2 if kv_tokens > chunk else 0


def a3b_slots(budget: int, kv_tokens: int, chunk: int, running: int) -> int:
    graphs = 32 * MIB + running * 4 * MIB + running * 151936 * 64  # with the device draws'
    fixed = A3B_WEIGHTS + kv_tokens * A3B_KV_PER_TOKEN + a3b_activations(chunk, running)
    fixed += a3b_chunk_attention(kv_tokens, chunk)
    left = budget - fixed - graphs - HEADROOM
    buffer = A3B_BUFFER if left >= A3B_BUFFER else 0
    return (left - buffer) // A3B_EXPERT


def card(vram_gib: float, free_gib: float, index: int = 0) -> Gpu:
    return Gpu(index, f"{vram_gib:.0f} GB card", f"uuid-{index}", int(vram_gib * GIB),
               int(free_gib * GIB))  # fmt: skip


def machine(
    gpus: tuple[Gpu, ...], ram_gib: int = 64, cores: int = 16, rates: bool = True
) -> Machine:
    return Machine("pc", "0.1.0", cores, ram_gib * GIB, gpus, RATES if rates else None)


def advice(rec) -> dict:
    return {a.flag: a for a in rec.advice}


def test_30b_on_a_24gb_card_gets_its_whole_context() -> None:
    budget = int(23.5 * GIB)
    # chunk: the largest whose activations fit 1/8 of what the weights leave
    assert a3b_activations(8192, 8) <= (budget - A3B_WEIGHTS) / 8
    slots = a3b_slots(budget, 40960, 8192, 8)
    assert slots == 1400 and slots >= math.ceil(0.1 * A3B_EXPERTS)
    rec = recommend(machine((card(24, 23.5),)), SPECS["30b"])
    a = advice(rec)
    assert a["--prefill-chunk-tokens"].value == "8192"
    assert a["--kv-reserve-tokens"].value == "40960"
    assert a["--kv-reserve-tokens"].numbers["slots"] == 1400
    assert "the model's whole context (40960 tokens" in str(a["--kv-reserve-tokens"].reason)
    # 1400 of 6144 is 23%, under a quarter: fewer requests at once
    assert a["--max-running-requests"].value == "4"
    final = a3b_slots(budget, 40960, 8192, 4)  # 4 running: smaller logits and graph pools
    assert final == 1407 and a["--moe-cache-size"].value is None
    assert a["--moe-cache-size"].numbers["slots"] == final
    # 8 threads reach 24.0 GB/s, 96% of the best 25.0 (15 threads); 4 threads only 76%
    assert a["--moe-cpu-threads"].value == "8" and a["--moe-cpu-threads"].source == "measured"
    assert a["--moe-miss-policy"].value == "auto"
    assert a["--moe-miss-policy"].numbers["fetch_fraction"] == 0.5  # 24 / (24 + 24)
    assert "--device" not in a  # one GPU: auto picks it
    assert rec.warnings == ()  # 54 GiB of experts in 64 GiB leaves more than 4 GiB
    split = rec.vram_split()
    assert split["bytes"]["weights"] == A3B_WEIGHTS
    # the remainder past the last slot holds one more 16-token block of KV here
    assert split["bytes"]["kv"] == (40960 + 16) * A3B_KV_PER_TOKEN
    assert split["bytes"]["expert_cache"] == final * A3B_EXPERT
    assert split["weights"] == 2.871 and split["slots"] == final


def test_30b_on_a_12gb_card_keeps_the_default_context_and_says_why() -> None:
    budget = int(11.5 * GIB)
    assert a3b_activations(8192, 8) > (budget - A3B_WEIGHTS) / 8 >= a3b_activations(4096, 8)
    # the most slots any tier leaves (2048 tokens) is still under 10% of the experts
    assert a3b_slots(budget, 2048, 4096, 8) == 536 < 615
    rec = recommend(machine((card(12, 11.5),), ram_gib=32), SPECS["30b"])
    a = advice(rec)
    assert a["--prefill-chunk-tokens"].value == "4096"
    assert a["--kv-reserve-tokens"].value == "8192"
    assert a["--kv-reserve-tokens"].numbers["slots"] == a3b_slots(budget, 8192, 4096, 8) == 471
    assert "no context leaves 10% of the experts (615 slots)" in str(
        a["--kv-reserve-tokens"].reason
    )
    assert any("fewer than 10% of the experts fit" in w for w in map(str, rec.warnings))
    # 54 GiB of experts cannot sit in 32 GiB of RAM
    assert any("does not fit in 32.00 GiB of RAM" in w for w in map(str, rec.warnings))


def test_30b_fp8_counts_its_experts_in_fp8_for_ram_and_slots() -> None:
    """Qwen3-30B-A3B-FP8: its 27 GiB of FP8 experts fit 32 GiB of RAM where the bf16 build's 54
    do not, and the same card plans more slots, each of FP8 bytes."""
    from moelab.engine.model.spec import ModelSpec

    from .geometry import A3B

    fp8_config = {
        **A3B,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    fp8 = ModelSpec.from_config(fp8_config)
    small_ram = machine((card(12, 11.5),), ram_gib=32)
    rec, bf16_rec = recommend(small_ram, fp8), recommend(small_ram, SPECS["30b"])
    assert not any("RAM" in w for w in map(str, rec.warnings))
    assert any("does not fit in 32.00 GiB of RAM" in w for w in map(str, bf16_rec.warnings))
    slots = advice(rec)["--moe-cache-size"].numbers["slots"]
    assert slots > 1.4 * advice(bf16_rec)["--moe-cache-size"].numbers["slots"]
    assert rec.vram_split()["bytes"]["expert_cache"] == slots * fp8.expert_bytes_as("fp8")


def test_30b_fp8_s_chunk_advice_and_pool_count_the_fp8_experts() -> None:
    """The prefill chunk's reason names the bytes a chunk streams: Qwen3-30B-A3B-FP8's experts in
    FP8 (27.01 GiB: values and their 128x128 block factors), not at bf16 size (54.00 GiB)."""
    from moelab.engine.model.spec import ModelSpec

    from .geometry import A3B

    fp8_config = {
        **A3B,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    fp8 = ModelSpec.from_config(fp8_config)
    expert = 3 * 2048 * 768 + 4 * (12 * 16 + 16 * 6)  # w13's and w2's block factors, fp32
    assert fp8.expert_pool_bytes == A3B_EXPERTS * expert
    pc = machine((card(24, 23.5),), ram_gib=64)
    assert "(27.01 GiB for this model)" in str(
        advice(recommend(pc, fp8))["--prefill-chunk-tokens"].reason
    )
    assert "(54.00 GiB for this model)" in str(
        advice(recommend(pc, SPECS["30b"]))["--prefill-chunk-tokens"].reason
    )


def test_a_benchmark_s_fp8_experts_are_what_the_ram_check_counts() -> None:
    """A benchmark that chose --moe-expert-dtype fp8 for the bf16 Qwen3-30B-A3B: its bank of
    27 GiB fits 32 GiB of RAM, and the chunk's reason names the FP8 pool."""
    small_ram = machine((card(24, 23.5),), ram_gib=32)
    result = BenchmarkResult.from_result(
        7, {"flags": ["--moe-expert-dtype", "fp8"]}, engine_version="0.1.0", machine_id=None
    )
    rec = recommend(small_ram, SPECS["30b"], benchmark=result)
    assert not any("RAM" in w for w in map(str, rec.warnings)), rec.warnings
    assert "(27.01 GiB for this model)" in str(advice(rec)["--prefill-chunk-tokens"].reason)


def test_30b_on_a_6gb_card_streams_without_a_prefill_buffer() -> None:
    budget = int(5.5 * GIB)
    assert a3b_activations(2048, 8) > (budget - A3B_WEIGHTS) / 8 >= a3b_activations(1024, 8)
    slots = a3b_slots(budget, 8192, 1024, 8)  # the 2.25 GiB buffer does not fit: none
    assert slots == 109
    rec = recommend(machine((card(6, 5.5),), ram_gib=128), SPECS["30b"])
    a = advice(rec)
    assert a["--prefill-chunk-tokens"].value == "1024"
    assert (a["--kv-reserve-tokens"].value, a["--kv-reserve-tokens"].numbers["slots"]) == (
        "8192",
        slots,
    )
    assert rec.plan is not None and rec.plan.prefill_buffer_bytes == 0
    assert a["--max-running-requests"].value == "4"
    assert not any("of RAM" in w for w in map(str, rec.warnings))


def test_small_model_fits_whole_on_a_6gb_card() -> None:
    # small: 38,029,312 dense parameters (76 MB), 256 experts of 3*1024*512*2 = 3 MiB (0.75 GiB)
    weights, pool = 38_029_312 * 2, 256 * 3 * 1024 * 512 * 2
    act_8192 = int(8192 * 62720 * 1.25) + 8 * 8192 * 8 + 64 * MIB
    budget = int(5.5 * GIB)
    assert act_8192 <= (budget - weights) / 8
    kv = 32768 * 2 * 8 * 4 * 64 * 2  # the whole context: 256 MiB
    graphs = 32 * MIB + 8 * 4 * MIB + 8 * 8192 * 64  # with the device draws'
    assert weights + kv + act_8192 + graphs + HEADROOM + pool <= budget
    rec = recommend(machine((card(6, 5.5),)), SPECS["small"])
    a = advice(rec)
    assert a["--prefill-chunk-tokens"].value == "8192"
    assert a["--kv-reserve-tokens"].value == "32768"
    assert "256 expert slots (100% of 256 experts)" in str(a["--kv-reserve-tokens"].reason)
    assert a["--moe-cache-size"].value is None and "every expert fits" in str(
        a["--moe-cache-size"].reason
    )
    assert str(a["--moe-miss-policy"].reason) == "every expert fits in VRAM: no misses to place"
    assert a["--max-running-requests"].value == "8"
    assert rec.vram_split()["slots"] == 256 and rec.warnings == ()


def test_two_gpus_use_the_one_with_most_memory() -> None:
    gpus = (card(12, 11.0, 0), card(12, 11.5, 1))
    rec = recommend(machine(gpus), SPECS["tiny"])
    a = advice(rec)
    assert a["--device"].value == "cuda:1"
    assert "2 GPUs, and one engine runs on one" in str(a["--device"].reason)
    assert rec.plan is not None and rec.plan.budget_bytes == int(11.5 * GIB)


def test_threads_and_policy_from_the_rates() -> None:
    spec = SPECS["30b"]
    gpu = (card(12, 11.5),)
    # 4 cores: at most 3 threads; of those measured (1 and 2), 2 is fastest
    a = advice(recommend(machine(gpu, cores=4), spec))
    assert a["--moe-cpu-threads"].value == "2" and a["--moe-miss-policy"].value == "auto"
    assert a["--moe-miss-policy"].numbers["fetch_fraction"] == round(24 / (24 + 11), 4)
    # copies and CPU experts together no faster than copies alone: fetch every miss
    slowed = Rates(**{**{f: getattr(RATES, f) for f in Rates.__slots__},
                      "h2d_concurrent_gbps": 14.0, "cpu_concurrent_gbps": 9.0})  # fmt: skip
    pc = Machine("pc", "0.1.0", 16, 64 * GIB, gpu, slowed)
    a = advice(recommend(pc, spec))
    assert a["--moe-miss-policy"].value == "gpu"
    assert "together 14.0 + 9.0 GB/s, no more than 24.0 GB/s copying alone" in (
        str(a["--moe-miss-policy"].reason)
    )
    # nothing measured: the engine's defaults, said to be so
    a = advice(recommend(machine(gpu, cores=8, rates=False), spec))
    assert a["--moe-cpu-threads"].value == "7" and a["--moe-cpu-threads"].source == "rule"
    assert str(a["--moe-miss-policy"].reason).startswith("not measured yet")


def test_cpu_only_tiny() -> None:
    rec = recommend(machine((), ram_gib=32, cores=4, rates=False), SPECS["tiny"])
    assert rec.flags == [
        "--device", "cpu", "--moe-cache-size", "0", "--moe-miss-policy", "cpu",
        "--kv-reserve-tokens", "4096", "--moe-cpu-threads", "3",
    ]  # fmt: skip
    assert rec.warnings == ()


def test_cpu_only_30b_sizes_the_device_from_ram() -> None:
    # float32 on a CPU: experts 6144 * 3*2048*768*4 = 108 GiB, weights 6,164,373,504 B
    bank, weights = 6144 * 3 * 2048 * 768 * 4, 1_541_093_376 * 4
    assert bank + weights + 4 * GIB <= 128 * GIB  # fits float32: no --dtype advice
    act = int(2048 * 230400 * 1.25) + 8 * 151936 * 8 + 64 * MIB  # default chunk, 4-byte weights
    buffer = 2 * 128 * 3 * 2048 * 768 * 4
    room = 128 * GIB - 4 * GIB - bank
    needed = weights + act + HEADROOM + buffer + 16384 * 2 * 48 * 512 * 4
    assert needed <= room < needed + 16384 * 2 * 48 * 512 * 4  # 16384 fits, 32768 does not
    rec = recommend(machine((), ram_gib=128), SPECS["30b"])
    a = advice(rec)
    assert "--dtype" not in a
    assert a["--kv-reserve-tokens"].value == "16384"
    assert a["--device-memory"].value == f"{-(-needed // MIB)}MiB"
    assert rec.warnings == ()
    # 64 GiB: float32 does not fit, the checkpoint's bfloat16 does (54 + 2.9 + 4 GiB)
    rec = recommend(machine((), ram_gib=64), SPECS["30b"])
    a = advice(rec)
    assert a["--dtype"].value == "bfloat16"
    assert "halves that to 54.00 GiB" in str(a["--dtype"].reason)
    assert any("leaves less than 4.00 GiB" in w for w in map(str, rec.warnings))


def test_asking_for_a_context() -> None:
    gpu = (card(24, 23.5),)
    a = advice(recommend(machine(gpu), SPECS["30b"], context_tokens=16384))
    assert a["--kv-reserve-tokens"].value == "16384"
    assert str(a["--kv-reserve-tokens"].reason).startswith("the 16384-token context asked for")
    rec = recommend(machine(gpu), SPECS["30b"], context_tokens=100_000)
    assert advice(rec)["--kv-reserve-tokens"].value == "40960"
    assert "the model supports at most 40960 tokens; planned for that" in map(str, rec.warnings)
    rec = recommend(machine((card(6, 5.5),)), SPECS["30b"], context_tokens=40960)
    assert any("a 40960-token context does not fit" in w for w in map(str, rec.warnings))
    assert advice(rec)["--kv-reserve-tokens"].value == "8192"


DEVICES = {
    "6gb": (card(6, 5.5),),
    "12gb": (card(12, 11.5),),
    "24gb": (card(24, 23.5),),
    "2x12gb": (card(12, 11.0, 0), card(12, 11.5, 1)),
    "none": (),
}


@pytest.mark.parametrize(
    ("device", "ram", "cores", "rates", "model"),
    list(itertools.product(DEVICES, (32, 64, 128), (4, 16), (True, False), SPECS)),
)
def test_matrix_invariants(device: str, ram: int, cores: int, rates: bool, model: str) -> None:
    spec = SPECS[model]
    pc = machine(DEVICES[device], ram_gib=ram, cores=cores, rates=rates)
    rec = recommend(pc, spec)
    a = advice(rec)
    validate_flags(rec.flags)  # always something the engine accepts
    threads = int(str(a["--moe-cpu-threads"].value))
    assert 1 <= threads <= cores - 1
    assert a["--moe-cpu-threads"].source == ("measured" if rates else "rule")
    assert ("--device" in a) == (device in ("none", "2x12gb"))
    # the context is always set, and never below the engine's default unless a warning says so
    assert "--kv-reserve-tokens" in a
    context = int(str(a["--kv-reserve-tokens"].value))
    assert context >= min(8192, spec.max_position_embeddings) or rec.warnings
    if device == "none":
        return
    assert rec.plan is not None
    config = engine_config(rec.flags)
    choice = choose_device(pc, spec, config)
    need = math.ceil(0.1 * spec.experts_total)
    if context < spec.max_position_embeddings:
        # a longer context would have cost the cache its 10%
        try:
            longest = plan_for(spec, choice, config, kv_tokens=spec.max_position_embeddings)
            assert longest.slots < need
        except MemoryPlanError:
            pass
    else:
        assert rec.plan.slots >= need
    pool = spec.experts_total * spec.expert_bytes
    assert any("of RAM" in w for w in map(str, rec.warnings)) == (pool > ram * GIB - 4 * GIB)


def test_a_benchmark_result_becomes_recommended() -> None:
    pc = machine((card(24, 23.5),))
    result = {
        "flags": [
            "--moe-cache-rate",
            "0.2",
            "--moe-cpu-threads",
            "6",
            "--max-running-requests",
            "8",
        ],
        "notes": [
            {"flag": "--moe-cache-rate", "note": "0.2 decoded 12% faster than 0.1 (confirmed)"},
            {"flag": "--no-cuda-graph", "note": "graphs kept: 8% faster with them"},
            "baseline measured 3 times, spread 1.2%",
        ],
        "hardware": {"gpu_uuids": ["uuid-0"]},
    }
    bench = BenchmarkResult.from_result(3, result, engine_version="0.1.0", machine_id="pc")
    rec = recommend(pc, SPECS["30b"], benchmark=bench)
    a = advice(rec)
    assert rec.basis == "benchmark" and rec.benchmark_run == 3 and not rec.stale
    assert a["--moe-cache-rate"].source == "measured"
    assert str(a["--moe-cache-rate"].reason) == "0.2 decoded 12% faster than 0.1 (confirmed)"
    assert str(a["--moe-cpu-threads"].reason) == "chosen by benchmark run 3"
    assert (a["--no-cuda-graph"].value, a["--no-cuda-graph"].source) == (False, "measured")
    # not covered by the benchmark: the rules; the cache size rule gives way to its rate
    assert a["--kv-reserve-tokens"].source == "rule" and "--moe-cache-size" not in a
    assert a["--prefill-chunk-tokens"].value == "8192"
    assert rec.notes == ("baseline measured 3 times, spread 1.2%",)
    assert rec.plan is not None and rec.plan.slots == round(0.2 * A3B_EXPERTS)  # 1229
    assert rec.warnings == ()
    # a benchmark's choice that no longer fits beside the rules' context is said to
    greedy = BenchmarkResult(4, ["--moe-cache-rate", "0.3"], engine_version="0.1.0")
    rec = recommend(pc, SPECS["30b"], benchmark=greedy)
    assert rec.plan is None
    assert any(
        w.startswith("the benchmark's flags no longer fit: 1843 expert slots")
        for w in map(str, rec.warnings)
    )
    # the engine or the GPUs changed since: stale, with the reasons
    newer = Machine("pc", "0.2.0", 16, 64 * GIB, (card(24, 23.5),), RATES)
    reasons = recommend(newer, SPECS["30b"], benchmark=bench).stale_reasons
    assert [str(reason) for reason in reasons] == [
        "benchmark run 3 ran moelab 0.1.0; this is 0.2.0: run it again (pick up from the last "
        "result)",
    ]
    other_gpu = machine((card(24, 23.5, 1),))
    assert "the GPUs changed since benchmark run 3" in map(
        str, recommend(other_gpu, SPECS["30b"], benchmark=bench).stale_reasons
    )


def test_rules_are_stale_when_the_rates_predate_the_engine() -> None:
    newer = Machine("pc", "0.2.0", 16, 64 * GIB, (card(24, 23.5),), RATES)
    rec = recommend(newer, SPECS["30b"])
    assert rec.stale and "measured with moelab 0.1.0; this is 0.2.0" in str(rec.stale_reasons[0])
    assert not recommend(machine((card(24, 23.5),)), SPECS["30b"]).stale


def test_compare_with_a_profile() -> None:
    rec = recommend(machine((card(24, 23.5),)), SPECS["30b"])
    rows = {
        r["flag"]: r
        for r in compare(
            rec.advice,
            ["--kv-reserve-tokens", "8192", "--moe-cpu-threads", "8", "--moe-cache-size", "9"],
        )
    }
    assert rows["--kv-reserve-tokens"]["state"] == "different"
    assert rows["--kv-reserve-tokens"]["profile"] == "8192"
    assert rows["--moe-cpu-threads"]["state"] == "same"
    assert rows["--prefill-chunk-tokens"]["state"] == "not set"
    assert rows["--moe-cache-size"]["state"] == "different"  # advised: leave it to the engine
    assert compare(rec.advice, [])[3]["state"] == "same"  # unset, as advised


def test_a_hybrid_model_on_a_24gb_card_gets_its_whole_262k_context() -> None:
    """Qwen3.6-35B-A3B keeps KV in 10 of its 40 layers: on a 24 GB card its whole 262,144-token
    context takes 5.00 GiB and still leaves 14% of the experts, where the same geometry with KV
    in every layer gets a quarter of it; the split shows the states of the running sequences."""
    from dataclasses import replace

    hybrid = HYBRID
    everywhere = replace(hybrid, layer_types=("full_attention",) * 40, linear_attention=None)
    pc = machine((card(24, 23.5),), ram_gib=96)
    rec = recommend(pc, hybrid)
    a = advice(rec)
    assert a["--kv-reserve-tokens"].value == "262144"
    assert "the model's whole context (262144 tokens, 5.00 GiB of KV)" in str(
        a["--kv-reserve-tokens"].reason
    )
    assert advice(recommend(pc, everywhere))["--kv-reserve-tokens"].value == "65536"
    split = rec.vram_split()
    running = int(a["--max-running-requests"].value)
    per_seq = 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)  # DeltaNet states in fp32, conv in bf16
    assert split["state_sequences"] == running == 4 and split["state_checkpoints"] == 8
    # and the graphs' padding slot and the prefix cache's state checkpoints
    assert split["bytes"]["states"] == (running + 1 + 8) * per_seq
    assert split["bytes"]["kv"] == split["kv_tokens"] * 2 * 10 * 2 * 256 * 2
    assert sum(v for k, v in split["bytes"].items() if k != "budget") == split["bytes"]["budget"]
    assert rec.warnings == ()


def test_cpu_only_hybrid_counts_kv_of_the_attention_layers() -> None:
    """Without a GPU, the KV in RAM counts 10 layers of 40: 10.00 GiB for the whole context in
    float32 (the engine's dtype on a CPU, which 256 GiB of RAM allows), 5.00 GiB in bf16."""
    for ram_gib, elem in ((256, 4), (128, 2)):
        a = advice(recommend(machine((), ram_gib=ram_gib), HYBRID))
        assert ("--dtype" in a) == (elem == 2)
        kv = a["--kv-reserve-tokens"]
        assert kv.value == "262144"
        assert kv.numbers["kv_bytes"] == 262144 * 2 * 10 * 2 * 256 * elem


def test_the_benchmarks_context_step_starts_from_a_hybrid_models_whole_context() -> None:
    """The benchmark's context step proves the base flags' context, then tries the tiers above it
    up to the model's: from Recommended's flags on a 24 GB card, Qwen3.6-35B-A3B (KV in 10 of 40
    layers) proves its whole 262,144 tokens with nothing above to try, where the geometry with KV
    in every layer proves 65,536 and tries 131,072 and 262,144."""
    from dataclasses import replace

    from moelab.autotune.eta import context_tiers, context_trials
    from moelab.autotune.modes import MODES

    hybrid = HYBRID
    everywhere = replace(hybrid, layer_types=("full_attention",) * 40, linear_attention=None)
    pc = machine((card(24, 23.5),), ram_gib=96)
    thorough = MODES["thorough"]
    flags = recommend(pc, hybrid).flags
    assert context_trials(flags, 262144, thorough) == 1
    dense_flags = recommend(pc, everywhere).flags
    assert context_trials(dense_flags, 262144, thorough) == 3
    assert context_tiers(65536, dense_flags, 262144, thorough) == [131072, 262144]


def test_a_benchmark_s_mxfp4_experts_are_what_the_ram_check_counts() -> None:
    """--moe-expert-dtype mxfp4 for the bf16 Qwen3-30B-A3B: 4.25 bits a weight, a bank of
    14.34 GiB that 24 GiB of RAM holds (the bf16 one, 54 GiB, would not), named in the chunk's
    reason; the flag passes the profiles' validation."""
    from moelab.profiles.flags import check_value

    assert check_value("--moe-expert-dtype", "mxfp4") is None
    small_ram = machine((card(24, 23.5),), ram_gib=24)
    result = BenchmarkResult.from_result(
        7, {"flags": ["--moe-expert-dtype", "mxfp4"]}, engine_version="0.1.0", machine_id=None
    )
    rec = recommend(small_ram, SPECS["30b"], benchmark=result)
    assert not any("RAM" in w for w in map(str, rec.warnings)), rec.warnings
    assert "(14.34 GiB for this model)" in str(advice(rec)["--prefill-chunk-tokens"].reason)
    plain = recommend(small_ram, SPECS["30b"])
    assert any("RAM" in w for w in map(str, plain.warnings))
