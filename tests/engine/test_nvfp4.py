"""NVFP4 checkpoints in ModelOpt's layout (NVIDIA's `-NVFP4` releases): the engine keeps their
experts 4-bit (the bank, its file, the slots, the CPU's jobs), widens the dense weights as they
load, and serves them against transformers on the same weights, dequantized here by
kernels/nvfp4.py (the format's definition)."""

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

from .reference import (
    assert_same_greedy,
    decode_with_each_planner,
    hf_greedy,
    hf_logits,
    make_engine,
    relative_error,
)
from .served import assert_offloaded_experts_serve, serve

PROMPT = list(range(5, 29))
OFFLOADED = ["--moe-cache-size", "6", "--moe-miss-policy", "split:0.5"]
# ModelOpt's exclusions for an MoE: the routers and lm_head (embeddings and norms are no linears)
EXCLUDED = ["lm_head", "model.layers.*.mlp.gate"]
QUANT = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": EXCLUDED}


def quantized_linear(name: str) -> bool:
    module = name.removesuffix(".weight")
    return name.endswith("_proj.weight") and module != "lm_head" and not module.endswith("mlp.gate")


def write_nvfp4(plain: Path, out: Path, *, hf_quant_config: bool = False, **quant) -> Path:
    """`plain` in ModelOpt's NVFP4 layout: each linear's weight packed by nvfp4.quantize with its
    weight_scale, weight_scale_2 and input_scale; config.json's quantization_config (or, with
    `hf_quant_config`, hf_quant_config.json) naming the scheme."""
    out.mkdir()
    for f in plain.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((plain / "config.json").read_text())
    scheme = {**QUANT, **quant}
    if hf_quant_config:
        producer = {"name": "modelopt", "version": "0.35.0"}
        (out / "hf_quant_config.json").write_text(
            json.dumps({"producer": producer, "quantization": scheme})
        )
    else:
        config["quantization_config"] = {"quant_method": "modelopt", **scheme}
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    with safe_open(str(plain / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            t = f.get_tensor(name)
            if not quantized_linear(name):
                tensors[name] = t
                continue
            packed, scale, scale_2 = nvfp4.quantize(t)
            tensors[name] = packed
            tensors[name + "_scale"] = scale
            tensors[name + "_scale_2"] = scale_2
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dequantize_checkpoint(nvfp4_dir: Path, out: Path) -> Path:
    """An fp32 copy of an NVFP4 checkpoint by the format's definition, without its
    quantization_config: what transformers runs as the reference."""
    out.mkdir()
    config = json.loads((nvfp4_dir / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    with safe_open(str(nvfp4_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            if name.endswith(("_scale", "_scale_2", "input_scale")):
                continue
            t = f.get_tensor(name)
            if t.dtype == torch.uint8:
                t = nvfp4.dequantize(
                    t, f.get_tensor(name + "_scale"), f.get_tensor(name + "_scale_2")
                )
            tensors[name] = t.float().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A qwen3_moe NVFP4 checkpoint and the transformers model of its dequantized weights,
    with its logits and greedy continuation."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("nvfp4")
    plain = synthesize(root / "bf16", arch="qwen3_moe", preset="tiny", seed=11, routing_skew=0.8)
    path = write_nvfp4(plain, root / "nvfp4")
    ref = dequantize_checkpoint(path, root / "ref")
    model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    tokens, margins = hf_greedy(model, PROMPT, 24)
    return path, hf_logits(model, PROMPT), tokens, margins


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_nvfp4_checkpoint_matches_transformers_on_its_dequantized_weights(checkpoint, placement):
    path, ref_logits, ref_tokens, margins = checkpoint
    assert ModelSpec.from_dir(path).quantization == "nvfp4"
    cache = ["--moe-cache-rate", "1.0"] if placement == "resident" else ["--moe-cache-size", "6"]
    engine = make_engine(path, "--moe-expert-dtype", "bf16", *cache)
    try:
        assert engine.bank.fmt == "bf16"
        ours = engine.score(PROMPT)
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))
    finally:
        engine.close()
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


@pytest.fixture
def equal_rates(monkeypatch):
    """Bp = Bh, so the split policy runs misses on the CPU and by copies on any machine."""
    import moelab.engine.runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "measure_bp_gbps", lambda bank, device: 10.0)
    monkeypatch.setattr(engine_module, "measure_bh_gbps", lambda runner, bank: 10.0)


@pytest.mark.usefixtures("equal_rates")
@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_nvfp4_experts_stay_4_bit_and_match_transformers(checkpoint, caplog, placement):
    """auto: the bank holds the checkpoint's own bytes (no widening, no rounding again), the
    slots hold them too, and the logits and greedy tokens are transformers' on the dequantized
    weights; offloaded, misses run both on the CPU and by copies."""
    path, ref_logits, ref_tokens, margins = checkpoint
    spec = ModelSpec.from_dir(path)
    flags = ["--moe-cache-rate", "1.0"] if placement == "resident" else OFFLOADED
    with caplog.at_level(logging.INFO, logger="moelab.engine"):
        engine = make_engine(path, *flags)
    try:
        bank, cache = engine.bank, engine.cache
        assert bank.fmt == cache.fmt == "nvfp4" and cache.snapshot()["dtype"] == "nvfp4"
        assert bank.w13[0].dtype == cache.w13.dtype == torch.uint8
        assert (
            cache.slot_bytes
            == bank.expert_bytes
            == spec.expert_bytes
            == spec.expert_bytes_as("nvfp4")
        )
        stored = expert_as_stored(path, layer=spec.moe_layers[0], expert=3)
        held = [bank.w13[0][3], bank.w2[0][3], bank.w13_scale[0][3], bank.w2_scale[0][3]]
        held += [bank.w13_scale_2[0][3], bank.w2_scale_2[0][3]]
        for mine, theirs in zip(held, stored, strict=True):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
        ours = engine.score(PROMPT)
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))
        if placement == "offloaded":
            counters = engine.moe.counters
            assert counters.fills.sum() > 0 and counters.cpu.sum() > 0
    finally:
        engine.close()
    assert not [r for r in caplog.records if "NVFP4" in r.getMessage()]
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


def test_the_native_planner_decodes_an_nvfp4_bank_as_the_python_planner_does(
    checkpoint, monkeypatch
):
    """An NVFP4 bank's offloaded decode steps are planned by the native planner (its values,
    scales and per-tensor scales copied, and its CPU jobs run with them), with the Python
    planner's plans: the same tokens, the same hits, fills and CPU experts per layer."""
    path, *_ = checkpoint
    prompts = [PROMPT, PROMPT[:9]]
    native, python = decode_with_each_planner(monkeypatch, path, prompts, 12, *OFFLOADED)
    assert native == python
    _, (_, _, fills, cpu, _), *_ = native
    assert sum(fills) > 0 and sum(cpu) > 0


def expert_as_stored(path: Path, layer: int, expert: int) -> list[torch.Tensor]:
    """An expert's tensors in the checkpoint, as the bank holds them: gate and up values and
    block scales stacked, down's, then the per-tensor scales (gate's and up's, down's)."""
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:

        def get(proj: str, suffix: str) -> torch.Tensor:
            return f.get_tensor(f"{p}{proj}.weight{suffix}")

        return [
            torch.cat([get("gate_proj", ""), get("up_proj", "")]),
            get("down_proj", ""),
            torch.cat([get("gate_proj", "_scale"), get("up_proj", "_scale")]),
            get("down_proj", "_scale"),
            torch.stack([get("gate_proj", "_scale_2"), get("up_proj", "_scale_2")]).reshape(2),
            get("down_proj", "_scale_2").reshape(1),
        ]


def test_prefill_streamed_from_an_nvfp4_bank_matches(checkpoint):
    path, ref_logits, *_ = checkpoint
    engine = make_engine(path, "--moe-cache-size", "6")
    try:
        engine.moe.prefill_stream_min_tokens = 1  # every prefill chunk streams whole layers
        assert engine.moe.prefill.allocated and engine.bank.fmt == "nvfp4"
        ours = engine.score(PROMPT)
    finally:
        engine.close()
    assert relative_error(ours, ref_logits) < 1e-4


def test_the_nvfp4_bank_is_written_once_and_read_back(checkpoint):
    """A file of its own (its key names the format): half a byte a weight, a byte per 16 and
    three fp32 scales an expert; a second start maps it without writing it again."""
    path, *_ = checkpoint
    engine = make_engine(path, "--moe-cache-size", "6")
    try:
        first = engine.score(PROMPT)
        bank_path = engine.bank.path
        spec = engine.spec
        weights = 3 * spec.hidden_size * spec.moe_intermediate_size
        assert engine.bank.nbytes == spec.experts_total * (weights // 2 + weights // 16 + 12)
    finally:
        engine.close()
    written = bank_path.stat().st_mtime_ns
    again = make_engine(path, "--moe-cache-size", "6")
    try:
        assert again.bank.path == bank_path and again.bank.fmt == "nvfp4"
        assert torch.equal(again.score(PROMPT), first)
    finally:
        again.close()
    assert bank_path.stat().st_mtime_ns == written


@pytest.mark.parametrize("flag", ["mxfp4", "fp8"])
def test_nvfp4_experts_go_into_another_format_on_request(checkpoint, flag):
    """mxfp4 or fp8 on request: the widened experts rounded once more (a relative error of
    about 0.09 in the logits here), which is not another model."""
    path, ref_logits, *_ = checkpoint
    spec = ModelSpec.from_dir(path)
    engine = make_engine(path, "--moe-expert-dtype", flag, "--moe-cache-size", "6")
    try:
        assert engine.bank.fmt == flag
        assert engine.bank.expert_bytes == spec.expert_bytes_as(flag)
        ours = engine.score(PROMPT)
    finally:
        engine.close()
    assert relative_error(ours, ref_logits) < 0.15


def test_hf_quant_config_json_names_nvfp4_too(checkpoint, tmp_path):
    """ModelOpt exports that name the scheme only in hf_quant_config.json load the same."""
    _, ref_logits, *_ = checkpoint
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=11,
                       routing_skew=0.8)  # fmt: skip
    other = write_nvfp4(plain, tmp_path / "nvfp4", hf_quant_config=True)
    assert "quantization_config" not in json.loads((other / "config.json").read_text())
    assert read_checkpoint(other, "x").error is None
    engine = make_engine(other, "--moe-expert-dtype", "bf16", "--moe-cache-size", "6")
    try:
        ours = engine.score(PROMPT)
    finally:
        engine.close()
    assert relative_error(ours, ref_logits) < 1e-4


@pytest.mark.parametrize(
    ("where", "quant", "found"),
    [
        ("config", {"quant_algo": "INT8_SQ"}, 'quant_algo "INT8_SQ", group_size 16'),
        ("config", {"quant_algo": "W4A8_AWQ", "group_size": 128},
         'quant_algo "W4A8_AWQ", group_size 128'),
        ("hf", {"quant_algo": "NVFP4", "group_size": 32}, 'quant_algo "NVFP4", group_size 32'),
        ("hf", {"quant_algo": "W4A16_AWQ"}, 'quant_algo "W4A16_AWQ", group_size 16'),
    ],
)  # fmt: skip
def test_other_modelopt_schemes_are_refused_naming_what_was_found(tmp_path, where, quant, found):
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=2)
    path = write_nvfp4(plain, tmp_path / "q", hf_quant_config=where == "hf", **quant)
    source = "hf_quant_config.json quantization" if where == "hf" else "quantization_config"
    reason = (
        f"{source}: {found}); moelab reads ModelOpt checkpoints in NVFP4 (quant_algo NVFP4, "
        "group_size 16), FP8 (quant_algo FP8, per-tensor) and MIXED_PRECISION of NVFP4 and FP8 "
        "layers"
    )
    with pytest.raises(CheckpointError) as refused:
        ModelSpec.from_dir(path)
    listed = str(read_checkpoint(path, "x").error)  # the manager's catalog, before any start
    for said in (str(refused.value), listed):
        assert said.startswith("this ModelOpt quantization is not supported (") and said.endswith(
            reason
        )


