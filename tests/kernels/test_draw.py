"""The decode draws' Gumbel-max kernel against its torch reference, and the hash under both."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moelab.kernels import draw

from .kernel_inputs import DEVICE, randn

pytestmark = pytest.mark.usefixtures("triton_runs")


def _lowbias32(x: np.ndarray) -> np.ndarray:
    """mix32 in numpy's unsigned 32-bit arithmetic (the reference for torch's wrapping int64)."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def test_the_hash_is_exact_32_bit_arithmetic(gen):
    values = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.long)
    values[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])  # products past 2**63 wrap
    assert draw.mix32(values).tolist() == _lowbias32(values.numpy()).tolist()
    # a bijection: distinct inputs, distinct hashes
    assert draw.mix32(torch.arange(1 << 16)).unique().numel() == 1 << 16


def test_the_noise_is_uniform_in_the_open_interval_and_keyed_by_seed_and_position():
    seed = torch.tensor([11, 11, 12, -5, 2**62 + 3])
    noise = draw.draw_noise(seed, torch.tensor([5, 6, 5, 5, 5]), 50_000)
    assert noise.min() > 0 and noise.max() < 1
    for i in range(1, 5):  # another position, seed (its high half too) gives another
        assert not torch.equal(noise[0], noise[i])
    # uniform: each tenth of (0, 1) holds a tenth of the noise, within 5 standard errors
    counts = torch.histc(noise, bins=10, min=0, max=1) / noise.numel()
    assert ((counts - 0.1).abs() < 5 * math.sqrt(0.09 / noise.numel())).all()


def _inputs(gen, rows: int, vocab: int, dtype=torch.float32):
    """Logits; rows drawn at various temperatures, the second (where there is one) greedy;
    thresholds (`threshold`)."""
    logits = randn(gen, rows, vocab, scale=3.0, dtype=dtype)
    inv_t = (torch.rand(rows, generator=gen) * 2 + 0.3).to(DEVICE)
    inv_t[1:2] = 0.0  # greedy
    x = logits.float()
    # thresholds keeping about half the tokens, then one keeping about 1% (the third row), and
    # none (the first)
    threshold = x.median(dim=-1).values
    if rows > 2:
        threshold[2] = x[2].quantile(0.99)
    threshold[0] = -math.inf
    seed = torch.randint(-(2**62), 2**62, (rows,), generator=gen).to(DEVICE)
    position = torch.randint(0, 1 << 20, (rows,), generator=gen, dtype=torch.int32).to(DEVICE)
    return logits, inv_t, threshold, seed, position


def _assert_same_draws(tokens, ref, logits, inv_t, seed, position) -> None:
    """Tokens equal the reference's, except where the two scores tie to fp32 rounding (the
    kernel's log and the reference's may differ in the last bit)."""
    assert tokens.dtype == torch.int64 and (tokens >= 0).all(), "unwritten (poisoned) tokens"
    x = logits.float()
    gumbel = -torch.log(-torch.log(draw.draw_noise(seed, position, x.shape[1])))
    scores = torch.where((inv_t > 0)[:, None], x * inv_t[:, None] + gumbel, x)
    for row in torch.nonzero(tokens != ref).flatten().tolist():
        a, b = scores[row, tokens[row]].item(), scores[row, ref[row]].item()
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (row, a, b)
    assert (tokens == ref).float().mean() >= 0.9


@pytest.mark.parametrize(
    ("rows", "vocab", "dtype"),
    [
        (2, 5000, torch.float32),  # two programs of a row, the second partly past the end
        (9, draw.SPLIT, torch.float32),  # exactly one program a row
        (6, 3 * draw.SPLIT + 17, torch.bfloat16),  # logits read as fp32
    ],
)
def test_matches_reference(gen, rows, vocab, dtype):
    inputs = _inputs(gen, rows, vocab, dtype)
    tokens = draw.gumbel_argmax_triton(*inputs)
    ref = draw.gumbel_argmax_ref(*inputs)
    logits, inv_t, threshold, seed, position = inputs
    _assert_same_draws(tokens, ref, logits, inv_t, seed, position)
    # every drawn token is kept by its row's threshold; the greedy row took its top logit
    x = logits.float()
    assert (x.gather(1, tokens[:, None])[:, 0] >= threshold).all()
    assert tokens[1] == x[1].argmax()


def test_writes_into_out_and_ties_go_to_the_lowest_id():
    logits = torch.zeros(2, draw.SPLIT * 2, device=DEVICE)
    logits[:, [7, draw.SPLIT + 3]] = 5.0  # equal tops in two programs of each row
    inv_t = torch.zeros(2, device=DEVICE)  # greedy: no noise
    threshold = torch.full((2,), -math.inf, device=DEVICE)
    seed, position = torch.zeros(2, dtype=torch.long, device=DEVICE), torch.zeros(2, device=DEVICE)
    out = torch.full((2,), -1, dtype=torch.long, device=DEVICE)
    result = draw.gumbel_argmax_triton(logits, inv_t, threshold, seed, position.int(), out=out)
    assert result.data_ptr() == out.data_ptr() and out.tolist() == [7, 7]
    assert draw.gumbel_argmax_ref(logits, inv_t, threshold, seed, position.int()).tolist() == [7, 7]


def test_cpu_tensors_go_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(draw, "gumbel_argmax_triton", refuse)
    inputs = [t.cpu() for t in _inputs(gen, 3, 300)]
    assert torch.equal(draw.gumbel_argmax(*inputs), draw.gumbel_argmax_ref(*inputs))


def test_bad_inputs_are_refused():
    logits = torch.zeros(2, 10, device=DEVICE)
    f32 = torch.zeros(2, device=DEVICE)
    i64 = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"seed must be \[2\] torch.int64"):
        draw.gumbel_argmax(logits, f32, f32, f32, i64)
    with pytest.raises(ValueError, match=r"inv_t must be \[2\]"):
        draw.gumbel_argmax(logits, f32[:1], f32, i64, i64)
    with pytest.raises(ValueError, match="out must be int64"):
        draw.gumbel_argmax(logits, f32, f32, i64, i64, out=f32)
    with pytest.raises(ValueError, match="logits must be"):
        draw.gumbel_argmax(logits[0], f32, f32, i64, i64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8])
def test_matches_reference_at_the_real_vocabulary_and_in_a_graph(gen, rows):
    inputs = _inputs(gen, rows, 151_936, torch.float32)
    ref = draw.gumbel_argmax_ref(*inputs)
    out = torch.full((rows,), -1, dtype=torch.long, device=DEVICE)
    draw.gumbel_argmax_triton(*inputs, out=out)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        draw.gumbel_argmax_triton(*inputs, out=out)
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    logits, inv_t, _, seed, position = inputs
    _assert_same_draws(out, ref, logits, inv_t, seed, position)
