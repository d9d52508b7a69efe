"""Telemetry: throughput windows, requests and TTFT, memory, per-layer expert counters, the what-if
curve and the per-token time breakdown, as `GET /v1/stats` and `GET /metrics` report them.

`Telemetry` is given the parts it reports on, each through a small interface it implements: the
expert cache, the expert bank and the scheduler report their figures (`Reports.snapshot`); the MoE
runner its figures too, its decode counters and its stream of decode accesses (`ExpertReports`);
a hybrid model's state pool its slots (`StateSlots`); of the engine itself telemetry reads only
what a resize replaces or the engine alone knows (`EngineState`)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ..experts.moe_stats import LayerCounters, MissCostFit
from ..experts.whatif import StackDistances

if TYPE_CHECKING:
    from ..config.memory import VramPlan
    from ..model.kv import KVCache
    from ..model.spec import ModelSpec

WINDOWS_S = (10, 60)
# One decode step in this many seconds is timed phase by phase: eager (no graph replay) and
# synchronizing at each phase, it takes several times a replayed step, so timing one every few
# seconds would cost a visible share of decode and stall a benchmark's runs
BREAKDOWN_EVERY_S = 30.0
PHASES = ("route", "copy", "gpu_experts", "cpu_experts")


@dataclass(slots=True)
class RateWindow:
    """Events (time, amount) kept for the longest window; rate over any shorter one."""

    horizon_s: float = 60.0
    events: deque = field(default_factory=deque)

    def add(self, amount: float, now: float) -> None:
        self.events.append((now, amount))
        while self.events and self.events[0][0] < now - self.horizon_s:
            self.events.popleft()

    def rate(self, window_s: float, now: float, started: float) -> float:
        span = min(window_s, now - started)
        if span <= 0:
            return 0.0
        return sum(a for t, a in self.events if t >= now - window_s) / span


class StepTimer:
    """Wall time per phase of one decode step, synchronizing the device at each boundary."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str):
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] += time.perf_counter() - t0


class Reports(Protocol):
    """A part that reports its own figures to telemetry."""

    def snapshot(self) -> dict:
        """The part's figures now, JSON-ready, as `/v1/stats` reports them."""
        ...


class ExpertReports(Reports, Protocol):
    """The MoE runner as telemetry reads it: its figures (the miss split in force, the CPU jobs,
    the staged layer steps, the prefill buffer's bytes), its decode counters per MoE layer, read
    each second, the decode reads and misses so far, read each step, and the decode accesses
    (keys layer * E + expert, in the order the cache saw them), which it hands to an observer."""

    @property
    def counters(self) -> LayerCounters: ...

    @property
    def decode_reads(self) -> tuple[int, int]: ...

    def watch_accesses(self, observer: Callable[[np.ndarray], None]) -> None: ...


