"""The routed experts of a model split across devices (`--devices`): one `MoERunner` per device
over its layers' part of the bank and an expert cache of its own, filled over its own link, and
the CPU expert workers shared by all (one layer runs at a time). A device whose layers are all
dense (a model's dense layers before its MoE ones, say) has neither: its runner and cache are
None.

`SplitExperts` and `SplitCache` show the engine, the step loop and telemetry one runner and one
cache, as a single device's would: a MoE layer goes to its device's runner under its index
there, and the figures are the devices' together (counters per layer in model order, slots and
bytes summed)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .cache import ExpertCache
from .misses import MissPolicy
from .moe import MoERunner
from .moe_stats import CpuJobTimes, LayerCounters, StagedStepTimes


class SplitExperts:
    """The devices' MoE runners, each over a contiguous range of MoE layers (`ranges`, by index
    among the MoE layers, in device order; None for a device with no MoE layer)."""

    def __init__(
        self, runners: list[MoERunner | None], ranges: tuple[range, ...], counters: LayerCounters
    ) -> None:
        """`counters`: the model's decode counters, whose rows each runner counts into
        (`counter_rows`)."""
        assert len(runners) == len(ranges) >= 2
        assert all((r is None) == (not span) for r, span in zip(runners, ranges, strict=True))
        self.runners = runners
        self.ranges = ranges
        # the runners of the devices that have MoE layers, in device order
        self._live = [r for r in runners if r is not None]
        self._counters = counters
        self._runner_of = [
            (r, m - span.start) for r, span in zip(runners, ranges, strict=True) for m in span
        ]
        # one set of CPU job and staged step timings for all: the CPU workers are shared
        self.cpu_times = CpuJobTimes()
        self.staged_times = StagedStepTimes()
        self._timer = None

    # the model's executor (model.py ExpertExecutor) ----------------------------------------------

    def forward(self, moe_layer, x, ids, weights, *, decode: bool) -> torch.Tensor:
        runner, local = self._runner_of[moe_layer]
        return runner.forward(local, x, ids, weights, decode=decode)

    def routing_record(self, moe_layer: int, tokens: int, decode: bool) -> torch.Tensor | None:
        runner, local = self._runner_of[moe_layer]
        return runner.routing_record(local, tokens, decode)

    def record_rows_from(self, row: int) -> None:
        """Write the resident decode routing that follows into the step's record from row `row`
        on: a micro-batch's rows keep their place (engine/runtime/microbatch.py)."""
        for runner in self._live:
            runner.resident_routing.offset = row

    # what the engine, the step loop and telemetry read --------------------------------------------

    @property
    def timer(self):
        return self._timer

    @timer.setter
    def timer(self, timer) -> None:
        self._timer = timer
        for runner in self._live:
            runner.timer = timer

    @property
    def cpu_times(self) -> CpuJobTimes:
        return self._cpu_times

    @cpu_times.setter
    def cpu_times(self, times: CpuJobTimes) -> None:
        self._cpu_times = times
        for runner in self._live:
            runner.cpu_times = times

    @property
    def staged_times(self) -> StagedStepTimes:
        return self._staged_times

    @staged_times.setter
    def staged_times(self, times: StagedStepTimes) -> None:
        self._staged_times = times
        for runner in self._live:
            runner.staged_times = times

    @property
    def policy(self) -> MissPolicy:
        """The first MoE device's miss split (each device's follows its own link)."""
        return self._live[0].policy

    @property
    def prefetch_rounds(self) -> int:
        return self._live[0].prefetch_rounds

    @property
    def copy_ahead(self) -> float:
        return self._live[0].copy_ahead

    @property
    def prefill_stream_min_tokens(self) -> int:
        return self._live[0].prefill_stream_min_tokens

    @prefill_stream_min_tokens.setter
    def prefill_stream_min_tokens(self, tokens: int) -> None:
        for runner in self._live:
            runner.prefill_stream_min_tokens = tokens

    def snapshot(self) -> dict:
        return {**self._live[0].snapshot(), "prefill_buffer_bytes": self.stage_bytes}

    def watch_accesses(self, observer: Callable[[np.ndarray], None]) -> None:
        """Hand every device's decode accesses to `observer`, keyed by the model's MoE layers."""
        num_experts = self._live[0].bank.num_experts
        for runner, span in zip(self.runners, self.ranges, strict=True):
            if runner is None:
                continue
            base = span.start * num_experts
            runner.watch_accesses(lambda keys, base=base: observer(keys + base))

    @property
    def decode_reads(self) -> tuple[int, int]:
        reads = [runner.decode_reads for runner in self._live]
        return sum(r for r, _ in reads), sum(m for _, m in reads)

    @property
    def counters(self) -> LayerCounters:
        """The model's decode counters per MoE layer, up to date (the runners count into their
        rows)."""
        self.count_backlog()
        return self._counters

    def count_backlog(self) -> None:
        for runner in self._live:
            runner.count_backlog()

    def snapshot_decode_ids(self, tokens: int) -> tuple | None:
        snapshots = tuple(
            None if runner is None else runner.snapshot_decode_ids(tokens)
            for runner in self.runners
        )
        return None if all(s is None for s in snapshots) else snapshots

    def after_decode_step(self, snapshot: tuple | None, settled: bool = True) -> None:
        for d, runner in enumerate(self.runners):
            if runner is not None:
                runner.after_decode_step(None if snapshot is None else snapshot[d], settled)

    def reset_prefill(self) -> None:
        for runner in self._live:
            runner.reset_prefill()

    def defer_host_work(self, work: Callable[[], None]) -> None:
        self._live[0].defer_host_work(work)

    def run_host_work(self) -> None:
        for runner in self._live:
            runner.run_host_work()

    # settings between runs -------------------------------------------------------------------

    def set_prefetch_rounds(self, rounds: int) -> None:
        for runner in self._live:
            runner.set_prefetch_rounds(rounds)

    def set_copy_ahead(self, share: float) -> None:
        for runner in self._live:
            runner.set_copy_ahead(share)

    def set_cache_admission(self, mode: str) -> None:
        for runner in self._live:
            runner.set_cache_admission(mode)

    def guess_lead_seconds(self) -> float:
        return max(runner.guess_lead_seconds() for runner in self._live)

    # prefill buffers -----------------------------------------------------------------------------

    @property
    def stage_bytes(self) -> int:
        return sum(runner.stage_bytes for runner in self._live)

    def allocate_prefill_buffers(self) -> None:
        for runner in self._live:
            runner.allocate_prefill_buffers()

    def release_prefill_buffers(self) -> None:
        for runner in self._live:
            runner.release_prefill_buffers()


