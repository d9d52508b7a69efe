"""Synthetic checkpoints of any supported architecture and size, on disk or in memory.

Weights are deterministic (seeded by the seed and each tensor's name) and scaled so activations stay
bounded through every layer. Routing skew lives in the router weights: hidden dimension 0 carries a
constant ("massive activation", as real models have) that no layer writes to, so the router's
column 0 acts as a per-expert bias; the biases are calibrated so expert popularity follows a Zipf
law: first from a Monte Carlo model of the router, then with forward passes of the synthetic model
itself (`SynthSource.calibrate`: by `moelab synth` before it writes the weights, and by an engine
with --dummy-weights over its expert bank, once that is in host memory).

gpt_oss's experts may be made in MXFP4 (`SynthSource(expert_format="mxfp4")`, as `moelab synth
--dtype mxfp4` writes them and an engine with --dummy-weights banks them): their `_blocks` and
`_scales` straight from the random generator, a large tensor tiled from the quantized random
block at whole groups of 32 values (`_mxfp4_part`), so that no expert is quantized.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ...kernels import mxfp4
from ...kernels.grouped_moe import grouped_moe
from ...kernels.mxfp4_moe import grouped_moe_mxfp4
from . import gpt_oss, synth_hybrid
from .checkpoint import iter_layer_experts, load_dense
from .kv import KVCache
from .model import DenseWeights, Model, SeqSlice, StepBatch
from .spec import ARCHITECTURES, CheckpointError, ModelSpec
from .states import StatePool
from .synth_hybrid import (
    HYBRID_PRESETS,
    SYNTH_ARCHS,
    hybrid_config,
    hybrid_shapes,
    hybrid_tensor,
    layer_of,
)
from .window import WindowPool

# Geometry shared by the architectures; each is mapped to its own config.json field names below.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=128,
        shared_expert_intermediate_size=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    ),
    "small": dict(
        vocab_size=8192,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        intermediate_size=2816,
        shared_expert_intermediate_size=1024,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    # the exact geometry of Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        shared_expert_intermediate_size=0,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
    ),
    **HYBRID_PRESETS,
}
# the architectures `moelab synth --arch` takes: the engine's, and the text-only layout of one
ARCHS = tuple(dict.fromkeys((*ARCHITECTURES, *SYNTH_ARCHS)))

PRESETS.update(gpt_oss.PRESETS)
# the architecture each real geometry belongs to: the default of --arch, and the only one (or its
# text-only layout) that --arch may name with it
PRESET_ARCHS = {
    "qwen3-30b-a3b": "qwen3_moe",
    **synth_hybrid.PRESET_ARCHS,
    **dict.fromkeys(gpt_oss.PRESETS, "gpt_oss"),
}

_DIM0 = 2.0  # the constant residual value of hidden dimension 0 (see module docstring)
_LOGIT_GAIN = 4.0  # lm_head gain, so next-token distributions are peaked rather than flat
_TILE = 1 << 22  # elements of the random block that large tensors are tiled from
_RANDN_MAX = 1 << 16  # tensors up to this many elements get their own random draw
# The calibration's forward passes: random prompts of up to this many tokens, this many tokens a
# round, this many rounds
CALIBRATION_PROMPT_TOKENS = 256
CALIBRATION_TOKENS = 1024
CALIBRATION_ROUNDS = 4
# A saved calibration (`SynthSource.save_calibration`) names what it was made from: the source of
# the model's and the kernels' modules is part of its key, so a change to the synthetic weights or
# to the passes that calibrate them makes a new one
_CALIBRATION_FILE_VERSION = 1


def parse_overrides(items: list[str]) -> dict:
    """`make_config`'s overrides from --set FIELD=VALUE items: each value read as JSON where it
    is JSON (numbers, lists, booleans), else taken as the string."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: write FIELD=VALUE, e.g. --set num_experts=64")
        key, text = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(text)
        except ValueError:
            out[key.strip()] = text
    return out


