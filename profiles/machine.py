"""The machine as Recommended and the planner see it: cores, RAM, GPUs and the measured rates.

Built from the daemon's stored measurements (the API's measurement shape), so it never probes
anything itself; tests build it directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.config.args import CPU_DEFAULT_BUDGET_BYTES
from ..engine.config.bandwidth import pcie_gbps
from ..engine.config.config import EngineConfig
from ..engine.config.memory import MemoryPlanError, VramPlan
from ..engine.config.split import DeviceBudget, SplitPlan, plan_devices
from ..engine.model.spec import DTYPE_BYTES, ModelSpec
from ..engine.text import Text

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU: its identity and memory (free as measured; None when never measured), its PCIe
    link's peak rate (its top generation and width with this system) and its memory's peak rate,
    in GB/s (None: not known)."""

    index: int
    name: str
    uuid: str | None
    vram_total_bytes: int
    vram_free_bytes: int | None = None
    link_peak_gbps: float | None = None
    memory_peak_gbps: float | None = None

    @property
    def usable_bytes(self) -> int:
        """What an engine started now could plan with: the free memory when measured."""
        return self.vram_free_bytes if self.vram_free_bytes is not None else self.vram_total_bytes


@dataclass(frozen=True, slots=True)
class Rates:
    """What `moelab bench bw` measured, in GB/s (None or empty: not measured)."""

    h2d_gbps: float | None = None  # pinned host-to-device copy of one expert
    device_gbps: float | None = None  # device memory copy
    cpu_experts_gbps: dict[int, float] = field(default_factory=dict)  # threads -> rate
    host_read_gbps: dict[int, float] = field(default_factory=dict)  # threads -> rate
    h2d_concurrent_gbps: float | None = None  # copies while the CPU runs experts
    cpu_concurrent_gbps: float | None = None  # CPU experts while copies run
    expert_bytes: int | None = None  # the expert size they were measured at
    engine_version: str | None = None
    gpu_uuid: str | None = None
    measured: str | None = None  # when (ISO 8601)
    # per GPU index: the pinned host-to-device copy and the device memory copy measured on it
    h2d_by_gpu: dict[int, float] = field(default_factory=dict)
    device_by_gpu: dict[int, float] = field(default_factory=dict)

    def cpu_rate(self, threads: int) -> tuple[int, float] | None:
        """The CPU expert rate at the largest measured thread count not above `threads`."""
        fitting = [t for t in self.cpu_experts_gbps if t <= threads]
        if not fitting:
            return None
        t = max(fitting)
        return t, self.cpu_experts_gbps[t]

    @property
    def host_gbps(self) -> float | None:
        return max(self.host_read_gbps.values()) if self.host_read_gbps else None


@dataclass(frozen=True, slots=True)
class Machine:
    """This PC for the rules: identity, cores, RAM, GPUs and measured rates (None: not yet)."""

    machine_id: str
    engine_version: str
    physical_cores: int
    ram_total_bytes: int
    gpus: tuple[Gpu, ...] = ()
    rates: Rates | None = None

    @classmethod
    def from_measurements(
        cls,
        rows: Iterable[dict[str, Any]],
        *,
        machine_id: str,
        engine_version: str,
        physical_cores: int,
        ram_total_bytes: int,
    ) -> Machine:
        """The latest reading of each kind (the API's measurement dicts) over the live inventory's
        values, which stand in for kinds never stored."""
        rows = list(rows)
        cores = physical_cores
        ram = ram_total_bytes
        gpus: dict[int, dict[str, Any]] = {}
        raw: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            kind, value, params = row["kind"], row["value"], row.get("params") or {}
            if kind == "cpu.physical_cores":
                cores = int(value)
            elif kind == "ram.total":
                ram = int(value)
            elif kind in _GPU_KINDS:
                gpu = gpus.setdefault(
                    int(params.get("gpu_index", 0)),
                    {"name": row.get("gpu_name") or "GPU", "uuid": row.get("gpu_uuid")},
                )
                gpu[kind] = value
            elif "." not in kind:  # `moelab bench bw` kinds carry no dot
                raw.setdefault(kind, []).append(row)
        gpu_list = tuple(
            Gpu(
                i,
                g["name"],
                g["uuid"],
                int(g["gpu.vram_total"]),
                int(g["gpu.vram_free"]) if "gpu.vram_free" in g else None,
                pcie_gbps(_whole(g.get("gpu.pcie_gen_max")), _whole(g.get("gpu.pcie_width_max"))),
                g.get("gpu.memory_gbps"),
            )
            for i, g in sorted(gpus.items())
            if "gpu.vram_total" in g
        )
        return cls(
            machine_id=machine_id,
            engine_version=engine_version,
            physical_cores=cores,
            ram_total_bytes=ram,
            gpus=gpu_list,
            rates=_rates(raw),
        )

    @property
    def default_cpu_threads(self) -> int:
        """The engine's default: one per physical core, less one that keeps feeding the GPU."""
        return max(1, self.physical_cores - 1)


