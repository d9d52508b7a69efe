"""The plan: candidates from the engine's tunable flags read against this machine and model."""

from __future__ import annotations

from moelab.autotune.flagset import Change, apply_change, effective_value, same_flags
from moelab.autotune.modes import MODES
from moelab.autotune.noise import Objective
from moelab.autotune.plan import MachineFacts, ModelFacts, Plan, make_plan
from moelab.engine.config.args import TUNABLE, Tunable
from moelab.engine.config.flag_list import FlagList

MODEL = ModelFacts("/m", num_moe_layers=3, num_experts=16, max_context=4096)
CPU_2 = MachineFacts(physical_cores=2, gpus=0)
GPU_8 = MachineFacts(physical_cores=8, gpus=1)


def keys(plan: Plan) -> list[str]:
    return [c.change.key for c in plan.candidates]


def why(plan: Plan, flag: str, value: object = None) -> str:
    return next(str(s.why) for s in plan.skipped if s.flag == flag and s.value == value)


def test_every_candidate_is_the_base_plus_exactly_one_change() -> None:
    base = ["--device", "cpu", "--moe-cache-size", "1", "--max-running-requests", "1"]
    plan = make_plan(base, MODEL, CPU_2, MODES["thorough"], Objective("aggregate", 8))
    for candidate in plan.candidates:
        flags = apply_change(base, candidate.change)
        assert not same_flags(flags, base), candidate
        changed = set(FlagList.parse(flags)) ^ set(FlagList.parse(base))
        names = {name for name, _value in changed}
        # one flag changes; setting the cache rate also drops the cache size it excludes
        assert names in ({candidate.change.flag}, {"--moe-cache-rate", "--moe-cache-size"})


def test_a_cpu_machine_gets_no_cuda_graphs_and_threads_up_to_its_cores() -> None:
    plan = make_plan([], MODEL, CPU_2, MODES["standard"], Objective("decode"))
    assert "CUDA graphs do not apply" in why(plan, "--no-cuda-graph")
    # overlapped decode replays whole-step graphs: nothing to switch off on a CPU
    assert "CUDA graphs do not apply" in why(plan, "--no-overlap-decode")
    # the guesses the CPU workers' prefetch needs come from the graphs' one-token pieces
    assert "CUDA graphs do not apply" in why(plan, "--moe-cpu-prefetch-rounds")
    assert [k for k in keys(plan) if k.startswith("--moe-cpu-threads")] == ["--moe-cpu-threads=2"]
    gpu = make_plan([], MODEL, GPU_8, MODES["standard"], Objective("decode"))
    assert "--no-cuda-graph=on" in keys(gpu) and "--no-overlap-decode=on" in keys(gpu)
    # rounds walked down from the default 4: 2, then 0 (off)
    prefetch = [c for c in gpu.candidates if c.change.flag == "--moe-cpu-prefetch-rounds"]
    assert [(c.change.value, c.walk) for c in prefetch] == [("2", "down"), ("0", "down")]
    prefill = make_plan([], MODEL, GPU_8, MODES["quick"], Objective("prefill"))
    assert "moves decode tok/s" in why(prefill, "--moe-cpu-prefetch-rounds")
    threads = [c for c in gpu.candidates if c.change.flag == "--moe-cpu-threads"]
    # from the default of 7 (cores less one): up to 8, then down 4, 2, 1
    assert [(c.change.value, c.walk) for c in threads] == [
        ("8", "up"),
        ("4", "down"),
        ("2", "down"),
        ("1", "down"),
    ]


