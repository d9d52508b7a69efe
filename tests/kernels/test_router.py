"""Router softmax + top-k against its torch reference (the one-launch router: test_route.py)."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import router

from .kernel_inputs import DEVICE, assert_top_k, randn

pytestmark = pytest.mark.usefixtures("triton_runs")


@pytest.mark.parametrize(
    ("tokens", "experts", "k", "renormalize", "dtype"),
    [
        (5, 128, 8, True, torch.float32),  # Qwen3-30B-A3B
        (3, 60, 4, False, torch.float32),  # Qwen2-MoE: not renormalized, odd expert count
        (4, 8, 2, True, torch.bfloat16),  # Mixtral
        (2, 64, 8, False, torch.float16),  # OLMoE
        (1, 7, 7, True, torch.float32),  # k equals the number of experts
    ],
)
def test_matches_reference(gen, tokens, experts, k, renormalize, dtype):
    logits = randn(gen, tokens, experts, scale=2.0, dtype=dtype)
    weights, ids = router.topk_softmax_triton(logits, k, renormalize)
    assert_top_k(weights, ids, logits, k, renormalize)
    ref_weights, ref_ids = router.topk_softmax_ref(logits, k, renormalize)
    assert_top_k(ref_weights, ref_ids, logits, k, renormalize)  # the reference, held to the same
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens, device=DEVICE))


def test_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], device=DEVICE)
    weights, ids = router.topk_softmax_triton(logits, 2, True)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]], device=DEVICE))


def nan_logits(gen: torch.Generator, experts: int) -> torch.Tensor:
    """Rows of router logits as NaN hidden states make them: one NaN, all NaN, all -inf, one
    +inf; and a finite row last."""
    logits = randn(gen, 5, experts, scale=2.0)
    logits[0, 3] = float("nan")
    logits[1] = float("nan")
    logits[2] = -float("inf")
    logits[3, 5] = float("inf")
    return logits


def assert_in_range(ids: torch.Tensor, experts: int) -> None:
    """Every pick names a real expert, once a row (what the MoE kernels index their slots by)."""
    assert ((ids >= 0) & (ids < experts)).all(), ids.tolist()
    assert all(len(set(row)) == len(row) for row in ids.tolist()), ids.tolist()


# the interpreter's numpy warns of the NaN the test feeds on purpose
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("experts", [12, 16], ids=["padded", "power-of-two"])
def test_nan_logits_pick_real_experts(gen, experts):
    """A NaN or infinite logit makes its row's probabilities NaN: the picks still name experts
    0..E-1 (NaN ranks first, as torch.topk ranks it, the lower id first), their weights NaN, and
    the finite rows route as before."""
    logits = nan_logits(gen, experts)
    weights, ids = router.topk_softmax_triton(logits, 3, True)
    assert_in_range(ids, experts)
    assert ids[:4].tolist() == [[0, 1, 2]] * 4 and weights[:4].isnan().all()
    assert_top_k(weights[4:], ids[4:], logits[4:], 3, True)


def test_cpu_tensors_go_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(router, "topk_softmax_triton", refuse)
    logits = torch.randn(3, 16, generator=gen)
    out = router.topk_softmax(logits, 4, True)
    ref = router.topk_softmax_ref(logits, 4, True)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("k", [0, 17])
def test_k_outside_the_experts_is_refused(k):
    with pytest.raises(ValueError, match="k must be between 1 and the number of experts"):
        router.topk_softmax(torch.ones(2, 16, device=DEVICE), k, True)


@pytest.mark.parametrize("fn", ["topk_softmax_triton", "topk_softmax_ref"])
def test_ids_written_into_a_strided_record(gen, fn):
    # the engine keeps every MoE layer's routing of a decode step in one [tokens, layers, K]
    # record; the router writes its layer's column there (no copy launch)
    record = torch.full((6, 3, 8), -7, dtype=torch.int32, device=DEVICE)
    logits = randn(gen, 4, 64, scale=2.0)
    weights, ids = getattr(router, fn)(logits, 8, True, ids_out=record[:4, 1])
    assert ids.data_ptr() == record[:4, 1].data_ptr()
    assert_top_k(weights, record[:4, 1], logits, 8, True)
    untouched = torch.ones_like(record, dtype=torch.bool)
    untouched[:4, 1] = False
    assert (record[untouched] == -7).all()
    with pytest.raises(ValueError, match="ids_out must be int32"):
        getattr(router, fn)(logits, 8, True, ids_out=record[:4, 1].long())
