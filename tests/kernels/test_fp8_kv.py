"""The FP8 KV cache's kernels (kernels/fp8_kv.py) against their torch references: the e4m3
narrowing bit for bit, the KV write of rope_kv bit for bit, the decode attention over FP8 pages
within fp32 tolerance (interpreter on CPU, fp32); at real shapes on a GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import fp8, fp8_kv, paged_attention, rope_kv
from moelab.kernels.common import tl, triton
from moelab.kernels.paged_attention import AttentionConfig

from .kernel_inputs import DEVICE, assert_matches, randn
from .test_paged_attention import paged_cache
from .test_rope_kv import Shape, make_args

pytestmark = pytest.mark.usefixtures("triton_runs")


@triton.jit
def _narrow_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(x_ptr + idx, mask=ok, other=0.0)
    tl.store(out_ptr + idx, fp8_kv.narrowed(x).to(tl.uint8), mask=ok)


def narrow(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _narrow_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value (254 codes), by the format's definition."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    return fp8.widen(codes)


def test_narrowing_rounds_as_torchs_cast_ties_to_even(gen):
    values = e4m3_values().sort().values
    ties = (values[1:] + values[:-1]) / 2  # halfway between neighbours: ties go to the even code
    near = torch.cat([ties * (1 + 2**-20), ties * (1 - 2**-20)])
    spread = torch.exp2(torch.rand(4000, generator=gen) * 22 - 13) * torch.sign(
        torch.randn(4000, generator=gen)
    )
    x = torch.cat([values, ties, near, spread.clamp(-448, 448), torch.tensor([0.0, -0.0])])
    expected = x.to(torch.float8_e4m3fn).view(torch.uint8)
    got = narrow(x.to(DEVICE)).cpu()
    differ = got != expected
    assert not differ.any(), (x[differ][:4].tolist(), got[differ][:4], expected[differ][:4])


def test_widening_gives_every_code_its_value():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    got = fp8_kv.dequantize_heads(codes, torch.tensor(1.0), torch.float32)
    assert torch.equal(got, fp8.widen(codes))


def test_a_head_round_trips_within_e4m3s_precision(gen):
    """Each head's own factor: a head of small values keeps its relative precision beside a head
    of large ones (3 mantissa bits: at most 1/16 of a value off, subnormals aside)."""
    x = torch.randn(7, 3, 64, generator=gen)
    x[:, 0] *= 1e-3
    x[:, 2] *= 1e3
    bits, factors = fp8_kv.quantize_heads(x)
    assert bits.dtype == torch.uint8 and factors.shape == (7, 3)
    back = fp8_kv.dequantize_heads(bits, factors, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # half a step of e4m3's mantissa, or of its subnormals (2^-9) times the head's factor
    assert ((back - x).abs() <= x.abs() / 16 + amax / 448 * 2**-10).all()
    torch.testing.assert_close(back.abs().amax(-1), amax.squeeze(-1), rtol=1e-6, atol=0)


def fp8_caches(args: dict[str, object]) -> dict[str, object]:
    """make_args' caches as FP8 pages (bits left at a code no write gives) and their factors."""
    k_cache = args["k_cache"]
    scales = torch.full(k_cache.shape[:-1], float("nan"), device=DEVICE)
    return {
        **args,
        "k_cache": torch.full(k_cache.shape, 0x7F, dtype=torch.uint8, device=DEVICE),
        "v_cache": torch.full(k_cache.shape, 0x7F, dtype=torch.uint8, device=DEVICE),
        "kv_scales": (scales, scales.clone()),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
def test_the_kv_write_stores_fp8_bit_for_bit(gen, dtype, qk_norm):
    args = fp8_caches(make_args(gen, Shape(tokens=6, dtype=dtype, qk_norm=qk_norm)))
    ref_args = {
        **args,
        "k_cache": args["k_cache"].clone(),
        "v_cache": args["v_cache"].clone(),
        "kv_scales": tuple(s.clone() for s in args["kv_scales"]),
    }
    q_ref = rope_kv.qk_norm_rope_kv_ref(**ref_args)
    q = rope_kv.qk_norm_rope_kv_triton(**args)
    assert torch.equal(q, q_ref)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(args[name], ref_args[name]), name
    for got, want in zip(args["kv_scales"], ref_args["kv_scales"], strict=True):
        assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))
    written = args["slots"]
    assert torch.isfinite(args["kv_scales"][0].view(-1, Shape().num_kv_heads)[written]).all()


def test_a_bf16_cache_under_fp32_compute_holds_the_rounded_values(gen):
    args = make_args(gen, Shape(tokens=4))
    for name in ("k_cache", "v_cache"):
        args[name] = args[name].to(torch.bfloat16)
    ref_args = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    rope_kv.qk_norm_rope_kv_ref(**ref_args)
    rope_kv.qk_norm_rope_kv_triton(**args)
    for name in ("k_cache", "v_cache"):
        assert args[name].dtype == torch.bfloat16
        assert torch.equal(args[name].nan_to_num(0.0), ref_args[name].nan_to_num(0.0))


