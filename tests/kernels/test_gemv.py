"""Skinny decode GEMM against F.linear: interpreter on CPU in fp32 at small shapes, and the
attention projections and lm_head of Qwen3-30B-A3B in bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from moelab.kernels import fp8, gemv
from moelab.kernels.gemv import GemvConfig

from .kernel_inputs import DEVICE, assert_matches, randn

pytestmark = pytest.mark.usefixtures("triton_runs")

BF16 = torch.bfloat16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Qwen3-30B-A3B: qkv [(32 + 2*4) * 128, 2048], o [2048, 32 * 128], lm_head [vocab, 2048].
REAL_SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}


def projection(
    gen: torch.Generator, n: int, k: int, with_bias: bool, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight [N, K] scaled so that outputs stay near 1, and a bias [N] when asked."""
    weight = randn(gen, n, k, scale=k**-0.5, dtype=dtype)
    return weight, randn(gen, n, dtype=dtype) if with_bias else None


@pytest.mark.parametrize(
    ("tokens", "n", "k", "config"),
    [
        (1, 37, 200, GemvConfig(block_n=4, block_k=64)),  # ragged N and K, several steps
        (1, 5, 40, GemvConfig(block_n=1, block_k=16)),  # one row per program
        (1, 300, 96, None),  # the heuristic's tiles
        (2, 37, 200, GemvConfig(block_k=64)),  # tl.dot, ragged N and K
        (7, 70, 100, None),
        (gemv.MAX_TOKENS, 33, 48, GemvConfig(block_k=16)),  # the largest batch
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(gen, tokens, n, k, config, with_bias):
    x = randn(gen, tokens, k)
    weight, bias = projection(gen, n, k, with_bias)
    out = gemv.linear_decode(x, weight, bias, config=config)
    ref = gemv.linear_decode_ref(x, weight, bias)
    assert_matches(out, ref, tol=1e-5)
    assert ref.abs().max().item() > 0  # the comparison is not between zeros


@pytest.mark.parametrize("tokens", [1, 5])
# 3 splits of K=200 in 64-wide steps take 128, 72 and nothing: an empty split must still count 0.
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_matches_reference(gen, tokens, split_k):
    x = randn(gen, tokens, 200)
    weight, bias = projection(gen, 45, 200, with_bias=True)
    config = GemvConfig(block_n=4 if tokens == 1 else 16, block_k=64, split_k=split_k)
    out = gemv.linear_decode(x, weight, bias, config=config)
    assert_matches(out, gemv.linear_decode_ref(x, weight, bias), tol=1e-5)


def test_heuristic_split_runs_and_matches(gen):
    # 64 rows are 4 blocks of 16: on 8 SMs the heuristic splits K=2048 to fill them.
    config = gemv.choose_config(8, 64, 2048, sms=8)
    assert config.split_k > 1
    x = randn(gen, 8, 2048)
    weight, bias = projection(gen, 64, 2048, with_bias=True)
    out = gemv.linear_decode(x, weight, bias, config=config)
    assert_matches(out, gemv.linear_decode_ref(x, weight, bias), tol=1e-5)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_half_storage_with_fp32_compute(gen, dtype, tokens):
    x = randn(gen, tokens, 96, dtype=dtype)
    weight, bias = projection(gen, 40, 96, with_bias=True, dtype=dtype)
    out = gemv.linear_decode(x, weight, bias, compute_dtype=torch.float32)
    ref = gemv.linear_decode_ref(x, weight, bias, compute_dtype=torch.float32)
    # Both sum in fp32; the rounding to 16 bits may differ by a unit where the orders differ.
    assert_matches(out, ref, tol=1e-2)


@pytest.mark.parametrize("tokens", [1, 3])
def test_rows_spaced_wider_than_k(gen, tokens):
    # Column slices of wider buffers: rows are contiguous but K apart no longer.
    x = randn(gen, tokens, 80)[:, 8:72]
    weight = randn(gen, 20, 100, scale=0.1)[:, 30:94]
    out = gemv.linear_decode(x, weight, config=GemvConfig(block_n=16, block_k=16))
    assert_matches(out, gemv.linear_decode_ref(x, weight), tol=1e-5)


def test_compute_dtype_rounds_the_operands(gen):
    # 1 + 2**-12 is 1 in bf16: in a bf16 compute dtype each product is 1 and the sum 64 exactly.
    x = torch.full((1, 64), 1 + 2**-12, device=DEVICE)
    weight = torch.ones(3, 64, device=DEVICE)
    out = gemv.linear_decode(x, weight, compute_dtype=BF16)
    assert torch.equal(out, gemv.linear_decode_ref(x, weight, compute_dtype=BF16))
    assert torch.equal(out, torch.full((1, 3), 64.0, device=DEVICE))


@pytest.mark.parametrize(("tokens", "n", "k"), [(1, *s) for s in REAL_SHAPES.values()])
def test_heuristic_fills_an_h200_in_one_launch_for_one_token(tokens, n, k):
    config = gemv.choose_config(tokens, n, k, sms=132)
    assert config.split_k == 1
    assert triton.cdiv(n, config.block_n) >= gemv.ROW_PROGRAMS_PER_SM * 132


@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_fp8_tiles_give_one_tokens_programs_as_many_bytes_as_bf16s(name):
    """One token over an FP8 weight: bf16's row blocks, widened until a program reads
    FP8_PROGRAM_BYTES (half a weight's bytes: o's 2-row blocks become 4), each step of
    ROW_TILE_ELEMENTS; more tokens take bf16's tiles."""
    n, k = REAL_SHAPES[name]
    bf16, fp8 = gemv.choose_config(1, n, k, sms=132), gemv.choose_fp8_config(1, n, k, sms=132)
    assert fp8.block_n * k >= gemv.FP8_PROGRAM_BYTES or fp8.block_n == 16
    assert fp8.block_n == bf16.block_n or (fp8.block_n // 2) * k < gemv.FP8_PROGRAM_BYTES
    assert fp8.block_n * fp8.block_k == max(gemv.ROW_TILE_ELEMENTS, 256 * fp8.block_n)
    if name == "o":
        assert (bf16.block_n, fp8.block_n, fp8.block_k) == (2, 4, 1024)
    assert gemv.choose_fp8_config(8, n, k, sms=132) == gemv.choose_config(8, n, k, sms=132)


@pytest.mark.parametrize(("tokens", "n", "k"), [(8, *s) for s in REAL_SHAPES.values()])
def test_heuristic_for_a_batch_uses_dot_tiles_and_fills_an_h200(tokens, n, k):
    config = gemv.choose_config(tokens, n, k, sms=132)
    assert config.block_n >= 16  # tl.dot
    assert triton.cdiv(n, config.block_n) * config.split_k >= gemv.SPLIT_PROGRAMS_PER_SM * 132
    assert k // config.split_k >= 2 * config.block_k  # each split keeps two steps or more


def test_cpu_calls_go_to_f_linear(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(gemv, "linear_decode", refuse)
    x = torch.randn(2, 64, generator=gen).to(BF16)
    weight = torch.randn(24, 64, generator=gen).to(BF16)
    bias = torch.randn(24, generator=gen).to(BF16)
    assert gemv.kernel_accepts(x, weight, bias)  # only the device keeps it off the kernel
    assert torch.equal(gemv.linear(x, weight, bias), F.linear(x, weight, bias))


def _inputs(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = torch.ones(4, 32, dtype=BF16)
    weight = torch.ones(8, 32, dtype=BF16)
    bias = torch.ones(8, dtype=BF16)
    changed = {
        "too many tokens": (torch.ones(gemv.MAX_TOKENS + 1, 32, dtype=BF16), weight, bias),
        "no tokens": (torch.ones(0, 32, dtype=BF16), weight, bias),
        "fp32": (x.float(), weight.float(), bias.float()),
        "x not contiguous": (torch.ones(32, 4, dtype=BF16).t(), weight, bias),
        "weight columns strided": (x, torch.ones(32, 8, dtype=BF16).t(), bias),
        "weight of another dtype": (x, weight.half(), bias),
        "bias of another dtype": (x, weight, bias.half()),
        "x 3-D": (x.view(2, 2, 32), weight, bias),
    }
    return changed.get(case, (x, weight, bias))


@pytest.mark.parametrize(
    ("case", "accepted"),
    [
        ("decode batch", True),
        ("too many tokens", False),
        ("no tokens", False),
        ("fp32", False),
        ("x not contiguous", False),
        ("weight columns strided", False),
        ("weight of another dtype", False),
        ("bias of another dtype", False),
        ("x 3-D", False),
    ],
)
def test_kernel_takes_only_contiguous_half_precision_decode_batches(case, accepted):
    assert gemv.kernel_accepts(*_inputs(case)) is accepted


def test_kernel_takes_fp16_and_no_bias():
    x, weight, _ = _inputs("decode batch")
    assert gemv.kernel_accepts(x.half(), weight.half(), None)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "b_shape", "dtype", "message"),
    [
        ((gemv.MAX_TOKENS + 1, 32), (8, 32), None, torch.float32, f"{gemv.MAX_TOKENS + 1} tokens"),
        ((0, 32), (8, 32), None, torch.float32, "0 tokens"),
        ((2, 32), (8, 31), None, torch.float32, "weight"),
        ((2, 2, 32), (8, 32), None, torch.float32, r"x must be \[T, K\]"),
        ((2, 32), (8, 32), (7,), torch.float32, r"bias must be \[8\]"),
        ((2, 32), (8, 32), None, torch.int32, "unsupported dtype"),
    ],
)
@pytest.mark.parametrize("fn", [gemv.linear_decode, gemv.linear_decode_ref])
def test_bad_shapes_and_dtypes_get_a_clear_error(fn, x_shape, w_shape, b_shape, dtype, message):
    x = torch.ones(x_shape, dtype=dtype)
    weight = torch.ones(w_shape, dtype=dtype)
    bias = torch.ones(b_shape, dtype=dtype) if b_shape else None
    with pytest.raises(ValueError, match=message):
        fn(x, weight, bias)


@pytest.mark.parametrize(
    ("x", "weight", "message"),
    [
        (torch.ones(2, 32), torch.ones(8, 32, dtype=BF16), "share one dtype"),
        (torch.ones(32, 2).t(), torch.ones(8, 32), "x must have a contiguous last dimension"),
        (torch.ones(2, 32), torch.ones(32, 8).t(), "weight must have a contiguous last"),
    ],
)
def test_mismatched_dtypes_and_strided_rows_get_a_clear_error(x, weight, message):
    with pytest.raises(ValueError, match=message):
        gemv.linear_decode(x, weight)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_n": 3}, "block_n"),
        ({"block_k": 8}, "block_k"),
        ({"block_k": 48}, "block_k"),
        ({"num_warps": 6}, "num_warps"),
        ({"split_k": 0}, "split_k"),
        ({"num_stages": 0}, "num_stages"),
    ],
)
def test_bad_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        GemvConfig(**fields)


def test_narrow_rows_are_refused_for_several_tokens(gen):
    x = randn(gen, 2, 32)
    weight, _ = projection(gen, 8, 32, with_bias=False)
    with pytest.raises(ValueError, match="block_n=8"):
        gemv.linear_decode(x, weight, config=GemvConfig(block_n=8))


def cuda_projection(
    gen: torch.Generator, tokens: int, n: int, k: int, with_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = torch.randn(tokens, k, generator=gen).to("cuda", BF16)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to("cuda", BF16)
    bias = torch.randn(n, generator=gen).to("cuda", BF16) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("tokens", [1, 8, gemv.MAX_TOKENS])
@pytest.mark.parametrize("name", list(REAL_SHAPES))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.cuda
@needs_cuda
def test_real_shapes_on_cuda(gen, name, tokens, with_bias):
    n, k = REAL_SHAPES[name]
    x, weight, bias = cuda_projection(gen, tokens, n, k, with_bias)
    out = gemv.linear_decode(x, weight, bias)
    ref = gemv.linear_decode_ref(
        x.float(), weight.float(), bias.float() if bias is not None else None
    )
    assert_matches(out, ref.to(BF16), tol=1e-2)


@pytest.mark.parametrize("tokens", [1, 8])  # the o projection: one launch, then split K
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.cuda
@needs_cuda
def test_graph_replay_equals_eager_bit_for_bit(gen, tokens, with_bias):
    n, k = REAL_SHAPES["o"]
    x, weight, bias = cuda_projection(gen, tokens, n, k, with_bias)
    gemv.linear(x, weight, bias)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear(x, weight, bias)
    x.copy_(torch.randn(tokens, k, generator=gen))
    graph.replay()
    assert torch.equal(out, gemv.linear(x, weight, bias))
    ref = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    assert_matches(out, ref.to(BF16), tol=1e-2)


@pytest.mark.cuda
@needs_cuda
def test_dispatcher_on_cuda_takes_single_tokens_only(gen, monkeypatch):
    calls = []
    kernel = gemv.linear_decode

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(gemv, "linear_decode", counted)
    weight = (torch.randn(256, 512, generator=gen) * 512**-0.5).to("cuda", BF16)
    for tokens in (1, 2, gemv.MAX_TOKENS, gemv.MAX_TOKENS + 1, 300):
        x = torch.randn(tokens, 512, generator=gen).to("cuda", BF16)
        out = gemv.linear(x, weight)
        if tokens > gemv.DISPATCH_MAX_TOKENS:
            assert torch.equal(out, F.linear(x, weight))
    # cuBLAS is faster from two tokens on (kernels/bench.py)
    assert calls == [1]


# FP8 weights with 128x128 block factors (kernels/fp8.py), against a reference that dequantizes
# them by the format's definition (`fp8.dequantize`, decoded from the bits alone)


def fp8_projection(
    gen: torch.Generator, n: int, k: int, spread: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight [N, K] and its factors, block factors apart by up to 2^spread (so a wrong
    block's factor shows), with weights of every e4m3 range among them."""
    weight, _ = projection(gen, n, k, with_bias=False)
    rows = torch.exp2(spread * torch.rand(n, 1, generator=gen)).to(weight.device)
    cols = torch.exp2(spread * torch.rand(1, k, generator=gen)).to(weight.device)
    return fp8.quantize(weight * rows * cols)


@pytest.mark.parametrize(
    ("tokens", "n", "k", "config"),
    [
        (1, 300, 400, GemvConfig(block_n=4, block_k=64)),  # ragged blocks, several per program
        # a step over several blocks (each summed before its factor), the last block ragged, a split
        (1, 256, 384, GemvConfig(block_n=16, block_k=512)),
        (1, 64, 1000, GemvConfig(block_n=2, block_k=1024)),
        (1, 64, 900, GemvConfig(block_n=4, block_k=256, split_k=2)),
        (1, 130, 96, None),  # the heuristic's tiles, a block of 2 rows at the edge
        (3, 300, 400, GemvConfig(block_n=16, block_k=64)),  # tl.dot, ragged
        (gemv.MAX_TOKENS, 160, 256, None),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_weights_match_their_dequantized_reference(gen, tokens, n, k, config, with_bias):
    x = randn(gen, tokens, k)
    weight, scale = fp8_projection(gen, n, k, spread=6.0)
    bias = randn(gen, n) if with_bias else None
    out = gemv.linear_decode_fp8(x, weight, scale, bias, config=config)
    ref = gemv.linear_decode_fp8_ref(x, weight, scale, bias)
    assert_matches(out, ref, tol=1e-5)
    assert ref.abs().max().item() > 0
    # the reference itself: the bits decoded, times their block's factor
    expect = F.linear(x, fp8.widen(weight) * scale.repeat_interleave(128, 0)[:n].repeat_interleave(
        128, 1)[:, :k], bias)  # fmt: skip
    assert_matches(ref, expect, tol=1e-5)


@pytest.mark.parametrize("tokens", [1, 4])
def test_fp8_weights_split_k_and_take_uint8_bits(gen, tokens):
    x = randn(gen, tokens, 512)
    weight, scale = fp8_projection(gen, 64, 512)
    bias = randn(gen, 64)
    config = GemvConfig(block_n=4 if tokens == 1 else 16, block_k=128, split_k=3)
    out = gemv.linear_decode_fp8(x, weight.view(torch.uint8), scale, bias, config=config)
    assert_matches(out, gemv.linear_decode_fp8_ref(x, weight, scale, bias), tol=1e-5)


@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (256, 1024, GemvConfig(block_n=4, block_k=512)),  # steps of four blocks
        (64, 900, GemvConfig(block_n=4, block_k=256, split_k=2)),  # each split's first step
        (130, 96, None),  # one ragged step, a block of 2 rows at the edge
    ],
)
def test_fp8_first_step_read_early_gives_the_same_bits(gen, n, k, config):
    """early_weights (as `linear` calls it): one token's first step taken before the loop, its
    bits and factors loaded before the wait, gives the loop's result bit for bit."""
    x = randn(gen, 1, k)
    weight, scale = fp8_projection(gen, n, k, spread=6.0)
    bias = randn(gen, n)
    early = gemv.linear_decode_fp8(x, weight, scale, bias, config=config, early_weights=True)
    plain = gemv.linear_decode_fp8(x, weight, scale, bias, config=config)
    assert torch.equal(early, plain)
    assert_matches(early, gemv.linear_decode_fp8_ref(x, weight, scale, bias), tol=1e-5)


def test_fp8_products_hold_large_activations_and_subnormal_weights(gen):
    """Activations of 2^40 and weights among e4m3's subnormals (2^-9 times their factor): every
    product stays a normal fp32 (each weight taken times 2^-8), so the result is the
    reference's."""
    x = randn(gen, 1, 256) * 2.0**40
    weight = torch.full((128, 256), 2.0**-9).to(torch.float8_e4m3fn).to(DEVICE)
    weight[:, ::2] = torch.tensor(448.0).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0**-20, 2.0**10]], device=DEVICE)
    out = gemv.linear_decode_fp8(x, weight, scale)
    ref = gemv.linear_decode_fp8_ref(x, weight, scale)
    assert torch.isfinite(out).all()
    assert_matches(out, ref, tol=1e-5)


def test_fp8_one_token_with_rows_of_odd_bytes_takes_the_dot_kernel(gen):
    # K = 902: the rows do not split into the one-token kernel's 4-byte words
    x = randn(gen, 1, 902)
    weight, scale = fp8_projection(gen, 64, 902)
    out = gemv.linear_decode_fp8(x, weight, scale)
    assert_matches(out, gemv.linear_decode_fp8_ref(x, weight, scale), tol=1e-5)
    with pytest.raises(ValueError, match=r"rows of 902 bytes .* blocks of 16 rows or more"):
        gemv.linear_decode_fp8(x, weight, scale, config=GemvConfig(block_n=4, block_k=256))


@pytest.mark.parametrize(
    ("weight", "scale", "message"),
    [
        (torch.zeros(8, 16), torch.ones(1, 1), "weight must be FP8"),
        (torch.zeros(8, 16, dtype=torch.uint8), torch.ones(1, 2), r"must be fp32 \[1, 1\]"),
        (torch.zeros(8, 16, dtype=torch.uint8), torch.ones(1, 1, dtype=torch.float64), "fp32"),
    ],
)
def test_fp8_calls_with_wrong_factors_get_a_clear_error(weight, scale, message):
    with pytest.raises(ValueError, match=message):
        gemv.linear_decode_fp8(torch.ones(1, 16), weight, scale)


@pytest.mark.parametrize("name", ["qkv", "o"])
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.cuda
@needs_cuda
def test_fp8_real_shapes_on_cuda(gen, name, tokens):
    n, k = REAL_SHAPES[name]
    x = randn(gen, tokens, k, dtype=BF16)
    weight, scale = fp8_projection(gen, n, k)
    out = gemv.linear_decode_fp8(x, weight, scale)
    ref = gemv.linear_decode_fp8_ref(x, weight, scale)
    assert_matches(out.float(), ref.float(), tol=2e-2)