def test_block_scales_of_another_layout_are_refused(checkpoint, tmp_path):
    path, *_ = checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    tensors[name + "_scale"] = tensors[name + "_scale"][:, :1].contiguous()  # one per row
    save_file(tensors, str(broken / "model.safetensors"))
    spec = ModelSpec.from_dir(broken)
    source = SafetensorsSource(broken, spec)
    assert source.shape(name) == (spec.hidden_size, spec.moe_intermediate_size)
    with pytest.raises(CheckpointError) as refused:
        source.get(name)
    assert str(refused.value) == (
        f"{name} is NVFP4 but {name}_scale is F8_E4M3 [64, 1]; NVFP4 has one F8_E4M3 scale "
        "per 16 values, [64, 2]"
    )


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe_text"])
def test_synth_writes_modelopt_nvfp4_that_the_engine_serves(tmp_path, arch):
    """`moelab synth --dtype nvfp4`: NVIDIA's layout (a hybrid's Gated DeltaNet projections
    too), served as transformers computes its weights dequantized here."""
    transformers = pytest.importorskip("transformers")
    path = synthesize(tmp_path / "m", arch=arch, preset="tiny", seed=5, dtype="nvfp4")
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    assert {k: quant[k] for k in ("quant_method", "quant_algo", "group_size")} == {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
    }
    assert "lm_head" in quant["exclude_modules"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        down = "model.layers.1.mlp.experts.0.down_proj."
        assert f.get_tensor(down + "weight").dtype == torch.uint8
        assert f.get_tensor(down + "weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor(down + "weight_scale_2").shape == ()
        assert down + "input_scale" in names
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    ref = dequantize_checkpoint(path, tmp_path / "ref")
    model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    ref_logits = hf_logits(model, PROMPT)
    for flag, fmt in (("bf16", "bf16"), ("auto", "nvfp4")):
        engine = make_engine(path, "--moe-expert-dtype", flag, "--moe-cache-size", "6")
        try:
            assert engine.bank.fmt == fmt
            ours = engine.score(PROMPT)
        finally:
            engine.close()
        assert relative_error(ours, ref_logits) < 1e-4, flag


def rounded_copy(path: Path, out: Path) -> Path:
    """`path`'s bf16 checkpoint in fp32 with every routed expert's projection rounded to NVFP4 and
    back (nvfp4.quantize, one per-tensor scale a projection, as the bank quantizes them)."""
    out.mkdir()
    (out / "config.json").write_bytes((path / "config.json").read_bytes())
    tensors = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_tensor(name).float()
            if ".mlp.experts." in name:
                t = nvfp4.dequantize(*nvfp4.quantize(t))
            tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.usefixtures("equal_rates")
def test_a_bf16_checkpoints_experts_are_quantized_to_nvfp4_once(tmp_path):
    """--moe-expert-dtype nvfp4 on a bf16 checkpoint: gate, up and down each quantized once as
    the bank is written, served offloaded as transformers computes the rounded weights."""
    transformers = pytest.importorskip("transformers")
    path = synthesize(tmp_path / "m", preset="tiny", seed=5, routing_skew=0.8)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        rounded_copy(path, tmp_path / "rounded"), dtype=torch.float32
    ).eval()
    ref_tokens, margins = hf_greedy(model, PROMPT, 16)
    engine = make_engine(path, "--moe-expert-dtype", "nvfp4", *OFFLOADED)
    try:
        assert engine.bank.fmt == "nvfp4"
        ours = engine.score(PROMPT)
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))
        assert engine.moe.counters.cpu.sum() > 0
    finally:
        engine.close()
    assert relative_error(ours, hf_logits(model, PROMPT)) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


