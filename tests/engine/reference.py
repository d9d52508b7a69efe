"""Reference models built with transformers' own classes, and the comparisons against them."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from moelab.engine.config.config import EngineConfig
from moelab.engine.experts import miss_plan
from moelab.engine.experts.h2d import address_of, host_functions
from moelab.engine.experts.miss_plan import LayerPlanner
from moelab.engine.runtime.engine import Engine
from moelab.engine.runtime.graphs import DecodeGraphs
from moelab.engine.runtime.sampling import SamplingParams

HF_CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def hf_config(arch: str, **geometry):
    """A small transformers config of `arch`; geometry keys use the moelab preset names."""
    import transformers

    g = dict(
        vocab_size=97,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=12,
        num_experts_per_tok=3,
        moe_intermediate_size=20,
        intermediate_size=40,
        rope_theta=10000.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    g.update(geometry)
    common = dict(
        vocab_size=g["vocab_size"],
        hidden_size=g["hidden_size"],
        num_hidden_layers=g["num_hidden_layers"],
        num_attention_heads=g["num_attention_heads"],
        num_key_value_heads=g["num_key_value_heads"],
        head_dim=g["head_dim"],
        num_experts_per_tok=g["num_experts_per_tok"],
        rope_theta=g["rope_theta"],
        max_position_embeddings=g["max_position_embeddings"],
        rms_norm_eps=g["rms_norm_eps"],
        tie_word_embeddings=g.get("tie_word_embeddings", False),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if "rope_scaling" in g:
        common["rope_scaling"] = g["rope_scaling"]
    config_cls = getattr(transformers, HF_CLASSES[arch][0])
    if arch == "gpt_oss":
        del common["rope_theta"]
        rope = {"rope_type": "default", "rope_theta": g["rope_theta"]}
        return config_cls(
            **common,
            num_local_experts=g["num_experts"],
            intermediate_size=g["moe_intermediate_size"],
            sliding_window=g.get("sliding_window", 8),
            layer_types=g.get("layer_types"),
            swiglu_limit=g.get("swiglu_limit", 7.0),
            rope_parameters=g.get("rope_parameters", rope),
        )
    if arch == "qwen3_moe":
        return config_cls(
            **common,
            num_experts=g["num_experts"],
            moe_intermediate_size=g["moe_intermediate_size"],
            intermediate_size=g["intermediate_size"],
            norm_topk_prob=g.get("norm_topk_prob", True),
            mlp_only_layers=g.get("mlp_only_layers", [1]),
            decoder_sparse_step=g.get("decoder_sparse_step", 1),
        )
    if arch == "qwen2_moe":
        return config_cls(
            **common,
            num_experts=g["num_experts"],
            moe_intermediate_size=g["moe_intermediate_size"],
            intermediate_size=g["intermediate_size"],
            shared_expert_intermediate_size=g.get("shared_expert_intermediate_size", 36),
            norm_topk_prob=g.get("norm_topk_prob", False),
            mlp_only_layers=g.get("mlp_only_layers", []),
            decoder_sparse_step=g.get("decoder_sparse_step", 2),
        )
    if arch == "mixtral":
        return config_cls(
            **common,
            num_local_experts=g["num_experts"],
            intermediate_size=g["moe_intermediate_size"],
            sliding_window=None,
        )
    return config_cls(
        **common,
        num_experts=g["num_experts"],
        intermediate_size=g["moe_intermediate_size"],
        norm_topk_prob=g.get("norm_topk_prob", False),
    )


def scale_up_weights(model, seed: int) -> None:
    """Re-draw every weight at unit gain (transformers' 0.02 init gives nearly flat logits)."""
    gen = torch.Generator().manual_seed(seed)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight") or name.endswith("router.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / math.sqrt(p.shape[-1]))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                # gpt_oss stores its experts [E, in, out]
                transposed = model.config.model_type == "gpt_oss" and name.endswith("_proj")
                fan_in = p.shape[-2] if transposed else p.shape[-1]
                std = 1 / math.sqrt(fan_in)
                if any(k in name for k in ("o_proj", "down_proj", ".w2")):
                    std /= math.sqrt(layers)
                if "embed_tokens" in name:
                    std = 1.0
                if "lm_head" in name:
                    std *= 3
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_reference(arch: str, out: Path, seed: int = 0, **geometry):
    """Save a scaled-up random transformers model of `arch` to `out`; return it (fp32, eval)."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **geometry)
    model = getattr(transformers, HF_CLASSES[arch][1])(config).float().eval()
    scale_up_weights(model, seed)
    model.save_pretrained(out)
    return model


# MOELAB_TEST_DEVICE=cuda runs the engine tests on a GPU (pinned bank, streams, CUDA graphs)
DEVICE = os.environ.get("MOELAB_TEST_DEVICE", "cpu")


def make_engine(path: Path, *flags: str) -> Engine:
    config = EngineConfig.from_flags(
        [
            "--model-path",
            str(path),
            "--device",
            DEVICE,
            "--dtype",
            "float32",
            "--moe-cpu-threads",
            "1",
            "--bank-dir",
            str(path / "bank"),
            *flags,
        ]
    )
    return Engine(config)


# The native planner's own decisions, which it takes only with its copies (on CUDA) and the
# Python planner never does: a split miss and a copy ahead of the routing (each frees a slot the
# Python plan keeps, and a split counts its expert on the CPU). Off where the two planners are
# compared.
NO_SPLIT, NO_COPY_AHEAD = ("--no-split-misses",), ("--moe-copy-ahead", "0")


def decode_with_each_planner(
    monkeypatch: pytest.MonkeyPatch,
    path: Path,
    prompts: list[list[int]],
    tokens: int,
    *flags: str,
    split_misses: bool = False,
) -> list[tuple]:
    """Greedy decodes of `prompts` by two fresh engines with `flags` (an offloaded placement),
    NO_COPY_AHEAD and, unless `split_misses`, NO_SPLIT: one whose decode steps the native
    planner plans, one whose the Python planner plans (`LayerPlanner.native` answering None);
    per engine its outputs, its counters (reads, hits, fills, CPU experts and picks per layer),
    its cache's (hits, fills, evictions) and its misses split. On the CPU device the native
    planner takes its CUDA path all the same (`take_the_cuda_path`), as on a GPU. Skips where
    the native CPU kernel did not build."""
    same = NO_COPY_AHEAD if split_misses else (*NO_COPY_AHEAD, *NO_SPLIT)
    runs = []
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(LayerPlanner, "native", lambda self: None)
            engine = make_engine(path, *flags, *same)
            try:
                if engine.cpu is None or engine.cpu.kernel != "native":
                    pytest.skip("the native CPU kernel did not build here")
                calls: dict[str, int] = {}
                if native and DEVICE == "cpu":
                    stand_ins = take_the_cuda_path(patch, engine, calls)
                assert (engine.moe.planner.native() is not None) == native
                outputs = engine.generate(prompts, SamplingParams(max_tokens=tokens,
                                                                  ignore_eos=True))  # fmt: skip
                if native and DEVICE == "cpu":
                    assert calls.get("copy", 0) > 0 and stand_ins, "no fill took the CUDA path"
                c, cache = engine.moe.counters, engine.cache
                counters = [a.tolist() for a in (c.reads, c.hits, c.fills, c.cpu, c.picks)]
                splits = engine.moe.stats.staged_times.split_misses
                runs.append((outputs, counters, (cache.hits, cache.fills, cache.evictions), splits))
            finally:
                engine.close()
    return runs


def take_the_cuda_path(patch: pytest.MonkeyPatch, engine: Engine, calls: dict[str, int]) -> tuple:
    """Have a CPU engine's offloaded decode steps take the native planner's CUDA path: replayed
    from stand-in graphs of pieces (test_graphs.ReplayGraph), each layer step staged between two
    by one native call that waits, plans, starts the CPU job and queues the fills, through
    stand-ins of the driver's functions on host memory (`h2d.host_functions`, counting their
    calls in `calls`). Returns the stand-ins, to keep alive while the engine runs."""
    from .test_graphs import ReplayGraph  # test_graphs imports this module

    functions = host_functions(calls)
    addresses = tuple(address_of(f) for f in functions)
    patch.setattr(miss_plan, "driver_functions", lambda: addresses)
    graphs = DecodeGraphs(
        engine.model, 4, engine.max_context, piecewise=True, graph_factory=ReplayGraph
    )
    graphs.capture()
    engine.stepper.graphs = graphs
    planner = engine.moe.planner
    planner.copies = True
    planner._native = None  # made again, with the stand-ins
    return functions


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int, processors=None) -> tuple[list[int], list[float]]:
    """Greedy continuation (full recompute each step) and the top-2 margin at each step; with
    Hugging Face logits `processors` applied to each step's logits first (the prompt and the
    tokens so far as their input ids), the margins then the processed ones'."""
    ids = list(ids)
    out, margins = [], []
    for _ in range(n):
        logits = hf_logits(model, ids)[-1]
        if processors is not None:
            logits = processors(torch.tensor([ids]), logits[None].clone())[0]
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
    return out, margins


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over the largest reference value (the engine's on the test device,
    transformers' on the CPU)."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max())


def assert_same_greedy(ours: list[int], ref: list[int], margins: list[float]) -> None:
    """Identical tokens wherever the reference's top-2 margin is clear; stop at a near tie."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if margins[i] <= 1e-3:
            return
        assert a == b, f"token {i}: moelab {a} != reference {b} (margin {margins[i]:.4f})"
