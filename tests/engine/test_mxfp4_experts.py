"""--moe-expert-dtype mxfp4: a bf16 or FP8 checkpoint's experts quantized once into an MXFP4 bank
(blocks and E8M0 scales, kernels/mxfp4.py), served against transformers on the same weights
rounded to MXFP4 and back, resident and offloaded; the bytes the plan and the stats count."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moelab.engine.config.config import EngineConfig
from moelab.engine.model.spec import CheckpointError, ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from moelab.kernels import mxfp4

from .reference import (
    assert_same_greedy,
    decode_with_each_planner,
    hf_greedy,
    hf_logits,
    make_engine,
    relative_error,
)

PROMPT = list(range(5, 29))
OFFLOADED = ["--moe-cache-size", "6", "--moe-miss-policy", "split:0.5"]


@pytest.fixture(autouse=True)
def equal_rates(monkeypatch):
    """Bp = Bh, so the split policy runs misses on the CPU and by copies on any machine."""
    import moelab.engine.runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "measure_bp_gbps", lambda bank, device: 10.0)
    monkeypatch.setattr(engine_module, "measure_bh_gbps", lambda runner, bank: 10.0)


def rounded_copy(path: Path, out: Path) -> Path:
    """`path`'s checkpoint in fp32 with every routed expert's weights rounded to MXFP4 and back
    (blocks of 32 along each weight's input dimension, as the bank blocks them)."""
    out.mkdir()
    shutil.copy(path / "config.json", out / "config.json")
    tensors = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_tensor(name).float()
            if ".mlp.experts." in name:
                t = mxfp4.dequantize(*mxfp4.quantize(t))
            tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A bf16 qwen3_moe checkpoint and transformers' model of its experts rounded to MXFP4."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("mxfp4")
    path = synthesize(root / "m", preset="tiny", seed=5, routing_skew=0.8)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        rounded_copy(path, root / "rounded"), dtype=torch.float32
    ).eval()
    ref_tokens, margins = hf_greedy(model, PROMPT, 24)
    return path, model, hf_logits(model, PROMPT), ref_tokens, margins


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_mxfp4_experts_match_transformers_on_the_rounded_weights(checkpoint, placement):
    path, _model, ref_logits, ref_tokens, margins = checkpoint
    flags = ["--moe-cache-rate", "1.0"] if placement == "resident" else OFFLOADED
    engine = make_engine(path, "--moe-expert-dtype", "mxfp4", *flags)
    try:
        spec = engine.spec
        assert engine.bank.fmt == "mxfp4" and engine.bank.w13[0].dtype == torch.uint8
        assert engine.cache.w13.dtype == torch.uint8
        assert engine.cache.slot_bytes == engine.bank.expert_bytes == spec.expert_bytes_as("mxfp4")
        assert engine.cache.snapshot()["dtype"] == "mxfp4"
        assert engine.cache.holds_everything == (placement == "resident")
        ours = engine.score(PROMPT)
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))
        if placement == "offloaded":
            counters = engine.moe.counters
            assert counters.fills.sum() > 0 and counters.cpu.sum() > 0
    finally:
        engine.close()
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


def test_the_native_planner_decodes_an_mxfp4_bank_as_the_python_planner_does(
    checkpoint, monkeypatch
):
    """An MXFP4 bank's offloaded decode steps are planned by the native planner (its blocks and
    scales copied and its CPU jobs run as an FP8 bank's factors are), with the Python planner's
    plans: the same tokens, the same hits, fills and CPU experts per layer."""
    path, *_ = checkpoint
    prompts = [PROMPT, PROMPT[:9]]
    native, python = decode_with_each_planner(
        monkeypatch, path, prompts, 12, "--moe-expert-dtype", "mxfp4", *OFFLOADED
    )
    assert native == python
    _, (_, _, fills, cpu, _), *_ = native
    assert sum(fills) > 0 and sum(cpu) > 0


def test_prefill_streamed_from_an_mxfp4_bank_matches(checkpoint):
    path, _model, ref_logits, *_ = checkpoint
    engine = make_engine(path, "--moe-expert-dtype", "mxfp4", "--moe-cache-size", "6")
    try:
        engine.moe.prefill_stream_min_tokens = 1  # every prefill chunk streams whole layers
        assert engine.moe.prefill.allocated
        ours = engine.score(PROMPT)
    finally:
        engine.close()
    assert relative_error(ours, ref_logits) < 1e-4


