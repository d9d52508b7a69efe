"""CUDA graphs of decode steps: the whole step when every expert is resident, else its pieces.

Replaying a graph removes the launch and Python overhead of a few hundred small kernels per token.
When every expert is in the cache the whole step is one graph. An offloaded MoE layer needs the host
to see the routing and choose copies, so it cannot sit inside a graph: then each piece of dense
work (attention, norms and router between two MoE dispatches; `Model.run_piece`) is a graph of its
own. Each piece copies its router's output into fixed pinned host memory inside its graph. Between
two replays the host waits for it, starts the CPU experts and the slot fills (on the copy stream),
and writes each route's slot into a fixed pinned table, marking the routes the fills serve
(engine/experts/staged_decode.py, one native call); it launches the next piece, and only then
counts. The next piece is two graphs: a head that reads the table and runs the cached experts'
routes while the fills cross PCIe, then, once the host has ordered the compute stream behind the
fills, the piece itself, which begins with the filled experts' routes and waits on the device for
the CPU's part, which the CPU job writes into fixed host memory (kernels/host_handoff.py): the host
launches the next piece as soon as it has dispatched, while the CPU job runs, and no kernel is
launched eagerly. One set of graphs per padded batch size; padding rows write their KV into a
scratch block, attend to nothing, and are left out of the expert dispatch (their slots stay -1).

Each step also takes its greedy next tokens on the device, and a row's input token may be one of
them: the engine can then replay step N+1 before it has read step N's tokens
(engine/runtime/engine.py). Where a row draws its token (a temperature), a small graph replayed
after the step's own draws every row's token on the device instead (`draw_tokens`, the host
sampler's function, so a seeded request gets the same tokens either way); one graph per batch size
with the sort that top-k and top-p need, one without.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ...kernels.common import inline_ptx
from ...kernels.host_handoff import tokens_to_host
from ..experts.h2d import HostToDevice
from ..experts.staged_decode import LayerStage, StagedDecode
from ..model.model import Model, SeqSlice, StepBatch, StepState
from .sampling import GREEDY_ROW, Cut, RowDraw, draw_tokens

log = logging.getLogger("moelab.graphs")

_LONG_ROWS = 8  # of the step's int64 inputs (`DecodeGraphs.__init__`)
_INT_TAIL = 4  # rows of the int32 inputs after the block tables: sequence lengths, draws' floats


# a greedy row's fp32 draw values: a column of the int32 block's last three rows
_GREEDY_FLOATS = [[value] for value in GREEDY_ROW.device_floats()]


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One sequence's decode step: its next input token, that token's position, its KV pages.

    source >= 0: the input token is the one the previous replay sampled for its row `source`
    (still on the device; `token` is then ignored).
    """

    token: int
    position: int
    blocks: list[int]
    source: int = -1
    draw: RowDraw = GREEDY_ROW  # how its next token is drawn (GREEDY_ROW: the top logit)
    state_slot: int = -1  # hybrid and sliding-window models: the sequence's slot


# What a captured piece hands to the host: the MoE layer's input, routing and weights, and the
# logits after the last piece (None where a piece does not make it).
Outputs = tuple[torch.Tensor | None, ...]


class Graph:
    """One captured piece of work (torch.cuda.CUDAGraph)."""

    def __init__(self, pool: object | None, stream: torch.cuda.Stream | None = None) -> None:
        """stream: the stream to capture on (torch's default capture stream where None)."""
        self._graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self._stream = stream

    def capture(self, work: Callable[[], Outputs]) -> Outputs:
        """Record `work`; its output tensors are rewritten in place by every replay."""
        with torch.cuda.graph(self._graph, pool=self.pool, stream=self._stream):
            outputs = work()
        self.pool = self._graph.pool()
        return outputs

    def replay(self) -> None:
        self._graph.replay()

    def exec_handle(self) -> int | None:
        """The instantiated graph's cudaGraphExec_t, for native code to launch (None where this
        torch does not expose it)."""
        raw = getattr(self._graph, "raw_cuda_graph_exec", None)
        return int(raw()) if raw is not None else None


