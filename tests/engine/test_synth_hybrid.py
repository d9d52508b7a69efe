"""`moelab synth` for the hybrid architectures (Qwen3-Next, Qwen3.5/3.6 MoE in both layouts):
what transformers reads of the checkpoints, the FP8 layout, the real geometries, the chat
template."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moelab.engine.cli import main
from moelab.engine.config.memory import state_bytes_per_seq
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize

from .reference import make_engine, relative_error
from .test_fp8 import dequantize_checkpoint

transformers = pytest.importorskip("transformers")

HYBRID = ["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"]


@pytest.fixture(scope="module", params=HYBRID)
def written(request, tmp_path_factory):
    arch = request.param
    return arch, synthesize(tmp_path_factory.mktemp(arch), arch=arch, preset="tiny", seed=2)


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (a safetensors handle)
    return out


def test_transformers_loads_every_tensor_synth_writes(written):
    """AutoModelForCausalLM reads the checkpoint with no tensor missing, left over or mis-shaped,
    and the weights it holds are the ones written (experts fused by its own conversion)."""
    arch, path = written
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert type(model).__name__ == {"qwen3_next": "Qwen3NextForCausalLM"}.get(
        arch, "Qwen3_5MoeForCausalLM"
    )
    written_tensors = _tensors(path)
    prefix = "model.language_model." if arch == "qwen3_5_moe" else "model."
    state = model.state_dict()
    for name in ("layers.0.linear_attn.conv1d.weight", "layers.0.linear_attn.A_log",
                 "layers.3.self_attn.q_proj.weight", "layers.2.mlp.gate.weight",
                 "layers.1.linear_attn.out_proj.weight"):  # fmt: skip
        assert torch.equal(state["model." + name], written_tensors[prefix + name].float()), name
    # zero-centred norms hold 0 (transformers multiplies by 1 + w), the gated norm 1
    assert not state["model.layers.0.input_layernorm.weight"].any()
    assert (state["model.layers.0.linear_attn.norm.weight"] == 1).all()
    assert state["model.layers.3.self_attn.q_proj.weight"].shape[0] == 2 * 4 * 16  # output gate
    with torch.no_grad():
        logits = model(torch.tensor([list(range(3, 40))])).logits[0]
    assert torch.isfinite(logits).all() and logits.std() > 1.0  # peaked, not flat


def test_the_multimodal_layout_carries_a_vision_tower_and_its_tokens(tmp_path):
    path = synthesize(tmp_path / "mm", arch="qwen3_5_moe", preset="tiny")
    config = json.loads((path / "config.json").read_text())
    assert (
        config["model_type"] == "qwen3_5_moe" and config["vision_config"]["out_hidden_size"] == 64
    )
    model, info = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    written_tensors = _tensors(path)
    assert torch.equal(
        model.state_dict()["model.visual.blocks.0.attn.qkv.weight"],
        written_tensors["model.visual.blocks.0.attn.qkv.weight"].float(),
    )
    tok = Tokenizer(path)
    for field, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                         ("vision_start_token_id", "<|vision_start|>")):  # fmt: skip
        assert config[field] == tok.token_to_id(token) < config["text_config"]["vocab_size"]
    spec = ModelSpec.from_dir(path)
    assert spec.arch == "qwen3_5_moe" and spec.text_prefix == "model.language_model."


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_fp8_writes_the_linear_weights_in_blocks_and_keeps_the_rest(arch, tmp_path):
    """--dtype fp8: the projections and experts F8_E4M3 with their block factors; convolutions,
    norms, the per-head b/a projections, routers, shared expert gates, the vision tower and lm_head
    as they were, named in modules_to_not_convert; dequantized, transformers reads it whole."""
    # I = 128: gate and up keep their own blocks in the bank (docs/models.md, weight formats)
    path = synthesize(tmp_path / arch, arch=arch, preset="tiny", dtype="fp8",
                      overrides={"moe_intermediate_size": 128})  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    keep = config["quantization_config"]["modules_to_not_convert"]
    spec = ModelSpec.from_dir(path)
    assert spec.quantization == "fp8"
    tensors = _tensors(path)
    p = spec.text_prefix
    fp8 = {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    assert all(n + "_scale_inv" in tensors for n in fp8)
    assert p + "layers.0.linear_attn.out_proj.weight" in fp8
    assert p + "layers.3.self_attn.q_proj.weight" in fp8
    assert p + "layers.2.mlp.experts.5.down_proj.weight" in fp8
    for name in ("layers.0.linear_attn.conv1d.weight", "layers.0.linear_attn.norm.weight",
                 "layers.0.mlp.gate.weight", "layers.0.mlp.shared_expert_gate.weight"):  # fmt: skip
        assert tensors[p + name].dtype == torch.bfloat16, name
        assert (p + name).removesuffix(".weight") in keep
    small = "in_proj_ba" if arch == "qwen3_next" else "in_proj_b"
    assert tensors[f"{p}layers.0.linear_attn.{small}.weight"].dtype == torch.bfloat16
    if arch == "qwen3_5_moe":
        assert "model.visual" in keep
        assert tensors["model.visual.blocks.0.attn.qkv.weight"].dtype == torch.bfloat16
    plain = dequantize_checkpoint(path, tmp_path / "plain")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        plain, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    # the engine serves the FP8 checkpoint as transformers computes its dequantized weights
    engine = make_engine(path)
    try:
        ids = list(range(3, 40))
        ours = engine.score(ids)
        with torch.no_grad():
            ref = model.eval()(torch.tensor([ids])).logits[0]
        assert relative_error(ours, ref) < 1e-4
    finally:
        engine.close()


def test_the_real_geometries():
    """qwen3.6-35b-a3b: Qwen3.6-35B-A3B's 40 layers, 30 DeltaNet + 10 attention, 256 experts with
    8 routed and 1 shared, 262,144 tokens; 35 B parameters, 3 B active. qwen3-next-80b-a3b: 80 B,
    3 B active. transformers' config classes take both configs."""
    config = make_config("qwen3_5_moe", "qwen3.6-35b-a3b")
    spec = ModelSpec.from_config(config)
    assert (spec.num_layers, len(spec.linear_layers), len(spec.attention_layers)) == (40, 30, 10)
    assert spec.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert (spec.num_experts, spec.top_k, spec.shared_expert_intermediate_size) == (256, 8, 512)
    assert spec.max_position_embeddings == 262144 and spec.vocab_size == 248320
    total = spec.dense_params + spec.experts_total * spec.expert_params
    active = spec.dense_params + spec.num_moe_layers * spec.top_k * spec.expert_params
    assert 34e9 < total < 36e9 and 3.0e9 < active < 3.6e9, (total, active)
    parsed = transformers.Qwen3_5MoeConfig(**config)
    assert parsed.text_config.layer_types == list(spec.layer_types)
    assert parsed.text_config.num_experts == 256
    nxt = make_config("qwen3_next", "qwen3-next-80b-a3b")
    spec = ModelSpec.from_config(nxt)
    total = spec.dense_params + spec.experts_total * spec.expert_params
    active = spec.dense_params + spec.num_moe_layers * spec.top_k * spec.expert_params
    assert 79e9 < total < 81e9 and 3.0e9 < active < 4.0e9, (total, active)
    assert transformers.Qwen3NextConfig(**nxt).layer_types == list(spec.layer_types)


