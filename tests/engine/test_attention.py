"""Prefill attention (Model._sdpa) against softmax attention, and on a GPU in a fused backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from moelab.engine.model.model import Model

from .reference import DEVICE

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at the last n of L positions, k and v [L, Hkv, D]: causal softmax attention,
    in fp64, one head at a time."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    allowed = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    out = torch.empty(n, heads, q.shape[2], dtype=torch.float64)
    for h in range(heads):
        qh, kh, vh = (t.double().cpu() for t in (q[:, h], k[:, h // group], v[:, h // group]))
        scores = (qh @ kh.T * scale).masked_fill(~allowed, float("-inf"))
        out[:, h] = scores.softmax(-1) @ vh
    return out


def sdpa(heads: int, kv_heads: int, head_dim: int, flash: bool = False):
    """Model._sdpa bound to the few attributes it reads; `flash`: a later chunk's attention as
    torch's lower-right causal bias with the heads shared (where a device runs it in flash
    attention; elsewhere torch makes the mask from the bias)."""
    spec = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads)
    device = torch.empty(0, device=DEVICE).device  # with its index, as a tensor's
    model = SimpleNamespace(spec=spec, scale=head_dim**-0.5, _flash_chunks={device: flash})
    return lambda q, k, v: Model._sdpa(model, q, k, v), model.scale


@pytest.mark.parametrize("flash", [False, True], ids=["mask", "causal-bias"])
@pytest.mark.parametrize(
    ("n", "length", "heads", "kv_heads"),
    [(37, 37, 8, 2), (37, 37, 6, 6), (9, 41, 8, 2), (1, 23, 8, 4), (1, 1, 4, 1)],
    ids=["prompt-gqa", "prompt-mha", "later-chunk-gqa", "one-query", "first-token"],
)
def test_prefill_attention_matches_softmax_attention(n, length, heads, kv_heads, flash):
    head_dim = 16
    gen = torch.Generator().manual_seed(n * 100 + length)
    q = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(length, kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(length, kv_heads, head_dim, generator=gen).to(DEVICE)
    call, scale = sdpa(heads, kv_heads, head_dim, flash)
    out = call(q, k, v)
    assert out.shape == (n, heads, head_dim)
    expected = attention_ref(q, k, v, scale)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (MOELAB_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("n", [512, 1], ids=["prompt", "one-query"])
def test_prefill_attention_runs_in_a_fused_backend(n):
    """The Qwen3-30B-A3B heads in bf16: a whole prompt runs in flash/cuDNN/memory-efficient
    attention (restricted to those, SDPA raises where only the math backend would take it)."""
    heads, kv_heads, head_dim = 32, 4, 128
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(512, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(512, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    call, scale = sdpa(heads, kv_heads, head_dim)
    with sdpa_kernel(FUSED):
        out = call(q, k, v)
    expected = attention_ref(q, k, v, scale)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (MOELAB_TEST_DEVICE=cuda)")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(32, 4, 128), (16, 2, 256)], ids=["qwen3", "qwen3.6"]
)
def test_a_later_chunk_runs_in_flash_attention_without_a_mask(heads, kv_heads, head_dim):
    """A chunk of 512 queries after 3,584 tokens at Qwen3-30B-A3B's and Qwen3.6-35B-A3B's heads
    in bf16: the device runs it in flash attention (the engine's check says so, and with only
    flash allowed SDPA raises where it could not), the key/value heads shared, equal to causal
    softmax attention."""
    from moelab.engine.model.model import flash_chunk_attention
    from moelab.engine.model.spec import flash_chunks_fit

    spec = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    assert flash_chunks_fit(spec, 2)
    assert flash_chunk_attention(spec, torch.device(DEVICE), torch.bfloat16)
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(512, heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(4096, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(4096, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    call, scale = sdpa(heads, kv_heads, head_dim, flash=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = call(q, k, v)
    expected = attention_ref(q, k, v, scale)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-2, atol=2e-2)