def test_a_cpu_machine_leaves_out_what_needs_a_gpu() -> None:
    plan = make_plan([], MODEL, CPU_2, MODES["standard"], Objective("decode"))
    # without a GPU a fetched miss is only copied within RAM: the CPU runs it where it lies
    policies = [k for k in keys(plan) if k.startswith("--moe-miss-policy")]
    assert policies == ["--moe-miss-policy=cpu"]
    for value in ("gpu", "split:0.25", "split:0.75"):
        assert "no GPU to fetch misses to" in why(plan, "--moe-miss-policy", value)
    # misses are split between a copy to the GPU and the CPU; prefill copies overlap on a GPU
    assert "there is no GPU" in why(plan, "--no-split-misses")
    assert "only on a GPU" in why(plan, "--no-prefill-overlap")
    # FP8 projections are read by a CUDA kernel; on the CPU each call would widen them
    assert "no FP8 kernel runs on the CPU" in why(plan, "--dense-dtype")
    # a GPU machine tries every one of them
    gpu = keys(make_plan([], MODEL, GPU_8, MODES["standard"], Objective("decode")))
    assert {"--moe-miss-policy=gpu", "--moe-miss-policy=split:0.25", "--no-split-misses=on",
            "--no-prefill-overlap=on", "--dense-dtype=fp8"} <= set(gpu)  # fmt: skip
    # flags that say --device cpu run the engine on the CPU whatever the machine has
    forced = make_plan(["--device", "cpu"], MODEL, GPU_8, MODES["standard"], Objective("decode"))
    assert "--moe-miss-policy=gpu" not in keys(forced)
    # a policy the start has is not listed as left out: it is measured as the baseline
    started = make_plan(["--moe-miss-policy", "gpu"], MODEL, CPU_2, MODES["standard"],
                        Objective("decode"))  # fmt: skip
    assert not any(s.flag == "--moe-miss-policy" and s.value == "gpu" for s in started.skipped)


def test_one_core_leaves_nothing_to_pin_and_clients_bound_running_requests() -> None:
    one = make_plan([], MODEL, MachineFacts(physical_cores=1), MODES["standard"],
                    Objective("decode"))  # fmt: skip
    assert "cores of their own" in why(one, "--moe-cpu-pin")
    assert not [k for k in keys(one) if k.startswith("--moe-cpu-pin")]
    assert [k for k in keys(make_plan([], MODEL, CPU_2, MODES["standard"], Objective("decode")))
            if k.startswith("--moe-cpu-pin")]  # fmt: skip
    # 4 clients never fill 8 or 16 running requests: only fewer are tried
    four = make_plan([], MODEL, GPU_8, MODES["standard"], Objective("aggregate", 4))
    running = [c.change.value for c in four.candidates if c.change.flag == "--max-running-requests"]
    assert running == ["4", "2", "1"]
    assert "4 concurrent clients" in why(four, "--max-running-requests", "16")


def test_running_requests_only_for_the_aggregate_objective() -> None:
    single = make_plan([], MODEL, GPU_8, MODES["standard"], Objective("decode"))
    assert "side by side" in why(single, "--max-running-requests")
    aggregate = make_plan([], MODEL, GPU_8, MODES["standard"], Objective("aggregate", 16))
    running = [c for c in aggregate.candidates if c.change.flag == "--max-running-requests"]
    assert [(c.change.value, c.walk) for c in running] == [
        ("16", "up"),
        ("4", "down"),
        ("2", "down"),
        ("1", "down"),
    ]


def test_quick_mode_leaves_out_what_cannot_move_the_objective() -> None:
    plan = make_plan([], MODEL, GPU_8, MODES["quick"], Objective("decode"))
    assert "moves prefill tok/s" in why(plan, "--prefill-chunk-tokens")
    policies = [k for k in keys(plan) if k.startswith("--moe-miss-policy")]
    assert policies == ["--moe-miss-policy=gpu", "--moe-miss-policy=cpu"]
    assert why(plan, "--moe-miss-policy", "split:0.25") == "quick mode tries 2 values"


def test_prefill_chunks_the_workload_cannot_tell_apart_are_left_out() -> None:
    plan = make_plan([], MODEL, GPU_8, MODES["quick"], Objective("prefill"))
    # the quick workload's long prompt is 512 tokens: the default 2048 and anything from 512 up
    # read it in one piece, so only a smaller chunk is a real change
    chunks = [k for k in keys(plan) if k.startswith("--prefill-chunk-tokens")]
    assert chunks == []
    assert "one piece either way" in why(plan, "--prefill-chunk-tokens", "4096")
    small = make_plan(["--prefill-chunk-tokens", "2"], MODEL, GPU_8, MODES["quick"],
                      Objective("prefill"))  # fmt: skip
    assert next(k for k in keys(small) if k.startswith("--prefill-chunk")) == (
        "--prefill-chunk-tokens=512"
    )
    longer = make_plan([], MODEL, GPU_8, MODES["thorough"], Objective("prefill"))
    assert "longer than the model's context" in why(longer, "--prefill-chunk-tokens", "8192")


