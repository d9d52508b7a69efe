"""The CPU expert kernel with NVFP4 weights (ModelOpt's layout: kernels/nvfp4_moe.py) against the
reference on the weights nvfp4.dequantize gives.

A widened e2m1 value times its block's e4m3 scale is exact in fp32, and the per-tensor scale
multiplies each row's sum once, so every output must lie within the fp32 error bound of the
exact (fp64) product with the dequantized weights. Inputs are fresh random numbers on every run;
the seed is in every failure message.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from moelab.kernels import cpu_experts_bench, nvfp4, nvfp4_moe
from moelab.kernels.cpu_experts import CpuExpertRunner, cpu_experts_ref, load_native

from .kernel_inputs import nvfp4_bank
from .test_cpu_experts import SEED, assert_within_bound, exact_and_bound

SIMD = ["avx512", "avx2", "scalar"]

# (experts, H, I, tokens, pairs): rows of one block (16 values), of an odd number of blocks (the
# last one alone) and of several pairs of blocks; experts that serve 4 or 5 tokens (tiles of 4
# and 1) and several experts a token.
SERVED = {0: (0, 1, 5, 4, 3), 1: (1, 2, 3, 5), 2: (0, 4, 1, 5), 3: (2, 3, 3, 5, 1)}
CASES = {
    "decode-1": (3, 16, 16, 1, [(1, 0)]),
    "decode-top4": (6, 176, 80, 1, [(5, 0), (0, 0), (3, 0), (1, 0)]),
    # rows of whole 64-value steps: AVX2 reads one token's rows against x and h in their slots
    "decode-steps": (6, 256, 64, 1, [(2, 0), (4, 0), (0, 0), (5, 0)]),
    "batch-top3": (5, 96, 48, 4, [(e, t) for t in range(4) for e in ((t + 1) % 5, (2 * t) % 5, 4)]),
    "batch-shared": (4, 208, 112, 6, [(e, t) for e, ts in SERVED.items() for t in ts]),
}


@pytest.fixture(scope="session")
def simd_levels() -> list[str]:
    """The code paths the native build has on this CPU (building it if needed, once)."""
    return list(load_native().simd_levels())


def nvfp4_inputs(case: str, salt: str = ""):
    """(args, scales, dequantized args): random x, and weights quantized to NVFP4 (gate, up and
    down apart, as ModelOpt does) whose rows and experts span a few binades, so that a scale taken
    from the wrong block, row or tensor shows."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(f"{case} {salt}".encode()))
    num_experts, hidden, inter, num_tokens, pairs = CASES[case]

    def weights(*shape: int) -> tuple[torch.Tensor, ...]:
        w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
        rows = torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float())
        tensors = torch.exp2(torch.randint(-4, 5, (shape[0], 1, 1), generator=gen).float())
        return nvfp4.quantize(w * rows * tensors)

    gate, up = weights(num_experts, inter, hidden), weights(num_experts, inter, hidden)
    bank = nvfp4_bank(gate, up, weights(num_experts, hidden, inter))
    x = torch.randn(num_tokens, hidden, generator=gen)
    pair_args = (
        torch.tensor([e for e, _ in pairs], dtype=torch.int32),
        torch.tensor([t for _, t in pairs], dtype=torch.int32),
        torch.rand(len(pairs), generator=gen) + 0.1,
    )
    names = ("w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2")
    scales = dict(zip(names, bank[2:], strict=True))
    return (x, *bank[:2], *pair_args), scales, (x, *nvfp4_moe.dequantized_bank(*bank), *pair_args)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("simd", SIMD)
def test_nvfp4_matches_exact_within_fp32_bound(
    simd: str, case: str, simd_levels: list[str]
) -> None:
    if simd not in simd_levels:
        pytest.skip(f"this CPU has no {simd}")
    args, scales, dequantized = nvfp4_inputs(case, simd)
    num_tokens, hidden = args[0].shape
    poisoned = torch.full((num_tokens, hidden), float("nan"))
    with CpuExpertRunner(3, "native", simd, task_kb=1) as runner:
        job = runner.submit(*args, **scales)
        out = job.wait()
        into = runner.run(*args, out=poisoned, **scales)
    assert job.seconds() is not None  # a native job's times: the native kernel ran it
    assert_within_bound(out, *exact_and_bound(*dequantized), f"{case} {simd}")
    assert torch.equal(into, out), f"{case} {simd} (seed {SEED}): a NaN-filled out changed it"


