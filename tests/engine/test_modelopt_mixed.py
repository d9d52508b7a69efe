"""ModelOpt's MIXED_PRECISION checkpoints (NVIDIA's `-NVFP4` releases of MoE models: NVFP4
experts, FP8 attention and dense layers, each module's algorithm in `quantized_layers`): the
engine keeps NVFP4 experts 4-bit, keeps FP8 experts FP8 where its blocks hold them exactly,
widens the rest as they load, and serves them as transformers computes the same weights
dequantized here from the formats' definitions."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moelab.daemon.models import read_checkpoint
from moelab.engine.model.checkpoint import SafetensorsSource
from moelab.engine.model.spec import CheckpointError, ModelSpec
from moelab.engine.process.launch import stop_engine
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from moelab.kernels import nvfp4

from .reference import assert_same_greedy, hf_greedy, hf_logits, make_engine, relative_error
from .served import assert_offloaded_experts_serve
from .served import serve as serve_process

PROMPT = list(range(5, 29))
OFFLOADED = ["--moe-cache-size", "6", "--moe-miss-policy", "split:0.5"]
# what ModelOpt keeps unquantized in an MoE: lm_head and the routers (and the shared experts' gates)
EXCLUDED = ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_expert_gate"]
FP8_MAX = 448.0  # e4m3's largest finite value
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # an e2m1 code's magnitude by its low 3 bits


def algorithm_of(module: str, experts: str) -> str | None:
    """The algorithm this test's exports give a module: `experts` for the routed experts, FP8
    for every other projection, None (unquantized) for lm_head, the routers and the gates."""
    last = module.rsplit(".", 1)[-1]
    if "proj" not in last or module == "lm_head":
        return None
    return experts if ".mlp.experts." in module else "FP8"


def fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's per-tensor FP8: e4m3 values of w / scale, scale = amax / 448 (fp32 [])."""
    scale = (w.float().abs().amax() / FP8_MAX).reshape(())
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def write_mixed(
    plain: Path, out: Path, *, experts: str = "NVFP4", hf_quant_config: bool = False, **layers
) -> Path:
    """`plain` as ModelOpt exports MIXED_PRECISION: each listed module's weight in its algorithm
    (NVFP4: uint8 values, e4m3 `weight_scale`, fp32 `weight_scale_2`; FP8: e4m3 values and an
    fp32 `weight_scale`; both with an `input_scale`), `quantized_layers` naming each (entries in
    `layers` replace the written ones'), in config.json's quantization_config or, with
    `hf_quant_config`, only in hf_quant_config.json."""
    copy_beside_weights(plain, out)
    tensors, quantized = {}, {}
    with safe_open(str(plain / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_tensor(name)
            module = name.removesuffix(".weight")
            algorithm = algorithm_of(module, experts) if name.endswith(".weight") else None
            if algorithm is None:
                tensors[name] = t
                continue
            if algorithm == "NVFP4":
                tensors[name], tensors[name + "_scale"], tensors[name + "_scale_2"] = (
                    nvfp4.quantize(t)
                )
                quantized[module] = {"quant_algo": "NVFP4", "group_size": 16}
            else:
                tensors[name], tensors[name + "_scale"] = fp8_per_tensor(t)
                quantized[module] = {"quant_algo": "FP8"}
            tensors[module + ".input_scale"] = torch.tensor(1.0)
    quantized.update(layers)
    scheme = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
              "quantized_layers": quantized}  # fmt: skip
    save_export(plain, out, tensors, scheme, EXCLUDED, hf_quant_config=hf_quant_config)
    return out


def copy_beside_weights(plain: Path, out: Path) -> None:
    """A new `out` holding `plain`'s files other than its weights and config.json."""
    out.mkdir()
    for f in plain.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())


