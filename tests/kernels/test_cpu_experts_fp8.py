"""The CPU expert kernel with FP8 weights against the dequantizing reference (kernels/fp8.py).

Every output must lie within the fp32 error bound of the exact (fp64) product with the weights
`fp8.dequantize` gives. Where an expert serves several tokens the kernel widens each weight to
exactly that dequantized fp32 value (its value times its block's factor, rounded once) and goes on
as with fp32 weights: the output must equal the dequantized weights' bit for bit. Inputs are fresh
random numbers on every run; the seed is in every failure message.
"""

from __future__ import annotations

import json
import math
import re
import weakref
import zlib

import numpy as np
import pytest
import torch

from moelab.kernels import cpu_experts_bench, fp8
from moelab.kernels.cpu_experts import CpuExpertRunner, cpu_experts_ref, load_native

from .test_cpu_experts import CASES, SEED, assert_within_bound, exact_and_bound

SIMD = ["avx512", "avx2", "scalar"]
FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}
_SIMD_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}


@pytest.fixture(scope="session")
def simd_levels() -> list[str]:
    """The code paths the native build has on this CPU (building it if needed, once)."""
    return list(load_native().simd_levels())


def skip_unless_built(simd: str, simd_levels: list[str]) -> None:
    if simd not in simd_levels:
        pytest.skip(f"this CPU has no {simd}")


# Beyond the bf16 cases (whose H and I fit in one 128 x 128 block): several blocks a row and a
# column, ragged at both ends (H = 300 is 2 blocks and 44 columns, 2I = 400 is 3 blocks and 16
# rows, I = 200 one block and 72), several experts a token (top-k 4), tokens sharing experts, and
# (ragged-batch-shared) every expert serving several tokens, one pair twice.
FP8_CASES = {
    **CASES,
    "ragged-decode-top4": (6, 300, 200, 1, [(5, 0), (0, 0), (3, 0), (1, 0)]),
    "ragged-batch-top3": (
        5,
        300,
        200,
        4,
        [(e, t) for t in range(4) for e in ((t + 1) % 5, (2 * t) % 5, 4) if e != t],
    ),
    "ragged-batch-shared": (
        4,
        300,
        200,
        5,
        [(0, 0), (0, 1), (1, 1), (1, 2), (1, 3), (2, 0), (2, 4), (3, 2), (3, 3), (3, 3), (2, 1)],
    ),
}
# the cases whose every expert serves several tokens (the kernel's tiles of tokens)
SHARED_CASES = ["batch-shared", "ragged-batch-shared"]


def fp8_inputs(
    gen: torch.Generator,
    num_experts: int,
    hidden: int,
    inter: int,
    num_tokens: int,
    pairs: list[tuple[int, int]],
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """(args, factors, dequantized args): random x, and weights quantized in 128 x 128 blocks
    whose factors span a few binades (rows and columns of unequal scale), so that a factor taken
    from the wrong block shows; the FP8 call's args and factors, and the same call with the
    dequantized fp32 weights."""

    def weights(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
        rows = torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float())
        cols = torch.exp2(torch.randint(-3, 4, (shape[-1],), generator=gen).float())
        q, scale = fp8.quantize(w * rows * cols / 8)
        return q.view(dtype), scale

    x = torch.randn(num_tokens, hidden, generator=gen)
    w13, w13_scale = weights(num_experts, 2 * inter, hidden)
    w2, w2_scale = weights(num_experts, hidden, inter)
    pair_expert = torch.tensor([e for e, _ in pairs], dtype=torch.int32)
    pair_token = torch.tensor([t for _, t in pairs], dtype=torch.int32)
    pair_weight = torch.rand(len(pairs), generator=gen) + 0.1
    pairs_args = (pair_expert, pair_token, pair_weight)
    factors = {"w13_scale": w13_scale, "w2_scale": w2_scale}
    dequantized = (x, fp8.dequantize(w13, w13_scale), fp8.dequantize(w2, w2_scale), *pairs_args)
    return (x, w13, w2, *pairs_args), factors, dequantized


def case_inputs(case: str, salt: str = "", dtype: torch.dtype = torch.float8_e4m3fn):
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(f"{case} {salt}".encode()))
    return fp8_inputs(gen, *FP8_CASES[case], dtype)


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("factor", [1.0, 0.37, 448.0, 2.0**-130])
def test_the_widening_is_exact_for_every_finite_byte(
    simd: str, factor: float, simd_levels: list[str]
) -> None:
    """Each SIMD level's loads give every byte but the two NaNs (which the dot products look for
    apart, below) as kernels/fp8 decodes it times the factor, rounded once: subnormal bytes, and
    a subnormal factor, included."""
    skip_unless_built(simd, simd_levels)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2)
    out = torch.full((512,), float("nan"))
    load_native().widen_e4m3(_SIMD_CODES[simd], every_byte.data_ptr(), out.data_ptr(), 512, factor)
    want = fp8.widen(every_byte) * torch.tensor(factor)
    finite = ~want.isnan()
    assert finite.sum() == 508
    wrong = (out != want) & finite
    assert not wrong.any(), f"bytes {every_byte[wrong].unique().tolist()} widen wrongly"
    assert out.isfinite().all()


