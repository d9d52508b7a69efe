"""gpt-oss's experts (biases, clamped SwiGLU) in every MoE kernel: the references against
transformers' GptOssExperts, the Triton kernels (interpreter on CPU, fp32) and the CPU runner
against the references."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import cpu_experts, fp8, fused_moe, grouped_moe, mxfp4, mxfp4_moe, swiglu
from moelab.kernels.fp4_one_token import OneTokenFP4Config
from moelab.kernels.fused_moe import DecodeMoEConfig
from moelab.kernels.fused_moe_one_token import OneTokenMoEConfig
from moelab.kernels.grouped_moe import GroupedMoEConfig
from moelab.kernels.mxfp4_moe import DotDecodeConfig

from .kernel_inputs import assert_matches, randn, route_table, route_weights

LIMIT = 1.0  # low enough that the clamps bite at these activations


def biased_experts(gen: torch.Generator, num: int, hidden: int, inter: int):
    """w13 [E, 2I, H], w2 [E, H, I] and their biases, activations of a few units."""
    w13 = randn(gen, num, 2 * inter, hidden, scale=2 * hidden**-0.5)
    w2 = randn(gen, num, hidden, inter, scale=inter**-0.5)
    return w13, w2, randn(gen, num, 2 * inter, scale=0.5), randn(gen, num, hidden, scale=0.5)


def test_activation_is_transformers_clamped_swiglu():
    """The formula of transformers' GptOssExperts._apply_gate, written out, on values that cross
    both clamps."""
    gate = torch.linspace(-12, 12, 97)
    up = torch.linspace(9, -9, 97)
    clamped_gate, clamped_up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    expected = (clamped_up + 1) * clamped_gate * torch.sigmoid(clamped_gate * 1.702)
    assert torch.allclose(swiglu.activate(gate, up, 7.0), expected)
    assert torch.allclose(swiglu.activate(gate, up), torch.nn.functional.silu(gate) * up)


def test_references_match_transformers_experts():
    """fused_moe_decode_ref, grouped_moe_ref and cpu_experts_ref against GptOssExperts itself
    (its fused, interleaved [E, H, 2I] layout turned into the bank's)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=6, swiglu_limit=LIMIT
    )
    module = GptOssExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(7, 32)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(7)])
    weights = torch.rand(7, 2)
    with torch.no_grad():
        expected = module(x, ids, weights)

    def gate_then_up(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)

    w13 = gate_then_up(module.gate_up_proj.detach()).transpose(1, 2).contiguous()
    w2 = module.down_proj.detach().transpose(1, 2).contiguous()
    b13 = gate_then_up(module.gate_up_proj_bias.detach())
    b2 = module.down_proj_bias.detach()
    extras = {"w13_bias": b13, "w2_bias": b2, "swiglu_limit": LIMIT}
    decode = fused_moe.fused_moe_decode_ref(x, ids, weights, w13, w2, **extras)
    grouped = grouped_moe.grouped_moe_ref(x, ids, weights, w13, w2, **extras)
    tokens = torch.arange(7).repeat_interleave(2).int()
    cpu = cpu_experts.cpu_experts_ref(
        x, w13, w2, ids.flatten().int(), tokens, weights.flatten(), **extras
    )
    for ours in (decode, grouped, cpu):
        assert_matches(ours, expected, tol=1e-5)
    plain = fused_moe.fused_moe_decode_ref(x, ids, weights, w13, w2)
    assert not torch.allclose(plain, expected, atol=1e-2)


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize(
    ("tokens", "config"),
    [
        (1, None),  # the one-token kernels, a program per route
        (1, OneTokenMoEConfig(16, 32, 16, 16, num_warps=2, loop_routes=True)),
        (1, DecodeMoEConfig()),  # one token through the tl.dot kernels
        (5, DecodeMoEConfig(gate_up_block_k=32, down_block_k=16)),
    ],
)
def test_decode_kernels_match_reference(gen, tokens, config):
    w13, w2, b13, b2 = biased_experts(gen, 6, 48, 24)
    x = randn(gen, tokens, 48)
    slots = route_table(gen, tokens, 3, 6, masked=0.2)
    weights = route_weights(gen, tokens, 3)
    extras = {"w13_bias": b13, "w2_bias": b2, "swiglu_limit": LIMIT}
    out = fused_moe.fused_moe_decode_triton(
        x, slots, weights, w13, w2, config=config, reduce=False, **extras
    )
    ref = fused_moe.fused_moe_decode_ref(x, slots, weights, w13, w2, reduce=False, **extras)
    assert_matches(out.sum(dim=1), ref.sum(dim=1), tol=1e-5)
    plain = fused_moe.fused_moe_decode_ref(x, slots, weights, w13, w2)
    assert not torch.allclose(plain, ref.sum(dim=1), atol=1e-2)


