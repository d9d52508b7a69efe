"""Reading safetensors checkpoints: dense tensors to the compute device, experts one at a time.

Checkpoints store experts either one tensor per expert (`experts.N.gate_proj`, Mixtral's `w1/w2/w3`)
or fused (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`); both are read here.

A weight stored as FP8 (float8_e4m3fn, Hugging Face's fine-grained layout: kernels/fp8.py) comes
with its fp32 block factors, `<name>_scale_inv`. Dense weights are widened to the compute dtype as
they load (their share of an MoE's bytes is small: docs/models.md); experts are handed on as
stored, values and factors, and the bank keeps or converts them. An NVFP4 weight (ModelOpt's
layout: modelopt.py) is read as its fp32 values where it is a dense one, and as stored (values,
block scales, per-tensor scale) where it is an expert's, stored one tensor per expert. Under
ModelOpt's MIXED_PRECISION each weight is checked against its module's algorithm in
`quantized_layers` as the checkpoint opens (under its plain FP8, against the config's rule:
every Linear not excluded); a per-tensor FP8 weight is read as its fp32 values
where it is a dense one, and as stored, its scale as every 128x128 block's factor, where it is an
expert's and the bank keeps it exactly (modelopt.experts_kept).
"""

from __future__ import annotations

import functools
import json
import logging
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from safetensors import safe_open

from ...kernels import fp8, nvfp4
from ..text import Text
from . import gpt_oss, modelopt
from .hybrid import gated_q_proj, linear_layer_weights
from .model import DenseWeights, LayerWeights
from .spec import (
    FP8_BLOCK,
    LINEAR_ATTENTION,
    SAFETENSORS_DTYPES,
    UNQUANTIZED_DTYPES,
    CheckpointError,
    ModelSpec,
    blocks,
    unread_weights_problem,
)

log = logging.getLogger("moelab.engine")

# weights of a checkpoint the engine does not load: a multimodal model's vision encoder, and the
# multi-token-prediction head of Qwen3-Next and Qwen3.5/3.6 MoE
SKIPPED_PARTS = {"model.visual.": "the vision encoder", "mtp.": "the multi-token-prediction head"}


class TensorSource(Protocol):
    """Named tensors of a checkpoint (or of a synthetic model)."""

    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> torch.Tensor: ...


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 1024 * 1024:
            raise CheckpointError(f"{path} is not a safetensors file (header of {size} bytes)")
        try:
            return json.loads(f.read(size))
        except ValueError:
            raise CheckpointError(f"{path} is not a safetensors file (bad header)") from None


