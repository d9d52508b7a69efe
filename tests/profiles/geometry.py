"""Checkpoint geometries for the profile tests: the synth presets tiny, small and Qwen3-30B-A3B,
all qwen3_moe in bfloat16, Qwen3.6-35B-A3B's text config, a hybrid of 30 Gated DeltaNet and
10 full-attention layers, and gpt-oss-120b's (engine/model/synth.py imports torch, so the config
dicts are written out)."""

from __future__ import annotations

from moelab.engine.model.spec import ModelSpec

COMMON = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "norm_topk_prob": True,
}  # fmt: skip
TINY = {
    **COMMON, "vocab_size": 2048, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128,
    "max_position_embeddings": 4096, "mlp_only_layers": [0],
}  # fmt: skip
SMALL = {
    **COMMON, "vocab_size": 8192, "hidden_size": 1024, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 32,
    "num_experts_per_tok": 4, "moe_intermediate_size": 512, "intermediate_size": 2816,
    "max_position_embeddings": 32768,
}  # fmt: skip
A3B = {
    **COMMON, "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "max_position_embeddings": 40960,
}  # fmt: skip
# the synth preset qwen3.6-35b-a3b in the text-only layout (layer_types from the interval)
Q36 = {
    "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "max_position_embeddings": 262144, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}  # fmt: skip
SPECS = {
    name: ModelSpec.from_config(c) for name, c in (("tiny", TINY), ("small", SMALL), ("30b", A3B))
}
HYBRID = ModelSpec.from_config(Q36)
# gpt-oss-120b's config.json (MXFP4 experts): 18 sliding-window layers of 128 tokens, 18 full
GPT_OSS_120B = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16",
    "vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 128, "num_experts_per_tok": 4, "intermediate_size": 2880,
    "max_position_embeddings": 131072, "rope_theta": 150000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "sliding_window": 128, "attention_bias": True,
    "swiglu_limit": 7.0, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "quantization_config": {"quant_method": "mxfp4"},
}  # fmt: skip
GPT_OSS = ModelSpec.from_config(GPT_OSS_120B)
