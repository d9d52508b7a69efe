"""Layers split across devices (`--devices`): which device holds each decoder layer, and the one
place where a step's activations move from one device to the next.

Each device holds a contiguous range of layers (engine/config/split.py plans them) with their
dense weights; the first also the embedding, the last the final norm and the LM head. A step
crosses at the first layer of every range after the first: its residual stream, its rotary
tables and its inputs (positions, KV slots, pages, a decode step's ring tables) move once, and
the logits move back to the first device, where the sampler reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .model import DenseWeights, LayerWeights, StepBatch, StepState


@dataclass(frozen=True, slots=True)
class LayerPlacement:
    """Each device's range of layers, in device order (ranges contiguous from layer 0)."""

    devices: tuple[torch.device, ...]
    ranges: tuple[range, ...]

    def __post_init__(self) -> None:
        assert len(self.devices) == len(self.ranges) >= 2
        assert [i for r in self.ranges for i in r] == list(range(self.ranges[-1].stop))

    @property
    def crossings(self) -> frozenset[int]:
        """The layers where a step moves to the next device: each range's first but the first."""
        return frozenset(r.start for r in self.ranges[1:])

    def part_of(self, layer: int) -> int:
        """The index of the device that holds `layer`."""
        return next(d for d, r in enumerate(self.ranges) if layer in r)

    def device_of(self, layer: int) -> torch.device:
        return self.devices[self.part_of(layer)]

    def moe_ranges(self, moe_layers: tuple[int, ...]) -> tuple[range, ...]:
        """Each device's MoE layers, by their index among the MoE layers."""
        out, start = [], 0
        for span in self.ranges:
            count = sum(1 for layer in moe_layers if layer in span)
            out.append(range(start, start + count))
            start += count
        return tuple(out)

    # moving --------------------------------------------------------------------------------------

    @staticmethod
    def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`t` on `device`: the one copy between devices. Between GPUs the copy engine takes the
        peer path where the driver allows one, else it stages through host memory; the stream
        orders it after the producing kernels either way."""
        return t.to(device, non_blocking=True)

    def to_first(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the first device, which is the current one again from here."""
        t = self.move(t, self.devices[0])
        self.begin()
        return t

    def begin(self) -> None:
        """A step starts on the first device (after a step that failed on another, too)."""
        _enter(self.devices[0])

    def enter(self, part: int) -> None:
        """Make device `part` the current one (a split's decode graphs capture and replay each
        device's graph with its device current)."""
        _enter(self.devices[part])

    def cross(self, layer: int, state: StepState) -> None:
        """Move a step's state to the device of `layer` (the first layer of its range), which is
        the current device from here."""
        device = self.device_of(layer)
        _enter(device)
        move = self.move
        assert state.hidden is not None
        state.hidden = move(state.hidden, device)
        if state.residual is not None:
            state.residual = move(state.residual, device)
        if state.rope is not None:
            state.rope = (move(state.rope[0], device), move(state.rope[1], device))
        state.batch = self.batch_on(state.batch, device)

    def batch_on(self, batch: StepBatch, device: torch.device) -> StepBatch:
        """The step's inputs on `device`. A prompt's scoring is moved in place: the model sets
        its results there for the caller, on the last device."""
        move = self.move

        def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else move(t, device)

        if batch.scoring is not None:
            batch.scoring.rows = move(batch.scoring.rows, device)
            batch.scoring.targets = move(batch.scoring.targets, device)
        return replace(
            batch,
            input_ids=move(batch.input_ids, device),
            positions=move(batch.positions, device),
            slots=move(batch.slots, device),
            seqs=[replace(s, pages=maybe(s.pages)) for s in batch.seqs],
            logits_index=move(batch.logits_index, device),
            block_tables=maybe(batch.block_tables),
            seq_lens=maybe(batch.seq_lens),
            state_slots=maybe(batch.state_slots),
            ring_slots=maybe(batch.ring_slots),
            ring_tables=maybe(batch.ring_tables),
        )

    def place(self, dense: DenseWeights) -> DenseWeights:
        """The dense weights on their devices: each layer's on its own, the embedding on the
        first, the final norm and the LM head on the last (a tied head is copied there)."""
        first, last = self.devices[0], self.devices[-1]
        layers = [_layer_on(layer, self.device_of(i)) for i, layer in enumerate(dense.layers)]
        return DenseWeights(
            embed=dense.embed.to(first),
            lm_head=dense.lm_head.to(last),
            final_norm=dense.final_norm.to(last),
            layers=layers,
        )


def _enter(device: torch.device) -> None:
    """Make `device` the current one: a Triton kernel launches on the current device and its
    stream, whatever device its tensors are on."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _layer_on(layer: LayerWeights, device: torch.device) -> LayerWeights:
    values = {}
    for name in LayerWeights.__slots__:
        t = getattr(layer, name)
        values[name] = None if t is None else t.to(device)
    return LayerWeights(**values)
