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

`quant_algo: MIXED_PRECISION` (NVIDIA's releases that keep the experts NVFP4 and the attention
and dense layers FP8) names each quantized module's algorithm in `quantized_layers` instead,
`{module: {quant_algo: NVFP4, group_size: 16} | {quant_algo: FP8}}`; a module it does not list
(those in `exclude_modules` / `ignore`) is stored unquantized. An FP8 module there is ModelOpt's
per-tensor FP8: an F8_E4M3 `weight` beside an F32 `weight_scale` of one value (the weight is
value × scale; its `input_scale` is the activations' scale of FP8 GEMMs, not read here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..text import Text

HF_QUANT_CONFIG = "hf_quant_config.json"
ALGORITHM = "NVFP4"
MIXED = "MIXED_PRECISION"
FP8 = "FP8"
GROUP_SIZE = 16  # values per e4m3 scale (kernels/nvfp4.py's BLOCK; this module is torch-free)
FP8_BLOCK = 128  # the bank's FP8 block (kernels/fp8.py's BLOCK)
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
    """Why a ModelOpt `quantization_config` is refused (None for NVFP4 in blocks of 16, and for
    MIXED_PRECISION whose layers are all NVFP4 in blocks of 16 or FP8): another algorithm
    (FP8, W4A8_AWQ, ...), another group size, or a layer of another algorithm."""
    algorithm = quantized.get("quant_algo")
    group = quantized.get("group_size", GROUP_SIZE)
    where = quantized.get(FROM_FILE)
    source = f"{where} quantization" if where else f"{source} quantization_config"
    if algorithm == MIXED:
        return _mixed_problem(quantized.get("quantized_layers"), source)
    if algorithm == ALGORITHM and group == GROUP_SIZE:
        return None
    found = f"quant_algo {json.dumps(algorithm)}, group_size {json.dumps(group)}"
    return Text(
        "this ModelOpt quantization is not supported ({source}: {found}); moelab reads "
        "ModelOpt checkpoints in NVFP4 (quant_algo NVFP4, group_size 16) and MIXED_PRECISION "
        "of NVFP4 and FP8 layers",
        source=source,
        found=found,
    )


def _mixed_problem(layers: object, source: str) -> Text | None:
    if not isinstance(layers, dict) or not layers:
        return Text(
            "{source} names quant_algo MIXED_PRECISION but no quantized_layers (each quantized "
            "module's algorithm); the checkpoint's export is incomplete: export it again",
            source=source,
        )
    for module, entry in layers.items():
        entry = entry if isinstance(entry, dict) else {}
        algorithm, group = entry.get("quant_algo"), entry.get("group_size", GROUP_SIZE)
        if algorithm == FP8 or (algorithm == ALGORITHM and group == GROUP_SIZE):
            continue
        found = f"quant_algo {json.dumps(algorithm)}"
        if algorithm == ALGORITHM:
            found += f", group_size {json.dumps(group)}"
        return Text(
            "module {module} is quantized as {found} ({source} quantized_layers); moelab reads "
            "MIXED_PRECISION layers in NVFP4 (group_size 16) and FP8 (per-tensor)",
            module=module,
            found=found,
            source=source,
        )
    return None


def layer_algorithms(quantized: dict) -> dict[str, str]:
    """Each module's algorithm ("NVFP4" or "FP8") in a MIXED_PRECISION `quantization_config`
    (one `problem` accepts); empty for any other."""
    if quantized.get("quant_algo") != MIXED:
        return {}
    return {module: entry["quant_algo"] for module, entry in quantized["quantized_layers"].items()}


# a multimodal model's decoder in module names: as its checkpoint spells it (transformers), and
# as vLLM's names do, which some lists use
DECODER, DECODER_ELSEWHERE = "model.language_model.", "language_model.model."


def _canonical(module: str) -> str:
    if module.startswith(DECODER_ELSEWHERE):
        return DECODER + module.removeprefix(DECODER_ELSEWHERE)
    return module


def algorithm_of(layers: dict[str, str], module: str) -> str | None:
    """The algorithm `quantized_layers` gives `module` (listed itself or by a module that holds
    it, in either spelling of a multimodal decoder), None where it is not listed: stored
    unquantized."""
    listed = {_canonical(name): algorithm for name, algorithm in layers.items()}
    parts = _canonical(module).split(".")
    for end in range(len(parts), 0, -1):
        found = listed.get(".".join(parts[:end]))
        if found is not None:
            return found
    return None


def experts_kept(
    layers: dict[str, str], moe_intermediate_size: int, decoder_layers: str
) -> tuple[str, str]:
    """How `--moe-expert-dtype auto` holds a MIXED_PRECISION checkpoint's routed experts (an
    expert format of spec.EXPERT_FORMATS) and why: as stored where the bank keeps that format
    exactly (NVFP4; FP8 where the intermediate size is a multiple of 128, so no 128x128 block
    of w13 holds both gate and up rows, each block's factor the tensor's scale), else widened
    to the compute dtype ("bf16"). The routed experts are those under `decoder_layers`
    (`model.layers.`): a multi-token-prediction head's, which the engine does not load, are not
    counted."""
    found = {
        algorithm
        for module, algorithm in layers.items()
        if _canonical(module).startswith(decoder_layers) and ".experts." in f"{module}."
    }
    if found == {ALGORITHM}:
        return "nvfp4", "NVFP4 experts kept NVFP4 as stored"
    if found == {FP8} and moe_intermediate_size % FP8_BLOCK == 0:
        return "fp8", "FP8 per-tensor experts kept FP8, each 128x128 block's factor the tensor's"
    if found == {FP8}:
        return "bf16", (
            f"FP8 per-tensor experts widened to the compute dtype (moe_intermediate_size "
            f"{moe_intermediate_size} is not a multiple of {FP8_BLOCK}: FP8 blocks would round "
            "them again)"
        )
    if found:
        return "bf16", "experts of several algorithms widened to the compute dtype"
    return "bf16", "unquantized experts kept in the compute dtype"


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


def is_fp8_per_tensor(dtype: str, scale: dict | None) -> bool:
    """Whether a `.weight` tensor of safetensors dtype `dtype`, beside the header entry of its
    `weight_scale` (None where it has none), is ModelOpt's per-tensor FP8."""
    if dtype != "F8_E4M3" or scale is None:
        return False
    return scale.get("dtype") == "F32" and math.prod(scale.get("shape", ())) == 1


def weight_problem(name: str, meta: dict[str, dict], algorithm: str | None) -> Text | None:
    """Why weight `name` (a `.weight` in the header `meta`) is not stored as `quantized_layers`
    says its module is (`algorithm`, None where unlisted: unquantized); None where it is."""
    dtype = meta[name].get("dtype")
    scale = meta.get(name + SCALE)
    if algorithm == ALGORITHM:
        stored = is_packed(dtype, name + SCALE_2 in meta)
        want = Text("U8 values beside {scale} and {scale_2}", scale=name + SCALE,
                    scale_2=name + SCALE_2)  # fmt: skip
    elif algorithm == FP8:
        stored = is_fp8_per_tensor(dtype, scale)
        want = Text("F8_E4M3 beside an F32 {scale} of one value", scale=name + SCALE)
    else:
        stored = dtype in ("BF16", "F16", "F32")
        want = Text("BF16, F16 or F32")
    if stored:
        return None
    return Text(
        "{name} is {dtype} but quantized_layers makes its module {algorithm}, stored as {want}; "
        "the checkpoint's weights and its quantization config disagree: export it again",
        name=name,
        dtype=str(dtype),
        algorithm=algorithm or Text("unquantized (not listed)"),
        want=want,
    )
