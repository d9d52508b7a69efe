"""The all-resident decode path's routing, for telemetry: recorded on the device inside the step,
copied to the host without waiting, counted in batches off the per-step path.

The router writes each layer's expert ids straight into a column of the step's device record
(`record`), so recording costs no kernel and is safe inside a CUDA graph. After the step is
queued, `snapshot` queues one copy of the whole record to pinned host memory; two host buffers
take turns, so one step's copy can land while the previous step's is read. Once the step has
synchronized, its snapshot is kept (`keep`), and `count` adds many kept steps to the counters at
once: picks, reads (every read of a resident step is a hit), and the access stream.
"""

from __future__ import annotations

import numpy as np
import torch

from .moe_stats import LayerCounters

# Decode rows whose routing is recorded (a decode batch is smaller)
MAX_RECORDED_ROWS = 1024
# Kept steps before they are counted, when nothing reads the counters sooner
COUNT_EVERY_STEPS = 64


class ResidentRouting:
    """The routing of all-resident decode steps, from the device record to the counters."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: torch.device):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.device = device
        self._ids_dev: torch.Tensor | None = None
        self._ids_host: torch.Tensor | None = None
        self._ids_buffer = 0
        self._backlog: list[np.ndarray] = []
        # the step's row the routing written next starts at (a split's decode step in
        # micro-batches writes each micro-batch's rows in their place: engine/runtime/microbatch.py)
        self.offset = 0

    def record(self, moe_layer: int, tokens: int) -> torch.Tensor | None:
        """Where the router writes one layer's expert ids of a step of `tokens` rows: its column
        of the device record. None for a batch larger than the record."""
        start = self.offset
        if start + tokens > MAX_RECORDED_ROWS:
            return None
        if self._ids_dev is None:  # first met in an eager step, before any graph is captured
            self._ids_dev = torch.zeros((MAX_RECORDED_ROWS, self.num_layers, self.top_k),
                                        dtype=torch.int32, device=self.device)  # fmt: skip
        return self._ids_dev[start : start + tokens, moe_layer]

    def store(self, moe_layer: int, ids: torch.Tensor) -> None:
        """Put one layer's routing in the device record, unless the router wrote it there already
        (`record`). No host sync (the step may be inside a CUDA graph)."""
        # of a larger batch, the first rows
        rows = min(ids.shape[0], MAX_RECORDED_ROWS - self.offset)
        if rows <= 0:
            return
        record = self.record(moe_layer, rows)
        assert record is not None
        if record.data_ptr() != ids.data_ptr():
            record.copy_(ids[:rows])

    def snapshot(self, tokens: int) -> tuple[torch.Tensor, int] | None:
        """Queue the copy of a queued step's record to pinned host memory (no wait); None when no
        step has written the record yet."""
        if self._ids_dev is None:
            return None
        if self._ids_host is None:
            pin = self.device.type == "cuda"
            self._ids_host = torch.empty((2, *self._ids_dev.shape), dtype=torch.int32,
                                         pin_memory=pin)  # fmt: skip
        rows = min(tokens, MAX_RECORDED_ROWS)
        host = self._ids_host[self._ids_buffer, :rows]
        self._ids_buffer ^= 1
        host.copy_(self._ids_dev[:rows], non_blocking=True)
        return host, rows

    def keep(self, snapshot: tuple[torch.Tensor, int]) -> bool:
        """Keep a synchronized step's snapshot; True when enough are kept to count them."""
        host, _ = snapshot
        self._backlog.append(host.numpy().transpose(1, 0, 2).copy())  # [layers, tokens, k]
        return len(self._backlog) >= COUNT_EVERY_STEPS

    def count(self, counters: LayerCounters) -> np.ndarray | None:
        """Add the kept steps to the counters; returns their accesses (keys layer * E + expert,
        per step layer-major with experts ascending: the cache's order), None with none kept."""
        if not self._backlog:
            return None
        layers, experts = self.num_layers, self.num_experts
        per_step = layers * experts
        layer_base = (np.arange(layers, dtype=np.int64) * experts)[:, None, None]
        rows_per_step = self._backlog
        keys = np.concatenate([
            (step * per_step + layer_base + rows).ravel() for step, rows in enumerate(rows_per_step)
        ])  # fmt: skip
        self._backlog = []
        counters.picks.reshape(-1)[:] += np.bincount(keys % per_step, minlength=per_step)
        seen = np.zeros(len(rows_per_step) * per_step, dtype=bool)
        seen[keys] = True
        unique = np.flatnonzero(seen)
        reads = np.bincount((unique % per_step) // experts, minlength=layers)
        counters.reads += reads
        counters.hits += reads
        return unique % per_step
