"""CUDA graphs of decode steps split across devices (`--devices`): a graph or pieces per device.

Every expert resident, each device's range of layers is a graph of its own, captured and replayed
with that device made the current one (a Triton kernel launches on the current device's stream,
whatever device its tensors are on). The step's inputs (positions, KV slots, block tables, state
slots) go from the host to every device; the first device's graph gathers the input tokens and
embeds them, each later one computes its own rotary and ring tables from the positions. Where a
range ends, its graph packs the residual stream (the hidden state and the residual, in one buffer),
and one copy per boundary per step moves that buffer into the next device's fixed input buffer,
outside the graphs, ordered by the copy behind both devices' streams. The last device's logits come
back to the first in one more copy, into the buffer a small graph there takes the greedy tokens
from, and the draw graphs draw from: the sampler's inputs, and the next step's input tokens, stay on
the first device, so overlapped decode runs as on one device (engine/runtime/graphs.py).

An offloaded split (`piecewise`: experts missed on some device) captures pieces instead, as one
device does (engine/runtime/graphs.py), each device's range cut at its own MoE layers: a device's
first piece starts at the embedding or the stream its boundary received, each later one at its
staged MoE layer's sum, and its last piece ends at the stream packed for the next device or the
logits; the boundary's copy follows the device's last piece. Each piece is captured and replayed
with its device current, and between two pieces of a device the host stages the MoE layer with
that device's runner (engine/experts/split_experts.py): its expert cache, its fills over its own
link, its staged buffers, its miss plan, on the CPU workers all share. Where the device's native
planner launches pieces, a stage launches the device's next piece itself; a device's first piece
is launched from Python after the boundary's copy. Where the planner wants them, a one-token
piece sends a guess of its routing to its device's staged buffers, on its device's side stream.
A device whose layers are all dense has no runner: its range is one piece, with nothing staged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial

import torch

from ...kernels.common import inline_ptx
from ..config.split import launch_order
from ..experts.split_experts import SplitExperts
from ..experts.staged_decode import LayerStage, StagedDecode, StagedRows
from ..model.model import Model, SeqSlice, StepBatch, StepState
from ..model.placement import LayerPlacement
from .graphs import DecodeGraphs, Graph, Outputs, piece_execs
from .microbatch import Pipelining
from .sampling import Cut

log = logging.getLogger("moelab.graphs")

_ALIGN = 16  # bytes: each packed tensor's offset in a boundary's buffer


class Crossing:
    """The residual stream at one boundary: its tensors packed into one buffer on the device
    before it, and a buffer as large on the device after it, which one copy fills."""

    def __init__(
        self,
        tensors: tuple[torch.Tensor, ...],
        dst: torch.device,
        receive: torch.cuda.Stream | None = None,
    ) -> None:
        """receive: a stream of the device after, which the copy of a pipelined step's
        micro-batch is queued behind instead of that device's stream (`send`)."""
        self.receive = receive
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
        """The boundary's one copy (behind the producing graph, ahead of the consuming one).
        torch orders a copy between devices behind both devices' streams: with a receive
        stream, the device after is still working on the micro-batch before, so the copy waits
        for the receive stream instead, and the device after's stream waits for the copy (an
        event, no host sync); the device before goes on with its next micro-batch."""
        if self.receive is None:
            self.into.copy_(self.out, non_blocking=True)
            return
        _copy_behind(self.into, self.out, self.receive)
        torch.cuda.current_stream(self.into.device).wait_stream(self.receive)


def _copy_behind(into: torch.Tensor, out: torch.Tensor, receive: torch.cuda.Stream) -> None:
    """Copy `out` into `into` (on another device) behind `receive`, a stream of `into`'s device
    (torch's copy waits for the destination's current stream, here `receive`)."""
    with torch.cuda.stream(receive):
        into.copy_(out, non_blocking=True)


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
        receive: torch.cuda.Stream | None = None,
    ) -> None:
        """receive: the stream the logits of a pipelined step's micro-batches were copied
        behind, which the first device's sampling waits for."""
        self.graph, self.placement, self.part, self.send = graph, placement, part, send
        self.receive = receive

    def replay(self) -> None:
        self.placement.enter(self.part)
        if self.receive is not None:
            torch.cuda.current_stream(self.receive.device).wait_stream(self.receive)
        self.graph.replay()
        if self.send is not None:
            self.send()


