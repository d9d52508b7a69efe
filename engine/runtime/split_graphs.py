"""CUDA graphs of decode steps split across devices (`--devices`), every expert resident.

Each device's range of layers is a graph of its own, captured and replayed with that device made
the current one (a Triton kernel launches on the current device's stream, whatever device its
tensors are on). The step's inputs (positions, KV slots, block tables, state slots) go from the
host to every device; the first device's graph gathers the input tokens and embeds them, each
later one computes its own rotary and ring tables from the positions. Where a range ends, its
graph packs the residual stream (the hidden state and the residual, in one buffer), and one copy
per boundary per step moves that buffer into the next device's fixed input buffer, outside the
graphs, ordered by the copy behind both devices' streams. The last device's logits come back to
the first in one more copy, into the buffer a small graph there takes the greedy tokens from,
and the draw graphs draw from: the sampler's inputs, and the next step's input tokens, stay on
the first device, so overlapped decode runs as on one device (engine/runtime/graphs.py).

An offloaded split (experts missed on some device) steps eagerly: its host stages each MoE layer
between dense pieces, and these graphs hold whole ranges of layers, not pieces.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial

import torch

from ..model.model import Model, SeqSlice, StepBatch, StepState
from ..model.placement import LayerPlacement
from .graphs import DecodeGraphs, Graph, Outputs
from .sampling import Cut

log = logging.getLogger("moelab.graphs")

_ALIGN = 16  # bytes: each packed tensor's offset in a boundary's buffer


class Crossing:
    """The residual stream at one boundary: its tensors packed into one buffer on the device
    before it, and a buffer as large on the device after it, which one copy fills."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], dst: torch.device) -> None:
        layout, size = [], 0
        for t in tensors:
            size = -(-size // _ALIGN) * _ALIGN
            layout.append((size, t.dtype, t.shape))
            size += t.nbytes
        src = tensors[0].device
        self.out = torch.empty(size, dtype=torch.uint8, device=src)
        self.into = torch.empty(size, dtype=torch.uint8, device=dst)
        self.sent = tuple(_view(self.out, *part) for part in layout)
        self.received = tuple(_view(self.into, *part) for part in layout)

    def pack(self, tensors: tuple[torch.Tensor, ...]) -> None:
        for view, t in zip(self.sent, tensors, strict=True):
            view.copy_(t)

    def send(self) -> None:
        """The boundary's one copy (behind the producing graph, ahead of the consuming one)."""
        self.into.copy_(self.out, non_blocking=True)


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size):
    count = shape.numel() * dtype.itemsize
    return buffer[offset : offset + count].view(dtype).view(shape)


class DeviceStep:
    """One device's graph of a split step: replayed with its device (`part` of `placement`)
    current, then its output sent to the next device (`send`; None: the first device's
    sampling)."""

    def __init__(
        self,
        graph: Graph,
        placement: LayerPlacement,
        part: int,
        send: Callable[[], None] | None,
    ) -> None:
        self.graph, self.placement, self.part, self.send = graph, placement, part, send

    def replay(self) -> None:
        self.placement.enter(self.part)
        self.graph.replay()
        if self.send is not None:
            self.send()


class SplitStep:
    """A whole split step: every device's graph in layer order, then the first device's
    sampling, after which the first device is the current one again."""

    def __init__(self, steps: list[DeviceStep]) -> None:
        self.steps = steps

    def replay(self) -> None:
        for step in self.steps:
            step.replay()


