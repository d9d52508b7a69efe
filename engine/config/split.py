"""Layers split across devices (`--devices`, `--layer-split`): which contiguous range of decoder
layers each device holds, with its dense weights, KV pages and its own expert cache.

The default split gives each device layers until every device would finish its share of a step
at the same time: a device's step is as long as its layers' dense work takes to read its memory
(where every device's memory rate is known) and the experts a step routes to that do not fit
its memory take to cross its link; where every device holds all of its layers' experts and no
memory rate is known, it is as full as the others. The inputs are per-device numbers (free
bytes, link rate, memory rate) and the bytes of one layer, so the plan is pure logic.
Torch-free: the profiles read it as the engine does.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, replace

from ..model.spec import ModelSpec
from ..text import Text
from .memory import (
    GIB,
    MemoryPlanError,
    MemoryRequest,
    VramPlan,
    activation_bytes,
    graph_pool_bytes,
    kv_bytes_per_token,
    state_reserve,
)

_DEVICE = re.compile(r"cpu|cuda:\d+")


class SplitError(MemoryPlanError):
    """The devices cannot hold the layers as split, or the split does not fit the model."""


def parse_devices(text: str) -> tuple[str, ...]:
    """Devices separated by commas, each cpu or cuda:N: cuda:0,cuda:1; cpu,cpu emulates a split
    on one CPU. Every device of one kind, and a GPU named once."""
    names = tuple(part.strip() for part in text.split(","))
    for name in names:
        if not _DEVICE.fullmatch(name):
            raise argparse.ArgumentTypeError(
                Text(
                    "{name!r} is not a device of a split; name each device as cpu or cuda:N, "
                    "separated by commas, e.g. cuda:0,cuda:1",
                    name=name,
                )
            )
    if len(names) < 2:
        raise argparse.ArgumentTypeError(
            Text("a split needs two devices or more, e.g. cuda:0,cuda:1; for one, use --device")
        )
    if len({name.partition(":")[0] for name in names}) > 1:
        raise argparse.ArgumentTypeError(
            Text("{text}: split across GPUs or emulate a split on the CPU, not both", text=text)
        )
    twice = sorted({name for name in names if name != "cpu" and names.count(name) > 1})
    if twice:
        raise argparse.ArgumentTypeError(
            Text("{name} is named twice; name each GPU once", name=twice[0])
        )
    return names


@dataclass(frozen=True, slots=True)
class LayerSplit:
    """`--layer-split`: the layers of each device, as counts (20,20: whole numbers that add up to
    the model's layers) or as shares (0.6,0.4: decimals that add up to 1)."""

    counts: tuple[int, ...] = ()
    shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        assert bool(self.counts) != bool(self.shares)

    def __str__(self) -> str:
        return ",".join(str(v) for v in self.counts or self.shares)

    @property
    def parts(self) -> int:
        return len(self.counts or self.shares)

    @classmethod
    def parse(cls, text: str) -> LayerSplit:
        """The flag's value; ArgumentTypeError in words where it is none."""
        items = [part.strip() for part in text.split(",")]
        if len(items) < 2 or not all(re.fullmatch(r"[0-9]*\.?[0-9]+", i) for i in items):
            raise argparse.ArgumentTypeError(
                Text(
                    "{text!r} is not a layer split; give each device's layers, separated by "
                    "commas, as counts (20,20) or as shares that add up to 1 (0.6,0.4)",
                    text=text,
                )
            )
        if all(i.isdigit() for i in items):
            counts = tuple(int(i) for i in items)
            if min(counts) < 1:
                raise argparse.ArgumentTypeError(
                    Text("{text}: give every device one layer or more", text=text)
                )
            return cls(counts=counts)
        shares = tuple(float(i) for i in items)
        if min(shares) <= 0 or abs(sum(shares) - 1) > 0.01:
            raise argparse.ArgumentTypeError(
                Text(
                    "{text}: shares of the layers must each be above 0 and add up to 1 (0.6,0.4)",
                    text=text,
                )
            )
        return cls(shares=shares)

    def layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Each device's layers in a model of `num_layers` (SplitError where the counts do not
        add up to it, or a share comes to no layer)."""
        if self.counts:
            if sum(self.counts) != num_layers:
                raise SplitError(
                    Text(
                        "--layer-split {split} places {placed} layers, but the model has {layers}; "
                        "give counts that add up to {layers}, or shares (0.5,0.5)",
                        split=str(self),
                        placed=sum(self.counts),
                        layers=num_layers,
                    )
                )
            return self.counts
        # largest remainders: the counts add up to num_layers and each is within 1 of its share
        exact = [share / sum(self.shares) * num_layers for share in self.shares]
        counts = [int(x) for x in exact]
        by_remainder = sorted(range(len(exact)), key=lambda d: counts[d] - exact[d])
        for d in by_remainder[: num_layers - sum(counts)]:
            counts[d] += 1
        if min(counts) < 1:
            raise SplitError(
                Text(
                    "--layer-split {split} gives a device none of the model's {layers} layers; "
                    "give every device a larger share",
                    split=str(self),
                    layers=num_layers,
                )
            )
        return tuple(counts)


@dataclass(frozen=True, slots=True)
class DeviceShare:
    """What one device brings to a split: its name, the bytes it has for its layers (its budget
    less what it holds besides them), its link's host-to-device rate and its memory's rate, what
    its share of a decode step's dense work reads at (None: not known; a split weighs the
    devices' compute only where every one's is known)."""

    name: str
    free_bytes: int
    link_gbps: float
    memory_gbps: float | None = None


@dataclass(frozen=True, slots=True)
class LayerBytes:
    """One decoder layer's bytes on its device: what it must hold (dense weights, its KV reserve,
    its per-sequence states) and all of its routed experts, which an expert cache holds as room
    allows; what a decode step reads of it in device memory (its dense weights and the experts
    a token routes to) and the share of its experts a token routes to (top_k of them: of the
    experts that do not fit, that share crosses the link each step; 1 counts them all)."""

    fixed_bytes: int
    expert_bytes: int
    step_bytes: int = 0
    active_share: float = 1.0


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """One device's share of a decode step under a split, as the planner estimates it: the
    seconds its layers' dense work reads its memory, the seconds the experts that do not fit it
    take to cross its link, and how full its memory is (where neither takes time, the fuller
    device is the slower)."""

    device: DeviceShare
    dense_s: float
    miss_s: float
    fullness: float

    @property
    def seconds(self) -> float:
        return self.dense_s + self.miss_s

    def limit_text(self) -> Text:
        """What limits this device's step, in words."""
        if self.miss_s > self.dense_s:
            return Text(
                "{device} limits the step: its layers' experts that do not fit its memory cross "
                "its {link:.1f} GB/s link",
                device=self.device.name,
                link=self.device.link_gbps,
            )
        if self.dense_s > 0:
            return Text(
                "{device} limits the step: its layers' dense work reads its memory at "
                "{rate:.0f} GB/s",
                device=self.device.name,
                rate=self.device.memory_gbps,
            )
        return Text(
            "{device} limits the step: its memory is the fullest ({share:.0%} of it for its "
            "layers)",
            device=self.device.name,
            share=self.fullness,
        )


