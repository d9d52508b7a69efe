"""Loading checkpoints: layouts (per-expert, fused, sharded), dtypes, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelab.engine.model.spec import CheckpointError, ModelSpec

from .reference import build_reference, hf_logits, make_engine, relative_error

pytest.importorskip(
    "transformers", reason="transformers is the reference (pip install -e '.[test]')"
)

IDS = list(range(5, 60, 2))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    model = build_reference("qwen3_moe", path, seed=4)
    return model, path


def _fuse_experts(src, dst, num_layers: int, num_experts: int) -> None:
    """Rewrite a per-expert checkpoint with fused experts.gate_up_proj [E, 2I, H] tensors."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for layer in range(num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        if p + "0.gate_proj.weight" not in tensors:
            continue
        gate_up, down = [], []
        for e in range(num_experts):
            gate_up.append(
                torch.cat(
                    [tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")]
                )
            )
            down.append(tensors.pop(f"{p}{e}.down_proj.weight"))
        out[p + "gate_up_proj"] = torch.stack(gate_up)
        out[p + "down_proj"] = torch.stack(down)
    out.update(tensors)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_fused_expert_layout_loads_the_same(qwen, tmp_path):
    model, path = qwen
    config = model.config
    _fuse_experts(path, tmp_path / "fused", config.num_hidden_layers, config.num_experts)
    engine = make_engine(tmp_path / "fused")
    try:
        assert relative_error(engine.score(IDS), hf_logits(model, IDS)) < 1e-4
    finally:
        engine.close()


def test_sharded_checkpoint_loads_the_same(tmp_path):
    model = build_reference("mixtral", tmp_path / "src", seed=5)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    engine = make_engine(tmp_path / "sharded")
    try:
        assert relative_error(engine.score(IDS), hf_logits(model, IDS)) < 1e-4
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(qwen, tmp_path, dtype):
    model, path = qwen
    tensors = {k: v.to(dtype) for k, v in load_file(str(path / "model.safetensors")).items()}
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    engine = make_engine(tmp_path, "--dtype", "auto")
    try:
        assert engine.bank.dtype == torch.float32  # the config says float32; auto keeps it
        # upcast from half precision: close to the fp32 reference, not equal
        assert relative_error(engine.score(IDS), hf_logits(model, IDS)) < 5e-2
    finally:
        engine.close()


def _broken_copy(src, dst, *, drop=None, reshape=None, config_edit=None):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_tensor_is_named(qwen, tmp_path):
    _, path = qwen
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    bad = _broken_copy(path, tmp_path / "b", drop=name)
    with pytest.raises(CheckpointError, match=f"no tensor {name}"):
        make_engine(bad)


def test_misshaped_tensor_is_named(qwen, tmp_path):
    _, path = qwen
    name = "model.layers.2.self_attn.k_proj.weight"
    bad = _broken_copy(path, tmp_path / "b", reshape=name)
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[15, 48\], expected \[16, 48\]"):
        make_engine(bad)


def test_unsupported_architecture_and_missing_fields(qwen, tmp_path):
    _, path = qwen

    def llama(config):
        config["model_type"] = "llama"
        config["architectures"] = ["LlamaForCausalLM"]

    bad = _broken_copy(path, tmp_path / "a", config_edit=llama)
    with pytest.raises(CheckpointError, match=r"'llama' is not supported.*qwen3_moe"):
        make_engine(bad)
    bad = _broken_copy(path, tmp_path / "b", config_edit=lambda c: c.pop("num_experts_per_tok"))
    with pytest.raises(CheckpointError, match="no num_experts_per_tok"):
        make_engine(bad)
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        ModelSpec.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("num_experts", "lots", 'num_experts must be a whole number, not "lots"'),
        ("num_hidden_layers", -2, "num_hidden_layers must be at least 1, not -2"),
        ("hidden_size", 64.5, "hidden_size must be a whole number, not 64.5"),
        ("rms_norm_eps", "small", 'rms_norm_eps must be a number, not "small"'),
        ("mlp_only_layers", "all", 'mlp_only_layers must be a list, not "all"'),
        ("rope_scaling", [1, 2], "rope_scaling must be a JSON object, not [1, 2]"),
    ],
)
def test_a_field_of_the_wrong_type_is_named_with_the_file(qwen, tmp_path, field, value, says):
    _, path = qwen
    bad = _broken_copy(path, tmp_path / "b", config_edit=lambda c: c.update({field: value}))
    expected = f"{bad / 'config.json'}: {says}"
    with pytest.raises(CheckpointError) as read:
        ModelSpec.from_dir(bad)
    assert str(read.value) == expected
    with pytest.raises(CheckpointError) as loaded:  # the engine's own load says the same
        make_engine(bad)
    assert str(loaded.value) == expected


@pytest.mark.parametrize(
    ("quantization", "says"),
    [
        ({"quant_method": "awq", "bits": 4}, r"quantization_config, quant_method 'awq'"),
        (
            {"quant_method": "compressed-tensors"},
            r"quantization_config, quant_method 'compressed-tensors'",
        ),
        (
            {"quant_method": "fp8"},
            r"quantization_config weight_block_size: per-tensor or per-channel scales",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [1, 128]},
            r"quantization_config weight_block_size: \[1, 128\]",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"},
            r'quantization_config fmt: "e5m2"',
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            r'quantization_config activation_scheme: "static"',
        ),
    ],
)
def test_unsupported_quantization_is_refused_naming_what_was_found(
    qwen, tmp_path, quantization, says
):
    _, path = qwen
    bad = _broken_copy(
        path, tmp_path / "q", config_edit=lambda c: c.update(quantization_config=quantization)
    )
    with pytest.raises(CheckpointError, match=r"config\.json " + says):
        make_engine(bad)


def test_not_safetensors_is_refused(qwen, tmp_path):
    _, path = qwen
    bad = tmp_path / "junk"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00" * 4 + b"garbage")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        make_engine(bad)


def test_real_qwen3_30b_config_is_understood():
    # the config.json published with Qwen/Qwen3-30B-A3B (fields that matter)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
        "eos_token_id": 151645,
        "bos_token_id": 151643,
        "use_sliding_window": False,
    }
    spec = ModelSpec.from_config(config)
    assert spec.num_moe_layers == 48 and spec.qk_norm == "head" and spec.eos_token_ids == (151645,)
    assert spec.expert_bytes == 3 * 2048 * 768 * 2
    assert spec.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
