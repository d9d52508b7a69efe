"""The engine's settings, typed: one frozen dataclass per flag group of engine/config/args.py,
built from the parsed flags in one place (`EngineConfig.from_args`) and checked as they are built.

Each field names the flag that sets it; an on/off flag that turns a thing off (`--no-cuda-graph`)
sets a field that says whether it is on (`cuda_graph`). A value the flag's own parser would refuse
is refused here in the same words, so a configuration made in code is held to the command line's
rules. Torch-free: the profiles' planner reads it as the engine does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..text import Text, error_text
from . import args as flags
from .memory import MemoryRequest
from .split import LayerSplit, parse_devices


class ConfigError(ValueError):
    """A setting the engine refuses; the message names the flag."""


def _one_of(choices: Sequence[str]) -> Callable[[str], None]:
    def check(value: str) -> None:
        if value not in choices:
            raise ValueError(Text("choose one of {choices}", choices=", ".join(choices)))

    return check


def _setting(
    flag: str,
    check: Callable[[Any], object] | None = None,
    *,
    negated: bool = False,
    secret: bool = False,
):
    """A field set by `flag`, whose value `check` refuses with an exception where the flag's
    parser would; `negated`: an on/off flag that turns the field off; `secret`: a value the
    configuration's repr leaves out."""
    return field(metadata={"flag": flag, "check": check, "negated": negated}, repr=not secret)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


class _FlagGroup:
    """The settings of one flag group; the dataclasses below add their fields."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            check, value = f.metadata["check"], getattr(self, f.name)
            if check is None or value is None:
                continue
            try:
                check(value)
            except (argparse.ArgumentTypeError, ValueError) as err:
                raise ConfigError(
                    Text(
                        "{flag} {value}: {detail}",
                        flag=f.metadata["flag"],
                        value=value,
                        detail=error_text(err),
                    )
                ) from None
        self._check_together()

    def _check_together(self) -> None:
        """Rules between this group's fields (none by default)."""

    @classmethod
    def from_args(cls, ns: argparse.Namespace):
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            value = getattr(ns, _dest(f.metadata["flag"]))
            values[f.name] = not value if f.metadata["negated"] else value
        return cls(**values)


