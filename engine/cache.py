"""ExpertCache: S expert slots on the device shared by all MoE layers, least recently used out.

The cache only decides which (layer, expert) lives in which slot; copying weights into a slot is the
MoE step's job (`engine/moe.py`), which knows the streams.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch


class ExpertCache:
    """Slots of expert weights on the device, keyed by (MoE layer, expert), LRU eviction."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        slots: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.dtype = dtype
        self.device = device
        self.w13 = torch.empty(0)
        self.w2 = torch.empty(0)
        self.slot_of = np.full((num_layers, num_experts), -1, dtype=np.int32)
        # the same map on the device, for steps that look slots up without the host (CUDA graphs)
        self.slot_of_device = torch.full(
            (num_layers, num_experts), -1, dtype=torch.int32, device=device
        )
        self._lru: OrderedDict[int, int] = OrderedDict()  # key (layer * E + expert) -> slot
        self._free: list[int] = []
        self._layer_major: bool | None = None
        self._device_stale = False
        self.hits = 0
        self.fills = 0
        self.evictions = 0
        self._allocate(slots)

    # sizes ---------------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self.w13.shape[0]

    @property
    def slot_bytes(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size * self.w13.element_size()

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    @property
    def resident(self) -> int:
        return len(self._lru)

    def resident_per_layer(self) -> list[int]:
        return [int(n) for n in (self.slot_of >= 0).sum(axis=1)]

    @property
    def layer_major(self) -> bool:
        """Every expert resident, (layer m, expert e) in slot m * E + e."""
        if not self.holds_everything:
            return False
        if self._layer_major is None:
            expected = np.arange(self.num_layers * self.num_experts).reshape(self.slot_of.shape)
            self._layer_major = bool((self.slot_of == expected).all())
        return self._layer_major

    @property
    def holds_everything(self) -> bool:
        return self.resident == self.num_layers * self.num_experts

    # lookups -------------------------------------------------------------------------------------

    def lookup(self, layer: int, experts: list[int]) -> list[int]:
        """Slots of `experts` (-1 where missing); the ones found become most recently used."""
        slots = self.slot_of[layer][experts].tolist()
        base = layer * self.num_experts
        lru = self._lru
        for expert, slot in zip(experts, slots, strict=True):
            if slot >= 0:
                lru.move_to_end(base + expert)
                self.hits += 1
        return slots

    def admit(self, layer: int, expert: int, protected: set[int]) -> int | None:
        """A slot for (layer, expert), evicting the least recently used unprotected entry.

        `protected` holds slots the current step still reads; None when every slot is protected.
        The caller copies the weights into the returned slot before using it.
        """
        key = layer * self.num_experts + expert
        assert key not in self._lru, "admitting an expert that is already resident"
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._lru.items() if s not in protected), None)
            if victim is None:
                return None
            slot = self._lru.pop(victim)
            self._set(victim, -1)
            self.evictions += 1
        self._lru[key] = slot
        self._set(key, slot)
        self.fills += 1
        return slot

    def _set(self, key: int, slot: int) -> None:
        self._layer_major = None
        layer, expert = divmod(key, self.num_experts)
        self.slot_of[layer, expert] = slot
        self._device_stale = True

    def device_slot_map(self) -> torch.Tensor:
        """The (layer, expert) -> slot map on the device, uploaded only after it changed.

        The offloaded step decides on the host; only the all-resident path (and its CUDA graphs,
        which keep this tensor's address) reads the device copy.
        """
        if self._device_stale:
            self.slot_of_device.copy_(torch.from_numpy(self.slot_of))
            self._device_stale = False
        return self.slot_of_device

    # sizing --------------------------------------------------------------------------------------

    def _allocate(self, slots: int) -> None:
        h, i = self.hidden_size, self.intermediate_size
        self.w13 = torch.empty((slots, 2 * i, h), dtype=self.dtype, device=self.device)
        self.w2 = torch.empty((slots, h, i), dtype=self.dtype, device=self.device)
        self._free = list(range(slots - 1, -1, -1))

    def resize(self, slots: int, refill: Callable[[int, int, int], None]) -> None:
        """Change the number of slots, keeping the most recently used experts that still fit.

        The old slots are freed first (so growing needs no room for both); `refill(layer, expert,
        slot)` copies each kept expert back from the host bank.
        """
        keep = list(self._lru.keys())[-slots:] if slots else []
        self.w13 = self.w2 = torch.empty(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.slot_of.fill(-1)
        self._device_stale = True
        self._lru.clear()
        self._allocate(slots)
        for key in keep:
            slot = self._free.pop()
            self._lru[key] = slot
            self._set(key, slot)
            refill(*divmod(key, self.num_experts), slot)