class SplitStep:
    """A whole split step: every device's graph in layer order (pipelined: each micro-batch's
    in turn, `launch_order`), then the first device's sampling, after which the first device is
    the current one again."""

    def __init__(self, steps: list[DeviceStep]) -> None:
        self.steps = steps

    def replay(self) -> None:
        for step in self.steps:
            step.replay()


class DeviceStaging:
    """One device's staged decode (its runner's) and the host buffers its pieces share with it:
    each route's slot, the CPU's part, the routing its routers store and its signal (None: the
    host waits for the device's stream instead), and where its planner wants them the buffers a
    one-token piece sends its guess of its routing to (`StagedDecode.guess_buffers`)."""

    def __init__(self, staged: StagedDecode, max_bs: int, device: torch.device) -> None:
        self.staged = staged
        buffers = staged.buffers
        self.slots_host = buffers.route_slots(max_bs)
        self.cpu_part = buffers.cpu_out(max_bs)
        self.routing_host = buffers.routing(max_bs)
        signals = device.type != "cuda" or inline_ptx(device)
        self.signal = staged.routing_signal() if signals else None
        self.guess = staged.guess_buffers() if signals else None


class DevicePiece:
    """One piece of an offloaded split step on device `part`: its head (the cached experts'
    routes of the MoE layer staged before it, None for a device's first piece) and its graph,
    then the stage of the MoE layer its router ends at (None: the device's last piece, which
    `send`s the stream across the boundary or the logits to the first device; the sampling's
    piece has neither). launched_stage: the same stage for the native planner, which launches
    the device's next piece itself (None where the graphs have no execs to hand it)."""

    def __init__(
        self,
        graph: Graph,
        head: Graph | None,
        placement: LayerPlacement,
        part: int,
        staging: DeviceStaging | None,
        stage: LayerStage | None,
        send: Callable[[], None] | None,
    ) -> None:
        self.graph, self.head, self.placement, self.part = graph, head, placement, part
        self.staging, self.stage, self.send = staging, stage, send
        self.launched_stage: LayerStage | None = None

    def replay(self, rows: StagedRows | None, n: int, bs: int, launched_before: bool) -> bool:
        """Replay the piece with its device current (launched_before: the stage before it has
        launched it), then stage its MoE layer for the step's `n` real rows of `bs` (`rows`: the
        device's staged views of them; None on a device with no MoE layer). Returns whether the
        stage launched the next piece."""
        self.placement.enter(self.part)
        staging, stage = self.staging, self.stage
        if launched_before:
            assert staging is not None
            launched = time.perf_counter()
            staging.staged.after_launch()
        else:
            t0 = time.perf_counter()
            if self.head is not None:  # the cached experts' routes, then the wait for the fills
                assert staging is not None
                self.head.replay()
                staging.staged.join_fills()
            if stage is not None and staging is not None and staging.signal is not None:
                staging.staged.expect_routing()  # its router sets the signal the stage waits for
            self.graph.replay()
            launched = time.perf_counter()
            if self.head is not None:  # the launch that ends a staged layer step
                assert staging is not None
                staging.staged.after_launch(launched - t0)
        if self.send is not None:
            self.send()
        if stage is None:
            return False
        assert staging is not None and rows is not None
        staged = staging.staged
        native = self.launched_stage is not None and staged.launches_pieces()
        staged.stage_decode(self.launched_stage if native else stage, rows, launched)
        # padding rows run no experts (the native launch marks them itself; here, written after
        # the stage's sync: an earlier step's graphs may read these rows until then)
        if not native and n < bs:
            staging.slots_host[n:bs] = -1
        return native