@dataclass(frozen=True, slots=True)
class ModelConfig(_FlagGroup):
    """Which checkpoint, under which name, in which dtype."""

    path: str = _setting("--model-path")
    served_name: str | None = _setting("--served-model-name")
    dtype: str = _setting("--dtype", _one_of(flags.DTYPES))
    expert_dtype: str = _setting("--moe-expert-dtype", _one_of(flags.EXPERT_DTYPES))
    dense_dtype: str = _setting("--dense-dtype", _one_of(flags.DENSE_DTYPES))
    dummy_weights: bool = _setting("--dummy-weights")
    bank_dir: str | None = _setting("--bank-dir")

    @property
    def name(self) -> str:
        """The name clients give in a request's `model` field."""
        return self.served_name or Path(self.path).resolve().name

    def compute_dtype(self, checkpoint_dtype: str, *, cpu: bool) -> str:
        """The dtype the engine computes in: the checkpoint's on a GPU; float32 on a CPU device,
        where torch's half-precision matmuls are slower than float32 ones."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if cpu else checkpoint_dtype


@dataclass(frozen=True, slots=True)
class MemoryConfig(_FlagGroup):
    """The compute device and how its memory is divided (engine/config/memory.py plans it)."""

    device: str = _setting("--device", flags.parse_device)
    devices: tuple[str, ...] | None = _setting("--devices", lambda v: parse_devices(",".join(v)))
    layer_split: LayerSplit | None = _setting("--layer-split")  # noqa: RUF009 (frozen)
    split_microbatches: int | None = _setting("--split-microbatches", flags.WholeNumber(1).check)
    # one size for every device, or one per device of --devices
    device_memory_bytes: tuple[int, ...] | None = _setting(
        "--device-memory", flags.check_device_memory
    )
    kv_reserve_tokens: int = _setting("--kv-reserve-tokens", flags.WholeNumber(1).check)
    max_context: int | None = _setting("--max-context", flags.WholeNumber(1).check)
    headroom_bytes: int = _setting("--memory-headroom", flags.check_bytes)
    kv_block_size: int = _setting("--kv-block-size", flags.WholeNumber(1).check)
    kv_cache_dtype: str = _setting("--kv-cache-dtype", _one_of(flags.KV_CACHE_DTYPES))
    prefix_cache: bool = _setting("--no-prefix-cache", negated=True)
    state_checkpoints: int = _setting("--state-checkpoints", flags.WholeNumber(0).check)
    state_checkpoint_interval: int = _setting(
        "--state-checkpoint-interval", flags.WholeNumber(0).check
    )

    def _check_together(self) -> None:
        if self.devices is not None and self.device != "auto":
            raise ConfigError(
                Text(
                    "--devices {devices} takes the place of --device {device}; give one of them",
                    devices=",".join(self.devices),
                    device=self.device,
                )
            )
        if self.layer_split is not None and self.devices is None:
            raise ConfigError(
                Text(
                    "--layer-split {split} splits the layers across --devices; name two devices "
                    "or more there (--devices cuda:0,cuda:1)",
                    split=str(self.layer_split),
                )
            )
        if self.split_microbatches is not None and self.devices is None:
            raise ConfigError(
                Text(
                    "--split-microbatches {count} pipelines a decode step across --devices; name "
                    "two devices or more there (--devices cuda:0,cuda:1), or leave it out",
                    count=self.split_microbatches,
                )
            )
        if self.layer_split is not None and self.layer_split.parts != len(self.devices or ()):
            raise ConfigError(
                Text(
                    "--layer-split {split} has {parts} parts for {count} devices; give one per "
                    "device of --devices",
                    split=str(self.layer_split),
                    parts=self.layer_split.parts,
                    count=len(self.devices or ()),
                )
            )
        sizes = self.device_memory_bytes or ()
        if len(sizes) > 1 and len(sizes) != len(self.device_names):
            given = ",".join(f"{size / 1024**3:g}GiB" for size in sizes)
            raise ConfigError(
                Text(
                    "--device-memory {given} gives {parts} sizes for {count} device(s) "
                    "({devices}); give one size for each device, or one per device of --devices",
                    given=given,
                    parts=len(sizes),
                    count=len(self.device_names),
                    devices=",".join(self.device_names),
                )
            )

    @property
    def device_names(self) -> tuple[str, ...]:
        """The devices the layers run on: --devices, else --device alone."""
        return self.devices or (self.device,)

    def device_memory(self, index: int = 0) -> int | None:
        """--device-memory of the `index`th device of `device_names`: its own size where one is
        given per device, else the one size (None: not given)."""
        sizes = self.device_memory_bytes
        if not sizes:
            return None
        return sizes[index] if len(sizes) > 1 else sizes[0]

    def budget_bytes(self, device_free_bytes: int | None, index: int = 0) -> int:
        """The memory to plan on the `index`th device: the free memory of a GPU
        (`device_free_bytes`), at most its --device-memory; on a CPU device (None), its
        --device-memory or the default there."""
        capped = self.device_memory(index)
        if device_free_bytes is None:
            return capped or flags.CPU_DEFAULT_BUDGET_BYTES
        if capped:
            return min(device_free_bytes, capped)
        return device_free_bytes


@dataclass(frozen=True, slots=True)
class ExpertsConfig(_FlagGroup):
    """The expert cache, where its misses run, and the CPU expert workers."""

    cache_size: int | None = _setting("--moe-cache-size", flags.WholeNumber(0).check)
    cache_rate: float | None = _setting("--moe-cache-rate", flags.Share(above_zero=True).check)
    miss_policy: str = _setting("--moe-miss-policy", flags.parse_miss_policy)
    cache_admission: str = _setting("--moe-cache-admission", _one_of(flags.CACHE_ADMISSIONS))
    split_misses: bool = _setting("--no-split-misses", negated=True)
    cpu_threads: int | None = _setting("--moe-cpu-threads", flags.WholeNumber(1).check)
    cpu_kernel: str = _setting("--moe-cpu-kernel", _one_of(flags.CPU_KERNELS))
    cpu_spin_us: int = _setting("--moe-cpu-spin-us", flags.WholeNumber(0).check)
    cpu_redo_us: int = _setting("--moe-cpu-redo-us", flags.WholeNumber(0).check)
    cpu_task_kb: int = _setting("--moe-cpu-task-kb", flags.WholeNumber(1).check)
    prefetch_rounds: int = _setting("--moe-cpu-prefetch-rounds", flags.parse_prefetch_rounds.check)
    copy_ahead: float = _setting("--moe-copy-ahead", flags.parse_share.check)
    early_cached: str = _setting("--moe-early-cached", _one_of(flags.EARLY_CACHED))
    cpu_pin: str = _setting("--moe-cpu-pin", _one_of(flags.CPU_PINS))
    bw_profile: str | None = _setting("--bw-profile")

    def _check_together(self) -> None:
        if self.cache_size is not None and self.cache_rate is not None:
            raise ConfigError(
                Text("argument --moe-cache-rate: not allowed with argument --moe-cache-size")
            )


@dataclass(frozen=True, slots=True)
class PrefillConfig(_FlagGroup):
    """How prompts are cut into steps and their experts streamed."""

    chunk_tokens: int = _setting("--prefill-chunk-tokens", flags.WholeNumber(1).check)
    overlap: bool = _setting("--no-prefill-overlap", negated=True)


@dataclass(frozen=True, slots=True)
class BatchingConfig(_FlagGroup):
    """How many requests run together, how many wait, and how decode steps are launched."""

    max_running_requests: int = _setting("--max-running-requests", flags.WholeNumber(1).check)
    max_queued_requests: int = _setting("--max-queued-requests", flags.WholeNumber(0).check)
    cuda_graph_max_bs: int = _setting("--cuda-graph-max-bs", flags.WholeNumber(1).check)
    cuda_graph: bool = _setting("--no-cuda-graph", negated=True)
    overlap_decode: bool = _setting("--no-overlap-decode", negated=True)

    @property
    def max_requests_in_flight(self) -> int:
        """Requests running or waiting, past which a new one is refused (429)."""
        return self.max_running_requests + self.max_queued_requests


@dataclass(frozen=True, slots=True)
class ServerConfig(_FlagGroup):
    """The HTTP side: where it listens, who may call it, and how replies are made."""

    host: str = _setting("--host")
    port: int = _setting("--port", flags.WholeNumber(1).check)
    api_key: str | None = _setting("--api-key", secret=True)
    allowed_origins: tuple[str, ...] | None = _setting("--allowed-origins")
    allow_host: tuple[str, ...] | None = _setting("--allow-host")
    stats: bool = _setting("--no-stats", negated=True)
    generation_config: str = _setting("--generation-config", _one_of(flags.GENERATION_CONFIGS))
    reasoning_parser: str = _setting("--reasoning-parser", _one_of(flags.REASONING_PARSERS))
    reasoning_budget: int | None = _setting("--reasoning-budget", flags.WholeNumber(0).check)
    tool_call_parser: str = _setting("--tool-call-parser", _one_of(flags.TOOL_CALL_PARSERS))
    seed: int = _setting("--seed")
    log_level: str = _setting("--log-level", _one_of(flags.LOG_LEVELS))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every setting of one engine, by flag group."""

    model: ModelConfig
    memory: MemoryConfig
    experts: ExpertsConfig
    prefill: PrefillConfig
    batching: BatchingConfig
    server: ServerConfig

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> EngineConfig:
        """The settings of `moelab serve`'s parsed flags (ConfigError where one is refused)."""
        return cls(
            model=ModelConfig.from_args(ns),
            memory=MemoryConfig.from_args(ns),
            experts=ExpertsConfig.from_args(ns),
            prefill=PrefillConfig.from_args(ns),
            batching=BatchingConfig.from_args(ns),
            server=ServerConfig.from_args(ns),
        )

    @classmethod
    def from_flags(cls, argv: Sequence[str]) -> EngineConfig:
        """The settings of a `moelab serve` command line (argparse's exit where it refuses)."""
        return cls.from_args(flags.build_parser().parse_args(list(argv)))

    def memory_request(
        self,
        *,
        budget_bytes: int,
        elem_bytes: int,
        cuda: bool,
        kv_tokens: int | None = None,
        flash: bool | None = None,
    ) -> MemoryRequest:
        """What these settings ask of a device's memory: a budget (`MemoryConfig.budget_bytes`
        of the device), weights of `elem_bytes` each, CUDA graphs where `cuda` and allowed. A KV
        reserve given here stands in for the one the flags set. `flash`: whether a prefill
        chunk's attention runs in flash attention (the engine's check of its device); where
        None, on every CUDA device (those of compute capability 8.0 and up). The plan counts
        that attention's transient on a GPU only (memory.plan_vram)."""
        memory, batching = self.memory, self.batching
        return MemoryRequest(
            budget_bytes=budget_bytes,
            elem_bytes=elem_bytes,
            kv_reserve_tokens=kv_tokens or memory.kv_reserve_tokens,
            block_size=memory.kv_block_size,
            kv_cache_dtype=memory.kv_cache_dtype,
            prefill_chunk_tokens=self.prefill.chunk_tokens,
            max_running=batching.max_running_requests,
            headroom_bytes=memory.headroom_bytes,
            cache_size=self.experts.cache_size,
            cache_rate=self.experts.cache_rate,
            cuda_graphs=cuda and batching.cuda_graph,
            max_context=memory.max_context,
            expert_dtype=self.model.expert_dtype,
            dense_dtype=self.model.dense_dtype,
            # the engine keeps state checkpoints only with the prefix cache
            state_checkpoints=memory.state_checkpoints if memory.prefix_cache else 0,
            chunk_attention=(("flash" if flash or flash is None else "masked") if cuda else "none"),
        )