@pytest.mark.parametrize("dtype", list(FP8_DTYPES))
@pytest.mark.parametrize("case", list(FP8_CASES))
@pytest.mark.parametrize("simd", SIMD)
def test_fp8_matches_exact_within_fp32_bound(
    simd: str, case: str, dtype: str, simd_levels: list[str]
) -> None:
    skip_unless_built(simd, simd_levels)
    args, factors, dequantized = case_inputs(case, f"{simd} {dtype}", FP8_DTYPES[dtype])
    num_tokens, hidden = args[0].shape
    poisoned = torch.full((num_tokens, hidden), float("nan"))
    with CpuExpertRunner(3, "native", simd) as runner:
        out = runner.run(*args, **factors)
        into = runner.run(*args, out=poisoned, **factors)
    what = f"{case} {simd} {dtype}"
    assert_within_bound(out, *exact_and_bound(*dequantized), what)
    assert torch.equal(into, out), f"{what} (seed {SEED}): a NaN-filled out changed the result"


@pytest.mark.parametrize("case", SHARED_CASES)
@pytest.mark.parametrize("simd", SIMD)
def test_tiles_of_tokens_equal_the_dequantized_weights_bit_for_bit(
    simd: str, case: str, simd_levels: list[str]
) -> None:
    """An expert with several tokens converts each weight once for all of them, to exactly its
    dequantized value: the whole computation is then the fp32 weights', bit for bit."""
    skip_unless_built(simd, simd_levels)
    args, factors, dequantized = case_inputs(case, simd)
    with CpuExpertRunner(3, "native", simd) as runner:
        out = runner.run(*args, **factors)
        want = runner.run(*dequantized)
    assert torch.equal(out, want), f"{case} {simd} (seed {SEED}): differs from fp32 weights"


def test_the_reference_dequantizes_and_the_torch_kernel_is_it() -> None:
    args, factors, dequantized = case_inputs("ragged-batch-top3")
    ref = cpu_experts_ref(*args, **factors)
    assert torch.equal(ref, cpu_experts_ref(*dequantized))
    # the torch kernel runs the reference with as many of torch's threads as it is given: as
    # many as here, so that the matrix products split (and round) alike
    with CpuExpertRunner(torch.get_num_threads(), "torch") as runner:
        assert torch.equal(runner.run(*args, **factors), ref)
        flag = torch.zeros(1, dtype=torch.int64)
        out = torch.full_like(ref, float("nan"))
        runner.submit(*args, out=out, done_flag=flag, done_value=7, **factors).wait()
        assert torch.equal(out, ref) and flag.item() == 7
    assert_within_bound(ref, *exact_and_bound(*dequantized), f"reference (seed {SEED})")


