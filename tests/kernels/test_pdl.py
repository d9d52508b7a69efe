"""Programmatic dependent launch (`common.pdl`): where it is on, and that kernels launched with it
wait for the kernel before them."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import common, gemv, rmsnorm

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def fresh_answer():
    """`common.pdl` keeps its answer per device: each test asks again."""
    common.pdl.cache_clear()
    yield
    common.pdl.cache_clear()


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    assert common.pdl(torch.device("cpu")) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert common.pdl(torch.device("cuda", 0)) is False  # the interpreter has no such launch


def test_off_on_rocm(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert common.pdl(torch.device("cuda", 0)) is False  # asked before any device is


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_on_from_hopper_unless_turned_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.device("cuda", 0)
    hopper = torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9
    assert common.pdl(device) is hopper
    common.pdl.cache_clear()
    monkeypatch.setenv("MOELAB_PDL", "0")
    assert common.pdl(device) is False


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_chain_of_launches_in_a_graph_reads_each_result_after_it_is_written():
    """A long kernel (a wide GEMV), then short ones that read its output, captured and replayed:
    each later kernel starts on the SMs before the one before it ends, and must still read that
    one's writes (the GEMVs read their first weight tile before that: `early_weights`). Fresh
    inputs each replay, checked against torch."""
    device = torch.device("cuda", 0)
    gen = torch.Generator(device).manual_seed(3)
    hidden, wide = 2048, 151936 // 8
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(wide, hidden, device=device, dtype=torch.bfloat16, generator=gen) / 32
    w_back = torch.randn(hidden, wide, device=device, dtype=torch.bfloat16, generator=gen) / 32
    norm_w = torch.rand(hidden, device=device, dtype=torch.bfloat16, generator=gen) + 0.5

    def chain() -> torch.Tensor:
        h = gemv.linear_decode(x, w, early_weights=True)
        back = gemv.linear_decode(h, w_back, early_weights=True)
        return rmsnorm.rmsnorm_triton(back, norm_w, 1e-6)

    chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        x.copy_(torch.randn(1, hidden, device=device, dtype=torch.bfloat16, generator=gen))
        graph.replay()
        h = (x.float() @ w.float().T).bfloat16()
        back = (h.float() @ w_back.float().T).bfloat16()
        expected = rmsnorm.rmsnorm_ref(back, norm_w, 1e-6)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
