"""ModelSpec of the hybrid architectures (Qwen3-Next, Qwen3.5/3.6 MoE): layer kinds, the linear
layers' geometry, gated attention with partial rotary, and the memory each kind keeps."""

from __future__ import annotations

import json

import pytest

from moelab.engine.model.spec import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MULTIMODAL_TEXT_PREFIX,
    TEXT_PREFIX,
    CheckpointError,
    LinearAttention,
    ModelSpec,
)

L, F = LINEAR_ATTENTION, FULL_ATTENTION

# the fields that matter of the config.json published with Qwen/Qwen3-Next-80B-A3B-Instruct
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

# ... and with Qwen/Qwen3.6-35B-A3B (the multimodal layout: the decoder's fields in text_config)
QWEN36_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "image_token_id": 248056,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "layer_types": ([L, L, L, F] * 10),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    },
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152},
}

REAL_LINEAR = LinearAttention(
    num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
)
# one sequence's state per linear layer: conv [3, 2·16·128 + 32·128] bf16, DeltaNet [32, 128, 128]
# fp32
REAL_STATE_PER_LAYER = 3 * 8192 * 2 + 32 * 128 * 128 * 4


def test_real_qwen3_next_config_is_understood():
    spec = ModelSpec.from_config(QWEN3_NEXT_80B)
    assert spec.arch == "qwen3_next" and spec.text_prefix == TEXT_PREFIX
    assert spec.attention_layers == tuple(range(3, 48, 4))
    assert len(spec.linear_layers) == 36 and spec.hybrid
    assert spec.layer_types[:4] == (L, L, L, F)
    assert spec.linear_attention == REAL_LINEAR
    assert spec.partial_rotary_factor == 0.25 and spec.rotary_dim == 64
    assert spec.attn_output_gate and spec.zero_centered_norm and spec.qk_norm == "head"
    assert spec.shared_expert_intermediate_size == 512 and spec.num_moe_layers == 48
    assert spec.norm_topk_prob and spec.rope_theta == 1e7 and spec.eos_token_ids == (151645,)
    assert spec.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2
    assert spec.state_bytes_per_seq == 36 * REAL_STATE_PER_LAYER


def test_real_qwen36_multimodal_config_is_understood():
    spec = ModelSpec.from_config(QWEN36_35B)
    assert spec.arch == "qwen3_5_moe" and spec.text_prefix == MULTIMODAL_TEXT_PREFIX
    assert spec.num_layers == 40 and spec.attention_layers == tuple(range(3, 40, 4))
    assert spec.linear_attention == REAL_LINEAR and spec.rotary_dim == 64
    assert spec.rope_scaling is None and spec.rope_theta == 1e7
    assert spec.num_experts == 256 and spec.top_k == 8 and spec.norm_topk_prob
    assert spec.moe_layers == tuple(range(40)) and spec.shared_expert_intermediate_size == 512
    assert spec.vocab_size == 248320 and spec.eos_token_ids == (248044,)
    assert spec.max_position_embeddings == 262144
    # 10 attention layers of 2 KV heads of 256: 20 KiB a token in bf16
    assert spec.kv_bytes_per_token == 2 * 10 * 2 * 256 * 2 == 20480
    assert spec.state_bytes_per_seq == 30 * REAL_STATE_PER_LAYER


def test_the_fp8_release_is_read_from_the_outer_config():
    config = json.loads(json.dumps(QWEN36_35B))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.visual", "linear_attn.conv1d"],
    }
    assert ModelSpec.from_config(config).quantization == "fp8"


def test_the_text_only_layout_reads_its_own_fields():
    config = {**QWEN36_35B["text_config"], "architectures": ["Qwen3_5MoeForCausalLM"]}
    spec = ModelSpec.from_config(config)
    assert spec.arch == "qwen3_5_moe" and spec.text_prefix == TEXT_PREFIX
    assert spec.attention_layers == ModelSpec.from_config(QWEN36_35B).attention_layers


def test_other_architectures_have_only_attention_layers():
    config = {**QWEN3_NEXT_80B, "model_type": "qwen3_moe", "architectures": []}
    spec = ModelSpec.from_config(config)
    assert spec.layer_types == (F,) * 48 and spec.attention_layers == tuple(range(48))
    assert spec.linear_layers == () and not spec.hybrid and spec.state_bytes_per_seq == 0
    assert spec.linear_attention is None and spec.rotary_dim == 256
    assert not spec.attn_output_gate and not spec.zero_centered_norm
    assert spec.kv_bytes_per_token == 2 * 48 * 2 * 256 * 2


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            {"layer_types": [L, F]},
            "config.json: layer_types must be a list of 48 layer kinds (full_attention, "
            'linear_attention), not ["linear_attention", "full_attention"]',
        ),
        (
            {"layer_types": ["sliding_attention"] * 48},
            "config.json: layer_types must be a list of 48 layer kinds",
        ),
        (
            {"linear_num_value_heads": 24, "linear_num_key_heads": 16},
            "linear_num_value_heads (24) is not a multiple of linear_num_key_heads (16)",
        ),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim must be at least 1, not 0"),
        ({"full_attention_interval": "4"}, "full_attention_interval must be a whole number"),
        ({"partial_rotary_factor": 0.001}, "partial_rotary_factor 0.001 must turn an even"),
        ({"shared_expert_intermediate_size": None}, "no shared_expert_intermediate_size"),
    ],
)
def test_a_bad_hybrid_field_is_named(edit, says):
    with pytest.raises(CheckpointError) as read:
        ModelSpec.from_config({**QWEN3_NEXT_80B, **edit})
    assert says in str(read.value)


def _transformers_spec(kind: str, tmp_path):
    """A tiny random model of `kind` written by transformers, and its spec read back."""
    transformers = pytest.importorskip("transformers")
    text = dict(
        vocab_size=101,
        hidden_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=20,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=3,
        layer_types=[L, F, L, L, F],
    )
    if kind == "qwen3_next":
        config = transformers.Qwen3NextConfig(**text, intermediate_size=24)
        model = transformers.Qwen3NextForCausalLM(config)
    elif kind == "qwen3_5_moe_text":
        config = transformers.Qwen3_5MoeTextConfig(**text)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        vision = dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32
        )
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    return model, ModelSpec.from_dir(tmp_path)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"])
def test_checkpoints_written_by_transformers_are_understood(kind, tmp_path):
    model, spec = _transformers_spec(kind, tmp_path)
    assert spec.arch == ("qwen3_next" if kind == "qwen3_next" else "qwen3_5_moe")
    assert spec.text_prefix == (MULTIMODAL_TEXT_PREFIX if kind == "qwen3_5_moe" else TEXT_PREFIX)
    assert spec.layer_types == (L, F, L, L, F)
    assert spec.attention_layers == (1, 4) and spec.linear_layers == (0, 2, 3)
    assert spec.linear_attention == LinearAttention(2, 4, 8, 12, 3)
    assert spec.partial_rotary_factor == 0.25 and spec.rotary_dim == 4
    # the parameters the engine keeps on the device: all but the routed experts (and the vision
    # encoder, which the engine does not load)
    dense = sum(
        p.numel()
        for name, p in model.named_parameters()
        if ".experts." not in name and "visual" not in name
    )
    assert spec.dense_params == dense
    assert spec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # fp32: 2 attention layers
    conv = 2 * (2 * 16 + 48) * 4  # W-1 rows of q, k, v channels, in the model's fp32
    assert spec.state_bytes_per_seq == 3 * (conv + 4 * 8 * 12 * 4)
