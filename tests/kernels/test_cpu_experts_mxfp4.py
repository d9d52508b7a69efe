"""The CPU expert kernel with MXFP4 weights against the dequantizing reference (kernels/mxfp4.py).

A widened e2m1 value times its block's E8M0 scale is the dequantized weight exactly, so every
output must lie within the fp32 error bound of the exact (fp64) product with the weights
`mxfp4.dequantize` gives; where an expert serves several tokens the kernel goes on as with those
fp32 weights, bit for bit. Inputs are fresh random numbers on every run; the seed is in every
failure message.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from moelab.kernels import cpu_experts_bench, e2m1, mxfp4
from moelab.kernels.cpu_experts import CpuExpertRunner, cpu_experts_ref, load_native

from .test_cpu_experts import SEED, assert_within_bound, exact_and_bound

SIMD = ["avx512", "avx2", "scalar"]
_SIMD_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}

# (experts, H, I, tokens, pairs): one block a row; rows of several blocks and row counts that
# leave a lone row or a lone tile at the end of a task; several experts a token; experts that
# serve 4 or 5 tokens (tiles of 4 and 1), one pair twice.
SERVED = {0: (0, 1, 5, 4, 3), 1: (1, 2, 3, 5), 2: (0, 4, 1, 5), 3: (2, 3, 3, 5, 1)}
CASES = {
    "decode-1": (3, 32, 32, 1, [(1, 0)]),
    "decode-top4": (6, 160, 96, 1, [(5, 0), (0, 0), (3, 0), (1, 0)]),
    # rows of whole 64-value steps: AVX2 reads one token's rows against x and h in their slots
    "decode-steps": (6, 192, 128, 1, [(2, 0), (4, 0), (0, 0), (5, 0)]),
    "batch-top3": (5, 96, 64, 4, [(e, t) for t in range(4) for e in ((t + 1) % 5, (2 * t) % 5, 4)]),
    "batch-shared": (4, 224, 96, 6, [(e, t) for e, ts in SERVED.items() for t in ts]),
}
SHARED_CASES = ["batch-shared"]


@pytest.fixture(scope="session")
def simd_levels() -> list[str]:
    """The code paths the native build has on this CPU (building it if needed, once)."""
    return list(load_native().simd_levels())


def mxfp4_inputs(case: str, salt: str = ""):
    """(args, scales, dequantized args): random x, and weights quantized to MXFP4 whose rows and
    columns span a few binades, so that a scale taken from the wrong block shows."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(f"{case} {salt}".encode()))
    num_experts, hidden, inter, num_tokens, pairs = CASES[case]

    def weights(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
        rows = torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float())
        cols = torch.exp2(torch.randint(-3, 4, (shape[-1],), generator=gen).float())
        return mxfp4.quantize(w * rows * cols)

    x = torch.randn(num_tokens, hidden, generator=gen)
    w13, w13_scale = weights(num_experts, 2 * inter, hidden)
    w2, w2_scale = weights(num_experts, hidden, inter)
    pair_expert = torch.tensor([e for e, _ in pairs], dtype=torch.int32)
    pair_token = torch.tensor([t for _, t in pairs], dtype=torch.int32)
    pair_weight = torch.rand(len(pairs), generator=gen) + 0.1
    pairs_args = (pair_expert, pair_token, pair_weight)
    scales = {"w13_scale": w13_scale, "w2_scale": w2_scale}
    dequantized = (x, mxfp4.dequantize(w13, w13_scale), mxfp4.dequantize(w2, w2_scale))
    return (x, w13, w2, *pairs_args), scales, (*dequantized, *pairs_args)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("simd", SIMD)
def test_mxfp4_matches_exact_within_fp32_bound(
    simd: str, case: str, simd_levels: list[str]
) -> None:
    if simd not in simd_levels:
        pytest.skip(f"this CPU has no {simd}")
    args, scales, dequantized = mxfp4_inputs(case, simd)
    num_tokens, hidden = args[0].shape
    poisoned = torch.full((num_tokens, hidden), float("nan"))
    with CpuExpertRunner(3, "native", simd, task_kb=1) as runner:
        out = runner.run(*args, **scales)
        into = runner.run(*args, out=poisoned, **scales)
    assert_within_bound(out, *exact_and_bound(*dequantized), f"{case} {simd}")
    assert torch.equal(into, out), f"{case} {simd} (seed {SEED}): a NaN-filled out changed it"