def counter_rows(counters: LayerCounters, span: range) -> LayerCounters:
    """The rows of `span`'s MoE layers: views, so that a device's runner counts into the
    model's counters (the native planner holds the picks' address, so they are never
    replaced)."""
    rows = slice(span.start, span.stop)
    return LayerCounters(
        *(getattr(counters, name)[rows] for name in ("reads", "hits", "fills", "cpu", "picks"))
    )


class SplitCache:
    """The devices' expert caches, each of its own device's MoE layers (None for a device with
    no MoE layer)."""

    def __init__(self, caches: list[ExpertCache | None]) -> None:
        self.caches = caches
        self._live = [cache for cache in caches if cache is not None]

    @property
    def slots(self) -> int:
        return sum(cache.slots for cache in self._live)

    @property
    def holds_everything(self) -> bool:
        return all(cache.holds_everything for cache in self._live)

    def device_slot_map(self) -> list[torch.Tensor]:
        """Each device's (layer, expert) -> slot map on its device, uploaded where it changed
        (of the devices with MoE layers)."""
        return [cache.device_slot_map() for cache in self._live]

    @property
    def hits(self) -> int:
        return sum(cache.hits for cache in self._live)

    @property
    def fills(self) -> int:
        return sum(cache.fills for cache in self._live)

    def snapshot(self) -> dict:
        parts = [cache.snapshot() for cache in self._live]
        return {
            **parts[0],
            "slots": self.slots,
            "bytes": sum(p["bytes"] for p in parts),
            "resident_per_layer": [n for p in parts for n in p["resident_per_layer"]],
        }

    def device_slots(self) -> list[dict]:
        """Each device's cache as /v1/stats reports it under `devices`."""
        return [
            {"slots": 0, "bytes": 0, "resident": 0}
            if cache is None
            else {"slots": cache.slots, "bytes": cache.nbytes, "resident": cache.resident}
            for cache in self.caches
        ]