class StateSlots(Protocol):
    """A hybrid model's recurrent states (engine/model/states.py), or a sliding-window model's
    rings (window.py, with `ring_tokens`), as telemetry reads them: a slot per running
    sequence."""

    @property
    def num_slots(self) -> int: ...

    @property
    def used_slots(self) -> int: ...

    @property
    def bytes_per_slot(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class EngineState(Protocol):
    """What telemetry reads of the engine itself: its device, what a resize replaces (the memory
    plan, the KV cache, the usable context) and the settings in force."""

    device: torch.device
    plan: VramPlan
    kv: KVCache
    max_context: int

    def config_in_force(self) -> dict: ...


class Telemetry:
    """Everything the engine reports about itself, fed by the engine thread."""

    def __init__(
        self,
        spec: ModelSpec,
        engine: EngineState,
        experts: ExpertReports,
        cache: Reports,
        bank: Reports,
        scheduler: Reports,
        enabled: bool = True,
        states: StateSlots | None = None,
        devices: Callable[[], list[dict]] | None = None,
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.states = states
        # each device's part of the model (Engine.device_reports), where told
        self.devices = devices
        self.experts = experts
        self.cache = cache
        self.bank = bank
        self.scheduler = scheduler
        self.enabled = enabled
        self.started = time.time()
        self._t0 = time.monotonic()
        self.decode = RateWindow()
        self.prefill = RateWindow()
        self.ttft: deque[tuple[float, float]] = deque(maxlen=2000)
        self.completed = 0
        self.decode_tokens_total = 0
        self.prefill_tokens_total = 0
        self.whatif: StackDistances | None = None
        self._snapshots: deque[tuple[float, np.ndarray]] = deque()
        self.breakdown: dict[str, float] = {}
        self.miss_cost = MissCostFit()
        self._reads_seen = (0, 0)
        self._last_breakdown = 0.0
        self.timed_steps = 0  # decode steps run eagerly, phase by phase, for the breakdown
        if enabled:
            self.whatif = StackDistances(spec.num_moe_layers * spec.num_experts)
            experts.watch_accesses(self.whatif.add)

    # fed by the engine thread --------------------------------------------------------------------

    def want_timing(self) -> bool:
        """Whether the next decode step should be timed by phase (one every few seconds)."""
        return self.enabled and time.monotonic() - self._last_breakdown > BREAKDOWN_EVERY_S

    def on_step(self, decode_tokens: int, prefill_tokens: int, step_s: float,
                timer: StepTimer | None = None) -> None:  # fmt: skip
        now = time.monotonic()
        if decode_tokens:
            self.decode.add(decode_tokens, now)
            self.decode_tokens_total += decode_tokens
        if prefill_tokens:
            self.prefill.add(prefill_tokens, now)
            self.prefill_tokens_total += prefill_tokens
        if self.enabled:
            reads, misses = self.experts.decode_reads
            # a timed step runs its CPU part alone: its time is not what a miss costs
            if decode_tokens and not prefill_tokens and timer is None:
                seen_reads, seen_misses = self._reads_seen
                self.miss_cost.add(decode_tokens, misses - seen_misses, reads - seen_reads, step_s)
            self._reads_seen = reads, misses
        if timer is not None:
            self.timed_steps += 1
            self._last_breakdown = now
            shares = {name: timer.seconds[name] for name in PHASES}
            shares["other"] = max(0.0, step_s - sum(shares.values()))
            shares["step_s"] = step_s
            self.breakdown = shares
        if self.enabled and (not self._snapshots or now - self._snapshots[-1][0] >= 1.0):
            self._snapshots.append((now, self._counter_matrix()))
            while self._snapshots and self._snapshots[0][0] < now - 61:
                self._snapshots.popleft()

    def on_finish(self, seq) -> None:
        self.completed += 1
        if seq.first_token_time is not None:
            self.ttft.append((time.monotonic(), seq.first_token_time - seq.arrival_time))

    # reading ---------------------------------------------------------------------------------

    def _counter_matrix(self) -> np.ndarray:
        c = self.experts.counters
        return np.stack([c.reads, c.hits, c.fills, c.cpu]).copy()

    @staticmethod
    def _layers(matrix: np.ndarray, resident: list[int] | None = None) -> list[dict]:
        out = []
        for layer in range(matrix.shape[1]):
            row = {
                "layer": layer,
                "reads": int(matrix[0, layer]),
                "hits": int(matrix[1, layer]),
                "fills": int(matrix[2, layer]),
                "cpu": int(matrix[3, layer]),
            }
            if resident is not None:
                row["resident"] = resident[layer]
            out.append(row)
        return out

    def stats(
        self,
        *,
        running: int,
        queued: int,
        model_name: str,
        preempted: int = 0,
        paused: bool = False,
    ) -> dict:
        """/v1/stats: `running` and `queued` requests now, `preempted` since the start, `paused`
        while a cache resize holds the queued ones back."""
        engine = self.engine
        cache, experts, bank = self.cache.snapshot(), self.experts.snapshot(), self.bank.snapshot()
        now = time.monotonic()
        plan = engine.plan
        recent = [t for when, t in self.ttft if when >= now - 300] or [t for _, t in self.ttft]
        ttft_sorted = sorted(recent)
        throughput = {}
        for w in WINDOWS_S:
            throughput[f"decode_tok_s_{w}s"] = self.decode.rate(w, now, self._t0)
            throughput[f"prefill_tok_s_{w}s"] = self.prefill.rate(w, now, self._t0)
        kv = engine.kv
        weights = plan.weights_bytes
        fixed = self.states.nbytes if self.states is not None else 0
        rings = fixed if self.spec.sliding_layers else 0
        used_device = {
            "index": engine.device.index or 0,
            "total": plan.budget_bytes,
            "weights": weights,
            "kv": kv.nbytes + rings,
            "expert_cache": cache["bytes"],
            "prefill_buffer": experts["prefill_buffer_bytes"],
            "activations": plan.activation_bytes,
            "graphs": plan.graph_bytes,
            "states": fixed - rings,
        }
        if engine.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(engine.device)
            used_device["total"] = total
            accounted = sum(v for k, v in used_device.items() if k not in ("index", "total"))
            used_device["other"] = max(0, total - free - accounted)
        else:
            used_device["other"] = 0
        devices = self.devices() if self.devices is not None else None
        # a split's memory device by device (each report's own), else the one device's
        memory_devices = [used_device]
        if devices is not None and len(devices) > 1:
            memory_devices = [d.pop("memory") for d in devices]
        stats = {
            "model": model_name,
            "uptime_s": time.time() - self.started,
            "throughput": throughput,
            "requests": {
                "running": running,
                "queued": queued,
                "preempted": preempted,
                "paused": paused,
                "completed": self.completed,
                "ttft_mean_s": float(np.mean(ttft_sorted)) if ttft_sorted else None,
                "ttft_p95_s": float(ttft_sorted[int(0.95 * (len(ttft_sorted) - 1))])
                if ttft_sorted
                else None,
            },
            "tokens": {
                "decode_total": self.decode_tokens_total,
                "prefill_total": self.prefill_tokens_total,
            },
            "memory": {
                "device": memory_devices,
                "host_rss": _host_rss(),
                "expert_bank": bank["bytes"],
                "expert_bank_pinned_layers": bank["pinned_layers"],
                "plan": plan.to_dict(),
            },
            "kv": {
                "tokens_total": kv.capacity_tokens,
                "tokens_used": kv.used_blocks * kv.block_size,
                "tokens_peak": kv.peak_blocks_used * kv.block_size,
                "max_context": engine.max_context,
                "bytes_per_token": kv.bytes_per_token,
                "dtype": kv.fmt,
                "attention_layers": len(self.spec.paged_layers),
                "states": self._states(),
                "window": self._window(),
                "prefix_cache": self.scheduler.snapshot(),
            },
            "config": engine.config_in_force(),
        }
        if devices is not None:
            stats["devices"] = devices
        stats["experts"] = self._experts(now, cache, experts) if self.enabled else None
        stats["breakdown"] = dict(self.breakdown) if self.breakdown else None
        return stats

    def _states(self) -> dict | None:
        """A hybrid model's recurrent states (its state pool): the bytes a sequence's take, the
        slots in use and in all; None for a model without linear layers."""
        pool = self.states
        if pool is None or not self.spec.linear_layers:
            return None
        return {
            "linear_layers": len(self.spec.linear_layers),
            "bytes_per_seq": pool.bytes_per_slot,
            "slots_total": pool.num_slots,
            "slots_used": pool.used_slots,
            "bytes": pool.nbytes,
        }

    def _window(self) -> dict | None:
        """A sliding-window model's rings (its window pool): the layers, their window, the
        tokens and bytes a sequence keeps of them, the slots in use and in all; None for a model
        without sliding-window layers."""
        pool, spec = self.states, self.spec
        if pool is None or not spec.sliding_layers:
            return None
        return {
            "sliding_layers": len(spec.sliding_layers),
            "window": spec.sliding_window,
            "tokens_per_seq": pool.ring_tokens,
            "bytes_per_seq": pool.bytes_per_slot,
            "slots_total": pool.num_slots,
            "slots_used": pool.used_slots,
            "bytes": pool.nbytes,
        }

    def _experts(self, now: float, cache: dict, experts: dict) -> dict:
        """The expert section: the cache's and the runner's figures (their snapshots), the
        counters per layer in all and over the last minute, the what-if curve."""
        spec = self.spec
        current = self._counter_matrix()
        base = next((m for t, m in self._snapshots if t >= now - 60), None)
        window = current - base if base is not None else current
        reads_60 = window[0].sum()
        total = spec.experts_total
        slots = cache["slots"]
        sizes = sorted(
            {max(1, round(total * f / 24)) for f in range(1, 25)}
            | {slots}
            | {min(total, round(slots * 1.5)), min(total, slots * 2)}
        )
        whatif = self.whatif.curve([s for s in sizes if s > 0]) if self.whatif else []
        moe_layers = list(spec.moe_layers)
        return {
            "num_layers": spec.num_moe_layers,
            "layer_ids": moe_layers,
            # each MoE layer's token mixer: full_attention, or linear_attention (Gated DeltaNet)
            "layer_types": [spec.layer_types[layer] for layer in moe_layers],
            "num_experts": spec.num_experts,
            "top_k": spec.top_k,
            "slots": slots,
            "slot_bytes": cache["slot_bytes"],
            "dtype": cache["dtype"],
            "policy": experts["policy"],
            "layers": self._layers(current, cache["resident_per_layer"]),
            "window_60s": {"layers": self._layers(window)},
            "picks": self.experts.counters.picks.tolist(),
            "whatif": whatif,
            "whatif_accesses": self.whatif.accesses if self.whatif else 0,
            "hit_rate_60s": float(window[1].sum() / reads_60) if reads_60 else None,
            "hit_rate": float(current[1].sum() / current[0].sum()) if current[0].sum() else None,
            "cpu_jobs": experts["cpu_jobs"],
            "staged_layer_us": experts["staged_layer_us"],
            "miss_cost": self.miss_cost.to_dict(),
        }


def _host_rss() -> int:
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:
        return 0
