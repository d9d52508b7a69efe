"""Synthetic checkpoints of the hybrid architectures: Qwen3-Next and Qwen3.5/3.6 MoE.

Their config.json in each layout transformers reads (Qwen3-Next's; Qwen3.5/3.6 MoE's multimodal one
with `text_config` and `vision_config`, and its text-only one), the tensors of their Gated DeltaNet
and gated full-attention layers, and the small vision tower a multimodal checkpoint carries (which
the engine skips). `synth.py` asks this module for what differs from the other architectures.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable

import torch

from .spec import HYBRID_ARCHITECTURES, MULTIMODAL_TEXT_PREFIX, ModelSpec

# the names `moelab synth --arch` takes for these models: the multimodal Qwen3.5/3.6 MoE layout is
# `qwen3_5_moe`, its text-only one `qwen3_5_moe_text` (the engine reads both as qwen3_5_moe)
TEXT_ONLY = "qwen3_5_moe_text"
SYNTH_ARCHS = (*HYBRID_ARCHITECTURES, TEXT_ONLY)

# the linear layers' geometry of each shared preset (PRESETS in synth.py), in config.json's names;
# elsewhere transformers' defaults (those of Qwen3-Next-80B-A3B and Qwen3.5/3.6-35B-A3B)
LINEAR_GEOMETRY: dict[str, dict] = {
    "tiny": dict(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    ),
    "small": dict(
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
    ),
}
_TRANSFORMERS_LINEAR = dict(
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)

# The real geometries. Qwen3.6-35B-A3B: 40 layers, three Gated DeltaNet layers to each full
# attention one, 256 experts of which 8 routed and 1 shared per token, a 262,144-token context;
# every other field is transformers' Qwen3_5MoeTextConfig default. Qwen3-Next-80B-A3B: transformers'
# Qwen3NextConfig defaults, with its published 262,144-token context.
HYBRID_PRESETS: dict[str, dict] = {
    "qwen3.6-35b-a3b": dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        intermediate_size=0,
        shared_expert_intermediate_size=512,
        max_position_embeddings=262144,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        **_TRANSFORMERS_LINEAR,
    ),
    "qwen3-next-80b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        intermediate_size=5632,
        shared_expert_intermediate_size=512,
        max_position_embeddings=262144,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        **_TRANSFORMERS_LINEAR,
    ),
}
# the architecture a real geometry belongs to, `moelab synth`'s --arch where none is given
PRESET_ARCHS = {"qwen3.6-35b-a3b": "qwen3_5_moe", "qwen3-next-80b-a3b": "qwen3_next"}

FULL_ATTENTION_INTERVAL = 4  # every 4th layer full attention, as in both real models
PARTIAL_ROTARY_FACTOR = 0.25

# The vision tower of a multimodal checkpoint: a small one for the CI-sized presets, else
# transformers' Qwen3_5MoeVisionConfig defaults (its out_hidden_size is the decoder's width).
VISION_GEOMETRY: dict[str, dict] = {
    "tiny": dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        patch_size=4,
        num_position_embeddings=16,
    ),
    "small": dict(
        depth=2,
        hidden_size=256,
        num_heads=4,
        intermediate_size=512,
        patch_size=16,
        num_position_embeddings=256,
    ),
}
_TRANSFORMERS_VISION = dict(
    depth=27,
    hidden_size=1152,
    num_heads=16,
    intermediate_size=4304,
    patch_size=16,
    num_position_embeddings=2304,
)
# the multimodal tokens' ids in the tokenizer (synth_tokenizer.write_tokenizer_files's extra)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


# fields of a preset's geometry beyond the shared ones that an override may set
_GEOMETRY = {
    *_TRANSFORMERS_LINEAR,
    "full_attention_interval",
    "mlp_only_layers",
    "decoder_sparse_step",
    "norm_topk_prob",
    "tie_word_embeddings",
    "torch_dtype",
}


def hybrid_config(arch: str, preset: str, g: dict, overrides: dict) -> dict:
    """config.json for a hybrid `arch` (SYNTH_ARCHS) of geometry `g` (a preset's fields with the
    overrides); overrides of fields the geometry does not name go into the decoder's config as
    they are."""
    named = _GEOMETRY | set(HYBRID_PRESETS["qwen3.6-35b-a3b"])
    extra = {k: v for k, v in overrides.items() if k not in named}
    linear = {
        key: g.get(key, LINEAR_GEOMETRY.get(preset, _TRANSFORMERS_LINEAR)[key])
        for key in _TRANSFORMERS_LINEAR
    }
    interval = g.get("full_attention_interval", FULL_ATTENTION_INTERVAL)
    layers = g["num_hidden_layers"]
    text = dict(
        vocab_size=g["vocab_size"],
        hidden_size=g["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=g["num_attention_heads"],
        num_key_value_heads=g["num_key_value_heads"],
        head_dim=g["head_dim"],
        max_position_embeddings=g["max_position_embeddings"],
        rms_norm_eps=g["rms_norm_eps"],
        num_experts=g["num_experts"],
        num_experts_per_tok=g["num_experts_per_tok"],
        moe_intermediate_size=g["moe_intermediate_size"],
        shared_expert_intermediate_size=g["shared_expert_intermediate_size"]
        or g["moe_intermediate_size"],
        **linear,
        full_attention_interval=interval,
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=None,
        tie_word_embeddings=bool(g.get("tie_word_embeddings", False)),
        torch_dtype=g.get("torch_dtype", "bfloat16"),
    )
    if arch == "qwen3_next":
        # Qwen3-Next's published config: rope settings at the top, dense MLP layers possible
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            **text,
            "intermediate_size": g["intermediate_size"],
            "decoder_sparse_step": g.get("decoder_sparse_step", 1),
            "mlp_only_layers": g.get("mlp_only_layers", []),
            "norm_topk_prob": g.get("norm_topk_prob", True),
            "rope_theta": g["rope_theta"],
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
            **extra,
        }
    # Qwen3.5/3.6 MoE, as transformers 5 writes it: rope in rope_parameters, with the sections of
    # its multimodal rope (one position for all three where the input is text)
    text.update(
        model_type=TEXT_ONLY,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=g["rope_theta"],
            partial_rotary_factor=PARTIAL_ROTARY_FACTOR,
            mrope_section=[11, 11, 10],
            mrope_interleaved=True,
        ),
        attn_output_gate=True,
    )
    text.update(extra)
    if arch == TEXT_ONLY:
        return {"architectures": ["Qwen3_5MoeForCausalLM"], **text}
    vision = {
        **VISION_GEOMETRY.get(preset, _TRANSFORMERS_VISION),
        "model_type": "qwen3_5_moe_vision",
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": g["hidden_size"],
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "torch_dtype": text["torch_dtype"],
    }


def set_vision_token_ids(config: dict, token_id: Callable[[str], int]) -> None:
    """Point a multimodal config's image and video token ids at the tokenizer's tokens."""
    start, end, image, video = (token_id(t) for t in VISION_TOKENS)
    config.update(
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
        video_token_id=video,
    )  # fmt: skip


def hybrid_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every decoder tensor of a hybrid checkpoint by its name (under the spec's text prefix),
    experts one tensor per expert as Qwen publishes them."""
    s, la = spec, spec.linear_attention
    assert la is not None
    p = s.text_prefix
    h, q, kv = s.hidden_size, s.q_size, s.kv_size
    shapes: dict[str, tuple[int, ...]] = {p + "embed_tokens.weight": (s.vocab_size, h)}
    for layer in range(s.num_layers):
        lp = f"{p}layers.{layer}."
        shapes[lp + "input_layernorm.weight"] = (h,)
        shapes[lp + "post_attention_layernorm.weight"] = (h,)
        if layer in s.attention_layers:
            a = lp + "self_attn."
            shapes.update({
                a + "q_proj.weight": (2 * q if s.attn_output_gate else q, h),
                a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                a + "o_proj.weight": (h, q),
                a + "q_norm.weight": (s.head_dim,), a + "k_norm.weight": (s.head_dim,),
            })  # fmt: skip
        else:
            a = lp + "linear_attn."
            if s.arch == "qwen3_next":
                projections = {
                    a + "in_proj_qkvz.weight": (2 * la.key_dim + 2 * la.value_dim, h),
                    a + "in_proj_ba.weight": (2 * la.num_v_heads, h),
                }
            else:
                projections = {
                    a + "in_proj_qkv.weight": (la.conv_dim, h),
                    a + "in_proj_z.weight": (la.value_dim, h),
                    a + "in_proj_b.weight": (la.num_v_heads, h),
                    a + "in_proj_a.weight": (la.num_v_heads, h),
                }
            shapes.update(projections)
            shapes.update({
                a + "conv1d.weight": (la.conv_dim, 1, la.conv_kernel),
                a + "dt_bias": (la.num_v_heads,), a + "A_log": (la.num_v_heads,),
                a + "norm.weight": (la.head_v_dim,), a + "out_proj.weight": (h, la.value_dim),
            })  # fmt: skip
        m = lp + "mlp."
        if not s.is_moe_layer(layer):
            i = s.intermediate_size
            shapes.update({m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h),
                           m + "down_proj.weight": (h, i)})  # fmt: skip
            continue
        shapes[m + "gate.weight"] = (s.num_experts, h)
        i = s.moe_intermediate_size
        for e in range(s.num_experts):
            x = f"{m}experts.{e}."
            shapes.update({x + "gate_proj.weight": (i, h), x + "up_proj.weight": (i, h),
                           x + "down_proj.weight": (h, i)})  # fmt: skip
        si = s.shared_expert_intermediate_size
        shapes.update({
            m + "shared_expert.gate_proj.weight": (si, h),
            m + "shared_expert.up_proj.weight": (si, h),
            m + "shared_expert.down_proj.weight": (h, si),
            m + "shared_expert_gate.weight": (1, h),
        })  # fmt: skip
    shapes[p + "norm.weight"] = (h,)
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, h)
    return shapes


