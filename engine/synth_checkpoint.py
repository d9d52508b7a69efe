"""`moelab synth`: write a synthetic checkpoint directory in Hugging Face layout."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..kernels import fp8, nvfp4
from .config.args import default_cpu_threads
from .model import gpt_oss
from .model.spec import FP8_BLOCK, ModelSpec
from .model.synth import SynthSource, make_config, preset_arch, router_name
from .model.synth_hybrid import (
    VISION_TOKENS,
    VisionTower,
    hybrid_not_converted,
    set_vision_token_ids,
)
from .model.synth_tokenizer import chat_template_for, write_tokenizer_files

log = logging.getLogger("moelab.synth")

# models up to this size calibrate their routing skew with forward passes on the CPU
CALIBRATE_MAX_BYTES = 6 * 1024**3
# mxfp4: gpt_oss's experts as OpenAI's release stores them; nvfp4: NVIDIA's ModelOpt layout
DTYPES = ("bf16", "fp8", "mxfp4", "nvfp4")


def synthesize(
    out: str | Path,
    *,
    arch: str | None = None,
    preset: str = "tiny",
    overrides: dict | None = None,
    seed: int = 0,
    routing_skew: float = 0.0,
    shard_bytes: int = 2 * 1024**3,
    chat_template: str | None = None,
    weights: bool = True,
    dtype: str = "bf16",
) -> Path:
    """Write config, tokenizer (with the chat template of that name: synth_tokenizer's
    CHAT_TEMPLATES, by default the architecture's), generation config and safetensors weights
    into `out` (`arch` by default the one the preset is the geometry of); without `weights`,
    all but the weights (an engine serves it with --dummy-weights, which builds its weights in
    memory: a benchmark of a geometry too big to write out).

    dtype "fp8": the linear weights are written in Hugging Face's fine-grained FP8 layout
    (float8_e4m3fn values and fp32 `weight_scale_inv` per 128x128 block, kernels/fp8.py) and
    config.json says so in `quantization_config`; embeddings, norms, routers and lm_head stay
    bf16, named in `modules_to_not_convert`. dtype "mxfp4" (gpt_oss): the experts in MXFP4
    `_blocks` and `_scales` (kernels/mxfp4.py), the rest bf16, as openai/gpt-oss-* ship. dtype
    "nvfp4": the same linear weights in ModelOpt's NVFP4 layout (uint8 `weight`, e4m3
    `weight_scale`, fp32 `weight_scale_2` and `input_scale`: kernels/nvfp4.py), as NVIDIA's
    `-NVFP4` releases store them, the kept modules named in `exclude_modules`."""
    if routing_skew < 0:
        raise ValueError("--routing-skew must be 0 (uniform) or more")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    out = Path(out)
    arch = arch or preset_arch(preset)
    config = make_config(arch, preset, overrides)
    config["moelab_synth"] = {"preset": preset, "seed": seed, "routing_skew": routing_skew}
    if dtype == "mxfp4":
        if arch != "gpt_oss":
            raise ValueError("--dtype mxfp4 writes gpt_oss's experts: use --arch gpt_oss")
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": gpt_oss.NOT_CONVERTED,
        }
    spec = ModelSpec.from_config(config)
    vision = config.get("vision_config")
    keep = _not_converted(spec) if dtype in ("fp8", "nvfp4") else None
    if dtype == "nvfp4":
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": nvfp4.BLOCK,
            "exclude_modules": keep,
        }
    elif keep is not None:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": keep,
        }
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer_files(
        out,
        spec.vocab_size,
        chat_template_for(arch, chat_template),
        extra_special=VISION_TOKENS if vision else (),
    )
    if vision:
        set_vision_token_ids(config, tokenizer.token_to_id)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer.get_vocab_size() > spec.vocab_size:
        raise ValueError(
            f"vocab_size {spec.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.get_vocab_size()} tokens; raise it with --set vocab_size=N"
        )
    if not weights:
        return out
    if spec.dense_bytes + spec.expert_pool_bytes <= CALIBRATE_MAX_BYTES:
        cpu = torch.device("cpu")
        source = SynthSource.calibrated(
            spec,
            seed=seed,
            skew=routing_skew,
            device=cpu,
            dtype=torch.float32,
            cpu_threads=default_cpu_threads(),
            expert_format=dtype,
        )
    else:
        source = SynthSource(spec, seed=seed, skew=routing_skew, expert_format=dtype)
    tower = VisionTower(vision, seed, source.dtype) if vision else None
    _write_weights(out, _Tensors(source, tower), shard_bytes, keep, fmt=dtype)
    return out


class _Tensors:
    """The tensors a checkpoint is written from: the model's source, and a multimodal
    checkpoint's vision tower."""

    def __init__(self, source: SynthSource, vision: VisionTower | None) -> None:
        self.dtype = source.dtype
        self.parts = [source] if vision is None else [source, vision]

    def names(self) -> list[str]:
        return [name for part in self.parts for name in part.names()]

    def _part(self, name: str) -> SynthSource | VisionTower:
        return next(part for part in self.parts if part.has(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._part(name).shape(name)

    def get(self, name: str) -> torch.Tensor:
        return self._part(name).get(name)


def _not_converted(spec: ModelSpec) -> list[str]:
    """The modules an FP8 checkpoint keeps unquantized, by their full names as transformers
    matches them: the embeddings, every norm, the routers (and qwen2_moe's shared expert gates)
    and lm_head (hybrid models: `hybrid_not_converted`)."""
    if spec.hybrid:
        return hybrid_not_converted(spec)
    names = ["model.embed_tokens"]
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        names += [p + "input_layernorm", p + "post_attention_layernorm"]
        if spec.qk_norm != "none":
            names += [p + "self_attn.q_norm", p + "self_attn.k_norm"]
        if spec.is_moe_layer(layer):
            names.append(router_name(spec, layer).removesuffix(".weight"))
            if spec.shared_expert_intermediate_size:
                names.append(p + "mlp.shared_expert_gate")
    names.append("model.norm")
    if not spec.tie_word_embeddings:
        names.append("lm_head")
    return names


def _kept(module: str, keep: set[str]) -> bool:
    """Whether `module` is one of `keep` or inside one (as transformers matches
    modules_to_not_convert: "model.visual" keeps "model.visual.blocks.0.attn.qkv")."""
    parts = module.split(".")
    return any(".".join(parts[:n]) in keep for n in range(1, len(parts) + 1))


def _tensors(source: _Tensors, names: list[str], keep: set[str] | None, fmt: str) -> dict:
    """The named tensors as written: with `keep` (an FP8 or NVFP4 checkpoint), every weight of a
    module not kept as FP8 values and its `weight_scale_inv`, or as ModelOpt's NVFP4 tensors
    (gpt_oss's MXFP4 experts come from the source as their blocks and scales)."""
    out = {}
    for name in names:
        t = source.get(name)
        module = name.removesuffix(".weight")
        if keep is None or not name.endswith(".weight") or _kept(module, keep):
            out[name] = t
        elif fmt == "nvfp4":
            out[name], out[name + "_scale"], out[name + "_scale_2"] = nvfp4.quantize(t)
            out[module + ".input_scale"] = torch.ones(t.shape[:-2])
        else:
            out[name], out[name + "_scale_inv"] = fp8.quantize(t)
    return out


def _write_weights(
    out: Path,
    source: _Tensors,
    shard_bytes: int,
    keep: list[str] | None = None,
    *,
    fmt: str = "bf16",
) -> None:
    kept = set(keep) if keep is not None else None
    names = source.names()
    elem = torch.empty((), dtype=source.dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = elem
        for d in source.shape(name):
            n *= d
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        _save_atomic(out / "model.safetensors", _tensors(source, shards[0], kept, fmt), meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = _tensors(source, shard, kept, fmt)
        _save_atomic(out / file, tensors, meta)
        weight_map.update(dict.fromkeys(tensors, file))
        log.info("wrote %s (%d/%d)", file, i, len(shards))
    index = {
        "metadata": {"total_size": sum((out / f).stat().st_size for f in set(weight_map.values()))},
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_atomic(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    shutil.move(tmp, path)