def test_a_real_geometry_without_weights_takes_its_architecture_from_the_preset(tmp_path):
    out = tmp_path / "q36"
    assert main(["synth", "--out", str(out), "--preset", "qwen3.6-35b-a3b", "--no-weights"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert not list(out.glob("*.safetensors"))
    assert "<think>" in json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    with pytest.raises(ValueError, match="qwen3_5_moe or qwen3_5_moe_text"):
        make_config("qwen3_moe", "qwen3.6-35b-a3b")


def test_qwen3_5_chat_template_thinks_and_calls_tools_in_xml(tmp_path):
    path = synthesize(tmp_path / "t", arch="qwen3_5_moe_text", preset="tiny", weights=False)
    tok = Tokenizer(path)
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": schema}}]  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Open a.txt"},
        {"role": "assistant", "content": "", "reasoning_content": "I should read it.",
         "tool_calls": [{"type": "function", "function": {"name": "read_file",
                                                          "arguments": {"path": "a.txt"}}}]},
        {"role": "tool", "content": "hello"},
    ]  # fmt: skip
    text = tok.apply_chat_template(messages, tools=tools)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following")
    assert '"name": "read_file"' in text and "Be brief.<|im_end|>" in text
    assert (
        "<|im_start|>assistant\n<think>\nI should read it.\n</think>\n\n\n<tool_call>\n"
        "<function=read_file>\n<parameter=path>\na.txt\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nhello\n</tool_response>\n<|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    # a turn before the last user message drops its reasoning; thinking can be switched off
    later = [*messages, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": "Thanks"}]  # fmt: skip
    text = tok.apply_chat_template(later, tools=tools, enable_thinking=False)
    assert "I should read it." not in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_engine_serves_what_synth_writes_as_transformers_does(written):
    """The engine reads each layout synth writes and agrees with transformers on it (bf16 weights
    upcast to fp32 on both sides); its /v1/stats report the state pool the plan reserved."""
    arch, path = written
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path)
    try:
        ids = list(range(3, 40))
        ours = engine.score(ids)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        assert relative_error(ours, ref) < 1e-4
        [out] = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(out) == 8
        stats = engine.telemetry.stats(running=0, queued=0, model_name=arch)
        per_seq = state_bytes_per_seq(engine.spec, 4)  # float32 on the CPU
        running = engine.config.batching.max_running_requests
        kept = engine.config.memory.state_checkpoints  # rows for the prefix cache's checkpoints
        assert stats["kv"]["states"] == {"linear_layers": 3, "bytes_per_seq": per_seq,
                                         "slots_total": running, "slots_used": 0,
                                         "bytes": (running + 1 + kept) * per_seq}  # fmt: skip
        assert stats["memory"]["device"][0]["states"] == engine.plan.state_bytes
        assert stats["experts"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    finally:
        engine.close()


def test_dummy_weights_of_a_multimodal_config_are_the_weights_synth_writes(tmp_path):
    """--dummy-weights builds a multimodal checkpoint's decoder under its own names
    (model.language_model.*), calibrated as synth calibrated the written one."""
    path = synthesize(tmp_path / "mm", arch="qwen3_5_moe", preset="tiny", routing_skew=1.0)
    written, dummy = make_engine(path), make_engine(path, "--dummy-weights")
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        prompts = [[5, 6, 7, 8], list(range(40, 60))]
        assert written.generate(prompts, params) == dummy.generate(prompts, params)
    finally:
        written.close()
        dummy.close()
