"""`--dense-dtype fp8`: the dense projections held in FP8 with one fp32 factor per 128x128
block, read by `gemv.linear` (the FP8 skinny GEMM on CUDA, each weight widened for its call
elsewhere), and the memory plan counting them as held."""

from __future__ import annotations

import pytest
import torch

from moelab.engine.model.checkpoint import _FP8_FIELDS
from moelab.engine.model.spec import LINEAR_ATTENTION, ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from moelab.kernels import fp8

from .reference import (
    assert_same_greedy,
    hf_greedy,
    hf_logits,
    make_engine,
    relative_error,
)
from .test_fp8 import PROMPT, dequantize_checkpoint
from .test_split_engine import engine as split_engine

# every projection whole 128-row blocks (q, k and v stack on the checkpoint's own blocks)
ALIGNED = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "moe_intermediate_size": 128,
    "intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}


def held_fp8(engine) -> dict[int, set[str]]:
    """Each layer's projections held in FP8, checked to be e4m3 with their factors' shape."""
    out = {}
    for index, lw in enumerate(engine.model.weights.layers):
        names = set()
        for name in _FP8_FIELDS:
            weight, scale = getattr(lw, name), getattr(lw, name + "_scale")
            if scale is None:
                assert weight is None or weight.dtype != torch.float8_e4m3fn, name
                continue
            n, k = weight.shape
            assert weight.dtype == torch.float8_e4m3fn
            assert scale.shape == (fp8.blocks(n), fp8.blocks(k)) and scale.dtype == torch.float32
            names.add(name)
        out[index] = names
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_an_fp8_checkpoints_projections_kept_fp8_match_transformers(arch, tmp_path):
    """An FP8 checkpoint served with its projections in FP8 against transformers on the weights
    dequantized by the format's definition: the logits within fp32 tolerance and the same
    greedy tokens, resident and offloaded; the plan's dense bytes are the bytes held."""
    transformers = pytest.importorskip("transformers")
    path = synthesize(
        tmp_path / "fp8", arch=arch, preset="tiny", seed=13, routing_skew=0.8, overrides=ALIGNED,
        dtype="fp8",
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(
        dequantize_checkpoint(path, tmp_path / "plain"), dtype=torch.float32
    ).eval()
    ref_logits = hf_logits(model, PROMPT)
    ref_tokens, margins = hf_greedy(model, PROMPT, 16)
    for flags in (("--moe-cache-rate", "1.0"), ("--moe-cache-size", "6")):
        engine = make_engine(path, "--dense-dtype", "fp8", *flags)
        try:
            held = held_fp8(engine)
            spec = engine.spec
            for index in range(spec.num_layers):
                mlp = {"mlp_gate_up", "mlp_down"} if not spec.is_moe_layer(index) else set()
                shared = (
                    {"shared_gate_up", "shared_down"}
                    if spec.is_moe_layer(index) and spec.shared_expert_intermediate_size
                    else set()
                )
                assert held[index] == {"qkv", "o"} | mlp | shared
            assert engine.plan.weights_bytes == engine.model.weights.nbytes
            ours = engine.score(PROMPT)
            [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))
        finally:
            engine.close()
        assert relative_error(ours, ref_logits) < 1e-4
        assert_same_greedy(tokens, ref_tokens, margins)


@pytest.mark.parametrize(
    "arch", ["qwen3_moe", "qwen3_5_moe", "qwen3_next", "gpt_oss", "mixtral", "olmoe"]
)
def test_a_bf16_checkpoints_projections_are_quantized_at_load(arch, tmp_path):
    """A bf16 checkpoint with --dense-dtype fp8 (ragged blocks here) gives the logits of the
    same model whose projections are quantized and widened back (`fp8.quantize`,
    `fp8.dequantize`): the factors go with their weights at every call site (attention, its
    biases and sinks in gpt_oss, a Gated DeltaNet layer's out projection, the dense MLP, the
    shared expert), in every architecture, and a DeltaNet layer's in projection stays in the
    compute dtype."""
    path = synthesize(tmp_path / "m", arch=arch, preset="tiny", seed=5, routing_skew=0.5)
    fp8_engine = make_engine(path, "--dense-dtype", "fp8", "--moe-cache-rate", "1.0")
    plain = make_engine(path, "--moe-cache-rate", "1.0")
    try:
        held = held_fp8(fp8_engine)
        spec = fp8_engine.spec
        for index, lw in enumerate(plain.model.weights.layers):
            linear_layer = spec.layer_types[index] == LINEAR_ATTENTION
            assert ("qkv" in held[index]) == (not linear_layer) and "o" in held[index]
            for name in held[index]:
                widened = fp8.dequantize(*fp8.quantize(getattr(lw, name)))
                setattr(lw, name, widened.to(getattr(lw, name).dtype))
        assert fp8_engine.plan.weights_bytes == fp8_engine.model.weights.nbytes
        assert fp8_engine.plan.weights_bytes < plain.plan.weights_bytes
        # /v1/stats' config says how the projections are held (the console shows it)
        assert fp8_engine.config_in_force()["dense_dtype"] == "fp8"
        assert plain.config_in_force()["dense_dtype"] == plain.config_in_force()["dtype"]
        ours, ref = fp8_engine.score(PROMPT), plain.score(PROMPT)
    finally:
        fp8_engine.close()
        plain.close()
    assert relative_error(ours, ref) < 1e-5


def test_the_plan_counts_the_fp8_projections_of_each_geometry():
    """ModelSpec.dense_bytes_at against the projections' own count at Qwen3-30B-A3B's and
    Qwen3.6-35B-A3B's geometries: one byte a weight and 4 a 128x128 block."""
    for arch, preset in (("qwen3_moe", "qwen3-30b-a3b"), ("qwen3_5_moe", "qwen3.6-35b-a3b")):
        spec = ModelSpec.from_config(make_config(arch, preset))
        shapes = spec.fp8_projections()
        weights = sum(n * k for n, k in shapes)
        factors = sum(fp8.blocks(n) * fp8.blocks(k) * 4 for n, k in shapes)
        assert spec.dense_bytes_at(2, "fp8") == spec.dense_bytes_at(2) - weights + factors
        assert spec.dense_bytes_at(2) == spec.dense_params * 2
        if arch == "qwen3_moe":  # 48 layers of q, k, v [5120, 2048] and o [2048, 4096]
            assert weights == 48 * (5120 * 2048 + 2048 * 4096)
        else:  # 10 attention layers, 30 DeltaNet out projections, 40 shared experts
            assert len(shapes) == 10 * 2 + 30 + 40 * 2


def test_a_split_places_each_projections_factors_with_it(tmp_path):
    """Layers split across two devices (emulated on the CPU) with FP8 projections score a prompt
    as one device does: each layer's factors go to its device with its weights, and each
    device's plan counts its own layers' FP8 bytes."""
    path = synthesize(tmp_path / "m", preset="tiny", seed=7, routing_skew=0.5)
    flags = ("--dense-dtype", "fp8", "--moe-cache-rate", "1.0")
    one = make_engine(path, *flags)
    split = split_engine(path, "--devices", "cpu,cpu", "--layer-split", "1,3", *flags)
    try:
        assert all(held_fp8(split)[i] >= {"qkv", "o"} for i in range(split.spec.num_layers))
        ours, ref = split.score(PROMPT), one.score(PROMPT)
        assert sum(p.weights_bytes for p in split.split.plans) == one.plan.weights_bytes
    finally:
        split.close()
        one.close()
    assert relative_error(ours, ref) < 1e-6
