"""Paged KV cache: fixed-size token blocks on the compute device and a free-list allocator."""

from __future__ import annotations

import torch

from .spec import ModelSpec


class KVCache:
    """Keys and values of every layer, in `num_blocks` pages of `block_size` tokens."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        assert num_blocks >= 1 and block_size >= 1
        # one extra block, never handed out, takes the writes of padding rows in CUDA graphs
        shape = (spec.num_layers, num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.peak_blocks_used = 0

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1] - 1

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def slot(self, blocks: list[int], position: int) -> int:
        """The flat KV slot of a sequence's token at `position`, given the sequence's pages."""
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; the caller checks `free_blocks` first."""
        assert n <= len(self._free), "KV allocation beyond the free blocks"
        blocks = [self._free.pop() for _ in range(n)]
        self.peak_blocks_used = max(self.peak_blocks_used, self.used_blocks)
        return blocks

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at flat token slots [T] (block * block_size + offset)."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

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
        (`page_indices`)."""
        k = self.k[layer].index_select(0, pages).flatten(0, 1)[:length]
        v = self.v[layer].index_select(0, pages).flatten(0, 1)[:length]
        return k, v
