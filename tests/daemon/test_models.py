"""Model discovery: where checkpoints are found and what is read from their config and headers."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from moelab.daemon.catalog import ModelCatalog, model_json
from moelab.daemon.jobs import Jobs
from moelab.daemon.models import (
    ModelRoot,
    default_roots,
    discover,
    read_checkpoint,
    read_safetensors_header,
)
from moelab.daemon.store import Store

from .conftest import asgi_client, make_daemon, synth


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A safetensors file with zero-filled tensors; returns the bytes of tensor data written."""
    sizes = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset


def mixtral_like(directory: Path) -> tuple[int, int]:
    """A 2-layer, 4-expert mixtral-style checkpoint; returns (dense bytes, expert bytes)."""
    directory.mkdir(parents=True)
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
    }
    (directory / "config.json").write_text(json.dumps(config))
    dense, experts = {}, {}
    for layer in range(2):
        dense[f"model.layers.{layer}.self_attn.q_proj.weight"] = ("BF16", [8, 8])
        dense[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = ("BF16", [4, 8])
        for expert in range(4):
            for w in ("w1", "w2", "w3"):
                experts[f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"] = (
                    "BF16",
                    [16, 8],
                )
    dense["model.embed_tokens.weight"] = ("F32", [32, 8])
    # two shards, as big checkpoints come
    dense_bytes = write_safetensors(directory / "model-00001-of-00002.safetensors", dense)
    expert_bytes = write_safetensors(directory / "model-00002-of-00002.safetensors", experts)
    return dense_bytes, expert_bytes


def test_the_demo_checkpoint_is_read_from_config_and_headers(demo_model: Path) -> None:
    checkpoint = read_checkpoint(demo_model, "--models-dir")
    config = json.loads((demo_model / "config.json").read_text())
    assert checkpoint.error is None
    assert checkpoint.architecture == "Qwen3MoeForCausalLM"
    assert checkpoint.num_layers == config["num_hidden_layers"]
    assert checkpoint.num_experts == config["num_experts"]
    assert checkpoint.top_k == config["num_experts_per_tok"]
    assert checkpoint.max_context == config["max_position_embeddings"]
    # every tensor byte is counted once, as dense or as expert
    header = read_safetensors_header(demo_model / "model.safetensors")
    data_bytes = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    assert checkpoint.dense_bytes + checkpoint.expert_bytes == data_bytes
    # qwen3_moe: gate, up and down per expert, in every layer but the mlp_only ones, bf16
    moe_layers = config["num_hidden_layers"] - len(config.get("mlp_only_layers", []))
    per_expert = 3 * config["hidden_size"] * config["moe_intermediate_size"] * 2
    assert checkpoint.expert_bytes == moe_layers * config["num_experts"] * per_expert


def test_expert_and_dense_bytes_of_a_sharded_mixtral_layout(tmp_path: Path) -> None:
    dense, experts = mixtral_like(tmp_path / "mix")
    checkpoint = read_checkpoint(tmp_path / "mix", "~/models")
    assert (checkpoint.dense_bytes, checkpoint.expert_bytes) == (dense, experts)
    assert (checkpoint.num_layers, checkpoint.num_experts, checkpoint.top_k) == (2, 4, 2)
    assert checkpoint.max_context == 32768 and checkpoint.is_moe


def test_shared_experts_count_as_dense(tmp_path: Path) -> None:
    directory = tmp_path / "ds"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"n_routed_experts": 2}))
    write_safetensors(
        directory / "model.safetensors",
        {
            "model.layers.0.mlp.shared_experts.up_proj.weight": ("BF16", [4, 4]),
            "model.layers.0.mlp.shared_expert.up_proj.weight": ("BF16", [4, 4]),
            "model.layers.0.mlp.experts.0.up_proj.weight": ("BF16", [4, 4]),
            "model.layers.0.mlp.experts.gate_up_proj": ("BF16", [2, 4, 8]),
        },
    )
    checkpoint = read_checkpoint(directory, "x")
    assert checkpoint.dense_bytes == 2 * 32
    assert checkpoint.expert_bytes == 32 + 128


