"""The 4-bit formats, MXFP4 and NVFP4: their e2m1 element, hand-made blocks decoded by the
definition, gpt-oss's layout as transformers reads it, and the quantizers' error bounds."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from moelab.kernels import e2m1, fp8, mxfp4, nvfp4

EVERY_CODE = torch.arange(16, dtype=torch.uint8)
VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_every_e2m1_code_decodes_to_its_value_and_encodes_back():
    values = e2m1.widen(EVERY_CODE)
    assert values.tolist() == VALUES == FP4_VALUES
    assert torch.equal(torch.signbit(values), EVERY_CODE >= 8)
    assert torch.equal(e2m1.encode(values), EVERY_CODE)


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])
    assert e2m1.widen(e2m1.encode(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4, -0.0, -4]
    near = torch.tensor([0.26, 0.74, 1.3, 2.4, 4.9, 5.1, 6.5, 1e9, -7.0])
    assert e2m1.widen(e2m1.encode(near)).tolist() == [0.5, 0.5, 1.5, 2, 4, 6, 6, 6, -6]


def test_pack_puts_the_even_value_in_the_low_nibble():
    packed = e2m1.pack(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x0F]]
    assert e2m1.unpack(packed).tolist() == [[1, 2, 15, 0]]


def _mx_block(codes: list[int], scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = e2m1.pack(torch.tensor(codes, dtype=torch.uint8)).reshape(1, 1, 16)
    return blocks, torch.tensor([[scale]], dtype=torch.uint8)


def test_mxfp4_block_of_every_code_at_the_scale_extremes():
    codes = list(range(16)) * 2
    for scale, factor in ((127, 1.0), (0, 2.0**-127), (254, 2.0**127), (130, 8.0)):
        values = mxfp4.dequantize(*_mx_block(codes, scale))
        expected = torch.tensor(VALUES * 2, dtype=torch.float64) * factor
        assert torch.equal(values.double().flatten(), expected.float().double()), scale
    assert mxfp4.dequantize(*_mx_block(codes, 0xFF)).isnan().all()


def test_mxfp4_quantize_takes_the_spec_shared_exponent_and_saturates():
    w = torch.zeros(2, 64)
    w[0, :32] = torch.linspace(-7.5, 7.5, 32)  # amax 7.5: X = 2^(2 - 2) = 1, ±7.5 saturate to ±6
    w[0, 32] = 0.375  # amax 0.375: X = 2^(-2 - 2); 0.375 = 6 · 2^-4
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (2, 2, 16) and scales.shape == (2, 2)
    assert scales.tolist() == [[127, 123], [0, 0]]
    back = mxfp4.dequantize(blocks, scales)
    assert back[0, 0] == -6 and back[0, 31] == 6 and back[0, 32] == 0.375
    assert torch.equal(back[1], torch.zeros(64))


def test_mxfp4_block_with_nan_or_infinity_gets_the_nan_scale_alone():
    w = torch.ones(1, 96)
    w[0, 3] = torch.nan
    w[0, 40] = torch.inf
    blocks, scales = mxfp4.quantize(w)
    assert scales.tolist() == [[0xFF, 0xFF, 125]]
    back = mxfp4.dequantize(blocks, scales)
    assert back[0, :64].isnan().all() and torch.equal(back[0, 64:], torch.ones(32))


def test_mxfp4_refuses_a_dimension_its_blocks_do_not_tile():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.ones(2, 48))


@settings(deadline=None, max_examples=20)
@given(seed=st.integers(0, 2**16))
def test_mxfp4_dequantize_matches_transformers_on_gpt_oss_layout(seed):
    g = torch.Generator().manual_seed(seed)
    experts, rows, nblocks = 3, 5, 4  # gate_up_proj_blocks [E, 2I, H/32, 16]
    blocks = torch.randint(0, 256, (experts, rows, nblocks, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (experts, rows, nblocks), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, H, 2I]
    assert torch.equal(mxfp4.dequantize(blocks, scales).transpose(1, 2), theirs)


def _weights(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Random weights whose blocks span many binades, as trained experts' do."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-30, 30, (*shape[:-1], 1), generator=g).float())
    return torch.randn(shape, generator=g) * spread


@settings(deadline=None, max_examples=50)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 9), k_blocks=st.integers(1, 6))
def test_mxfp4_round_trip_is_within_one_e2m1_step_per_block(seed, n, k_blocks):
    w = _weights(seed, (2, n, 32 * k_blocks))
    blocks, scales = mxfp4.quantize(w)
    back = mxfp4.dequantize(blocks, scales)
    x = mxfp4.scale_values(scales).repeat_interleave(32, -1)
    # one mantissa bit: half a step is at most a quarter of the value, or of X below 1·X; a
    # saturated value (|w|/X in (6, 8)) loses less than a quarter too
    assert torch.all((back - w).abs() <= torch.maximum(w.abs(), x) / 4)
    # the spec's X puts each block's largest magnitude in [4, 8) · X
    top = w.abs().unflatten(-1, (k_blocks, 32)).amax(-1) / mxfp4.scale_values(scales)
    assert torch.all((top >= 4) & (top < 8))


# the spec's MXFP4 quantizer as it reads, in float64 (frexp for the shared exponent, ldexp for
# the division, a search among e2m1's midpoints for the rounding): what mxfp4.quantize and
# e2m1.encode must give bit for bit
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _reference_encode(values: torch.Tensor) -> torch.Tensor:
    v = values.float()
    magnitude = torch.nan_to_num(v.abs(), nan=0.0).contiguous()
    code = torch.searchsorted(MIDPOINTS, magnitude)  # a tie lands on the lower code
    tie_to_odd = (MIDPOINTS[code.clamp(max=6)] == magnitude) & (code % 2 == 1)
    sign = (v < 0) | ((v == 0) & torch.signbit(v))
    return ((code + tie_to_odd.long()) | torch.where(sign, 8, 0)).to(torch.uint8)


def _reference_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tiles = weight.double().unflatten(-1, (-1, 32))
    finite = tiles.isfinite().all(-1)
    amax = torch.where(tiles.isfinite(), tiles.abs(), 0.0).amax(-1)
    _, exponent = torch.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): ⌊log2 amax⌋ = e − 1
    shared = torch.where(amax > 0, exponent - 3, -127).clamp(-127, 127)
    codes = _reference_encode(torch.ldexp(tiles, -shared[..., None]).clamp(-6, 6))
    codes = torch.where(finite[..., None], codes, 0).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, torch.where(finite, shared + 127, 0xFF).to(torch.uint8)


def _assert_quantizes_as_the_reference(w: torch.Tensor) -> None:
    blocks, scales = mxfp4.quantize(w)
    ref_blocks, ref_scales = _reference_mxfp4(w)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(blocks, ref_blocks)


# what a block's values are made of: e2m1's elements and the midpoints between them (ties), values
# past 6 (saturated), at its scale; and any fp32 at all (zeros, subnormals, NaN, infinities)
_ON_THE_GRID = st.sampled_from([*e2m1.MAGNITUDES, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 7.5])
_ELEMENTS = st.one_of(
    st.tuples(_ON_THE_GRID, st.sampled_from([1.0, -1.0])),
    st.tuples(st.floats(width=32), st.none()),  # as it is, not scaled
)
_BINADES = st.one_of(st.integers(-152, -118), st.integers(-30, 30), st.integers(100, 127))


@st.composite
def _mx_weights(draw) -> torch.Tensor:
    """A weight of whole blocks, each on the e2m1 grid at a drawn scale 2^e (its first value,
    in [4, 8) · 2^e, pins the spec's scale to 2^e), sprinkled with arbitrary fp32 values."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    n, k_blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    values = []
    for _ in range(n * k_blocks):
        e = draw(_BINADES)
        block = [(draw(st.sampled_from([4.0, 5.0, 6.0, 7.5, 0.0])), -1.0)]
        block += draw(st.lists(_ELEMENTS, min_size=31, max_size=31))
        values += [v if sign is None else math.ldexp(v * sign, e) for v, sign in block]
    return torch.tensor(values, dtype=torch.float64).reshape(n, k_blocks * 32).to(dtype)


@settings(deadline=None, max_examples=200)
@given(w=_mx_weights())
def test_mxfp4_quantize_matches_the_spec_bit_for_bit(w):
    _assert_quantizes_as_the_reference(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_quantize_matches_the_spec_on_large_weights(dtype):
    g = torch.Generator().manual_seed(7)
    every_fp32 = torch.randint(-(2**31), 2**31, (2, 320, 1024), generator=g).int()
    weights = _weights(1, (2, 320, 4096)) * 2.0**-100  # blocks down to fp32's subnormals
    for w in (every_fp32.view(torch.float32).to(dtype), weights.to(dtype)):
        _assert_quantizes_as_the_reference(w)  # several of quantize's chunks each
        _assert_quantizes_as_the_reference(w.transpose(0, 1))
        _assert_quantizes_as_the_reference(w[1].t())  # as the bank reads gpt_oss's experts
    assert torch.equal(
        e2m1.encode(every_fp32.view(torch.float32)),
        _reference_encode(every_fp32.view(torch.float32)),
    )


def test_mxfp4_quantizes_a_float64_weight_as_its_fp32_rounding():
    w = _weights(2, (3, 64)).double() * (1 + 2.0**-40)
    assert all(map(torch.equal, mxfp4.quantize(w), mxfp4.quantize(w.float())))


def test_mxfp4_quantizes_a_vector_and_no_rows():
    w = _weights(3, (2, 96))
    blocks, scales = mxfp4.quantize(w[1])
    assert torch.equal(blocks, mxfp4.quantize(w)[0][1]) and scales.shape == (3,)
    blocks, scales = mxfp4.quantize(w[:0])
    assert blocks.shape == (0, 3, 16) and scales.shape == (0, 3)


def _nv_block(codes: list[int], scale_bits: int, scale_2: float):
    weight = e2m1.pack(torch.tensor([codes], dtype=torch.uint8))
    weight_scale = torch.tensor([[scale_bits]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    return weight, weight_scale, torch.tensor(scale_2)


def test_nvfp4_block_of_every_code_at_the_scale_extremes():
    for bits, scale in ((0x7E, 448.0), (0x01, 2.0**-9), (0x38, 1.0), (0x00, 0.0)):
        values = nvfp4.dequantize(*_nv_block(list(range(16)), bits, 0.5))
        expected = torch.tensor(VALUES) * scale * 0.5
        assert torch.equal(values.flatten(), expected), hex(bits)
    assert nvfp4.dequantize(*_nv_block(list(range(16)), 0x7F, 0.5)).isnan().all()
    assert nvfp4.dequantize(*_nv_block(list(range(16)), 0xFF, 0.5)).isnan().all()


def test_nvfp4_quantize_scales_as_modelopt_and_keeps_bad_blocks_to_themselves():
    w = torch.zeros(2, 3, 32)
    w[0, 0, :16] = torch.linspace(-6.0, 6.0, 16) * 448  # the tensor's amax: scales 448, 1
    w[0, 1, 16] = 3.0
    w[0, 2, 0] = torch.nan
    weight, weight_scale, scale_2 = nvfp4.quantize(w)
    assert weight.shape == (2, 3, 16) and weight_scale.shape == (2, 3, 2)
    assert scale_2.tolist() == [1.0, 1.0]  # expert 1 is all zeros
    scales = fp8.widen(weight_scale)
    assert scales[0, 0, 0] == 448 and scales[0, 1, 1] == 0.5 and scales[0, 2, 0].isnan()
    back = nvfp4.dequantize(weight, weight_scale, scale_2)
    assert back[0, 0, 0] == -6 * 448 and back[0, 1, 16] == 3.0
    assert back[0, 2, :16].isnan().all() and torch.equal(back[1], torch.zeros(3, 32))


def test_nvfp4_refuses_a_dimension_its_blocks_do_not_tile():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.ones(2, 40))


@settings(deadline=None, max_examples=50)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 9), k_blocks=st.integers(1, 6))
def test_nvfp4_round_trip_is_within_one_e2m1_step_per_block(seed, n, k_blocks):
    w = _weights(seed, (2, n, 16 * k_blocks))
    weight, weight_scale, scale_2 = nvfp4.quantize(w)
    assert weight_scale.dtype == torch.float8_e4m3fn and scale_2.shape == (2,)
    back = nvfp4.dequantize(weight, weight_scale, scale_2)
    factor = (fp8.widen(weight_scale) * scale_2[:, None, None]).repeat_interleave(16, -1)
    # as MXFP4's bound, on the block's factor; plus what a scale below e4m3's smallest step
    # (2^-9 · weight_scale_2, half of it by rounding) can leave of a block of tiny values
    floor = 6 * 2.0**-10 * scale_2[:, None, None]
    assert torch.all((back - w).abs() <= torch.maximum(w.abs(), factor) / 4 + floor)
