"""ExpertCache: S expert slots on the device shared by all MoE layers, least recently used out;
SlotFills: the copies of experts from the host bank into its slots.

The cache only decides which (layer, expert) lives in which slot; `SlotFills` copies the weights,
on the copy stream after the compute stream's work.

Its state is a few numpy arrays (the slot of each expert, the key and the last use of each slot,
the use clock and the counters), so that the native decode planner (kernels/cpu_experts.py,
`DecodePlanner`) can decide on the same state without Python (engine/experts/miss_plan.py says which
implementation is the specification).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ...kernels import mxfp4, nvfp4
from ..model.spec import blocks
from .bank import ExpertBank
from .h2d import HostToDevice

# the names under which the MoE kernels take an FP8 bank's block factors
SCALE_INV = ("w13_scale_inv", "w2_scale_inv")
# indices into ExpertCache.state (int64): the use clock, then the counters
TICK, HITS, FILLS, EVICTIONS = range(4)


class ExpertCache:
    """Slots of expert weights on the device, keyed by (MoE layer, expert), LRU eviction (with
    "frequency" admission, a rarer fill kept at the least recently used end)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        slots: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device,
        fmt: str = "bf16",
        *,
        bias: bool = False,
        swiglu_limit: float = 0.0,
        admission: str = "recent",
    ) -> None:
        self.num_layers = num_layers
        # where a decode step's fill goes in the recency order (--moe-cache-admission): "recent",
        # the most recently used end; "frequency", there unless the expert it evicts was picked
        # more often, in which case it keeps that expert's place at the least recently used end
        self.admission = admission
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.dtype = dtype  # the compute dtype; the slots' own where fmt is "bf16"
        # "fp8": the slots hold FP8 values and their block factors, "mxfp4" MXFP4 blocks and their
        # scales, "nvfp4" NVFP4 values, their block scales and their per-tensor scales (bank.py)
        self.fmt = fmt
        self.device = device
        self.w13 = torch.empty(0)
        self.w2 = torch.empty(0)
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        self.w13_scale_2: torch.Tensor | None = None
        self.w2_scale_2: torch.Tensor | None = None
        # gpt_oss: each slot's biases (fp32, as the bank's) and the clamped SwiGLU's limit (0:
        # SwiGLU)
        self.bias = bias
        self.swiglu_limit = swiglu_limit
        self.w13_bias: torch.Tensor | None = None
        self.w2_bias: torch.Tensor | None = None
        self.slot_of = np.full((num_layers, num_experts), -1, dtype=np.int32)
        # the same map on the device, for steps that look slots up without the host (CUDA graphs)
        self.slot_of_device = torch.full(
            (num_layers, num_experts), -1, dtype=torch.int32, device=device
        )
        # per slot: its key (layer * E + expert, -1 while free) and its last use (-1 while free:
        # free slots go first, the lowest first; then the least recently used)
        self.key_of_slot = np.empty(0, dtype=np.int64)
        self.last_use = np.empty(0, dtype=np.int64)
        self.state = np.zeros(4, dtype=np.int64)
        # bumped whenever the slot arrays are replaced (a planner holding their addresses is stale)
        self.version = 0
        self._layer_major: bool | None = None
        self._device_stale = False
        self._allocate(slots)

    # counters --------------------------------------------------------------------------------

    @property
    def hits(self) -> int:
        return int(self.state[HITS])

    @hits.setter
    def hits(self, value: int) -> None:
        self.state[HITS] = value

    @property
    def fills(self) -> int:
        return int(self.state[FILLS])

    @fills.setter
    def fills(self, value: int) -> None:
        self.state[FILLS] = value

    @property
    def evictions(self) -> int:
        return int(self.state[EVICTIONS])

    # sizes -----------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self.w13.shape[0]

    @property
    def slot_bytes(self) -> int:
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.tensors())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """The slots' tensors, in the order of `ExpertBank.layer_tensors`: w13, w2, for an FP8
        cache their factors (an MXFP4 or NVFP4 one's scales, NVFP4's per-tensor ones after),
        then any biases."""
        extra = (
            self.w13_scale, self.w2_scale, self.w13_scale_2, self.w2_scale_2, self.w13_bias,
            self.w2_bias,
        )  # fmt: skip
        return [self.w13, self.w2, *(t for t in extra if t is not None)]

    def kernel_args(self) -> dict[str, torch.Tensor | float]:
        """What the MoE kernels take beside the slots' weights: an FP8 cache's factors, an MXFP4
        or NVFP4 one's scales (moe_kernels.py), gpt_oss's biases and SwiGLU limit (nothing for a
        bf16 cache of another architecture)."""
        args: dict[str, torch.Tensor | float] = {}
        if self.w13_scale is not None and self.w2_scale is not None:
            names = SCALE_INV if self.fmt == "fp8" else ("w13_scale", "w2_scale")
            args.update(zip(names, (self.w13_scale, self.w2_scale), strict=True))
        if self.w13_scale_2 is not None and self.w2_scale_2 is not None:
            args.update(w13_scale_2=self.w13_scale_2, w2_scale_2=self.w2_scale_2)
        if self.w13_bias is not None and self.w2_bias is not None:
            args.update(w13_bias=self.w13_bias, w2_bias=self.w2_bias)
        if self.swiglu_limit:
            args["swiglu_limit"] = self.swiglu_limit
        return args

    @property
    def resident(self) -> int:
        return int(np.count_nonzero(self.key_of_slot >= 0))

    def resident_per_layer(self) -> list[int]:
        return [int(n) for n in (self.slot_of >= 0).sum(axis=1)]

    def snapshot(self) -> dict:
        """The cache's size and what each layer holds (telemetry's `Reports`)."""
        return {
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "dtype": self.fmt,
            "bytes": self.nbytes,
            "resident_per_layer": self.resident_per_layer(),
        }

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
        everything = self.num_layers * self.num_experts
        # the slot count first: asked once a decode step, where counting the resident slots
        # costs a host whose caches the CPU experts streamed cold tens of microseconds
        return self.slots >= everything and self.resident == everything

    # lookups ---------------------------------------------------------------------------------

    def lookup(self, layer: int, experts: list[int]) -> list[int]:
        """Slots of `experts` (-1 where missing); the ones found become most recently used, in
        the order given."""
        slots = self.slot_of[layer][experts].tolist()
        state, last_use = self.state, self.last_use
        for slot in slots:
            if slot >= 0:
                state[TICK] += 1
                last_use[slot] = state[TICK]
                state[HITS] += 1
        return slots

    def admit(
        self, layer: int, expert: int, protected: set[int], picks: np.ndarray | None = None
    ) -> int | None:
        """A slot for (layer, expert): a free one, else the least recently used unprotected one,
        whose expert is evicted.

        `protected` holds slots the current step still reads; None when every slot is protected.
        The caller copies the weights into the returned slot before using it. The slot becomes the
        most recently used, unless `picks` ([layers, experts] pick counts) is given and the
        evicted expert was picked more often than this one: then it keeps the evicted expert's
        place at the least recently used end, and the next fill takes it first (the
        "frequency" admission: a rare expert's fill does not push a more used one out next).
        """
        key = layer * self.num_experts + expert
        assert self.slot_of[layer, expert] < 0, "admitting an expert that is already resident"
        if protected:
            candidates = self.last_use.copy()
            candidates[list(protected)] = np.iinfo(np.int64).max
            slot = int(candidates.argmin())
            if slot in protected:
                return None
        else:
            slot = int(self.last_use.argmin())
        victim = int(self.key_of_slot[slot])
        keep_back = picks is not None and victim >= 0 and picks.flat[key] < picks.flat[victim]
        if victim >= 0:
            self._set(victim, -1)
            self.state[EVICTIONS] += 1
        self.key_of_slot[slot] = key
        self.state[TICK] += 1
        if not keep_back:  # (kept back: the slot keeps its last use, the evicted expert's)
            self.last_use[slot] = self.state[TICK]
        self._set(key, slot)
        self.state[FILLS] += 1
        return slot

    def _set(self, key: int, slot: int) -> None:
        layer, expert = divmod(key, self.num_experts)
        self.slot_of[layer, expert] = slot
        self.changed()

    def changed(self) -> None:
        """The slot map changed (here, or in the native planner): derived views are stale."""
        self._layer_major = None
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

    # sizing ----------------------------------------------------------------------------------

    def _allocate(self, slots: int) -> None:
        h, i, dev = self.hidden_size, self.intermediate_size, self.device
        values = torch.float8_e4m3fn if self.fmt == "fp8" else self.dtype
        shape13, shape2 = (slots, 2 * i, h), (slots, h, i)
        if self.fmt == "mxfp4":
            values, b = torch.uint8, mxfp4.BLOCK
            shape13, shape2 = (slots, 2 * i, h // b, b // 2), (slots, h, i // b, b // 2)
            self.w13_scale = torch.zeros(shape13[:3], dtype=values, device=dev)
            self.w2_scale = torch.zeros(shape2[:3], dtype=values, device=dev)
        if self.fmt == "nvfp4":
            values, b, e4m3 = torch.uint8, nvfp4.BLOCK, torch.float8_e4m3fn
            shape13, shape2 = (slots, 2 * i, h // 2), (slots, h, i // 2)
            self.w13_scale = torch.zeros((slots, 2 * i, h // b), dtype=e4m3, device=dev)
            self.w2_scale = torch.zeros((slots, h, i // b), dtype=e4m3, device=dev)
            self.w13_scale_2 = torch.zeros((slots, 2), dtype=torch.float32, device=dev)
            self.w2_scale_2 = torch.zeros((slots, 1), dtype=torch.float32, device=dev)
        self.w13 = torch.empty(shape13, dtype=values, device=dev)
        # zeroed: a split miss's slot (decode_planner.h) adds its down projection's columns past
        # the copied ones times zero, which must not be NaN in a slot never filled
        self.w2 = torch.zeros(shape2, dtype=values, device=dev)
        if self.fmt == "fp8":
            shape13, shape2 = (slots, blocks(2 * i), blocks(h)), (slots, blocks(h), blocks(i))
            self.w13_scale = torch.zeros(shape13, dtype=torch.float32, device=dev)
            self.w2_scale = torch.zeros(shape2, dtype=torch.float32, device=dev)
        if self.bias:
            self.w13_bias = torch.zeros((slots, 2 * i), dtype=torch.float32, device=dev)
            self.w2_bias = torch.zeros((slots, h), dtype=torch.float32, device=dev)
        self.key_of_slot = np.full(slots, -1, dtype=np.int64)
        self.last_use = np.full(slots, -1, dtype=np.int64)
        self.version += 1

    def resize(self, slots: int, refill: Callable[[int, int, int], None]) -> None:
        """Change the number of slots, keeping the most recently used experts that still fit.

        The old slots are freed first (so growing needs no room for both); `refill(layer, expert,
        slot)` copies each kept expert back from the host bank.
        """
        used = np.flatnonzero(self.key_of_slot >= 0)
        by_use = used[np.argsort(self.last_use[used], kind="stable")]
        keep = [(int(self.key_of_slot[s]), int(self.last_use[s])) for s in by_use]
        keep = keep[-slots:] if slots else []
        self.w13 = self.w2 = torch.empty(0)
        self.w13_scale = self.w2_scale = self.w13_bias = self.w2_bias = None
        self.w13_scale_2 = self.w2_scale_2 = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.slot_of.fill(-1)
        self.changed()
        self._allocate(slots)
        for slot, (key, last_use) in enumerate(keep):
            self.key_of_slot[slot] = key
            self.last_use[slot] = last_use
            self._set(key, slot)
            refill(*divmod(key, self.num_experts), slot)


class SlotFills:
    """Copies experts from the host bank into the cache's slots: on the copy stream, one driver
    call a matrix (`HostToDevice`: torch's copy_ costs the host several times more); at once
    without CUDA."""

    def __init__(
        self,
        bank: ExpertBank,
        cache: ExpertCache,
        copy_stream: torch.cuda.Stream | None,
        compute_stream: torch.cuda.Stream | None,
    ) -> None:
        self.bank = bank
        self.cache = cache
        self.copy_stream = copy_stream
        # the engine's stream (the device's current one), looked up once: the lookup costs more
        # than the small copies of a decode layer step
        self.compute_stream = compute_stream
        self._h2d = HostToDevice(copy_stream) if copy_stream is not None else None

    def copy(self, moe_layer: int, admitted: list[tuple[int, int]]) -> torch.cuda.Event | None:
        """Copy (expert, slot) pairs into their slots after the compute stream's queued work
        (which may still read the slots being refilled); returns the event that marks them
        done (None without CUDA, where the copies are done on return)."""
        stream = self.copy_stream
        if stream is None:
            self.queue(moe_layer, admitted)
            return None
        stream.wait_stream(self.compute_stream)
        self.queue(moe_layer, admitted)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def queue(self, moe_layer: int, admitted: list[tuple[int, int]]) -> None:
        """Queue the copies of (expert, slot) pairs on the copy stream without waiting for
        anything (done at once without CUDA)."""
        pairs = list(zip(self.cache.tensors(), self.bank.layer_tensors(moe_layer), strict=True))
        h2d = self._h2d
        if h2d is None:
            for expert, slot in admitted:
                for dst, src in pairs:
                    dst[slot].copy_(src[expert])
            return
        spans = []
        for dst, src in pairs:
            n = dst.stride(0) * dst.element_size()  # one expert's matrix, in bytes
            assert src.is_contiguous() and src.stride(0) == dst.stride(0)
            spans.append((dst.data_ptr(), src.data_ptr(), n))
        for expert, slot in admitted:
            for dst_ptr, src_ptr, n in spans:
                h2d.copy(dst_ptr + slot * n, src_ptr + expert * n, n)

    def refill(self, moe_layer: int, expert: int, slot: int) -> None:
        """Copy one expert into a slot and wait (cache resize, warm-up)."""
        event = self.copy(moe_layer, [(expert, slot)])
        if event is not None:
            event.synchronize()
