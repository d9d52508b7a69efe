"""`moelab synth`: write a synthetic checkpoint directory in Hugging Face layout."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config.args import default_cpu_threads
from .model.spec import ModelSpec
from .model.synth import SynthSource, make_config
from .model.synth_tokenizer import write_tokenizer_files

log = logging.getLogger("moelab.synth")

# models up to this size calibrate their routing skew with forward passes on the CPU
CALIBRATE_MAX_BYTES = 6 * 1024**3


def synthesize(
    out: str | Path,
    *,
    arch: str = "qwen3_moe",
    preset: str = "tiny",
    overrides: dict | None = None,
    seed: int = 0,
    routing_skew: float = 0.0,
    shard_bytes: int = 2 * 1024**3,
    chat_template: str = "qwen3",
    weights: bool = True,
) -> Path:
    """Write config, tokenizer (with the chat template of that name: synth_tokenizer's
    CHAT_TEMPLATES), generation config and safetensors weights into `out`; without `weights`,
    all but the weights (an engine serves it with --dummy-weights, which builds its weights in
    memory: a benchmark of a geometry too big to write out)."""
    if routing_skew < 0:
        raise ValueError("--routing-skew must be 0 (uniform) or more")
    out = Path(out)
    config = make_config(arch, preset, overrides)
    config["moelab_synth"] = {"preset": preset, "seed": seed, "routing_skew": routing_skew}
    spec = ModelSpec.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = write_tokenizer_files(out, spec.vocab_size, chat_template)
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
        )
    else:
        source = SynthSource(spec, seed=seed, skew=routing_skew)
    _write_weights(out, source, shard_bytes)
    return out


def _write_weights(out: Path, source: SynthSource, shard_bytes: int) -> None:
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
        _save_atomic(out / "model.safetensors", {n: source.get(n) for n in shards[0]}, meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_atomic(out / file, {n: source.get(n) for n in shard}, meta)
        weight_map.update(dict.fromkeys(shard, file))
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