class DecodeGraphs:
    """Captured decode steps for batch sizes up to `max_bs`, replayed with the batch's inputs.

    piecewise: capture the dense pieces between MoE layers (the host stages the experts between
    them) instead of whole steps. `graph_factory` makes the graph objects (tests pass one that
    re-runs the work, to check the plumbing without CUDA).
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
        # the last piece stores the step's tokens into host memory itself (`sampled_to_host`)
        self._tokens_in_pieces = piecewise
        self._graph_factory = graph_factory
        kv = model.kv
        dev = model.device
        self.sizes = sorted(
            {min(max_bs, 1 << i) for i in range(max_bs.bit_length() + 1)} | {max_bs}
        )
        self.max_bs = max_bs
        self.max_blocks = -(-max_context // kv.block_size)
        # A step's inputs: written on the host into pinned mirrors, sent in three copies. Row 0 of
        # the long block is the last replay's tokens (written on the device, never sent);
        # each row's input token is gathered from rows 0-1 by its index in row 4, so it can be a
        # token the host has not seen yet. Rows 5-6 are each row's seed and top-k for its draw
        # (`RowDraw`), row 7 the state slots of a hybrid model (its recurrent states) or of a
        # sliding-window one (its rings, whose tables the step makes from them). The int32 block
        # holds the block tables, then the sequence lengths, then three fp32 rows of the draws:
        # the inverse temperature, top-p and min-p's offset.
        # Two sets of mirrors, used in turn: with overlapped decode the host writes step N+2's
        # inputs once step N is done, while step N+1's copies may still be queued.
        pin = dev.type == "cuda"
        self._host_longs = [torch.zeros((_LONG_ROWS, max_bs), dtype=torch.long, pin_memory=pin)
                            for _ in range(2)]  # fmt: skip
        ints = max_bs * (self.max_blocks + _INT_TAIL)
        self._host_ints = [torch.zeros(ints, dtype=torch.int32, pin_memory=pin)
                           for _ in range(2)]  # fmt: skip
        self._mirror = 0
        tables = max_bs * self.max_blocks
        self._host_floats = [m[tables + max_bs :].view(torch.float32).numpy().reshape(3, max_bs)
                             for m in self._host_ints]  # fmt: skip
        self._long = torch.zeros((_LONG_ROWS, max_bs), dtype=torch.long, device=dev)
        self._int = torch.zeros(ints, dtype=torch.int32, device=dev)
        (
            self.sampled, _, self.positions, self.slots, self._token_index, self._seeds,
            self._top_k, self.state_slots,
        ) = self._long  # fmt: skip
        # the state slot that padding rows advance (never a sequence's)
        self._pad_state = model.states.pad_slot if model.states is not None else 0
        self._inv_t, self._top_p, self._min_offset = (
            self._int[tables + max_bs :].view(torch.float32).view(3, max_bs)
        )
        self._token_pool = self._long[:2].view(-1)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        # the sampled tokens, copied back to the host (two buffers: one step's copy may land
        # while the host still reads the previous step's)
        self._host_sampled = torch.zeros((2, max_bs), dtype=torch.long, pin_memory=pin)
        # piecewise, the last piece stores them into this one itself (`sampled_to_host`), whose
        # views are kept (making a view each step costs a host whose caches are cold more than
        # keeping them)
        self._tokens_host = torch.zeros(max_bs, dtype=torch.long, pin_memory=pin)
        self._tokens_views: dict[int, torch.Tensor] = {}
        self._cuda = pin
        # steps run, and the last one known finished on the device (piecewise: a later step's
        # first routing has arrived; `step_done`)
        self._runs = self._passed = 0
        self.block_tables = self._int[:tables].view(max_bs, self.max_blocks)
        self.seq_lens = self._int[tables : tables + max_bs]
        self.slots.fill_(kv.pad_slot)
        self.state_slots.fill_(self._pad_state)
        self.logits_index = torch.arange(max_bs, device=dev)
        # with CUDA, a step's input copies as driver calls on the stream the graphs replay on
        # (the engine's one stream, current now): computed addresses, no views, no torch copy_
        # (torch's copies cost the host several times more, most when the CPU experts have
        # streamed its caches cold)
        self._h2d = HostToDevice(torch.cuda.current_stream(dev)) if pin else None
        # the experts' staged decode (MoERunner.staged), which stages each MoE layer between two
        # pieces, and its host buffers
        self.staged: StagedDecode | None = model.experts.staged if piecewise else None
        buffers = self.staged.buffers if self.staged is not None else None
        # staged experts of the layer between two pieces: each route's slot and the CPU's part,
        # in host memory, where the host and the CPU job write them and the next piece reads them
        self.slots_host = buffers.route_slots(max_bs) if buffers else None
        # --moe-early-cached: each head runs its layer's cached routes at the layer's routing,
        # launched right after the piece that makes it (`StagedDecode.routed_cached_early`)
        self.early = self.staged is not None and self.staged.early_cached
        self.cpu_part = buffers.cpu_out(max_bs) if buffers else None
        # each piece that ends in a router copies its routing here (in its graph: no host launch
        # between the router and the host's read of it)
        self.routing_host = buffers.routing(max_bs) if buffers else None
        # which its router sets once the routing is there, for the host's wait: where its store
        # is ordered after the routing's (a fence in PTX on an NVIDIA GPU; the CPU's reference
        # runs in order); elsewhere the host waits for the stream to go idle
        signals = self.staged is not None and (dev.type != "cuda" or inline_ptx(dev))
        self.routing_signal = self.staged.routing_signal() if signals else None
        # and where the planner wants them, a one-token piece that ends in a router sends a
        # guess of its routing ahead of it (kernels/route_guess.py), for the wait to plan
        self.routing_guess = self.staged.guess_buffers() if signals else None
        self.graphs: dict[int, list[Graph]] = {}
        self.outputs: dict[int, list[Outputs]] = {}  # per size, each graph's in capture order
        # piecewise: each piece after an MoE layer starts with a graph of its own, the cached
        # experts' routes (run while the fills cross PCIe); per size, per piece (None: piece 0)
        self.heads: dict[int, list[Graph | None]] = {}
        # what a head hands to its piece: the cached routes' outputs and the filled routes' slots
        self._head_out: tuple[torch.Tensor, torch.Tensor] | None = None
        # piecewise: per size, the staged layer step after each piece but the last, as Python
        # launches the pieces, and as the native planner launches them (each holding the next
        # piece's (head, piece) graph execs; None where a graph has none)
        self.stages: dict[int, list[LayerStage]] = {}
        self.launched_stages: dict[int, list[LayerStage] | None] = {}
        # per (batch size, cut): the graph that draws every row's token after a step (`_draw`),
        # cut: what of the sorted logits the rows' filters read (sampling.Cut)
        self.draws: dict[tuple[int, Cut], Graph] = {}
        self.pool: object | None = None

    def _batch(self, bs: int) -> StepBatch:
        return StepBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], slots=self.slots[:bs],
            seqs=[SeqSlice(i, 1, 1) for i in range(bs)], logits_index=self.logits_index[:bs],
            block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
            state_slots=self.state_slots[:bs] if self.model.states is not None else None,
        )  # fmt: skip

    def _gather_inputs(self, bs: int) -> None:
        """Each row's input token: one the host sent, or one the last replay sampled."""
        torch.index_select(self._token_pool, 0, self._token_index[:bs], out=self.input_ids[:bs])

    def _sample(self, bs: int, logits: torch.Tensor) -> None:
        """The greedy next token of every row, kept on the device for the next replay."""
        torch.argmax(logits, dim=-1, out=self.sampled[:bs])

    def _draw(self, bs: int, cut: Cut, logits: torch.Tensor) -> Outputs:
        """Every row's next token drawn by its `RowDraw` (the top logit where it has none), over
        the greedy ones the step took, and where pieces are captured into the host's buffer as
        the last piece stores them. A row's position for its noise is its sequence length."""
        rows = slice(0, bs)
        draw_tokens(
            logits[:bs], self._inv_t[rows], self._top_k[rows], self._top_p[rows],
            self._min_offset[rows], self._seeds[rows], self.seq_lens[rows],
            out=self.sampled[rows], cut=cut,
        )  # fmt: skip
        if self._tokens_in_pieces:
            tokens_to_host(self.sampled[rows], self._tokens_host[rows])
        return ()

    def _head(self, bs: int, piece: int, state: StepState) -> Outputs:
        """The start of piece `piece` (after an MoE layer): the layer's cached experts' routes;
        with --moe-early-cached looked up on the device at the routing, before the host plans."""
        assert state.x is not None and state.weights is not None and self.slots_host is not None
        assert self.staged is not None
        if self.early:
            assert state.ids is not None
            self._head_out = self.staged.routed_cached_early(
                state.x, state.ids, state.weights, piece - 1, self.seq_lens[:bs]
            )
            return self._head_out[:1]
        self._head_out = self.staged.routed_cached(state.x, self.slots_host[:bs], state.weights)
        return self._head_out

    def _piece(self, bs: int, piece: int, state: StepState) -> Outputs:
        """One piece; after an MoE layer it starts with that layer's filled experts' routes and
        the sum of all of its parts."""
        if piece:
            assert state.x is not None and state.weights is not None and self.cpu_part is not None
            assert self._head_out is not None and self.staged is not None
            cached_part, filled = self._head_out
            staged, cpu_part = self.staged, self.cpu_part[:bs]
            if filled is None:  # an early head's: the fills' routes from the host's table
                assert self.slots_host is not None
                filled = staged.filled_routes(self.slots_host[:bs], state.x.device)
            norm = self.model.norm_after_experts(piece - 1)
            if norm is None:
                state.routed = staged.routed_filled(
                    state.x, filled, state.weights, cached_part, cpu_part,
                    self.model.routed_dtype(piece - 1),
                )  # fmt: skip
            else:  # the layer's sum, the residual add and the next norm in one launch
                assert state.residual is not None
                state.normed = staged.routed_filled_normed(
                    state.x, filled, state.weights, cached_part, cpu_part, state.residual, norm,
                    self.model.spec.rms_norm_eps,
                )  # fmt: skip
        else:
            self._gather_inputs(bs)
        last = piece == self.model.num_pieces - 1
        # the router of a piece's MoE layer stores its routing into the host's buffers too
        assert last or self.routing_host is not None
        state.routing_host = None if last else tuple(t[:bs] for t in self.routing_host)
        state.routing_signal = None if last else self.routing_signal
        state.routing_guess = self.routing_guess if self._guesses(bs, piece) else None
        self.model.run_piece(piece, state)
        if last:  # (by the piece's index: a replay that reruns this code sees the last logits)
            assert state.logits is not None
            self._sample(bs, state.logits)
            tokens_to_host(self.sampled[:bs], self._tokens_host[:bs])
        # the shared expert's tensors too: the next piece reads them where this one wrote them
        return state.x, state.ids, state.weights, state.logits, *(state.shared or ())

    def _guesses(self, bs: int, piece: int) -> bool:
        """Whether piece `piece` of batch size `bs` sends a guess of its routing: one token (a
        guess of several tokens' jobs would rarely match), a piece that ends in a router (piece 0
        too: its guess comes from the embedding)."""
        return self.routing_guess is not None and bs == 1 and piece < self.model.num_pieces - 1

    def _stage(self, bs: int, execs: list[tuple[int, int]] | None) -> None:
        """The staged layer steps of batch size `bs` between its captured pieces, as Python
        launches the pieces and, where the graphs have execs, as the native planner does."""
        pieces = self.model.num_pieces
        self.stages[bs] = [
            LayerStage(piece, guess=self._guesses(bs, piece)) for piece in range(pieces - 1)
        ]
        signals = self.routing_signal is not None

        def launch(piece: int) -> tuple[int, int]:
            """What stage `piece` launches: the next piece with its head, or with an early head
            the next piece, then the head of the piece after (0: none)."""
            assert execs is not None
            if not self.early:
                return execs[piece + 1]
            after = execs[piece + 2][0] if piece + 2 < pieces else 0
            return after, execs[piece + 1][1]

        self.launched_stages[bs] = None if execs is None else [
            LayerStage(piece, launch(piece), signals and piece + 2 < pieces,
                       self._guesses(bs, piece))
            for piece in range(pieces - 1)
        ]  # fmt: skip

    def _whole(self, bs: int, state: StepState) -> Outputs:
        self._gather_inputs(bs)
        state.logits = self.model.forward(state.batch)
        self._sample(bs, state.logits)
        return None, None, None, state.logits

    def _work(self, bs: int, piece: int, state: StepState) -> Callable[[], Outputs]:
        """What one graph of batch size `bs` holds: a piece, or the whole step."""
        if self.piecewise:
            return partial(self._piece, bs, piece, state)
        return partial(self._whole, bs, state)

    def capture(self) -> None:
        """Capture every batch size (largest first, so the smaller ones share its memory pool)."""
        model = self.model
        pieces = model.num_pieces if self.piecewise else 1
        cuda = model.device.type == "cuda"
        stream = torch.cuda.Stream(model.device) if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # compile every kernel specialization and settle the allocator before capturing
            for bs in self.sizes:
                for _ in range(2):
                    state = StepState(self._batch(bs))
                    for piece in range(pieces):
                        if self.piecewise and piece:
                            self._head(bs, piece, state)
                        self._work(bs, piece, state)()
                    assert state.logits is not None
                    for cut in Cut:
                        self._draw(bs, cut, state.logits)
        if stream is not None:
            torch.cuda.current_stream(model.device).wait_stream(stream)
        for bs in sorted(self.sizes, reverse=True):
            state = StepState(self._batch(bs))
            graphs: list[Graph] = []
            heads: list[Graph | None] = []
            outputs: list[Outputs] = []
            for piece in range(pieces):
                head = None
                if self.piecewise and piece:
                    head = self._graph_factory(self.pool)
                    outputs.append(head.capture(partial(self._head, bs, piece, state)))
                    self.pool = head.pool
                heads.append(head)
                graph = self._graph_factory(self.pool)
                outputs.append(graph.capture(self._work(bs, piece, state)))
                self.pool = graph.pool
                graphs.append(graph)
            # the outputs stay referenced: their memory is where every replay writes them
            self.graphs[bs], self.heads[bs], self.outputs[bs] = graphs, heads, outputs
            if self.piecewise:
                self._stage(bs, piece_execs(graphs, heads))
            for cut in Cut:
                graph = self._graph_factory(self.pool)
                graph.capture(partial(self._draw, bs, cut, self._logits(bs, bs)))
                self.pool = graph.pool
                self.draws[bs, cut] = graph
        if cuda:
            torch.cuda.synchronize(model.device)
        log.info(
            "captured decode CUDA graphs (%s) for batch sizes %s",
            f"{pieces} pieces per step" if self.piecewise else "whole steps",
            self.sizes,
        )

    @torch.inference_mode()
    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Replay the graphs of the smallest captured size that holds `rows` (at most max_bs);
        logits [n, vocab]."""
        n = len(rows)
        bs = next(s for s in self.sizes if s >= n)
        kv = self.model.kv
        self._runs += 1
        self._mirror ^= 1
        host_long_t, host_int_t = self._host_longs[self._mirror], self._host_ints[self._mirror]
        host_long = host_long_t.numpy()
        host_int = host_int_t.numpy()
        tables = host_int[: self.max_bs * self.max_blocks].reshape(self.max_bs, self.max_blocks)
        seq_lens = host_int[self.max_bs * self.max_blocks :][: self.max_bs]
        max_bs = self.max_bs
        drawn = any(row.draw is not GREEDY_ROW for row in rows)
        floats = self._host_floats[self._mirror]
        for i, row in enumerate(rows):
            pos = row.position
            host_long[1, i] = row.token
            host_long[2, i] = pos
            host_long[3, i] = kv.slot(row.blocks, pos)
            # index into [sampled | host tokens]
            host_long[4, i] = row.source if row.source >= 0 else max_bs + i
            host_long[7, i] = row.state_slot
            tables[i, : len(row.blocks)] = row.blocks
            seq_lens[i] = pos + 1
            if drawn:
                d = row.draw
                host_long[5, i], host_long[6, i] = d.seed, d.top_k
                floats[:, i] = d.device_floats()
        # padding rows: token 0 at position 0, KV into the scratch block, nothing to attend to
        # (and the top logit, where a row draws)
        host_long[1:, n:bs] = 0
        host_long[3, n:bs] = kv.pad_slot
        host_long[7, n:bs] = self._pad_state
        host_long[4, n:bs] = range(max_bs + n, max_bs + bs)
        if drawn:
            floats[:, n:bs] = _GREEDY_FLOATS
        seq_lens[n:bs] = 0
        self._send_inputs(host_long_t, host_int_t, bs)
        draw = self.draws[bs, max(r.draw.cut for r in rows)] if drawn else None
        self._replay(bs, n)
        if draw is not None:
            draw.replay()
        return self._logits(bs, n)

    def _replay(self, bs: int, n: int) -> None:
        """Replay the step's graphs of batch size `bs` (its first `n` rows real), staging the
        MoE layers between pieces."""
        graphs, heads = self.graphs[bs], self.heads[bs]
        staged = self.staged
        launched_stages = self.launched_stages.get(bs)
        if launched_stages is not None and staged.launches_pieces():
            self._run_launched(graphs[0], launched_stages, n, bs)
            return
        # only the real rows: padding rows would fetch and run experts for nothing
        staged_rows = staged.buffers.rows(n, 0) if staged is not None else None
        stages = self.stages.get(bs)
        for piece, graph in enumerate(graphs):
            t0 = time.perf_counter()
            head = heads[piece]
            if head is not None:  # the cached experts' routes, then the wait for the fills
                if not self.early:  # (an early head was launched after the piece before)
                    head.replay()
                staged.join_fills()
            if self.routing_signal is not None and piece < len(graphs) - 1:
                staged.expect_routing()  # its router sets the signal the stage waits for
            graph.replay()
            if self.early and piece < len(graphs) - 1:  # the next head, at this routing
                staged.refresh_cached_row(piece)
                heads[piece + 1].replay()
            launched = time.perf_counter()
            if self.piecewise and piece:  # the launch that ends a staged layer step
                staged.after_launch(launched - t0)
            if piece < len(graphs) - 1:
                assert stages is not None and staged_rows is not None
                assert self.slots_host is not None
                if piece + 2 == len(graphs):  # before the last piece, which writes the tokens
                    staged.run_host_work()  # the host's work may still read (`sampled_to_host`)
                staged.stage_decode(stages[piece], staged_rows, launched)
                if piece == 0:  # this step's first routing: the step before is finished
                    self._passed = self._runs - 1
                # padding rows run no experts (written after the stage's sync: an earlier
                # step's graphs may read these rows until then)
                if n < bs:
                    self.slots_host[n:bs] = -1

    def _run_launched(self, first: Graph, stages: list[LayerStage], n: int, bs: int) -> None:
        """The pieces of one step, each after the first launched by the stage before it, in the
        native call that waited for its routing (`LayerStage.launch`)."""
        staged = self.staged
        assert staged is not None
        last = len(stages)
        if self.routing_signal is not None:
            staged.expect_routing()
        first.replay()
        if self.early and len(self.heads[bs]) > 1:  # the first layer's head, at its routing
            staged.refresh_cached_row(0)
            self.heads[bs][1].replay()
        launched = time.perf_counter()
        # only the real rows: padding rows would fetch and run experts for nothing
        staged_rows = staged.buffers.rows(n, bs - n)
        for piece, stage in enumerate(stages):
            if piece + 1 == last:  # the host's work before the last piece, which writes the
                staged.run_host_work()  # tokens the work may still read (`sampled_to_host`)
            staged.stage_decode(stage, staged_rows, launched)
            launched = time.perf_counter()
            if piece == 0:  # this step's first routing: the step before is finished
                self._passed = self._runs - 1
            staged.after_launch()

    def _logits(self, bs: int, n: int) -> torch.Tensor:
        logits = self.outputs[bs][-1][3]
        assert logits is not None
        return logits[:n]

    def _send_inputs(self, host_long: torch.Tensor, host_int: torch.Tensor, bs: int) -> None:
        """Queue the copies of a step's inputs from a pair of host mirrors: rows 1-6 of the
        long block, the first bs rows of the block tables, the rest of the int32 block (the
        sequence lengths and the draws' floats)."""
        tables = self.max_bs * self.max_blocks
        if self._h2d is None:
            self._long[1:].copy_(host_long[1:])
            self._int[: bs * self.max_blocks].copy_(host_int[: bs * self.max_blocks])
            self._int[tables:].copy_(host_int[tables:])
            return
        row = self.max_bs * 8  # int64 rows of the long block
        self._h2d.copy(self._long.data_ptr() + row, host_long.data_ptr() + row,
                       (_LONG_ROWS - 1) * row)  # fmt: skip
        src, dst = host_int.data_ptr(), self._int.data_ptr()
        self._h2d.copy(dst, src, 4 * bs * self.max_blocks)
        self._h2d.copy(dst + 4 * tables, src + 4 * tables, 4 * _INT_TAIL * self.max_bs)

    def sampled_to_host(self, n: int, buffer: int) -> torch.Tensor:
        """The last replay's tokens of its first `n` rows in pinned host memory, valid once
        the step is done (`step_done`). Whole steps: a copy queued into host buffer 0 or 1.
        Pieces: the last piece stored them into one buffer itself (a copy queued after the
        launches costs the host more than the piece's store); the next step's tokens overwrite
        them only once its last piece runs, and the host reads them before it launches that piece
        (during the next step's staging, or after a wait for this one)."""
        if self._tokens_in_pieces:
            view = self._tokens_views.get(n)
            if view is None:
                view = self._tokens_views[n] = self._tokens_host[:n]
            return view
        host = self._host_sampled[buffer, :n]
        host.copy_(self.sampled[:n], non_blocking=True)
        return host

    def step_done(self) -> Callable[[], None] | None:
        """What waits until the step just run is finished on the device (None on the CPU, where
        it is). Whole steps: an event recorded after it. Pieces: nothing to record, as a later
        step's first routing, which its staging waits for, comes after it; the wait syncs the
        stream only where no such routing has arrived yet."""
        if not self._cuda:
            return None
        if self._tokens_in_pieces:
            return partial(self._wait_step, self._runs)
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def _wait_step(self, run: int) -> None:
        if self._passed < run:
            torch.cuda.current_stream(self.model.device).synchronize()
            self._passed = self._runs


def piece_execs(graphs: list, heads: list) -> list[tuple[int, int]] | None:
    """Each piece's (head, piece) graph execs (head 0 where a piece has none); None where a graph
    has no exec to hand out."""
    execs = []
    for graph, head in zip(graphs, heads, strict=True):
        handle = getattr(graph, "exec_handle", lambda: None)()
        head_handle = 0 if head is None else getattr(head, "exec_handle", lambda: None)()
        if handle is None or head_handle is None:
            return None
        execs.append((head_handle, handle))
    return execs
