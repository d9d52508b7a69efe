"""The recurrent state of the linear (Gated DeltaNet) layers: a pool of slots, one per running
sequence, beside the KV pages of the attention layers.

A slot holds, for every linear layer, the convolution state [W-1, C] (the last W-1 convolution
inputs, in the model's dtype) and the DeltaNet state [HV, DK, DV] (fp32), as
kernels/gated_deltanet.py reads and writes them. A slot is zeroed when it is taken: an all-zero
slot is the state of an empty prefix, so a sequence's prefill starts from it and every later chunk
or decode step continues from what the slot holds. Unlike a KV page, a state cannot be cut back
to an earlier token: it always holds the state after the sequence's last computed token.
"""

from __future__ import annotations

import torch

from .spec import RECURRENT_STATE_BYTES, ModelSpec

RECURRENT_STATE_DTYPE = torch.float32
assert RECURRENT_STATE_DTYPE.itemsize == RECURRENT_STATE_BYTES


class StatePool:
    """Convolution and DeltaNet states of every linear layer, in `num_slots` slots; one more
    slot, never handed out, takes the state updates of a CUDA graph's padding rows."""

    def __init__(
        self, spec: ModelSpec, num_slots: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        linear = spec.linear_attention
        assert linear is not None and spec.linear_layers and num_slots >= 1
        layers = len(spec.linear_layers)
        self.conv = torch.zeros(
            (layers, num_slots + 1, *linear.conv_state_shape()), device=device, dtype=dtype
        )
        self.recurrent = torch.zeros(
            (layers, num_slots + 1, *linear.recurrent_state_shape()),
            device=device,
            dtype=RECURRENT_STATE_DTYPE,
        )
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self._row = {layer: row for row, layer in enumerate(spec.linear_layers)}
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's states over all linear layers (spec.state_bytes_per_seq)."""
        return (self.conv[:, 0].nbytes + self.recurrent[:, 0].nbytes) if self.num_slots else 0

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def allocate(self) -> int:
        """Take a free slot, zeroed (the caller checks `free_slots` first)."""
        assert self._free, "state slot allocation beyond the free slots"
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        """Give a sequence's slot back."""
        assert 0 <= slot < self.num_slots and slot not in self._free, slot
        self._free.append(slot)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear layer's pools (by its index among all layers): conv [slots + 1, W-1, C] and
        recurrent [slots + 1, HV, DK, DV]."""
        row = self._row[layer]
        return self.conv[row], self.recurrent[row]