def test_the_plan_counts_nvfp4s_own_bytes():
    """Qwen3-30B-A3B's geometry as an NVFP4 release on a 12 GiB budget: auto holds its experts
    at 4.5 bits a weight (half a byte, a scale byte per 16, three fp32 scales an expert), so the
    slots and the bank count those bytes (the bound and the split take the bank's, which the
    engine tests above check): nearly twice FP8's slots."""
    from moelab.engine.config.config import EngineConfig
    from moelab.engine.model.synth import make_config

    config = {
        **make_config("qwen3_moe", "qwen3-30b-a3b"),
        "quantization_config": {"quant_method": "modelopt", **QUANT},
    }
    spec = ModelSpec.from_config(config, "m/config.json")
    weights = spec.expert_params
    assert spec.expert_format() == "nvfp4"
    assert spec.expert_bytes == weights // 2 + weights // 16 + 12
    assert spec.expert_pool_bytes == spec.experts_total * spec.expert_bytes

    def plan(expert_dtype: str):
        flags = ["--model-path", "m", "--moe-expert-dtype", expert_dtype]
        request = EngineConfig.from_flags([*flags, "--kv-reserve-tokens", "8192"]).memory_request(
            budget_bytes=12 << 30, elem_bytes=2, cuda=True
        )
        return request.plan(spec)

    nv, fp8 = plan("auto"), plan("fp8")
    assert nv.slot_bytes == spec.expert_bytes
    assert 1.7 < nv.slots / fp8.slots < 2.0


