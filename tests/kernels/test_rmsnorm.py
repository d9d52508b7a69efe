"""RMSNorm and fused residual-add RMSNorm against their torch references."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import rmsnorm

from .kernel_inputs import DEVICE, assert_matches, randn

pytestmark = pytest.mark.usefixtures("triton_runs")


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 200), torch.float32), ((2, 5, 64), torch.float32), ((4, 100), torch.bfloat16)],
)
def test_rmsnorm_matches_reference(gen, shape, dtype):
    x = randn(gen, *shape, scale=3.0, dtype=dtype)
    weight = randn(gen, shape[-1], dtype=dtype)
    out = rmsnorm.rmsnorm_triton(x, weight, 1e-6)
    # bf16 rounding of the normalized value may differ by one unit where the sums differ in order.
    assert_matches(
        out, rmsnorm.rmsnorm_ref(x, weight, 1e-6), tol=1e-5 if dtype == torch.float32 else 1e-2
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm_matches_reference(gen, dtype):
    x = randn(gen, 3, 7, 96, dtype=dtype)
    residual = randn(gen, 3, 7, 96, scale=4.0, dtype=dtype)
    weight = randn(gen, 96, dtype=dtype)
    normed, new_residual = rmsnorm.fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
    ref_normed, ref_residual = rmsnorm.fused_add_rmsnorm_ref(x, residual, weight, 1e-5)
    if dtype == torch.float32 or DEVICE.type == "cuda":
        assert torch.equal(new_residual, ref_residual)  # the add is rounded exactly as torch's
    else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one unit off
        torch.testing.assert_close(new_residual, ref_residual, rtol=2**-7, atol=0)
    assert_matches(normed, ref_normed, tol=1e-5 if dtype == torch.float32 else 1e-2)


def test_fp32_weight_on_bf16_input_gives_fp32_as_hf(gen):
    x = randn(gen, 2, 64, dtype=torch.bfloat16)
    weight = randn(gen, 64)
    out = rmsnorm.rmsnorm_triton(x, weight, 1e-6)
    assert out.dtype == torch.float32
    assert_matches(out, rmsnorm.rmsnorm_ref(x, weight, 1e-6), tol=1e-2)


def test_cpu_tensors_go_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(rmsnorm, "rmsnorm_triton", refuse)
    monkeypatch.setattr(rmsnorm, "fused_add_rmsnorm_triton", refuse)
    x = torch.randn(2, 32, generator=gen)
    residual = torch.randn(2, 32, generator=gen)
    weight = torch.randn(32, generator=gen)
    assert torch.equal(rmsnorm.rmsnorm(x, weight, 1e-6), rmsnorm.rmsnorm_ref(x, weight, 1e-6))
    fused = rmsnorm.fused_add_rmsnorm(x, residual, weight, 1e-6)
    ref = rmsnorm.fused_add_rmsnorm_ref(x, residual, weight, 1e-6)
    assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])


def test_weight_of_wrong_size_is_refused():
    with pytest.raises(ValueError, match=r"weight must be \[32\]"):
        rmsnorm.rmsnorm(torch.ones(2, 32, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)


def test_residual_of_wrong_shape_is_refused():
    x = torch.ones(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        rmsnorm.fused_add_rmsnorm(
            x, torch.ones(3, 32, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 8])
def test_fused_add_rmsnorm_sums_the_routes_parts_first(gen, dtype, parts):
    # the routed experts' fp32 outputs, one per route: summed, cast, added, normed in one pass
    x = randn(gen, 5, parts, 96, dtype=torch.float32)
    residual = randn(gen, 5, 96, scale=4.0, dtype=dtype)
    weight = randn(gen, 96, dtype=dtype)
    normed, new_residual = rmsnorm.fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
    ref_normed, ref_residual = rmsnorm.fused_add_rmsnorm_ref(x, residual, weight, 1e-5)
    summed = (x.sum(dim=1).to(dtype), residual)
    assert torch.equal(ref_residual, summed[0] + summed[1])  # what the reference means
    assert new_residual.shape == residual.shape and new_residual.dtype == dtype
    if dtype == torch.float32:  # the sum's order may differ in the last bit
        torch.testing.assert_close(new_residual, ref_residual, rtol=1e-6, atol=1e-6)
        assert_matches(normed, ref_normed, tol=1e-5)
    else:  # two roundings to bf16 (the sum's cast, the add), each at most one unit of its operands
        bound = 2**-6 * (summed[0].float().abs() + residual.float().abs())
        assert ((new_residual.float() - ref_residual.float()).abs() <= bound).all()
        # the norm of the residual the kernel made (a unit off in the residual moves the norm)
        assert_matches(normed, rmsnorm.rmsnorm_ref(new_residual, weight, 1e-5), tol=1e-2)


def test_parts_must_be_fp32_and_match_the_residual(gen):
    residual = randn(gen, 5, 96, dtype=torch.bfloat16)
    weight = randn(gen, 96, dtype=torch.bfloat16)
    for bad in (randn(gen, 5, 8, 96, dtype=torch.bfloat16), randn(gen, 4, 8, 96)):
        for fn in (rmsnorm.fused_add_rmsnorm_triton, rmsnorm.fused_add_rmsnorm_ref):
            with pytest.raises(ValueError, match="must be fp32"):
                fn(bad, residual, weight, 1e-5)
