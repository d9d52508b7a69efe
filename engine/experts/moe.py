"""The MoE step: route, run hits from the GPU cache, split misses between fills and CPU execution.

`MoERunner` composes the parts of the MoE layer's runtime, each built here and owning its state:
the expert cache and the fills into it (cache.py), the miss split and its controller (misses.py),
the planner of a layer step and its CPU jobs (miss_plan.py), the decode counters and timers
(moe_stats.py), the staged decode between captured pieces with its host buffers
(staged_decode.py), the prefill stream (prefill_stream.py) and the all-resident decode routing
(resident_record.py). This module runs the eager steps.

Decode: a layer step's misses are divided between copies into cache slots and the CPU, both run
at the same time (how many of each: misses.py; which: miss_plan.py).

Prefill: a long chunk streams whole layers into a two-layer buffer (prefill_stream.py); a short
chunk routes first and then treats its misses like decode does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from ...kernels.cpu_experts import CpuExpertRunner
from ...kernels.host_handoff import routing_to_host
from . import moe_kernels
from .bank import ExpertBank
from .cache import ExpertCache, SlotFills
from .miss_plan import Dispatch, Handoff, LayerPlanner, expert_mask
from .misses import MissPolicy, MissSplit
from .moe_stats import ACCESS_BATCH, CpuJobTimes, DecodeStats, LayerCounters, StagedStepTimes
from .prefill_stream import PrefillStream
from .resident_record import ResidentRouting
from .staged_decode import StagedBuffers, StagedDecode


class MoERunner:
    """Runs the routed experts of every MoE layer from the host bank and the device cache.

    The settings of offloaded decode: split_misses (--no-split-misses turns it off),
    prefetch_rounds (--moe-cpu-prefetch-rounds), copy_ahead (--moe-copy-ahead) and copy_rate,
    the copies' rate in bytes/s that sizes a copy ahead (`LayerPlanner`), early_cached
    (--moe-early-cached: `StagedDecode`); counters, where given, the decode counters it counts
    into (a split model's rows: engine/experts/split_experts.py)."""

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
        split_misses: bool = False,
        prefetch_rounds: int = 0,
        copy_ahead: float = 0.0,
        copy_rate: float = 0.0,
        counters: LayerCounters | None = None,
        early_cached: bool = False,
    ) -> None:
        self.bank = bank
        self.cache = cache
        self.cpu = cpu
        self.top_k = top_k
        self.device = cache.device
        self.dtype = cache.dtype  # the compute dtype
        self.prefill_stream_min_tokens = prefill_stream_min_tokens
        self.timer = None  # a telemetry StepTimer while one step is being timed by phase
        cuda = self.device.type == "cuda"
        copy_stream = torch.cuda.Stream(self.device) if cuda else None
        # the engine runs on the device's current stream; looked up once (the lookup costs more
        # than the small copies of a decode layer step)
        self.compute_stream = torch.cuda.current_stream(self.device) if cuda else None
        # reusable host buffers by name (`_pinned`), for the eager steps and the planner
        self._views: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._host_buffers: dict[str, torch.Tensor] = {}
        self.split = MissSplit(policy)
        self.stats = DecodeStats(bank.num_layers, bank.num_experts, counters)
        self.fills = SlotFills(bank, cache, copy_stream, self.compute_stream)
        handoff = Handoff(pin=cuda)
        self.planner = LayerPlanner(
            bank, cache, self.split, cpu, self.stats, self.fills, handoff, self._pinned,
            top_k=top_k, split_misses=split_misses, prefetch_rounds=prefetch_rounds,
            copy_ahead=copy_ahead, copy_rate=copy_rate,
        )  # fmt: skip
        buffers = StagedBuffers(bank.num_experts, top_k, bank.hidden_size, handoff, cuda)
        self.staged = StagedDecode(buffers, cache, self.planner, self.fills, self.split,
                                   self.stats, early_cached=early_cached)  # fmt: skip
        self.prefill = PrefillStream(
            bank, self.device, copy_stream, self.compute_stream,
            overlap=prefill_overlap,
        )  # fmt: skip
        # all-resident decode keeps its routing on the device and copies it to the host without
        # waiting
        self.resident_routing = ResidentRouting(bank.num_layers, bank.num_experts, top_k,
                                                self.device)  # fmt: skip

    # what the engine and telemetry read ----------------------------------------------------------

    @property
    def policy(self) -> MissPolicy:
        """The miss split in force (auto follows the CPU rate decode sees)."""
        return self.split.policy

    @property
    def prefetch_rounds(self) -> int:
        return self.planner.prefetch_rounds

    @property
    def copy_ahead(self) -> float:
        return self.planner.copy_ahead

    @property
    def cpu_times(self) -> CpuJobTimes:
        """The CPU jobs' own timing (a benchmark replaces it to time a run alone)."""
        return self.stats.cpu_times

    @cpu_times.setter
    def cpu_times(self, times: CpuJobTimes) -> None:
        self.stats.cpu_times = times

    @property
    def staged_times(self) -> StagedStepTimes:
        """The staged layer steps' timing (a benchmark replaces it to time a run alone)."""
        return self.stats.staged_times

    @staged_times.setter
    def staged_times(self, times: StagedStepTimes) -> None:
        self.stats.staged_times = times

    def snapshot(self) -> dict:
        """The miss split's, the CPU jobs' and the staged steps' figures and the prefill
        buffer's bytes (telemetry's `ExpertReports`)."""
        return {
            **self.split.snapshot(),
            **self.stats.snapshot(),
            "prefill_buffer_bytes": self.stage_bytes,
        }

    def watch_accesses(self, observer: Callable[[np.ndarray], None]) -> None:
        """Hand the decode accesses to `observer` from now on, in batches: keys layer * E +
        expert, in the order the cache saw them (the what-if curve's stream)."""
        self.stats.on_accesses = observer

    @property
    def decode_reads(self) -> tuple[int, int]:
        """Decode expert (reads, misses) counted so far; resident steps still in the backlog
        are left out, so read both together."""
        c = self.stats.counters
        reads = int(c.reads.sum())
        return reads, reads - int(c.hits.sum())

    @property
    def counters(self) -> LayerCounters:
        """Decode counters per MoE layer, up to date."""
        self.count_backlog()
        return self.stats.counters

    # settings between runs (`bench decode --alternate-...`) -------------------------------------

    def set_prefetch_rounds(self, rounds: int) -> None:
        self.staged.set_prefetch_rounds(rounds)

    def set_copy_ahead(self, share: float) -> None:
        self.staged.set_copy_ahead(share)

    def set_cache_admission(self, mode: str) -> None:
        self.planner.set_cache_admission(mode)

    def guess_lead_seconds(self) -> float:
        return self.planner.guess_lead_seconds()

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

    def refill(self, moe_layer: int, expert: int, slot: int) -> None:
        """Copy one expert from the bank into a slot and wait (cache resize, warm-up)."""
        self.fills.refill(moe_layer, expert, slot)

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
        self.stats.break_chain()
        if self.cache.holds_everything:
            return self._all_resident(moe_layer, x, ids, weights, decode)
        if not decode and self.prefill.allocated and x.shape[0] >= self.prefill_stream_min_tokens:
            return self.prefill.run(moe_layer, x, ids, weights)
        return self._split(moe_layer, x, ids, weights, decode)

    def _all_resident(self, moe_layer, x, ids, weights, decode) -> torch.Tensor:
        cache = self.cache
        args = cache.kernel_args()
        if cache.layer_major:
            # layer m's experts fill slots m*E .. m*E+E-1 in order: index that view by expert id
            e = self.bank.num_experts
            slots = ids
            layer = slice(moe_layer * e, (moe_layer + 1) * e)
            w13, w2 = cache.w13[layer], cache.w2[layer]
            args = {n: t[layer] if isinstance(t, torch.Tensor) else t for n, t in args.items()}
        else:
            # slots looked up on the device: no host sync, so the step can sit in a CUDA graph
            slots = cache.device_slot_map()[moe_layer][ids.long()]
            w13, w2 = cache.w13, cache.w2
        if decode:
            self.resident_routing.store(moe_layer, ids)
            with self._phase("gpu_experts"):
                # the routes' outputs unsummed: the next residual add + RMSNorm sums them
                return moe_kernels.decode(x, slots, weights, w13, w2, reduce=False, **args)
        # the router's ids are in range: no check, and nothing in the layer waits for the device
        e = self.bank.num_experts
        return moe_kernels.prefill(
            x, slots, weights, w13, w2, layer_experts=e, checked=False, **args
        )

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
            self.staged.end_handoff()
        self.stats.flush_accesses(ACCESS_BATCH)
        if snapshot is not None and self.resident_routing.keep(snapshot):
            self.count_backlog()

    def count_backlog(self) -> None:
        """Count the kept resident steps at once: picks, reads (= hits), the what-if stream."""
        stats = self.stats
        stats.flush_accesses()
        unique = self.resident_routing.count(stats.counters)
        if unique is None:
            return
        self.cache.hits += int(unique.size)
        if stats.on_accesses is not None:
            stats.on_accesses(unique)

    # the staged decode's work between steps (stepping.py) -------------------------------------

    def defer_host_work(self, work: Callable[[], None]) -> None:
        self.staged.defer_host_work(work)

    def run_host_work(self) -> None:
        self.staged.run_host_work()

    # eager offloaded steps --------------------------------------------------------------------

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

    def _slots_to_device(self, name: str, slots: np.ndarray) -> torch.Tensor:
        """`slots` copied to the device without waiting, from a reusable pinned buffer (int32),
        which the next layer reuses only after its routing sync, by which time the copy has
        run."""
        host = self._pinned(name, slots.shape, torch.int32)
        host.numpy()[...] = slots
        return host.to(self.device, non_blocking=True)

    def _dispatch(self, moe_layer, ids_host, weights_host, x_host, decode) -> Dispatch:
        """The host side of an eager offloaded layer step, from its routing on the host
        (`_routing_to_host`): plan and start, count. The caller copies the admitted experts."""
        d = self.planner.plan_and_start(moe_layer, ids_host, weights_host, x_host, decode)
        if decode:
            self.stats.layer_step(d, moe_layer)
            split = self.split
            if d.missing and split.policy.mode == "auto":
                split.note_cpu_use(bool(d.on_cpu))
        return d

    def _split(self, moe_layer, x, ids, weights, decode) -> torch.Tensor:
        """Hits on the device, misses split between slot fills and CPU execution (eager)."""
        ids_host, weights_host, x_host = self._routing_to_host(x, ids, weights)
        d = self._dispatch(moe_layer, ids_host, weights_host, x_host, decode)
        if d.job is not None and self.timer is not None:
            with self._phase("cpu_experts"):  # a timed step runs the CPU part alone
                d.job.wait()
        kernel = moe_kernels.decode if decode else moe_kernels.prefill
        fetched_mask = expert_mask(self.bank.num_experts, [expert for expert, _ in d.admitted])[
            ids_host
        ]
        hit_slots = np.where(fetched_mask, -1, d.route_slots)
        cache = self.cache
        out = None
        with self._phase("gpu_experts"):
            # hits first: they need not wait for the fills
            if (hit_slots >= 0).any():
                slots_d = self._slots_to_device("hit_slots", hit_slots)
                out = kernel(x, slots_d, weights, cache.w13, cache.w2, **cache.kernel_args())
            if d.admitted:
                fill_event = self.fills.copy(moe_layer, d.admitted)
                if fill_event is not None:
                    self.compute_stream.wait_event(fill_event)
                fill_slots = np.where(fetched_mask, d.route_slots, -1)
                slots_d = self._slots_to_device("fill_slots", fill_slots)
                part = kernel(x, slots_d, weights, cache.w13, cache.w2, **cache.kernel_args())
                out = part if out is None else out + part
        if d.job is not None:
            with self._phase("cpu_experts"):
                cpu_out = self.planner.end_job(d, decode)
                # a copy: the pinned buffer is reused by the next layer's CPU job
                cpu_out = cpu_out.to(self.device, non_blocking=True, copy=True)
            out = cpu_out if out is None else out + cpu_out
        if out is None:
            out = torch.zeros(x.shape, dtype=torch.float32, device=self.device)
        return out


_NO_TIMER = contextlib.nullcontext()
