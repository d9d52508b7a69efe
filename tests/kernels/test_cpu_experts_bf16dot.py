"""The CPU expert kernel's bf16 dot products (kernels/csrc/bf16dot.h): FP8, MXFP4 and NVFP4 rows
of a job whose x are all bf16 values, one token an expert, widened to bf16 and multiplied with
vdpbf16ps, h rounded to bf16 before the down projection.

The widening must give every e4m3 byte and every e2m1 code its value as the format defines it.
A job takes the products only where x is all bf16; its output must lie within the fp32 bound of
the exact product with the dequantized weights and h rounded to bf16 (the tolerance is stated in
`rounded_h_exact_and_bound`); a job whose x is not all bf16 keeps the fp32 path and its fp32
bound. Inputs are fresh random numbers on every run; the seed is in every failure message.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from moelab.kernels import fp8, mxfp4, nvfp4, nvfp4_moe
from moelab.kernels.cpu_experts import CpuExpertRunner, load_native

from .kernel_inputs import nvfp4_bank
from .test_cpu_experts import SEED, UNIT_ROUNDOFF, assert_within_bound, exact_and_bound, gamma


@pytest.fixture(scope="module", autouse=True)
def bf16_dot_built() -> None:
    if not load_native().bf16_dot_built():
        pytest.skip("this CPU (or compiler) has no AVX-512 BF16 and VBMI: no bf16 dot products")


def e4m3_value(byte: int) -> float:
    """An e4m3fn byte's value from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
    exponent 0 subnormal, 0x7F and 0xFF NaN."""
    sign, exponent, mantissa = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if exponent == 0xF and mantissa == 7:
        return math.nan
    if exponent == 0:
        magnitude = mantissa / 8 * 2.0**-6
    else:
        magnitude = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -magnitude if sign else magnitude


def e2m1_value(code: int) -> float:
    """An e2m1 code's value from its bits: 1 sign, 2 exponent (bias 1), 1 mantissa bit."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


def test_the_widening_gives_every_e4m3_byte_its_value_as_a_bf16() -> None:
    """Every byte, at every place of a 64-byte step (four permutations of the 256 bytes):
    subnormals exactly (m * 2^-9, bf16 normals), the signed zeros, and NaN for 0x7F and 0xFF."""
    gen = torch.Generator().manual_seed(SEED)
    every_byte = torch.cat([torch.randperm(256, generator=gen) for _ in range(4)]).to(torch.uint8)
    out = torch.zeros(every_byte.numel(), dtype=torch.int16)
    assert load_native().widen_bf16(every_byte.data_ptr(), out.data_ptr(), every_byte.numel(), 0)
    got = out.view(torch.bfloat16).double()
    want = torch.tensor([e4m3_value(b) for b in every_byte.tolist()], dtype=torch.float64)
    wrong = ~((got == want) | (got.isnan() & want.isnan()))
    wrong |= got.signbit() != torch.tensor([b >> 7 == 1 for b in every_byte.tolist()])
    bad = every_byte[wrong].tolist()
    assert not wrong.any(), f"(seed {SEED}) bytes {[hex(b) for b in bad]} widen wrong"


@pytest.mark.parametrize("form", [3, 1, 2], ids=["128-values", "64-values", "last-32-values"])
def test_the_widening_gives_every_e2m1_code_twice_its_value_as_a_bf16(form: int) -> None:
    """Both nibbles of every byte, at every place of a step (a row's whole 128 values, the
    64-value step of its last ones and its last 32 values), to twice the value e2m1 defines, in
    value order (the low nibble's first)."""
    gen = torch.Generator().manual_seed(SEED)
    every_byte = torch.cat([torch.randperm(256, generator=gen) for _ in range(4)]).to(torch.uint8)
    out = torch.zeros(2 * every_byte.numel(), dtype=torch.int16)
    assert load_native().widen_bf16(every_byte.data_ptr(), out.data_ptr(), every_byte.numel(), form)
    codes = torch.stack([every_byte & 0xF, every_byte >> 4], dim=1).flatten().tolist()
    want = torch.tensor([2 * e2m1_value(c) for c in codes], dtype=torch.float64)
    wrong = out.view(torch.bfloat16).double() != want
    assert not wrong.any(), f"(seed {SEED}) values {wrong.nonzero().flatten().tolist()} wrong"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_every_scale_byte_gives_half_its_scale_sixteen_blocks_at_a_time(fmt: str) -> None:
    """Every scale byte, at every lane of the 16-block vector and in a last group of fewer: half
    the scale its format defines (E8M0: 2^(e - 127), subnormal for 0 and 1, 0xFF NaN; e4m3:
    its value), exactly."""
    gen = torch.Generator().manual_seed(SEED)
    every_byte = torch.cat([torch.randperm(256, generator=gen) for _ in range(2)] +
                           [torch.randperm(256, generator=gen)[:7]]).to(torch.uint8)  # fmt: skip
    out = torch.zeros(every_byte.numel(), dtype=torch.float32)
    nv = fmt == "nvfp4"
    assert load_native().block_halves_bf16(every_byte.data_ptr(), out.data_ptr(), out.numel(), nv)
    if nv:
        want = [e4m3_value(b) / 2 for b in every_byte.tolist()]
    else:
        want = [math.nan if b == 0xFF else 2.0 ** (b - 128) for b in every_byte.tolist()]
    want = torch.tensor(want, dtype=torch.float64)
    wrong = ~((out.double() == want) | (out.isnan() & want.isnan()))
    bad = every_byte[wrong].tolist()
    assert not wrong.any(), f"(seed {SEED}) {fmt} bytes {[hex(b) for b in bad]} wrong"