def preset_arch(preset: str) -> str:
    """The architecture a preset is the geometry of, where it is a real model's; else qwen3_moe."""
    return PRESET_ARCHS.get(preset, "qwen3_moe")


def make_config(arch: str, preset: str = "tiny", overrides: dict | None = None) -> dict:
    """A Hugging Face config.json for `arch` with the preset's geometry and any overrides."""
    if arch not in ARCHS:
        raise CheckpointError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise CheckpointError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if preset in PRESET_ARCHS and not arch.startswith(PRESET_ARCHS[preset]):
        layouts = [a for a in ARCHS if a.startswith(PRESET_ARCHS[preset])]
        raise CheckpointError(
            f"preset {preset!r} is a {PRESET_ARCHS[preset]} model's geometry, not a {arch} "
            f"one's; use --arch {' or '.join(layouts)}, or leave --arch out"
        )
    g = {**PRESETS[preset], **(overrides or {})}
    if arch in SYNTH_ARCHS:
        return hybrid_config(arch, preset, g, overrides or {})
    base = dict(
        vocab_size=g["vocab_size"],
        hidden_size=g["hidden_size"],
        num_hidden_layers=g["num_hidden_layers"],
        num_attention_heads=g["num_attention_heads"],
        num_key_value_heads=g["num_key_value_heads"],
        head_dim=g["head_dim"],
        max_position_embeddings=g["max_position_embeddings"],
        rope_theta=g["rope_theta"],
        rms_norm_eps=g["rms_norm_eps"],
        num_experts_per_tok=g["num_experts_per_tok"],
        hidden_act="silu",
        tie_word_embeddings=bool(g.get("tie_word_embeddings", False)),
        torch_dtype=g.get("torch_dtype", "bfloat16"),
        bos_token_id=None,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
    )
    if arch == "qwen3_moe":
        extra = dict(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=g["num_experts"],
            moe_intermediate_size=g["moe_intermediate_size"],
            intermediate_size=g["intermediate_size"],
            norm_topk_prob=g.get("norm_topk_prob", True),
            decoder_sparse_step=g.get("decoder_sparse_step", 1),
            mlp_only_layers=g.get("mlp_only_layers", [0] if preset == "tiny" else []),
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
        )
    elif arch == "qwen2_moe":
        extra = dict(
            architectures=["Qwen2MoeForCausalLM"],
            model_type="qwen2_moe",
            num_experts=g["num_experts"],
            moe_intermediate_size=g["moe_intermediate_size"],
            intermediate_size=g["intermediate_size"],
            shared_expert_intermediate_size=g["shared_expert_intermediate_size"]
            or 4 * g["moe_intermediate_size"],
            norm_topk_prob=g.get("norm_topk_prob", False),
            decoder_sparse_step=g.get("decoder_sparse_step", 1),
            mlp_only_layers=g.get("mlp_only_layers", [0] if preset == "tiny" else []),
            qkv_bias=True,
            use_sliding_window=False,
            sliding_window=None,
        )
    elif arch == "mixtral":
        extra = dict(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=g["num_experts"],
            intermediate_size=g["moe_intermediate_size"],
            sliding_window=None,
        )
    elif arch == "gpt_oss":
        extra = gpt_oss.synth_config(g)
    else:
        extra = dict(
            architectures=["OlmoeForCausalLM"],
            model_type="olmoe",
            num_experts=g["num_experts"],
            intermediate_size=g["moe_intermediate_size"],
            norm_topk_prob=g.get("norm_topk_prob", False),
            clip_qkv=None,
        )
    config = {**base, **extra}
    known = set(PRESETS["tiny"]) | {
        "norm_topk_prob",
        "tie_word_embeddings",
        "torch_dtype",
        "decoder_sparse_step",
        "mlp_only_layers",
    }
    for key, value in (overrides or {}).items():
        if key not in known and key not in config:
            config[key] = value
    return config


