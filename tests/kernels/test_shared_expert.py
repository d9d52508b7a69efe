"""The shared expert's combine (kernels/shared_expert.py) against its definition."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import shared_expert

from .kernel_inputs import assert_matches, randn


def combine_inputs(gen, tokens: int, routes: int, hidden: int, dtype: torch.dtype):
    routed = randn(gen, tokens, routes, hidden) if routes else randn(gen, tokens, hidden)
    return (
        routed,
        randn(gen, tokens, 1, scale=3.0, dtype=dtype),
        randn(gen, tokens, hidden, dtype=dtype),
    )


def test_the_reference_is_the_layers_arithmetic(gen):
    """Written out as the MoE layer rounds it: the routes summed in fp32, the sigmoid gate and
    its product with the shared expert in the model's dtype, the sum cast back."""
    routed, gate_logit, shared = combine_inputs(gen, 3, 4, 64, torch.bfloat16)
    gate = torch.sigmoid(gate_logit)
    expected = (routed.sum(dim=1) + (gate * shared).float()).bfloat16()
    assert torch.equal(shared_expert.combine_ref(routed, gate_logit, shared), expected)
    assert torch.equal(
        shared_expert.combine(routed.cpu(), gate_logit.cpu(), shared.cpu()), expected.cpu()
    )


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2**-6)])
@pytest.mark.parametrize("routes", [0, 1, 8])  # 0: the routes already summed, [T, H]
def test_the_kernel_is_the_reference(gen, dtype, tol, routes):
    """Hidden sizes off the column block, one route, eight, or their sum: the reference's
    values, every output written (bf16: the interpreter truncates where the reference rounds)."""
    routed, gate_logit, shared = combine_inputs(gen, 3, routes, 1100, dtype)
    out = shared_expert.combine_triton(routed, gate_logit, shared)
    assert_matches(out, shared_expert.combine_ref(routed, gate_logit, shared), tol)


def test_the_kernel_refuses_what_it_cannot_combine(gen):
    routed, gate_logit, shared = combine_inputs(gen, 2, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="routed must be float32"):
        shared_expert.combine_triton(routed.bfloat16(), gate_logit, shared)
    with pytest.raises(ValueError, match=r"gate_logit \[T, 1\]"):
        shared_expert.combine_triton(routed, gate_logit.float(), shared)
    with pytest.raises(ValueError, match="shared must have a contiguous last dimension"):
        shared_expert.combine_triton(routed, gate_logit, shared.t().contiguous().t())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_rounds_as_the_reference_on_cuda(gen):
    """Qwen3.6-35B-A3B's hidden size, 8 routes, bf16: within one bf16 unit, nearly all equal."""
    routed, gate_logit, shared = combine_inputs(gen, 8, 8, 2048, torch.bfloat16)
    out = shared_expert.combine(routed, gate_logit, shared)
    ref = shared_expert.combine_ref(routed, gate_logit, shared)
    assert_matches(out, ref, 2**-7)
    assert (out == ref).float().mean().item() > 0.95
