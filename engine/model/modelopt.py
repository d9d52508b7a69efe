"""NVIDIA's NVFP4 checkpoints as ModelOpt writes them (kernels/nvfp4.py defines the layout);
torch-free, as the manager's catalog reads configs with it.

config.json names the scheme in `quantization_config` (`quant_method: modelopt`, `quant_algo:
NVFP4`, `group_size: 16`, `exclude_modules`), or hf_quant_config.json does in its
`quantization` object. Each quantized linear's `weight` is uint8, two e2m1 values a byte, beside
its e4m3 `weight_scale` (one per 16 values) and fp32 `weight_scale_2`; the excluded modules
(embeddings, routers, lm_head, ...) are stored unquantized and read by their dtype.

Dense weights are widened to fp32 as they are read (checkpoint.py's SafetensorsSource) and load
in the compute dtype; the experts are read as stored and go into the bank as NVFP4 for
`--moe-expert-dtype auto` (kernels/nvfp4_moe.py reads them), or in the format the flag names.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..text import Text

HF_QUANT_CONFIG = "hf_quant_config.json"
ALGORITHM = "NVFP4"
GROUP_SIZE = 16  # values per e4m3 scale (kernels/nvfp4.py's BLOCK; this module is torch-free)
# the tensors beside an NVFP4 weight `<name>`: `<name>_scale` and `<name>_scale_2`
SCALE, SCALE_2 = "_scale", "_scale_2"


# where a quantization_config taken from hf_quant_config.json names its file (`problem` says it)
FROM_FILE = "moelab_from_file"


def config_of(path: Path, config: dict) -> dict:
    """config.json, given hf_quant_config.json's `quantization` as its quantization_config
    where it has none (ModelOpt's exports that write only that file)."""
    quant_file = path / HF_QUANT_CONFIG
    if config.get("quantization_config") or not quant_file.is_file():
        return config
    try:
        quantization = json.loads(quant_file.read_text()).get("quantization")
    except (OSError, ValueError, AttributeError):
        quantization = None
    if not isinstance(quantization, dict):
        return config
    merged = {"quant_method": "modelopt", **quantization, FROM_FILE: HF_QUANT_CONFIG}
    return {**config, "quantization_config": merged}


def problem(quantized: dict, source: str) -> Text | None:
    """Why a ModelOpt `quantization_config` is refused (None for NVFP4 in blocks of 16):
    another algorithm (FP8, W4A8_AWQ, MIXED_PRECISION, ...) or another group size."""
    algorithm = quantized.get("quant_algo")
    group = quantized.get("group_size", GROUP_SIZE)
    if algorithm == ALGORITHM and group == GROUP_SIZE:
        return None
    found = f"quant_algo {json.dumps(algorithm)}, group_size {json.dumps(group)}"
    where = quantized.get(FROM_FILE)
    return Text(
        "this ModelOpt quantization is not supported ({source}: {found}); moelab reads "
        "ModelOpt checkpoints in NVFP4 (quant_algo NVFP4, group_size 16)",
        source=f"{where} quantization" if where else f"{source} quantization_config",
        found=found,
    )


def is_packed(dtype: str, has_scale_2: bool) -> bool:
    """Whether a `.weight` tensor of safetensors dtype `dtype` is NVFP4 (uint8 beside its
    per-tensor `weight_scale_2`; gpt_oss's MXFP4 `_blocks` have none)."""
    return dtype == "U8" and has_scale_2


def widened_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the weight an NVFP4 tensor of `shape` holds (two values a byte)."""
    return (*shape[:-1], 2 * shape[-1])


def scale_problem(
    name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], scale_dtype: str
) -> Text | None:
    """Why the block scales beside NVFP4 weight `name` cannot be read (None where they can)."""
    *lead, n, half_k = shape
    want = (*lead, n, 2 * half_k // GROUP_SIZE)
    if scale_shape == want and scale_dtype == "F8_E4M3":
        return None
    return Text(
        "{name} is NVFP4 but {scale} is {dtype} {found}; NVFP4 has one F8_E4M3 scale per "
        "{block} values, {want}",
        name=name,
        scale=name + SCALE,
        dtype=scale_dtype,
        found=str(list(scale_shape)),
        block=GROUP_SIZE,
        want=str(list(want)),
    )