def test_discovery_in_nested_folders_and_the_hub_cache(tmp_path: Path, demo_model: Path) -> None:
    home_models = tmp_path / "models"
    mixtral_like(home_models / "mistralai" / "Mixtral-tiny")
    (home_models / "notes").mkdir()
    (home_models / "notes" / "readme.txt").write_text("not a model")
    hub = tmp_path / "hub"
    snapshot = hub / "models--Qwen--Qwen3-tiny" / "snapshots" / "0123456789abcdef"
    shutil.copytree(demo_model, snapshot)
    found = discover([ModelRoot(home_models, "~/models"), ModelRoot(hub, "hf cache", True)])
    by_name = {c.name: c for c in found}
    assert set(by_name) == {"mistralai/Mixtral-tiny", "Qwen/Qwen3-tiny"}
    assert by_name["Qwen/Qwen3-tiny"].source == "hf cache"
    assert by_name["mistralai/Mixtral-tiny"].architecture == "MixtralForCausalLM"


def test_a_damaged_checkpoint_is_listed_with_its_problem(tmp_path: Path, demo_model: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(demo_model, broken)
    (broken / "model.safetensors").write_bytes(b"\x05")
    checkpoint = read_checkpoint(broken, "x")
    assert checkpoint.error is not None and "safetensors" in str(checkpoint.error)
    assert checkpoint.num_experts is not None  # the config part still reads


def edited_copy(demo_model: Path, target: Path, **fields: object) -> Path:
    """The demo checkpoint with fields of its config.json set (None: removed)."""
    shutil.copytree(demo_model, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    kept = {k: v for k, v in config.items() if v is not None}
    (target / "config.json").write_text(json.dumps(kept))
    return target


@pytest.mark.parametrize(
    ("quantization", "method"),
    [
        ({"quant_method": "mxfp4"}, "mxfp4"),
        (
            {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
            "compressed-tensors",
        ),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq"),
    ],
)
def test_a_quantized_checkpoint_is_listed_with_why_it_cannot_be_served(
    tmp_path: Path, demo_model: Path, quantization: dict, method: str
) -> None:
    model = edited_copy(demo_model, tmp_path / method, quantization_config=quantization)
    checkpoint = read_checkpoint(model, "~/models")
    assert checkpoint.error is not None
    error = str(checkpoint.error)
    assert "quantized" in error and f"quant_method {method!r}" in error
    assert checkpoint.num_experts is not None  # listed with what can be read


def test_a_fine_grained_fp8_checkpoint_is_servable_and_other_fp8_layouts_say_why(
    tmp_path: Path, demo_model: Path
) -> None:
    fine = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    model = edited_copy(demo_model, tmp_path / "fine", quantization_config=fine)
    write_safetensors(
        model / "model.safetensors",
        {
            "model.embed_tokens.weight": ("BF16", [4, 4]),
            "model.layers.0.mlp.experts.0.up_proj.weight": ("F8_E4M3", [4, 4]),
            "model.layers.0.mlp.experts.0.up_proj.weight_scale_inv": ("F32", [1, 1]),
        },
    )
    assert read_checkpoint(model, "x").error is None
    per_tensor = edited_copy(
        demo_model, tmp_path / "per-tensor", quantization_config={"quant_method": "fp8"}
    )
    error = str(read_checkpoint(per_tensor, "x").error)
    assert "weight_block_size: per-tensor or per-channel scales" in error


def test_quantized_weights_without_a_quantization_config_are_named(
    tmp_path: Path, demo_model: Path
) -> None:
    model = tmp_path / "fp8"
    model.mkdir()
    shutil.copy(demo_model / "config.json", model)
    write_safetensors(
        model / "model.safetensors",
        {
            "model.embed_tokens.weight": ("BF16", [4, 4]),
            "model.layers.0.mlp.experts.0.up_proj.weight": ("F8_E4M3", [4, 4]),
            "model.layers.0.mlp.experts.0.up_proj.weight_scale_inv": ("F32", [1, 1]),
        },
    )
    error = str(read_checkpoint(model, "x").error)
    assert error is not None
    assert "F8_E4M3 (model.layers.0.mlp.experts.0.up_proj.weight)" in error
    assert "moelab reads BF16, F16, F32, and F8_E4M3 weights where" in error


def test_an_architecture_moelab_does_not_serve_is_listed_with_why(
    tmp_path: Path, demo_model: Path
) -> None:
    model = edited_copy(
        demo_model, tmp_path / "llama", model_type="llama", architectures=["LlamaForCausalLM"]
    )
    error = str(read_checkpoint(model, "x").error)
    assert error is not None and "'llama' is not supported" in error and "qwen3_moe" in error


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("num_experts", "lots", 'config.json: num_experts must be a whole number, not "lots"'),
        ("num_hidden_layers", -2, "config.json: num_hidden_layers must be at least 1, not -2"),
        ("num_experts_per_tok", None, "config.json has no num_experts_per_tok"),
    ],
)
def test_a_config_with_a_wrong_field_is_listed_naming_it(
    tmp_path: Path, demo_model: Path, field: str, value: object, says: str
) -> None:
    model = edited_copy(demo_model, tmp_path / "bad", **{field: value})
    error = str(read_checkpoint(model, "x").error)
    assert error is not None and error.startswith(says)


def test_a_model_that_cannot_be_served_is_refused_before_anything_starts(
    tmp_path: Path, demo_model: Path
) -> None:
    models = tmp_path / "models"
    edited_copy(demo_model, models / "lots", num_experts="lots")
    daemon = make_daemon(tmp_path / "data", models)
    daemon.catalog.rescan()
    (listed,) = [model_json(m) for m in daemon.catalog.list()]
    assert listed["error"] == 'config.json: num_experts must be a whole number, not "lots"'
    client = asgi_client(daemon, "127.0.0.1", "127.0.0.1")
    reply = client.post("/api/servers", json={"model": listed["path"], "flags": []})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "unsupported_model"
    assert error["message"] == (
        'lots cannot be served: config.json: num_experts must be a whole number, not "lots"'
    )
    assert error["message_text"]["template"] == "{name} cannot be served: {error}"
    assert client.get("/api/servers").json()["servers"] == []
    daemon.close()


def test_a_download_cut_short_is_listed_with_its_problem(tmp_path: Path, demo_model: Path) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(demo_model, cut)
    weights = cut / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 4096)
    error = str(read_checkpoint(cut, "x").error)
    assert error == (
        f"the safetensors files cannot be read: model.safetensors is cut short ({size - 4096} of "
        f"the {size} bytes its header describes): download it again"
    )


