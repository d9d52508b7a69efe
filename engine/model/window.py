"""The keys and values of the sliding-window layers (gpt-oss's `ModelSpec.sliding_layers`): per
running sequence a ring of the last tokens, the window in whole pages, instead of pages for the
whole context; the paged KV cache (kv.py) holds the other attention layers.

A sequence's slot is `pages_per_slot` pages of `block_size` tokens, `ring_tokens` in all;
position p sits at offset p % ring_tokens of the slot, so the slot holds the last ring_tokens
positions written, which cover the window of the next one.

A decode step writes its token into the ring, then reads the ring through a block table as wide as
the paged cache's (`decode_pages`): entry i is the slot's page i % pages_per_slot, so the decode
kernels and their CUDA graphs take it as they take the paged table, with the same shape. A prefill
chunk may be longer than the ring: it is written into pages of its own (`chunk_pages`), its
queries read the window before the chunk from the ring and the chunk from those pages
(`window_keys`), and its last tokens go into the ring after (`keep_tail`).

Like a recurrent state (states.py), a ring cannot be cut back to an earlier token: a prompt
resumes from a cached prefix through a checkpoint of the ring kept where an earlier sequence's
computed tokens reached that prefix.
"""

from __future__ import annotations

import torch

from ...kernels import fp8_kv
from .spec import ModelSpec
from .states import SlotPool

# a prefill step's own pages (`WindowPool.chunk_pages`): keys, values, FP8 factors or None
ChunkPages = tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]


