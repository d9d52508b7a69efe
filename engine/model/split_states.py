"""A split model's per-sequence states (`--devices` with a hybrid or sliding-window model):
each device's linear layers keep their recurrent states, and its sliding-window layers their
rings, on that device, in slots and checkpoint rows numbered alike on all of them, so that one
pool's bookkeeping (free slots, checkpoints by name) serves every device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .spec import ModelSpec
from .states import RECURRENT_STATE_DTYPE, StatePool
from .window import WindowPool

# the device of the whole pool's tensors: shapes without memory, so that the pool's bookkeeping
# (and its byte counts) hold while the states themselves live in the devices' parts
_NOWHERE = torch.device("meta")


class SplitStatePool(StatePool):
    """StatePool's slots and checkpoints over the devices' parts: a part per device of its
    linear layers' conv and recurrent states (`parts`: each device with its range of layers)."""

    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        parts: Sequence[tuple[torch.device, range]],
        dtype: torch.dtype,
        checkpoints: int = 0,
    ) -> None:
        super().__init__(spec, num_slots, _NOWHERE, dtype, checkpoints)
        linear = spec.linear_attention
        assert linear is not None
        rows = num_slots + 1 + checkpoints
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._part_row: dict[int, tuple[int, int]] = {}
        for device, span in parts:
            layers = [layer for layer in spec.linear_layers if layer in span]
            for row, layer in enumerate(layers):
                self._part_row[layer] = (len(self._parts), row)
            conv_shape, state_shape = linear.conv_state_shape(), linear.recurrent_state_shape()
            self._parts.append(
                (
                    torch.zeros((len(layers), rows, *conv_shape), device=device, dtype=dtype),
                    torch.zeros(
                        (len(layers), rows, *state_shape),
                        device=device,
                        dtype=RECURRENT_STATE_DTYPE,
                    ),
                )
            )

    def allocate(self) -> int:
        slot = super().allocate()
        for conv, recurrent in self._parts:
            conv[:, slot].zero_()
            recurrent[:, slot].zero_()
        return slot

    def _copy(self, src: int, dst: int) -> None:
        for conv, recurrent in self._parts:
            conv[:, dst].copy_(conv[:, src])
            recurrent[:, dst].copy_(recurrent[:, src])

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, row = self._part_row[layer]
        conv, recurrent = self._parts[part]
        return conv[row], recurrent[row]

    def part_bytes(self) -> list[int]:
        """Each device's states, in device order."""
        return [conv.nbytes + recurrent.nbytes for conv, recurrent in self._parts]


class SplitWindowPool(WindowPool):
    """WindowPool's slots and checkpoints over the devices' parts: a window pool per device of
    its sliding layers' rings (`parts`: each device with its range of layers), whose own slot
    bookkeeping goes unused. A decode step's ring tables (`decode_pages`) are the same on every
    device; a layer's rings, and a prefill's pages for them, are its part's (`ring_of`)."""

    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        block_size: int,
        parts: Sequence[tuple[torch.device, range]],
        dtype: torch.dtype,
        checkpoints: int = 0,
        cache_dtype: str = "auto",
    ) -> None:
        super().__init__(spec, num_slots, block_size, _NOWHERE, dtype, checkpoints, cache_dtype)
        self.parts = []
        for device, span in parts:
            layers = tuple(layer for layer in spec.sliding_layers if layer in span)
            self.parts.append(WindowPool(spec, num_slots, block_size, device, dtype, checkpoints,
                                         cache_dtype, layers))  # fmt: skip

    def ring_of(self, layer: int) -> tuple[WindowPool, int] | None:
        return next((found for part in self.parts if (found := part.ring_of(layer))), None)

    def _copy(self, src: int, dst: int) -> None:
        for part in self.parts:
            part._copy(src, dst)

    def part_bytes(self) -> list[int]:
        """Each device's rings, in device order."""
        return [part.nbytes for part in self.parts]