def save_export(
    plain: Path,
    out: Path,
    tensors: dict,
    scheme: dict,
    excluded: list[str],
    *,
    hf_quant_config: bool,
    version: str = "0.39.0",
) -> None:
    """`tensors` and `plain`'s config as a ModelOpt export of `scheme` (quant_algo and the
    rest) writes them: the scheme in config.json's quantization_config with `ignore`, or with
    `hf_quant_config` only in hf_quant_config.json with `exclude_modules`."""
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    if hf_quant_config:
        producer = {"name": "modelopt", "version": version}
        quantization = {**scheme, "exclude_modules": excluded}
        (out / "hf_quant_config.json").write_text(
            json.dumps({"producer": producer, "quantization": quantization})
        )
    else:
        config["quantization_config"] = {"quant_method": "modelopt", **scheme, "ignore": excluded}
    (out / "config.json").write_text(json.dumps(config))


def dequantized(f, name: str) -> torch.Tensor:
    """A weight's fp32 values by its format's definition: FP8, value × weight_scale; NVFP4, two
    e2m1 codes a byte (the even element in the low nibble; bit 3 the sign) × the e4m3
    weight_scale of its block of 16 × weight_scale_2; anything else as stored."""
    t = f.get_tensor(name)
    if t.dtype == torch.float8_e4m3fn:
        return t.float() * f.get_tensor(name + "_scale").float()
    if t.dtype != torch.uint8:
        return t.float()
    codes = torch.stack([t & 0xF, t >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1)[codes & 7] * (1 - 2 * (codes >> 3)).float()
    blocks = f.get_tensor(name + "_scale").float().repeat_interleave(16, dim=-1)
    return values * blocks * f.get_tensor(name + "_scale_2").float()


def reference_copy(path: Path, out: Path) -> Path:
    """An fp32 copy of a MIXED_PRECISION checkpoint, dequantized here and without its
    quantization config: what transformers runs as the reference."""
    out.mkdir()
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {
            name: dequantized(f, name).contiguous()
            for name in f.keys()  # noqa: SIM118 (safe_open is not a mapping)
            if not name.endswith(("_scale", "_scale_2", "input_scale"))
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def reference(path: Path, out: Path, n: int = 24):
    """transformers on `path`'s dequantized weights: its logits, greedy tokens and margins."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        reference_copy(path, out), dtype=torch.float32
    ).eval()
    tokens, margins = hf_greedy(model, PROMPT, n)
    return hf_logits(model, PROMPT), tokens, margins


@pytest.fixture
def equal_rates(monkeypatch):
    """Bp = Bh, so the split policy runs misses on the CPU and by copies on any machine."""
    import moelab.engine.runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "measure_bp_gbps", lambda bank, device: 10.0)
    monkeypatch.setattr(engine_module, "measure_bh_gbps", lambda runner, bank: 10.0)


def serve(path: Path, *flags: str, n: int = 24):
    """The engine's logits on PROMPT and its greedy tokens, with its bank's format."""
    engine = make_engine(path, *flags)
    try:
        ours = engine.score(PROMPT)
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=n, ignore_eos=True))
        fmt = engine.bank.fmt
        if "split:0.5" in flags:
            assert engine.moe.counters.fills.sum() > 0 and engine.moe.counters.cpu.sum() > 0
    finally:
        engine.close()
    return ours, tokens, fmt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A qwen3_moe MIXED_PRECISION checkpoint (NVFP4 experts, FP8 attention) and transformers'
    logits and greedy continuation on its dequantized weights."""
    root = tmp_path_factory.mktemp("mixed")
    plain = synthesize(root / "bf16", arch="qwen3_moe", preset="tiny", seed=11, routing_skew=0.8)
    path = write_mixed(plain, root / "mixed")
    return path, *reference(path, root / "ref")


@pytest.mark.usefixtures("equal_rates")
@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_mixed_precision_keeps_nvfp4_experts_and_matches_transformers(
    checkpoint, caplog, placement
):
    """auto: the experts in the bank as stored (NVFP4), the FP8 attention widened as it loads;
    the logits and greedy tokens are transformers' on the dequantized weights."""
    path, ref_logits, ref_tokens, margins = checkpoint
    spec = ModelSpec.from_dir(path)
    assert spec.quantization == "mixed" and spec.expert_format() == "nvfp4"
    flags = ["--moe-cache-rate", "1.0"] if placement == "resident" else OFFLOADED
    with caplog.at_level(logging.INFO, logger="moelab.engine"):
        ours, tokens, fmt = serve(path, *flags)
    assert fmt == "nvfp4"
    said = [r.getMessage() for r in caplog.records if "MIXED_PRECISION" in r.getMessage()]
    assert said == [
        "ModelOpt MIXED_PRECISION checkpoint: NVFP4 experts kept NVFP4 as stored "
        "(--moe-expert-dtype auto)"
    ]
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


def test_mixed_precision_experts_widen_on_request(checkpoint):
    path, ref_logits, ref_tokens, margins = checkpoint
    ours, tokens, fmt = serve(path, "--moe-expert-dtype", "bf16", "--moe-cache-size", "6")
    assert fmt == "bf16"
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


def test_hf_quant_config_json_names_mixed_precision_too(checkpoint, tmp_path):
    """Exports that name the scheme only in hf_quant_config.json load the same."""
    _, ref_logits, *_ = checkpoint
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=11,
                       routing_skew=0.8)  # fmt: skip
    other = write_mixed(plain, tmp_path / "mixed", hf_quant_config=True)
    assert "quantization_config" not in json.loads((other / "config.json").read_text())
    assert read_checkpoint(other, "x").error is None
    ours, _, fmt = serve(other, "--moe-cache-size", "6", n=1)
    assert fmt == "nvfp4"
    assert relative_error(ours, ref_logits) < 1e-4


@pytest.mark.usefixtures("equal_rates")
@pytest.mark.parametrize(("intermediate", "kept"), [(128, "fp8"), (32, "bf16")])
def test_fp8_experts_are_kept_fp8_where_its_blocks_hold_them_exactly(
    tmp_path, caplog, intermediate, kept
):
    """FP8 per-tensor experts: kept FP8 (each 128x128 block's factor the tensor's scale, the
    checkpoint's bytes) where the intermediate size is a multiple of 128, else widened to the
    compute dtype rather than rounded again; either way transformers' logits and tokens."""
    geometry = {"moe_intermediate_size": intermediate}
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=3,
                       routing_skew=0.8, overrides=geometry)  # fmt: skip
    path = write_mixed(plain, tmp_path / "mixed", experts="FP8")
    ref_logits, ref_tokens, margins = reference(path, tmp_path / "ref")
    with caplog.at_level(logging.INFO, logger="moelab.engine"):
        engine = make_engine(path, *OFFLOADED)
    try:
        assert engine.bank.fmt == kept
        if kept == "fp8":
            name = f"model.layers.{engine.spec.moe_layers[0]}.mlp.experts.2.up_proj.weight"
            with safe_open(str(path / "model.safetensors"), framework="pt") as f:
                values, scale = f.get_tensor(name), f.get_tensor(name + "_scale")
            up_rows = engine.bank.w13[0][2][intermediate:]
            assert torch.equal(up_rows.view(torch.uint8), values.view(torch.uint8))
            assert torch.all(engine.bank.w13_scale[0][2][1:] == scale)
        ours = engine.score(PROMPT)
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))
    finally:
        engine.close()
    said = " ".join(r.getMessage() for r in caplog.records if "MIXED_PRECISION" in r.getMessage())
    assert ("kept FP8" if kept == "fp8" else "widened to the compute dtype") in said
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


