"""ModelOpt's plain FP8 checkpoints (NVIDIA's `-FP8` releases: quant_algo FP8, every Linear of
the decoder that the exclusions do not name stored as per-tensor FP8): the engine reads each
module as a MIXED_PRECISION module of FP8, keeps the experts FP8 where its blocks hold them
exactly, widens the rest as they load, and serves them as transformers computes the same weights
dequantized here from the format's definition."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moelab.daemon.models import read_checkpoint
from moelab.engine.model.checkpoint import SafetensorsSource
from moelab.engine.model.spec import CheckpointError, ModelSpec
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize

from .reference import assert_same_greedy, make_engine, relative_error
from .test_modelopt_mixed import (
    OFFLOADED,
    PROMPT,
    copy_beside_weights,
    equal_rates,  # noqa: F401 (a fixture, used by name)
    fp8_per_tensor,
    reference,
    save_export,
)

# one attention projection named by the exclusions, and so stored unquantized
KEPT = "model.layers.1.self_attn.o_proj"
# as ModelOpt lists its exclusions: names, and patterns with `*`
EXCLUDED = ["lm_head", "model.layers.*.mlp.gate", KEPT]


def quantized(module: str, excluded: list[str]) -> bool:
    """Whether this test's export quantizes a module: every projection (attention, experts)
    the exclusions do not name; the routers, lm_head, embeddings and norms stay as they are."""
    last = module.rsplit(".", 1)[-1]
    return "proj" in last and module not in excluded


def write_fp8(
    plain: Path,
    out: Path,
    *,
    hf_quant_config: bool = False,
    excluded: list[str] = EXCLUDED,
    kv_cache: str | None = None,
) -> Path:
    """`plain` as ModelOpt exports quant_algo FP8: each quantized Linear's weight e4m3 beside
    an fp32 `weight_scale` of one value and an `input_scale` (and with `kv_cache` FP8 the
    attention's `k_scale` and `v_scale`), in config.json's quantization_config (`ignore`) or,
    with `hf_quant_config`, only in hf_quant_config.json (`exclude_modules`)."""
    copy_beside_weights(plain, out)
    tensors = {}
    with safe_open(str(plain / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_tensor(name)
            module = name.removesuffix(".weight")
            if not (name.endswith(".weight") and quantized(module, excluded)):
                tensors[name] = t
                continue
            tensors[name], tensors[name + "_scale"] = fp8_per_tensor(t)
            tensors[module + ".input_scale"] = torch.tensor(1.0)
            if kv_cache and module.endswith(("self_attn.k_proj", "self_attn.v_proj")):
                tensors[module + "." + module[-6] + "_scale"] = torch.tensor(0.5)
    scheme = {"quant_algo": "FP8", "kv_cache_quant_algo": kv_cache}
    save_export(plain, out, tensors, scheme, excluded, hf_quant_config=hf_quant_config,
                version="0.37.0")  # fmt: skip
    return out


@pytest.fixture(scope="module", params=[(128, "fp8"), (32, "bf16")], ids=["I128", "I32"])
def exported(request, tmp_path_factory):
    """A qwen3_moe checkpoint of moe_intermediate_size I in plain FP8, written both ways (its
    scheme in config.json, and in hf_quant_config.json with an FP8 KV cache), the experts kept
    FP8 by auto or widened, and transformers' logits and greedy continuation on its dequantized
    weights."""
    intermediate, kept = request.param
    root = tmp_path_factory.mktemp(f"fp8_{intermediate}")
    plain = synthesize(root / "bf16", arch="qwen3_moe", preset="tiny", seed=3, routing_skew=0.8,
                       overrides={"moe_intermediate_size": intermediate})  # fmt: skip
    paths = {
        "config": write_fp8(plain, root / "config"),
        "hf": write_fp8(plain, root / "hf", hf_quant_config=True, kv_cache="FP8"),
    }
    return paths, kept, *reference(paths["config"], root / "ref")


@pytest.mark.usefixtures("equal_rates")
@pytest.mark.parametrize("placement", ["resident", "offloaded"])
@pytest.mark.parametrize("where", ["config", "hf"])
def test_plain_fp8_serves_as_transformers_computes(exported, caplog, placement, where):
    """Every projection FP8 but the excluded one: auto keeps the experts FP8 (the bank in
    float8_e4m3fn) where I is a multiple of 128, else widens them; the logits and greedy tokens
    are transformers' on the dequantized weights, resident and offloaded."""
    paths, kept, ref_logits, ref_tokens, margins = exported
    path = paths[where]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor(KEPT + ".weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
    assert read_checkpoint(path, "x").error is None
    spec = ModelSpec.from_dir(path)
    assert spec.expert_format() == kept
    flags = ["--moe-cache-rate", "1.0"] if placement == "resident" else OFFLOADED
    with caplog.at_level(logging.INFO, logger="moelab.engine"):
        engine = make_engine(path, *flags)
    try:
        assert engine.bank.fmt == kept
        want = torch.float8_e4m3fn if kept == "fp8" else engine.dtype
        assert engine.bank.w13[0].dtype == engine.bank.w2[0].dtype == want
        ours = engine.score(PROMPT)
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))
        if placement == "offloaded":
            assert engine.moe.counters.fills.sum() > 0 and engine.moe.counters.cpu.sum() > 0
    finally:
        engine.close()
    said = [r.getMessage() for r in caplog.records if "ModelOpt" in r.getMessage()]
    how = (
        "kept FP8, each 128x128 block's factor the tensor's"
        if kept == "fp8"
        else "widened to the compute dtype (moe_intermediate_size 32 is not a multiple of 128: "
        "FP8 blocks would round them again)"
    )
    assert said[0] == (
        f"ModelOpt FP8 checkpoint: FP8 per-tensor experts {how} (--moe-expert-dtype auto)"
    )
    kv = [s for s in said if "kv_cache_quant_algo" in s]
    assert kv == (
        ["ModelOpt kv_cache_quant_algo FP8: the checkpoint's KV scales are not read "
         "(--kv-cache-dtype fp8 computes its own factor per token and KV head; auto keeps the "
         "compute dtype)"] if where == "hf" else []
    )  # fmt: skip
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


