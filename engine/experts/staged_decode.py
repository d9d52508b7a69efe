"""Offloaded decode between captured pieces: the host's part of each MoE layer step, the
device's part inside the next piece, the CPU's part handed over in pinned host memory.

A decode step with experts offloaded runs as CUDA graphs of the dense work between two MoE layers
(engine/runtime/graphs.py). Each piece stores its routing into pinned host buffers
(`StagedBuffers`); between two replays the host stages the layer (`StagedDecode.stage_decode`):
waits for that routing, plans the layer step, starts the CPU job, queues the fills on the copy
stream and writes each route's slot into a pinned table, marking the routes the fills serve. The
next piece comes in two graphs. The first, `routed_cached`, reads that table and runs the cached
experts' routes while the fills are still crossing PCIe; the host then orders the compute stream
after the fills (`join_fills`); the second begins with `routed_filled`: the filled experts' routes,
then `sum_when_ready`, which sums both, waits on the device for the CPU job's epoch and adds its
part (kernels/host_handoff.py), so the host never waits for the CPU (`routed_filled_normed`, for a
layer with no shared expert: the same sum added to the residual and normalized in the same launch).
What must not delay the next piece, counting and ending the CPU job before, waits until it is
launched (`after_launch`).

With native CPU experts, one native call (`DecodePlanner`, kernels/csrc/decode_planner.h) does the
whole serial host path of a layer step: wait, plan, start the CPU job, queue the copies. With
`prefetch_rounds`, a one-token piece also sends a guess of its layer's routing ahead of the
routing (kernels/route_guess.py): the wait plans the guessed step and the idle CPU workers fetch
the weights of their first blocks of its job, which are theirs in the real job where the plans
match.

`StagedDecode` works with the runner's parts, given to it: the planner (miss_plan.py), the fills
(cache.py), the miss split (misses.py) and the counters (moe_stats.py), which it feeds one call
per launch, after it. What the captured pieces fix of a layer step (its layer, the native launch
of the next piece, its signal, its guess) is a `LayerStage` made at capture; the buffers' views of
a step's rows, a `StagedRows` made once per batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ...kernels.host_handoff import (
    TIMED_OUT,
    filled_mark,
    route_slots_from_host,
    route_slots_from_map,
    routing_signal,
    sum_norm_when_ready,
    sum_when_ready,
)
from . import moe_kernels
from .cache import ExpertCache, SlotFills
from .miss_plan import Dispatch, Handoff, LayerPlanner, expert_mask
from .misses import MissSplit
from .moe_stats import DecodeStats, StagedStep

# What the host knows of the routing's signal (`StagedDecode.expect_routing`): clear, awaited
# (cleared, a signalling piece launched and not waited for yet), or neither (routers may have set
# it)
_CLEAR, _EXPECTED, _UNKNOWN = range(3)


@dataclass(frozen=True, slots=True)
class LayerStage:
    """A staged layer step as the captured pieces fix it: the MoE layer between piece moe_layer
    and the next, which the native call launches where `launch` holds the next piece's (head,
    piece) graph execs (None: Python launches it); signals: the next piece's router sets the
    routing's signal; guess: the piece before sends a guess of this layer's routing
    (`StagedDecode.guess_buffers`)."""

    moe_layer: int
    launch: tuple[int, int] | None = None
    signals: bool = False
    guess: bool = False


@dataclass(frozen=True, slots=True)
class StagedRows:
    """The staged buffers' views for a step's real rows (`StagedBuffers.rows`): the routing the
    piece's router stores (ids [T, K] int32, weights [T, K] and x [T, H] fp32), the table each
    route's slot goes to [T, K] int32 and the CPU's part [T, H] fp32; pad_rows: the padding rows
    of the captured batch after them, which a native launch marks as running no experts."""

    ids: torch.Tensor
    ids_np: np.ndarray
    weights: torch.Tensor
    x: torch.Tensor
    slots: torch.Tensor
    slots_np: np.ndarray
    cpu_out: torch.Tensor
    pad_rows: int


class StagedBuffers:
    """The host memory staged decode shares with the captured pieces (pinned with CUDA): the
    routing the pieces' routers store and its signal, the table of each route's slot, the CPU's
    part and its handoff, and the guess of the routing. Captured graphs keep their addresses:
    each is allocated once and then only handed out."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, handoff: Handoff, pin: bool):
        self.num_experts, self.top_k, self.hidden = num_experts, top_k, hidden
        self.handoff = handoff
        self.pin = pin
        self.routing_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.route_slots_host: torch.Tensor | None = None
        self.cpu_part: torch.Tensor | None = None
        self.signal: torch.Tensor | None = None  # set by a piece's router once its routing is in
        self.guess: tuple[torch.Tensor, torch.Tensor] | None = None  # logits [1, E], signal
        self._rows: dict[tuple[int, int], StagedRows] = {}

    def routing(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[rows, K] int32 ids, [rows, K] fp32 weights and [rows, H] fp32 x, which captured
        pieces' routers write (`Model._route`) and `stage_decode` reads."""
        if self.routing_host is None or self.routing_host[0].shape[0] < rows:
            pin = self.pin
            self.routing_host = (
                torch.zeros((rows, self.top_k), dtype=torch.int32, pin_memory=pin),
                torch.zeros((rows, self.top_k), dtype=torch.float32, pin_memory=pin),
                torch.zeros((rows, self.hidden), dtype=torch.float32, pin_memory=pin),
            )
            self._rows.clear()
        ids_h, w_h, x_h = self.routing_host
        return ids_h[:rows], w_h[:rows], x_h[:rows]

    def route_slots(self, rows: int) -> torch.Tensor:
        """The table [rows, K] int32 into which `stage_decode` writes each route's slot
        (`filled_mark` for a route its fills serve) and which `routed_cached` reads."""
        table = self.route_slots_host
        if table is None or table.shape[0] < rows:
            table = self.route_slots_host = torch.full(
                (rows, self.top_k), -1, dtype=torch.int32, pin_memory=self.pin
            )
            self._rows.clear()
        return table[:rows]

    def cpu_out(self, rows: int) -> torch.Tensor:
        """The buffer [rows, H] fp32 into which staged decode's CPU jobs write their part, and
        from which the next piece's `routed_filled` adds it."""
        out = self.cpu_part
        if out is None or out.shape[0] < rows:
            out = self.cpu_part = torch.zeros((rows, self.hidden), dtype=torch.float32,
                                              pin_memory=self.pin)  # fmt: skip
            self._rows.clear()
        return out[:rows]

    def rows(self, rows: int, pad_rows: int) -> StagedRows:
        """The views of a step of `rows` real rows and `pad_rows` padding ones, made once."""
        views = self._rows.get((rows, pad_rows))
        if views is None:
            ids, weights, x = self.routing(rows)
            slots, cpu_out = self.route_slots(rows), self.cpu_out(rows)
            views = StagedRows(ids, ids.numpy(), weights, x, slots, slots.numpy(), cpu_out,
                               pad_rows)  # fmt: skip
            self._rows[rows, pad_rows] = views
        return views

    def routing_signal(self) -> torch.Tensor:
        """The routing's signal, which captured pieces' routers set once their routing is in
        the routing buffers (`Model._route`); made on first use."""
        if self.signal is None:
            self.signal = routing_signal(pin=self.pin)
        return self.signal

    def guesses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a one-token piece sends its guess of its layer's routing (`Model.run_piece`,
        kernels/route_guess.py): fp32 logits [1, E] and their signal; made on first use."""
        if self.guess is None:
            logits = torch.zeros((1, self.num_experts), dtype=torch.float32, pin_memory=self.pin)
            self.guess = (logits, routing_signal(pin=self.pin))
        return self.guess

    def clear_signals(self) -> None:
        """Clear the routing's signal and the guess's (set before it, by the same pieces)."""
        self.routing_signal().numpy()[0] = 0
        self.clear_guess()

    def clear_guess(self) -> None:
        if self.guess is not None:
            self.guess[1].numpy()[0] = 0


class StagedDecode:
    """The host's part of offloaded decode layer steps between captured pieces, and the device's
    parts the pieces capture (`routed_cached`, `routed_filled`).

    It keeps what the host knows of the routing's signal (`expect_routing`), whether the staged
    layer's fills are still to be joined, the staged steps not yet counted and the CPU job not
    yet ended, and the host's work deferred to the next wait (`defer_host_work`)."""

    def __init__(
        self,
        buffers: StagedBuffers,
        cache: ExpertCache,
        planner: LayerPlanner,
        fills: SlotFills,
        split: MissSplit,
        stats: DecodeStats,
        *,
        early_cached: bool = False,
    ) -> None:
        self.buffers = buffers
        self.cache = cache
        self.planner = planner
        self.fills = fills
        self.split = split
        self.stats = stats
        self.compute_stream = fills.compute_stream  # the engine's, which the fills follow
        self._sync = buffers.handoff.sync
        self._signal_state = _UNKNOWN
        self._fills_queued = False  # the staged layer's fills, on the copy stream, not joined
        self._host_work: Callable[[], None] | None = None  # defer_host_work's, not run yet
        # staged layer steps launched but not yet counted (counted after the next launch), and
        # the records of counted ones, which the next steps reuse
        self._uncounted: list[StagedStep] = []
        self._spare: list[StagedStep] = []
        self._pending: Dispatch | None = None  # the staged layer whose CPU job is not ended
        # --moe-early-cached: each layer's cached routes run at its routing (`routed_cached_early`),
        # their slots read from this copy of the cache's slot map [layers, experts] (pinned with
        # CUDA), whose row a layer's head reads refreshed just before the head is launched
        # (`refresh_cached_row`, or the native planner's launch of it)
        self.early_cached = early_cached
        self.cached_map: torch.Tensor | None = None
        self._cached_map_np: np.ndarray | None = None
        if early_cached:
            self.cached_map = torch.full(cache.slot_of.shape, -1, dtype=torch.int32,
                                         pin_memory=buffers.pin)  # fmt: skip
            self._cached_map_np = self.cached_map.numpy()
            planner.cached_map = self.cached_map

    # the routing's signal and its guess -------------------------------------------------------

    def routing_signal(self) -> torch.Tensor:
        """The routing's signal (`StagedBuffers.routing_signal`), which `stage_decode` waits for
        after `expect_routing`. Whoever takes it may run its routers outside a staged step (a
        capture's warm-ups), so its state is unknown from then on until the next
        `expect_routing` clears it."""
        self._signal_state = _UNKNOWN
        return self.buffers.routing_signal()

    def expect_routing(self) -> None:
        """Just before launching a piece whose router sets the routing's signal: have the next
        `stage_decode` wait for that signal rather than for the stream to go idle. The signal
        is clear after each wait for it (the native planner clears it on seeing it); where it is
        not known to be, the device is finished first (a piece whose routing was never waited
        for, an error having come between, or routers run outside a staged step), so that no
        late signal can pass for this piece's, and it is cleared here."""
        if self._signal_state != _CLEAR:
            self._settle_signal()
        self._signal_state = _EXPECTED

    def _settle_signal(self) -> None:
        """Finish the device's work, then clear the routing's signal: no late store can set it."""
        if self.compute_stream is not None:
            self.compute_stream.synchronize()
        self.buffers.clear_signals()
        self._signal_state = _CLEAR

    def guess_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The guess buffers (`StagedBuffers.guesses`) where a guess is wanted: prefetch rounds or
        copies ahead, and a native planner waiting on signals with its copies; else None."""
        planner = self.planner
        if not planner.uses_guesses() or not planner.copies or planner.native() is None:
            return None
        return self.buffers.guesses()

    def set_prefetch_rounds(self, rounds: int) -> None:
        """Change the rounds of blocks the wait has the workers fetch from the guesses, between
        runs (`bench decode --alternate-prefetch-rounds`): pieces captured with guesses keep
        sending them, and with 0 the wait ignores them. More than 0 needs pieces that send
        guesses (captured with `guess_buffers`). The device must be idle: the guess's signal is
        cleared, so that no guess of a step the wait ignored passes for the next one's."""
        if rounds > 0 and self.buffers.guess is None:
            raise ValueError("no routing guesses are sent: the pieces were captured without them")
        self.planner.prefetch_rounds = rounds
        self.buffers.clear_guess()

    def set_copy_ahead(self, share: float) -> None:
        """Change the share of a guess's lead the copy ahead takes, between runs (`bench decode
        --alternate-copy-ahead`); more than 0 needs pieces that send guesses. The device must be
        idle, as for `set_prefetch_rounds`."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"copy_ahead must be in [0, 1], got {share}")
        if share > 0 and self.buffers.guess is None:
            raise ValueError("no routing guesses are sent: the pieces were captured without them")
        self.planner.set_copy_ahead(share)
        self.buffers.clear_guess()

    # the staged layer step ---------------------------------------------------------------------

    def launches_pieces(self) -> bool:
        """Whether `stage_decode` can launch the next piece itself (the native planner, with its
        copies and launches)."""
        planner = self.planner
        return planner.copies and planner.launches and planner.native() is not None

    def stage_decode(
        self, stage: LayerStage, rows: StagedRows, launched: float | None = None
    ) -> None:
        """An offloaded decode layer step between two captured pieces: the host part now, the
        device part (`routed_cached`, `join_fills`, `routed_filled`) in the next piece's graphs.

        Waits for the layer's routing in `rows` (for its signal after `expect_routing`, else for
        the compute stream to go idle), plans the step, starts its CPU job (its part into
        rows.cpu_out, which the next piece waits for on the device), queues the fills and writes
        each route's slot into rows.slots (`filled_mark(slot)` for a route the fills serve, -1
        on the CPU), and launches the next piece where the stage says (`LayerStage`);
        `after_launch` counts the step once the next piece is launched. launched: the host's
        clock when the piece before was launched (`StagedStepTimes`)."""
        step = self._spare.pop() if self._spare else StagedStep()
        step.started, step.moe_layer, step.launched = time.perf_counter(), stage.moe_layer, launched
        native = self.planner.native()
        if native is not None and self.planner.copies:
            self._stage_natively(native, stage, rows, step)
        else:
            self._stage_in_python(stage, rows, step)
        self._uncounted.append(step)

    def _stage_natively(
        self, native: object, stage: LayerStage, rows: StagedRows, step: StagedStep
    ) -> None:
        """The serial host path in one native call, with nothing in Python between the routing's
        arrival and the CPU job's start: wait, plan, start the CPU job, queue the fills, hand
        over to the next piece and, where the stage says, launch it."""
        if stage.signals and self._signal_state == _UNKNOWN:
            self._settle_signal()  # the launched piece's signal must be the only one to come
        buffers, planner = self.buffers, self.planner
        awaited = self._signal_state == _EXPECTED  # the wait takes the signal and clears it
        # with 0 rounds and no copies ahead (set between runs) the guesses the pieces still send
        # are ignored
        guessed = stage.guess and awaited and planner.uses_guesses()
        d, (_, plan_s, fill_s, replay_s) = planner.native_step(
            native, stage.moe_layer, rows.ids, rows.weights, rows.x, rows.cpu_out, True,
            sync=True, copies=True, route_slots=rows.slots,
            signal=buffers.signal if awaited else None, expected=True, launch=stage.launch,
            pad_rows=rows.pad_rows, guess=buffers.guess if guessed else None,
        )  # fmt: skip
        step.arrived = time.perf_counter() - plan_s - fill_s - replay_s
        step.d, step.plan_s, step.fill_s, step.replay_s = d, plan_s, fill_s, replay_s
        if awaited:
            self._signal_state = _CLEAR
        if stage.launch is None:
            self._fills_queued = bool(d.admitted) or d.split is not None
        elif stage.signals:  # the next piece, launched after the fills (joined natively)
            self._signal_state = _EXPECTED

    def _stage_in_python(self, stage: LayerStage, rows: StagedRows, step: StagedStep) -> None:
        """Wait for the compute stream, plan and start the CPU job, queue the fills, write the
        routes' slots and hand over to the next piece."""
        if stage.launch is not None:
            raise ValueError("only the native planner with its copies launches pieces")
        clock = time.perf_counter
        if self.compute_stream is not None:
            self.compute_stream.synchronize()
        arrived = clock()
        # the CPU job and the fills as early as possible, the CPU job first: it takes as long as
        # the fills (the split balances them) and costs the host more to start
        d = self.planner.plan_and_start(stage.moe_layer, rows.ids_np, rows.weights, rows.x, True,
                                        rows.cpu_out)  # fmt: skip
        planned = clock()
        self.fills.queue(stage.moe_layer, d.admitted)
        slots = d.route_slots
        filled = expert_mask(self.cache.num_experts, [e for e, _ in d.admitted])[rows.ids_np]
        rows.slots_np[...] = np.where(filled, filled_mark(slots), slots)
        step.d, step.arrived, step.plan_s = d, arrived, planned - arrived
        step.fill_s, step.replay_s = clock() - planned, 0.0
        if d.job is None:  # nothing on the CPU: its part is zero, and ready now
            rows.cpu_out.zero_()
        self.buffers.handoff.expect(ready=d.job is None)  # the native call hands over itself
        if self._signal_state == _EXPECTED:  # waited for by the sync
            self.buffers.clear_signals()
            self._signal_state = _CLEAR
        self._fills_queued = bool(d.admitted) or d.split is not None

    def join_fills(self) -> None:
        """Between the next piece's two graphs: order the compute stream after the staged layer's
        fills (the cached experts' routes, launched before this, run during them)."""
        fills = self.fills
        if self._fills_queued and fills.copy_stream is not None:
            fills.compute_stream.wait_stream(fills.copy_stream)
        self._fills_queued = False

    def after_launch(self, replay_s: float = 0.0) -> None:
        """The host's work of the staged layer steps that must not delay the next piece: after
        it is launched (in replay_s, where Python launched it), end the CPU job of the layer
        before the last staged one (the device waited for it before making the last routing;
        fails if it gave up waiting), and count the staged steps; then the deferred host work."""
        started = time.perf_counter()
        staged, split = self._uncounted, self.split
        if split.policy.mode == "auto":  # its controller follows the CPU's use
            for step in staged:
                if step.d.missing:
                    split.note_cpu_use(bool(step.d.on_cpu))
        try:
            self.end_handoff()
            if staged and staged[-1].d.job is not None:
                self._pending = staged[-1].d
        finally:  # counted once, whether or not the device gave up waiting
            self.stats.staged_steps(staged, replay_s, started)
            self._spare += staged
            staged.clear()
        self.run_host_work()

    def end_handoff(self) -> None:
        """After a sync: count the last staged CPU job (ended: the device waited for it), and
        fail if the device gave up waiting for one."""
        state = self.buffers.handoff.state
        if state[TIMED_OUT]:
            state[TIMED_OUT] = 0
            self._pending = None  # its job is waited for as it is dropped: no late write of DONE
            raise RuntimeError(
                "offloaded decode: the GPU gave up waiting for the CPU experts of a layer "
                "(their job did not end within seconds); the step's output is wrong and was "
                "dropped"
            )
        d, self._pending = self._pending, None
        if d is not None:
            self.planner.end_job(d, decode=True)

    def defer_host_work(self, work: Callable[[], None]) -> None:
        """Run `work` once, in the host's next wait of a staged decode step: after a staged
        layer's piece is launched and the steps before counted, before the wait for the next
        layer's routing (the device then has that layer's work queued); or at `run_host_work`,
        where no staged step comes first."""
        self._host_work = work

    def run_host_work(self) -> None:
        """Run the deferred host work now, if it has not run."""
        work, self._host_work = self._host_work, None
        if work is not None:
            work()

    # the device's parts, captured in the next piece's graphs -----------------------------------

    def routed_cached(
        self, x: torch.Tensor, slots_h: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first device part of a staged decode layer step (capturable), before its fills
        are done: the route slots table slots_h read from the host, the cached experts' routes
        run. Returns their per-route outputs [T, K, H] and the filled routes' slots [T, K]."""
        cached = torch.empty(slots_h.shape, dtype=torch.int32, device=x.device)
        filled = torch.empty_like(cached)
        route_slots_from_host(slots_h, cached, filled)
        cache = self.cache
        out = moe_kernels.decode(x, cached, weights, cache.w13, cache.w2, reduce=False,
                                 **cache.kernel_args())  # fmt: skip
        return out, filled

    def refresh_cached_row(self, moe_layer: int) -> None:
        """Copy the cache's slot map of `moe_layer` into the row its early head reads: just
        before that head is launched, after the last plan that changed it (the layer step
        before's). Until the head has read it no plan changes a slot the head may read: the
        layer's own plan comes after its routing, which the head follows, and fills, splits and
        copies ahead evict no slot of an expert the head may run (the plan protects the routed
        ones; the copy ahead takes no slot of its own layer, DecodePlanner::copy_ahead)."""
        assert self._cached_map_np is not None, "not staged with --moe-early-cached on"
        self._cached_map_np[moe_layer] = self.cache.slot_of[moe_layer]

    def routed_cached_early(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        moe_layer: int,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """`routed_cached` at the routing (capturable; --moe-early-cached): each route's slot
        looked up on the device in `moe_layer`'s row of the slot map's copy (rows whose length
        is 0, a captured batch's padding, run none), without the host's route slots table;
        returns the cached routes' per-route outputs [T, K, H] (the filled routes' slots come
        from the table in the piece, `filled_routes`)."""
        assert self.cached_map is not None, "not staged with --moe-early-cached on"
        cached = torch.empty(ids.shape, dtype=torch.int32, device=x.device)
        route_slots_from_map(ids, self.cached_map[moe_layer], seq_lens, cached)
        cache = self.cache
        out = moe_kernels.decode(x, cached, weights, cache.w13, cache.w2, reduce=False,
                                 **cache.kernel_args())  # fmt: skip
        return out, None

    def filled_routes(self, slots_h: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The filled routes' slots [T, K] from the host's route slots table (capturable): with
        --moe-early-cached the piece reads them itself, its head having run the cached ones."""
        cached = torch.empty(slots_h.shape, dtype=torch.int32, device=device)
        filled = torch.empty_like(cached)
        route_slots_from_host(slots_h, cached, filled)
        return filled

    def routed_filled(
        self,
        x: torch.Tensor,
        filled: torch.Tensor,
        weights: torch.Tensor,
        cached_part: torch.Tensor,
        cpu_part: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The second device part (capturable), once the fills are done: the filled experts'
        routes, summed with the cached ones' (cached_part) and the CPU's part (cpu_part, host
        memory) once the CPU job has ended, in `dtype` [T, H]."""
        parts = [cached_part, self._filled_part(x, filled, weights)]
        return sum_when_ready(parts, cpu_part, self._sync, dtype)

    def routed_filled_normed(
        self,
        x: torch.Tensor,
        filled: torch.Tensor,
        weights: torch.Tensor,
        cached_part: torch.Tensor,
        cpu_part: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`routed_filled` for a layer with nothing to add to its routed output: the sum goes
        straight into the residual add and the RMSNorm after the layer (norm_weight), in the same
        launch; returns (the norm's output, the new residual)."""
        parts = [cached_part, self._filled_part(x, filled, weights)]
        return sum_norm_when_ready(parts, cpu_part, self._sync, residual, norm_weight, eps)

    def _filled_part(
        self, x: torch.Tensor, filled: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The filled experts' routes [T, K, H] (one or two experts, mostly: their rows spread
        over the device, few_routes)."""
        cache = self.cache
        return moe_kernels.decode(x, filled, weights, cache.w13, cache.w2, reduce=False,
                                  few_routes=True, **cache.kernel_args())  # fmt: skip
