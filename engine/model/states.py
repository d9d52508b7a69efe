"""The recurrent state of the linear (Gated DeltaNet) layers: a pool of slots, one per running
sequence, beside the KV pages of the attention layers.

A slot holds, for every linear layer, the convolution state [W-1, C] (the last W-1 convolution
inputs, in the model's dtype) and the DeltaNet state [HV, DK, DV] (fp32), as
kernels/gated_deltanet.py reads and writes them. A slot is zeroed when it is taken: an all-zero
slot is the state of an empty prefix, so a sequence's prefill starts from it and every later chunk
or decode step continues from what the slot holds. Unlike a KV page, a state cannot be cut back
to an earlier token: it always holds the state after the sequence's last computed token.

So that a later prompt can resume from a prefix, the pool also keeps state checkpoints: copies of
a sequence's slot taken when its computed tokens reach a checkpoint's token count, each named by
the prefix it holds (the prefix cache's name of the prefix's last KV page, kv.py, and its token
count), kept in rows of their own and dropped least recently used first. A prompt whose cached
pages reach a checkpoint copies it into its slot and is prefilled from there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

import torch

from .spec import RECURRENT_STATE_BYTES, ModelSpec

RECURRENT_STATE_DTYPE = torch.float32
assert RECURRENT_STATE_DTYPE.itemsize == RECURRENT_STATE_BYTES


CheckpointName = tuple[int, int]  # (the prefix's last KV page's name hashed, its token count)


class SlotPool(ABC):
    """Per-sequence memory of a fixed size in `num_slots` slots, one more slot that takes a CUDA
    graph's padding rows, and `checkpoints` rows after it: copies of a slot named by the prefix
    it holds, kept for later prompts and dropped least recently used first. A subclass holds the
    memory (`_clear`, `_copy` of whole rows)."""

    def __init__(self, num_slots: int, checkpoints: int) -> None:
        assert num_slots >= 1 and checkpoints >= 0
        rows = num_slots + 1 + checkpoints
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.checkpoint_capacity = checkpoints
        self._kept: OrderedDict[CheckpointName, int] = OrderedDict()  # rows; least recent first
        self._spare = list(range(rows - 1, num_slots, -1))  # checkpoint rows holding none
        self.checkpoints_kept = self.checkpoints_resumed = 0  # counts since the start

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        """Take a free slot, cleared (the caller checks `free_slots` first)."""
        assert self._free, "slot allocation beyond the free slots"
        slot = self._free.pop()
        self._clear(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give a sequence's slot back."""
        assert 0 <= slot < self.num_slots and slot not in self._free, slot
        self._free.append(slot)

    @property
    def checkpoints_held(self) -> int:
        return len(self._kept)

    def has_checkpoint(self, name: CheckpointName) -> bool:
        return name in self._kept

    def keep(self, name: CheckpointName, slot: int) -> None:
        """Copy a sequence's slot into the checkpoint `name` (what it holds after that prefix),
        in a spare row or else in the least recently used checkpoint's; a checkpoint already
        kept under `name` holds that already and is only marked used."""
        if not self.checkpoint_capacity:
            return
        if name in self._kept:
            self._kept.move_to_end(name)
            return
        row = self._spare.pop() if self._spare else self._kept.popitem(last=False)[1]
        self._copy(slot, row)
        self._kept[name] = row
        self.checkpoints_kept += 1

    def resume(self, name: CheckpointName, slot: int) -> None:
        """Copy the checkpoint `name` (`has_checkpoint`) into a sequence's slot."""
        row = self._kept[name]
        self._kept.move_to_end(name)
        self._copy(row, slot)
        self.checkpoints_resumed += 1

    @abstractmethod
    def _clear(self, slot: int) -> None: ...

    @abstractmethod
    def _copy(self, src: int, dst: int) -> None: ...


class StatePool(SlotPool):
    """Convolution and DeltaNet states of every linear layer, in `num_slots` slots; one more
    slot, never handed out, takes the state updates of a CUDA graph's padding rows; and
    `checkpoints` rows after it for state checkpoints."""

    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
        checkpoints: int = 0,
    ) -> None:
        super().__init__(num_slots, checkpoints)
        linear = spec.linear_attention
        assert linear is not None and spec.linear_layers
        layers = len(spec.linear_layers)
        rows = num_slots + 1 + checkpoints
        self.conv = torch.zeros(
            (layers, rows, *linear.conv_state_shape()), device=device, dtype=dtype
        )
        self.recurrent = torch.zeros(
            (layers, rows, *linear.recurrent_state_shape()),
            device=device,
            dtype=RECURRENT_STATE_DTYPE,
        )
        self._row = {layer: row for row, layer in enumerate(spec.linear_layers)}

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's states over all linear layers (spec.state_bytes_per_seq)."""
        return (self.conv[:, 0].nbytes + self.recurrent[:, 0].nbytes) if self.num_slots else 0

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def _clear(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def _copy(self, src: int, dst: int) -> None:
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear layer's pools (by its index among all layers): conv [rows, W-1, C] and
        recurrent [rows, HV, DK, DV], rows the slots, the padding slot and the checkpoints."""
        row = self._row[layer]
        return self.conv[row], self.recurrent[row]
