"""The MoE step: route, run hits from the GPU cache, split misses between fills and CPU execution.

Decode: a layer step's misses are divided between copies into cache slots and the CPU, both run
at the same time (how many of each: misses.py; which: miss_plan.py). What the step counts and
times: moe_stats.py; the all-resident step's routing for telemetry: resident_record.py.

Offloaded decode steps replayed from captured pieces stage each layer step between two pieces
(staged_decode.py, mixed into `MoERunner`); this module runs the eager steps, the fills and the
CPU jobs both use.

Prefill: a long chunk streams whole layers into a two-layer buffer (prefill_stream.py); a short
chunk routes first and then treats its misses like decode does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
import torch

from ..kernels.cpu_experts import CpuExpertRunner
from ..kernels.fused_moe import fused_moe_decode
from ..kernels.grouped_moe import grouped_moe
from ..kernels.host_handoff import (
    routing_to_host,
)
from .bank import ExpertBank
from .cache import ExpertCache
from .h2d import HostToDevice
from .miss_plan import Dispatch, expert_mask, plan_layer
from .misses import MissPolicy
from .moe_stats import CpuJobTimes, LayerCounters, StagedStepTimes
from .prefill_stream import PrefillStream
from .resident_record import ResidentRouting
from .staged_decode import StagedDecode

# CPU jobs of decode between two updates of the auto split from their measured rate
ADAPT_EVERY_JOBS = 48
# The auto split's way back from a CPU rate so low that the CPU gets no job, or a rare one: jobs
# made rare by a low rate find their workers asleep (waking them took milliseconds on a busy H200
# host), measure slow and keep the rate low, so one slow stretch of the host sent every miss to the
# copies for good (4 of 6 processes on 2026-12-02: 36% of the bound against 58%). After this many
# layer steps with misses that ran none on the CPU, before a window of jobs measured it, the rate
# moves half-way back to the start-up measurement and the next few jobs are judged at once; each
# return the CPU did not confirm doubles the wait.
RECOVER_AFTER_STEPS = 96
RECOVER_AFTER_STEPS_MAX = 96 * 64
ADAPT_AFTER_RECOVERY_JOBS = 8
# Offloaded decode accesses handed to `on_accesses` (the what-if stream) at once: handed over once
# per step, they cost the host 45 of the 88 us of landing a step (CI machine, a test engine)
ACCESS_BATCH = 4096

log = logging.getLogger("moelab.engine")


class MoERunner(StagedDecode):
    """Runs the routed experts of every MoE layer from the host bank and the device cache."""

    def __init__(
        self,
        bank: ExpertBank,
        cache: ExpertCache,
        policy: MissPolicy,
        cpu: CpuExpertRunner | None,
        *,
        top_k: int,
        prefill_overlap: bool,
        prefill_stream_min_tokens: int,
    ) -> None:
        self.bank = bank
        self.cache = cache
        self.policy = policy
        self.cpu = cpu
        self.top_k = top_k
        self.device = cache.device
        self.dtype = cache.dtype
        self.prefill_stream_min_tokens = prefill_stream_min_tokens
        self._counters = LayerCounters.zeros(bank.num_layers, bank.num_experts)
        self.cpu_times = CpuJobTimes()
        self.staged_times = StagedStepTimes()
        self._cpu_window = CpuJobTimes()  # the CPU jobs since the auto split was last updated
        self._adapt_every = ADAPT_EVERY_JOBS
        # the auto split's way back to the CPU (`_note_cpu_use`): the start-up CPU rate, the
        # layer steps with misses that ran none on the CPU since a window of jobs measured it,
        # and how many of them make it return
        self._bh_start = policy.bh_gbps
        self._steps_without_cpu = 0
        self._recover_after = RECOVER_AFTER_STEPS
        # what the planner adds a split prefill layer's picks to (decode's counters rank misses);
        # a resident or streamed prefill does not count, which would cost a host sync a layer
        self.prefill_picks = np.zeros((bank.num_layers, bank.num_experts), dtype=np.int64)
        # decode-step observers: (layer, experts, slots before the step, fetched, run on CPU)
        self.on_decode_step: list[Callable] = []
        # the decode access stream, keys layer * E + expert in the order the cache sees them
        self.on_accesses: Callable[[np.ndarray], None] | None = None
        # offloaded steps' accesses, handed over in batches (ACCESS_BATCH) or when counters are read
        self._accesses: list[int] = []
        self.timer = None  # a telemetry StepTimer while one step is being timed by phase
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        # the engine runs on the device's current stream; looked up once (the lookup costs more
        # than the small copies of a decode layer step)
        self.compute_stream = torch.cuda.current_stream(self.device) if cuda else None
        # fills queued by the driver directly: torch's copy_ costs the host several times more
        self._h2d_copy = HostToDevice(self.copy_stream) if cuda else None
        self._expert_bytes = bank.expert_bytes
        self._views: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self.prefill = PrefillStream(
            bank, self.dtype, self.device, self.copy_stream, self.compute_stream,
            overlap=prefill_overlap,
        )  # fmt: skip
        # all-resident decode keeps its routing on the device and copies it to the host without
        # waiting
        self.resident_routing = ResidentRouting(bank.num_layers, bank.num_experts, top_k,
                                                self.device)  # fmt: skip
        self._host_buffers: dict[str, torch.Tensor] = {}
        self._init_staged(cuda)

    # prefill buffers (prefill_stream.py) --------------------------------------------------------

    @property
    def stage_bytes(self) -> int:
        """Bytes of the two-layer prefill buffer (allocated by `allocate_prefill_buffers`)."""
        return self.prefill.nbytes

    @staticmethod
    def prefill_buffer_bytes(bank: ExpertBank) -> int:
        return PrefillStream.buffer_bytes(bank)

    def allocate_prefill_buffers(self) -> None:
        self.prefill.allocate()

    def release_prefill_buffers(self) -> None:
        self.prefill.release()

    def reset_prefill(self) -> None:
        """Forget staged layers (a prefill chunk ended early or the step failed)."""
        self.prefill.reset()

    # the step ---------------------------------------------------------------------------------

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        *,
        decode: bool,
    ) -> torch.Tensor:
        # an eager MoE layer (a prefill, a decode step not replayed) breaks the chain of staged
        # layer steps: the next one starts no period (StagedStepTimes: periods, boundaries)
        self._last_arrival = None
        if self.cache.holds_everything:
            return self._all_resident(moe_layer, x, ids, weights, decode)
        if not decode and self.prefill.allocated and x.shape[0] >= self.prefill_stream_min_tokens:
            return self.prefill.run(moe_layer, x, ids, weights)
        return self._split(moe_layer, x, ids, weights, decode)

    def _all_resident(self, moe_layer, x, ids, weights, decode) -> torch.Tensor:
        cache = self.cache
        if cache.layer_major:
            # layer m's experts fill slots m*E .. m*E+E-1 in order: index that view by expert id
            e = self.bank.num_experts
            slots = ids
            w13, w2 = (
                cache.w13[moe_layer * e : (moe_layer + 1) * e],
                cache.w2[moe_layer * e : (moe_layer + 1) * e],
            )
        else:
            # slots looked up on the device: no host sync, so the step can sit in a CUDA graph
            slots = cache.device_slot_map()[moe_layer][ids.long()]
            w13, w2 = cache.w13, cache.w2
        if decode:
            self.resident_routing.store(moe_layer, ids)
            with self._phase("gpu_experts"):
                # the routes' outputs unsummed: the next residual add + RMSNorm sums them
                return fused_moe_decode(x, slots, weights, w13, w2, reduce=False)
        # the router's ids are in range: no check, and nothing in the layer waits for the device
        e = self.bank.num_experts
        return grouped_moe(x, slots, weights, w13, w2, layer_experts=e, checked=False)

    def _phase(self, name: str):
        return self.timer.phase(name) if self.timer is not None else _NO_TIMER

    def routing_record(self, moe_layer: int, tokens: int, decode: bool) -> torch.Tensor | None:
        """Where the router writes a resident decode step's expert ids of one layer (a copy launch
        per layer less than copying them there); None off the resident decode path."""
        if not (decode and self.cache.holds_everything):
            return None
        return self.resident_routing.record(moe_layer, tokens)

    def snapshot_decode_ids(self, tokens: int) -> tuple[torch.Tensor, int] | None:
        """Queue the copy of a queued all-resident decode step's routing to pinned host memory
        (no wait); hand the result to `after_decode_step` once the step has synchronized. None
        when the step did not run on the resident path."""
        if not self.cache.holds_everything:
            return None
        return self.resident_routing.snapshot(tokens)

    def after_decode_step(
        self, snapshot: tuple[torch.Tensor, int] | None, settled: bool = True
    ) -> None:
        """Keep a synchronized decode step's routing (from `snapshot_decode_ids`); it is counted
        in batches, off the per-step path, when the counters are read or the backlog grows. The
        offloaded steps' accesses are handed to `on_accesses` in batches too.

        settled: no later step is queued. When one is (overlapped decode), its last staged CPU
        job is still running: the next piece's launch ends it, not this (waiting here would hold
        the host while the device still has that job and the logits to do)."""
        if settled:
            self._end_handoff()
        if len(self._accesses) >= ACCESS_BATCH:
            self._flush_accesses()
        if snapshot is not None and self.resident_routing.keep(snapshot):
            self.count_backlog()

    def count_backlog(self) -> None:
        """Count the kept resident steps at once: picks, reads (= hits), the what-if stream."""
        self._flush_accesses()
        unique = self.resident_routing.count(self._counters)
        if unique is None:
            return
        self.cache.hits += int(unique.size)
        if self.on_accesses is not None:
            self.on_accesses(unique)

    def _flush_accesses(self) -> None:
        if self._accesses and self.on_accesses is not None:
            self.on_accesses(np.array(self._accesses, dtype=np.int64))
        self._accesses = []

    @property
    def decode_reads(self) -> tuple[int, int]:
        """Decode expert (reads, misses) counted so far; resident steps still in the backlog
        are left out, so read both together."""
        c = self._counters
        reads = int(c.reads.sum())
        return reads, reads - int(c.hits.sum())

    @property
    def counters(self) -> LayerCounters:
        """Decode counters per MoE layer, up to date."""
        self.count_backlog()
        return self._counters

    def _pinned(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reusable host buffer (pinned with CUDA) of at least `shape`, viewed to it."""
        view = self._views.get((name, shape, dtype))
        if view is not None:
            return view
        n = 1
        for d in shape:
            n *= d
        buf = self._host_buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 1), dtype=dtype, pin_memory=self.device.type == "cuda")
            self._host_buffers[name] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
        view = self._views[(name, shape, dtype)] = buf[:n].view(shape)
        return view

    def _routing_to_host(self, x, ids, weights) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """ids, weights and x on the host after one synchronization (the step's only one)."""
        if self.device.type != "cuda":
            return ids.numpy(), weights.float(), x.float()
        ids_h = self._pinned("ids", tuple(ids.shape), torch.int32)
        w_h = self._pinned("weights", tuple(weights.shape), torch.float32)
        x_h = self._pinned("x", tuple(x.shape), torch.float32)  # as the CPU experts read it
        routing_to_host(ids, weights, x, ids_h, w_h, x_h)
        self.compute_stream.synchronize()
        return ids_h.numpy(), w_h, x_h

    def _pinned_copy(self, name: str, values: np.ndarray) -> torch.Tensor:
        """`values` in a reusable pinned buffer (int32), ready for a non-blocking copy; the
        buffer is reused by the next layer only after that layer's routing sync, by which time
        the copy has run."""
        host = self._pinned(name, values.shape, torch.int32)
        host.numpy()[...] = values
        return host

    def _slots_to_device(self, name: str, slots: np.ndarray) -> torch.Tensor:
        return self._pinned_copy(name, slots).to(self.device, non_blocking=True)

    def _dispatch(self, moe_layer, ids_host, weights_host, x_host, decode) -> Dispatch:
        """The host side of an eager offloaded layer step, from its routing on the host
        (`_routing_to_host`): plan and start, count. The caller copies the admitted experts."""
        d = self._plan_and_start(moe_layer, ids_host, weights_host, x_host, decode)
        if decode:
            self._count(d, moe_layer)
        return d

    def _plan_and_start(
        self, moe_layer, ids_host, weights_host, x_host, decode, handoff_out=None
    ) -> Dispatch:
        """Plan a layer step and start its CPU job: in native code for decode when the CPU
        experts are native (`DecodePlanner`, the same decisions), else `_plan` and `_start`."""
        planner = self._decode_planner() if decode else None
        if planner is None:
            d = self._plan(moe_layer, ids_host, decode)
            self._start(d, moe_layer, ids_host, weights_host, x_host, handoff_out)
            return d
        ids = torch.from_numpy(np.ascontiguousarray(ids_host, dtype=np.int32))
        weights = weights_host.float().contiguous()
        x = x_host.float().contiguous()
        out = handoff_out
        if out is None:
            out = self._pinned("cpu_out", tuple(x.shape), torch.float32)
        d, _ = self._native_step(planner, moe_layer, ids, weights, x, out, handoff_out is not None)
        return d

    def _plan(self, moe_layer: int, ids_host: np.ndarray, decode: bool) -> Dispatch:
        """The Python planner of a layer step (miss_plan.py), which the native one matches."""
        picks = self._counters.picks if decode else self.prefill_picks
        return plan_layer(self.cache, self.policy, moe_layer, ids_host, picks[moe_layer],
                          self._counters.picks[moe_layer])  # fmt: skip

    def _start(
        self, d: Dispatch, moe_layer, ids_host, weights_host, x_host, handoff_out=None
    ) -> None:
        """Start the CPU job of a planned layer step, if it has one (writing into handoff_out and
        ending the next epoch, when given)."""
        if d.cpu_mask is not None:
            d.job = self._submit_cpu(
                moe_layer, x_host, ids_host, weights_host, d.cpu_mask, handoff_out
            )

    def _count(self, d: Dispatch, moe_layer: int) -> None:
        """Count a planned decode layer step, and tell the observers."""
        experts, slots, missing = d.experts, d.slots, d.missing
        fetched = [expert for expert, _ in d.admitted]
        c = self._counters
        c.reads[moe_layer] += len(experts)
        c.hits[moe_layer] += len(experts) - len(missing)
        c.fills[moe_layer] += len(fetched)
        c.cpu[moe_layer] += len(d.on_cpu)
        if missing and self.policy.mode == "auto":
            self._note_cpu_use(bool(d.on_cpu))
        for callback in self.on_decode_step:
            callback(moe_layer, experts, slots, fetched, d.on_cpu)
        if self.on_accesses is not None:
            base = moe_layer * self.bank.num_experts
            self._accesses += [base + e for e, s in zip(experts, slots, strict=True) if s >= 0]
            self._accesses += [base + e for e in missing]

    def _split(self, moe_layer, x, ids, weights, decode) -> torch.Tensor:
        """Hits on the device, misses split between slot fills and CPU execution (eager)."""
        ids_host, weights_host, x_host = self._routing_to_host(x, ids, weights)
        d = self._dispatch(moe_layer, ids_host, weights_host, x_host, decode)
        if d.job is not None and self.timer is not None:
            with self._phase("cpu_experts"):  # a timed step runs the CPU part alone
                d.job.wait()
        kernel = fused_moe_decode if decode else grouped_moe
        fetched_mask = expert_mask(self.bank.num_experts, [expert for expert, _ in d.admitted])[
            ids_host
        ]
        hit_slots = np.where(fetched_mask, -1, d.route_slots)
        out = None
        with self._phase("gpu_experts"):
            # hits first: they need not wait for the fills
            if (hit_slots >= 0).any():
                slots_d = self._slots_to_device("hit_slots", hit_slots)
                out = kernel(x, slots_d, weights, self.cache.w13, self.cache.w2)
            if d.admitted:
                fill_event = self._copy_experts(moe_layer, d.admitted)
                if fill_event is not None:
                    self.compute_stream.wait_event(fill_event)
                fill_slots = np.where(fetched_mask, d.route_slots, -1)
                slots_d = self._slots_to_device("fill_slots", fill_slots)
                part = kernel(x, slots_d, weights, self.cache.w13, self.cache.w2)
                out = part if out is None else out + part
        if d.job is not None:
            with self._phase("cpu_experts"):
                cpu_out = self._wait_cpu(d, decode)
                # a copy: the pinned buffer is reused by the next layer's CPU job
                cpu_out = cpu_out.to(self.device, non_blocking=True, copy=True)
            out = cpu_out if out is None else out + cpu_out
        if out is None:
            out = torch.zeros(x.shape, dtype=torch.float32, device=self.device)
        return out

    def _wait_cpu(self, d: Dispatch, decode: bool) -> torch.Tensor:
        assert d.job is not None
        out = d.job.wait()
        if decode:
            weight_bytes, seconds = int(d.cpu_experts * self._expert_bytes), d.job.seconds()
            self.cpu_times.add(
                weight_bytes, seconds, d.job.worker_seconds(), self.cpu.num_threads,
                d.job.phase_seconds(), d.job.redone(),
            )  # fmt: skip
            self._cpu_window.add(weight_bytes, seconds)
            if self._cpu_window.jobs >= self._adapt_every:
                self._adapt_split()
        return out

    def _adapt_split(self) -> None:
        """Auto policy: take the CPU's rate as decode sees it, reaction time included.

        The start-up Bh is the workers' best streaming rate; inside decode each job also waits
        for the workers to wake, and on an H200 they averaged 60 GB/s against 109 measured at
        start, so the start-up split sent too many misses to the CPU. Half the new reading is
        blended in per window, so one noisy window cannot swing the split. The reading is the
        window's marginal rate where its jobs' sizes vary enough to fit one (`CpuJobTimes`):
        the planner counts each job's fixed part apart (misses.CPU_FIXED), so the average rate,
        which spreads that part over the bytes, would count it twice.
        """
        window, self._cpu_window = self._cpu_window, CpuJobTimes()
        self._steps_without_cpu = 0  # the CPU was measured: the way back's count starts again
        policy = self.policy
        busy_s = window.start_s + window.run_s
        if policy.mode != "auto" or not busy_s or policy.bp_gbps is None or not policy.bh_gbps:
            return
        average_gbps = window.weight_bytes / busy_s / 1e9
        # no faster than twice the average: a fit over few, noisy jobs may be steep
        seen_gbps = min(window.marginal_gbps() or average_gbps, 2.0 * average_gbps)
        self.policy = MissPolicy.auto(policy.bp_gbps, 0.5 * (policy.bh_gbps + seen_gbps))
        self._adapt_every = ADAPT_EVERY_JOBS
        if self._bh_start and self.policy.bh_gbps >= 0.5 * self._bh_start:
            self._recover_after = RECOVER_AFTER_STEPS  # the CPU is back: the next wait is short

    def _note_cpu_use(self, used: bool) -> None:
        """Auto policy, after a decode layer step with misses that ran some (`used`) or none on
        the CPU: once RECOVER_AFTER_STEPS of them (doubled after each return the CPU's jobs did
        not confirm) ran none before a window of jobs measured the CPU, move its rate half-way
        back to the start-up measurement, so that it gets jobs again and is measured anew. Steps
        that ran some do not reset the count: a rate that leaves the CPU a job now and then is
        as stuck (those jobs find the workers asleep), and a healthy split fills a window long
        before (nearly every step with misses runs some on the CPU)."""
        if used:
            return
        self._steps_without_cpu += 1
        policy = self.policy  # auto: its rates are set
        if self._steps_without_cpu < self._recover_after or policy.bh_gbps >= self._bh_start:
            return
        bh_gbps = 0.5 * (policy.bh_gbps + self._bh_start)
        log.info(
            "auto miss split: %d layer steps with misses ran none on the CPU since its rate "
            "was last measured; the rate it plans with goes from %.1f back to %.1f GB/s "
            "(start-up %.1f) to measure it again",
            self._steps_without_cpu, policy.bh_gbps, bh_gbps, self._bh_start,
        )  # fmt: skip
        self.policy = MissPolicy.auto(policy.bp_gbps, bh_gbps)
        self._steps_without_cpu = 0
        self._recover_after = min(2 * self._recover_after, RECOVER_AFTER_STEPS_MAX)
        self._cpu_window = CpuJobTimes()
        self._adapt_every = ADAPT_AFTER_RECOVERY_JOBS

    def _copy_experts(self, moe_layer: int, admitted: list[tuple[int, int]]):
        """Copy (expert, slot) pairs from the bank into their slots: on the copy stream, after the
        compute stream's queued work (which may still read the slots being refilled); returns the
        event that marks them done (None without CUDA, where the copies are done on return)."""
        stream = self.copy_stream
        if stream is None:
            self._fill_slots(moe_layer, admitted, None)
            return None
        stream.wait_stream(self.compute_stream)
        self._fill_slots(moe_layer, admitted, self._h2d_copy)
        return self._record_copies()

    def _fill_slots(
        self, moe_layer: int, admitted: list[tuple[int, int]], h2d: HostToDevice | None
    ) -> None:
        """Copy (expert, slot) pairs from the bank: queued on h2d's stream, or at once without
        CUDA."""
        bank_w13, bank_w2 = self.bank.w13[moe_layer], self.bank.w2[moe_layer]
        cache = self.cache
        if h2d is None:
            for expert, slot in admitted:
                cache.w13[slot].copy_(bank_w13[expert])
                cache.w2[slot].copy_(bank_w2[expert])
            return
        n13 = cache.w13.stride(0) * cache.w13.element_size()  # one expert's matrix, in bytes
        n2 = cache.w2.stride(0) * cache.w2.element_size()
        assert bank_w13.is_contiguous() and bank_w13.stride(0) == cache.w13.stride(0)
        dst13, dst2 = cache.w13.data_ptr(), cache.w2.data_ptr()
        src13, src2 = bank_w13.data_ptr(), bank_w2.data_ptr()
        for expert, slot in admitted:
            h2d.copy(dst13 + slot * n13, src13 + expert * n13, n13)
            h2d.copy(dst2 + slot * n2, src2 + expert * n2, n2)

    def refill(self, moe_layer: int, expert: int, slot: int) -> None:
        """Copy one expert from the bank into a slot and wait (cache resize, warm-up)."""
        event = self._copy_experts(moe_layer, [(expert, slot)])
        if event is not None:
            event.synchronize()

    def _record_copies(self):
        if self.copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

    def _submit_cpu(self, moe_layer, x_host, ids_host, weights_host, cpu_mask, handoff_out):
        rows, cols = np.nonzero(cpu_mask)
        pair_expert = torch.from_numpy(ids_host[rows, cols].astype(np.int32, copy=False))
        pair_token = torch.from_numpy(rows.astype(np.int32))
        pair_weight = torch.from_numpy(weights_host.numpy()[rows, cols])
        handoff = {}
        if handoff_out is None:
            out = self._pinned("cpu_out", tuple(x_host.shape), torch.float32)
        else:
            out = handoff_out
            self._epoch += 1
            handoff = {"done_flag": self._handoff_sync, "done_value": self._epoch}
        assert self.cpu is not None, "CPU execution chosen without a CPU executor"
        return self.cpu.submit(
            x_host.float(),
            self.bank.w13[moe_layer],
            self.bank.w2[moe_layer],
            pair_expert,
            pair_token,
            pair_weight,
            out,
            **handoff,
            check=False,  # the bank's tensors and this runner's buffers, right by construction
        )


_NO_TIMER = contextlib.nullcontext()
