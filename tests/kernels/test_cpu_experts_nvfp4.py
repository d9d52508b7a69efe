"""The CPU expert runner with NVFP4 weights (ModelOpt's layout: kernels/nvfp4_moe.py) against
the reference on the weights nvfp4.dequantize gives: the torch kernel runs them whichever kernel
the runner has, widening each expert a job routes to."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import nvfp4_moe
from moelab.kernels.cpu_experts import CpuExpertRunner, cpu_experts_ref

from .test_nvfp4_moe import nvfp4_bank

# (experts, tokens, pairs): experts that serve several tokens, and a token of several experts
PAIRS = [(0, 0), (3, 0), (1, 1), (3, 1), (0, 2), (2, 2), (3, 2)]


def nvfp4_inputs(gen: torch.Generator):
    """(args, scales, the args with the dequantized weights) over a bank of 4 experts."""
    bank = [t.cpu() for t in nvfp4_bank(gen, 4)]
    w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2 = bank
    x = torch.randn(3, w2.shape[1], generator=gen)
    pairs = (
        torch.tensor([e for e, _ in PAIRS], dtype=torch.int32),
        torch.tensor([t for _, t in PAIRS], dtype=torch.int32),
        torch.rand(len(PAIRS), generator=gen) + 0.1,
    )
    scales = {
        "w13_scale": w13_scale,
        "w2_scale": w2_scale,
        "w13_scale_2": w13_scale_2,
        "w2_scale_2": w2_scale_2,
    }
    dense = nvfp4_moe.dequantized_bank(*bank)
    return (x, w13, w2, *pairs), scales, (x, *dense, *pairs)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_nvfp4_runs_on_the_torch_kernel_as_the_reference_on_dequantized_weights(kernel):
    gen = torch.Generator().manual_seed(7)
    args, scales, dense = nvfp4_inputs(gen)
    ref = cpu_experts_ref(*dense)
    poisoned = torch.full_like(ref, float("nan"))
    with CpuExpertRunner(2, kernel) as runner:
        out = runner.run(*args, **scales)
        into = runner.run(*args, out=poisoned, **scales)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert into is poisoned and torch.equal(into, out)


def test_a_done_flag_is_written_after_the_output():
    """The handoff the decode's GPU kernel polls (kernels/host_handoff.py)."""
    gen = torch.Generator().manual_seed(8)
    args, scales, dense = nvfp4_inputs(gen)
    out = torch.empty(3, args[0].shape[1])
    flag = torch.zeros(1, dtype=torch.int64)
    with CpuExpertRunner(1, "auto") as runner:
        runner.submit(*args, out=out, done_flag=flag, done_value=5, **scales).wait()
    assert flag.item() == 5
    torch.testing.assert_close(out, cpu_experts_ref(*dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("w2_scale_2", "NVFP4 weights need both w13_scale_2 and w2_scale_2"),
        ("w13_scale", "NVFP4 weights need w13_scale and w2_scale"),
    ],
)
def test_an_nvfp4_call_without_its_scales_is_refused(drop, message):
    gen = torch.Generator().manual_seed(9)
    args, scales, _ = nvfp4_inputs(gen)
    del scales[drop]
    with CpuExpertRunner(1, "torch") as runner, pytest.raises(ValueError, match=message):
        runner.submit(*args, **scales)
