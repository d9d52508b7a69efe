"""Where the routes of one offloaded layer step run: from a slot (a hit, or a miss fetched now)
or on the CPU; and the planner that decides it and starts the step's CPU job.

The Python code is the specification of these decisions: `plan_layer` over `ExpertCache`'s state
(cache.py: lookups, admissions, the least recently used slot out), with `MissPolicy` (misses.py)
saying how many misses to copy (`fetch_count`), whether to split one between the copy and the CPU
(`fetch_plan`) and how a copy ahead of the routing counts (`lead_plan`), its constants included.
Of a step's misses, the copied ones are those picked most often so far (the likeliest to be
reused from the cache), ties broken by more tokens now, then the lower expert id.

The native `DecodePlanner` (kernels/csrc/decode_planner.h) reimplements those decisions for
speed, on the same numpy arrays and in the same double arithmetic, and adds what only it does:
waiting for the routing, queueing the fills through the driver, splitting a miss, launching the
next captured piece, planning a guess of the routing. `LayerPlanner` runs it for decode where the
CPU experts are native, and `plan_layer` otherwise (the torch kernel, prefill). Where the two
differ, the native code is wrong: a change to the policy is made here, then in the native planner,
and tests/engine/test_planner.py runs both over the same caches and routings and compares their
plans, cache states and CPU outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ...kernels.cpu_experts import CpuExpertJob, CpuExpertRunner
from ...kernels.host_handoff import DONE, EXPECTED, handoff_sync
from .bank import ExpertBank
from .cache import ExpertCache, SlotFills
from .h2d import DriverEvent, driver_functions, launch_functions
from .misses import MissPolicy, MissSplit, split_chunks
from .moe_stats import DecodeStats


@dataclass(slots=True)
class Dispatch:
    """Where the routes of one offloaded layer step run (`plan_layer`, or the native planner),
    and the CPU job started for them."""

    experts: list[int]  # the layer's routed experts, ascending
    slots: list[int]  # their cache slots before this step, -1 where missing
    missing: list[int]
    admitted: list[tuple[int, int]]  # (expert, slot) to copy from the bank now
    on_cpu: list[int]  # experts run on the CPU
    # [T, K] cache slot of each route, -1 where it runs on the CPU; a staged decode step with the
    # planner's copies holds filled_mark(slot) (kernels/host_handoff.py) for a route its fills serve
    route_slots: np.ndarray
    cpu_mask: np.ndarray | None  # [T, K] routes run on the CPU (None: none, or already started)
    job: object | None = None  # the CPU job (CpuExpertJob)
    route_slots_host: torch.Tensor | None = None  # route_slots in a reusable (pinned) buffer
    # the split miss (native planner): (expert, borrowed slot, first row on the CPU); its expert is
    # in on_cpu too, and its share of rows on the device is split_share
    split: tuple[int, int, int] | None = None
    split_share: float = 0.0
    # the native planner's guess of this step (`prefetch_rounds`): whether one naming CPU work
    # came before the routing, and the gate/up blocks of the job its workers own, having fetched
    # them while they waited (0: none, or the guess did not match)
    guessed: bool = False
    owned_blocks: int = 0
    # the native planner's copy ahead (`copy_ahead`): rows of the device's first miss copied once
    # the guess came, before the routing (0: none served this step), and whether one was copied
    # for an expert the step did not miss
    ahead_rows: int = 0
    ahead_missed: bool = False
    # the wait's planning of this step's guess: its seconds (0: none), and whether the routing
    # came during it
    guess_s: float = 0.0
    guess_late: bool = False

    @property
    def cpu_experts(self) -> float:
        """Experts' worth of weights the CPU reads (a split miss counts its rows on the CPU)."""
        return len(self.on_cpu) - self.split_share