# the inventory's kinds of one GPU that the machine keeps
_GPU_KINDS = (
    "gpu.vram_total", "gpu.vram_free", "gpu.pcie_gen_max", "gpu.pcie_width_max", "gpu.memory_gbps"
)  # fmt: skip


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def _by_gpu(rows: list[dict[str, Any]]) -> dict[int, float]:
    """The best value per GPU index (a row without one is GPU 0's: `moelab bench bw` measured
    only the first GPU before it measured each)."""
    out: dict[int, float] = {}
    for r in rows:
        index = int((r.get("params") or {}).get("gpu_index", 0))
        out[index] = max(out.get(index, 0.0), float(r["value"]))
    return out


def _best(rows: list[dict[str, Any]], **match: Any) -> float | None:
    values = [
        float(r["value"])
        for r in rows
        if all((r.get("params") or {}).get(k) == v for k, v in match.items())
    ]
    return max(values) if values else None


def _by_threads(rows: list[dict[str, Any]], **match: Any) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in rows:
        params = r.get("params") or {}
        if "threads" in params and all(params.get(k) == v for k, v in match.items()):
            t = int(params["threads"])
            out[t] = max(out.get(t, 0.0), float(r["value"]))
    return out


def _rates(raw: dict[str, list[dict[str, Any]]]) -> Rates | None:
    if not raw:
        return None
    any_row = next(iter(raw.values()))[0]
    cpu = raw.get("cpu_experts", [])
    # the 4-experts-a-step rate is the one the engine splits misses by
    cpu_rates = _by_threads(cpu, experts=4) or _by_threads(cpu)
    return Rates(
        h2d_gbps=_best(raw.get("h2d_pinned", [])),
        device_gbps=_best(raw.get("device_copy", [])),
        cpu_experts_gbps=cpu_rates,
        host_read_gbps=_by_threads(raw.get("host_read", [])),
        h2d_concurrent_gbps=_best(raw.get("h2d_pinned_concurrent", [])),
        cpu_concurrent_gbps=_best(raw.get("cpu_experts_concurrent", [])),
        expert_bytes=(any_row.get("params") or {}).get("expert_bytes"),
        engine_version=(any_row.get("versions") or {}).get("moelab"),
        gpu_uuid=any_row.get("gpu_uuid"),
        measured=any_row.get("created"),
        h2d_by_gpu=_by_gpu(raw.get("h2d_pinned", [])),
        device_by_gpu=_by_gpu(raw.get("device_copy", [])),
    )


# ---- the device an engine with some flags would plan on ------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """Where an engine with given flags runs, how much memory it plans with, and why."""

    device: str  # "cpu" or "cuda:N"
    gpu: Gpu | None
    budget_bytes: int
    elem_bytes: int  # bytes per weight at the engine's compute dtype
    budget_source: str  # in words: where budget_bytes comes from
    # --devices: each device of the split with its budget (budget_bytes is their sum)
    split: tuple[DeviceBudget, ...] = ()

    @property
    def cuda(self) -> bool:
        return self.gpu is not None


def choose_device(machine: Machine, spec: ModelSpec, config: EngineConfig) -> DeviceChoice:
    """The device, memory budget and dtype an engine started with `config` would use here (the
    same resolution as the engine's, from measurements instead of a live query)."""
    memory = config.memory
    if memory.devices is not None:
        return _choose_split(machine, spec, config)
    name = memory.device
    if name == "auto":
        name = "cuda:0" if machine.gpus else "cpu"
    elif name == "cuda":
        name = "cuda:0"
    gpu = None
    if name.startswith("cuda"):
        index = int(name.split(":")[1])
        gpu = next((g for g in machine.gpus if g.index == index), None)
        if gpu is None:
            raise MemoryPlanError(
                Text(
                    "--device {device}: this machine has no GPU {index} ({n} found); use --device "
                    "cpu or another index",
                    device=memory.device,
                    index=index,
                    n=len(machine.gpus),
                )
            )
    elem = DTYPE_BYTES[config.model.compute_dtype(spec.dtype, cpu=gpu is None)]
    budget = memory.budget_bytes(gpu.usable_bytes if gpu is not None else None)
    if gpu is None:
        default = f"the engine's {CPU_DEFAULT_BUDGET_BYTES / GIB:g} GiB default on a CPU device"
        source = "--device-memory" if memory.device_memory_bytes else default
    elif budget < gpu.usable_bytes:
        source = "--device-memory"
    else:
        source = (
            f"{gpu.name}'s {'free' if gpu.vram_free_bytes is not None else 'total'} memory "
            f"({budget / GIB:.1f} GiB)"
        )
    return DeviceChoice(name, gpu, budget, elem, source)