def test_qwen3_shape_is_right_and_independent_of_thread_count() -> None:
    """The Qwen3-30B-A3B expert shape (H = 2048, I = 768: 16 and 6 blocks): 8 experts for one
    token, then a batch of 3 sharing some; tasks of every size give the same bits."""
    gen = torch.Generator().manual_seed(SEED)
    decode = [(e, 0) for e in (6, 1, 7, 0, 3, 5, 2, 4)]
    batch = [*decode, (1, 1), (6, 1), (1, 2), (3, 2)]
    for pairs, num_tokens in ((decode, 1), (batch, 3)):
        args, factors, dequantized = fp8_inputs(gen, 8, 2048, 768, num_tokens, pairs)
        with CpuExpertRunner(1, "native") as one, CpuExpertRunner(3, "native") as three:
            alone = one.run(*args, **factors)
            shared = three.run(*args, **factors)
        for threads, task_kb in ((3, 8), (16, 1024)):
            with CpuExpertRunner(threads, "native", task_kb=task_kb) as runner:
                assert torch.equal(runner.run(*args, **factors), shared), (threads, task_kb)
        assert torch.equal(alone, shared), "the result depends on the number of threads"
        exact, bound = exact_and_bound(*dequantized, worst_case=False)
        assert_within_bound(shared, exact, bound, f"qwen3 shape, {len(pairs)} pairs", 5e-2)


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("case", ["ragged-decode-top4", "ragged-batch-top3"])
def test_a_nan_byte_gives_nan_where_its_dequantized_weight_would(
    simd: str, case: str, simd_levels: list[str]
) -> None:
    """The NaN bytes widen to finite numbers in the SIMD loads: each dot product looks for them
    in its row. A NaN in a down projection's row r (at columns inside a 64-byte chunk, at its
    edges and in the ragged tail) makes out[t, r] NaN for exactly the tokens t its expert serves;
    one in a gate or up row, the whole output rows of those tokens."""
    skip_unless_built(simd, simd_levels)
    args, factors, _ = case_inputs(case, simd)
    x, w13, w2, pair_expert, pair_token, pair_weight = args
    _, hidden, inter = w2.shape
    expert = int(pair_expert[0])
    served = pair_token[pair_expert == expert].unique()
    with CpuExpertRunner(2, "native", simd) as runner:
        for column in (0, 63, 64, 130, inter - 1):
            for nan_byte in (0x7F, 0xFF):
                bad = w2.clone()
                bad.view(torch.uint8)[expert, 7, column] = nan_byte
                out = runner.run(x, w13, bad, pair_expert, pair_token, pair_weight, **factors)
                want_nan = torch.zeros_like(out, dtype=torch.bool)
                want_nan[served, 7] = True
                assert torch.equal(out.isnan(), want_nan), (column, hex(nan_byte))
        for row in (3, inter + 5):  # a gate row, an up row
            bad = w13.clone()
            bad.view(torch.uint8)[expert, row, hidden - 1] = 0x7F
            out = runner.run(x, bad, w2, pair_expert, pair_token, pair_weight, **factors)
            want_nan = torch.zeros_like(out, dtype=torch.bool)
            want_nan[served] = True
            assert torch.equal(out.isnan(), want_nan), row


@pytest.mark.parametrize("case", ["ragged-decode-top4", "ragged-batch-top3", "ragged-batch-shared"])
def test_owned_blocks_and_tasks_run_again_give_the_same_output_bit_for_bit(case: str) -> None:
    """The job paths the bf16 kernel has, with FP8 weights: blocks owned by the workers, tasks
    run again by idle workers (redo_us=1, more workers than cores) into NaN-poisoned buffers,
    the done flag written after the output, and an unchecked submit."""
    args, factors, _ = case_inputs(case)
    num_tokens, hidden = args[0].shape
    with CpuExpertRunner(2, "native", task_kb=1) as runner:
        want = runner.run(*args, **factors)
        assert torch.equal(runner.submit(*args, check=False, **factors).wait(), want)
        for rounds in (1, 2, 50):
            poisoned = torch.full((num_tokens, hidden), float("nan"))
            owned = runner.submit(*args, out=poisoned, own_rounds=rounds, **factors).wait()
            assert torch.equal(owned, want), rounds
    with CpuExpertRunner(4, "native", task_kb=1, redo_us=1) as runner:
        for i in range(100):
            poisoned = torch.full((num_tokens, hidden), float("nan"))
            flag = torch.zeros(1, dtype=torch.int64)
            job = runner.submit(*args, out=poisoned, own_rounds=i % 3, redoable=True,
                                done_flag=flag, done_value=i + 1, **factors)  # fmt: skip
            assert job.redoable()
            assert torch.equal(job.wait(), want), (case, i)
            assert flag.item() == i + 1