def test_the_mxfp4_bank_is_written_once_and_read_back(checkpoint):
    """A file of its own beside the bf16 bank (its key names the format), a quarter of its
    bytes and a scale per 32 weights; a second start maps it without writing it again."""
    path, *_ = checkpoint
    engine = make_engine(path, "--moe-expert-dtype", "mxfp4", "--moe-cache-size", "6")
    try:
        first = engine.score(PROMPT)
        bank_path = engine.bank.path
        spec = engine.spec
        assert engine.bank.nbytes == spec.experts_total * 3 * 64 * 32 * 17 // 32
    finally:
        engine.close()
    written = bank_path.stat().st_mtime_ns
    plain = make_engine(path, "--moe-expert-dtype", "bf16", "--moe-cache-size", "6")
    try:
        assert plain.bank.path != bank_path and plain.bank.fmt == "bf16"
    finally:
        plain.close()
    again = make_engine(path, "--moe-expert-dtype", "mxfp4", "--moe-cache-size", "6")
    try:
        assert again.bank.path == bank_path and again.bank.fmt == "mxfp4"
        assert torch.equal(again.score(PROMPT), first)
    finally:
        again.close()
    assert bank_path.stat().st_mtime_ns == written


def test_an_fp8_checkpoints_experts_are_quantized_to_mxfp4_too(tmp_path):
    """FP8 experts widened and rounded to MXFP4 once: the logits stay within the 4-bit rounding
    of the FP8 ones."""
    path = synthesize(tmp_path / "fp8", preset="tiny", seed=6, dtype="fp8",
                      overrides={"moe_intermediate_size": 128, "hidden_size": 160})  # fmt: skip
    logits = {}
    for dtype in ("fp8", "mxfp4"):
        engine = make_engine(path, "--moe-expert-dtype", dtype, "--moe-cache-size", "6")
        try:
            assert engine.bank.fmt == dtype
            logits[dtype] = engine.score(PROMPT)
        finally:
            engine.close()
    assert 1e-4 < relative_error(logits["mxfp4"], logits["fp8"]) < 0.2


def test_mxfp4_needs_sizes_in_whole_blocks_and_says_so():
    config = {**make_config("qwen3_moe", "tiny"), "moe_intermediate_size": 40}
    spec = ModelSpec.from_config(config, "m/config.json")
    assert spec.expert_format("fp8") == "fp8"
    with pytest.raises(CheckpointError, match=r"--moe-expert-dtype mxfp4 .* multiples of 32"):
        spec.expert_format("mxfp4")


def test_the_plan_buys_about_twice_the_slots_of_fp8():
    """The Qwen3-30B-A3B geometry on a 12 GiB budget: an expert's bytes are 4.25 bits a weight,
    so the same memory holds about twice FP8's slots, in the bytes the slots count."""
    spec = ModelSpec.from_config(make_config("qwen3_moe", "qwen3-30b-a3b"))

    def plan(expert_dtype: str):
        config = EngineConfig.from_flags(
            ["--model-path", "m", "--moe-expert-dtype", expert_dtype, "--kv-reserve-tokens", "8192"]
        )
        return config.memory_request(budget_bytes=12 << 30, elem_bytes=2, cuda=True).plan(spec)

    assert spec.expert_bytes_as("mxfp4") == spec.expert_params * 17 // 32
    bf16, fp8, fp4 = plan("bf16"), plan("fp8"), plan("mxfp4")
    assert fp4.slot_bytes == spec.expert_bytes_as("mxfp4")
    assert 1.8 < fp4.slots / fp8.slots < 2.2
    assert fp8.slots > bf16.slots


def test_the_flag_and_the_benchmark_offer_mxfp4():
    from moelab.engine.config.args import TUNABLE

    config = EngineConfig.from_flags(["--model-path", "m", "--moe-expert-dtype", "mxfp4"])
    assert config.model.expert_dtype == "mxfp4"
    [tunable] = [t for t in TUNABLE if t.flag == "--moe-expert-dtype"]
    assert "mxfp4" in tunable.values