@pytest.mark.usefixtures("equal_rates")
def test_the_qwen3_5_moe_text_layout_loads_mixed_precision(tmp_path):
    """Qwen3.5/3.6 MoE's text layout: its Gated DeltaNet and attention projections and its
    shared experts FP8, the routed experts NVFP4, served offloaded as transformers computes."""
    plain = synthesize(tmp_path / "bf16", arch="qwen3_5_moe_text", preset="tiny", seed=5,
                       routing_skew=0.8)  # fmt: skip
    path = write_mixed(plain, tmp_path / "mixed")
    layers = json.loads((path / "config.json").read_text())["quantization_config"]
    assert layers["quantized_layers"]["model.layers.0.linear_attn.in_proj_qkv"] == {
        "quant_algo": "FP8"
    }
    ref_logits, ref_tokens, margins = reference(path, tmp_path / "ref", n=16)
    ours, tokens, fmt = serve(path, *OFFLOADED, n=16)
    assert fmt == "nvfp4"
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


@pytest.mark.parametrize(
    ("layers", "found"),
    [
        ({"model.layers.1.self_attn.o_proj": {"quant_algo": "W4A16_AWQ", "group_size": 128}},
         'module model.layers.1.self_attn.o_proj is quantized as quant_algo "W4A16_AWQ"'),
        ({"model.layers.2.mlp.experts.0.up_proj": {"quant_algo": "NVFP4", "group_size": 32}},
         'module model.layers.2.mlp.experts.0.up_proj is quantized as quant_algo "NVFP4", '
         "group_size 32"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("where", ["config", "hf"])
def test_a_layer_of_another_algorithm_is_refused_naming_it(tmp_path, layers, found, where):
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=2)
    path = write_mixed(plain, tmp_path / "q", hf_quant_config=where == "hf", **layers)
    source = "hf_quant_config.json quantization" if where == "hf" else "quantization_config"
    reason = (
        f"{source} quantized_layers); moelab reads MIXED_PRECISION layers in NVFP4 "
        "(group_size 16) and FP8 (per-tensor)"
    )
    with pytest.raises(CheckpointError) as refused:
        ModelSpec.from_dir(path)
    listed = str(read_checkpoint(path, "x").error)  # the manager's catalog, before any start
    for said in (str(refused.value), listed):
        assert said.startswith(found + " (") and said.endswith(reason)


def test_mixed_precision_without_its_layers_is_refused(tmp_path):
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=2)
    path = write_mixed(plain, tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]["quantized_layers"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as refused:
        ModelSpec.from_dir(path)
    assert str(refused.value) == (
        f"{path / 'config.json'} quantization_config names quant_algo MIXED_PRECISION but no "
        "quantized_layers (each quantized module's algorithm); the checkpoint's export is "
        "incomplete: export it again"
    )


@pytest.mark.parametrize(
    ("module", "listed", "said"),
    [
        # listed FP8, stored bf16
        ("model.layers.1.self_attn.k_proj", {"quant_algo": "FP8"},
         "model.layers.1.self_attn.k_proj.weight is BF16 but quantized_layers makes its module "
         "FP8, stored as F8_E4M3 beside an F32 model.layers.1.self_attn.k_proj.weight_scale of "
         "one value"),
        # stored NVFP4, listed FP8
        ("model.layers.1.mlp.experts.3.down_proj", {"quant_algo": "FP8"},
         "model.layers.1.mlp.experts.3.down_proj.weight is U8 but quantized_layers makes its "
         "module FP8"),
    ],
)  # fmt: skip
def test_weights_stored_otherwise_than_listed_are_refused(tmp_path, module, listed, said):
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=2)
    path = write_mixed(plain, tmp_path / "q", **{module: listed})
    if module.endswith("k_proj"):  # the weight written unquantized
        with safe_open(str(plain / "model.safetensors"), framework="pt") as f:
            bf16 = f.get_tensor(module + ".weight")
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
        tensors[module + ".weight"] = bf16
        del tensors[module + ".weight_scale"]
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    spec = ModelSpec.from_dir(path)
    with pytest.raises(CheckpointError) as refused:
        SafetensorsSource(path, spec)
    assert str(refused.value).startswith(said)
    assert str(refused.value).endswith(
        "the checkpoint's weights and its quantization config disagree: export it again"
    )


def test_an_unlisted_module_stored_quantized_is_refused(tmp_path):
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=2)
    path = write_mixed(plain, tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]["quantized_layers"]["model.layers.2.self_attn.v_proj"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as refused:
        SafetensorsSource(path, ModelSpec.from_dir(path))
    assert str(refused.value).startswith(
        "model.layers.2.self_attn.v_proj.weight is F8_E4M3 but quantized_layers makes its "
        "module unquantized (not listed), stored as BF16, F16 or F32"
    )


def test_modules_listed_by_a_parent_or_in_the_other_decoder_spelling_read_the_same(tmp_path):
    """The multimodal Qwen3.5/3.6 MoE layout (`model.language_model.`): a list that names each
    layer's routed experts by their parent module and spells the decoder `language_model.model.`
    (as vLLM's names do) reads every weight as the per-module list does."""
    plain = synthesize(tmp_path / "bf16", arch="qwen3_5_moe", preset="tiny", seed=7)
    path = write_mixed(plain, tmp_path / "mixed")
    ours, _, fmt = serve(path, "--moe-cache-size", "6", n=1)
    assert fmt == "nvfp4"
    config = json.loads((path / "config.json").read_text())
    listed = config["quantization_config"]["quantized_layers"]
    assert "model.language_model.layers.3.mlp.experts.0.up_proj" in listed
    respelled = {}
    for module, entry in listed.items():
        module = module.replace("model.language_model.", "language_model.model.")
        parent, experts, _ = module.partition(".mlp.experts.")
        respelled[parent + ".mlp.experts" if experts else module] = entry
    assert len(respelled) < len(listed)
    config["quantization_config"]["quantized_layers"] = respelled
    (path / "config.json").write_text(json.dumps(config))
    again, _, fmt = serve(path, "--moe-cache-size", "6", n=1)
    assert fmt == "nvfp4"
    assert torch.equal(again, ours)


def test_auto_goes_by_the_decoders_experts_not_the_mtp_heads(tmp_path):
    """Qwen3.6's geometry as NVIDIA lists it: the decoder's routed experts NVFP4 and a
    multi-token-prediction head (not loaded) of FP8 experts: auto keeps NVFP4."""
    path = synthesize(tmp_path / "m", arch="qwen3_5_moe", preset="tiny", weights=False)
    config = json.loads((path / "config.json").read_text())
    nvfp4_layer = {"quant_algo": "NVFP4", "group_size": 16}
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": {
            "mtp.layers.0.mlp.experts.0.up_proj": {"quant_algo": "FP8"},
            "model.language_model.layers.0.mlp.experts.0.up_proj": nvfp4_layer,
            "model.language_model.layers.3.self_attn.q_proj": {"quant_algo": "FP8"},
        },
    }
    spec = ModelSpec.from_config(config, "m/config.json")
    assert spec.expert_format() == "nvfp4"
    assert spec.expert_bytes == spec.expert_bytes_as("nvfp4")


def test_moelab_serve_answers_from_a_mixed_precision_checkpoint(tmp_path):
    """A real `moelab serve` process on a MIXED_PRECISION checkpoint, its experts offloaded: a
    completion, and the expert slots reported in NVFP4 at their own bytes."""
    plain = synthesize(tmp_path / "bf16", preset="tiny", seed=21, routing_skew=1.0)
    path = write_mixed(plain, tmp_path / "m", hf_quant_config=True)
    engine = serve_process(path, tmp_path, "--moe-cache-rate", "0.5")
    try:
        assert_offloaded_experts_serve(engine, path, "nvfp4", 16)
    finally:
        stop_engine(engine)
    assert "NVFP4 experts kept NVFP4 as stored" in Path(engine.log_path).read_text()
