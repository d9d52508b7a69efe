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

`quant_algo: FP8` (NVIDIA's `-FP8` releases) quantizes every Linear of the decoder that
`exclude_modules` / `ignore` does not name to that per-tensor FP8, as a MIXED_PRECISION module of
FP8 is stored: each module's algorithm comes from the same rule (`algorithm_of`), the exclusions
matched as ModelOpt writes them (a module's name, a module holding it, or a pattern with `*`),
and the modules ModelOpt never quantizes (its default configuration's routers, lm_head and
conv1d; embeddings and norms are no Linear) unquantized whether listed or not. Its
`kv_cache_quant_algo` (FP8 or null) names KV scales the engine does not read.
"""

from __future__ import annotations

import json
import math
from fnmatch import fnmatchcase
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
    """Why a ModelOpt `quantization_config` is refused (None for NVFP4 in blocks of 16, for
    per-tensor FP8, and for MIXED_PRECISION whose layers are all NVFP4 in blocks of 16 or FP8):
    another algorithm (W4A8_AWQ, ...), another group size, or a layer of another algorithm."""
    algorithm = quantized.get("quant_algo")
    group = quantized.get("group_size", GROUP_SIZE)
    where = quantized.get(FROM_FILE)
    source = f"{where} quantization" if where else f"{source} quantization_config"
    if algorithm == MIXED:
        return _mixed_problem(quantized.get("quantized_layers"), source)
    if (algorithm == ALGORITHM and group == GROUP_SIZE) or algorithm == FP8:
        return None
    found = f"quant_algo {json.dumps(algorithm)}, group_size {json.dumps(group)}"
    return Text(
        "this ModelOpt quantization is not supported ({source}: {found}); moelab reads "
        "ModelOpt checkpoints in NVFP4 (quant_algo NVFP4, group_size 16), FP8 (quant_algo FP8, "
        "per-tensor) and MIXED_PRECISION of NVFP4 and FP8 layers",
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


# in `layer_algorithms` of a plain FP8 checkpoint: the algorithm of every Linear of the decoder
# that no other key names, and the algorithm of the modules those keys (its exclusions) name
EVERY_LINEAR, UNQUANTIZED = "*", ""
# the modules ModelOpt's default configuration never quantizes (`modelopt.torch.quantization.
# config`'s disabled quantizers, by their quantizers' names: routers, lm_head, conv1d, output
# layers)
NEVER_QUANTIZED = (
    "*lm_head*",
    "*proj_out.*",
    "*block_sparse_moe.gate*",
    "*router*",
    "*mlp.gate.*",
    "*mlp.shared_expert_gate.*",
    "*linear_attn.conv1d*",
    "*mixer.conv1d*",
    "*output_layer*",
    "output.*",
)


def layer_algorithms(quantized: dict) -> dict[str, str]:
    """Each module's algorithm ("NVFP4" or "FP8") in a MIXED_PRECISION `quantization_config`,
    or for plain FP8 its exclusions (`exclude_modules` or `ignore`; UNQUANTIZED) and
    EVERY_LINEAR's FP8, for a config `problem` accepts; empty for any other."""
    algorithm = quantized.get("quant_algo")
    if algorithm == FP8:
        excluded = [*(quantized.get("exclude_modules") or ()), *(quantized.get("ignore") or ())]
        return {**{str(module): UNQUANTIZED for module in excluded}, EVERY_LINEAR: FP8}
    if algorithm != MIXED:
        return {}
    return {module: entry["quant_algo"] for module, entry in quantized["quantized_layers"].items()}


def scheme(layers: dict[str, str]) -> str:
    """The `quant_algo` whose `layer_algorithms` these are: FP8 or MIXED_PRECISION."""
    return FP8 if EVERY_LINEAR in layers else MIXED


# a multimodal model's decoder in module names: as its checkpoint spells it (transformers), and
# as vLLM's names do, which some lists use
DECODER, DECODER_ELSEWHERE = "model.language_model.", "language_model.model."


def _canonical(module: str) -> str:
    if module.startswith(DECODER_ELSEWHERE):
        return DECODER + module.removeprefix(DECODER_ELSEWHERE)
    return module


def algorithm_of(layers: dict[str, str], module: str, linear: bool = True) -> str | None:
    """The algorithm `layer_algorithms` gives `module` (listed itself or by a module that holds
    it, in either spelling of a multimodal decoder; a plain FP8 checkpoint's exclusions also as
    patterns with `*`), None where it is stored unquantized: a module not listed under
    MIXED_PRECISION; under plain FP8 an excluded one, one ModelOpt never quantizes, and one that
    is no Linear (`linear` false: embeddings, norms, convolutions)."""
    canonical = _canonical(module)
    listed = {_canonical(name): algorithm for name, algorithm in layers.items()}
    parts = canonical.split(".")
    for end in range(len(parts), 0, -1):
        found = listed.get(".".join(parts[:end]))
        if found is not None:
            return found or None
    every = layers.get(EVERY_LINEAR)
    if every is None or not linear:
        return None
    patterns = [name for name, algorithm in listed.items() if "*" in name and not algorithm]
    if any(fnmatchcase(canonical, p) for p in patterns):
        return None
    # ModelOpt's defaults match its quantizers' names: `<module>.weight_quantizer`
    if any(fnmatchcase(f"{canonical}.weight_quantizer", p) for p in NEVER_QUANTIZED):
        return None
    return every


def experts_kept(
    layers: dict[str, str], moe_intermediate_size: int, decoder_layers: str
) -> tuple[str, str]:
    """How `--moe-expert-dtype auto` holds a ModelOpt checkpoint's routed experts (an
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
    if EVERY_LINEAR in layers:
        expert = algorithm_of(layers, f"{decoder_layers}0.mlp.experts.0.gate_proj")
        found = {expert} if expert else set()
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


def weight_problem(
    name: str, meta: dict[str, dict], algorithm: str | None, plain: bool = False
) -> Text | None:
    """Why weight `name` (a `.weight` in the header `meta`) is not stored as `quantized_layers`
    says its module is (`algorithm`, None where unlisted: unquantized), or with `plain` as a
    plain FP8 config makes it (FP8 for a Linear not excluded); None where it is."""
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
    if plain:
        return Text(
            "{name} is {dtype} but quant_algo FP8 makes its module {algorithm}, stored as "
            "{want}; the checkpoint's weights and its quantization config disagree: export it "
            "again",
            name=name,
            dtype=str(dtype),
            algorithm=Text("FP8 (a Linear its exclusions do not name)")
            if algorithm
            else Text("unquantized (excluded, or a module ModelOpt does not quantize)"),
            want=want,
        )
    return Text(
        "{name} is {dtype} but quantized_layers makes its module {algorithm}, stored as {want}; "
        "the checkpoint's weights and its quantization config disagree: export it again",
        name=name,
        dtype=str(dtype),
        algorithm=algorithm or Text("unquantized (not listed)"),
        want=want,
    )