def hybrid_tensor(spec: ModelSpec, name: str, shape: tuple[int, ...], dtype: torch.dtype):
    """The tensors of a hybrid model whose values follow their role rather than a random draw, or
    None: RMSNorm weights stored zero-centred (the norm multiplies by 1 + w) hold 0, the linear
    layers' gated norm 1, their decay rates A span 1..16 (transformers draws them from 0.01..16)
    and their time-step biases are 1 (transformers' initialisation)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.linspace(1.0, 16.0, shape[0]).log().to(dtype)
    if leaf == "dt_bias":
        return torch.ones(shape, dtype=dtype)
    if "norm" in name:
        zero = spec.zero_centered_norm and not name.endswith("linear_attn.norm.weight")
        return torch.zeros(shape, dtype=dtype) if zero else torch.ones(shape, dtype=dtype)
    return None


def hybrid_not_converted(spec: ModelSpec) -> list[str]:
    """The modules an FP8 hybrid checkpoint keeps unquantized: the embeddings, every norm, the
    linear layers' convolutions and their small per-head projections (b and a), the routers and
    shared expert gates, the vision tower and lm_head."""
    p = spec.text_prefix
    names = [p + "embed_tokens"]
    for layer in range(spec.num_layers):
        lp = f"{p}layers.{layer}."
        names += [lp + "input_layernorm", lp + "post_attention_layernorm"]
        if layer in spec.attention_layers:
            names += [lp + "self_attn.q_norm", lp + "self_attn.k_norm"]
        else:
            a = lp + "linear_attn."
            small = ["in_proj_ba"] if spec.arch == "qwen3_next" else ["in_proj_b", "in_proj_a"]
            names += [a + "conv1d", a + "norm", *(a + n for n in small)]
        if spec.is_moe_layer(layer):
            names += [lp + "mlp.gate", lp + "mlp.shared_expert_gate"]
    names.append(p + "norm")
    if spec.text_prefix == MULTIMODAL_TEXT_PREFIX:
        names.append("model.visual")
    if not spec.tie_word_embeddings:
        names.append("lm_head")
    return names


def layer_of(name: str) -> int:
    """The decoder layer a tensor name belongs to ("...layers.12.mlp.gate.weight": 12)."""
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    assert found is not None, name
    return int(found.group(1))


class VisionTower:
    """The vision encoder tensors of a multimodal Qwen3.5/3.6 MoE checkpoint (`model.visual.*`),
    deterministic random values of transformers' shapes: written so that the checkpoint is the
    published layout, and skipped by the engine."""

    def __init__(self, vision: dict, seed: int, dtype: torch.dtype) -> None:
        self.seed = seed
        self.dtype = dtype
        vh, vi = vision["hidden_size"], vision["intermediate_size"]
        patch, t = vision["patch_size"], vision["temporal_patch_size"]
        merged = vh * vision["spatial_merge_size"] ** 2
        v = "model.visual."
        shapes = {
            v + "patch_embed.proj.weight": (vh, vision["in_channels"], t, patch, patch),
            v + "patch_embed.proj.bias": (vh,),
            v + "pos_embed.weight": (vision["num_position_embeddings"], vh),
        }
        for block in range(vision["depth"]):
            b = f"{v}blocks.{block}."
            shapes.update({
                b + "norm1.weight": (vh,), b + "norm1.bias": (vh,),
                b + "norm2.weight": (vh,), b + "norm2.bias": (vh,),
                b + "attn.qkv.weight": (3 * vh, vh), b + "attn.qkv.bias": (3 * vh,),
                b + "attn.proj.weight": (vh, vh), b + "attn.proj.bias": (vh,),
                b + "mlp.linear_fc1.weight": (vi, vh), b + "mlp.linear_fc1.bias": (vi,),
                b + "mlp.linear_fc2.weight": (vh, vi), b + "mlp.linear_fc2.bias": (vh,),
            })  # fmt: skip
        shapes.update({
            v + "merger.norm.weight": (vh,), v + "merger.norm.bias": (vh,),
            v + "merger.linear_fc1.weight": (merged, merged),
            v + "merger.linear_fc1.bias": (merged,),
            v + "merger.linear_fc2.weight": (vision["out_hidden_size"], merged),
            v + "merger.linear_fc2.bias": (vision["out_hidden_size"],),
        })  # fmt: skip
        self.shapes = shapes

    def names(self) -> list[str]:
        return list(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def has(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if "norm" in name and name.endswith(".weight"):
            return torch.ones(shape, dtype=self.dtype)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=self.dtype)
        seed = (zlib.crc32(name.encode()) ^ (self.seed * 0x9E3779B1)) & 0x7FFFFFFF
        fan_in = math.prod(shape[1:])
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        return (t / math.sqrt(fan_in)).to(self.dtype)