def rounded_h_exact_and_bound(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_token: torch.Tensor,
    pair_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact output (fp64) with each h rounded to bf16, and the bound on a bf16-dot job's
    error (weights as fp32, the dequantized ones).

    The gate/up products are exact (bf16 times bf16), their sums in fp32: h lies within h_err
    (exact_and_bound's fp32 bound) of the exact h. Where no bf16 rounding boundary lies within
    h_err of the exact h, the job's h rounds to the same bf16 as the exact one; where one does, it
    may round to the other neighbour, one bf16 ulp away. So the bound is the fp32 bound of the
    down projection of the rounded h (gamma(I + 2): the sums and the block factor's product),
    plus |w2| times one ulp of each h that may round the other way, plus the pairs' sum."""
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    exact = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    bound = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for e, t, w in zip(
        pair_expert.tolist(), pair_token.tolist(), pair_weight.tolist(), strict=True
    ):
        gate_up, down, xt = w13[e].double(), w2[e].double(), x[t].double()
        gu = gate_up @ xt
        gu_err = gamma(hidden) * (gate_up.abs() @ xt.abs())
        g, u, g_err, u_err = gu[:inter], gu[inter:], gu_err[:inter], gu_err[inter:]
        s, s_err = F.silu(g), 1.1 * g_err
        h = s * u
        h_err = s_err * (u.abs() + u_err) + s.abs() * u_err
        h_err += 8 * UNIT_ROUNDOFF * (s.abs() + s_err) * (u.abs() + u_err)
        rounded = h.float().bfloat16().double()
        ulp = torch.exp2(torch.floor(torch.log2(rounded.abs().clamp_min(2.0**-126))) - 7)
        may_flip = (h - rounded).abs() + h_err >= ulp / 2
        y = down @ rounded
        y_err = gamma(inter + 2) * (down.abs() @ (rounded.abs() + ulp * may_flip))
        y_err += down.abs() @ (ulp * may_flip)
        exact[t] += w * y
        bound[t] += abs(w) * y_err + gamma(len(pair_expert) + 1) * abs(w) * (y.abs() + y_err)
    return exact, bound


def bf16_values(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def fp8_call(gen: torch.Generator, num_experts: int, hidden: int, inter: int):
    """FP8 weights whose 128 x 128 blocks' factors span a few binades: (weights, keywords,
    dequantized weights)."""

    def weights(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
        cols = torch.exp2(torch.randint(-3, 4, (shape[-1],), generator=gen).float())
        return fp8.quantize(w * cols / 8)

    w13, s13 = weights(num_experts, 2 * inter, hidden)
    w2, s2 = weights(num_experts, hidden, inter)
    keywords = {"w13_scale": s13, "w2_scale": s2}
    return (w13, w2), keywords, (fp8.dequantize(w13, s13), fp8.dequantize(w2, s2))


def mxfp4_call(gen: torch.Generator, num_experts: int, hidden: int, inter: int):
    def weights(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
        cols = torch.exp2(torch.randint(-3, 4, (shape[-1],), generator=gen).float())
        return mxfp4.quantize(w * cols)

    w13, s13 = weights(num_experts, 2 * inter, hidden)
    w2, s2 = weights(num_experts, hidden, inter)
    keywords = {"w13_scale": s13, "w2_scale": s2}
    return (w13, w2), keywords, (mxfp4.dequantize(w13, s13), mxfp4.dequantize(w2, s2))


def nvfp4_call(gen: torch.Generator, num_experts: int, hidden: int, inter: int):
    def weights(*shape: int) -> tuple[torch.Tensor, ...]:
        w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
        rows = torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float())
        return nvfp4.quantize(w * rows)

    gate, up = weights(num_experts, inter, hidden), weights(num_experts, inter, hidden)
    bank = nvfp4_bank(gate, up, weights(num_experts, hidden, inter))
    names = ("w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2")
    keywords = dict(zip(names, bank[2:], strict=True))
    return bank[:2], keywords, nvfp4_moe.dequantized_bank(*bank)


# (bank, experts, H, I, tokens, pairs): one token an expert. FP8: rows of whole 128-column
# blocks, several blocks a row, and rows ending in a block of 64 (H = 320, I = 192); MXFP4 and
# NVFP4: rows of whole 128 values (their blocks' scales made 16 at a time: MXFP4's H = 864 holds
# six 128s, a group of 16 blocks and 8 more, NVFP4's H = 416 three, a group and 8 more), and
# rows whose last values come in 64-value steps and a last 32 (I = 96: a step and a half; H =
# 864: a step and a half after the 128s); several experts a token and tokens of their own.
CASES = {
    "fp8-decode-top4": (fp8_call, 6, 384, 256, 1, [(5, 0), (0, 0), (3, 0), (1, 0)]),
    "fp8-batch": (fp8_call, 4, 320, 192, 3, [(2, 0), (0, 1), (3, 1), (1, 2)]),
    "mxfp4-decode-top4": (mxfp4_call, 5, 192, 96, 1, [(4, 0), (0, 0), (2, 0), (1, 0)]),
    "mxfp4-batch": (mxfp4_call, 3, 256, 96, 3, [(0, 0), (1, 1), (2, 2)]),
    "nvfp4-decode-top4": (nvfp4_call, 5, 160, 96, 1, [(4, 0), (0, 0), (2, 0), (1, 0)]),
    "nvfp4-batch": (nvfp4_call, 3, 128, 64, 3, [(0, 0), (2, 1), (1, 2)]),
    "mxfp4-long-rows": (mxfp4_call, 3, 864, 224, 1, [(2, 0), (0, 0)]),
    "nvfp4-long-rows": (nvfp4_call, 3, 416, 160, 1, [(1, 0), (2, 0)]),
}


def case_call(case: str, salt: str = ""):
    """(args, keywords, dequantized args) of a case, x all bf16 values."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(f"{case} {salt}".encode()))
    make, num_experts, hidden, inter, num_tokens, pairs = CASES[case]
    weights, keywords, dequantized = make(gen, num_experts, hidden, inter)
    x = bf16_values(torch.randn(num_tokens, hidden, generator=gen))
    pair_args = (
        torch.tensor([e for e, _ in pairs], dtype=torch.int32),
        torch.tensor([t for _, t in pairs], dtype=torch.int32),
        torch.rand(len(pairs), generator=gen) + 0.1,
    )
    return (x, *weights, *pair_args), keywords, (x, *dequantized, *pair_args)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_x_takes_the_bf16_dot_within_the_bound_of_rounded_h(case: str) -> None:
    args, keywords, dequantized = case_call(case)
    with CpuExpertRunner(2, "native") as runner:
        assert runner.bf16_dot
        job = runner.submit(*args, **keywords)
        out = job.wait()
        assert job.bf16_dot(), f"{case}: a job of bf16 x took the fp32 path"
    assert_within_bound(out, *rounded_h_exact_and_bound(*dequantized), f"{case} bf16 dot")


def test_mxfp4_scales_outside_the_normal_floats_reach_the_bf16_dot_exactly() -> None:
    """E8M0 bytes 0 and 1 (2^-127 and 2^-126 halved: subnormal half-scales) beside normal ones in
    blocks of whole 128 values, in both groups of a row, widen as the table gives them: the
    output stays within the bound; the NaN byte makes the row it scales NaN for the token its
    expert serves, and nothing else."""
    args, keywords, dequantized = case_call("mxfp4-long-rows", "scales")
    expert, token = int(args[3][0]), int(args[4][0])
    w13_scale = keywords["w13_scale"].clone()
    w13_scale[expert, 5, [0, 3]] = torch.tensor([0, 1], dtype=torch.uint8)
    w13_scale[expert, 5, 17] += 1  # twice its scale
    w13_scale[expert, 9, 2] = 1
    w13 = mxfp4.dequantize(args[1], w13_scale)
    with CpuExpertRunner(2, "native") as runner:
        job = runner.submit(*args, w13_scale=w13_scale, w2_scale=keywords["w2_scale"])
        out = job.wait()
        assert job.bf16_dot()
        bound = rounded_h_exact_and_bound(dequantized[0], w13, *dequantized[2:])
        # (the rounded h's bound at these rows' lengths reaches 1% of the largest output at times)
        assert_within_bound(out, *bound, "MXFP4 scales 0 and 1, bf16 dot", max_bound_share=2e-2)
        w2_scale = keywords["w2_scale"].clone()
        w2_scale[expert, 11, 1] = 0xFF
        out = runner.submit(*args, w13_scale=keywords["w13_scale"], w2_scale=w2_scale).wait()
    want_nan = torch.zeros_like(out, dtype=torch.bool)
    want_nan[token, 11] = True
    assert torch.equal(out.isnan(), want_nan), f"(seed {SEED})"


@pytest.mark.parametrize("case", ["fp8-decode-top4", "mxfp4-batch", "nvfp4-decode-top4"])
def test_x_that_is_not_all_bf16_keeps_the_exact_fp32_path(case: str) -> None:
    """One x value with bits below bf16's: the job's output lies within the fp32 bound of the
    exact product (h not rounded), which rounding h to bf16 would break by far."""
    args, keywords, dequantized = case_call(case, "fp32")
    x = args[0].clone()
    x[-1, -1] += x[-1, -1].abs() * 2.0**-12
    args, dequantized = (x, *args[1:]), (x, *dequantized[1:])
    with CpuExpertRunner(2, "native") as runner:
        job = runner.submit(*args, **keywords)
        out = job.wait()
        assert not job.bf16_dot(), f"{case}: a job of fp32 x took the bf16 dot products"
    assert_within_bound(out, *exact_and_bound(*dequantized), f"{case} fp32 x")


def test_fp8_rows_of_a_ragged_block_keep_the_fp32_path_with_bf16_x() -> None:
    """FP8 rows whose last block is not a multiple of 64 columns (H = 300, I = 200) take the fp32
    path even for x of bf16 values, within its fp32 bound (h not rounded)."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(b"ragged"))
    weights, keywords, dequantized = fp8_call(gen, 3, 300, 200)
    x = bf16_values(torch.randn(1, 300, generator=gen))
    pair_args = (torch.tensor([2, 0], dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    pair_args += (torch.rand(2, generator=gen) + 0.1,)
    with CpuExpertRunner(2, "native") as runner:
        job = runner.submit(x, *weights, *pair_args, **keywords)
        out = job.wait()
        assert not job.bf16_dot(), "rows of a ragged block took the bf16 dot products"
    assert_within_bound(out, *exact_and_bound(x, *dequantized, *pair_args), "ragged fp8")


def test_a_nan_byte_gives_nan_rows_in_the_bf16_dot() -> None:
    """A NaN byte widens to a bf16 NaN: in a down projection's row r (at a 64-byte step's edges,
    in the second 128-column block) out[t, r] is NaN for exactly the tokens its expert serves;
    in a gate or up row, those tokens' whole rows."""
    args, keywords, _ = case_call("fp8-batch", "nan")
    x, w13, w2, pair_expert, pair_token, pair_weight = args
    _, hidden, inter = w2.shape
    expert = int(pair_expert[0])
    served = pair_token[pair_expert == expert].unique()
    with CpuExpertRunner(2, "native") as runner:
        for column in (0, 63, 64, inter - 1):
            for nan_byte in (0x7F, 0xFF):
                bad = w2.clone()
                bad.view(torch.uint8)[expert, 7, column] = nan_byte
                job = runner.submit(x, w13, bad, pair_expert, pair_token, pair_weight, **keywords)
                out = job.wait()
                assert job.bf16_dot()
                want_nan = torch.zeros_like(out, dtype=torch.bool)
                want_nan[served, 7] = True
                assert torch.equal(out.isnan(), want_nan), (column, hex(nan_byte))
        for row in (3, inter + 5):
            bad = w13.clone()
            bad.view(torch.uint8)[expert, row, hidden - 1] = 0xFF
            out = runner.run(x, bad, w2, pair_expert, pair_token, pair_weight, **keywords)
            want_nan = torch.zeros_like(out, dtype=torch.bool)
            want_nan[served] = True
            assert torch.equal(out.isnan(), want_nan), row


def test_the_bench_feeds_bf16_x_and_says_which_dot_products_ran() -> None:
    """The bench's native jobs get bf16 x by default, as the engine's bf16 models give it, and
    take the bf16 dot products; with bf16_x=False the fp32 path."""
    gen = torch.Generator().manual_seed(SEED)
    (w13, w2), keywords, _ = fp8_call(gen, 2, 256, 128)
    with CpuExpertRunner(1, "native") as runner:
        assert runner.jobs_profile(w13, w2, 1, 3, **keywords)["bf16_dot"]
        assert not runner.jobs_profile(w13, w2, 1, 3, bf16_x=False, **keywords)["bf16_dot"]
