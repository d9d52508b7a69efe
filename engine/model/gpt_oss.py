"""gpt-oss as transformers implements it (GptOssForCausalLM): its checkpoint layout and the parts
of its forward pass that no other architecture has.

- Attention: q/k/v/o projections with biases; a learned logit per head (its "sink") joins each
  query's softmax denominator and takes a share of the weight that no value receives; the layers
  in `ModelSpec.sliding_layers` see only the last `sliding_window` positions (themselves
  included).
- Router: a linear layer with a bias, top-k of its logits, softmax over those k (the same as the
  renormalized top-k of the full softmax, which kernels/router.py computes).
- Experts: gate/up and down projections with biases, stored fused with gate and up interleaved
  (`gate_up_proj [E, H, 2I]`, columns gate0, up0, gate1, ...), and the clamped SwiGLU
  (kernels/swiglu.py). The bank holds them as every other architecture's: w13 [2I, H] gate rows
  then up rows, w2 [H, I], the biases beside them in the same order.
- Weights in bf16 as `save_pretrained` writes them, or OpenAI's release: experts in MXFP4
  (`gate_up_proj_blocks [E, 2I, H/32, 16]` uint8, two e2m1 values a byte, and
  `gate_up_proj_scales [E, 2I, H/32]`, a power-of-two exponent biased by 127 per 32 values;
  kernels/mxfp4.py), which the bank keeps as they are (gate and up rows reordered) or widens, as
  --moe-expert-dtype says (engine/experts/bank.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ...kernels import mxfp4
from .spec import ModelSpec

# one expert in the bank's layout: w13 [2I, H] (gate rows, then up rows), w2 [H, I], their MXFP4
# scales (None for bf16 weights; then w13 and w2 are blocks [2I, H/32, 16] and [H, I/32, 16]),
# and their biases [2I] and [H]
ExpertTensors = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor
]


def experts_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts."


def expert_names(has: Callable[[str], bool], layer: int) -> list[str]:
    """The tensor names that hold a layer's experts, MXFP4 or not."""
    p = experts_prefix(layer)
    if has(p + "gate_up_proj_blocks"):
        projections = [p + f"{w}_{part}" for w in ("gate_up_proj", "down_proj")
                       for part in ("blocks", "scales")]  # fmt: skip
    else:
        projections = [p + "gate_up_proj", p + "down_proj"]
    return [*projections, p + "gate_up_proj_bias", p + "down_proj_bias"]


