"""CUDA graphs of whole decode steps while every expert is resident.

An offloaded MoE step needs the host to see the routing and choose copies, so it cannot sit inside a
graph; when every expert is in the cache the whole step can, and replaying it removes the launch and
Python overhead of a few hundred small kernels per token. One graph per padded batch size; padding
rows write their KV into a scratch block and attend to nothing.
"""

from __future__ import annotations

import logging

import torch

from .model import Model, SeqSlice, StepBatch

log = logging.getLogger("moelab.graphs")


class DecodeGraphs:
    """Captured decode steps for batch sizes up to `max_bs`, replayed with the batch's inputs."""

    def __init__(self, model: Model, max_bs: int, max_context: int) -> None:
        self.model = model
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _batch(self, bs: int) -> StepBatch:
        return StepBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], slots=self.slots[:bs],
            seqs=[SeqSlice(i, 1, 1, []) for i in range(bs)], logits_index=self.logits_index[:bs],
            block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
        )  # fmt: skip

    def capture(self) -> None:
        """Capture every batch size (largest first, so the smaller ones share its memory pool)."""
        model = self.model
        stream = torch.cuda.Stream(model.device)
        stream.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(stream):
            # compile every kernel specialization and settle the allocator before capturing
            for bs in self.sizes:
                for _ in range(2):
                    model.forward(self._batch(bs))
        torch.cuda.current_stream(model.device).wait_stream(stream)
        for bs in sorted(self.sizes, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = model.forward(self._batch(bs))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(model.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def fits(self, batch: StepBatch) -> bool:
        return (batch.block_tables is not None and len(batch.seqs) <= self.max_bs
                and batch.block_tables.shape[1] <= self.max_blocks)  # fmt: skip

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Replay the graph of the smallest captured size that holds `batch`; logits [n, vocab]."""
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
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