# rows of a decode step from which a split pipelines it in two micro-batches by default
# (`--split-microbatches`): below, a step's work is mostly reading the weights, which every
# micro-batch reads again. Unmeasured: no machine with two GPUs has been lent to time it.
PIPELINE_MIN_ROWS = 32


def microbatch_count(setting: int | None, rows: int) -> int:
    """How many micro-batches a split's decode step of `rows` rows runs in: `setting`
    (`--split-microbatches`; None: 2 from PIPELINE_MIN_ROWS rows, else 1), never more than its
    rows (a batch of one runs whole)."""
    wanted = setting if setting is not None else (2 if rows >= PIPELINE_MIN_ROWS else 1)
    return max(1, min(wanted, rows))


def microbatch_rows(rows: int, count: int) -> tuple[range, ...]:
    """The rows of each of `count` micro-batches of a step of `rows` rows, in order: contiguous,
    as even as they go, the first ones the larger (5 rows in 3: 0-1, 2-3, 4)."""
    size, extra = divmod(rows, count)
    out, start = [], 0
    for i in range(count):
        stop = start + size + (i < extra)
        out.append(range(start, stop))
        start = stop
    return tuple(out)


def launch_order(parts: int, count: int) -> tuple[tuple[int, int], ...]:
    """(micro-batch, device) in the order a pipelined step launches them: each micro-batch
    through every device before the next one starts, dev0(mb0), dev1(mb0), dev0(mb1), ... With
    each device's work on its own stream and the launches asynchronous, device 0 runs
    micro-batch 1 while device 1 runs micro-batch 0."""
    return tuple((m, d) for m in range(count) for d in range(parts))