class SplitDecodeGraphs(DecodeGraphs):
    """Captured decode steps of a model split across devices: the single-device graphs' inputs,
    draws and overlapped decode, the step itself a graph per device where every expert is
    resident (`SplitStep` as the one graph of each batch size), else each device's pieces
    (piecewise: `DevicePiece`s, in `pieces`). Either way the step's tokens come back in a copy
    queued after the first device's sampling, and an event after it tells the step done."""

    def __init__(
        self,
        model: Model,
        max_bs: int,
        max_context: int,
        *,
        piecewise: bool = False,
        graph_factory: Callable[[object | None], Graph] | None = None,
        pipelining: Pipelining | None = None,
    ) -> None:
        """pipelining: the split's micro-batches (microbatch.py); None or piecewise, every step
        runs whole."""
        placement = model.placement
        assert isinstance(placement, LayerPlacement)
        super().__init__(model, max_bs, max_context, graph_factory=graph_factory or _device_graph)
        self.piecewise = piecewise
        self.placement = placement
        devices = placement.devices
        # each device's MoE layers (by index among the model's) and, offloaded, its staging
        self._moe_ranges = placement.moe_ranges(model.spec.moe_layers)
        # (made with each device current: a planner made on first use makes its driver event
        # on the current device; None: a device with no MoE layer)
        self._staging: list[DeviceStaging | None] = []
        if piecewise:
            runners = model.experts.runners
            for part, (runner, device) in enumerate(zip(runners, devices, strict=True)):
                placement.enter(part)
                staging = None if runner is None else DeviceStaging(runner.staged, max_bs, device)
                self._staging.append(staging)
            placement.begin()
        # whether the pieces send routing guesses (`bench decode` asks): the first device's with
        # MoE layers
        staged = [staging for staging in self._staging if staging is not None]
        self.routing_guess = staged[0].guess if staged else None
        # piecewise: per batch size, the step's pieces in launch order
        self.pieces: dict[int, list[DevicePiece]] = {}
        # each later device's copy of the step's inputs, sent from the host as the first's is
        self._device_inputs = [
            (self._long.to(d, copy=True), self._int.to(d, copy=True)) for d in devices[1:]
        ]
        self._device_index = [torch.arange(max_bs, device=d) for d in devices[1:]]
        # per (rows, boundary): the residual stream of a step's rows (a micro-batch's, or a whole
        # step's from row 0) crossing it (made in the warm-up)
        self.crossings: dict[tuple[range, int], Crossing] = {}
        # per batch size: the last device's logits, on the first device
        self._first_logits: dict[int, torch.Tensor] = {}
        # per batch size: each micro-batch's rows, captured as graphs of their own (one: the
        # step whole). Offloaded steps run whole: the host stages each MoE layer between
        # pieces, one device at a time, so no device's pieces would run beside another's
        self.pipelining = pipelining
        self.micro = {
            bs: (range(bs),) if pipelining is None or piecewise else pipelining.rows(bs)
            for bs in self.sizes
        }
        # per (rows, device): the graph of its range over those rows, and its outputs
        self._range_graphs: dict[tuple[range, int], tuple[Graph, Outputs]] = {}
        # pipelined on GPUs: each device's stream that the copies into it queue behind, for
        # every step (its device's own stream waits for them: `Crossing.send`, the sampling)
        pipelined = any(len(rows) > 1 for rows in self.micro.values())
        self._receive = (
            [torch.cuda.Stream(d) for d in devices]
            if pipelined and model.device.type == "cuda"
            else None
        )

    def _send_inputs(self, host_long: torch.Tensor, host_int: torch.Tensor, bs: int) -> None:
        super()._send_inputs(host_long, host_int, bs)
        for long, ints in self._device_inputs:
            long[1:].copy_(host_long[1:], non_blocking=True)
            ints.copy_(host_int, non_blocking=True)

    def _device_batch(self, part: int, rows: range) -> StepBatch:
        """The step's inputs of rows `rows` (a micro-batch's, or a whole step's from row 0) on
        device `part` of the split."""
        span, count = slice(rows.start, rows.stop), len(rows)
        states = self.model.states is not None
        if part == 0:
            long, ints, index = self._long, self._int, self.logits_index
        else:
            (long, ints), index = self._device_inputs[part - 1], self._device_index[part - 1]
        tables = self.max_bs * self.max_blocks
        return StepBatch(
            input_ids=self.input_ids[span] if part == 0 else long[1, span],
            positions=long[2, span], slots=long[3, span],
            seqs=[SeqSlice(i, 1, 1) for i in range(count)],
            logits_index=index[:count],
            block_tables=ints[:tables].view(self.max_bs, self.max_blocks)[span],
            seq_lens=ints[tables : tables + self.max_bs][span],
            state_slots=long[7, span] if states else None,
        )  # fmt: skip

    def _span(self, rows: range, part: int) -> Outputs:
        """Device `part`'s layers of a step's rows `rows`: from the embedding of the gathered
        input tokens, or the stream the boundary before it received; to the stream packed for
        the next device, or the logits."""
        state = StepState(self._device_batch(part, rows))
        self._range_start(rows, part, state)
        # the resident routing record keeps a micro-batch's rows in their place
        experts = self.model.experts
        assert isinstance(experts, SplitExperts)
        experts.record_rows_from(rows.start)
        try:
            self.model.run_layers(self.placement.ranges[part], state)
        finally:
            experts.record_rows_from(0)
        return self._range_end(rows, part, state)

    def _range_start(self, rows: range, part: int, state: StepState) -> None:
        if part == 0:  # each row's input token: one the host sent, or one the last replay sampled
            span = slice(rows.start, rows.stop)
            torch.index_select(
                self._token_pool, 0, self._token_index[span], out=self.input_ids[span]
            )
        else:
            state.hidden, state.residual = self.crossings[rows, part - 1].received

    def _range_end(self, rows: range, part: int, state: StepState) -> Outputs:
        placement = self.placement
        if part == len(placement.devices) - 1:
            assert state.logits is not None
            return None, None, None, state.logits
        assert state.hidden is not None and state.residual is not None
        stream = (state.hidden, state.residual)
        crossing = self.crossings.get((rows, part))
        if crossing is None:  # the warm-up's first run makes the boundary's buffers
            receive = None if self._receive is None else self._receive[part + 1]
            crossing = Crossing(stream, placement.devices[part + 1], receive)
            self.crossings[rows, part] = crossing
        crossing.pack(stream)
        return ()

    def _sample_first(self, bs: int) -> Outputs:
        """The greedy tokens of the logits the last device sent, on the first device."""
        logits = self._first_logits[bs]
        self._sample(bs, logits)
        return None, None, None, logits

    def _send_logits(self, bs: int, rows: range, logits: torch.Tensor) -> None:
        """The last device's logits of a step's rows `rows` into their rows on the first
        device (pipelined on GPUs, behind its receive stream, which the sampling waits for)."""
        into = self._first_logits[bs][rows.start : rows.stop]
        if self._receive is None:
            into.copy_(logits, non_blocking=True)
        else:
            _copy_behind(into, logits, self._receive[0])

    # offloaded: each device's pieces -------------------------------------------------------------

    def _device_pieces(self, part: int) -> range:
        """Device `part`'s pieces, by the model's piece index (`Model.run_piece`): the one ending
        at each of its MoE layers' routers, then its last one."""
        moe = self._moe_ranges[part]
        return range(moe.start, moe.stop + 1)

    def _head_of(self, bs: int, part: int, state: StepState) -> Outputs:
        """The start of a piece after an MoE layer of device `part`: its cached experts' routes."""
        assert state.x is not None and state.weights is not None
        staging = self._staging[part]
        assert staging is not None
        self._head_out = staging.staged.routed_cached(
            state.x, staging.slots_host[:bs], state.weights
        )
        return self._head_out

    def _piece_of(self, bs: int, part: int, piece: int, state: StepState) -> Outputs:
        """Piece `piece` of device `part`: after one of its MoE layers it starts with that
        layer's filled experts' routes and the sum of all of its parts; it ends at the next MoE
        layer's router, or at the end of the device's range."""
        model, staging = self.model, self._staging[part]
        moe = self._moe_ranges[part]
        if piece > moe.start:
            assert state.x is not None and state.weights is not None
            assert self._head_out is not None
            cached_part, filled = self._head_out
            staged, cpu_part = staging.staged, staging.cpu_part[:bs]
            norm = model.norm_after_experts(piece - 1)
            if norm is None:
                state.routed = staged.routed_filled(
                    state.x, filled, state.weights, cached_part, cpu_part,
                    model.routed_dtype(piece - 1),
                )  # fmt: skip
            else:  # the layer's sum, the residual add and the next norm in one launch
                assert state.residual is not None
                state.normed = staged.routed_filled_normed(
                    state.x, filled, state.weights, cached_part, cpu_part, state.residual, norm,
                    model.spec.rms_norm_eps,
                )  # fmt: skip
        else:
            self._range_start(range(bs), part, state)
        routed = piece < moe.stop
        state.routing_host = tuple(t[:bs] for t in staging.routing_host) if routed else None
        state.routing_signal = staging.signal if routed else None
        state.routing_guess = staging.guess if routed and self._guesses_of(bs, part) else None
        model.run_piece(piece, state, self.placement.ranges[part])
        if routed:
            return state.x, state.ids, state.weights, None
        return self._range_end(range(bs), part, state)

    def _guesses_of(self, bs: int, part: int) -> bool:
        """Whether device `part`'s pieces of batch size `bs` that end in a router send a guess
        of its routing: one token, where its planner wants guesses."""
        staging = self._staging[part]
        return bs == 1 and staging is not None and staging.guess is not None

    def _part_eagerly(self, bs: int, rows: range, part: int) -> Outputs:
        """Device `part`'s share of a step's rows `rows` run through the graphs' buffers (a
        warm-up)."""
        if not self.piecewise:
            return self._span(rows, part)
        state = StepState(self._device_batch(part, range(bs)))
        out: Outputs = ()
        for piece in self._device_pieces(part):
            if piece > self._moe_ranges[part].start:
                self._head_of(bs, part, state)
            out = self._piece_of(bs, part, piece, state)
        return out

    def _warm(self, bs: int) -> None:
        """One eager step of batch size `bs` through the graphs' buffers."""
        placement = self.placement
        last = len(placement.devices) - 1
        micro = self.micro[bs]
        for m, part in launch_order(last + 1, len(micro)):
            placement.enter(part)
            out = self._part_eagerly(bs, micro[m], part)
            if part < last:
                self.crossings[micro[m], part].send()
                continue
            logits = out[3]
            assert logits is not None
            if bs not in self._first_logits:
                self._first_logits[bs] = torch.empty(
                    (bs, logits.shape[1]), dtype=logits.dtype, device=self.model.device
                )
            self._send_logits(bs, micro[m], logits)
        placement.begin()
        if self._receive is not None:
            torch.cuda.current_stream(self.model.device).wait_stream(self._receive[0])
        outputs = self._sample_first(bs)
        for cut in Cut:
            self._draw(bs, cut, outputs[3])

    def _capture_part(self, bs: int, rows: range, part: int, pools: list[object | None]) -> list:
        """Device `part`'s graphs of batch size `bs` (of its rows `rows`: a micro-batch's, or
        all of them), captured with it current: one `DeviceStep`, or its `DevicePiece`s."""
        last = len(self.placement.devices) - 1

        def send(out: Outputs) -> Callable[[], None]:
            if part < last:
                return self.crossings[rows, part].send
            return partial(self._send_logits, bs, rows, out[3])

        if not self.piecewise:
            # a graph per device per rows: a micro-batch whose rows are a smaller size's whole
            # step (each step's first) replays that size's graph, with its own send
            kept = self._range_graphs.get((rows, part))
            if kept is None:
                graph = self._graph_factory(pools[part])
                kept = graph, graph.capture(partial(self._span, rows, part))
                pools[part] = graph.pool
                self._range_graphs[rows, part] = kept
            graph, out = kept
            return [DeviceStep(graph, self.placement, part, send(out))]
        state = StepState(self._device_batch(part, rows))
        staging, moe = self._staging[part], self._moe_ranges[part]
        pieces = []
        for piece in self._device_pieces(part):
            head = None
            if piece > moe.start:
                head = self._graph_factory(pools[part])
                head.capture(partial(self._head_of, bs, part, state))
                pools[part] = head.pool
            graph = self._graph_factory(pools[part])
            out = graph.capture(partial(self._piece_of, bs, part, piece, state))
            pools[part] = graph.pool
            routed = piece < moe.stop
            guess = self._guesses_of(bs, part)
            stage = LayerStage(piece - moe.start, guess=guess) if routed else None
            pieces.append(
                DevicePiece(graph, head, self.placement, part, staging, stage,
                            None if routed else send(out))
            )  # fmt: skip
        if staging is None:  # no MoE layer: one piece, no stage
            return pieces
        # each stage as the native planner runs it, launching the device's next piece: whose
        # router signals where the piece after it is the device's too
        execs = piece_execs([p.graph for p in pieces], [p.head for p in pieces])
        if execs is not None:
            signals = staging.signal is not None
            for local, piece in enumerate(pieces[:-1]):
                piece.launched_stage = LayerStage(
                    local, execs[local + 1], signals and local + 2 < len(pieces), guess
                )
        return pieces

    def capture(self) -> None:
        """Capture every batch size (largest first, so the smaller ones share each device's
        memory pool), each device's graphs with its device current."""
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
        for bs in sorted(self.sizes, reverse=True):
            steps = []
            micro = self.micro[bs]
            for m, part in launch_order(len(devices), len(micro)):
                placement.enter(part)
                steps += self._capture_part(bs, micro[m], part, pools)
            placement.begin()
            sample = self._graph_factory(pools[0])
            outputs = sample.capture(partial(self._sample_first, bs))
            pools[0] = sample.pool
            if self.piecewise:
                steps.append(DevicePiece(sample, None, placement, 0, None, None, None))
                self.pieces[bs] = steps
                self.graphs[bs], self.heads[bs] = [], []
            else:
                receive = None if self._receive is None else self._receive[0]
                steps.append(DeviceStep(sample, placement, 0, None, receive))
                self.graphs[bs], self.heads[bs] = [SplitStep(steps)], [None]
            self.outputs[bs] = [outputs]
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
            "captured decode CUDA graphs (%s per device: %s) for batch sizes %s",
            "pieces" if self.piecewise else "a graph",
            ", ".join(str(d) for d in devices),
            self.sizes,
        )

    def _replay(self, bs: int, n: int) -> None:
        if self.pipelining is not None:
            self.pipelining.ran(len(self.micro[bs]))
        if not self.piecewise:
            super()._replay(bs, n)
            return
        # only the real rows: padding rows would fetch and run experts for nothing (a native
        # launch marks the padding rows after them); each device current while its planner is
        # asked (one made now makes its driver event on the current device)
        rows: list[StagedRows | None] = []
        for part, staging in enumerate(self._staging):
            if staging is None:
                rows.append(None)
                continue
            self.placement.enter(part)
            pad = bs - n if staging.staged.launches_pieces() else 0
            rows.append(staging.staged.buffers.rows(n, pad))
        launched = False
        for piece in self.pieces[bs]:
            launched = piece.replay(rows[piece.part], n, bs, launched)


_capture_streams: dict[int, torch.cuda.Stream] = {}


def _device_graph(pool: object | None) -> Graph:
    """A graph captured on a stream of the current device (torch's default capture stream is
    the device's that was current when it was first made)."""
    index = torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(index)
    return Graph(pool, stream)