def plan_layer(
    cache: ExpertCache,
    policy: MissPolicy,
    moe_layer: int,
    ids_host: np.ndarray,
    picks: np.ndarray,
    ranked_picks: np.ndarray,
    admission_picks: np.ndarray | None = None,
) -> Dispatch:
    """Look the routes up in the cache and admit the experts to fetch: which routes run from a
    slot, which slots to fill, which routes go to the CPU.

    ids_host [T, K]: the layer's routing. picks: the layer's pick counts, which this step's picks
    are added to; ranked_picks: the counts that rank the misses (decode's, also for prefill);
    admission_picks: every layer's decode pick counts where the cache admits by frequency
    (`ExpertCache.admit`), else None.
    On the serial path of every offloaded decode layer step: the per-expert work is on Python
    lists (a numpy call on eight numbers costs more than the loop), numpy only for the routes.
    """
    if ids_host.shape[0] == 1:  # one token: its experts are distinct, no counting needed
        picks[ids_host[0]] += 1
        experts = sorted(ids_host[0].tolist())
        tokens_of = None
    else:
        np.add.at(picks, ids_host.ravel(), 1)
        unique, counts = np.unique(ids_host, return_counts=True)
        experts = unique.tolist()
        tokens_of = dict(zip(experts, counts.tolist(), strict=True))
    slots = cache.lookup(moe_layer, experts)
    missing = [e for e, s in zip(experts, slots, strict=True) if s < 0]
    q = policy.fetch_count(len(missing))
    if q < len(missing):
        # fetch the most picked (likeliest reused); ties: more tokens now, then lower id
        seen = dict(zip(missing, ranked_picks[missing].tolist(), strict=True))
        ranked = sorted(missing, key=lambda e: (-seen[e], -(tokens_of[e] if tokens_of else 1), e))
        fetch, on_cpu = ranked[:q], ranked[q:]
    else:
        fetch, on_cpu = missing, []
    protected = {s for s in slots if s >= 0}
    admitted: list[tuple[int, int]] = []
    for expert in fetch:
        slot = cache.admit(moe_layer, expert, protected, admission_picks)
        if slot is None:
            break
        protected.add(slot)
        admitted.append((expert, slot))
    if len(admitted) < len(fetch):  # every slot is in use by this step: the rest go to the CPU
        on_cpu = on_cpu + fetch[len(admitted) :]
    route_slots = cache.slot_of[moe_layer][ids_host]
    cpu_mask = None
    if on_cpu:
        cpu_mask = expert_mask(len(picks), on_cpu)[ids_host]
        route_slots[cpu_mask] = -1
    return Dispatch(experts, slots, missing, admitted, on_cpu, route_slots, cpu_mask)


def expert_mask(num_experts: int, experts: list[int]) -> np.ndarray:
    """A layer's experts as a lookup table: True at `experts` (cheaper than np.isin)."""
    mask = np.zeros(num_experts, dtype=bool)
    mask[experts] = True
    return mask


class Handoff:
    """Where a staged decode step's CPU job hands its part over to the next piece: a pinned word
    (kernels/host_handoff.py) the job writes its epoch into once its part is in host memory
    (DONE) and whose EXPECTED entry the piece waits for, and the epoch of the last part handed
    over."""

    def __init__(self, pin: bool) -> None:
        self.sync = handoff_sync(pin=pin)
        self.state = self.sync.numpy()
        self.epoch = 0

    def expect(self, ready: bool) -> None:
        """Have the next piece wait for the last epoch handed over: the last CPU job's, or where
        `ready` (a step with nothing on the CPU, its part zeroed), a new one, done now."""
        if ready:
            self.epoch += 1
            self.state[DONE] = self.epoch
        self.state[EXPECTED] = self.epoch