class SafetensorsSource:
    """The tensors of a checkpoint directory: `model.safetensors`, or shards with an index;
    with `spec`, weights of a dtype the engine does not read under its config.json are refused
    as they are found (spec.unread_weights_problem, the catalog's reason too)."""

    def __init__(self, path: str | Path, spec: ModelSpec | None = None) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise CheckpointError(f"{index} is not a valid safetensors index: {err}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path} holds no *.safetensors files")
        self._where: dict[str, str] = {}
        self._meta: dict[str, dict] = {}
        for name in files:
            shard = self.path / name
            if not shard.is_file():
                raise CheckpointError(
                    f"shard {name} listed in the index is missing from {self.path}"
                )
            header = read_header(shard)
            for key, meta in header.items():
                if key != "__metadata__":
                    self._where[key] = name
                    self._meta[key] = meta
        self._handles: dict[str, object] = {}
        problem = unread_weights_problem(spec, self.unread_weights()) if spec else None
        if problem is None and spec is not None and spec.quantization == "mixed":
            problem = self._layers_problem(spec.layer_algorithms)
        if problem is not None:
            raise CheckpointError(problem)
        self._log_skipped()

    def _log_skipped(self) -> None:
        """One log line for the parts of the checkpoint the engine leaves unread."""
        counts = {
            part: sum(name.startswith(prefix) for name in self._meta)
            for prefix, part in SKIPPED_PARTS.items()
        }
        skipped = [f"{part} ({n} tensors)" for part, n in counts.items() if n]
        if skipped:
            log.info("not loaded: %s; the engine serves text only", ", ".join(skipped))

    def _layers_problem(self, layers: dict[str, str]) -> Text | None:
        """Why a `.weight` the engine reads is not stored as `quantized_layers`, or a plain FP8
        config, says (a Linear's weight is 2-D and no embedding)."""
        plain = modelopt.scheme(layers) == modelopt.FP8
        for name in sorted(self._meta):
            if name.endswith(".weight") and not name.startswith(tuple(SKIPPED_PARTS)):
                module = name.removesuffix(".weight")
                linear = len(self._meta[name].get("shape", ())) == 2
                linear = linear and not module.endswith("embed_tokens")
                algorithm = modelopt.algorithm_of(layers, module, linear)
                problem = modelopt.weight_problem(name, self._meta, algorithm, plain)
                if problem is not None:
                    return problem
        return None

    def unread_weights(self) -> dict[str, str]:
        """The weights of dtypes read only under a quantization_config, or not at all: dtype ->
        the first such `.weight` tensor (spec.unread_weights_problem says which are refused)."""
        unread: dict[str, str] = {}
        for name in sorted(self._meta):
            code = self._meta[name].get("dtype")
            if name.endswith(".weight") and code not in UNQUANTIZED_DTYPES:
                unread.setdefault(str(code), name)
        return unread

    @property
    def files(self) -> list[Path]:
        return [self.path / name for name in sorted(set(self._where.values()))]

    def dtype(self, name: str) -> str:
        code = self._meta[name]["dtype"]
        if code not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"tensor {name} has dtype {code}; moelab reads {', '.join(SAFETENSORS_DTYPES)}"
            )
        return SAFETENSORS_DTYPES[code]

    def has(self, name: str) -> bool:
        return name in self._where

    def _nvfp4(self, name: str) -> bool:
        return modelopt.is_packed(self._meta[name]["dtype"], self.has(name + modelopt.SCALE_2))

    def _fp8_per_tensor(self, name: str) -> bool:
        dtype = self._meta.get(name, {}).get("dtype")
        return modelopt.is_fp8_per_tensor(dtype, self._meta.get(name + modelopt.SCALE))

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape; an NVFP4 weight's is that of the values it holds."""
        shape = tuple(self._meta[name]["shape"])
        return modelopt.widened_shape(shape) if self._nvfp4(name) else shape

    def get(self, name: str) -> torch.Tensor:
        """A tensor as stored; an NVFP4 weight widened to fp32 by its two scales, a per-tensor
        FP8 one by its scale."""
        packed = self.nvfp4(name)
        if packed is not None:
            return nvfp4.dequantize(*packed)
        fp8_values = self.fp8_per_tensor(name)
        if fp8_values is not None:
            values, scale = fp8_values
            return values.float() * scale
        return self._read(name)

    def fp8_per_tensor(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A per-tensor FP8 weight (ModelOpt's) as stored: (values float8_e4m3fn, scale fp32
        of shape []); None for a weight of another format."""
        if not self._fp8_per_tensor(name):
            return None
        return self._read(name), self._read(name + modelopt.SCALE).float().reshape(())

    def nvfp4(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """An NVFP4 weight as stored: (values uint8, block scales float8_e4m3fn, per-tensor
        scale fp32 of shape []); None for a weight of another format."""
        if not self._nvfp4(name):
            return None
        scale = name + modelopt.SCALE
        meta = self._meta.get(scale, {})
        problem = modelopt.scale_problem(
            name,
            tuple(self._meta[name]["shape"]),
            tuple(meta.get("shape", ())),
            str(meta.get("dtype", "missing")),
        )
        if problem is not None:
            raise CheckpointError(problem)
        scale_2 = self._read(name + modelopt.SCALE_2).float().reshape(())
        return self._read(name), self._read(scale), scale_2

    def _read(self, name: str) -> torch.Tensor:
        self.dtype(name)
        shard = self._where[name]
        handle = self._handles.get(shard)
        if handle is None:
            handle = safe_open(str(self.path / shard), framework="pt")
            self._handles[shard] = handle
        return handle.get_tensor(name)


def _need(source: TensorSource, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    _check_shape(source, name, shape)
    return source.get(name)


def _check_shape(source: TensorSource, name: str, shape: tuple[int, ...]) -> None:
    if not source.has(name):
        raise CheckpointError(f"the checkpoint has no tensor {name}")
    found = tuple(source.shape(name))
    if found != shape:
        raise CheckpointError(f"tensor {name} has shape {list(found)}, expected {list(shape)}")


class Expert(NamedTuple):
    """One routed expert as stored: w13 [2I, H] (gate rows, then up rows) and w2 [H, I], and
    for FP8 their block factors [⌈2I/128⌉, ⌈H/128⌉] and [⌈H/128⌉, ⌈I/128⌉] (None otherwise);
    for MXFP4 (uint8) w13 and w2 are blocks [2I, H/32, 16] and [H, I/32, 16] and the scales
    their E8M0 codes [2I, H/32] and [H, I/32] (kernels/mxfp4.py); for NVFP4 (uint8 beside e4m3
    scales) w13 and w2 are values [2I, H/2] and [H, I/2], the scales e4m3 [2I, H/16] and
    [H, I/16], and w13_scale_2 [2] (gate's, up's) and w2_scale_2 [1] the per-tensor scales
    (kernels/nvfp4.py)."""

    index: int
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    # gpt_oss: the projections' biases [2I] (gate's, then up's) and [H]
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    # NVFP4: the per-tensor scales
    w13_scale_2: torch.Tensor | None = None
    w2_scale_2: torch.Tensor | None = None


def _scale_of(source: TensorSource, name: str, values: torch.Tensor) -> torch.Tensor | None:
    """The block factors of an FP8 weight (None for a weight stored unquantized); a missing
    factor tensor or one of another layout is refused, naming what was found."""
    if values.dtype != torch.float8_e4m3fn:
        return None
    scale_name = name + "_scale_inv"
    if not source.has(scale_name):
        raise CheckpointError(
            f"tensor {name} is FP8 but the checkpoint has no {scale_name} (its block factors)"
        )
    *lead, n, k = values.shape
    want = (*lead, blocks(n), blocks(k))
    found = tuple(source.shape(scale_name))
    if found != want:
        raise CheckpointError(
            f"{scale_name} has shape {list(found)}; moelab reads FP8 with one factor per "
            f"{FP8_BLOCK}x{FP8_BLOCK} block, shape {list(want)} for {name} {list(values.shape)} "
            "(per-tensor and per-channel factors are not supported)"
        )
    scale = source.get(scale_name)
    if scale.dtype != torch.float32:
        raise CheckpointError(f"{scale_name} has dtype {scale.dtype}; FP8 factors are float32")
    return scale


def _prefix(spec: ModelSpec, layer: int) -> str:
    return f"{spec.text_prefix}layers.{layer}."


def _mlp_prefix(spec: ModelSpec, layer: int, source: TensorSource) -> str:
    # Mixtral checkpoints name the MoE block `block_sparse_moe`; newer writers use `mlp`
    p = _prefix(spec, layer)
    if spec.arch == "mixtral" and source.has(p + "block_sparse_moe.gate.weight"):
        return p + "block_sparse_moe."
    return p + "mlp."


def load_dense(
    spec: ModelSpec,
    source: TensorSource,
    device: torch.device,
    dtype: torch.dtype,
    dense_dtype: str = "auto",
) -> DenseWeights:
    """Every non-expert tensor, checked against the spec's shapes, on `device` in `dtype`; with
    `dense_dtype` "fp8", the projections ModelSpec.fp8_projections names in FP8 (`hold_fp8`)."""
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size

    def get(name: str, *shape: int) -> torch.Tensor:
        t = _need(source, name, tuple(shape))
        scale = _scale_of(source, name, t)
        if scale is not None:
            t = fp8.dequantize(t, scale)
        return t.to(device=device, dtype=dtype)

    def norm(name: str, *shape: int) -> torch.Tensor:
        """An RMSNorm's weight as the norm kernels multiply by it: 1 + w where it is stored
        zero-centred."""
        if not spec.zero_centered_norm:
            return get(name, *shape)
        return (_need(source, name, tuple(shape)).float() + 1).to(device=device, dtype=dtype)

    text = spec.text_prefix
    embed = get(text + "embed_tokens.weight", spec.vocab_size, h)
    if spec.tie_word_embeddings or not source.has("lm_head.weight"):
        if not spec.tie_word_embeddings:
            raise CheckpointError("the checkpoint has no tensor lm_head.weight")
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", spec.vocab_size, h)
    weights = DenseWeights(embed=embed, lm_head=lm_head, final_norm=norm(text + "norm.weight", h))

    for layer in range(spec.num_layers):
        p = _prefix(spec, layer)
        attn = p + "self_attn."
        norms = {
            "input_norm": norm(p + "input_layernorm.weight", h),
            "post_norm": norm(p + "post_attention_layernorm.weight", h),
        }
        if spec.layer_types[layer] == LINEAR_ATTENTION:
            lw = LayerWeights(**norms, **linear_layer_weights(spec, get, p + "linear_attn."))
            _load_mlp(spec, source, get, layer, lw)
            if dense_dtype == "fp8":
                hold_fp8(lw, linear_layer=True)
            weights.layers.append(lw)
            continue
        if spec.attn_output_gate:  # the gate's rows after q, k and v (hybrid.py)
            q_rows, gate_rows = gated_q_proj(spec, get(attn + "q_proj.weight", 2 * q, h))
        else:
            q_rows, gate_rows = get(attn + "q_proj.weight", q, h), None
        qkv = torch.cat(
            [
                q_rows,
                get(attn + "k_proj.weight", kv, h),
                get(attn + "v_proj.weight", kv, h),
                *([] if gate_rows is None else [gate_rows]),
            ]
        )
        lw = LayerWeights(**norms, qkv=qkv, o=get(attn + "o_proj.weight", h, q))
        if spec.attention_bias:
            lw.qkv_bias = torch.cat(
                [
                    get(attn + "q_proj.bias", q),
                    get(attn + "k_proj.bias", kv),
                    get(attn + "v_proj.bias", kv),
                ]
            )
        if spec.qk_norm == "head":
            lw.q_norm = norm(attn + "q_norm.weight", spec.head_dim)
            lw.k_norm = norm(attn + "k_norm.weight", spec.head_dim)
        elif spec.qk_norm == "full":
            lw.q_norm = get(attn + "q_norm.weight", q)
            lw.k_norm = get(attn + "k_norm.weight", kv)
        if spec.arch == "gpt_oss":
            lw.o_bias = get(attn + "o_proj.bias", h)
            lw.sinks = get(attn + "sinks", spec.num_heads)
        _load_mlp(spec, source, get, layer, lw)
        if dense_dtype == "fp8":
            hold_fp8(lw, linear_layer=False)
        weights.layers.append(lw)
    return weights


# The projections `--dense-dtype fp8` holds in FP8 (ModelSpec.fp8_projections counts them), each
# beside its factors' field
_FP8_FIELDS = ("qkv", "o", "shared_gate_up", "shared_down", "mlp_gate_up", "mlp_down")


def hold_fp8(lw: LayerWeights, *, linear_layer: bool) -> None:
    """`lw`'s projections in FP8 with one fp32 factor per 128x128 block (`fp8.quantize`), each
    in place of its weight, its factors in the `_scale` field beside it; a Gated DeltaNet
    layer's in projection (`linear_layer`: its qkv) stays. An FP8 checkpoint's projections were
    dequantized as they loaded; quantized again, they keep their e4m3 values where the stacked
    pieces keep the checkpoint's 128-row blocks and its factors are each block's largest value
    over 448 (as Qwen's and DeepSeek's FP8 releases make them), else they are rounded again."""
    for name in _FP8_FIELDS:
        weight = getattr(lw, name)
        if weight is None or (linear_layer and name == "qkv"):
            continue
        bits, scale = fp8.quantize(weight)
        setattr(lw, name, bits)
        setattr(lw, name + "_scale", scale)


def _load_mlp(
    spec: ModelSpec, source: TensorSource, get: Callable, layer: int, lw: LayerWeights
) -> None:
    """A layer's router and shared expert (MoE layers) or its dense MLP, into `lw`."""
    h = spec.hidden_size
    m = _mlp_prefix(spec, layer, source)
    if spec.arch == "gpt_oss":
        lw.router = get(m + "router.weight", spec.num_experts, h)
        lw.router_bias = get(m + "router.bias", spec.num_experts)
    elif spec.is_moe_layer(layer):
        lw.router = get(m + "gate.weight", spec.num_experts, h)
        if spec.shared_expert_intermediate_size:
            si = spec.shared_expert_intermediate_size
            lw.shared_gate_up = torch.cat(
                [
                    get(m + "shared_expert.gate_proj.weight", si, h),
                    get(m + "shared_expert.up_proj.weight", si, h),
                ]
            )
            lw.shared_down = get(m + "shared_expert.down_proj.weight", h, si)
            lw.shared_gate = get(m + "shared_expert_gate.weight", 1, h)
    else:
        i = spec.intermediate_size
        lw.mlp_gate_up = torch.cat(
            [get(m + "gate_proj.weight", i, h), get(m + "up_proj.weight", i, h)]
        )
        lw.mlp_down = get(m + "down_proj.weight", h, i)


def expert_names(spec: ModelSpec, source: TensorSource, layer: int) -> list[str]:
    """The tensor names that hold a layer's routed experts (for loading progress and checks)."""
    if spec.arch == "gpt_oss":
        return gpt_oss.expert_names(source.has, layer)
    m = _mlp_prefix(spec, layer, source) + "experts."
    if source.has(m + "gate_up_proj"):
        return [m + "gate_up_proj", m + "down_proj"]
    if spec.arch == "mixtral" and source.has(m + "0.w1.weight"):
        return [f"{m}{e}.{w}.weight" for e in range(spec.num_experts) for w in ("w1", "w3", "w2")]
    return [
        f"{m}{e}.{w}.weight"
        for e in range(spec.num_experts)
        for w in ("gate_proj", "up_proj", "down_proj")
    ]


def iter_layer_experts(spec: ModelSpec, source: TensorSource, layer: int) -> Iterator[Expert]:
    """Each routed expert of a layer, as stored (FP8 with its factors, or unquantized).

    FP8 experts stored with separate gate and up tensors get w13's factors by stacking theirs
    where I is a multiple of 128; otherwise a block of w13 straddles gate and up rows, and the
    two are dequantized, stacked and quantized again (`fp8.quantize`), which rounds each value
    once more."""
    h, i, n = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    if spec.arch == "gpt_oss":
        need = functools.partial(_need, source)
        for e, tensors in enumerate(gpt_oss.iter_experts(spec, source.has, need, layer)):
            yield Expert(e, *tensors)
        return
    names = expert_names(spec, source, layer)
    if names[0].endswith("gate_up_proj"):
        if source.has(names[0]) and tuple(source.shape(names[0])) == (n, h, 2 * i) and h != 2 * i:
            gate_up = source.get(names[0])
            down = _need(source, names[1], (n, i, h))
            gate_up_scale, down_scale = (
                _transposed(_scale_of(source, names[0], gate_up)),
                _transposed(_scale_of(source, names[1], down)),
            )
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        else:
            gate_up = _need(source, names[0], (n, 2 * i, h))
            down = _need(source, names[1], (n, h, i))
            gate_up_scale = _scale_of(source, names[0], gate_up)
            down_scale = _scale_of(source, names[1], down)
        if gate_up_scale is None and down_scale is None:
            for e in range(n):
                yield Expert(e, gate_up[e], down[e])
            return
        if gate_up_scale is None or down_scale is None:
            raise _mixed(layer, "gate_up_proj and down_proj")
        for e in range(n):
            yield Expert(e, gate_up[e], down[e], gate_up_scale[e], down_scale[e])
        return
    for e in range(n):
        gate_name, up_name, down_name = names[3 * e : 3 * e + 3]
        packed = _nvfp4_expert(source, e, gate_name, up_name, down_name, (i, h))
        if packed is None and i % FP8_BLOCK == 0:
            packed = _fp8_tensor_expert(source, e, gate_name, up_name, down_name, (i, h))
        if packed is not None:
            yield packed
            continue
        gate = _need(source, gate_name, (i, h))
        up = _need(source, up_name, (i, h))
        down = _need(source, down_name, (h, i))
        gate_scale = _scale_of(source, gate_name, gate)
        up_scale = _scale_of(source, up_name, up)
        down_scale = _scale_of(source, down_name, down)
        if gate_scale is None or up_scale is None or down_scale is None:
            if gate.dtype == up.dtype == down.dtype != torch.float8_e4m3fn:
                yield Expert(e, torch.cat([gate, up]), down)
                continue
            raise _mixed(layer, f"expert {e}")
        if i % FP8_BLOCK == 0:
            yield Expert(
                e, torch.cat([gate, up]), down, torch.cat([gate_scale, up_scale]), down_scale
            )
            continue
        stacked = torch.cat([fp8.dequantize(gate, gate_scale), fp8.dequantize(up, up_scale)])
        w13, w13_scale = fp8.quantize(stacked)
        yield Expert(e, w13, down, w13_scale, down_scale)


def _nvfp4_expert(
    source: TensorSource, index: int, gate: str, up: str, down: str, shape: tuple[int, int]
) -> Expert | None:
    """An expert whose three projections are NVFP4, as stored (None where any is not, or the
    source reads no NVFP4 as stored)."""
    if not isinstance(source, SafetensorsSource):
        return None
    if not all(source.has(name) and source._nvfp4(name) for name in (gate, up, down)):
        return None
    i, h = shape
    for name, want in ((gate, (i, h)), (up, (i, h)), (down, (h, i))):
        _check_shape(source, name, want)
    (g, gs, gt), (u, us, ut), (d, ds, dt) = (source.nvfp4(name) for name in (gate, up, down))
    return Expert(
        index,
        torch.cat([g, u]),
        d,
        torch.cat([gs, us]),
        ds,
        w13_scale_2=torch.stack([gt, ut]),
        w2_scale_2=dt.reshape(1),
    )


def _fp8_tensor_expert(
    source: TensorSource, index: int, gate: str, up: str, down: str, shape: tuple[int, int]
) -> Expert | None:
    """An expert whose three projections are per-tensor FP8, as stored, each scale the factor
    of all its projection's 128x128 blocks (None where any is not); gate's and up's stack into
    w13's only where I is a multiple of 128, which the caller checks."""
    if not isinstance(source, SafetensorsSource):
        return None
    if not all(source.has(name) and source._fp8_per_tensor(name) for name in (gate, up, down)):
        return None
    i, h = shape
    for name, want in ((gate, (i, h)), (up, (i, h)), (down, (h, i))):
        _check_shape(source, name, want)
    (g, gs), (u, us), (d, ds) = (source.fp8_per_tensor(name) for name in (gate, up, down))

    def factors(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return scale.expand(blocks(values.shape[0]), blocks(values.shape[1])).contiguous()

    w13_scale = torch.cat([factors(g, gs), factors(u, us)])
    return Expert(index, torch.cat([g, u]), d, w13_scale, factors(d, ds))


def _mixed(layer: int, which: str) -> CheckpointError:
    return CheckpointError(
        f"layer {layer} mixes FP8 and unquantized expert projections ({which}); moelab reads "
        "the experts' projections in one format"
    )


def _transposed(scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if scale is None else scale.transpose(-1, -2)