def split_ranges(counts: tuple[int, ...]) -> tuple[range, ...]:
    """Contiguous layer ranges, in device order, of the given counts."""
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def _mean_layer(layers: tuple[LayerBytes, ...]) -> LayerBytes:
    n = len(layers)
    return LayerBytes(
        fixed_bytes=sum(layer.fixed_bytes for layer in layers) // n,
        expert_bytes=sum(layer.expert_bytes for layer in layers) // n,
        step_bytes=sum(layer.step_bytes for layer in layers) // n,
        active_share=max(layer.active_share for layer in layers),
    )


def _step(device: DeviceShare, count: int, layer: LayerBytes, weigh_compute: bool) -> DeviceStep:
    """`device`'s share of a step with `count` layers like `layer`."""
    whole = layer.fixed_bytes + layer.expert_bytes
    missing = max(0, count * whole - device.free_bytes)
    miss_s = missing * layer.active_share / (device.link_gbps * 1e9)
    dense_s = 0.0
    if weigh_compute and device.memory_gbps:
        dense_s = count * layer.step_bytes / (device.memory_gbps * 1e9)
    return DeviceStep(device, dense_s, miss_s, count * whole / max(1, device.free_bytes))


def _weighs_compute(devices: tuple[DeviceShare, ...]) -> bool:
    return all(device.memory_gbps for device in devices)


def step_estimates(
    devices: tuple[DeviceShare, ...], layers: tuple[LayerBytes, ...], counts: tuple[int, ...]
) -> tuple[DeviceStep, ...]:
    """Each device's share of a decode step with `counts` layers, at the mean layer."""
    mean, weigh = _mean_layer(layers), _weighs_compute(devices)
    return tuple(
        _step(device, count, mean, weigh) for device, count in zip(devices, counts, strict=True)
    )


def limiting(steps: tuple[DeviceStep, ...]) -> DeviceStep:
    """The device whose share of a step is the longest (the fullest, where none takes time)."""
    return max(steps, key=lambda step: (step.seconds, step.fullness))


def default_counts(
    devices: tuple[DeviceShare, ...], layers: tuple[LayerBytes, ...]
) -> tuple[int, ...]:
    """Each device's layers where --layer-split is not given (SplitError where the devices cannot
    hold them): one layer at a time to the device whose step would then be shortest.

    A device's step is its layers' dense work at its memory's rate (where every device's is
    known) and the experts a step routes to that do not fit its memory, over its link; between
    devices whose steps take no time, the one left fuller is the slower. Ties go to the device
    with fewer layers, then to the one with more memory, then the faster link, then the faster
    memory: a device with more of each never gets fewer layers than one with less. The costs
    use the mean layer (layers of one model differ by little: a dense MLP layer among MoE ones),
    and `check_fits` then holds the real layers to each device's memory."""
    n = len(layers)
    if n < len(devices):
        raise SplitError(
            Text(
                "the model's {layers} layers cannot be split across {devices} devices; name at "
                "most {layers}",
                layers=n,
                devices=len(devices),
            )
        )
    mean, weigh = _mean_layer(layers), _weighs_compute(devices)
    fixed = sum(layer.fixed_bytes for layer in layers) / n

    def cost(device: DeviceShare, count: int) -> tuple[float, float]:
        if count * fixed > device.free_bytes:
            return (float("inf"), float("inf"))
        step = _step(device, count, mean, weigh)
        return (step.seconds, step.fullness)

    counts = [1] * len(devices)
    for device in devices:
        if cost(device, 1)[0] == float("inf"):
            raise _too_small(device, 1, fixed)
    for _ in range(n - len(devices)):
        d = min(
            range(len(devices)),
            key=lambda d: (
                cost(devices[d], counts[d] + 1),
                counts[d],
                -devices[d].free_bytes,
                -devices[d].link_gbps,
                -(devices[d].memory_gbps or 0.0),
                d,
            ),
        )
        if cost(devices[d], counts[d] + 1)[0] == float("inf"):
            raise SplitError(
                Text(
                    "{devices} cannot hold the dense weights and KV of the model's {layers} "
                    "layers (about {per_layer:.2f} GiB a layer); lower --kv-reserve-tokens, or "
                    "add a device",
                    devices=" and ".join(
                        f"{dev.name} ({dev.free_bytes / GIB:.2f} GiB)" for dev in devices
                    ),
                    layers=n,
                    per_layer=fixed / GIB,
                )
            )
        counts[d] += 1
    return tuple(counts)