def test_plain_fp8_experts_widen_on_request(exported):
    paths, _, ref_logits, ref_tokens, margins = exported
    engine = make_engine(paths["config"], "--moe-expert-dtype", "bf16", "--moe-cache-size", "6")
    try:
        assert engine.bank.fmt == "bf16"
        ours = engine.score(PROMPT)
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))
    finally:
        engine.close()
    assert relative_error(ours, ref_logits) < 1e-4
    assert_same_greedy(tokens, ref_tokens, margins)


def test_routers_ModelOpt_never_quantizes_need_no_exclusion(tmp_path):
    """An exclusion list naming only lm_head (the routers left out, as ModelOpt never quantizes
    them): the bf16 routers are read as they are, the projections as FP8."""
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=2)
    path = write_fp8(plain, tmp_path / "q", excluded=["lm_head"])
    spec = ModelSpec.from_dir(path)
    source = SafetensorsSource(path, spec)
    router = "model.layers.1.mlp.gate.weight"
    with safe_open(str(plain / "model.safetensors"), framework="pt") as f:
        assert torch.equal(source.get(router), f.get_tensor(router))


@pytest.mark.parametrize(
    ("excluded", "said"),
    [
        # a Linear not excluded, stored bf16
        (["lm_head", "model.layers.*.mlp.gate"],
         f"{KEPT}.weight is BF16 but quant_algo FP8 makes its module FP8 (a Linear its "
         f"exclusions do not name), stored as F8_E4M3 beside an F32 {KEPT}.weight_scale of one "
         "value"),
        # an excluded module, stored FP8
        ([*EXCLUDED, "model.layers.2.mlp.experts"],
         "model.layers.2.mlp.experts.0.down_proj.weight is F8_E4M3 but quant_algo FP8 makes its "
         "module unquantized (excluded, or a module ModelOpt does not quantize), stored as BF16, "
         "F16 or F32"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("where", ["config", "hf"])
def test_weights_stored_otherwise_than_the_config_says_are_refused(tmp_path, excluded, said, where):
    """The weights written with EXCLUDED, the config saying `excluded`: the first weight that
    disagrees is named."""
    plain = synthesize(tmp_path / "bf16", arch="qwen3_moe", preset="tiny", seed=2)
    path = write_fp8(plain, tmp_path / "q", hf_quant_config=where == "hf")
    if where == "hf":
        written = json.loads((path / "hf_quant_config.json").read_text())
        written["quantization"]["exclude_modules"] = excluded
        (path / "hf_quant_config.json").write_text(json.dumps(written))
    else:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"]["ignore"] = excluded
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as refused:
        SafetensorsSource(path, ModelSpec.from_dir(path))
    assert str(refused.value) == (
        said + "; the checkpoint's weights and its quantization config disagree: export it again"
    )