@pytest.mark.usefixtures("triton_runs")
def test_grouped_kernels_match_reference(gen):
    w13, w2, b13, b2 = biased_experts(gen, 5, 40, 24)
    x = randn(gen, 23, 40)
    ids = route_table(gen, 23, 2, 5, masked=0.1)
    weights = route_weights(gen, 23, 2)
    extras = {"w13_bias": b13, "w2_bias": b2, "swiglu_limit": LIMIT}
    config = GroupedMoEConfig(16, 16, 32, 32, num_warps=4, num_stages=2)
    out = grouped_moe.grouped_moe_triton(x, ids, weights, w13, w2, config=config, **extras)
    ref = grouped_moe.grouped_moe_ref(x, ids, weights, w13, w2, **extras)
    assert_matches(out, ref, tol=1e-5)


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_cpu_runner_matches_reference(gen, kernel, tokens):
    """The native kernel (one token an expert, and tiles of several) and the torch one."""
    w13, w2, b13, b2 = (t.cpu() for t in biased_experts(gen, 4, 64, 40))
    x = torch.randn(tokens, 64, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:3] for _ in range(tokens)])
    experts = ids.flatten().int()
    pairs = torch.arange(tokens).repeat_interleave(3).int()
    weights = torch.rand(3 * tokens, generator=gen)
    extras = {"w13_bias": b13, "w2_bias": b2, "swiglu_limit": LIMIT}
    args = (x, w13, w2, experts, pairs, weights)
    with cpu_experts.CpuExpertRunner(2, kernel) as runner:
        out = runner.run(*args, **extras)
    assert_matches(out, cpu_experts.cpu_experts_ref(*args, **extras), tol=1e-5)
    plain = cpu_experts.cpu_experts_ref(*args)
    assert not torch.allclose(plain, out, atol=1e-2)


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize(
    "config",
    [None, DecodeMoEConfig(gate_up_block_k=64, down_block_k=32), "grouped"],
    ids=["one-token", "tl.dot", "grouped"],
)
def test_fp8_experts_with_biases_match_reference(gen, config):
    """gpt-oss's experts quantized to FP8 (--moe-expert-dtype fp8): the FP8 paths add the biases
    and clamp as the others do."""
    w13, w2, b13, b2 = biased_experts(gen, 5, 160, 48)
    (q13, s13), (q2, s2) = fp8.quantize(w13), fp8.quantize(w2)
    tokens = 1 if config is None else 6
    x = randn(gen, tokens, 160)
    ids = route_table(gen, tokens, 2, 5, masked=0.2 if config != "grouped" else 0.0)
    weights = route_weights(gen, tokens, 2)
    extras = {"w13_bias": b13, "w2_bias": b2, "swiglu_limit": LIMIT,
              "w13_scale_inv": s13, "w2_scale_inv": s2}  # fmt: skip
    if config == "grouped":
        out = grouped_moe.grouped_moe_triton(x, ids, weights, q13, q2, **extras)
        ref = grouped_moe.grouped_moe_ref(x, ids, weights, q13, q2, **extras)
    else:
        out = fused_moe.fused_moe_decode_triton(x, ids, weights, q13, q2, config=config, **extras)
        ref = fused_moe.fused_moe_decode_ref(x, ids, weights, q13, q2, **extras)
    assert_matches(out, ref, tol=1e-5)


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize(
    "config",
    [OneTokenFP4Config(4, 64, 8, 32, num_warps=2), DotDecodeConfig(16, 64)],
    ids=["one-token", "tl.dot"],
)
def test_mxfp4_experts_with_biases_match_reference(gen, config):
    """gpt-oss's own format: one token over MXFP4 experts, through the one-token launches and
    the tl.dot ones, adds the biases and clamps as the reference on the dequantized weights."""
    w13, w2, b13, b2 = biased_experts(gen, 5, 96, 64)
    (q13, s13), (q2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
    x = randn(gen, 1, 96)
    ids = route_table(gen, 1, 3, 5, masked=0.2)
    weights = route_weights(gen, 1, 3)
    extras = {"w13_bias": b13, "w2_bias": b2, "swiglu_limit": LIMIT}
    bank = (q13, q2, s13, s2)
    out = mxfp4_moe.fused_moe_decode_mxfp4(x, ids, weights, *bank, config=config, **extras)
    ref = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, ids, weights, *bank, **extras)
    assert_matches(out, ref, tol=1e-5)
    plain = mxfp4_moe.fused_moe_decode_mxfp4_ref(x, ids, weights, *bank)
    assert not torch.allclose(plain, ref, atol=1e-2)
