"""Paged decode attention against its torch reference (interpreter on CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import paged_attention
from moelab.kernels.paged_attention import AttentionConfig, default_num_splits

from .kernel_inputs import DEVICE, assert_matches, randn

pytestmark = pytest.mark.usefixtures("triton_runs")


def paged_cache(
    gen: torch.Generator,
    seq_lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    max_blocks: int,
    dtype=torch.float32,
):
    """K/V pages in a shuffled order per sequence; every slot no sequence owns holds NaN."""
    num_blocks = len(seq_lens) * max_blocks + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = randn(gen, *shape, dtype=dtype)
    v_cache = randn(gen, *shape, dtype=dtype)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for b, seq_len in enumerate(seq_lens):
        pages = order[b * max_blocks : b * max_blocks + -(-seq_len // block_size)]
        tables[b, : len(pages)] = pages.int()
        owned.view(-1, block_size)[pages] = True
        if seq_len % block_size:
            owned[pages[-1], seq_len % block_size :] = False
    # A kernel that reads a page or slot past a sequence's end returns NaN and fails.
    k_cache[~owned.to(DEVICE)] = float("nan")
    v_cache[~owned.to(DEVICE)] = float("nan")
    return k_cache, v_cache, tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "block_size", "seq_lens", "config"),
    [
        (4, 4, 32, 4, [1, 3, 4, 5, 17], AttentionConfig(block_n=16)),  # GQA ratio 1
        (4, 2, 48, 16, [15, 16, 17, 40], AttentionConfig(block_n=16, num_splits=3)),  # ratio 2
        (8, 2, 32, 16, [1, 33, 64, 100], AttentionConfig(block_n=32, num_splits=1)),  # ratio 4
        (
            8,
            2,
            64,
            8,
            [70, 9],
            AttentionConfig(block_n=16, num_splits=16),
        ),  # more slices than steps
        (8, 2, 32, 16, [50, 130], None),  # default tiles and slices
        (2, 1, 16, 16, [1200], AttentionConfig(block_n=16, num_splits=80)),  # 75 slices, 2 merges
    ],
)
def test_matches_reference(gen, q_heads, kv_heads, head_dim, block_size, seq_lens, config):
    max_blocks = -(-max(seq_lens) // block_size) + 1
    k_cache, v_cache, tables, lens = paged_cache(
        gen, seq_lens, block_size, kv_heads, head_dim, max_blocks
    )
    q = randn(gen, len(seq_lens), q_heads, head_dim)
    scale = head_dim**-0.5
    out = paged_attention.paged_attention_decode_triton(
        q, k_cache, v_cache, tables, lens, scale, config=config
    )
    ref = paged_attention.paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale)
    assert_matches(out, ref, tol=1e-5)


@pytest.mark.parametrize(
    ("seq_lens", "window", "config"),
    [
        ([1, 5, 40, 130], 16, AttentionConfig(block_n=16, num_splits=3)),
        ([0, 7, 64], 0, AttentionConfig(block_n=16, num_splits=2)),  # sinks alone
        ([9, 100], 128, None),  # a window longer than the context
        ([33], 17, AttentionConfig(block_n=16, num_splits=8)),  # more slices than the window has
    ],
)
def test_sinks_and_a_window_match_reference(gen, seq_lens, window, config):
    """gpt-oss's attention: a sink logit per head and a sliding window. Positions before the
    window hold NaN, which a kernel that read them would return."""
    block_size, max_blocks = 8, -(-max(seq_lens) // 8) + 1
    k_cache, v_cache, tables, lens = paged_cache(gen, seq_lens, block_size, 2, 32, max_blocks)
    for b, seq_len in enumerate(seq_lens):
        for pos in range(max(0, seq_len - window) if window else 0):
            page = tables[b, pos // block_size]
            k_cache[page, pos % block_size] = float("nan")
            v_cache[page, pos % block_size] = float("nan")
    q = randn(gen, len(seq_lens), 8, 32)
    sinks = randn(gen, 8) * 3
    kwargs = {"sinks": sinks, "window": window}
    out = paged_attention.paged_attention_decode_triton(
        q, k_cache, v_cache, tables, lens, 0.2, config=config, **kwargs
    )
    ref = paged_attention.paged_attention_decode_ref(
        q, k_cache, v_cache, tables, lens, 0.2, **kwargs
    )
    assert_matches(out, ref, tol=1e-5)
    # the sinks take their share: the same call without them differs
    plain = paged_attention.paged_attention_decode_ref(
        q, k_cache, v_cache, tables, lens, 0.2, window=window
    )
    assert not torch.allclose(plain[lens > 0], ref[lens > 0], atol=1e-3)


def test_sinks_match_softmax_with_an_extra_logit(gen):
    """The reference's sink is a logit in the softmax whose value is zero: attention over the
    keys plus one zero key whose score is the sink gives the same output."""
    k_cache, v_cache, tables, lens = paged_cache(gen, [11], 4, 1, 16, 4)
    q = randn(gen, 1, 2, 16)
    sinks = torch.tensor([0.5, -1.0], device=q.device)
    out = paged_attention.paged_attention_decode_ref(
        q, k_cache, v_cache, tables, lens, 0.3, sinks=sinks
    )
    keys = k_cache[tables[0, :3].long()].reshape(-1, 16)[:11]
    values = v_cache[tables[0, :3].long()].reshape(-1, 16)[:11]
    for head in range(2):
        scores = torch.cat([keys @ q[0, head] * 0.3, sinks[head : head + 1]])
        expected = torch.softmax(scores, dim=0)[:11] @ values
        assert_matches(out[0, head], expected, tol=1e-5)


def test_empty_sequence_gives_zeros(gen):
    k_cache, v_cache, tables, lens = paged_cache(gen, [0, 7], 4, 2, 32, 3)
    q = randn(gen, 2, 4, 32)
    out = paged_attention.paged_attention_decode_triton(
        q, k_cache, v_cache, tables, lens, 0.2, config=AttentionConfig(block_n=16, num_splits=2)
    )
    ref = paged_attention.paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_matches(out, ref, tol=1e-5)


def test_bf16_cache_with_fp32_compute_returns_bf16(gen):
    k_cache, v_cache, tables, lens = paged_cache(gen, [20, 5], 16, 2, 32, 2, dtype=torch.bfloat16)
    q = randn(gen, 2, 4, 32, dtype=torch.bfloat16)
    kwargs = {"compute_dtype": torch.float32}
    out = paged_attention.paged_attention_decode_triton(
        q, k_cache, v_cache, tables, lens, 0.2, config=AttentionConfig(block_n=16), **kwargs
    )
    ref = paged_attention.paged_attention_decode_ref(
        q, k_cache, v_cache, tables, lens, 0.2, **kwargs
    )
    assert out.dtype == torch.bfloat16
    assert_matches(out, ref, tol=1e-2)  # both round the fp32 result to bf16 once


def test_cpu_tensors_go_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(paged_attention, "paged_attention_decode_triton", refuse)
    k_cache = torch.randn(4, 4, 1, 16, generator=gen)
    v_cache = torch.randn(4, 4, 1, 16, generator=gen)
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    q = torch.randn(1, 2, 16, generator=gen)
    out = paged_attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25)
    ref = paged_attention.paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.25)
    assert torch.equal(out, ref)


def test_query_heads_must_be_a_multiple_of_kv_heads():
    q = torch.ones(1, 6, 16)
    cache = torch.ones(2, 4, 4, 16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention.paged_attention_decode_ref(q, cache, cache, tables, torch.ones(1), 1.0)


@pytest.mark.parametrize(
    ("rows", "max_tokens", "expected"),
    [(4, 32768, 132), (32, 32768, 17), (4, 100, 2), (1000, 32768, 1)],
)
def test_slices_fill_the_gpu_but_not_past_the_context(rows, max_tokens, expected):
    assert default_num_splits(rows, max_tokens, 64, sms=132) == expected
