"""Micro-batch pipelining of a split's decode step (`--devices`, `--split-microbatches`).

Unpipelined, a split's decode step runs the first device's layers for the whole batch, moves the
activations, then the next device's layers: each device idles while another works. Pipelined, the
step's rows are cut into micro-batches (engine/config/split.py `microbatch_rows`), each run
through every device before the next starts (`launch_order`): with each device's work on its own
stream and the launches asynchronous, device 0 runs micro-batch 1 while device 1 runs micro-batch
0. A micro-batch's rows keep their own KV pages, state slots and window rings, and its MoE layers
route and miss on their own, so the step's tokens are the unpipelined step's (its logits within
rounding: a matmul of fewer rows may sum in another order).

`Pipelining` decides the micro-batches of a step and counts what ran (`/v1/stats` `devices`);
`forward_in_microbatches` is the eager step, resident or offloaded. A resident split's decode
graphs pipeline with the same rows and order; an offloaded split's pieces run whole
(engine/runtime/split_graphs.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config.split import launch_order, microbatch_count, microbatch_rows
from ..experts.split_experts import SplitExperts
from ..model.model import Model, StepBatch, StepState
from ..model.placement import LayerPlacement


class Pipelining:
    """A split's micro-batches: `setting` (--split-microbatches; None: by the step's rows), and
    what the decode steps so far ran in."""

    def __init__(self, setting: int | None) -> None:
        self.setting = setting
        self.last = 1  # micro-batches of the last decode step
        self.steps = 0  # decode steps run in two micro-batches or more

    def rows(self, rows: int) -> tuple[range, ...]:
        """Each micro-batch's rows of a decode step of `rows` rows."""
        return microbatch_rows(rows, microbatch_count(self.setting, rows))

    def ran(self, count: int) -> None:
        """A decode step ran in `count` micro-batches."""
        self.last = count
        self.steps += count > 1

    def report(self) -> dict:
        """What `/v1/stats` reports under each of the split's `devices`."""
        return {"microbatches": self.last, "pipelined_steps": self.steps}

    def forward(self, model: Model, batch: StepBatch) -> torch.Tensor:
        """Logits of `batch`: a decode step in micro-batches, a prefill whole."""
        if not batch.decode:
            return model.forward(batch)
        rows = self.rows(len(batch.seqs))
        self.ran(len(rows))
        if len(rows) == 1:
            return model.forward(batch)
        return forward_in_microbatches(model, batch, rows)


def row_batch(batch: StepBatch, rows: range) -> StepBatch:
    """The rows `rows` of a decode step as a step of their own (a decode step has one token a
    row, each one's logits wanted)."""
    span = slice(rows.start, rows.stop)

    def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[span]

    return StepBatch(
        input_ids=batch.input_ids[span],
        positions=batch.positions[span],
        slots=batch.slots[span],
        seqs=[replace(s, q_start=s.q_start - rows.start) for s in batch.seqs[span]],
        logits_index=batch.logits_index[span] - rows.start,
        block_tables=maybe(batch.block_tables),
        seq_lens=maybe(batch.seq_lens),
        state_slots=maybe(batch.state_slots),
    )


@torch.inference_mode()
def forward_in_microbatches(
    model: Model, batch: StepBatch, rows: tuple[range, ...]
) -> torch.Tensor:
    """A split's decode step in the micro-batches `rows`, launched in `launch_order`: each
    device's range of layers on its rows (its MoE layers routed, fetched and run on the CPU for
    them alone), the stream crossing each boundary once per micro-batch; the logits, in row order,
    on the first device."""
    placement = model.placement
    assert isinstance(placement, LayerPlacement)
    experts = model.experts
    assert isinstance(experts, SplitExperts)
    states: list[StepState] = []
    logits: list[torch.Tensor] = []
    try:
        for micro, part in launch_order(len(placement.devices), len(rows)):
            # the resident routing record keeps each micro-batch's rows in their place
            experts.record_rows_from(rows[micro].start)
            span = placement.ranges[part]
            if part == 0:
                placement.begin()
                states.append(StepState(row_batch(batch, rows[micro])))
            else:
                placement.cross(span.start, states[micro])
            state = states[micro]
            model.run_layers(span, state)
            if span.stop == model.spec.num_layers:
                assert state.logits is not None
                logits.append(state.logits)
    finally:
        experts.record_rows_from(0)
        placement.begin()
    # back to the first device in one copy once every micro-batch is launched: a copy per
    # micro-batch would hold the first device until the last had finished that micro-batch
    return placement.to_first(torch.cat(logits))