def check_fits(
    devices: tuple[DeviceShare, ...], layers: tuple[LayerBytes, ...], counts: tuple[int, ...]
) -> None:
    """SplitError naming the first device whose layers' dense weights and KV do not fit it."""
    for device, span in zip(devices, split_ranges(counts), strict=True):
        need = sum(layers[i].fixed_bytes for i in span)
        if need > device.free_bytes:
            raise _too_small(device, len(span), need / max(1, len(span)))


def plan_split(
    devices: tuple[DeviceShare, ...],
    layers: tuple[LayerBytes, ...],
    layer_split: LayerSplit | None = None,
) -> tuple[range, ...]:
    """Each device's range of layers: as --layer-split gives them, else the default split;
    SplitError where a device cannot hold its share (`step_estimates` tells each one's step)."""
    if layer_split is not None:
        if layer_split.parts != len(devices):
            raise SplitError(
                Text(
                    "--layer-split {split} has {parts} parts for {count} devices; give one per "
                    "device of --devices",
                    split=str(layer_split),
                    parts=layer_split.parts,
                    count=len(devices),
                )
            )
        counts = layer_split.layer_counts(len(layers))
    else:
        counts = default_counts(devices, layers)
    check_fits(devices, layers, counts)
    return split_ranges(counts)


def _too_small(device: DeviceShare, count: int, per_layer: float) -> SplitError:
    return SplitError(
        Text(
            "{device} has {free:.2f} GiB for its layers, but the dense weights and KV of its "
            "{count} of the model's layers need {need:.2f} GiB; give it fewer layers with "
            "--layer-split, lower --kv-reserve-tokens, or leave it out of --devices",
            device=device.name,
            free=device.free_bytes / GIB,
            count=count,
            need=count * per_layer / GIB,
        )
    )


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    """A device of a split as its memory plan sees it: its name, the memory it may plan with
    (`MemoryConfig.budget_bytes` of it), its link's measured host-to-device rate and its
    memory's rate (None: not known), and how a later prefill chunk's attention runs there
    ("flash", "masked" or "none", as `MemoryRequest.chunk_attention`; None: the request's), so
    that a newer and an older card each plan the transient of the path they run."""

    name: str
    budget_bytes: int
    link_gbps: float
    memory_gbps: float | None = None
    chunk_attention: str | None = None


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """A split model's memory: each device's range of layers and its VRAM plan, all with the
    same KV tokens (a sequence's pages are the same on every device), and their sum; each
    device's estimated share of a decode step, and which device's is the longest."""

    names: tuple[str, ...]
    ranges: tuple[range, ...]
    plans: tuple[VramPlan, ...]
    steps: tuple[DeviceStep, ...]

    @property
    def limit(self) -> DeviceStep:
        """The device that limits the step (`limiting`)."""
        return limiting(self.steps)

    @property
    def total(self) -> VramPlan:
        """The devices' plans summed: bytes and slots added, KV tokens and context shared."""
        first = self.plans[0]
        summed = {
            name: sum(getattr(p, name) for p in self.plans)
            for name in (
                "budget_bytes", "weights_bytes", "kv_bytes", "state_bytes",
                "prefill_buffer_bytes", "activation_bytes", "graph_bytes", "headroom_bytes",
                "slots", "experts_total",
            )
        }  # fmt: skip
        return replace(first, **summed)


def _edge_bytes(spec: ModelSpec, elem_bytes: int) -> tuple[int, int]:
    """The bytes the first device holds besides its layers (the embedding) and the last (the
    final norm and the LM head, a copy of a tied embedding)."""
    table = spec.vocab_size * spec.hidden_size * elem_bytes
    return table, table + spec.hidden_size * elem_bytes


def dense_layer_bytes(spec: ModelSpec, elem_bytes: int, dense_dtype: str = "auto") -> int:
    """One decoder layer's dense weights (`--dense-dtype`): the mean over the model's layers."""
    embed, head = _edge_bytes(spec, elem_bytes)
    tied = embed if spec.tie_word_embeddings else 0
    dense = spec.dense_bytes_at(elem_bytes, dense_dtype)
    return (dense - embed - head + tied) // spec.num_layers


