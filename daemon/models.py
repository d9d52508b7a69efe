"""Checkpoints on this machine: where they are found, and what their config and tensors say.

A checkpoint is a directory with a config.json and at least one *.safetensors file. The dense and
expert byte counts come from the safetensors headers (a few KB read per file), so discovery never
reads weights. A checkpoint moelab cannot serve is listed with the reason in `error`: the engine's
own reading of config.json (engine/model/spec.py: the architecture, quantized weights, each field's
type and range) and the weights' dtypes in the headers, so that nothing has to start to find out.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.model import modelopt
from ..engine.model.spec import (
    UNQUANTIZED_DTYPES,
    CheckpointError,
    ModelSpec,
    unread_weights_problem,
)
from ..engine.text import Text, error_text

DEMO_NAME = "moelab-demo-tiny"
# routed experts: "...mlp.experts.3.gate_proj.weight", "...block_sparse_moe.experts.0.w1.weight",
# fused "...mlp.experts.gate_up_proj"; not "shared_experts" / "shared_expert" (those are dense)
_EXPERT_TENSOR = re.compile(r"(^|\.)experts\.")
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelRoot:
    """A folder to search for checkpoints, and what to call the place in the console."""

    path: Path
    source: str  # "~/models", "hf cache", "--models-dir", "data dir"
    hub_layout: bool = False
    max_depth: int = 3


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What discovery learned about one checkpoint directory."""

    path: str
    name: str
    source: str
    architecture: str | None = None
    model_type: str | None = None
    num_layers: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    dense_bytes: int | None = None
    expert_bytes: int | None = None
    max_context: int | None = None
    is_demo: bool = False
    error: Text | str | None = None  # why it cannot be served
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts and self.num_experts > 1)


def default_roots(models_dirs: Iterable[Path], data_dir: Path) -> list[ModelRoot]:
    """~/models, the Hugging Face hub cache, each --models-dir, and the data dir's models/."""
    roots = [ModelRoot(Path.home() / "models", "~/models")]
    roots.append(ModelRoot(hf_hub_cache(), "hf cache", hub_layout=True))
    roots += [ModelRoot(Path(d).expanduser(), "--models-dir") for d in models_dirs]
    roots.append(ModelRoot(data_dir / "models", "data dir"))
    return roots


def hf_hub_cache() -> Path:
    """The hub cache folder, following the environment variables huggingface_hub reads."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "huggingface" / "hub"


def discover(roots: Iterable[ModelRoot]) -> list[Checkpoint]:
    """Every checkpoint under the roots, each path once (the first root that finds it names it)."""
    found: dict[str, Checkpoint] = {}
    for root in roots:
        if not root.path.is_dir():
            continue
        dirs = _hub_snapshots(root.path) if root.hub_layout else _walk(root.path, root.max_depth)
        for directory, name in dirs:
            key = str(directory.resolve())
            if key not in found:
                found[key] = read_checkpoint(directory, root.source, name=name)
    return sorted(found.values(), key=lambda c: (c.name.lower(), c.path))


def _is_checkpoint(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _walk(root: Path, max_depth: int) -> Iterable[tuple[Path, str]]:
    """Checkpoint folders under `root`, named by their path below it (`Qwen/Qwen3-30B-A3B`)."""
    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        if _is_checkpoint(directory):
            yield directory, str(directory.relative_to(root)) if directory != root else root.name
            continue
        if depth == max_depth:
            continue
        try:
            children = [p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")]
        except OSError:
            continue
        stack += [(child, depth + 1) for child in sorted(children, reverse=True)]


def _hub_snapshots(cache: Path) -> Iterable[tuple[Path, str]]:
    """models--Org--Name/snapshots/<revision>/ folders; the name is Org/Name (@rev if several)."""
    for repo in sorted(cache.glob("models--*")):
        repo_name = repo.name[len("models--") :].replace("--", "/")
        snapshots = [s for s in sorted((repo / "snapshots").glob("*")) if _is_checkpoint(s)]
        for snapshot in snapshots:
            suffix = f"@{snapshot.name[:8]}" if len(snapshots) > 1 else ""
            yield snapshot, repo_name + suffix


def read_checkpoint(directory: Path, source: str, *, name: str | None = None) -> Checkpoint:
    """Parse a checkpoint's config.json and safetensors headers; problems go into `error`."""
    directory = directory.resolve()
    base = {"path": str(directory), "name": name or directory.name, "source": source}
    base["is_demo"] = directory.name == DEMO_NAME and source == "data dir"
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as err:
        return Checkpoint(**base, error=Text("config.json cannot be read: {error}", error=str(err)))
    if not isinstance(config, dict):
        return Checkpoint(**base, error=Text("config.json does not hold a JSON object"))
    config = modelopt.config_of(directory, config)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    architectures = config.get("architectures") or [None]
    try:
        dense_bytes, expert_bytes, unread = tensor_bytes(directory)
    except (OSError, ValueError) as err:
        dense_bytes = expert_bytes = None
        error: Text | str | None = Text(
            "the safetensors files cannot be read: {error}", error=error_text(err)
        )
    else:
        error = serving_problem(config, unread)
    return Checkpoint(
        **base,
        architecture=architectures[0],
        model_type=text.get("model_type") or config.get("model_type"),
        num_layers=_first_int(text, "num_hidden_layers", "n_layer", "num_layers"),
        num_experts=_first_int(
            text, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"
        ),
        top_k=_first_int(text, "num_experts_per_tok", "moe_top_k", "num_experts_per_token"),
        dense_bytes=dense_bytes,
        expert_bytes=expert_bytes,
        max_context=_first_int(text, "max_position_embeddings", "max_sequence_length", "n_ctx"),
        error=error,
        config=config,
    )


def serving_problem(config: dict[str, Any], unread: dict[str, str]) -> Text | str | None:
    """Why the engine would refuse this checkpoint: its config.json as the engine reads it, or
    weights of a dtype it does not read (`unread`: dtype -> a tensor of that dtype)."""
    try:
        spec = ModelSpec.from_config(config)
    except CheckpointError as err:
        return error_text(err)
    return unread_weights_problem(spec, unread)


def _first_int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def tensor_bytes(directory: Path) -> tuple[int, int, dict[str, str]]:
    """(dense bytes, routed-expert bytes) of every tensor in the directory's safetensors files,
    and the weights the engine would not read: dtype -> the first such tensor's name."""
    dense = experts = 0
    unread: dict[str, str] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, info in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if _EXPERT_TENSOR.search(name):
                experts += end - start
            else:
                dense += end - start
            if name.endswith(".weight") and info.get("dtype") not in UNQUANTIZED_DTYPES:
                unread.setdefault(str(info.get("dtype")), name)
    return dense, experts, unread


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor name -> dtype, shape, data_offsets.

    A file shorter than its header says (a download cut short) is refused here, as the engine
    would refuse it when it loads."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(Text("{name} is too short to be a safetensors file", name=path.name))
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(
                Text(
                    "{name} has an implausible header length {length}",
                    name=path.name,
                    length=length,
                )
            )
        header = json.loads(f.read(length))
        size = os.fstat(f.fileno()).st_size
    if not isinstance(header, dict):
        raise ValueError(Text("{name} has a header that is not a JSON object", name=path.name))
    ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        raise ValueError(
            Text(
                "{name} is cut short ({size} of the {needed} bytes its header describes): "
                "download it again",
                name=path.name,
                size=size,
                needed=needed,
            )
        )
    return header