@pytest.mark.parametrize("simd", SIMD)
def test_the_nan_scale_reaches_the_output(simd: str, simd_levels: list[str]) -> None:
    """A block with e4m3's NaN scale makes the down projection's row NaN for exactly the tokens
    its expert serves, and a gate row's the whole output of those tokens, as the reference."""
    if simd not in simd_levels:
        pytest.skip(f"this CPU has no {simd}")
    args, scales, _ = nvfp4_inputs("batch-top3", simd)
    pair_expert, pair_token = args[3], args[4]
    expert = int(pair_expert[0])
    served = pair_token[pair_expert == expert].unique()
    with CpuExpertRunner(2, "native", simd) as runner:
        w2_scale = scales["w2_scale"].clone()
        w2_scale.view(torch.uint8)[expert, 7, 1] = nvfp4.SCALE_NAN
        out = runner.run(*args, **{**scales, "w2_scale": w2_scale})
        want_nan = torch.zeros_like(out, dtype=torch.bool)
        want_nan[served, 7] = True
        assert torch.equal(out.isnan(), want_nan)
        w13_scale = scales["w13_scale"].clone()
        w13_scale.view(torch.uint8)[expert, 3, 0] = nvfp4.SCALE_NAN
        out = runner.run(*args, **{**scales, "w13_scale": w13_scale})
        want_nan = torch.zeros_like(out, dtype=torch.bool)
        want_nan[served] = True
        assert torch.equal(out.isnan(), want_nan)


def test_the_torch_kernel_widens_as_the_reference_does() -> None:
    """cpu_experts_ref on NVFP4 (the torch kernel's work, here with its done flag) within the fp32
    bound of the exact product with the dequantized weights."""
    args, scales, dequantized = nvfp4_inputs("batch-shared")
    bound = exact_and_bound(*dequantized)
    assert_within_bound(cpu_experts_ref(*args, **scales), *bound, "reference")
    flag = torch.zeros(1, dtype=torch.int64)
    out = torch.empty_like(bound[0], dtype=torch.float32)
    with CpuExpertRunner(1, "torch") as runner:
        runner.submit(*args, out=out, done_flag=flag, done_value=5, **scales).wait()
    assert flag.item() == 5
    assert_within_bound(out, *bound, "torch kernel")


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("w2_scale_2", "NVFP4 weights need both w13_scale_2 and w2_scale_2"),
        ("w13_scale", "NVFP4 weights need w13_scale and w2_scale"),
    ],
)
@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_an_nvfp4_call_without_its_scales_is_refused(kernel, drop, message):
    args, scales, _ = nvfp4_inputs("decode-1")
    del scales[drop]
    with CpuExpertRunner(1, kernel) as runner, pytest.raises(ValueError, match=message):
        runner.submit(*args, **scales)


def test_the_decode_planner_takes_an_nvfp4_banks_scales_and_per_tensor_scales() -> None:
    """The native planner plans over NVFP4 banks with their e4m3 scales and per-tensor scales
    (tests/engine/test_planner.py runs it); without either, it says what it needs."""
    w13, w13_scale, w13_scale_2 = nvfp4.quantize(torch.randn(4, 2, 32, 32))
    w2, w2_scale, w2_scale_2 = nvfp4.quantize(torch.randn(4, 32, 32))
    scales = {
        "w13_scale": [w13_scale.flatten(1, 2)],
        "w2_scale": [w2_scale],
        "w13_scale_2": [w13_scale_2],
        "w2_scale_2": [w2_scale_2[:, None]],
    }
    arrays = {
        "slot_of": np.full((1, 4), -1, dtype=np.int32),
        "key_of_slot": np.full(2, -1, dtype=np.int64),
        "last_use": np.zeros(2, dtype=np.int64),
        "state": np.zeros(4, dtype=np.int64),
        "picks": np.zeros((1, 4), dtype=np.int64),
        "w13": [w13.flatten(1, 2)],
        "w2": [w2],
        "top_k": 2,
    }
    missing = {
        "w2_scale_2": "NVFP4 weights need both w13_scale_2 and w2_scale_2",
        "w13_scale": "NVFP4 weights need w13_scale and w2_scale",
    }
    with CpuExpertRunner(2, "native") as runner:
        for drop, message in missing.items():
            given = {name: t for name, t in scales.items() if name != drop}
            with pytest.raises(ValueError, match=message):
                runner.decode_planner(**arrays, **given)
        assert runner.decode_planner(**arrays, **scales) is not None


def test_the_bench_counts_nvfp4_bytes_as_stored_and_times_native_jobs() -> None:
    """The benchmark's NVFP4 bank: gate, up and down quantized apart, an expert's bytes its
    values, its e4m3 scales and its three per-tensor scales (4.5 bits a weight and 12 bytes),
    against which the native jobs' GB/s are counted."""
    w13 = torch.randn(6, 256, 256).to(torch.bfloat16)
    w2 = torch.randn(6, 256, 128).to(torch.bfloat16)
    bank = cpu_experts_bench.Bank(w13, w2, "nvfp4")
    assert bank.w13.shape == (6, 256, 128) and bank.factors["w2_scale"].shape == (6, 256, 8)
    assert bank.factors["w13_scale_2"].shape == (6, 2)
    weights = 256 * 256 + 256 * 128
    assert bank.expert_bytes == weights // 2 + weights // 16 + 12
    gate = nvfp4.dequantize(
        bank.w13[:, :128], bank.factors["w13_scale"][:, :128], bank.factors["w13_scale_2"][:, 0]
    )
    assert (gate - w13[:, :128].float()).abs().max() < 0.5 * w13.float().abs().max()
    with CpuExpertRunner(1, "native") as runner:
        profile = runner.jobs_profile(bank.w13, bank.w2, 2, 10, **bank.factors)
    assert profile["gbps"] > 0 and profile["run_us"] > 0