@pytest.mark.parametrize("case", SHARED_CASES)
@pytest.mark.parametrize("simd", SIMD)
def test_tiles_of_tokens_equal_the_dequantized_weights_bit_for_bit(
    simd: str, case: str, simd_levels: list[str]
) -> None:
    if simd not in simd_levels:
        pytest.skip(f"this CPU has no {simd}")
    args, scales, dequantized = mxfp4_inputs(case, simd)
    with CpuExpertRunner(2, "native", simd) as runner:
        out = runner.run(*args, **scales)
        want = runner.run(*dequantized)
    assert torch.equal(out, want), f"{case} {simd} (seed {SEED}): differs from fp32 weights"


@pytest.mark.parametrize("simd", SIMD)
def test_scale_extremes_and_the_nan_scale_reach_the_output(
    simd: str, simd_levels: list[str]
) -> None:
    """2^-127 (a subnormal scale) widens exactly; 2^127 overflows where the dequantized weights
    do; a block with the NaN scale makes the down projection's row NaN for exactly the tokens
    its expert serves, and a gate row's the whole output of those tokens."""
    if simd not in simd_levels:
        pytest.skip(f"this CPU has no {simd}")
    args, scales, _ = mxfp4_inputs("batch-top3", simd)
    pair_expert, pair_token = args[3], args[4]
    expert = int(pair_expert[0])
    served = pair_token[pair_expert == expert].unique()
    with CpuExpertRunner(2, "native", simd) as runner:
        for code in (0, 254, 0xFF):
            w2_scale = scales["w2_scale"].clone()
            w2_scale[expert, 7, 1] = code
            out = runner.run(*args, w13_scale=scales["w13_scale"], w2_scale=w2_scale)
            ref = cpu_experts_ref(*args, w13_scale=scales["w13_scale"], w2_scale=w2_scale)
            # which of inf, -inf and NaN an overflowing sum gives depends on the order of its
            # products (and on fused multiply-adds); that it does not stay finite does not
            assert torch.equal(out.isfinite(), ref.isfinite()), f"scale {code} (seed {SEED})"
            if code != 254:
                assert torch.equal(out.isnan(), ref.isnan()), f"scale {code} (seed {SEED})"
            if code == 0:
                w2 = mxfp4.dequantize(args[2], w2_scale)
                bound = exact_and_bound(args[0], mxfp4.dequantize(args[1], scales["w13_scale"]),
                                        w2, *args[3:])  # fmt: skip
                assert_within_bound(out, *bound, f"scale 0, {simd}")
            if code == 0xFF:
                want_nan = torch.zeros_like(out, dtype=torch.bool)
                want_nan[served, 7] = True
                assert torch.equal(out.isnan(), want_nan)
        w13_scale = scales["w13_scale"].clone()
        w13_scale[expert, 3, 0] = 0xFF
        out = runner.run(*args, w13_scale=w13_scale, w2_scale=scales["w2_scale"])
        want_nan = torch.zeros_like(out, dtype=torch.bool)
        want_nan[served] = True
        assert torch.equal(out.isnan(), want_nan)


@pytest.mark.parametrize("by64", [False, True], ids=["block", "two-blocks"])
@pytest.mark.parametrize("simd", SIMD)
def test_the_widening_gives_every_code_its_value_in_order(
    simd: str, by64: bool, simd_levels: list[str]
) -> None:
    """Each SIMD level's loads (MXFP4's and NVFP4's) widen every byte, both its codes, to twice
    the values e2m1 defines, the low nibble's first, at every place of a block."""
    if simd not in simd_levels:
        pytest.skip(f"this CPU has no {simd}")
    gen = torch.Generator().manual_seed(SEED)
    every_byte = torch.cat([torch.randperm(256, generator=gen) for _ in range(4)]).to(torch.uint8)
    out = torch.full((2 * every_byte.numel(),), float("nan"))
    load_native().widen_e2m1(
        _SIMD_CODES[simd], every_byte.data_ptr(), out.data_ptr(), every_byte.numel(), by64
    )
    codes = torch.stack([every_byte & 0xF, every_byte >> 4], dim=1).flatten()
    want = 2 * e2m1.widen(codes)
    wrong = out != want
    assert not wrong.any(), f"(seed {SEED}) values {wrong.nonzero().flatten().tolist()} wrong"


def test_the_reference_dequantizes_and_the_torch_kernel_is_it() -> None:
    args, scales, dequantized = mxfp4_inputs("batch-top3")
    ref = cpu_experts_ref(*args, **scales)
    assert torch.equal(ref, cpu_experts_ref(*dequantized))
    with CpuExpertRunner(torch.get_num_threads(), "torch") as runner:
        assert torch.equal(runner.run(*args, **scales), ref)