class WindowPool(SlotPool):
    """Keys and values of every sliding-window layer in ring slots: `num_slots` for the running
    sequences, one for a CUDA graph's padding rows and `checkpoints` after it; held as
    --kv-cache-dtype says, as the paged cache holds its pages."""

    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        checkpoints: int = 0,
        cache_dtype: str = "auto",
        layers: tuple[int, ...] | None = None,
    ) -> None:
        """`layers`: the sliding layers it holds, where not all (one device's of a split,
        split_states.py)."""
        super().__init__(num_slots, checkpoints)
        assert spec.sliding_layers and spec.sliding_window > 0
        self.window = spec.sliding_window
        self.block_size = block_size
        self.ring_tokens = spec.window_ring_tokens(block_size)
        self.pages_per_slot = self.ring_tokens // block_size
        rows = num_slots + 1 + checkpoints
        layers = spec.sliding_layers if layers is None else layers
        shape = (len(layers), rows * self.pages_per_slot, block_size,
                 spec.num_kv_heads, spec.head_dim)  # fmt: skip
        held = {"auto": dtype, "bf16": torch.bfloat16, "fp8": torch.uint8}[cache_dtype]
        self.dtype = dtype
        self.k = torch.zeros(shape, device=device, dtype=held)
        self.v = torch.zeros(shape, device=device, dtype=held)
        self.k_scale = self.v_scale = None
        if cache_dtype == "fp8":
            self.k_scale = torch.ones(shape[:-1], device=device, dtype=torch.float32)
            self.v_scale = torch.ones(shape[:-1], device=device, dtype=torch.float32)
        self._row = {layer: row for row, layer in enumerate(layers)}

    @property
    def nbytes(self) -> int:
        factors = 0 if self.k_scale is None or self.v_scale is None else 2 * self.k_scale.nbytes
        return self.k.nbytes + self.v.nbytes + factors

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's ring over all sliding layers, factors included."""
        return self.nbytes // (self.k.shape[1] // self.pages_per_slot)

    def ring_of(self, layer: int) -> tuple[WindowPool, int] | None:
        """The pool that holds a layer's rings (by its index among all layers) and the layer's
        row there; None for a layer that keeps paged KV."""
        row = self._row.get(layer)
        return None if row is None else (self, row)

    def scales(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A row's FP8 factors (keys', values'); None where not FP8."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale[row], self.v_scale[row]

    def _clear(self, slot: int) -> None:
        """Nothing: a sequence reads only the positions it wrote or resumed."""

    def _copy(self, src: int, dst: int) -> None:
        n = self.pages_per_slot
        for pages in (self.k, self.v, self.k_scale, self.v_scale):
            if pages is not None:
                pages[:, dst * n : (dst + 1) * n].copy_(pages[:, src * n : (src + 1) * n])

    def decode_pages(
        self, slots: torch.Tensor, positions: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a decode step's rows (their state slots and positions [B], long, on the device):
        the flat slot each row's token is written to [B] (long) and each row's block table
        [B, width] (int32), on the device with no host copy (inside a CUDA graph too)."""
        ring, n = self.ring_tokens, self.pages_per_slot
        written = slots * ring + positions % ring
        pages = torch.arange(width, device=slots.device) % n
        tables = (slots[:, None] * n + pages[None, :]).to(torch.int32)
        return written, tables

    def chunk_pages(self, tokens: int) -> ChunkPages:
        """Pages for a prefill step's `tokens` keys and values (token t at flat slot t), held as
        the ring holds them: (keys, values, FP8 factors or None)."""
        pages = -(-tokens // self.block_size)
        shape = (pages, *self.k.shape[2:])
        k = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        v = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
        if self.k_scale is None:
            return k, v, None
        factors = torch.empty(shape[:-1], device=self.k.device, dtype=torch.float32)
        return k, v, (factors, torch.empty_like(factors))

    def window_keys(
        self,
        row: int,
        slot: int,
        start: int,
        chunk: ChunkPages,
        rows: slice,
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The keys and values [L, Hkv, D] (compute dtype) a prefill chunk's queries see: the
        window before the chunk's first position `start` from the ring, then the chunk's own
        (`rows` of the step's `chunk_pages`); with the position of the first."""
        first = max(0, start - self.window + 1)
        ring = self._ring_index(slot, first, start)
        keys = torch.cat([self._read(self.k[row], self.scales(row), 0, ring),
                          self._read(chunk[0], chunk[2], 0, rows)])  # fmt: skip
        values = torch.cat([self._read(self.v[row], self.scales(row), 1, ring),
                            self._read(chunk[1], chunk[2], 1, rows)])  # fmt: skip
        return first, keys, values

    def keep_tail(
        self,
        row: int,
        slot: int,
        start: int,
        chunk: ChunkPages,
        rows: slice,
    ) -> None:
        """Copy the last tokens of a prefill chunk (`rows` of `chunk_pages`, from position
        `start`) into the sequence's ring, as many as it holds."""
        count = rows.stop - rows.start
        kept = min(count, self.ring_tokens)
        end = start + count
        dst = self._ring_index(slot, end - kept, end)
        src = slice(rows.stop - kept, rows.stop)
        ring_factors = self.scales(row)
        for i, (ring, pages) in enumerate(((self.k[row], chunk[0]), (self.v[row], chunk[1]))):
            heads = ring.shape[2:]
            ring.view(-1, *heads).index_copy_(0, dst, pages.view(-1, *heads)[src])
            if ring_factors is not None and chunk[2] is not None:
                ring_factors[i].view(-1, heads[0]).index_copy_(
                    0, dst, chunk[2][i].view(-1, heads[0])[src]
                )

    def _ring_index(self, slot: int, first: int, end: int) -> torch.Tensor:
        """The flat ring slots of positions first..end-1 of the sequence in `slot`."""
        positions = torch.arange(first, end, device=self.k.device)
        return slot * self.ring_tokens + positions % self.ring_tokens

    def _read(
        self,
        pages: torch.Tensor,
        factors: tuple[torch.Tensor, torch.Tensor] | None,
        which: int,
        where: torch.Tensor | slice,
    ) -> torch.Tensor:
        """Tokens of `pages` [P, B, Hkv, D] at flat slots `where` (an index or a slice), in the
        compute dtype: FP8 bits widened with their factors (`which`: 0 keys', 1 values')."""
        flat = pages.view(-1, *pages.shape[2:])
        bits = flat[where] if isinstance(where, slice) else flat.index_select(0, where)
        if factors is None:
            return bits.to(self.dtype)
        f = factors[which].view(-1, pages.shape[2])
        scale = f[where] if isinstance(where, slice) else f.index_select(0, where)
        return fp8_kv.dequantize_heads(bits, scale, self.dtype)