def fp8_paged_cache(gen, seq_lens, block_size, kv_heads, head_dim, max_blocks):
    """paged_cache's pages quantized per (token, head); the slots no sequence owns hold a code
    that widens to ±480 and a NaN factor, so that a read past a sequence's end shows."""
    k_cache, v_cache, tables, lens = paged_cache(
        gen, seq_lens, block_size, kv_heads, head_dim, max_blocks
    )
    pages = []
    for cache in (k_cache, v_cache):
        bits, factors = fp8_kv.quantize_heads(cache.nan_to_num(0.0))
        unowned = cache.isnan().any(-1)
        bits[unowned] = 0x7F
        factors[unowned] = float("nan")
        pages.append((bits, factors))
    (k_bits, k_factors), (v_bits, v_factors) = pages
    return k_bits, v_bits, (k_factors, v_factors), tables, lens


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "block_size", "seq_lens", "config"),
    [
        (4, 4, 32, 4, [1, 3, 17], AttentionConfig(block_n=16)),
        (8, 2, 32, 16, [1, 33, 100], AttentionConfig(block_n=32, num_splits=3)),
        (4, 2, 64, 8, [70, 9], AttentionConfig(block_n=16, num_splits=16)),
    ],
)
def test_decode_attention_reads_fp8_pages(
    gen, q_heads, kv_heads, head_dim, block_size, seq_lens, config
):
    max_blocks = -(-max(seq_lens) // block_size) + 1
    k_bits, v_bits, scales, tables, lens = fp8_paged_cache(
        gen, seq_lens, block_size, kv_heads, head_dim, max_blocks
    )
    q = randn(gen, len(seq_lens), q_heads, head_dim)
    scale = head_dim**-0.5
    out = paged_attention.paged_attention_decode_triton(
        q, k_bits, v_bits, tables, lens, scale, config=config, kv_scales=scales
    )
    ref = paged_attention.paged_attention_decode_ref(
        q, k_bits, v_bits, tables, lens, scale, kv_scales=scales
    )
    assert_matches(out, ref, tol=1e-5)


def test_the_reference_widens_by_the_formats_definition(gen):
    """The reference over FP8 pages equals the one over the pages widened by fp8.widen."""
    k_bits, v_bits, (k_f, v_f), tables, lens = fp8_paged_cache(gen, [9, 20], 4, 2, 16, 6)
    q = randn(gen, 2, 4, 16)
    out = paged_attention.paged_attention_decode_ref(
        q, k_bits, v_bits, tables, lens, 0.25, kv_scales=(k_f, v_f)
    )
    k_wide = fp8.widen(k_bits) * k_f[..., None]
    v_wide = fp8.widen(v_bits) * v_f[..., None]
    ref = paged_attention.paged_attention_decode_ref(q, k_wide, v_wide, tables, lens, 0.25)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("length", [1, 37, 64])
def test_a_sequences_pages_widen_for_prefill_bit_for_bit(gen, dtype, length):
    k_bits, _, (k_factors, _), tables, _ = fp8_paged_cache(gen, [64], 8, 2, 32, 9)
    pages = tables[0, : -(-length // 8)].long()
    out = fp8_kv.gather_triton(k_bits, k_factors, pages, length, dtype)
    ref = fp8_kv.gather_ref(k_bits, k_factors, pages, length, dtype)
    assert out.shape == (length, 2, 32) and out.dtype == dtype
    assert torch.equal(out, ref)


def test_fp8_pages_need_their_factors():
    q = torch.ones(1, 2, 16)
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_scales"):
        paged_attention.paged_attention_decode_ref(q, cache, cache, tables, torch.ones(1), 1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_shapes_on_the_gpu(gen):
    """Qwen3-30B-A3B's attention (32 q heads, 4 KV heads, head_dim 128) in bf16: the KV write
    bit for bit, and decode attention over FP8 pages against the reference."""
    shape = Shape(tokens=8, num_heads=32, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16,
                  grid_values=False, num_blocks=16, block_size=16)  # fmt: skip
    args = fp8_caches(make_args(gen, shape))
    ref_args = {
        **args,
        "k_cache": args["k_cache"].clone(),
        "v_cache": args["v_cache"].clone(),
        "kv_scales": tuple(s.clone() for s in args["kv_scales"]),
    }
    rope_kv.qk_norm_rope_kv_ref(**ref_args)
    rope_kv.qk_norm_rope_kv_triton(**args)
    assert torch.equal(args["k_cache"], ref_args["k_cache"])
    assert torch.equal(args["v_cache"], ref_args["v_cache"])
    k_bits, v_bits, scales, tables, lens = fp8_paged_cache(gen, [1, 700, 4000], 16, 4, 128, 260)
    q = randn(gen, 3, 32, 128, dtype=torch.bfloat16)
    out = paged_attention.paged_attention_decode_triton(
        q, k_bits, v_bits, tables, lens, 128**-0.5, kv_scales=scales
    )
    ref = paged_attention.paged_attention_decode_ref(
        q, k_bits, v_bits, tables, lens, 128**-0.5, compute_dtype=torch.float32, kv_scales=scales
    )
    assert_matches(out, ref, tol=2e-2)
    pages = tables[2, : -(-4000 // 16)].long()
    widened = fp8_kv.gather_triton(k_bits, scales[0], pages, 4000, torch.bfloat16)
    assert torch.equal(widened, fp8_kv.gather_ref(k_bits, scales[0], pages, 4000, torch.bfloat16))