def test_gpt_oss_expert_shape_is_independent_of_thread_count() -> None:
    """gpt-oss's experts (H = I = 2880: 90 blocks a row), one serving one token and one a batch
    of 3, both of them the first token's: every thread count and task size gives the same
    bits."""
    CASES["gpt-oss"] = (2, 2880, 2880, 3, [(1, 0), (0, 0), (1, 1), (1, 2)])
    try:
        args, scales, dequantized = mxfp4_inputs("gpt-oss")
    finally:
        del CASES["gpt-oss"]
    with CpuExpertRunner(1, "native") as one:
        alone = one.run(*args, **scales)
    for threads, task_kb in ((3, 8), (16, 1024)):
        with CpuExpertRunner(threads, "native", task_kb=task_kb) as runner:
            assert torch.equal(runner.run(*args, **scales), alone), (threads, task_kb)
    exact, bound = exact_and_bound(*dequantized, worst_case=False)
    assert_within_bound(alone, exact, bound, "gpt-oss shape", 5e-2)


def test_mxfp4_calls_without_their_scales_are_refused_with_what_to_pass() -> None:
    args, scales, _ = mxfp4_inputs("decode-1")
    with CpuExpertRunner(1, "native") as runner:
        with pytest.raises(ValueError, match=r"w2_scale: their E8M0 scales, \[3, 32, 1\] uint8"):
            runner.run(*args, w13_scale=scales["w13_scale"])
        with pytest.raises(ValueError, match="E8M0 scales"):
            runner.run(*args, w13_scale=scales["w13_scale"], w2_scale=scales["w2_scale"].float())
        x, w13, w2, *pairs = args
        with pytest.raises(ValueError, match=r"blocks \[E, N, K/32, 16\]"):
            runner.run(x, w13, w2[..., :8].contiguous(), *pairs, **scales)


def test_the_decode_planner_takes_an_mxfp4_banks_scales_and_biases() -> None:
    """The native planner plans over MXFP4 banks with their scales and gpt-oss's biases
    (tests/engine/test_planner.py runs it); without the scales, or with one bias of the two, it
    says what it needs."""
    w13, w13_scale = mxfp4.quantize(torch.randn(4, 64, 32))
    w2, w2_scale = mxfp4.quantize(torch.randn(4, 32, 32))
    bias13, bias2 = torch.randn(4, 64), torch.randn(4, 32)
    arrays = {
        "slot_of": np.full((1, 4), -1, dtype=np.int32),
        "key_of_slot": np.full(2, -1, dtype=np.int64),
        "last_use": np.zeros(2, dtype=np.int64),
        "state": np.zeros(4, dtype=np.int64),
        "picks": np.zeros((1, 4), dtype=np.int64),
        "w13": [w13],
        "w2": [w2],
        "top_k": 2,
    }
    scales = {"w13_scale": [w13_scale], "w2_scale": [w2_scale]}
    with CpuExpertRunner(2, "native") as runner:
        with pytest.raises(ValueError, match=r"MXFP4 weights need w13_scale: their E8M0 scales"):
            runner.decode_planner(**arrays)
        with pytest.raises(ValueError, match="w13_bias and w2_bias come together"):
            runner.decode_planner(**arrays, **scales, w13_bias=[bias13])
        with pytest.raises(ValueError, match=r"w13_bias must be \[4, 64\] and w2_bias \[4, 32\]"):
            runner.decode_planner(**arrays, **scales, w13_bias=[bias13], w2_bias=[bias13])
        planner = runner.decode_planner(
            **arrays, **scales, w13_bias=[bias13], w2_bias=[bias2], swiglu_limit=7.0
        )
    assert planner is not None


def test_the_bench_counts_mxfp4_bytes_as_stored() -> None:
    """The benchmark's MXFP4 bank: an expert's bytes are its blocks and scales, 4.25 bits a
    weight, against which its GB/s and its share of the host read rate are counted."""
    bank = cpu_experts_bench.Bank(
        torch.zeros(6, 256, 256, dtype=torch.bfloat16), torch.zeros(6, 256, 128), "mxfp4"
    )
    assert bank.w13.shape == (6, 256, 8, 16) and bank.factors["w2_scale"].shape == (6, 256, 4)
    weights = 256 * 256 + 256 * 128
    assert bank.expert_bytes == weights // 2 + weights // 32
