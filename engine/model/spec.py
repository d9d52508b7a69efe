"""ModelSpec: one normalized description of a supported MoE checkpoint's geometry and rules."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..text import Text
from . import modelopt

ARCHITECTURES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3_next",
    "qwen3_5_moe",
    "gpt_oss",
)
# architectures with Gated DeltaNet (linear attention) layers beside gated full attention
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5_moe")

_ARCH_BY_CLASS = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
}
# model types that name an architecture under another name (the text-only Qwen3.5/3.6 MoE)
_ARCH_BY_TYPE = {"qwen3_5_moe_text": "qwen3_5_moe"}
# the layer kinds of `layer_types`
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
# where the decoder's weights lie: "model.layers.N...", or in a multimodal checkpoint (Qwen3.5/3.6
# MoE with a vision encoder) "model.language_model.layers.N..."
TEXT_PREFIX, MULTIMODAL_TEXT_PREFIX = "model.", "model.language_model."

ROPE_SCALINGS = ("default", "linear", "yarn")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the safetensors dtypes the engine reads, and their names in torch
SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F8_E4M3": "float8_e4m3fn",
    "U8": "uint8",  # gpt_oss's MXFP4 `_blocks` and `_scales`
}
# the dtypes of weights read without a quantization_config (F8_E4M3 only with an fp8 one: a
# `weight_scale_inv` beside an FP8 weight means its block factors where config.json says so)
UNQUANTIZED_DTYPES = [code for code in SAFETENSORS_DTYPES if code not in ("F8_E4M3", "U8")]
# the FP8 layout the engine reads: Hugging Face's fine-grained FP8 (kernels/fp8.py), e4m3 values
# with one fp32 factor per 128x128 block (`weight_scale_inv`)
FP8_BLOCK = 128
RECURRENT_STATE_BYTES = 4  # the DeltaNet state is held in fp32
EXPERT_FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")  # how the bank holds the routed experts
# MXFP4 (kernels/mxfp4.py): one E8M0 scale byte per this many e2m1 values, two values a byte
MXFP4_BLOCK = 32
# NVFP4 (kernels/nvfp4.py): one e4m3 scale byte per this many e2m1 values, and an fp32 scale per
# projection (an expert's gate, up and down: three)
NVFP4_BLOCK = modelopt.GROUP_SIZE
NVFP4_TENSOR_SCALES = 3


def blocks(n: int, block: int = FP8_BLOCK) -> int:
    """How many blocks cover n values."""
    return -(-n // block)


class CheckpointError(ValueError):
    """A checkpoint moelab cannot serve, with a message that names what is wrong (a Text, which
    the catalog shows in the console's language)."""


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """The geometry of a Gated DeltaNet (linear attention) layer: H key heads of DK and HV value
    heads of DV (HV a multiple of H), and a causal convolution `conv_kernel` tokens wide over the
    q, k and v channels (kernels/gated_deltanet.py)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def conv_state_shape(self) -> tuple[int, int]:
        """One sequence's convolution state: its last W-1 inputs [W-1, C]."""
        return (self.conv_kernel - 1, self.conv_dim)

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """One sequence's DeltaNet state [HV, DK, DV]."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    @property
    def params(self) -> int:
        """Weights of one layer but its input and output projections' hidden side: the
        convolution, dt_bias, A_log and the gated norm."""
        return self.conv_dim * self.conv_kernel + 2 * self.num_v_heads + self.head_v_dim


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the engine needs to know about a checkpoint's architecture, normalized."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    # dense MLP width for layers that are not MoE (qwen mlp_only_layers / decoder_sparse_step)
    intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (Qwen3: per head) | "full" (OLMoE: whole projection)
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0  # qwen2_moe's shared expert (gated by a sigmoid)
    moe_layers: tuple[int, ...] = ()
    rope_scaling: dict | None = None
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # "fp8": the checkpoint's linear weights (but those named in modules_to_not_convert) are
    # fine-grained FP8 with 128x128 block factors; "nvfp4": ModelOpt's NVFP4 (modelopt.py);
    # "mixed": ModelOpt's MIXED_PRECISION, each module's algorithm in `layer_algorithms`, or its
    # plain FP8, the rule in `layer_algorithms` (modelopt.py); "" where the weights are unquantized
    quantization: str = ""
    layer_algorithms: dict = field(default_factory=dict, compare=False, hash=False)
    # a ModelOpt config's kv_cache_quant_algo (its KV scales, not read), "" where it has none
    kv_cache_quant_algo: str = field(default="", compare=False, hash=False)
    # the token mixer of each layer, FULL_ATTENTION or LINEAR_ATTENTION (all full attention where
    # not given); the linear layers' geometry where there are any
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttention | None = None
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions rotary turns
    attn_output_gate: bool = False  # q_proj also gives a sigmoid gate on the attention output
    # RMSNorm weights stored zero-centred (the norm multiplies by 1 + w), as Qwen3-Next's are; the
    # gated norm of the linear layers is not
    zero_centered_norm: bool = False
    text_prefix: str = TEXT_PREFIX  # TEXT_PREFIX or MULTIMODAL_TEXT_PREFIX
    # gpt_oss (engine/model/gpt_oss.py): the window of the layers in `sliding_layers` (tokens a
    # position sees, itself included; 0: none), a learned logit per head in the softmax's
    # denominator, biases in the router and the experts, the clamped SwiGLU's limit (0: SiLU)
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_layers)
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(
                Text(
                    "architecture {found} is not supported; moelab serves {architectures}",
                    found=repr(self.arch),
                    architectures=", ".join(ARCHITECTURES),
                )
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "moe_intermediate_size",
        ):
            if getattr(self, name) < 1:
                raise CheckpointError(
                    Text(
                        "config field for {name} must be at least 1, got {value}",
                        name=name,
                        value=getattr(self, name),
                    )
                )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                Text(
                    "num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                    "({kv_heads})",
                    heads=self.num_heads,
                    kv_heads=self.num_kv_heads,
                )
            )
        if self.top_k > self.num_experts:
            raise CheckpointError(
                Text(
                    "num_experts_per_tok ({top_k}) exceeds the number of experts ({experts})",
                    top_k=self.top_k,
                    experts=self.num_experts,
                )
            )
        if self.dtype not in DTYPE_BYTES:
            raise CheckpointError(
                Text(
                    "dtype {dtype} is not supported; use one of {dtypes}",
                    dtype=repr(self.dtype),
                    dtypes=", ".join(DTYPE_BYTES),
                )
            )
        if any(not 0 <= layer < self.num_layers for layer in self.moe_layers):
            raise CheckpointError(Text("an MoE layer index lies outside the model's layers"))
        self._check_layer_kinds()

    def _check_layer_kinds(self) -> None:
        kinds = (FULL_ATTENTION, LINEAR_ATTENTION)
        if len(self.layer_types) != self.num_layers or any(
            kind not in kinds for kind in self.layer_types
        ):
            raise CheckpointError(
                Text(
                    "layer_types must name {kinds} for each of the {layers} layers",
                    kinds=" or ".join(kinds),
                    layers=self.num_layers,
                )
            )
        linear = self.linear_attention
        if self.linear_layers and linear is None:
            raise CheckpointError(Text("linear attention layers need their geometry"))
        if linear is not None:
            for name in fields(linear):
                if getattr(linear, name.name) < 1:
                    raise CheckpointError(
                        Text(
                            "config field for {name} must be at least 1, got {value}",
                            name=name.name,
                            value=getattr(linear, name.name),
                        )
                    )
            if linear.num_v_heads % linear.num_k_heads:
                raise CheckpointError(
                    Text(
                        "linear_num_value_heads ({v_heads}) is not a multiple of "
                        "linear_num_key_heads ({k_heads})",
                        v_heads=linear.num_v_heads,
                        k_heads=linear.num_k_heads,
                    )
                )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2:
            raise CheckpointError(
                Text(
                    "partial_rotary_factor {factor} must turn an even number of each head's "
                    "{head_dim} dimensions, and at least 2",
                    factor=self.partial_rotary_factor,
                    head_dim=self.head_dim,
                )
            )

    # derived geometry -------------------------------------------------------------------------

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as the engine holds it by default (--moe-expert-dtype
        auto): FP8 values and their block factors for an FP8 checkpoint, else its dtype's."""
        return self.expert_bytes_as(self.expert_format())

    @property
    def mixed_experts_kept(self) -> tuple[str, str]:
        """How `auto` holds a ModelOpt MIXED_PRECISION checkpoint's experts, and why."""
        return modelopt.experts_kept(
            self.layer_algorithms, self.moe_intermediate_size, self.text_prefix + "layers."
        )

    @property
    def modelopt_scheme(self) -> str:
        """A ModelOpt checkpoint's `quant_algo` under which each module's algorithm is read."""
        return modelopt.scheme(self.layer_algorithms)

    def expert_format(self, requested: str = "auto") -> str:
        """How the bank and the expert slots hold the routed experts (`EXPERT_FORMATS`): as
        `requested` (--moe-expert-dtype), or where "auto" as the checkpoint stores them."""
        fmt = requested
        if requested == "auto" and self.quantization == "mixed":
            fmt = self.mixed_experts_kept[0]
        elif requested == "auto":
            fmt = self.quantization if self.quantization in EXPERT_FORMATS else "bf16"
        h, i = self.hidden_size, self.moe_intermediate_size
        block = {"mxfp4": MXFP4_BLOCK, "nvfp4": NVFP4_BLOCK}.get(fmt)
        if block and (h % block or i % block):
            raise CheckpointError(
                f"--moe-expert-dtype {fmt} blocks {block} values along hidden_size ({h}) and "
                f"moe_intermediate_size ({i}), which must both be multiples of {block}: use "
                "--moe-expert-dtype fp8 or bf16 for this model"
            )
        return fmt

    def expert_bytes_as(self, fmt: str, elem_bytes: int | None = None) -> int:
        """Bytes of one routed expert held as `fmt`: FP8 values and their fp32 block factors
        (w13's [⌈2I/128⌉, ⌈H/128⌉] and w2's [⌈H/128⌉, ⌈I/128⌉]), MXFP4 half a byte a weight and
        a scale byte per 32 (4.25 bits a weight), NVFP4 half a byte a weight, a scale byte per 16
        and an fp32 scale per projection (4.5 bits a weight), else `elem_bytes` a weight (the
        checkpoint's dtype where not given); gpt_oss's fp32 biases with any."""
        h, i = self.hidden_size, self.moe_intermediate_size
        # gpt_oss's biases beside the weights, fp32 (engine/experts/bank.py)
        biases = 4 * (2 * i + h) if self.expert_bias else 0
        if fmt == "fp8":
            factors = blocks(2 * i) * blocks(h) + blocks(h) * blocks(i)
            return self.expert_params + 4 * factors + biases
        if fmt == "mxfp4":
            return self.expert_params // 2 + self.expert_params // MXFP4_BLOCK + biases
        if fmt == "nvfp4":
            scales = self.expert_params // NVFP4_BLOCK + 4 * NVFP4_TENSOR_SCALES
            return self.expert_params // 2 + scales + biases
        return self.expert_params * (elem_bytes or self.dtype_bytes) + biases

    @property
    def experts_total(self) -> int:
        """Routed experts over all MoE layers (the size of the host bank, in experts)."""
        return self.num_moe_layers * self.num_experts

    @property
    def expert_pool_bytes(self) -> int:
        return self.experts_total * self.expert_bytes

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with full attention: those that keep a KV cache."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def paged_layers(self) -> tuple[int, ...]:
        """The full-attention layers that keep pages for the whole context (the paged KV cache,
        kv.py): all but the sliding-window ones, which keep their window's (window.py)."""
        return tuple(i for i in self.attention_layers if i not in self.sliding_layers)

    def window_ring_tokens(self, block_size: int) -> int:
        """Tokens a sequence keeps per sliding-window layer: the window in whole pages of
        `block_size` (window.py); 0 without sliding layers."""
        return -(-self.sliding_window // block_size) * block_size if self.sliding_layers else 0

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers: those that keep a recurrent state per sequence."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def hybrid(self) -> bool:
        """Whether some layers keep a recurrent state (which a prefix cannot be cut from)."""
        return bool(self.linear_layers)

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that rotary turns (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token: keys and values of the paged attention layers."""
        return 2 * len(self.paged_layers) * self.kv_size * self.dtype_bytes

    @property
    def conv_state_bytes_per_seq(self) -> int:
        """Convolution state of one sequence over all linear layers, in the model's dtype (which
        holds the convolution's inputs exactly: they are the projection's output)."""
        if self.linear_attention is None:
            return 0
        rows, channels = self.linear_attention.conv_state_shape()
        return len(self.linear_layers) * rows * channels * self.dtype_bytes

    @property
    def recurrent_state_bytes_per_seq(self) -> int:
        """DeltaNet state of one sequence over all linear layers, in fp32 (RECURRENT_STATE_BYTES:
        exact across any number of steps, as transformers and fla keep it)."""
        if self.linear_attention is None:
            return 0
        return (
            len(self.linear_layers)
            * math.prod(self.linear_attention.recurrent_state_shape())
            * RECURRENT_STATE_BYTES
        )

    @property
    def state_bytes_per_seq(self) -> int:
        """Fixed bytes one running sequence holds besides its KV pages: the convolution and
        DeltaNet states of every linear layer (0 for models without linear layers)."""
        return self.conv_state_bytes_per_seq + self.recurrent_state_bytes_per_seq

    @property
    def dense_params(self) -> int:
        """Parameters that stay on the device: everything but the routed experts."""
        h = self.hidden_size
        q_out = 2 * self.q_size if self.attn_output_gate else self.q_size
        attn = h * (q_out + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += q_out + 2 * self.kv_size
        if self.arch == "gpt_oss":
            attn += h * self.attention_bias + self.num_heads * self.attention_sinks
        if self.qk_norm == "head":
            attn += 2 * self.head_dim
        elif self.qk_norm == "full":
            attn += self.q_size + self.kv_size
        mixers = attn * len(self.attention_layers)
        if self.linear_attention is not None:
            la = self.linear_attention
            # in projections: q, k, v, z and the per-head a and b; out projection from v
            projections = h * (la.conv_dim + la.value_dim + 2 * la.num_v_heads) + la.value_dim * h
            mixers += (projections + la.params) * len(self.linear_layers)
        moe = (h + self.router_bias) * self.num_experts
        if self.shared_expert_intermediate_size:
            moe += 3 * h * self.shared_expert_intermediate_size + h
        dense_mlp = 3 * h * self.intermediate_size
        per_layer = mixers + 2 * h * self.num_layers
        mlps = moe * self.num_moe_layers + dense_mlp * (self.num_layers - self.num_moe_layers)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return per_layer + mlps + embed + h

    @property
    def dense_bytes(self) -> int:
        return self.dense_params * self.dtype_bytes

    def fp8_projections(self) -> list[tuple[int, int]]:
        """The shapes [N, K] of the dense projections `--dense-dtype fp8` holds in FP8, each
        once per layer that has it: an attention layer's stacked q, k, v (and output gate) and
        its o, a Gated DeltaNet layer's out projection (its in projection, whose small b and a
        rows break the 128-row blocks, stays in the compute dtype), a shared expert's stacked
        gate and up and its down, a dense MLP's."""
        h = self.hidden_size
        q_out = 2 * self.q_size if self.attn_output_gate else self.q_size
        shapes = [(q_out + 2 * self.kv_size, h), (h, self.q_size)] * len(self.attention_layers)
        if self.linear_attention is not None:
            shapes += [(h, self.linear_attention.value_dim)] * len(self.linear_layers)
        if self.shared_expert_intermediate_size:
            si = self.shared_expert_intermediate_size
            shapes += [(2 * si, h), (h, si)] * self.num_moe_layers
        mlp = self.intermediate_size
        shapes += [(2 * mlp, h), (h, mlp)] * (self.num_layers - self.num_moe_layers)
        return shapes

    def dense_bytes_at(self, elem_bytes: int, dense_dtype: str = "auto") -> int:
        """The dense weights' bytes at `elem_bytes` a weight, with the FP8 projections (one
        byte a weight and an fp32 factor per 128x128 block) where `dense_dtype` is "fp8"."""
        total = self.dense_params * elem_bytes
        if dense_dtype != "fp8":
            return total
        for n, k in self.fp8_projections():
            factors = -(-n // 128) * -(-k // 128)
            total -= n * k * (elem_bytes - 1) - 4 * factors
        return total

    @property
    def active_bytes_per_token(self) -> int:
        """Weight bytes one decode token reads: the dense weights (less the embedding table) and
        top-k experts per MoE layer."""
        embed_unused = self.vocab_size * self.hidden_size * self.dtype_bytes
        if self.tie_word_embeddings:
            embed_unused = 0
        return (
            self.dense_bytes - embed_unused + self.num_moe_layers * self.top_k * self.expert_bytes
        )

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def moe_index(self, layer: int) -> int:
        """Position of an MoE layer among the MoE layers (the bank and the cache count this way)."""
        return self.moe_layers.index(layer)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}

    # construction ------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> ModelSpec:
        """Normalize a Hugging Face config.json of a supported architecture.

        Every field is checked for its type and range; an error names the field and `source`
        (the file the config came from)."""
        if not isinstance(config, dict):
            raise CheckpointError(
                Text(
                    "{source} holds {kind}, not a JSON object",
                    source=source,
                    kind=type(config).__name__,
                )
            )
        config, text_prefix = _text_config(config)
        arch = _ARCH_BY_TYPE.get(config.get("model_type"), config.get("model_type"))
        if arch not in ARCHITECTURES:
            for name in config.get("architectures") or ():
                arch = _ARCH_BY_CLASS.get(name, arch)
        if arch not in ARCHITECTURES:
            found = config.get("model_type") or config.get("architectures")
            raise CheckpointError(
                Text(
                    "architecture {found} is not supported; moelab serves {architectures} "
                    "({source} model_type)",
                    found=repr(found),
                    architectures=", ".join(ARCHITECTURES),
                    source=source,
                )
            )
        quantization = (
            "mxfp4" if arch == "gpt_oss" and _is_mxfp4(config) else _quantization(config, source)
        )
        read = _Fields(config, source, arch)

        hidden = read.whole("hidden_size")
        heads = read.whole("num_attention_heads")
        layers = read.whole("num_hidden_layers")
        kv_heads = read.whole("num_key_value_heads", default=heads)
        head_dim = read.whole("head_dim", default=hidden // heads)
        num_experts = read.whole("num_experts", "num_local_experts")
        top_k = read.whole("num_experts_per_tok")
        intermediate = read.whole("intermediate_size", default=0, minimum=0)
        max_position = read.whole("max_position_embeddings", default=4096)

        if arch in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
            moe_inter = read.whole("moe_intermediate_size")
            step = read.whole("decoder_sparse_step", default=1)
            only = set(read.indices("mlp_only_layers"))
            moe_layers = tuple(
                i
                for i in range(layers)
                if i not in only and num_experts > 0 and (i + 1) % step == 0
            )
            if len(moe_layers) < layers and intermediate < 1:
                raise CheckpointError(
                    Text("{source} has dense MLP layers but no intermediate_size", source=source)
                )
            norm_topk = bool(config.get("norm_topk_prob", arch != "qwen2_moe"))
        elif arch == "qwen3_5_moe":  # every layer MoE, the top-k weights renormalized
            moe_inter = read.whole("moe_intermediate_size")
            moe_layers = tuple(range(layers))
            norm_topk = True
        else:
            moe_inter = read.whole("intermediate_size")
            moe_layers = tuple(range(layers))
            # gpt_oss's softmax over the top-k logits is the renormalized top-k of the softmax
            norm_topk = arch in ("mixtral", "gpt_oss") or bool(config.get("norm_topk_prob", False))

        sliding = read.whole("sliding_window", default=0, minimum=0) if arch == "mixtral" else 0
        if arch == "gpt_oss":
            own = gpt_oss_fields(config, read, layers)
        elif config.get("use_sliding_window") or 0 < sliding < max_position:
            raise CheckpointError(
                Text(
                    "sliding-window attention is not supported; this checkpoint's {source} "
                    "enables it",
                    source=source,
                )
            )

        rope = read.mapping("rope_parameters") or {}
        rope_theta = read.real("rope_theta", default=rope.get("rope_theta") or 10000.0)
        scaling = read.mapping("rope_scaling") or (
            {k: v for k, v in rope.items() if k != "rope_theta"} if rope else None
        )
        if scaling:
            kind = scaling.get("rope_type") or scaling.get("type") or "default"
            if kind not in ROPE_SCALINGS:
                raise CheckpointError(
                    Text(
                        "rope scaling {kind} is not supported; moelab supports {supported}",
                        kind=repr(kind),
                        supported=", ".join(ROPE_SCALINGS),
                    )
                )
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}

        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        vocab = read.whole("vocab_size")
        eos = config.get("eos_token_id")
        eos_ids = read.indices("eos_token_id") if isinstance(eos, list) else ()
        if eos is not None and not isinstance(eos, list):
            eos_ids = (read.whole("eos_token_id", minimum=0),)
        eos_ids = tuple(i for i in eos_ids if 0 <= i < vocab)
        qk_norm = {"qwen3_moe": "head", "olmoe": "full"}.get(arch, "none")
        hybrid = arch in HYBRID_ARCHITECTURES
        if hybrid:
            qk_norm = "head"
        layer_types, linear = _linear_attention(read, layers) if hybrid else ((), None)
        # transformers' default for these architectures where the config gives none
        rotary = rope.get("partial_rotary_factor") or 0.25
        rotary = read.real("partial_rotary_factor", default=rotary) if hybrid else 1.0
        attention_bias = bool(
            config.get("qkv_bias", True)
            if arch == "qwen2_moe"
            else config.get("attention_bias", arch == "gpt_oss")
        )

        return cls(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=moe_inter,
            intermediate_size=intermediate,
            norm_topk_prob=norm_topk,
            rms_norm_eps=read.real("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=max_position,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=qk_norm,
            clip_qkv=read.real("clip_qkv", default=None) if arch == "olmoe" else None,
            shared_expert_intermediate_size=(
                read.whole("shared_expert_intermediate_size")
                if arch in ("qwen2_moe", *HYBRID_ARCHITECTURES)
                else 0
            ),
            moe_layers=moe_layers,
            rope_scaling=scaling,
            dtype=dtype,
            bos_token_id=read.whole("bos_token_id", default=None, minimum=0),
            eos_token_ids=eos_ids,
            quantization=quantization,
            layer_algorithms=modelopt.layer_algorithms(config["quantization_config"])
            if quantization == "mixed"
            else {},
            kv_cache_quant_algo=str(
                (config.get("quantization_config") or {}).get("kv_cache_quant_algo") or ""
            )
            if quantization in ("mixed", "nvfp4")
            else "",
            layer_types=layer_types,
            linear_attention=linear,
            partial_rotary_factor=rotary,
            attn_output_gate=hybrid,
            zero_centered_norm=hybrid,
            text_prefix=text_prefix,
            **(own if arch == "gpt_oss" else {}),
            extra={"moelab_synth": config.get("moelab_synth")}
            if config.get("moelab_synth")
            else {},
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        """Read `config.json` from a checkpoint directory."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise CheckpointError(
                Text("{path} has no config.json; is it a Hugging Face checkpoint?", path=str(path))
            )
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(
                Text(
                    "{path} cannot be read as JSON: {error}", path=str(config_path), error=str(err)
                )
            ) from None
        return cls.from_config(modelopt.config_of(Path(path), config), str(config_path))


def _text_config(config: dict) -> tuple[dict, str]:
    """The decoder's config and where its weights lie: a multimodal Qwen3.5/3.6 MoE config keeps
    the decoder's fields in `text_config` (the rest, such as quantization_config, at the top)."""
    text = config.get("text_config")
    multimodal = config.get(
        "model_type"
    ) == "qwen3_5_moe" or "Qwen3_5MoeForConditionalGeneration" in (
        config.get("architectures") or ()
    )
    if not multimodal or not isinstance(text, dict):
        return config, TEXT_PREFIX
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    return {**outer, **text, "model_type": "qwen3_5_moe"}, MULTIMODAL_TEXT_PREFIX


def _linear_attention(read: _Fields, layers: int) -> tuple[tuple[str, ...], LinearAttention]:
    """The layer kinds (config's layer_types, or every `full_attention_interval`-th layer full
    attention, the others linear) and the linear layers' geometry, with transformers' defaults."""
    given = read.config.get("layer_types")
    if given is not None:
        kinds = (FULL_ATTENTION, LINEAR_ATTENTION)
        if (
            not isinstance(given, list)
            or len(given) != layers
            or any(kind not in kinds for kind in given)
        ):
            raise read._say(
                "layer_types",
                Text(
                    "a list of {layers} layer kinds ({kinds})",
                    layers=layers,
                    kinds=", ".join(kinds),
                ),
                given,
            )
        layer_types = tuple(given)
    else:
        interval = read.whole("full_attention_interval", default=4)
        layer_types = tuple(
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
        )
    linear = LinearAttention(
        num_k_heads=read.whole("linear_num_key_heads", default=16),
        num_v_heads=read.whole("linear_num_value_heads", default=32),
        head_k_dim=read.whole("linear_key_head_dim", default=128),
        head_v_dim=read.whole("linear_value_head_dim", default=128),
        conv_kernel=read.whole("linear_conv_kernel_dim", default=4),
    )
    return layer_types, linear


def unread_weights_problem(spec: ModelSpec, unread: dict[str, str]) -> Text | None:
    """Why the engine refuses weights of the dtypes in `unread` (dtype -> a `.weight` tensor of
    it, those not in UNQUANTIZED_DTYPES), None where it reads them all: F8_E4M3 only where
    config.json's quantization_config is fine-grained FP8, as Hugging Face's layout defines it,
    and U8 only where it is ModelOpt's NVFP4 (modelopt.py), both under its MIXED_PRECISION
    (which modules, checkpoint.py's SafetensorsSource checks by `quantized_layers`)."""
    packed = {"fp8": ("F8_E4M3",), "nvfp4": ("U8",), "mixed": ("F8_E4M3", "U8")}
    kept = packed.get(spec.quantization, ())
    unread = {dtype: name for dtype, name in unread.items() if dtype not in kept}
    if not unread:
        return None
    listed = ", ".join(f"{dtype} ({name})" for dtype, name in sorted(unread.items()))
    return Text(
        "weights of dtype {listed}: moelab reads {dtypes}, and F8_E4M3 weights where "
        "config.json's quantization_config is fine-grained FP8 (quant_method fp8, "
        "weight_block_size [128, 128])",
        listed=listed,
        dtypes=", ".join(UNQUANTIZED_DTYPES),
    )


def gpt_oss_fields(config: dict, read: _Fields, layers: int) -> dict:
    """gpt_oss's own fields of ModelSpec from its config.json: the sliding window and which
    layers use it (`layer_types`, transformers' default alternating from a sliding layer 0), the
    clamped SwiGLU's limit; sinks and the router's and experts' biases are always there."""
    window = read.whole("sliding_window", default=0, minimum=0)
    types = config.get("layer_types")
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise read._say("layer_types", Text("a list of {n} of {kinds}", n=layers,
                                             kinds=" / ".join(kinds)), types)  # fmt: skip
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    if read.real("swiglu_alpha", default=1.702) != 1.702:
        raise read._say("swiglu_alpha", Text("1.702 (gpt_oss's SwiGLU)"), config["swiglu_alpha"])
    return {
        "sliding_window": window if sliding else 0,
        "sliding_layers": sliding,
        "attention_sinks": True,
        "router_bias": True,
        "expert_bias": True,
        "swiglu_limit": read.real("swiglu_limit", default=7.0),
    }


def _is_mxfp4(config: dict) -> bool:
    quantized = config.get("quantization_config")
    return isinstance(quantized, dict) and quantized.get("quant_method") == "mxfp4"


def _quantization(config: dict, source: str) -> str:
    """ "fp8" for Hugging Face's fine-grained FP8 layout (e4m3, dynamic activations, 128x128
    blocks), "nvfp4" for ModelOpt's NVFP4, "mixed" for its MIXED_PRECISION of NVFP4 and FP8
    layers, "" for unquantized weights; any other scheme is refused, naming what was found."""
    quantized = config.get("quantization_config") or config.get("compression_config")
    if not quantized:
        return ""
    method = quantized.get("quant_method") if isinstance(quantized, dict) else None
    if method == "modelopt":
        problem = modelopt.problem(quantized, source)
        if problem is not None:
            raise CheckpointError(problem)
        mixed = quantized.get("quant_algo") in (modelopt.MIXED, modelopt.FP8)
        return "mixed" if mixed else "nvfp4"
    if method != "fp8":
        raise CheckpointError(
            Text(
                "the weights are quantized ({source} quantization_config, quant_method "
                "{method}); moelab reads bf16, fp16 and fp32 weights, fine-grained FP8 "
                "(quant_method fp8, weight_block_size [128, 128]) and NVFP4 (quant_method "
                "modelopt, quant_algo NVFP4 or MIXED_PRECISION): use one of those releases",
                source=source,
                method=repr(method),
            )
        )
    found = {
        "weight_block_size": quantized.get("weight_block_size"),
        "fmt": quantized.get("fmt", "e4m3"),
        "activation_scheme": quantized.get("activation_scheme", "dynamic"),
    }
    wanted = {
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
    }
    for name, value in found.items():
        if value != wanted[name]:
            layout = (
                Text("per-tensor or per-channel scales")
                if name == "weight_block_size" and value is None
                else json.dumps(value)
            )
            raise CheckpointError(
                Text(
                    "this FP8 layout is not supported ({source} quantization_config {name}: "
                    "{found}); moelab reads fine-grained FP8: fmt e4m3, activation_scheme "
                    "dynamic, weight_block_size [128, 128]",
                    source=source,
                    name=name,
                    found=layout,
                )
            )
    return "fp8"


class _Fields:
    """Typed reads of a config.json's fields; a wrong type or range names the field and file."""

    def __init__(self, config: dict, source: str, arch: str) -> None:
        self.config = config
        self.source = source
        self.arch = arch

    def _say(self, name: str, what: Text, value: object) -> CheckpointError:
        return CheckpointError(
            Text(
                "{source}: {name} must be {what}, not {value}",
                source=self.source,
                name=name,
                what=what,
                value=json.dumps(value),
            )
        )

    def whole(self, *names: str, default: Any = ..., minimum: int = 1) -> Any:
        """The first of `names` given, a whole number of at least `minimum` (8.0 passes as 8);
        `default` where none is given (without one, a missing field is an error)."""
        given = [name for name in names if self.config.get(name) is not None]
        if not given:
            if default is ...:
                raise CheckpointError(
                    Text(
                        "{source} has no {names} (needed for {arch})",
                        source=self.source,
                        names=" / ".join(names),
                        arch=self.arch,
                    )
                )
            return default
        name = given[0]
        value = self.config[name]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value != int(value)
        ):
            raise self._say(name, Text("a whole number"), value)
        if value < minimum:
            raise self._say(name, Text("at least {minimum}", minimum=minimum), value)
        return int(value)

    def real(self, name: str, default: float | None) -> Any:
        """A finite number above zero; `default` where the field is not given."""
        value = self.config.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._say(name, Text("a number"), value)
        if not math.isfinite(value) or value <= 0:
            raise self._say(name, Text("a number above zero"), value)
        return float(value)

    def indices(self, name: str) -> tuple[int, ...]:
        """A list of whole numbers from zero (layer numbers, token ids)."""
        value = self.config.get(name) or []
        if not isinstance(value, list):
            raise self._say(name, Text("a list"), value)
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise self._say(name, Text("a list of whole numbers from 0"), value)
        return tuple(value)

    def mapping(self, name: str) -> dict | None:
        value = self.config.get(name)
        if value is not None and not isinstance(value, dict):
            raise self._say(name, Text("a JSON object"), value)
        return value


def flash_chunks_fit(spec: ModelSpec, elem_bytes: int) -> bool:
    """Whether a prefill chunk's attention can take flash attention's lower-right causal mask
    with the key/value heads shared (engine/model/model.py `_sdpa`; gpt-oss's layers without a
    window, their sinks applied after it: gpt_oss.attention), where the device has it: fp16 or
    bf16 compute and a head size flash attention takes (a multiple of 8, at most 256)."""
    d = spec.head_dim
    return elem_bytes == 2 and d % 8 == 0 and d <= 256