def iter_experts(
    spec: ModelSpec,
    has: Callable[[str], bool],
    need: Callable[[str, tuple[int, ...]], torch.Tensor],
    layer: int,
) -> Iterator[ExpertTensors]:
    """A layer's experts one by one in the bank's layout, MXFP4 as stored (blocks and scales, an
    expert at a time: a whole layer of gpt-oss-120b widened would take 8.5 GB in fp32);
    `need(name, shape)` reads a tensor after checking its shape."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    p = experts_prefix(layer)
    b13 = _gate_then_up(need(p + "gate_up_proj_bias", (e, 2 * i)), 1)
    b2 = need(p + "down_proj_bias", (e, h))
    if has(p + "gate_up_proj_blocks"):
        blocks13 = need(p + "gate_up_proj_blocks", (e, 2 * i, h // mxfp4.BLOCK, 16))
        scales13 = need(p + "gate_up_proj_scales", (e, 2 * i, h // mxfp4.BLOCK))
        blocks2 = need(p + "down_proj_blocks", (e, h, i // mxfp4.BLOCK, 16))
        scales2 = need(p + "down_proj_scales", (e, h, i // mxfp4.BLOCK))
        for x in range(e):
            w13, s13 = _gate_then_up(blocks13[x], 0), _gate_then_up(scales13[x], 0)
            yield w13, blocks2[x], s13, scales2[x], b13[x], b2[x]
        return
    gate_up = need(p + "gate_up_proj", (e, h, 2 * i))
    down = need(p + "down_proj", (e, i, h))
    for x in range(e):
        yield _gate_then_up(gate_up[x].t(), 0), down[x].t(), None, None, b13[x], b2[x]


def _gate_then_up(interleaved: torch.Tensor, dim: int) -> torch.Tensor:
    """Along `dim`, gate0, up0, gate1, up1, ... reordered as all gate rows, then all up rows."""
    rows = torch.arange(interleaved.shape[dim], device=interleaved.device)
    return interleaved.index_select(dim, torch.cat([rows[0::2], rows[1::2]]))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
    window: int,
    first: int = 0,
    flash: bool = False,
) -> torch.Tensor:
    """Causal attention of q [n, Hq, D] (the last n positions) over k, v [L, Hkv, D], the keys
    of positions first..first+L-1, with a sink logit per head [Hq] in each softmax and, where
    window > 0, each position seeing only the last `window` positions.

    With `flash` (a CUDA device that runs flash attention on these heads:
    model.flash_chunk_attention), a layer without a window takes flash attention over the keys
    alone (`_flash_with_lse`: its lower-right causal mask, the key/value heads shared), and its
    sink afterwards (`with_sinks`): no mask and no copy of the keys, whose memory would grow with
    the context (engine/config/memory.py chunk_attention_bytes).

    Otherwise one fused attention call with a boolean mask [n, L'] shared by the heads: the
    sink is one more key, whose value is zero, and whose score is the head's sink through one
    more dimension (q's 1 times the key's sink / scale; the real keys' are 0), padded to 8 so
    that the fused backends take the head size. A per-head float mask instead would hold
    Hq · n · L values (17 GB at gpt-oss's 64 heads, a chunk of 2,048 and 32K of context). The
    keys before the window of the chunk's first position are left out.

    A sink of -inf (a head without one) goes in as a quarter of the dtype's lowest value, whose
    weight rounds to 0 as -inf's is 0, where an infinite key would make every score NaN in
    fused fp32 kernels that split each operand x into tf32(x) and tf32(x - tf32(x)) (inf - inf:
    PyTorch's memory-efficient attention on compute capability 8.0 and up)."""
    if flash and not window:
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out, lse = _flash_with_lse(qt, kt, vt, scale)
        return with_sinks(out, lse, sinks).squeeze(0).transpose(0, 1)
    n, heads, dim = q.shape[0], q.shape[1], q.shape[2]
    length = first + k.shape[0]
    skip = max(0, length - n - window + 1 - first) if window else 0
    k, v = k[skip:], v[skip:]
    rows = torch.arange(length - n, length, device=q.device)[:, None]
    cols = torch.arange(first + skip, length, device=q.device)[None, :]
    visible = cols <= rows
    if window:
        visible &= cols > rows - window
    mask = torch.cat([visible, visible.new_ones(n, 1)], dim=1)
    groups = heads // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    q = F.pad(q, (0, _SINK_DIMS))
    q[..., dim] = 1.0
    sink_key = q.new_zeros(1, heads, dim + _SINK_DIMS)
    lowest = torch.finfo(q.dtype).min / 4
    sink_key[0, :, dim] = (sinks.to(q.dtype) / scale).clamp(min=lowest)
    k = torch.cat([F.pad(k, (0, _SINK_DIMS)), sink_key])
    v = F.pad(torch.cat([v, v.new_zeros(1, heads, dim)]), (0, _SINK_DIMS))
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)[..., :dim]


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention of q [1, Hq, n, D] over k, v [1, Hkv, L, D] (Hkv dividing Hq), the
    causal mask aligned to the last keys (the queries are the last n positions), and the
    log-sum-exp of each query's scaled scores [1, Hq, n] in fp32. torch's flash op, as torch's
    own lower-right causal bias calls it (torch/nn/attention/bias.py): `is_causal` means the
    lower-right mask there."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )[:2]
    return out, lse


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention over the keys alone (out [.., Hq, n, D], its log-sum-exp lse [.., Hq, n]) as
    with each head's sink logit [Hq] in the softmax's denominator: the sink takes weight
    exp(sink) and gives no value, so each output is the keys' alone times their share of the
    denominator, exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), in fp32 (a sink of
    -inf: a share of 1)."""
    share = torch.sigmoid(lse.float() - sinks.float()[:, None])
    return (out.float() * share[..., None]).to(out.dtype)


# the sink's dimension in `attention`, padded: fused attention takes head sizes in multiples of 8
_SINK_DIMS = 8


# synthetic checkpoints (engine/model/synth.py) ------------------------------------------------

# the exact geometries of openai/gpt-oss-20b and -120b (config.json), by synth's preset names
PRESETS: dict[str, dict] = {
    name: dict(
        vocab_size=201088,
        hidden_size=2880,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_experts=experts,
        num_experts_per_tok=4,
        moe_intermediate_size=2880,
        intermediate_size=2880,
        shared_expert_intermediate_size=0,
        max_position_embeddings=131072,
        rope_theta=150000.0,
        rms_norm_eps=1e-5,
    )
    for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))
}


def synth_config(g: dict) -> dict:
    """gpt_oss's own config.json fields for a synthetic checkpoint of geometry `g` (synth's
    preset names): gpt-oss's window, alternating layers from a sliding one, its yarn scaling and
    SwiGLU limit."""
    layers = g["num_hidden_layers"]
    return dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        num_local_experts=g["num_experts"],
        intermediate_size=g["moe_intermediate_size"],
        sliding_window=g.get("sliding_window", 128),
        layer_types=[["sliding_attention", "full_attention"][i % 2] for i in range(layers)],
        attention_bias=True,
        swiglu_limit=g.get("swiglu_limit", 7.0),
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a gpt_oss checkpoint in transformers' layout, by name, with its shape."""
    h, q, kv, e, i = (spec.hidden_size, spec.q_size, spec.kv_size, spec.num_experts,
                      spec.moe_intermediate_size)  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for layer in range(spec.num_layers):
        p, x = f"model.layers.{layer}.", experts_prefix(layer)
        a = p + "self_attn."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            a + "q_proj.weight": (q, h), a + "q_proj.bias": (q,),
            a + "k_proj.weight": (kv, h), a + "k_proj.bias": (kv,),
            a + "v_proj.weight": (kv, h), a + "v_proj.bias": (kv,),
            a + "o_proj.weight": (h, q), a + "o_proj.bias": (h,), a + "sinks": (spec.num_heads,),
            p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
            x + "gate_up_proj": (e, h, 2 * i), x + "gate_up_proj_bias": (e, 2 * i),
            x + "down_proj": (e, i, h), x + "down_proj_bias": (e, h),
        })  # fmt: skip
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


# the modules an MXFP4 gpt-oss checkpoint keeps in bf16 (its quantization_config's
# modules_to_not_convert, as OpenAI's release names them): all but the experts
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]  # fmt: skip


def mxfp4_shapes(
    shapes: dict[str, tuple[int, ...]],
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, tuple[int, ...]]]]:
    """`tensor_shapes` as an MXFP4 gpt-oss checkpoint holds them: each expert projection ([E,
    in, out] in transformers' layout) as the `_blocks` [E, out, in/32, 16] and `_scales` [E, out,
    in/32] of the [E, out, in] weight, in its place; and each of those names' projection and its
    unquantized shape."""
    out: dict[str, tuple[int, ...]] = {}
    parts: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = shape
            continue
        experts, fan_in, fan_out = shape
        groups = fan_in // mxfp4.BLOCK
        out[name + "_blocks"] = (experts, fan_out, groups, mxfp4.BLOCK // 2)
        out[name + "_scales"] = (experts, fan_out, groups)
        parts[name + "_blocks"] = parts[name + "_scales"] = (name, shape)
    return out, parts
