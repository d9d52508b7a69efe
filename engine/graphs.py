"""CUDA graphs of decode steps: the whole step when every expert is resident, else its pieces.

Replaying a graph removes the launch and Python overhead of a few hundred small kernels per token.
When every expert is in the cache the whole step is one graph. An offloaded MoE layer needs the host
to see the routing and choose copies, so it cannot sit inside a graph: then each piece of dense
work (attention, norms and router between two MoE dispatches; `Model.run_piece`) is a graph of its
own, and the experts run eagerly between the replays, reading the piece's outputs and writing into
a fixed buffer the next piece reads. One set of graphs per padded batch size; padding rows write
their KV into a scratch block, attend to nothing, and are left out of the expert dispatch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial

import torch

from .model import Model, SeqSlice, StepBatch, StepState

log = logging.getLogger("moelab.graphs")


class Graph:
    """One captured piece of work (torch.cuda.CUDAGraph)."""

    def __init__(self, pool: object | None) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, work: Callable[[], None]) -> object:
        """Capture `work` (run once, recorded); returns the memory pool for the next capture."""
        with torch.cuda.graph(self._graph, pool=self._pool):
            work()
        return self._graph.pool()

    def replay(self) -> None:
        self._graph.replay()


class DecodeGraphs:
    """Captured decode steps for batch sizes up to `max_bs`, replayed with the batch's inputs.

    piecewise: capture the dense pieces between MoE layers (experts run eagerly between them)
    instead of whole steps. `graph_factory` makes the graph objects (tests pass one that re-runs
    the work, to check the plumbing without CUDA).
    """

    def __init__(
        self,
        model: Model,
        max_bs: int,
        max_context: int,
        *,
        piecewise: bool = False,
        graph_factory: Callable[[object | None], Graph] = Graph,
    ) -> None:
        self.model = model
        self.piecewise = piecewise
        self._graph_factory = graph_factory
        kv = model.kv
        dev = model.device
        self.sizes = sorted(
            {min(max_bs, 1 << i) for i in range(max_bs.bit_length() + 1)} | {max_bs}
        )
        self.max_bs = max_bs
        self.max_blocks = -(-max_context // kv.block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.slots = torch.full((max_bs,), kv.pad_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros((max_bs, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.logits_index = torch.arange(max_bs, device=dev)
        self.graphs: dict[int, list[Graph]] = {}
        self.states: dict[int, StepState] = {}  # per size: the pieces' outputs, fixed tensors
        self.routed: dict[int, list[torch.Tensor]] = {}  # per size: expert outputs, per MoE layer
        self.pool: object | None = None

    def _batch(self, bs: int) -> StepBatch:
        return StepBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], slots=self.slots[:bs],
            seqs=[SeqSlice(i, 1, 1, []) for i in range(bs)], logits_index=self.logits_index[:bs],
            block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
        )  # fmt: skip

    def _piece(self, bs: int, piece: int, state: StepState) -> None:
        """One piece of dense work; a piece after an MoE layer reads that layer's fixed buffer."""
        if piece:
            state.routed = self.routed[bs][piece - 1]
        self.model.run_piece(piece, state)

    def _whole(self, state: StepState) -> None:
        state.logits = self.model.forward(state.batch)

    def capture(self) -> None:
        """Capture every batch size (largest first, so the smaller ones share its memory pool)."""
        model = self.model
        hidden = model.spec.hidden_size
        pieces = model.num_pieces if self.piecewise else 1
        for bs in self.sizes:
            self.routed[bs] = [
                torch.zeros(bs, hidden, dtype=torch.float32, device=model.device)
                for _ in range(pieces - 1)
            ]
        cuda = model.device.type == "cuda"
        stream = torch.cuda.Stream(model.device) if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # compile every kernel specialization and settle the allocator before capturing;
            # the experts are not run (the buffers' contents do not matter here)
            for bs in self.sizes:
                for _ in range(2):
                    state = StepState(self._batch(bs))
                    for piece in range(pieces):
                        if self.piecewise:
                            self._piece(bs, piece, state)
                        else:
                            self._whole(state)
        if stream is not None:
            torch.cuda.current_stream(model.device).wait_stream(stream)
        for bs in sorted(self.sizes, reverse=True):
            state = self.states[bs] = StepState(self._batch(bs))
            graphs: list[Graph] = []
            for piece in range(pieces):
                graph = self._graph_factory(self.pool)
                if self.piecewise:
                    self.pool = graph.capture(partial(self._piece, bs, piece, state))
                else:
                    self.pool = graph.capture(partial(self._whole, state))
                graphs.append(graph)
            self.graphs[bs] = graphs
        if cuda:
            torch.cuda.synchronize(model.device)
        log.info(
            "captured decode CUDA graphs (%s) for batch sizes %s",
            f"{pieces} pieces per step" if self.piecewise else "whole steps",
            self.sizes,
        )

    def fits(self, batch: StepBatch) -> bool:
        return (batch.block_tables is not None and len(batch.seqs) <= self.max_bs
                and batch.block_tables.shape[1] <= self.max_blocks)  # fmt: skip

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Replay the graphs of the smallest captured size that holds `batch`; logits [n, vocab]."""
        n = len(batch.seqs)
        bs = next(s for s in self.sizes if s >= n)
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slots)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.seq_lens[:n].copy_(batch.seq_lens)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slots[n:bs].fill_(self.model.kv.pad_slot)
            self.seq_lens[n:bs].zero_()
        state = self.states[bs]
        graphs = self.graphs[bs]
        for piece, graph in enumerate(graphs):
            graph.replay()
            if piece < len(graphs) - 1:
                # only the real rows: padding rows would fetch and run experts for nothing
                assert state.x is not None and state.ids is not None and state.weights is not None
                out = self.model.experts.forward(
                    piece, state.x[:n], state.ids[:n], state.weights[:n], decode=True
                )
                self.routed[bs][piece][:n].copy_(out)
        assert state.logits is not None
        return state.logits[:n]
