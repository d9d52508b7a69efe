"""`bench decode`'s bound for a hybrid model at Qwen3.6-35B-A3B's geometry: the linear layers'
recurrent states read and written each step, the KV cache of the attention layers alone; and for
gpt-oss, its sliding layers' windows beside the full layers' KV."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moelab.engine.bench.bound import against_the_bound
from moelab.engine.bench.runner import TIMED_FIELDS
from moelab.engine.model.kv import KVCache
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.model.window import WindowPool

# an engine's flags as the bound reads them: the projections in the compute dtype
AUTO = SimpleNamespace(model=SimpleNamespace(dense_dtype="auto"))

transformers = pytest.importorskip(
    "transformers", reason="transformers writes the config (pip install -e '.[test]')"
)

# per sequence: 30 linear layers' DeltaNet states [32, 128, 128] in fp32 (2 MiB each) and conv
# states [3, 8,192] in bf16 (48 KiB each)
STATE_BYTES = 30 * 32 * 128 * 128 * 4 + 30 * 3 * 8192 * 2
# per token: K and V of the 10 attention layers' 2 KV heads of 256, in bf16
KV_TOKEN_BYTES = 10 * 2 * 2 * 256 * 2


def qwen36_spec() -> ModelSpec:
    """Qwen3.6-35B-A3B's text model: transformers' Qwen3.5 MoE defaults (three linear layers to
    each attention one; 16 key and 32 value heads of 128; a convolution of 4), 40 layers, 256
    experts of which 8 routed, its vocabulary and context."""
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=248320,
        num_hidden_layers=40,
        num_experts=256,
        num_experts_per_tok=8,
        max_position_embeddings=262144,
    ).to_dict()
    return ModelSpec.from_config({**config, "torch_dtype": "bfloat16"})


def test_the_hybrid_decode_bound_reads_and_writes_each_sequences_states():
    spec = qwen36_spec()
    assert spec.state_bytes_per_seq == STATE_BYTES == 64_389_120
    kv = KVCache(spec, 1, 16, torch.device("cpu"), torch.bfloat16)
    assert kv.bytes_per_token == KV_TOKEN_BYTES == 20_480  # a quarter of the layers
    bank = SimpleNamespace(expert_bytes=spec.expert_params * 2)
    engine = SimpleNamespace(spec=spec, dtype=torch.bfloat16, kv=kv, bank=bank, config=AUTO)
    layers = spec.num_moe_layers
    counts = {
        k: np.zeros((layers, spec.num_experts), dtype=np.int64)
        for k in ("reads", "hits", "fills", "cpu", "picks")
    }
    counts["reads"][:, :8], counts["hits"][:, :8] = 4, 4  # 4 steps, every route resident
    timed = {"elapsed": 0.1, "counts": counts, **dict.fromkeys(TIMED_FIELDS)}
    rates = {"hbm_gbps": 3000.0, "bp_gbps": 50.0, "host_gbps": 100.0}

    def bound(batch: int, prompt_tokens: int) -> dict:
        args = SimpleNamespace(batch=batch, tokens=4, prompt_tokens=prompt_tokens)
        return against_the_bound(engine, args, timed, rates)

    one, two = bound(1, 32768), bound(2, 32768)
    # each sequence's states, read and written once a step: 122.8 MiB a sequence
    assert one["state_bytes_per_step"] == 2 * STATE_BYTES == 128_778_240
    assert two["state_bytes_per_step"] == 4 * STATE_BYTES
    kv_step = (32768 + 2.5) * KV_TOKEN_BYTES  # the mean context of 4 timed steps
    assert one["kv_bytes_per_step"] == pytest.approx(kv_step)
    dense = (spec.dense_params - spec.vocab_size * spec.hidden_size) * 2
    experts = layers * 8 * bank.expert_bytes  # the 8 routes of each of the 4 steps, resident
    t_min = (dense + kv_step + 2 * STATE_BYTES + experts) / 3000e9
    assert one["bound_tok_s"] == pytest.approx(1 / t_min)
    assert one["hbm_bound_tok_s"] == pytest.approx(1 / t_min)
    # the states are of the step, whatever the context: 1 token of context still reads them
    short = bound(1, 1)
    assert short["state_bytes_per_step"] == one["state_bytes_per_step"]
    assert 1 / short["bound_tok_s"] > (dense + 2 * STATE_BYTES + experts) / 3000e9


def test_the_gpt_oss_decode_bound_reads_the_sliding_layers_windows_alone():
    """gpt-oss-20b: a step reads the 12 full layers' KV of the whole context (24 KiB a token in
    bf16) and the 12 sliding layers' last 128 tokens (3 MiB a sequence), or the context where it
    is shorter."""
    spec = ModelSpec.from_config(make_config("gpt_oss", "gpt-oss-20b"))
    device = torch.device("cpu")
    kv = KVCache(spec, 1, 16, device, torch.bfloat16)
    rings = WindowPool(spec, 1, 16, device, torch.bfloat16)
    assert kv.bytes_per_token == 12 * 2 * 8 * 64 * 2
    window_token = 12 * 2 * 8 * 64 * 2  # a token of the 12 sliding layers
    bank = SimpleNamespace(expert_bytes=spec.expert_params * 2)
    engine = SimpleNamespace(
        spec=spec, dtype=torch.bfloat16, kv=kv, bank=bank, states=rings, config=AUTO
    )
    counts = {
        k: np.zeros((spec.num_moe_layers, spec.num_experts), dtype=np.int64)
        for k in ("reads", "hits", "fills", "cpu", "picks")
    }
    counts["reads"][:, :4], counts["hits"][:, :4] = 4, 4
    timed = {"elapsed": 0.1, "counts": counts, **dict.fromkeys(TIMED_FIELDS)}
    rates = {"hbm_gbps": 3000.0, "bp_gbps": 50.0, "host_gbps": 100.0}

    def kv_step(prompt_tokens: int) -> float:
        args = SimpleNamespace(batch=1, tokens=4, prompt_tokens=prompt_tokens)
        return against_the_bound(engine, args, timed, rates)["kv_bytes_per_step"]

    long = (32768 + 2.5) * kv.bytes_per_token + 128 * window_token
    assert kv_step(32768) == pytest.approx(long)
    assert kv_step(1) == pytest.approx(3.5 * (kv.bytes_per_token + window_token))