def test_default_roots_follow_home_and_hf_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    roots = default_roots([tmp_path / "extra"], tmp_path / "data")
    assert [(r.path, r.source) for r in roots] == [
        (tmp_path / "home" / "models", "~/models"),
        (tmp_path / "hf" / "hub", "hf cache"),
        (tmp_path / "extra", "--models-dir"),
        (tmp_path / "data" / "models", "data dir"),
    ]


def test_the_catalog_marks_vanished_models_and_keeps_their_rows(tmp_path: Path) -> None:
    mixtral_like(tmp_path / "models" / "a")
    mixtral_like(tmp_path / "models" / "b")
    store = Store(tmp_path / "mgr.sqlite3")
    catalog = ModelCatalog(
        store, [ModelRoot(tmp_path / "models", "--models-dir")], tmp_path, Jobs()
    )
    assert [m.name for m in catalog.rescan()] == ["a", "b"]
    shutil.rmtree(tmp_path / "models" / "b")
    assert [m.name for m in catalog.rescan()] == ["a"]
    everything = catalog.list(include_missing=True)
    assert {(m.name, m.present) for m in everything} == {("a", True), ("b", False)}
    assert catalog.ensure_demo() is None  # there is a model, so no demo is written
    store.close()


@pytest.mark.slow
def test_the_demo_model_is_written_when_there_are_no_models(tmp_path: Path) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    jobs = Jobs()
    catalog = ModelCatalog(store, [ModelRoot(tmp_path / "models", "data dir")], tmp_path, jobs)
    assert catalog.rescan() == []
    job = catalog.ensure_demo()
    assert job is not None and jobs.wait(job, 300)
    assert job.status == "done", job.error
    models = catalog.list()
    assert [m.is_demo for m in models] == [True]
    assert models[0].architecture == "Qwen3MoeForCausalLM"
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "models").iterdir())
    store.close()


def test_synth_helper_writes_a_sharded_checkpoint_that_sums_the_same(
    tmp_path: Path, demo_model: Path
) -> None:
    sharded = synth(tmp_path / "sharded", "--shard-size", "300000")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = read_checkpoint(demo_model, "x"), read_checkpoint(sharded, "x")
    assert (a.dense_bytes, a.expert_bytes) == (b.dense_bytes, b.expert_bytes)
