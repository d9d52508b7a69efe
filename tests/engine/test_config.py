"""The engine's typed settings: built from the flags, checked as the flags are, planned alike by
the engine and the profiles' planner."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from moelab.engine import cli
from moelab.engine.config.args import CPU_DEFAULT_BUDGET_BYTES, build_parser
from moelab.engine.config.config import ConfigError, EngineConfig
from moelab.engine.synth_checkpoint import synthesize
from moelab.profiles.machine import Machine, choose_device, plan_for

from .reference import make_engine

GIB = 1024**3


def config(*flags: str) -> EngineConfig:
    return EngineConfig.from_flags(["--model-path", "m", *flags])


# (group, field, value, the message): one case a rule
REFUSED = [
    ("model", "dtype", "bf16", "--dtype bf16: choose one of auto, bfloat16, float16, float32"),
    (
        "model",
        "expert_dtype",
        "int4",
        "--moe-expert-dtype int4: choose one of auto, bf16, fp8, mxfp4, nvfp4",
    ),
    ("memory", "device", "gpu", "--device gpu: not a device; use auto, cpu, cuda or cuda:N"),
    ("memory", "device_memory_bytes", (-1,), "--device-memory -1: -1 is not a size"),
    ("memory", "kv_reserve_tokens", 0, "--kv-reserve-tokens 0: 0 must be at least 1"),
    ("memory", "max_context", 0, "--max-context 0: 0 must be at least 1"),
    ("memory", "headroom_bytes", -1, "--memory-headroom -1: -1 is not a size"),
    ("memory", "kv_block_size", 0, "--kv-block-size 0: 0 must be at least 1"),
    ("memory", "state_checkpoints", -1, "--state-checkpoints -1: -1 must be 0 or more"),
    (
        "memory",
        "state_checkpoint_interval",
        -8,
        "--state-checkpoint-interval -8: -8 must be 0 or more",
    ),
    ("experts", "cache_size", -1, "--moe-cache-size -1: -1 must be 0 or more"),
    (
        "experts",
        "cache_rate",
        1.5,
        "--moe-cache-rate 1.5: 1.5 must be a share of all experts, in (0, 1]",
    ),
    (
        "experts",
        "miss_policy",
        "split:2",
        "--moe-miss-policy split:2: 'split:2' is not a miss policy; use auto, gpu, cpu or split:F "
        "with F in [0, 1]",
    ),
    ("experts", "cpu_threads", 0, "--moe-cpu-threads 0: 0 must be at least 1"),
    (
        "experts",
        "cpu_kernel",
        "fast",
        "--moe-cpu-kernel fast: choose one of auto, native, torch",
    ),
    ("experts", "cpu_spin_us", -1, "--moe-cpu-spin-us -1: -1 must be 0 or more"),
    ("experts", "cpu_redo_us", -1, "--moe-cpu-redo-us -1: -1 must be 0 or more"),
    ("experts", "cpu_task_kb", 0, "--moe-cpu-task-kb 0: 0 must be at least 1"),
    ("experts", "prefetch_rounds", 5, "--moe-cpu-prefetch-rounds 5: 5 must be from 0 to 4"),
    ("experts", "copy_ahead", 1.5, "--moe-copy-ahead 1.5: 1.5 must be from 0 to 1"),
    ("experts", "cpu_pin", "all", "--moe-cpu-pin all: choose one of cores, isolate, off"),
    ("prefill", "chunk_tokens", 0, "--prefill-chunk-tokens 0: 0 must be at least 1"),
    ("batching", "max_running_requests", 0, "--max-running-requests 0: 0 must be at least 1"),
    ("batching", "max_queued_requests", -1, "--max-queued-requests -1: -1 must be 0 or more"),
    ("batching", "cuda_graph_max_bs", 0, "--cuda-graph-max-bs 0: 0 must be at least 1"),
    ("server", "port", 0, "--port 0: 0 must be at least 1"),
    ("server", "generation_config", "on", "--generation-config on: choose one of auto, off"),
    (
        "server",
        "reasoning_parser",
        "r1",
        "--reasoning-parser r1: choose one of off, think, harmony",
    ),
    (
        "server",
        "log_level",
        "loud",
        "--log-level loud: choose one of debug, info, warning, error",
    ),
]


@pytest.mark.parametrize(("group", "name", "value", "message"), REFUSED)
def test_each_setting_is_refused_in_words_that_name_its_flag(group, name, value, message):
    settings = getattr(config(), group)
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(settings, **{name: value})
    assert str(err.value) == message


def test_the_cache_size_and_its_rate_are_refused_together_as_on_the_command_line():
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(config("--moe-cache-size", "4").experts, cache_rate=0.5)
    assert str(err.value) == "argument --moe-cache-rate: not allowed with argument --moe-cache-size"


def test_a_device_that_is_no_device_is_refused_before_the_engine_loads(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--model-path", "m", "--device", "gpu"])
    assert exit_.value.code == 2
    assert (
        "argument --device: not a device; use auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    )


def test_every_engine_flag_sets_a_setting():
    """A flag the configuration does not read would be parsed and then ignored."""
    groups = typing.get_type_hints(EngineConfig).values()
    read = {f.metadata["flag"] for group in groups for f in dataclasses.fields(group)}
    flags = {a.option_strings[-1] for a in build_parser()._actions if a.option_strings}
    # --split-misses is the default, kept so that profiles saved with it still start
    assert flags - read == {"--help", "--split-misses"}
    assert read <= flags


def test_on_off_flags_set_what_they_turn_off_and_values_arrive_typed():
    settings = config(
        "--no-cuda-graph", "--no-prefix-cache", "--no-split-misses", "--no-prefill-overlap",
        "--no-overlap-decode", "--no-stats", "--device-memory", "3GiB", "--moe-cache-rate", "0.5",
        "--allowed-origins", "http://localhost:3000",
    )  # fmt: skip
    assert not settings.batching.cuda_graph and not settings.batching.overlap_decode
    assert not settings.memory.prefix_cache and not settings.experts.split_misses
    assert not settings.prefill.overlap and not settings.server.stats
    assert settings.memory.device_memory_bytes == (3 * GIB,) and settings.experts.cache_rate == 0.5
    assert settings.server.allowed_origins == ("http://localhost:3000",)
    defaults = config()
    assert defaults.batching.cuda_graph and defaults.memory.prefix_cache
    assert defaults.experts.split_misses and defaults.server.stats
    assert defaults.batching.max_requests_in_flight == 8 + 64


def test_the_memory_budget_follows_the_device():
    assert config().memory.budget_bytes(None) == CPU_DEFAULT_BUDGET_BYTES
    capped = config("--device-memory", "3GiB").memory
    assert capped.budget_bytes(None) == 3 * GIB
    assert capped.budget_bytes(10 * GIB) == 3 * GIB and capped.budget_bytes(2 * GIB) == 2 * GIB
    assert config().memory.budget_bytes(10 * GIB) == 10 * GIB


def test_the_api_key_stays_out_of_the_settings_repr():
    assert "sk-secret" not in repr(config("--api-key", "sk-secret"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("cfg") / "m", preset="tiny", seed=3)


SET = (
    *("--device-memory", "3GiB", "--kv-reserve-tokens", "1024", "--moe-cache-rate", "0.5"),
    *("--max-context", "900", "--prefill-chunk-tokens", "256", "--max-running-requests", "2"),
)


@pytest.mark.parametrize(
    "flags", [(), SET, (*SET, "--moe-expert-dtype", "fp8")], ids=["defaults", "set", "fp8"]
)
def test_the_engine_and_the_profiles_planner_ask_the_same_of_memory(checkpoint, flags):
    engine = make_engine(checkpoint, *flags)
    try:
        settings = engine.config
        machine = Machine("m", "dev", physical_cores=2, ram_total_bytes=8 * GIB)
        choice = choose_device(machine, engine.spec, settings)
        assert plan_for(engine.spec, choice, settings) == engine.plan
        # the plan's slots are the cache's, FP8 values and factors included
        assert engine.plan.slot_bytes == engine.cache.slot_bytes == engine.bank.expert_bytes
    finally:
        engine.close()