def layer_bytes(spec: ModelSpec, request: MemoryRequest) -> tuple[LayerBytes, ...]:
    """Each layer's bytes as a device of a split holds it under `request`: dense weights, its
    KV reserve and per-sequence states (recurrent, or windows); its routed experts in slots."""
    elem, fmt = request.elem_bytes, spec.expert_format(request.expert_dtype)
    dense = dense_layer_bytes(spec, elem, request.dense_dtype)
    tokens = -(-request.kv_reserve_tokens // request.block_size) * request.block_size
    out = []
    for i in range(spec.num_layers):
        one = range(i, i + 1)
        kv = tokens * kv_bytes_per_token(spec, elem, request.kv_cache_dtype, one)
        states = state_reserve(
            spec, request.max_running, elem, request.state_checkpoints,
            request.kv_cache_dtype, request.block_size, one,
        )[2]  # fmt: skip
        expert = spec.expert_bytes_as(fmt, elem) if i in spec.moe_layers else 0
        out.append(
            LayerBytes(
                dense + kv + states,
                spec.num_experts * expert,
                step_bytes=dense + spec.top_k * expert,
                active_share=spec.top_k / spec.num_experts,
            )
        )
    return tuple(out)


def plan_devices(
    spec: ModelSpec,
    request: MemoryRequest,
    devices: tuple[DeviceBudget, ...],
    layer_split: LayerSplit | None = None,
) -> SplitPlan:
    """The split (`plan_split`) and each device's VRAM plan under `request`, its budget its
    own: its layers' dense weights, KV and states, the buffers every device needs, and expert
    slots of its layers' experts from the rest. SplitError or MemoryPlanError where it cannot
    fit."""
    elem = request.elem_bytes
    embed, head = _edge_bytes(spec, elem)
    # what every device holds besides its layers (a prefill buffer only where room is left:
    # plan_vram)
    common = (
        activation_bytes(spec, request.prefill_chunk_tokens, request.max_running, elem)
        + (graph_pool_bytes(spec, request.max_running) if request.cuda_graphs else 0)
        + request.headroom_bytes
    )
    last = len(devices) - 1
    edges = [(embed if d == 0 else 0) + (head if d == last else 0) for d in range(len(devices))]
    shares = tuple(
        DeviceShare(
            dev.name, max(0, dev.budget_bytes - common - edge), dev.link_gbps, dev.memory_gbps
        )
        for dev, edge in zip(devices, edges, strict=True)
    )
    layers = layer_bytes(spec, request)
    ranges = plan_split(shares, layers, layer_split)
    dense = dense_layer_bytes(spec, elem, request.dense_dtype)

    def plans(req: MemoryRequest) -> list[VramPlan]:
        out = []
        for dev, span, edge in zip(devices, ranges, edges, strict=True):
            try:
                out.append(
                    replace(
                        req,
                        budget_bytes=dev.budget_bytes,
                        chunk_attention=dev.chunk_attention or req.chunk_attention,
                    ).plan(spec, layers=span, weights_bytes=dense * len(span) + edge)
                )
            except MemoryPlanError as err:  # which device it is, where the text does not say
                why = err.args[0] if err.args and isinstance(err.args[0], Text) else str(err)
                raise MemoryPlanError(Text("{device}: {why}", device=dev.name, why=why)) from None
        return out

    # the KV tokens every device holds: the fewest any device can
    tokens = min(p.kv_tokens for p in plans(request))
    blocks = tokens // request.block_size
    out = []
    for p in plans(replace(request, kv_reserve_tokens=tokens)):
        per_token = p.kv_bytes // p.kv_tokens
        out.append(
            replace(
                p,
                kv_blocks=blocks,
                kv_tokens=tokens,
                kv_bytes=tokens * per_token,
                max_context=min(p.max_context, tokens),
            )
        )
    steps = step_estimates(shares, layers, tuple(len(span) for span in ranges))
    return SplitPlan(tuple(dev.name for dev in devices), ranges, tuple(out), steps)


def plan_graphed_devices(
    spec: ModelSpec,
    request: MemoryRequest,
    devices: tuple[DeviceBudget, ...],
    layer_split: LayerSplit | None = None,
) -> SplitPlan:
    """`plan_devices` with each device's CUDA graphs' pool (where `request.cuda_graphs`),
    reserved on every device where the split still fits with them: a resident split then
    decodes from a graph per device, an offloaded one from each device's pieces
    (engine/runtime/split_graphs.py), its pools taken from its expert slots. Where the pools do
    not fit, or would leave a split that holds every expert without some of them (its eager
    steps miss nothing), the split is planned without them and decodes eagerly."""
    split = plan_devices(spec, replace(request, cuda_graphs=False), devices, layer_split)
    if not request.cuda_graphs:
        return split
    try:
        graphed = plan_devices(spec, request, devices, layer_split)
    except MemoryPlanError:  # the pools leave no room for a device's layers
        return split
    resident = all(plan.all_resident for plan in split.plans)
    if resident and not all(plan.all_resident for plan in graphed.plans):
        return split
    return graphed
