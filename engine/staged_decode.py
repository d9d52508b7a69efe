"""Offloaded decode between captured pieces: the host's part of each MoE layer step, the
device's part inside the next piece, the CPU's part handed over in pinned host memory.

A decode step with experts offloaded runs as CUDA graphs of the dense work between two MoE layers
(engine/graphs.py). Each piece stores its routing into pinned host buffers (`routing_buffers`);
between two replays the host stages the layer (`stage_decode`): waits for that routing, plans the
layer step, starts the CPU job, queues the fills on the copy stream and writes each route's slot
into a pinned table (`route_slots_buffer`), marking the routes the fills serve. The next piece
comes in two graphs. The first, `routed_cached`, reads that table and runs the cached experts'
routes while the fills are still crossing PCIe; the host then orders the compute stream after the
fills (`join_fills`); the second begins with `routed_filled`: the filled experts' routes, then
`sum_when_ready`, which sums both, waits on the device for the CPU job's epoch and adds its part
(kernels/host_handoff.py), so the host never waits for the CPU (`routed_filled_normed`, for a layer
with no shared expert: the same sum added to the residual and normalized in the same launch). What
must not delay the next piece, counting and ending the CPU job before, waits until it is launched
(`after_launch`).

With native CPU experts, one native call (`DecodePlanner`, kernels/csrc/decode_planner.h) does the
whole serial host path of a layer step: wait, plan, start the CPU job, queue the copies. With
`prefetch_rounds`, a one-token piece also sends a guess of its layer's routing ahead of the
routing (kernels/route_guess.py): the wait plans the guessed step and the idle CPU workers fetch
the weights of their first blocks of its job, which are theirs in the real job where the plans
match.

`StagedDecode` is mixed into `MoERunner` (moe.py) and shares its state: the bank and the cache,
the miss policy, the CPU executor, the compute stream, the counters and timers, and its planning
(`_plan_and_start`, `_count`), fills (`_fill_slots`) and CPU jobs (`_wait_cpu`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ..kernels.cpu_experts import CpuExpertJob
from ..kernels.fused_moe import fused_moe_decode
from ..kernels.host_handoff import (
    DONE,
    EXPECTED,
    TIMED_OUT,
    filled_mark,
    handoff_sync,
    route_slots_from_host,
    routing_signal,
    sum_norm_when_ready,
    sum_when_ready,
)
from .h2d import DriverEvent, driver_functions, launch_functions
from .miss_plan import Dispatch, expert_mask
from .misses import SPLIT_CHUNKS


class StagedDecode:
    """The staged decode layer step and the native planner, for `MoERunner`."""

    def _init_staged(self, cuda: bool) -> None:
        """The staged decode's own state; `MoERunner.__init__` calls this."""
        # staged decode hands the CPU's part to the next piece in host memory (host_handoff.py)
        self._handoff_sync = handoff_sync(pin=cuda)
        self._handoff_out: torch.Tensor | None = None
        self._routing_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._route_slots_host: torch.Tensor | None = None
        # set by a piece's router once its routing is in the host's buffers (`expect_routing`),
        # and whether it is known clear (CLEAR), awaited (EXPECTED: cleared, a signalling piece
        # launched and not waited for yet) or neither (UNKNOWN: routers may have set it)
        self._routing_signal: torch.Tensor | None = None
        self._signal_state = _UNKNOWN
        self._fills_queued = False  # the staged layer's fills, on the copy stream, not joined
        self._host_work: Callable[[], None] | None = None  # defer_host_work's, not run yet
        # staged layer steps launched but not yet counted (counted after the next launch)
        self._uncounted: list[tuple[Dispatch, int]] = []
        self._epoch = 0  # of the last CPU part handed over (the value DONE reaches)
        self._pending: Dispatch | None = None  # the staged layer whose CPU job is not ended
        # the last staged layer step: (MoE layer, host time its routing arrived, its plan's key)
        self._last_arrival: tuple[int, float, str] | None = None
        # the native planner of decode layer steps (None: the Python `_plan`), rebuilt when the
        # cache replaces its arrays
        self._planner: object | None = None
        self._planner_version = -1
        # the native planner also waits for the routing and queues the copies itself, through
        # the driver functions of `h2d.driver_functions` (with CUDA; a CPU test may stand in
        # functions that copy host memory)
        self.planner_copies = cuda
        # with its copies, it may split one miss per layer step between the copy and the CPU
        # (the engine's default; --no-split-misses turns it off)
        self.split_misses = False
        # with its copies, it may also launch the next captured piece (`stage_decode`'s launch),
        # through the driver functions of `h2d.launch_functions` (with CUDA; a CPU test may stand
        # in functions that run stand-in graphs); joining the fills on an event of its own
        self.planner_launches = cuda
        self._join_event: DriverEvent | None = None
        # rounds of a CPU job's gate/up blocks its workers fetch while they wait for it, from a
        # guess of the routing (0: no guesses; --moe-cpu-prefetch-rounds), and the guess's host
        # buffers: the logits [1, E] and their signal
        self.prefetch_rounds = 0
        self._guess_host: tuple[torch.Tensor, torch.Tensor] | None = None
        # where a guess came, the share of its lead over the routing in which the device's first
        # miss of the guessed step starts copying (0: none; --moe-copy-ahead), and the copies'
        # rate that sizes it (bytes/s: the engine's measured Bp)
        self.copy_ahead = 0.0
        self.copy_rate = 0.0

    def routing_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host buffers (pinned on CUDA) for a staged decode step's routing, [rows, K] int32 ids,
        [rows, K] fp32 weights and [rows, H] fp32 x, which captured pieces' routers write
        (`Model._route`) and `stage_decode` reads. Allocated once: graphs keep their addresses."""
        if self._routing_host is None or self._routing_host[0].shape[0] < rows:
            pin = self.device.type == "cuda"
            hidden = self.bank.w13[0].shape[-1]
            self._routing_host = (
                torch.zeros((rows, self.top_k), dtype=torch.int32, pin_memory=pin),
                torch.zeros((rows, self.top_k), dtype=torch.float32, pin_memory=pin),
                torch.zeros((rows, hidden), dtype=torch.float32, pin_memory=pin),
            )
        ids_h, w_h, x_h = self._routing_host
        return ids_h[:rows], w_h[:rows], x_h[:rows]

    def routing_signal_buffer(self) -> torch.Tensor:
        """The routing's signal in host memory (pinned on CUDA), which captured pieces' routers
        set once their routing is in `routing_buffers` (`Model._route`) and `stage_decode` waits
        for after `expect_routing`. Captured graphs write it, so it is allocated once; whoever
        takes it may run its routers outside a staged step (a capture's warm-ups), so its state
        is unknown from then on until the next `expect_routing` clears it."""
        self._signal_state = _UNKNOWN
        return self._signal()

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
        if self.device.type == "cuda":
            self.compute_stream.synchronize()
        self._clear_signal()
        self._signal_state = _CLEAR

    def _signal(self) -> torch.Tensor:
        """The routing's signal, made on first use; its state is left to the caller."""
        if self._routing_signal is None:
            self._routing_signal = routing_signal(pin=self.device.type == "cuda")
        return self._routing_signal

    def _clear_signal(self) -> None:
        self._signal().numpy()[0] = 0
        if self._guess_host is not None:  # set before the routing's, by the same pieces
            self._guess_host[1].numpy()[0] = 0

    def guess_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a one-token piece sends its guess of its layer's routing (`Model.run_piece`,
        kernels/route_guess.py): fp32 logits [1, E] and their signal, in host memory (pinned on
        CUDA); None where no guess is wanted (no prefetch rounds and no copies ahead, or no
        native planner waiting on signals with its copies). Captured graphs write them, so they
        are allocated once."""
        if not self._uses_guesses() or not self.planner_copies or self._decode_planner() is None:
            return None
        if self._guess_host is None:
            pin = self.device.type == "cuda"
            logits = torch.zeros((1, self.bank.num_experts), dtype=torch.float32, pin_memory=pin)
            self._guess_host = (logits, routing_signal(pin=pin))
        return self._guess_host

    def _uses_guesses(self) -> bool:
        """Whether the waits plan the guesses: for the workers' prefetch or the copies ahead."""
        return self.prefetch_rounds > 0 or self.copy_ahead > 0

    def set_prefetch_rounds(self, rounds: int) -> None:
        """Change the rounds of blocks the wait has the workers fetch from the guesses, between
        runs (`bench decode --alternate-prefetch-rounds`): pieces captured with guesses keep
        sending them, and with 0 the wait ignores them. More than 0 needs pieces that send
        guesses (captured with `guess_buffers`). The device must be idle: the guess's signal is
        cleared, so that no guess of a step the wait ignored passes for the next one's."""
        if rounds > 0 and self._guess_host is None:
            raise ValueError("no routing guesses are sent: the pieces were captured without them")
        self.prefetch_rounds = rounds
        if self._guess_host is not None:
            self._guess_host[1].numpy()[0] = 0

    def set_copy_ahead(self, share: float) -> None:
        """Change the share of a guess's lead the copy ahead takes (`copy_ahead`), between runs
        (`bench decode --alternate-copy-ahead`); more than 0 needs pieces that send guesses. The
        device must be idle, as for `set_prefetch_rounds`."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"copy_ahead must be in [0, 1], got {share}")
        if share > 0 and self._guess_host is None:
            raise ValueError("no routing guesses are sent: the pieces were captured without them")
        self.copy_ahead = share
        if self._planner is not None and self.planner_copies:
            self._planner.set_copy_ahead(share, self.copy_rate)
        if self._guess_host is not None:
            self._guess_host[1].numpy()[0] = 0

    def guess_lead_seconds(self) -> float:
        """The guesses' usual lead over the routing, as the native planner measures it (a
        running mean; 0 before a guess came, or without the native planner)."""
        planner = self._planner
        return planner.guess_lead_seconds() if planner is not None else 0.0

    def route_slots_buffer(self, rows: int) -> torch.Tensor:
        """The host table [rows, K] int32 (pinned on CUDA) into which `stage_decode` writes each
        route's slot (`filled_mark` for a route its fills serve) and which `routed_cached`
        reads. Captured graphs read it, so it is allocated once."""
        table = self._route_slots_host
        if table is None or table.shape[0] < rows:
            table = self._route_slots_host = torch.full(
                (rows, self.top_k), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda"
            )
        return table[:rows]

    def handoff_buffer(self, rows: int) -> torch.Tensor:
        """The host buffer [rows, H] fp32 (pinned on CUDA) into which staged decode's CPU jobs
        write their part, and from which the next piece's `routed` adds it. Captured graphs read
        it, so it is allocated once and then only handed out again."""
        hidden = self.bank.w13[0].shape[-1]
        out = self._handoff_out
        if out is None or out.shape[0] < rows:
            pin = self.device.type == "cuda"
            out = self._handoff_out = torch.zeros((rows, hidden), dtype=torch.float32,
                                                  pin_memory=pin)  # fmt: skip
        return out[:rows]

    def stage_decode(
        self,
        moe_layer: int,
        ids_h: torch.Tensor,
        w_h: torch.Tensor,
        x_h: torch.Tensor,
        slots_h: torch.Tensor,
        cpu_out: torch.Tensor,
        launched: float | None = None,
        launch: tuple[int, int] | None = None,
        pad_rows: int = 0,
        signals: bool = False,
        guess: bool = False,
    ) -> None:
        """An offloaded decode layer step between two captured pieces: the host part now, the
        device part (`routed_cached`, `join_fills`, `routed_filled`) in the next piece's graphs.

        ids_h, w_h, x_h: the layer's routing in host buffers (`routing_buffers` views of the real
        rows), which the piece just launched stores there (its router); this waits for it: for
        the routing's signal after `expect_routing`, else for the compute stream to go idle.
        Writes each route's slot into slots_h [T, K] (a `route_slots_buffer` view): a cached
        expert's slot, `filled_mark(slot)` for a route this step's fills serve (queued on the copy
        stream), -1 for a route on the CPU. The CPU routes' weighted sum goes into cpu_out [T, H]
        (a `handoff_buffer` view) when the CPU job ends; the host does not wait for it: the next
        piece does, on the device. Only what the next piece needs is done here; `after_launch`
        does the rest once it is launched. launched: the host's clock (`time.perf_counter`) when
        the piece was launched, which splits the time between two decode steps (`StagedStepTimes`).

        launch (where `launches_pieces`): the next piece's two graph execs (its head, then the
        piece), which the native call launches itself, the piece after the fills (the head before
        them where the copies are the shorter side: it runs only cached experts' routes), so
        that no Python runs between the routing's arrival and the next piece; the
        pad_rows rows of slots_h's buffer after the real ones are set to -1 first (a captured
        batch's padding rows run no experts). signals: the launched piece's router sets the
        routing's signal (`expect_routing` is then done). guess: the piece just launched sends a
        guess of this layer's routing ahead of it (`guess_buffers`), which the native wait on the
        routing's signal plans for the CPU workers to fetch their first blocks.
        """
        clock = time.perf_counter
        t0 = clock()
        if launch is not None and signals and self._signal_state not in (_CLEAR, _EXPECTED):
            self._settle_signal()  # the launched piece's signal must be the only one to come
        planner = self._decode_planner()
        signal = None  # the routing's, where the native planner waits for it (and clears it)
        if planner is not None and self.planner_copies:
            # the serial path in one native call, with nothing in Python between the routing's
            # arrival and the CPU job's start: wait, plan, start the CPU job, queue the fills
            signal = self._routing_signal if self._signal_state == _EXPECTED else None
            # with 0 rounds and no copies ahead (set between runs) the guesses the pieces still
            # send are ignored
            guessed = guess and self._uses_guesses() and signal is not None
            d, (_, plan_s, fill_s, launch_s) = self._native_step(
                planner, moe_layer, ids_h, w_h, x_h, cpu_out, True, sync=True, copies=True,
                route_slots=slots_h, signal=signal, expected=True, launch=launch,
                pad_rows=pad_rows, guess=self._guess_host if guessed else None,
            )  # fmt: skip
            t4 = clock()
            sync_s = t4 - t0 - plan_s - fill_s - launch_s  # the wait, and the call
            arrived = t4 - plan_s - fill_s - launch_s
            self.staged_times.replay_s += launch_s
        else:
            if launch is not None:
                raise ValueError("only the native planner with its copies launches pieces")
            if self.device.type == "cuda":
                self.compute_stream.synchronize()
            t1 = clock()
            # the CPU job and the fills as early as possible, the CPU job first: it takes as long
            # as the fills (the split balances them) and costs the host more to start
            d = self._plan_and_start(
                moe_layer, ids_h.numpy(), w_h, x_h, decode=True, handoff_out=cpu_out
            )
            t3 = clock()
            self._fill_slots(moe_layer, d.admitted, self._h2d_copy)
            slots = d.route_slots
            filled = expert_mask(self.bank.num_experts, [e for e, _ in d.admitted])[ids_h.numpy()]
            slots_h.numpy()[...] = np.where(filled, filled_mark(slots), slots)
            t4 = clock()
            sync_s, plan_s, fill_s = t1 - t0, t3 - t1, t4 - t3
            arrived = t1
        if self._signal_state == _EXPECTED:  # waited for: cleared by the planner, or synced
            if signal is None:
                self._clear_signal()
            self._signal_state = _CLEAR
        if launch is not None:  # the next piece, launched after the fills (joined natively)
            self._signal_state = _EXPECTED if signals else self._signal_state
        else:
            self._fills_queued = bool(d.admitted) or d.split is not None
        if planner is None or not self.planner_copies:  # else handed over by the native call
            state = self._handoff_sync.numpy()
            if d.job is None:  # nothing on the CPU: its part is zero, and ready now
                cpu_out.zero_()
                self._epoch += 1
                state[DONE] = self._epoch
            state[EXPECTED] = self._epoch  # read by the next piece's sum_when_ready
        self._uncounted.append((d, moe_layer))
        times = self.staged_times
        times.layer_steps += 1
        times.cpu_jobs += d.job is not None
        times.guesses += d.guessed
        times.prefetched_jobs += d.owned_blocks > 0
        times.copied_ahead += d.ahead_rows > 0
        times.ahead_missed += d.ahead_missed
        times.guess_plans += d.guess_s > 0
        times.guess_s += d.guess_s
        times.guess_late += d.guess_late
        times.sync_s += sync_s
        times.plan_s += plan_s
        times.fill_s += fill_s
        # the last layer step's period ends as this one's routing arrives (within one token)
        last, self._last_arrival = self._last_arrival, (moe_layer, arrived, _plan_key(d))
        if last is not None and last[0] == moe_layer - 1:
            times.add_period(last[2], arrived - last[1])
        elif last is not None and moe_layer == 0:  # the previous step's last layer
            times.boundaries += 1
            times.boundary_s += arrived - last[1]
            if launched is not None:
                times.boundary_host_s += launched - last[1]

    def launches_pieces(self) -> bool:
        """Whether `stage_decode` can launch the next piece itself (the native planner, with its
        copies and launches)."""
        return self.planner_copies and self.planner_launches and self._decode_planner() is not None

    def join_fills(self) -> None:
        """Between the next piece's two graphs: order the compute stream after the staged layer's
        fills (the cached experts' routes, launched before this, run during them)."""
        if self._fills_queued and self.copy_stream is not None:
            self.compute_stream.wait_stream(self.copy_stream)
        self._fills_queued = False

    def after_launch(self) -> None:
        """The host's work of the staged layer steps that must not delay the next piece: after
        it is launched, end the CPU job of the layer before the last staged one (the device
        waited for it before making the last routing; fails if it gave up waiting), and count
        the staged steps."""
        t0 = time.perf_counter()
        staged, self._uncounted = self._uncounted, []
        for d, moe_layer in staged:
            self._count(d, moe_layer)
        self._end_handoff()
        if staged and staged[-1][0].job is not None:
            self._pending = staged[-1][0]
        self.staged_times.count_s += time.perf_counter() - t0
        self.run_host_work()

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

    def routed_cached(
        self, x: torch.Tensor, slots_h: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first device part of a staged decode layer step (capturable), before its fills
        are done: the route slots table slots_h read from the host, the cached experts' routes
        run. Returns their per-route outputs [T, K, H] and the filled routes' slots [T, K]."""
        cached = torch.empty(slots_h.shape, dtype=torch.int32, device=x.device)
        filled = torch.empty_like(cached)
        route_slots_from_host(slots_h, cached, filled)
        w13, w2 = self.cache.w13, self.cache.w2
        return fused_moe_decode(x, cached, weights, w13, w2, reduce=False), filled

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
        return sum_when_ready(parts, cpu_part, self._handoff_sync, dtype)

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
        return sum_norm_when_ready(parts, cpu_part, self._handoff_sync, residual, norm_weight, eps)

    def _filled_part(
        self, x: torch.Tensor, filled: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The filled experts' routes [T, K, H] (one or two experts, mostly: their rows spread
        over the device, few_routes)."""
        w13, w2 = self.cache.w13, self.cache.w2
        return fused_moe_decode(x, filled, weights, w13, w2, reduce=False, few_routes=True)

    def _end_handoff(self) -> None:
        """After a sync: count the last staged CPU job (ended: the device waited for it), and
        fail if the device gave up waiting for one."""
        state = self._handoff_sync.numpy()
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
            self._wait_cpu(d, decode=True)

    def _native_step(
        self, planner, moe_layer, ids, weights, x, out, handoff, sync=False, copies=False,
        route_slots=None, signal=None, expected=False, launch=None, pad_rows=0, guess=None,
    ) -> tuple[Dispatch, tuple[float, float, float, float]]:  # fmt: skip
        """One DecodePlanner step over host tensors ids [T, K] (int32), weights [T, K] and x
        [T, H] (fp32), the CPU's part into out (and then the next handoff epoch, if `handoff`).
        sync: wait for the compute stream first (the routing's copies); copies: queue the fills
        on the copy stream and mark the routes they serve (and then one miss may be split
        between the copy and the CPU, if `split_misses`). route_slots: the host table [T, K]
        int32 the routes' slots go to (a reusable buffer if None). signal: with sync, the
        routing's signal to wait for instead of the stream (`routing_signal_buffer`).
        expected (with handoff): the native call also completes the handoff to the next piece
        (a zero part and its epoch where no CPU job runs; the epoch the piece waits for).
        launch, pad_rows: the next piece's graph execs to launch, and the padding rows of
        route_slots' buffer to mark (`stage_decode`). guess (with signal): the guess's logits and
        signal (`guess_buffers`), planned during the wait for `prefetch_rounds` rounds of blocks
        and, with `copy_ahead` and the copies, the copy ahead of its first device miss.
        Returns the step and its native (wait, plan, copy, launch) seconds."""
        if route_slots is None:
            route_slots = self._pinned("route_slots", tuple(ids.shape), torch.int32)
        flag, value = (self._handoff_sync, self._epoch + 1) if handoff else (None, 0)
        expected_at = flag.data_ptr() + EXPECTED * flag.element_size() if expected else 0
        head, piece = launch if launch is not None else (0, 0)
        inter = self.bank.w2[0].shape[-1]
        chunks = SPLIT_CHUNKS if copies and self.split_misses and inter % SPLIT_CHUNKS == 0 else 0
        guess_logits, guess_signal = (t.data_ptr() for t in guess) if guess else (0, 0)
        try:
            experts, slots, admitted, on_cpu, split, job, seconds, guessed_step = planner.step(
                moe_layer, ids.data_ptr(), weights.data_ptr(), x.data_ptr(), ids.shape[0],
                self.policy.fetch_fraction, route_slots.data_ptr(), out.data_ptr(),
                0 if flag is None else flag.data_ptr(), value, sync, copies, chunks,
                0 if signal is None else signal.data_ptr(), expected_at, pad_rows, head, piece,
                guess_logits, guess_signal, self.prefetch_rounds if guess else 0,
            )  # fmt: skip
        except RuntimeError:  # a driver call failed; a failed fill has freed its slots again
            self.cache.changed()
            if flag is not None:  # the epochs stay ahead of any the call may have written
                state = flag.numpy()
                self._epoch = max(self._epoch, int(state[DONE]), int(state[EXPECTED]))
            raise
        if admitted or split is not None:
            self.cache.changed()
        missing = [e for e, s in zip(experts, slots, strict=True) if s < 0]
        d = Dispatch(experts, slots, missing, admitted, on_cpu, route_slots.numpy(), None)
        d.route_slots_host = route_slots
        d.guessed, d.owned_blocks, d.ahead_rows, d.ahead_missed, d.guess_s, d.guess_late = (
            guessed_step
        )
        if split is not None:
            d.split, d.split_share = split, split[2] / inter
            self.staged_times.split_misses += 1
        if job is not None:
            keep = (ids, weights, x, out) if flag is None else (ids, weights, x, out, flag)
            d.job = CpuExpertJob(out, job=job, keep=keep)
        if flag is not None and (job is not None or expected):
            self._epoch = value
        return d, seconds

    def _decode_planner(self) -> object | None:
        """The native planner over this runner's cache (None: the Python `_plan`); with CUDA it
        also waits for the routing and queues the copies (`DecodePlanner.set_device`)."""
        cache = self.cache
        if self.cpu is None or self.cpu.kernel != "native":
            return None
        if self._planner is None or self._planner_version != cache.version:
            planner = self.cpu.decode_planner(
                slot_of=cache.slot_of, key_of_slot=cache.key_of_slot, last_use=cache.last_use,
                state=cache.state, picks=self._counters.picks, w13=self.bank.w13,
                w2=self.bank.w2, top_k=self.top_k,
            )  # fmt: skip
            if planner is not None and self.planner_copies:
                assert self.bank.w13[0].element_size() == cache.w13.element_size()
                stream = self.compute_stream.cuda_stream if self.compute_stream else 0
                fills = self.copy_stream.cuda_stream if self.copy_stream else 0
                planner.set_device(*driver_functions(), stream, fills, cache.w13.data_ptr(),
                                   cache.w2.data_ptr(), cache.w13.element_size())  # fmt: skip
                if self.planner_launches:
                    if self._join_event is None and self.device.type == "cuda":
                        self._join_event = DriverEvent()
                    join = self._join_event.handle if self._join_event is not None else 0
                    planner.set_launch(*launch_functions(), join)
                planner.set_copy_ahead(self.copy_ahead, self.copy_rate)
            self._planner, self._planner_version = planner, cache.version
        return self._planner


# StagedDecode's knowledge of the routing's signal (`expect_routing`)
_CLEAR, _EXPECTED, _UNKNOWN = range(3)


def _plan_key(d: Dispatch) -> str:
    """A layer step's plan as `StagedStepTimes.periods` keys it: "q+c", q experts copied and c
    run on the CPU, with "s" when one of those is split between the two, then "p" when its CPU
    job's first blocks were fetched by their workers ahead of it (a guessed plan), or "w" when a
    guess of CPU work came and the job was another (the workers fetched for nothing); no mark
    where no such guess came (prefetch off, a batch of several tokens, a guess that came late);
    then "a" when the device's first miss was copied in part ahead of the routing (`copy_ahead`)."""
    key = f"{len(d.admitted)}+{len(d.on_cpu)}" + ("s" if d.split is not None else "")
    key += "p" if d.owned_blocks else "w" if d.guessed else ""
    return key + ("a" if d.ahead_rows else "")