def test_a_flag_that_excludes_a_tunable_one_is_dropped_first() -> None:
    plan = make_plan(["--moe-cache-size", "1"], MODEL, GPU_8, MODES["standard"],
                     Objective("decode"))  # fmt: skip
    cache = [c.change.key for c in plan.candidates if "cache" in c.change.flag]
    assert cache[0] == "--moe-cache-size=(default)"
    assert "--moe-cache-rate=1.0" in cache


def test_only_flags_and_tried_candidates_are_left_out_with_a_reason() -> None:
    plan = make_plan([], MODEL, GPU_8, MODES["standard"], Objective("decode"),
                     only_flags=frozenset({"--moe-miss-policy"}),
                     tried={"--moe-miss-policy=cpu": 4})  # fmt: skip
    assert keys(plan) == ["--moe-miss-policy=gpu", "--moe-miss-policy=split:0.25",
                          "--moe-miss-policy=split:0.75"]  # fmt: skip
    assert why(plan, "--moe-miss-policy", "cpu") == "tried in run 4"
    assert "asked to tune" in why(plan, "--moe-cpu-threads")
    assert "--moe-miss-policy=auto" in plan.starting


def test_a_flag_the_engine_declares_tunable_is_planned_without_code_changes() -> None:
    newer = (*TUNABLE, Tunable("--kv-block-size", "choice", ("8", "16", "32"), "page size"))
    plan = make_plan([], MODEL, GPU_8, MODES["standard"], Objective("decode"), tunable=newer)
    block = [
        (c.change.value, c.walk) for c in plan.candidates if c.change.flag == "--kv-block-size"
    ]
    assert block == [("32", "up"), ("8", "down")]
    tokens = (Tunable("--kv-reserve-tokens", "tokens", why="KV against experts"),)
    plan = make_plan([], MODEL, GPU_8, MODES["standard"], Objective("decode"), tunable=tokens)
    assert [(c.change.value, c.walk) for c in plan.candidates] == [
        ("16384", "up"),
        ("32768", "up"),
        ("4096", "down"),
        ("2048", "down"),
    ]
    unknown = (Tunable("--kv-block-size", "choice", ("16",), "x"),)
    object.__setattr__(unknown[0], "kind", "curve")  # a kind a newer engine might declare
    plan = make_plan([], MODEL, GPU_8, MODES["standard"], Objective("decode"), tunable=unknown)
    assert plan.candidates == () and "kind 'curve'" in why(plan, "--kv-block-size")


def test_plans_survive_storage() -> None:
    plan = make_plan(["--moe-cache-size", "1"], MODEL, CPU_2, MODES["quick"],
                     Objective("aggregate", 4))  # fmt: skip
    assert Plan.from_json(plan.to_json()) == plan
    assert effective_value([], "--no-cuda-graph") is False
    assert str(Change("--x", None).label) == "drop --x"


def test_the_split_is_tried_where_the_machine_has_two_gpus() -> None:
    """--devices across every GPU, one change as for any flag; a start that splits already
    tries one device; a machine of one GPU, or an engine on the CPU, has nothing to split."""
    two = MachineFacts(physical_cores=8, gpus=2)
    plan = make_plan(["--device", "cuda:0"], MODEL, two, MODES["standard"], Objective("decode"))
    assert "--devices=cuda:0,cuda:1" in keys(plan)
    assert "--device=(default)" not in keys(plan)
    split = next(c for c in plan.candidates if c.change.flag == "--devices")
    # the trial's flags name the devices and no longer --device (they exclude each other)
    assert apply_change(["--device", "cuda:0"], split.change) == ["--devices", "cuda:0,cuda:1"]
    back = make_plan(["--devices", "cuda:0,cuda:1"], MODEL, two, MODES["standard"],
                     Objective("decode"))  # fmt: skip
    assert "--devices=(default)" in keys(back)
    assert "--devices=cuda:0,cuda:1" in back.starting
    assert why(make_plan([], MODEL, GPU_8, MODES["standard"], Objective("decode")),
               "--devices") == "1 GPU here: a split needs two or more"  # fmt: skip
    assert "a split runs across GPUs" in why(
        make_plan([], MODEL, CPU_2, MODES["standard"], Objective("decode")), "--devices"
    )