class LayerPlanner:
    """Plans offloaded layer steps and starts and ends their CPU jobs: `plan_layer`, or for
    decode where the CPU experts are native, the native `DecodePlanner` over the same cache.

    Settings of the native planner: `copies`, it also waits for the routing and queues the fills,
    and `launches`, it also launches the next captured piece (`DecodePlanner.set_device`,
    `set_launch`; through the driver functions of `h2d`, with CUDA; a CPU test may stand in
    functions on host memory and set them). `split_misses`: with its copies, one miss per layer
    step may be split between the copy and the CPU (--no-split-misses). `prefetch_rounds`: rounds
    of a CPU job's gate/up blocks its workers fetch while they wait for it, from a guess of the
    routing (--moe-cpu-prefetch-rounds). `copy_ahead`: the share of a guess's lead over the
    routing in which the device's first miss of the guessed step starts copying, at `copy_rate`
    bytes/s (--moe-copy-ahead; the engine's measured Bp).
    """

    def __init__(
        self,
        bank: ExpertBank,
        cache: ExpertCache,
        split: MissSplit,
        cpu: CpuExpertRunner | None,
        stats: DecodeStats,
        fills: SlotFills,
        handoff: Handoff,
        pinned: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor],
        *,
        top_k: int,
        split_misses: bool,
        prefetch_rounds: int,
        copy_ahead: float,
        copy_rate: float,
    ) -> None:
        self.bank = bank
        self.cache = cache
        self.split = split
        self.cpu = cpu
        self.stats = stats
        self.fills = fills
        self.handoff = handoff
        self._pinned = pinned  # reusable host buffers by name (`MoERunner._pinned`)
        self.top_k = top_k
        cuda = cache.device.type == "cuda"
        self.copies = self.launches = cuda
        self.split_misses = split_misses
        self.prefetch_rounds = prefetch_rounds
        self.copy_ahead = copy_ahead
        self.copy_rate = copy_rate
        # the counters are never replaced: the native planner holds the picks' address
        self._counters = stats.counters
        self._inter = bank.intermediate_size
        self._split_chunks = split_chunks(self._inter, bank.block_rows)
        self._expert_bytes = bank.expert_bytes
        # --moe-early-cached: the slot map's copy the heads read on the device
        # (`StagedDecode.cached_map`), which the native planner's launches refresh a row at a time
        self.cached_map: torch.Tensor | None = None
        self._native: object | None = None  # rebuilt when the cache replaces its arrays
        self._native_version = -1
        self._join_event: DriverEvent | None = None

    def native(self) -> object | None:
        """The native planner over the cache (None: `plan_layer`, for the torch CPU kernel);
        with `copies` it also waits for the routing and queues the copies, with `launches` it
        also launches the next piece, joining the fills on an event of its own."""
        cache = self.cache
        if self.cpu is None or self.cpu.kernel != "native":
            return None
        if self._native is None or self._native_version != cache.version:
            bank = self.bank
            native = self.cpu.decode_planner(
                slot_of=cache.slot_of, key_of_slot=cache.key_of_slot, last_use=cache.last_use,
                state=cache.state, picks=self._counters.picks, w13=bank.w13, w2=bank.w2,
                top_k=self.top_k, w13_scale=bank.w13_scale or None,
                w2_scale=bank.w2_scale or None, w13_bias=bank.w13_bias or None,
                w2_bias=bank.w2_bias or None, swiglu_limit=bank.swiglu_limit,
                w13_scale_2=bank.w13_scale_2 or None, w2_scale_2=bank.w2_scale_2 or None,
            )  # fmt: skip
            if native is not None and self.copies:
                slots = cache.tensors()
                assert [(t.shape[1:], t.dtype) for t in slots] == [
                    (t.shape[1:], t.dtype) for t in bank.layer_tensors(0)
                ], "the cache's slots hold an expert as the bank does"
                compute, fills = self.fills.compute_stream, self.fills.copy_stream
                native.set_device(*driver_functions(),
                                  compute.cuda_stream if compute is not None else 0,
                                  fills.cuda_stream if fills is not None else 0,
                                  [t.data_ptr() for t in slots])  # fmt: skip
                if self.launches:
                    if self._join_event is None and cache.device.type == "cuda":
                        self._join_event = DriverEvent()
                    join = self._join_event.handle if self._join_event is not None else 0
                    native.set_launch(*launch_functions(), join)
                native.set_copy_ahead(self.copy_ahead, self.copy_rate)
            if native is not None:
                native.set_frequency_admission(cache.admission == "frequency")
                cached_map = self.cached_map
                native.set_cached_map(0 if cached_map is None else cached_map.data_ptr())
            self._native, self._native_version = native, cache.version
        return self._native

    def uses_guesses(self) -> bool:
        """Whether the waits plan the routing's guesses: for the workers' prefetch or the copies
        ahead."""
        return self.prefetch_rounds > 0 or self.copy_ahead > 0

    def set_cache_admission(self, mode: str) -> None:
        """The cache's admission (`--moe-cache-admission`: "recent" or "frequency") from now on,
        in the native planner too."""
        self.cache.admission = mode
        if self._native is not None:
            self._native.set_frequency_admission(mode == "frequency")

    def set_copy_ahead(self, share: float) -> None:
        """`copy_ahead` from now on, in the native planner too."""
        self.copy_ahead = share
        if self._native is not None and self.copies:
            self._native.set_copy_ahead(share, self.copy_rate)

    def guess_lead_seconds(self) -> float:
        """The guesses' usual lead over the routing, as the native planner measures it (a
        running mean; 0 before a guess came, or without the native planner)."""
        native = self._native
        return native.guess_lead_seconds() if native is not None else 0.0

    def plan(self, moe_layer: int, ids_host: np.ndarray, decode: bool) -> Dispatch:
        """The Python plan of a layer step (`plan_layer`)."""
        counters = self._counters
        picks = counters.picks if decode else self.stats.prefill_picks
        by_frequency = decode and self.cache.admission == "frequency"
        return plan_layer(self.cache, self.split.policy, moe_layer, ids_host, picks[moe_layer],
                          counters.picks[moe_layer],
                          counters.picks if by_frequency else None)  # fmt: skip

    def start(
        self, d: Dispatch, moe_layer, ids_host, weights_host, x_host, handoff_out=None
    ) -> None:
        """Start the CPU job of a planned layer step, if it has one (writing into handoff_out and
        ending the next epoch, when given)."""
        if d.cpu_mask is not None:
            d.job = self._submit(moe_layer, x_host, ids_host, weights_host, d.cpu_mask, handoff_out)

    def plan_and_start(
        self, moe_layer, ids_host, weights_host, x_host, decode, handoff_out=None
    ) -> Dispatch:
        """Plan a layer step and start its CPU job: in native code for decode where the CPU
        experts are native (the same decisions), else `plan` and `start`."""
        native = self.native() if decode else None
        if native is None:
            d = self.plan(moe_layer, ids_host, decode)
            self.start(d, moe_layer, ids_host, weights_host, x_host, handoff_out)
            return d
        ids = torch.from_numpy(np.ascontiguousarray(ids_host, dtype=np.int32))
        weights = weights_host.float().contiguous()
        x = x_host.float().contiguous()
        out = handoff_out
        if out is None:
            out = self._pinned("cpu_out", tuple(x.shape), torch.float32)
        d, _ = self.native_step(native, moe_layer, ids, weights, x, out, handoff_out is not None)
        return d

    def native_step(
        self, native, moe_layer, ids, weights, x, out, handoff, sync=False, copies=False,
        route_slots=None, signal=None, expected=False, launch=None, pad_rows=0, guess=None,
    ) -> tuple[Dispatch, tuple[float, float, float, float]]:  # fmt: skip
        """One DecodePlanner step over host tensors ids [T, K] (int32), weights [T, K] and x
        [T, H] (fp32), the CPU's part into out (and then the next handoff epoch, if `handoff`).
        sync: wait for the compute stream first (the routing's copies); copies: queue the fills
        on the copy stream and mark the routes they serve (and then one miss may be split
        between the copy and the CPU, if `split_misses`). route_slots: the host table [T, K]
        int32 the routes' slots go to (a reusable buffer if None). signal: with sync, the
        routing's signal to wait for instead of the stream. expected (with handoff): the native
        call also completes the handoff to the next piece (a zero part and its epoch where no
        CPU job runs; the epoch the piece waits for). launch, pad_rows: the next piece's graph
        execs to launch, and the padding rows of route_slots' buffer to mark. guess (with
        signal): the guess's logits and signal, planned during the wait for `prefetch_rounds`
        rounds of blocks and, with `copy_ahead` and the copies, the copy ahead of its first
        device miss. Returns the step and its native (wait, plan, copy, launch) seconds."""
        if route_slots is None:
            route_slots = self._pinned("route_slots", tuple(ids.shape), torch.int32)
        h = self.handoff
        flag, value = (h.sync, h.epoch + 1) if handoff else (None, 0)
        expected_at = flag.data_ptr() + EXPECTED * flag.element_size() if expected else 0
        head, piece = launch if launch is not None else (0, 0)
        inter = self._inter
        chunks = self._split_chunks if copies and self.split_misses else 0
        guess_logits, guess_signal = (t.data_ptr() for t in guess) if guess else (0, 0)
        try:
            experts, slots, admitted, on_cpu, split, job, seconds, guessed_step = native.step(
                moe_layer, ids.data_ptr(), weights.data_ptr(), x.data_ptr(), ids.shape[0],
                self.split.policy.fetch_fraction, route_slots.data_ptr(), out.data_ptr(),
                0 if flag is None else flag.data_ptr(), value, sync, copies, chunks,
                0 if signal is None else signal.data_ptr(), expected_at, pad_rows, head, piece,
                guess_logits, guess_signal, self.prefetch_rounds if guess else 0,
            )  # fmt: skip
        except RuntimeError:  # a driver call failed; a failed fill has freed its slots again
            self.cache.changed()
            if flag is not None:  # the epochs stay ahead of any the call may have written
                h.epoch = max(h.epoch, int(h.state[DONE]), int(h.state[EXPECTED]))
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
        if job is not None:
            keep = (ids, weights, x, out) if flag is None else (ids, weights, x, out, flag)
            d.job = CpuExpertJob(out, job=job, keep=keep)
        if flag is not None and (job is not None or expected):
            h.epoch = value
        return d, seconds

    def end_job(self, d: Dispatch, decode: bool) -> torch.Tensor:
        """Wait for a layer step's CPU job and return its part; a decode job's own timing goes to
        the counters and to the miss split."""
        job = d.job
        assert job is not None
        out = job.wait()
        if decode:
            weight_bytes, seconds = int(d.cpu_experts * self._expert_bytes), job.seconds()
            self.stats.cpu_times.add(
                weight_bytes, seconds, job.worker_seconds(), self.cpu.num_threads,
                job.phase_seconds(), job.redone(),
            )  # fmt: skip
            self.split.job_done(weight_bytes, seconds)
        return out

    def _submit(self, moe_layer, x_host, ids_host, weights_host, cpu_mask, handoff_out):
        rows, cols = np.nonzero(cpu_mask)
        pair_expert = torch.from_numpy(ids_host[rows, cols].astype(np.int32, copy=False))
        pair_token = torch.from_numpy(rows.astype(np.int32))
        pair_weight = torch.from_numpy(weights_host.numpy()[rows, cols])
        handoff = {}
        if handoff_out is None:
            out = self._pinned("cpu_out", tuple(x_host.shape), torch.float32)
        else:
            out, h = handoff_out, self.handoff
            h.epoch += 1
            handoff = {"done_flag": h.sync, "done_value": h.epoch}
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
            **self.bank.cpu_args(moe_layer),
            check=False,  # the bank's tensors and the runner's buffers, right by construction
        )
