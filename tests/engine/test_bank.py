"""The host expert bank: final layout, prepacked file, RAM refusal, pinning fallback, plan log."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from moelab.engine.config.memory import log_plan, plan_vram
from moelab.engine.experts import bank as bank_module
from moelab.engine.experts.bank import HostMemoryError, load_bank, map_prepacked
from moelab.engine.model.checkpoint import SafetensorsSource, iter_layer_experts
from moelab.engine.model.spec import ModelSpec
from moelab.engine.synth_checkpoint import synthesize


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("bank"), preset="tiny", seed=31)


def test_bank_holds_each_expert_contiguously_as_stored(model, tmp_path):
    spec = ModelSpec.from_dir(model)
    source = SafetensorsSource(model)
    bank = load_bank(spec, source, torch.float32, bank_dir=tmp_path, pin=False)
    assert len(list(tmp_path.glob("*.bank.safetensors"))) == 1
    for m, layer in enumerate(spec.moe_layers):
        for e, gate_up, down, *_ in iter_layer_experts(spec, source, layer):
            assert bank.w13[m][e].is_contiguous() and bank.w2[m][e].is_contiguous()
            assert torch.equal(bank.w13[m][e], gate_up.float())
            assert torch.equal(bank.w2[m][e], down.float())
    again = load_bank(spec, source, torch.float32, bank_dir=tmp_path, pin=False)
    assert again.path == bank.path and torch.equal(again.w13[-1], bank.w13[-1])


def test_a_bank_larger_than_ram_is_refused_with_the_numbers(model, tmp_path, monkeypatch):
    import psutil

    gib = 1024**3
    monkeypatch.setattr(
        psutil, "virtual_memory", lambda: SimpleNamespace(total=gib, available=gib // 2)
    )
    spec = ModelSpec.from_dir(model)
    huge = spec.__class__(
        **{
            **spec.to_dict(),
            "num_experts": 4096,
            "moe_intermediate_size": 4096,
            "moe_layers": spec.moe_layers,
        }
    )
    with pytest.raises(
        HostMemoryError, match=r"needs \d+\.\d+ GiB of host RAM but this machine has"
    ):
        load_bank(huge, SafetensorsSource(model), torch.bfloat16, bank_dir=tmp_path, pin=True)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_pinning_failure_falls_back_to_pageable_memory_per_layer(
    model, tmp_path, monkeypatch, caplog
):
    spec = ModelSpec.from_dir(model)
    source = SafetensorsSource(model)
    path = load_bank(spec, source, torch.float32, bank_dir=tmp_path, pin=False).path
    calls = []

    def pin_some(t):
        calls.append(t.shape)
        if len(calls) > 2:  # the first layer pins, later ones hit the host's page-lock limit
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        return t.clone()

    monkeypatch.setattr(bank_module, "_pinned_copy", pin_some)
    with caplog.at_level(logging.WARNING, logger="moelab.bank"):
        bank = map_prepacked(spec, torch.float32, path, pin=True)
    assert bank.pinned == [True] + [False] * (bank.num_layers - 1)
    assert "pinning host memory failed at MoE layer 1" in caplog.text
    assert torch.equal(
        bank.w13[-1], load_bank(spec, source, torch.float32, bank_dir=tmp_path, pin=False).w13[-1]
    )


def test_the_context_trap_is_logged_with_the_way_out(caplog):
    from moelab.engine.model.synth import make_config

    spec = ModelSpec.from_config(make_config("qwen3_moe", "qwen3-30b-a3b"))
    plan = plan_vram(
        spec,
        budget_bytes=24 * 1024**3,
        weights_bytes=spec.dense_params * 2,
        elem_bytes=2,
        kv_reserve_tokens=8192,
        block_size=16,
        prefill_chunk_tokens=2048,
        max_running=8,
        headroom_bytes=0,
        cache_size=2000,
    )
    with caplog.at_level(logging.INFO, logger="moelab.memory"):
        log_plan(plan)
    assert plan.max_context == 8192 < spec.max_position_embeddings
    assert "usable context is 8192 tokens but the model supports 40960" in caplog.text
    assert "--kv-reserve-tokens 40960" in caplog.text


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "nvfp4"])
def test_a_bank_filled_on_several_threads_holds_the_bytes_of_one(fmt):
    """The experts are converted on torch's intra-op threads' worth of threads, an expert each:
    the bank's bytes are those of one thread converting them in turn, and torch's thread count
    is given back."""
    from moelab.engine.experts.bank import build_in_memory
    from moelab.engine.model.synth import SynthSource, make_config

    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny", {"num_experts": 24}))
    banks, before = [], torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            source = SynthSource(spec, seed=3, skew=1.0)
            banks.append(build_in_memory(spec, source, torch.bfloat16, pin=False, fmt=fmt))
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    one, several = banks
    for kind in ("w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"):
        assert len(getattr(one, kind)) == len(getattr(several, kind)), kind
        for a, b in zip(getattr(one, kind), getattr(several, kind), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), kind
