"""The FP8 block format: the bit decoding against torch's own cast, and a round trip."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.kernels import fp8


def test_widen_decodes_every_byte_as_torch_does():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = fp8.widen(bits)
    theirs = bits.view(torch.float8_e4m3fn).float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = ~theirs.isnan()
    assert torch.equal(ours[finite], theirs[finite])
    assert ours[0x7E].item() == fp8.E4M3_MAX and ours[0x01].item() == 2.0**-9


@settings(deadline=None, max_examples=50)  # quantizing a 300x300 block takes its time
@given(n=st.integers(1, 300), k=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_round_trip_is_within_e4m3_precision_per_block(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(1, generator=g) * 10
    q, scale_inv = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.shape == (fp8.blocks(n), fp8.blocks(k))
    back = fp8.dequantize(q, scale_inv)
    # e4m3 keeps 3 mantissa bits: a rounding error of at most 2^-4 of the value, or of the
    # subnormal step below 2^-6 of the block's scale
    step = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k] * 2.0**-9
    assert torch.all((back - w).abs() <= w.abs() * 2.0**-4 + step)


def test_an_all_zero_block_keeps_factor_one_and_stacked_experts_block_separately():
    w = torch.zeros(3, 256, 130)
    w[1, 128:, :] = 5.0
    q, scale_inv = fp8.quantize(w)
    assert scale_inv.shape == (3, 2, 2)
    assert scale_inv[0].eq(1).all() and scale_inv[1, 0].eq(1).all()
    assert torch.allclose(scale_inv[1, 1], torch.tensor(5.0 / 448))
    assert torch.equal(fp8.dequantize(q, scale_inv), w)