def test_the_runner_holds_the_factors_of_redoable_jobs_until_it_closes() -> None:
    """A late run of a task reads the factors as it reads the weights: both are held."""
    args, factors, _ = case_inputs("ragged-decode-top4")
    x, w13, w2, *pairs = args
    w13_scale, w2_scale = factors["w13_scale"].clone(), factors["w2_scale"].clone()
    held = [weakref.ref(t) for t in (w13, w2, w13_scale, w2_scale)]
    runner = CpuExpertRunner(2, "native", redo_us=50)
    runner.submit(x, w13, w2, *pairs, w13_scale=w13_scale, w2_scale=w2_scale, redoable=True).wait()
    del w13, w2, w13_scale, w2_scale, args
    assert all(ref() is not None for ref in held)
    runner.close()
    assert all(ref() is None for ref in held)


def test_the_decode_planner_takes_an_fp8_banks_factors() -> None:
    """The native planner plans over FP8 banks with their factors (tests/engine/test_planner.py
    runs it); without them it says what it needs."""
    w13, w13_scale = fp8.quantize(torch.randn(4, 64, 32))
    w2, w2_scale = fp8.quantize(torch.randn(4, 32, 32))
    arrays = {
        "slot_of": np.full((1, 4), -1, dtype=np.int32),
        "key_of_slot": np.full(2, -1, dtype=np.int64),
        "last_use": np.zeros(2, dtype=np.int64),
        "state": np.zeros(4, dtype=np.int64),
        "picks": np.zeros((1, 4), dtype=np.int64),
    }
    with CpuExpertRunner(2, "native") as runner:
        with pytest.raises(ValueError, match=r"FP8 weights \(torch.float8_e4m3fn\) need w13_scale"):
            runner.decode_planner(**arrays, w13=[w13], w2=[w2], top_k=2)
        with pytest.raises(ValueError, match="w2_scale needs one tensor per layer"):
            runner.decode_planner(**arrays, w13=[w13], w2=[w2], top_k=2, w13_scale=[w13_scale],
                                  w2_scale=[])  # fmt: skip
        planner = runner.decode_planner(
            **arrays, w13=[w13], w2=[w2], top_k=2, w13_scale=[w13_scale], w2_scale=[w2_scale]
        )
    assert planner is not None


def fp8_call() -> dict[str, torch.Tensor]:
    """A valid FP8 call: H = 130 (2 blocks), I = 5, 3 experts, 2 tokens."""
    w13, w13_scale = fp8.quantize(torch.randn(3, 10, 130))
    w2, w2_scale = fp8.quantize(torch.randn(3, 130, 5))
    return {
        "x": torch.randn(2, 130),
        "w13": w13,
        "w2": w2,
        "pair_expert": torch.tensor([0, 2], dtype=torch.int32),
        "pair_token": torch.tensor([0, 1], dtype=torch.int32),
        "pair_weight": torch.tensor([0.5, 0.5]),
        "w13_scale": w13_scale,
        "w2_scale": w2_scale,
    }