def test_moelab_serve_answers_from_an_nvfp4_checkpoint(tmp_path):
    """A real `moelab serve` process on an NVFP4 checkpoint `moelab synth` wrote, its experts
    offloaded: a completion, and the expert slots reported in NVFP4 at their own bytes."""
    path = synthesize(tmp_path / "m", preset="tiny", seed=21, routing_skew=1.0, dtype="nvfp4")
    engine = serve(path, tmp_path, "--moe-cache-rate", "0.5")
    try:
        assert_offloaded_experts_serve(engine, path, "nvfp4", 16)
    finally:
        stop_engine(engine)


@pytest.mark.parametrize("slots", [0, 3])
def test_an_nvfp4_cache_reports_its_slots_bytes_at_any_size(slots):
    """The what-if prices slots the cache does not have from its slot bytes, so a cache of no
    slots reports them too: half a byte a weight, a byte per 16 and three fp32 scales."""
    from moelab.engine.experts.cache import ExpertCache

    cache = ExpertCache(2, 4, slots, 160, 32, torch.float32, torch.device("cpu"), "nvfp4")
    slot = 3 * 160 * 32 // 2 + 3 * 160 * 32 // 16 + 4 * 3
    assert cache.slot_bytes == slot and cache.nbytes == slots * slot
    assert cache.snapshot()["dtype"] == "nvfp4"
    assert set(cache.kernel_args()) == {"w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"}