class SplitDecodeGraphs(DecodeGraphs):
    """Captured decode steps of a model split across devices, every expert resident: the
    single-device graphs' inputs, draws and overlapped decode, the step itself a graph per
    device (`SplitStep` as the one graph of each batch size)."""

    def __init__(
        self,
        model: Model,
        max_bs: int,
        max_context: int,
        *,
        graph_factory: Callable[[object | None], Graph] | None = None,
    ) -> None:
        placement = model.placement
        assert isinstance(placement, LayerPlacement)
        super().__init__(model, max_bs, max_context, graph_factory=graph_factory or _device_graph)
        self.placement = placement
        devices = placement.devices
        # each later device's copy of the step's inputs, sent from the host as the first's is
        self._device_inputs = [
            (self._long.to(d, copy=True), self._int.to(d, copy=True)) for d in devices[1:]
        ]
        self._device_index = [torch.arange(max_bs, device=d) for d in devices[1:]]
        # per (batch size, boundary): the residual stream crossing it (made in the warm-up)
        self.crossings: dict[tuple[int, int], Crossing] = {}
        # per batch size: the last device's logits, on the first device
        self._first_logits: dict[int, torch.Tensor] = {}

    def _send_inputs(self, host_long: torch.Tensor, host_int: torch.Tensor, bs: int) -> None:
        super()._send_inputs(host_long, host_int, bs)
        for long, ints in self._device_inputs:
            long[1:].copy_(host_long[1:], non_blocking=True)
            ints.copy_(host_int, non_blocking=True)

    def _device_batch(self, part: int, bs: int) -> StepBatch:
        """The step's inputs of batch size `bs` on device `part` of the split."""
        if part == 0:
            return self._batch(bs)
        long, ints = self._device_inputs[part - 1]
        tables = self.max_bs * self.max_blocks
        return StepBatch(
            input_ids=long[1, :bs], positions=long[2, :bs], slots=long[3, :bs],
            seqs=[SeqSlice(i, 1, 1) for i in range(bs)],
            logits_index=self._device_index[part - 1][:bs],
            block_tables=ints[:tables].view(self.max_bs, self.max_blocks)[:bs],
            seq_lens=ints[tables : tables + self.max_bs][:bs],
            state_slots=long[7, :bs] if self.model.states is not None else None,
        )  # fmt: skip

    def _span(self, bs: int, part: int) -> Outputs:
        """Device `part`'s layers of a step: from the embedding of the gathered input tokens, or
        the stream the boundary before it received; to the stream packed for the next device,
        or the logits."""
        placement = self.placement
        state = StepState(self._device_batch(part, bs))
        if part == 0:
            self._gather_inputs(bs)
        else:
            state.hidden, state.residual = self.crossings[bs, part - 1].received
        self.model.run_layers(placement.ranges[part], state)
        if part == len(placement.devices) - 1:
            assert state.logits is not None
            return None, None, None, state.logits
        assert state.hidden is not None and state.residual is not None
        stream = (state.hidden, state.residual)
        crossing = self.crossings.get((bs, part))
        if crossing is None:  # the warm-up's first run makes the boundary's buffers
            crossing = Crossing(stream, placement.devices[part + 1])
            self.crossings[bs, part] = crossing
        crossing.pack(stream)
        return ()

    def _sample_first(self, bs: int) -> Outputs:
        """The greedy tokens of the logits the last device sent, on the first device."""
        logits = self._first_logits[bs]
        self._sample(bs, logits)
        return None, None, None, logits

    def _send_logits(self, bs: int, logits: torch.Tensor) -> None:
        self._first_logits[bs].copy_(logits, non_blocking=True)

    def _warm(self, bs: int) -> None:
        """One eager step of batch size `bs` through the graphs' buffers."""
        placement = self.placement
        last = len(placement.devices) - 1
        for part in range(last + 1):
            placement.enter(part)
            out = self._span(bs, part)
            if part < last:
                self.crossings[bs, part].send()
                continue
            if bs not in self._first_logits:
                self._first_logits[bs] = torch.empty_like(out[3], device=self.model.device)
            self._send_logits(bs, out[3])
        placement.begin()
        outputs = self._sample_first(bs)
        for cut in Cut:
            self._draw(bs, cut, outputs[3])

    def capture(self) -> None:
        """Capture every batch size (largest first, so the smaller ones share each device's
        memory pool), each device's graph with its device current."""
        placement = self.placement
        devices = placement.devices
        cuda = self.model.device.type == "cuda"
        # each device's warm-up stream
        streams = [(torch.cuda.Stream(d), d) for d in devices] if cuda else []
        with contextlib.ExitStack() as stack:
            for stream, device in streams:
                stream.wait_stream(torch.cuda.current_stream(device))
                stack.enter_context(torch.cuda.stream(stream))
            # compile every kernel specialization and settle the allocators before capturing
            for bs in self.sizes:
                for _ in range(2):
                    self._warm(bs)
        for stream, device in streams:
            torch.cuda.current_stream(device).wait_stream(stream)
        pools: list[object | None] = [None] * len(devices)
        last = len(devices) - 1
        for bs in sorted(self.sizes, reverse=True):
            steps = []
            for part in range(last + 1):
                placement.enter(part)
                graph = self._graph_factory(pools[part])
                out = graph.capture(partial(self._span, bs, part))
                pools[part] = graph.pool
                send = (
                    self.crossings[bs, part].send
                    if part < last
                    else partial(self._send_logits, bs, out[3])
                )
                steps.append(DeviceStep(graph, placement, part, send))
            placement.begin()
            sample = self._graph_factory(pools[0])
            outputs = sample.capture(partial(self._sample_first, bs))
            pools[0] = sample.pool
            steps.append(DeviceStep(sample, placement, 0, None))
            self.graphs[bs], self.heads[bs], self.outputs[bs] = (
                [SplitStep(steps)],
                [None],
                [outputs],
            )
            for cut in Cut:
                graph = self._graph_factory(pools[0])
                graph.capture(partial(self._draw, bs, cut, self._logits(bs, bs)))
                pools[0] = graph.pool
                self.draws[bs, cut] = graph
        if cuda:
            for device in devices:
                torch.cuda.synchronize(device)
        placement.begin()
        log.info(
            "captured decode CUDA graphs (a graph per device: %s) for batch sizes %s",
            ", ".join(str(d) for d in devices),
            self.sizes,
        )


_capture_streams: dict[int, torch.cuda.Stream] = {}


def _device_graph(pool: object | None) -> Graph:
    """A graph captured on a stream of the current device (torch's default capture stream is
    the device's that was current when it was first made)."""
    index = torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(index)
    return Graph(pool, stream)
