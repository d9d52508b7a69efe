"""Paged KV cache: fixed-size token blocks on the compute device, a free-list allocator, and the
prefix cache: full blocks named by their tokens, kept after their sequence ends and handed to a
later prompt that begins with the same tokens.

Keys and values are held in the compute dtype, in bf16, or in FP8 (`--kv-cache-dtype`): e4m3 bits
with one fp32 factor per token and KV head (kernels/fp8_kv.py), quantized as they are written and
widened as they are read.

A block's name is (its parent's name hashed, its tokens): the tokens of every block before it
are in the name, so a prompt's prefix matches block by block from its start. A block no sequence
holds any more stays named (idle) until a new allocation needs it; the least recently released
go first. Only full blocks are named, and a sequence writes only past its matched prefix, so a
block is never written while another sequence may read it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from ...kernels import fp8_kv
from ...kernels.rope_kv import write_kv
from .spec import ModelSpec

BlockName = tuple[int, tuple[int, ...]]  # (the parent's name hashed, 0 for none; the tokens)


def block_names(
    tokens: Sequence[int], size: int, first: int, last: int, parent: int
) -> Iterator[tuple[BlockName, int]]:
    """The names of blocks first..last-1 of `tokens` in blocks of `size`, the chain starting
    from `parent` (block first-1's name hashed, 0 for none), each with its own name hashed: the
    one chain both naming (the scheduler) and matching (`KVCache.match`) walk."""
    for i in range(first, last):
        name = parent, tuple(tokens[i * size : (i + 1) * size])
        parent = hash(name)
        yield name, parent


class KVCache:
    """Keys and values of every paged attention layer (`ModelSpec.paged_layers`), in
    `num_blocks` pages of `block_size` tokens; a layer's methods take its row, its place among
    those layers (the layer's own index in a model of full-attention layers only)."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        prefix_cache: bool = True,
        cache_dtype: str = "auto",
        rows: int | None = None,
    ) -> None:
        """`dtype`: the compute dtype, which reads give; `cache_dtype`: --kv-cache-dtype; `rows`:
        the paged attention layers it holds, where not all (one device's of a split)."""
        assert num_blocks >= 1 and block_size >= 1
        assert cache_dtype in ("auto", "bf16", "fp8"), cache_dtype
        # one extra block, never handed out, takes the writes of padding rows in CUDA graphs; one
        # row per paged attention layer (a hybrid model's linear layers keep states instead:
        # states.py; sliding-window layers keep their window's tokens: window.py)
        layers = len(spec.paged_layers) if rows is None else rows
        shape = (layers, num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        held = {"auto": dtype, "bf16": torch.bfloat16, "fp8": torch.uint8}[cache_dtype]
        self.dtype = dtype
        # how the pages hold keys and values (/v1/stats kv.dtype): "fp8", else the dtype's name
        self.fmt = "fp8" if cache_dtype == "fp8" else str(held).removeprefix("torch.")
        self.k = torch.zeros(shape, device=device, dtype=held)
        self.v = torch.zeros(shape, device=device, dtype=held)
        # FP8 pages' factors, one per token and KV head (an all-zero page widens to zeros)
        self.k_scale = self.v_scale = None
        if cache_dtype == "fp8":
            self.k_scale = torch.ones(shape[:-1], device=device, dtype=torch.float32)
            self.v_scale = torch.ones(shape[:-1], device=device, dtype=torch.float32)
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._holders = [0] * num_blocks  # sequences holding each block
        self.prefix_cache = prefix_cache
        self._named: dict[BlockName, int] = {}  # full blocks by name
        self._name_of: dict[int, BlockName] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named, held by none; oldest first
        self.peak_blocks_used = 0

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1] - 1

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take: the free ones and the idle named ones."""
        return len(self._free) + len(self._idle)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Named blocks (held or idle): what later prompts may match."""
        return len(self._named)

    @property
    def nbytes(self) -> int:
        factors = 0 if self.k_scale is None or self.v_scale is None else 2 * self.k_scale.nbytes
        return self.k.nbytes + self.v.nbytes + factors

    @property
    def bytes_per_token(self) -> int:
        """Every layer's keys and values of one token, factors included."""
        return self.nbytes // (self.k.shape[1] * self.block_size)

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A layer's FP8 factors (keys', values'), for the kernels; None where not FP8."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale[layer], self.v_scale[layer]

    def free_memory(self) -> None:
        """Let go of the pages' memory at once (the cache is not used after)."""
        self.k = self.v = torch.empty(0)
        self.k_scale = self.v_scale = None

    def slot(self, blocks: list[int], position: int) -> int:
        """The flat KV slot of a sequence's token at `position`, given the sequence's pages."""
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, free ones first, then the idle named ones least recently released
        (forgetting their names); the caller checks `free_blocks` first."""
        assert n <= self.free_blocks, "KV allocation beyond the free blocks"
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._idle.popitem(last=False)
                del self._named[self._name_of.pop(block)]
            self._holders[block] = 1
            blocks.append(block)
        self.peak_blocks_used = max(self.peak_blocks_used, self.used_blocks)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Let go of a sequence's blocks (and empty the list): a block no sequence holds is free,
        or idle where it is named. The last blocks go idle first, so that an allocation takes a
        prompt's tail before its head, which more prompts share."""
        for block in reversed(blocks):
            self._holders[block] -= 1
            if self._holders[block] == 0:
                if block in self._name_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)
        blocks.clear()

    def match(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """The named blocks that hold the longest prefix of `tokens` in whole blocks, leaving
        at least its last token to compute (a step needs one to give logits), and the last
        one's name hashed (0 for none). Nothing is taken yet (`hold`)."""
        blocks: list[int] = []
        chain = 0
        if not self.prefix_cache:
            return blocks, chain
        size = self.block_size
        for name, hashed in block_names(tokens, size, 0, (len(tokens) - 1) // size, 0):
            block = self._named.get(name)
            if block is None:
                break
            blocks.append(block)
            chain = hashed
        return blocks, chain

    def idle_among(self, blocks: list[int]) -> int:
        """How many of `blocks` are idle (counted in `free_blocks` until held)."""
        return sum(block in self._idle for block in blocks)

    def hold(self, blocks: list[int]) -> None:
        """Take matched blocks for one more sequence."""
        for block in blocks:
            if self._holders[block] == 0:
                del self._idle[block]
            self._holders[block] += 1
        self.peak_blocks_used = max(self.peak_blocks_used, self.used_blocks)

    def name(self, block: int, name: BlockName) -> None:
        """Name a full block by its tokens, for later prompts to match (a name already given to
        another block keeps that one)."""
        if self.prefix_cache and name not in self._named and block not in self._name_of:
            self._named[name] = block
            self._name_of[block] = name

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at flat token slots [T] (block * block_size + offset)."""
        write_kv(self.k[layer], self.v[layer], self.scales(layer), slots, k, v)

    def page_indices(self, seqs: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        """For each (blocks, length): the pages holding its first `length` tokens as a device
        index for `gather`; one host-to-device copy for all of them (a copy waits for the device:
        make them with a step's inputs, not in a layer)."""
        counts = [self.blocks_for(length) for _, length in seqs]
        flat = [page for (blocks, _), n in zip(seqs, counts, strict=True) for page in blocks[:n]]
        return list(torch.tensor(flat, device=self.k.device).split(counts))

    def gather(
        self, layer: int, pages: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values [length, Hkv, D] of a sequence's pages
        (`page_indices`), in the compute dtype."""
        if self.k_scale is not None and self.v_scale is not None:
            return (
                fp8_kv.gather(self.k[layer], self.k_scale[layer], pages, length, self.dtype),
                fp8_kv.gather(self.v[layer], self.v_scale[layer], pages, length, self.dtype),
            )
        k = self.k[layer].index_select(0, pages).flatten(0, 1)[:length]
        v = self.v[layer].index_select(0, pages).flatten(0, 1)[:length]
        return k.to(self.dtype), v.to(self.dtype)