def zipf_shares(num_experts: int, skew: float) -> np.ndarray:
    """Target share of picks for experts of rank 1..E under a Zipf law of exponent `skew`."""
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    shares = ranks**-skew
    return shares / shares.sum()


def calibrate_biases(
    num_experts: int, top_k: int, skew: float, seed: int, samples: int = 4096, steps: int = 60
) -> np.ndarray:
    """Per-rank logit biases so that top-k picks over unit-variance router noise follow Zipf(skew).

    Shares a top-k router cannot give (a share above 1/top_k of all picks) saturate.
    """
    if skew == 0:
        return np.zeros(num_experts)
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((samples, num_experts))
    target = zipf_shares(num_experts, skew)
    bias = np.log(target) - np.log(target).mean()
    for _ in range(steps):
        top = np.argpartition(-(noise + bias), top_k - 1, axis=1)[:, :top_k]
        counts = np.bincount(top.ravel(), minlength=num_experts) + 0.5
        observed = counts / counts.sum()
        bias += 0.7 * (np.log(target) - np.log(observed))
        bias -= bias.mean()
    return bias


@contextlib.contextmanager
def calibration_threads(device: torch.device, cpu_threads: int) -> Iterator[None]:
    """Torch's threads for a calibration on `device`: `cpu_threads` of them on the CPU (an
    engine on the CPU leaves one physical core to its CPU experts: on a busy machine the small
    ops of a synthetic model run many times slower where each of its cores has a thread spinning
    on them), as they are on a GPU."""
    if device.type == "cuda":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SynthSource:
    """A TensorSource of deterministic synthetic weights for a spec (nothing read from disk)."""

    @classmethod
    def calibrated(
        cls,
        spec: ModelSpec,
        seed: int = 0,
        skew: float = 0.0,
        *,
        device: torch.device,
        dtype: torch.dtype,
        cpu_threads: int = 1,
        expert_format: str = "bf16",
    ) -> SynthSource:
        """A source whose routers are calibrated with forward passes of a synthetic model of its
        own on `device` in `dtype` (`calibrate`), on the CPU with `cpu_threads` of torch's
        threads: the same weights for the same spec, seed, skew, expert format, device type and
        dtype. (An engine with --dummy-weights calibrates its own dense weights over its
        bank.)"""
        source = cls(spec, seed=seed, skew=skew, expert_format=expert_format)
        with calibration_threads(device, cpu_threads):
            source.calibrate(device, dtype)
        return source

    def __init__(
        self, spec: ModelSpec, seed: int = 0, skew: float = 0.0, expert_format: str = "bf16"
    ) -> None:
        """expert_format "mxfp4": gpt_oss's experts as an MXFP4 checkpoint holds them (their
        `_blocks` and `_scales` in place of each projection); other architectures' experts, and
        other formats, are made unquantized (a bank quantizes them as it is built)."""
        self.spec = spec
        self.seed = seed
        self.skew = skew
        self.expert_format = expert_format
        self.dtype = getattr(torch, spec.dtype)
        self._shapes = self._all_shapes()
        # MXFP4 parts: each `_blocks` and `_scales` name's projection and its unquantized shape
        self._mxfp4: dict[str, tuple[str, tuple[int, ...]]] = {}
        if expert_format == "mxfp4" and spec.arch == "gpt_oss":
            self._shapes, self._mxfp4 = gpt_oss.mxfp4_shapes(self._shapes)
        # per standard deviation: the random block, quantized to MXFP4 (`_mxfp4_part`)
        self._mxfp4_block: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        # per MoE layer: each expert's target share of picks, and its logit bias (first from a
        # Monte Carlo model of the router; `_calibrate` refines them and the constant's scale)
        self.targets: dict[int, np.ndarray] = {}
        self.biases: dict[int, np.ndarray] = {}
        self.dim0_scale = [1.0 / _DIM0] * spec.num_layers
        self._block: torch.Tensor | None = None
        mc_bias = calibrate_biases(spec.num_experts, spec.top_k, skew, seed)
        shares = zipf_shares(spec.num_experts, skew)
        for layer in spec.moe_layers:
            order = np.random.default_rng([seed, layer]).permutation(spec.num_experts)
            self.targets[layer] = np.empty(spec.num_experts)
            self.targets[layer][order] = shares
            self.biases[layer] = np.empty(spec.num_experts)
            self.biases[layer][order] = mc_bias

    # TensorSource ------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def names(self) -> list[str]:
        return list(self._shapes)

    def get(self, name: str) -> torch.Tensor:
        if name in self._mxfp4:
            return self._mxfp4_part(name, *self._mxfp4[name])
        return self._make(name, self._shapes[name])

    def _make(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The unquantized tensor `name` of `shape`."""
        spec = self.spec
        leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name
        if spec.hybrid and (fixed := hybrid_tensor(spec, name, shape, self.dtype)) is not None:
            return fixed
        if "norm" in name:
            return torch.ones(shape, dtype=self.dtype)
        # gpt_oss's experts are stored [E, in, out], their biases [E, out]
        experts = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if experts:
            leaf = name.rsplit(".", 1)[-1]
        if name.endswith((".bias", "_bias", ".sinks")):
            t = self._random(name, shape, 0.1)
            if name.endswith(("o_proj.bias", "down_proj_bias")):
                t[..., 0] = 0  # nothing writes to the constant dimension
            return t
        std, writes_residual = self._std(leaf, shape, experts)
        if name == spec.text_prefix + "embed_tokens.weight":
            t = self._random(name, shape, 1.0)
            t[:, 0] = _DIM0
            return t
        if name == "lm_head.weight":
            t = self._random(name, shape, _LOGIT_GAIN * std)
            t[:, 0] = 0
            return t
        if leaf in ("gate", "router") and len(shape) == 2 and shape[0] == spec.num_experts:
            return self._router(name, shape)
        t = self._random(name, shape, std)
        if writes_residual and experts:
            t[..., 0] = 0
        elif writes_residual:
            t[0] = 0  # nothing writes to the constant dimension
        return t

    # calibration -------------------------------------------------------------------------------

    @torch.inference_mode()
    def calibrate(
        self,
        device: torch.device,
        dtype: torch.dtype,
        dense: DenseWeights | None = None,
        experts: list[tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        """Refine each router's bias column (`_refine`) with forward passes of a model of this
        source's weights on `device` in `dtype`: `dense`, whose routers it calibrates in place
        (loaded here where not given), and each MoE layer's experts packed as the bank packs
        them, (w13, w2) in `dtype` or MXFP4 (w13, w2, w13_scale, w2_scale), and gpt_oss's biases
        (`experts`, an engine's bank, or built here in `dtype` where not given)."""
        spec = self.spec
        length = min(CALIBRATION_PROMPT_TOKENS, spec.max_position_embeddings)
        dense = dense or load_dense(spec, self, device, dtype)
        executor = _CalibrationExperts(self, device, dtype, experts)
        kv = KVCache(spec, 1, length, device, dtype, prefix_cache=False)  # one prompt's block
        states: StatePool | WindowPool | None = None
        if spec.linear_layers:
            states = StatePool(spec, 1, device, dtype)
        elif spec.sliding_layers:
            states = WindowPool(spec, 1, length, device, dtype)
        model = Model(spec, dense, executor, kv, max_positions=length + 1, states=states)
        self._refine(model, length)
        del model, executor, kv, states
        if device.type == "cuda":
            torch.cuda.empty_cache()  # what the calibration's model held goes back to the device

    def calibration_key(self, device: torch.device, dtype: torch.dtype, bank_format: str) -> str:
        """What a calibration on `device` in `dtype` over a bank of `bank_format` gives the same
        biases for: the spec, the seed, the skew, this source's and the bank's expert formats,
        the device type and dtype of the passes, their constants, torch's version, and the source
        of the modules that make the weights and run the passes (`_calibration_code`)."""
        parts = [
            _CALIBRATION_FILE_VERSION, self.spec.to_dict(), self.seed, self.skew,
            self.expert_format, bank_format, device.type, str(dtype),
            [CALIBRATION_PROMPT_TOKENS, CALIBRATION_TOKENS, CALIBRATION_ROUNDS],
            torch.__version__, _calibration_code(),
        ]  # fmt: skip
        return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:16]

    def save_calibration(self, path: Path, key: str) -> None:
        """Write the calibrated biases and constant scales to `path` (JSON, replaced whole), so
        that `restore_calibration` takes them back instead of calibrating again."""
        state = {
            "key": key,
            "biases": {str(layer): bias.tolist() for layer, bias in self.biases.items()},
            "dim0_scale": list(self.dim0_scale),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def restore_calibration(self, path: Path, key: str, dense: DenseWeights) -> bool:
        """Take back a calibration `save_calibration` wrote under `key`, its routers into
        `dense`: False (nothing changed) where there is none, or it is not whole or not this
        key's."""
        try:
            state = json.loads(path.read_text())
            biases = {int(k): np.asarray(v, dtype=np.float64) for k, v in state["biases"].items()}
            dim0_scale = [float(v) for v in state["dim0_scale"]]
            whole = (
                state["key"] == key
                and sorted(biases) == sorted(self.biases)
                and all(b.shape == (self.spec.num_experts,) for b in biases.values())
                and len(dim0_scale) == len(self.dim0_scale)
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        if not whole:
            return False
        self.biases, self.dim0_scale = biases, dim0_scale
        for layer in self.spec.moe_layers:
            router = dense.layers[layer].router
            router.copy_(self.get(router_name(self.spec, layer)).to(router.device, router.dtype))
        return True

    @torch.inference_mode()
    def _refine(self, model: Model, length: int) -> None:
        """Refine each router's bias column with forward passes of `model` over random prompts of
        `length` tokens; the model's routers take the new weights.

        Each round measures, per MoE layer, the mean of the router input's constant dimension (it
        is divided by each token's RMS at every norm, so it depends on how the residual stream
        grew) and the experts' pick shares, then moves the biases toward the Zipf targets.
        """
        spec = self.spec
        gen = torch.Generator().manual_seed(self.seed + 1)
        prompts = max(1, CALIBRATION_TOKENS // length)
        dim0: dict[int, list[float]] = {layer: [] for layer in spec.moe_layers}
        picks = {layer: np.zeros(spec.num_experts) for layer in spec.moe_layers}

        def record(layer: int, x: torch.Tensor, ids: torch.Tensor) -> None:
            dim0[layer].append(float(x[:, 0].float().mean()))
            np.add.at(picks[layer], ids.flatten().cpu().numpy(), 1)

        model.on_router = record
        for _ in range(CALIBRATION_ROUNDS):
            for layer in spec.moe_layers:
                dim0[layer].clear()
                picks[layer][:] = 0
            for _ in range(prompts):
                _prefill(model, torch.randint(0, spec.vocab_size, (length,), generator=gen))
            for layer in spec.moe_layers:
                self.dim0_scale[layer] = 1.0 / max(float(np.mean(dim0[layer])), 1e-3)
                observed = (picks[layer] + 0.5) / (picks[layer] + 0.5).sum()
                bias = self.biases[layer] + 0.7 * (np.log(self.targets[layer]) - np.log(observed))
                self.biases[layer] = bias - bias.mean()
                router = model.weights.layers[layer].router
                router.copy_(self.get(router_name(spec, layer)).to(router.device, router.dtype))
        model.on_router = None

    # internals ---------------------------------------------------------------------------------

    def _std(self, leaf: str, shape: tuple[int, ...], experts: bool) -> tuple[float, bool]:
        """A weight's standard deviation (1 / sqrt(fan-in), less for one that writes the
        residual stream), and whether it writes it; gpt_oss's experts are [E, in, out]."""
        std = 1.0 / math.sqrt(shape[-2] if experts else shape[-1])
        writes_residual = leaf in ("o_proj", "down_proj", "w2", "out_proj")
        if writes_residual:
            std /= math.sqrt(2 * self.spec.num_layers)
        return std, writes_residual

    def _mxfp4_part(self, name: str, weight: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The `_blocks` or `_scales` (`name`) of gpt_oss's expert projection `weight`, [E, in,
        out] unquantized (`shape`), as an MXFP4 checkpoint holds it: of the [E, out, in] weight.
        A tensor small enough for a random draw of its own is that draw quantized; a larger one
        is tiled, as `_random` tiles one, from the random block times its standard deviation,
        quantized once, at chunk offsets in whole groups of 32 values (its blocks' bytes and
        their scales, copied; a down projection's output row 0 zero, as `_make` makes it)."""
        blocks_part = name.endswith("_blocks")
        if math.prod(shape) <= _RANDN_MAX:
            blocks, scales = mxfp4.quantize(self._make(weight, shape).transpose(1, 2).contiguous())
            return blocks if blocks_part else scales
        experts, fan_in, out = shape
        std, writes_residual = self._std(weight.rsplit(".", 1)[-1], shape, True)
        if std not in self._mxfp4_block:
            if self._block is None:
                self._block = self._tile_block()
            blocks, scales = mxfp4.quantize((self._block * std)[None])
            self._mxfp4_block[std] = (blocks[0], scales[0])  # [groups, 16] and [groups]
        source = self._mxfp4_block[std][0 if blocks_part else 1]
        groups = experts * out * fan_in // mxfp4.BLOCK
        tile = _TILE // mxfp4.BLOCK  # a tile's groups
        part = torch.empty((groups, *source.shape[1:]), dtype=torch.uint8)
        gen = torch.Generator().manual_seed(self._tensor_seed(weight))
        offsets = torch.randint(0, tile, (-(-groups // tile),), generator=gen).tolist()
        # numpy's copies, a thread each: torch would share each chunk's 2 MB among its threads,
        # which on a busy host wait for one another (3x slower on a loaded 2-core host)
        into, tiles = part.numpy(), source.numpy()
        for i, off in enumerate(offsets):
            chunk = into[i * tile : (i + 1) * tile]
            chunk[...] = tiles[off : off + chunk.shape[0]]
        part = part.view(experts, out, fan_in // mxfp4.BLOCK, *source.shape[1:])
        if writes_residual:
            part[:, 0] = 0  # nothing writes to the constant dimension (a zero block's scale: 0)
        return part

    def _router(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        layer = layer_of(name)
        t = self._random(name, shape, 1.0 / math.sqrt(shape[1]))
        bias = self.biases[layer] * self.dim0_scale[layer]
        t[:, 0] = torch.from_numpy(bias).to(t.dtype)
        return t

    def _tensor_seed(self, name: str) -> int:
        return (zlib.crc32(name.encode()) ^ (self.seed * 0x9E3779B1)) & 0x7FFFFFFF

    def _tile_block(self) -> torch.Tensor:
        """The random block large tensors are tiled from, twice over (a tile at any offset)."""
        base = torch.randn(_TILE, generator=torch.Generator().manual_seed(self.seed))
        return torch.cat([base, base]).to(self.dtype)

    def _random(self, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        numel = math.prod(shape)
        gen = torch.Generator().manual_seed(self._tensor_seed(name))
        if numel <= _RANDN_MAX:
            return (torch.randn(shape, generator=gen) * std).to(self.dtype)
        # large tensors: tile one random block at per-chunk offsets (a cheap deterministic fill)
        if self._block is None:
            self._block = self._tile_block()
        out = torch.empty(numel, dtype=self.dtype)
        offsets = torch.randint(0, _TILE, (-(-numel // _TILE),), generator=gen).tolist()
        for i, off in enumerate(offsets):
            chunk = out[i * _TILE : (i + 1) * _TILE]
            chunk.copy_(self._block[off : off + chunk.numel()])
        out.mul_(std)
        return out.view(shape)

    def _all_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.spec
        if s.arch == "gpt_oss":
            return gpt_oss.tensor_shapes(s)
        if s.hybrid:
            return hybrid_shapes(s)
        h, q, kv = s.hidden_size, s.q_size, s.kv_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, h)}
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}."
            a = p + "self_attn."
            shapes.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                    a + "q_proj.weight": (q, h),
                    a + "k_proj.weight": (kv, h),
                    a + "v_proj.weight": (kv, h),
                    a + "o_proj.weight": (h, q),
                }
            )
            if s.attention_bias:
                shapes.update(
                    {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
                )
            if s.qk_norm == "head":
                shapes.update(
                    {a + "q_norm.weight": (s.head_dim,), a + "k_norm.weight": (s.head_dim,)}
                )
            elif s.qk_norm == "full":
                shapes.update({a + "q_norm.weight": (q,), a + "k_norm.weight": (kv,)})
            m = p + ("block_sparse_moe." if s.arch == "mixtral" else "mlp.")
            if not s.is_moe_layer(layer):
                i = s.intermediate_size
                shapes.update(
                    {
                        m + "gate_proj.weight": (i, h),
                        m + "up_proj.weight": (i, h),
                        m + "down_proj.weight": (h, i),
                    }
                )
                continue
            shapes[m + "gate.weight"] = (s.num_experts, h)
            i = s.moe_intermediate_size
            names = (
                ("w1", "w3", "w2") if s.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            )
            for e in range(s.num_experts):
                shapes.update(
                    {
                        f"{m}experts.{e}.{names[0]}.weight": (i, h),
                        f"{m}experts.{e}.{names[1]}.weight": (i, h),
                        f"{m}experts.{e}.{names[2]}.weight": (h, i),
                    }
                )
            if s.shared_expert_intermediate_size:
                si = s.shared_expert_intermediate_size
                shapes.update(
                    {
                        m + "shared_expert.gate_proj.weight": (si, h),
                        m + "shared_expert.up_proj.weight": (si, h),
                        m + "shared_expert.down_proj.weight": (h, si),
                        m + "shared_expert_gate.weight": (1, h),
                    }
                )
        shapes["model.norm.weight"] = (h,)
        if not s.tie_word_embeddings:
            shapes["lm_head.weight"] = (s.vocab_size, h)
        return shapes


@functools.lru_cache(maxsize=1)
def _calibration_code() -> str:
    """A digest of the Python source of the model's package (this file among it) and of the
    kernels': what makes the synthetic weights and runs the calibration's passes."""
    digest = hashlib.sha1()
    for root in (Path(__file__).parent, Path(mxfp4.__file__).parent):
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def calibration_dir() -> Path:
    """Where an engine with --dummy-weights keeps its routers' calibrations, one small JSON file
    a key (`SynthSource.calibration_key`)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("moelab")) / "calibrations"


def router_name(spec: ModelSpec, layer: int) -> str:
    if spec.arch == "gpt_oss":
        return f"model.layers.{layer}.mlp.router.weight"
    block = "block_sparse_moe." if spec.arch == "mixtral" else "mlp."
    return f"{spec.text_prefix}layers.{layer}.{block}gate.weight"


class _CalibrationExperts:
    """The routed experts of a synthetic model for its calibration (an `ExpertExecutor`): each
    MoE layer's experts packed as the expert bank packs them, in the compute dtype, FP8 or MXFP4
    (the given `layers`, an engine's bank, or built from the source: w13, w2, FP8's factors or
    MXFP4's scales, and gpt_oss's biases), all on the device where they fit, else each layer
    copied there as it runs. FP8 and MXFP4 experts run in their kernels, which widen them in
    registers."""

    def __init__(
        self,
        source: SynthSource,
        device: torch.device,
        dtype: torch.dtype,
        layers: list[tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        spec = source.spec
        self.device = device
        self.swiglu_limit = spec.swiglu_limit
        self.layers = layers if layers is not None else _packed_experts(source, dtype)
        nbytes = sum(t.nbytes for tensors in self.layers for t in tensors)
        if device.type != "cuda" or nbytes < 0.9 * torch.cuda.mem_get_info(device)[0]:
            self.layers = [tuple(t.to(device) for t in tensors) for tensors in self.layers]
        assert len(self.layers) == spec.num_moe_layers

    def forward(self, moe_layer, x, ids, weights, *, decode: bool) -> torch.Tensor:
        w13, w2, *rest = (w.to(self.device) for w in self.layers[moe_layer])
        # MXFP4 blocks or FP8 values come with their scales or factors, before any biases
        scaled = w13.dim() == 4 or w13.dtype == torch.float8_e4m3fn
        scales = rest[:2] if scaled else []
        extras = dict(zip(("w13_bias", "w2_bias"), rest[len(scales) :], strict=False))
        args = dict(layer_experts=w13.shape[0], checked=False, swiglu_limit=self.swiglu_limit)
        if w13.dim() == 4:
            return grouped_moe_mxfp4(x, ids, weights, w13, w2, *scales, **args, **extras)
        if scales:
            extras.update(w13_scale_inv=scales[0], w2_scale_inv=scales[1])
        return grouped_moe(x, ids, weights, w13, w2, **args, **extras)

    def routing_record(self, moe_layer: int, tokens: int, decode: bool) -> None:
        return None


def _packed_experts(source: SynthSource, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Each MoE layer's experts of `source`, packed as the bank packs them: (w13, w2) in `dtype`
    (MXFP4 ones widened) and for gpt_oss their biases (fp32)."""
    spec = source.spec
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    layers = []
    for layer in spec.moe_layers:
        w13 = torch.empty((e, 2 * i, h), dtype=dtype)
        w2 = torch.empty((e, h, i), dtype=dtype)
        biases = (torch.empty((e, 2 * i)), torch.empty((e, h))) if spec.expert_bias else ()
        for expert in iter_layer_experts(spec, source, layer):
            mx = expert.w13_scale is not None  # the source's only quantized experts: MXFP4
            w13[expert.index].copy_(mxfp4.dequantize(expert.w13, expert.w13_scale) if mx
                                    else expert.w13)  # fmt: skip
            w2[expert.index].copy_(mxfp4.dequantize(expert.w2, expert.w2_scale) if mx
                                   else expert.w2)  # fmt: skip
            if biases:
                biases[0][expert.index].copy_(expert.w13_bias)
                biases[1][expert.index].copy_(expert.w2_bias)
        layers.append((w13, w2, *biases))
    return layers


def _prefill(model: Model, tokens: torch.Tensor) -> None:
    """One prompt's forward pass from the start of a free KV cache (and, for a hybrid model, a
    zeroed state slot): its last token's logits."""
    kv, states, device, n = model.kv, model.states, model.device, tokens.numel()
    blocks = kv.allocate(kv.blocks_for(n))
    state_slot = states.allocate() if states is not None else -1
    try:
        model.forward(StepBatch(
            input_ids=tokens.to(device), positions=torch.arange(n, device=device),
            slots=torch.tensor([kv.slot(blocks, p) for p in range(n)], device=device),
            seqs=[SeqSlice(0, n, n, kv.page_indices([(blocks, n)])[0], state_slot)],
            logits_index=torch.tensor([n - 1], device=device),
        ))  # fmt: skip
    finally:
        kv.release(blocks)
        if states is not None:
            states.release(state_slot)