def _choose_split(machine: Machine, spec: ModelSpec, config: EngineConfig) -> DeviceChoice:
    """The devices of --devices with their budgets, each GPU's link and memory rate
    (`device_rates`)."""
    memory = config.memory
    assert memory.devices is not None
    gpus, budgets = [], []
    for name in memory.devices:
        gpu = None
        if name != "cpu":
            index = int(name.split(":")[1])
            gpu = next((g for g in machine.gpus if g.index == index), None)
            if gpu is None:
                raise MemoryPlanError(
                    Text(
                        "--devices {devices}: this machine has no GPU {index} ({n} found); name "
                        "the GPUs it has",
                        devices=",".join(memory.devices),
                        index=index,
                        n=len(machine.gpus),
                    )
                )
            gpus.append(gpu)
        budget = memory.budget_bytes(gpu.usable_bytes if gpu is not None else None, len(budgets))
        budgets.append(DeviceBudget(name, budget, 1.0))
    if len(gpus) == len(budgets):
        links, rates = device_rates(machine, tuple(gpus))
        budgets = [
            replace(b, link_gbps=link, memory_gbps=rate)
            for b, link, rate in zip(budgets, links, rates, strict=True)
        ]
    gpu = gpus[0] if gpus else None
    elem = DTYPE_BYTES[config.model.compute_dtype(spec.dtype, cpu=gpu is None)]
    total = sum(b.budget_bytes for b in budgets)
    source = "--device-memory" if memory.device_memory_bytes else "each device's free memory"
    return DeviceChoice(",".join(memory.devices), gpu, total, elem, source, tuple(budgets))


def device_rates(
    machine: Machine, gpus: tuple[Gpu, ...]
) -> tuple[tuple[float, ...], tuple[float | None, ...]]:
    """Each GPU's link rate and memory rate, as a split weighs them, in GB/s.

    Links: the pinned copy `moelab bench bw` measured on each GPU; where some GPU has none, a
    measured card's rate scaled by each card's PCIe peak against that card's (an x8 link beside
    an x16 one: half); where that is not known either, the machine's one rate for every card
    (the split then follows the memory and the memory rates). Memory rates: each
    GPU's measured device copy where every card has one, else the peak NVML tells where every
    card has one, else None for all (the split does not weigh compute)."""
    rates = machine.rates or Rates()
    measured = rates.h2d_by_gpu
    # a GPU whose copy was measured and whose link is known: the others' links scale from it
    reference = next((g for g in machine.gpus if g.index in measured and g.link_peak_gbps), None)
    links: tuple[float, ...]
    if all(g.index in measured for g in gpus):
        links = tuple(measured[g.index] for g in gpus)
    elif reference is not None and all(g.link_peak_gbps for g in gpus):
        scale = measured[reference.index] / (reference.link_peak_gbps or 1.0)
        links = tuple(measured.get(g.index) or scale * (g.link_peak_gbps or 0.0) for g in gpus)
    else:
        links = (rates.h2d_gbps or 1.0,) * len(gpus)
    memory: tuple[float | None, ...] = (None,) * len(gpus)
    if all(g.index in rates.device_by_gpu for g in gpus):
        memory = tuple(rates.device_by_gpu[g.index] for g in gpus)
    elif all(g.memory_peak_gbps for g in gpus):
        memory = tuple(g.memory_peak_gbps for g in gpus)
    return links, memory


def plan_for(
    spec: ModelSpec,
    choice: DeviceChoice,
    config: EngineConfig,
    *,
    kv_tokens: int | None = None,
    budget_bytes: int | None = None,
) -> VramPlan:
    """The engine's VRAM plan for these settings on the device `choice` names, within
    `budget_bytes` in place of the device's budget where given (MemoryPlanError when they cannot
    fit). A split's plan is its devices' summed: their KV, slots and bytes together
    (engine/config/split.py), each device's budget scaled where `budget_bytes` is given."""
    if choice.split:
        return split_for(spec, choice, config, kv_tokens=kv_tokens, budget_bytes=budget_bytes).total
    request = config.memory_request(
        budget_bytes=choice.budget_bytes if budget_bytes is None else budget_bytes,
        elem_bytes=choice.elem_bytes,
        cuda=choice.cuda,
        kv_tokens=kv_tokens,
    )
    return request.plan(spec)


def split_for(
    spec: ModelSpec,
    choice: DeviceChoice,
    config: EngineConfig,
    *,
    kv_tokens: int | None = None,
    budget_bytes: int | None = None,
) -> SplitPlan:
    """The split (`choice.split`'s devices) as the engine would plan it: each device's layers,
    VRAM plan and step estimate, each device's budget scaled where `budget_bytes` is given."""
    scale = 1.0 if budget_bytes is None else budget_bytes / choice.budget_bytes
    devices = tuple(replace(d, budget_bytes=int(d.budget_bytes * scale)) for d in choice.split)
    # a split runs its steps eagerly: no graph pool
    request = config.memory_request(
        budget_bytes=0, elem_bytes=choice.elem_bytes, cuda=False, kv_tokens=kv_tokens
    )
    return plan_devices(spec, request, devices, config.memory.layer_split)
