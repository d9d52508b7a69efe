"""The torch references compute what Hugging Face's Qwen3-MoE modules compute."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

from moelab.kernels import fused_moe, grouped_moe, rmsnorm, router


def config(norm_topk_prob: bool = True) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob,
        hidden_act="silu",
    )


@torch.no_grad()
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_hf(gen, norm_topk_prob):
    gate = hf.Qwen3MoeTopKRouter(config(norm_topk_prob))
    gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    logits, hf_weights, hf_ids = gate(x)
    weights, ids = router.topk_softmax_ref(logits, 3, renormalize=norm_topk_prob)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights)


@torch.no_grad()
def test_moe_references_match_hf_experts(gen):
    experts = hf.Qwen3MoeExperts(config())
    experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / 8)
    experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / 6)
    x = torch.randn(6, 64, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(6)])
    weights = torch.rand(6, 3, generator=gen)
    expected = experts(x, ids, weights)
    args = (x, ids.int(), weights, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(fused_moe.fused_moe_decode_ref(*args), expected)
    torch.testing.assert_close(grouped_moe.grouped_moe_ref(*args), expected)


@torch.no_grad()
def test_rmsnorm_matches_hf_bit_for_bit_in_bf16(gen):
    norm = hf.Qwen3MoeRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    norm.weight.copy_(torch.randn(64, generator=gen))
    x = (torch.randn(4, 64, generator=gen) * 3).to(torch.bfloat16)
    assert torch.equal(rmsnorm.rmsnorm_ref(x, norm.weight, 1e-6), norm(x))
