"""The sliding-window layers' rings (engine/model/window.py): a sequence keeps its window's
pages however long it grows, and reads back the keys it wrote there."""

from __future__ import annotations

import pytest
import torch

from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.model.window import WindowPool
from moelab.kernels.rope_kv import write_kv


def pool(cache_dtype: str = "auto", checkpoints: int = 0) -> WindowPool:
    """gpt-oss's tiny preset with a window of 6 in pages of 4: rings of 8 tokens, 2 pages."""
    spec = ModelSpec.from_config(make_config("gpt_oss", "tiny", {"sliding_window": 6}))
    return WindowPool(spec, 3, 4, torch.device("cpu"), torch.float32, checkpoints, cache_dtype)


def token(rings: WindowPool, seq: int, position: int) -> torch.Tensor:
    """A key [1, Hkv, D] that names its sequence and position."""
    return torch.full((1, *rings.k.shape[3:]), 1000.0 * seq + position)


def test_a_growing_sequence_keeps_its_windows_pages_and_reads_what_it_wrote() -> None:
    """Two sequences decode 60 tokens each (ten windows): the pool's pages never grow, each
    step's block table sends every position of the window to the sequence's own two pages, and
    those hold the keys written at those positions."""
    rings = pool()
    pages = rings.k.shape[1]
    assert rings.ring_tokens == 8 and rings.pages_per_slot == 2
    slots = [rings.allocate(), rings.allocate()]
    for position in range(60):
        for seq, slot in enumerate(slots):
            written, tables = rings.decode_pages(torch.tensor([slot]), torch.tensor([position]),
                                                 width=16)  # fmt: skip
            key = token(rings, seq, position)
            write_kv(rings.k[0], rings.v[0], None, written, key, key)
            window = range(max(0, position - 5), position + 1)
            seen = {int(tables[0, p // 4]) for p in window}
            assert seen <= {2 * slot, 2 * slot + 1}
            for p in window:
                page = int(tables[0, p // 4])
                assert rings.k[0, page, p % 4, 0, 0] == 1000.0 * seq + p
    assert rings.k.shape[1] == pages


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_a_chunk_longer_than_the_ring_reads_the_window_before_it_and_keeps_its_tail(
    cache_dtype,
) -> None:
    """Chunks of 11 tokens (more than the ring's 8): each query's keys are the window before the
    chunk (from the ring) and the chunk's own, and the ring keeps the chunk's last 8, which the
    next chunk reads; FP8 pages give back what they would widen to."""
    rings = pool(cache_dtype)
    slot = rings.allocate()
    for start in (0, 11, 22):
        chunk = rings.chunk_pages(11)
        keys = torch.cat([token(rings, 0, p) for p in range(start, start + 11)])
        write_kv(chunk[0], chunk[1], chunk[2], torch.arange(11), keys, keys)
        first, k, v = rings.window_keys(0, slot, start, chunk, slice(0, 11))
        assert first == max(0, start - 5)
        expected = torch.tensor([float(p) for p in range(first, start + 11)])
        assert torch.allclose(k[:, 0, 0], expected, rtol=0.07) and torch.equal(k, v)
        rings.keep_tail(0, slot, start, chunk, slice(0, 11))


def test_a_checkpoint_gives_a_later_sequence_the_window_it_was_kept_with() -> None:
    """A ring kept at 8 tokens and resumed into a slot written over since: the next position's
    window reads the kept keys."""
    rings = pool(checkpoints=1)
    slot = rings.allocate()
    written, _ = rings.decode_pages(torch.tensor([slot] * 8), torch.arange(8), width=4)
    keys = torch.cat([token(rings, 0, p) for p in range(8)])
    write_kv(rings.k[0], rings.v[0], None, written, keys, keys)
    rings.keep((7, 8), slot)
    rings.release(slot)
    other = rings.allocate()
    assert other == slot
    rings.k[0, 2 * other : 2 * other + 2].zero_()  # written over before the resume
    rings.resume((7, 8), other)
    first, k, _v = rings.window_keys(0, other, 8, rings.chunk_pages(1), slice(0, 0))
    assert first == 3 and k[:, 0, 0].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