def bad_factor_calls() -> dict[str, tuple[dict, str]]:
    """Overrides of fp8_call() and the words the error must contain."""
    call = fp8_call()
    w13, w2, w13_scale, w2_scale = (call[k] for k in ("w13", "w2", "w13_scale", "w2_scale"))
    return {
        "no w13_scale": ({"w13_scale": None}, "need w13_scale"),
        "no w2_scale": ({"w2_scale": None}, "need w2_scale: their fp32 factors"),
        "w13_scale per tensor": ({"w13_scale": torch.ones(3)}, "w13_scale must be [3, 1, 2]"),
        "w2_scale transposed": (
            {"w2_scale": w2_scale.transpose(1, 2).contiguous()},
            "w2_scale must be [3, 2, 1] float32",
        ),
        "bf16 factors": ({"w13_scale": w13_scale.bfloat16()}, "w13_scale must be"),
        "factors of bf16 weights": (
            {"w13": w13.float().bfloat16(), "w2": w2.float().bfloat16()},
            "belong to FP8 weights only",
        ),
        "fp8 with bf16": ({"w2": w2.float().bfloat16()}, "share one dtype"),
        "e4m3 with uint8": ({"w2": w2.view(torch.uint8)}, "share one dtype"),
        "factors not contiguous": (
            {"w13_scale": torch.ones(3, 1, 4)[:, :, ::2]},
            "w13_scale must be contiguous",
        ),
        "factors on meta": ({"w2_scale": w2_scale.to("meta")}, "w2_scale must be a CPU tensor"),
    }


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("bad", list(bad_factor_calls()))
def test_bad_factors_get_a_clear_error(kernel: str, bad: str) -> None:
    overrides, words = bad_factor_calls()[bad]
    call = fp8_call()
    with CpuExpertRunner(1, kernel) as runner:
        assert runner.run(**call).isfinite().all()
        with pytest.raises(ValueError, match=re.escape(words)):
            runner.submit(**(call | overrides))
    with pytest.raises(ValueError, match=re.escape(words)):
        cpu_experts_ref(**(call | overrides))


def test_an_unchecked_submit_without_factors_is_refused_by_the_native_kernel() -> None:
    args, factors, _ = case_inputs("decode-1")
    words = re.escape("FP8 (e4m3) weights need their block factors")
    with CpuExpertRunner(1, "native") as runner, pytest.raises(ValueError, match=words):
        runner.submit(*args, check=False, w13_scale=factors["w13_scale"])


def test_native_job_loop_rate_counts_the_fp8_bytes_and_checks_the_factors() -> None:
    args, factors, _ = case_inputs("ragged-decode-top4")
    _, w13, w2, *_ = args
    with CpuExpertRunner(2, "native") as runner:
        profile = runner.jobs_profile(w13, w2, 2, 20, **factors)
        assert 0 < profile["gbps"] < 5000 and 0 < profile["phase1_us"] <= profile["run_us"]
        assert 0 < runner.jobs_gbps(w13, w2, 1, 10, **factors) < 5000
        with pytest.raises(ValueError, match="need w2_scale"):
            runner.jobs_gbps(w13, w2, 1, 1, w13_scale=factors["w13_scale"])


def test_bench_reports_fp8_beside_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    """Each thread count and task size gets a bf16 row, an FP8 row, an MXFP4 row and an NVFP4
    row; FP8's GB/s count its bytes (values and factors), its share is of the same host read
    rate."""
    argv = ["--threads", "2", "--experts", "2,1", "--hidden", "256", "--intermediate", "128"]
    argv += ["--num-experts", "6", "--min-seconds", "0.01", "--read-mib", "16", "--json"]
    assert cpu_experts_bench.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(row["threads"], row["dtype"]) for row in result["results"]] == [
        (2, "bf16"),
        (2, "fp8"),
        (2, "mxfp4"),
        (2, "nvfp4"),
    ]
    for row in result["results"]:
        for rates in row["experts"].values():
            assert rates["native_gbps"] > 0 and rates["torch_gbps"] > 0
            share = rates["native_gbps"] / row["host_read_gbps"]
            assert rates["native_share_of_host"] == pytest.approx(share)
    bank = cpu_experts_bench.Bank(
        torch.zeros(6, 256, 256, dtype=torch.bfloat16), torch.zeros(6, 256, 128), "fp8"
    )
    # an expert's FP8 bytes: 256 x 256 + 256 x 128 values, 2 x 2 + 2 x 1 factors of 4 bytes
    assert bank.expert_bytes == 256 * 256 + 256 * 128 + 4 * 6
    with pytest.raises(SystemExit):
        cpu_experts_bench.main(["--dtype", "bf16,int4"])
    assert "--dtype takes a comma-separated list of bf16, fp8" in capsys.readouterr().err
