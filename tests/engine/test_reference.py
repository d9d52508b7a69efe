"""The engine's forward against transformers' own implementations of the four architectures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelab.engine.model.model import SeqSlice, StepBatch
from moelab.engine.runtime.sampling import SamplingParams

from .reference import (
    DEVICE,
    assert_same_greedy,
    build_reference,
    hf_greedy,
    hf_logits,
    make_engine,
    relative_error,
)

pytest.importorskip(
    "transformers", reason="transformers is the reference (pip install -e '.[test]')"
)

# odd sizes, one KV head, top-1 and top-k > 2: nothing tuned to one shape
GEOMETRIES = {
    "qwen3_moe": dict(
        hidden_size=56,
        num_attention_heads=7,
        num_key_value_heads=1,
        head_dim=10,
        num_experts=13,
        num_experts_per_tok=3,
        norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        hidden_size=40,
        num_attention_heads=5,
        num_key_value_heads=5,
        head_dim=8,
        num_experts=9,
        num_experts_per_tok=1,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        num_experts=10,
        num_experts_per_tok=2,
    ),
    "olmoe": dict(
        hidden_size=36,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=12,
        num_experts=11,
        num_experts_per_tok=4,
        norm_topk_prob=False,
    ),
}


def prompt(seed: int, n: int, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(GEOMETRIES))
def reference(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    model = build_reference(arch, path, seed=len(arch), **GEOMETRIES[arch])
    engine = make_engine(path)
    yield arch, model, engine, path
    engine.close()


def test_logits_match_reference(reference):
    arch, model, engine, _ = reference
    ids = prompt(1, 37)
    ours, ref = engine.score(ids), hf_logits(model, ids)
    assert ours.shape == ref.shape
    assert relative_error(ours, ref) < 1e-4, arch


def test_greedy_continuation_matches_and_is_varied(reference):
    arch, model, engine, _ = reference
    ids = prompt(2, 11)
    picked: dict[int, set[int]] = {}
    engine.model.on_router = lambda layer, x, e: picked.setdefault(layer, set()).update(
        e.flatten().tolist()
    )
    try:
        [ours] = engine.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))
    finally:
        engine.model.on_router = None
    ref, margins = hf_greedy(model, ids, 32)
    assert_same_greedy(ours, ref, margins)
    assert len(set(ours)) >= 8, f"{arch}: continuation is not varied: {ours}"
    num_experts = engine.spec.num_experts
    for layer, experts in picked.items():
        assert len(experts) >= num_experts // 2, f"{arch} layer {layer} routed to {experts}"


def test_penalized_greedy_continuation_matches_transformers_processors(reference):
    """A logit bias and a repetition penalty at temperature 0: the engine's host sampler against
    Hugging Face's SequenceBias and RepetitionPenalty processors, in the same order."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    _arch, model, engine, _ = reference
    ids = prompt(3, 11)
    params = SamplingParams(
        max_tokens=24, ignore_eos=True, repetition_penalty=1.8, logit_bias=((7, 1.5),)
    )
    [ours] = engine.generate([ids], params)
    processors = LogitsProcessorList(
        [SequenceBiasLogitsProcessor({(7,): 1.5}), RepetitionPenaltyLogitsProcessor(1.8)]
    )
    ref, margins = hf_greedy(model, ids, 24, processors)
    assert_same_greedy(ours, ref, margins)
    plain, _ = hf_greedy(model, ids, 24)
    assert ref != plain  # the adjustments changed the continuation


def test_batch_of_different_lengths_matches_alone(reference):
    _arch, model, engine, _ = reference
    prompts = [prompt(10 + i, n) for i, n in enumerate((3, 17, 9, 30))]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    for ids, ours in zip(prompts, outputs, strict=True):
        ref, margins = hf_greedy(model, ids, 20)
        assert_same_greedy(ours, ref, margins)


def test_prefill_in_chunks_matches(reference):
    _arch, model, _engine, path = reference
    engine = make_engine(path, "--prefill-chunk-tokens", "7")
    try:
        ids = prompt(3, 40)
        [ours] = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.close()
    ref, margins = hf_greedy(model, ids, 12)
    assert_same_greedy(ours, ref, margins)


def test_a_prompt_continued_from_the_prefix_cache_matches(reference):
    """A second turn (the first prompt, its reply and more) takes the first turn's KV pages from
    the prefix cache, its reply's included, and continues as transformers does from scratch."""
    _arch, model, engine, _ = reference
    first = prompt(4, 40)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    [reply] = engine.generate([first], params)
    second = first + reply + prompt(5, 9)
    seq = engine.add(second, params)
    engine.run_until_idle()
    # pages of 16: the first prompt and its reply computed 59 tokens, 3 whole pages
    assert seq.cached_tokens == 48
    ref, margins = hf_greedy(model, second, 20)
    assert_same_greedy(seq.output_ids, ref, margins)


def _spec_variant(engine, **changes):
    engine.model.spec = dataclasses.replace(engine.spec, **changes)
    engine.spec = engine.model.spec


def test_comparison_catches_wrong_topk_normalisation(reference):
    _arch, model, _engine, path = reference
    engine = make_engine(path)
    try:
        _spec_variant(engine, norm_topk_prob=not engine.spec.norm_topk_prob)
        ids = prompt(1, 37)
        assert relative_error(engine.score(ids), hf_logits(model, ids)) > 1e-3
    finally:
        engine.close()


def test_comparison_catches_wrong_rope_theta(reference):
    _arch, model, _engine, path = reference
    engine = make_engine(path)
    try:
        from moelab.engine.model.rope import Rotary

        wrong = dataclasses.replace(engine.spec, rope_theta=engine.spec.rope_theta * 2)
        engine.model.rotary = Rotary(wrong, 512, engine.device, engine.dtype)
        ids = prompt(1, 37)
        assert relative_error(engine.score(ids), hf_logits(model, ids)) > 1e-3
    finally:
        engine.close()


def test_comparison_catches_dropped_shared_expert_gate(tmp_path):
    model = build_reference("qwen2_moe", tmp_path, seed=3, **GEOMETRIES["qwen2_moe"])
    engine = make_engine(tmp_path)
    try:
        for layer in engine.model.weights.layers:
            if layer.shared_gate is not None:
                layer.shared_gate.fill_(1e4)  # sigmoid(gate) == 1: the gate has no effect
        ids = prompt(1, 37)
        assert relative_error(engine.score(ids), hf_logits(model, ids)) > 1e-3
    finally:
        engine.close()


@pytest.mark.parametrize("chunk", [None, 6], ids=["whole-prompts", "prompts-in-chunks"])
def test_fused_attention_matches_reference(tmp_path, chunk):
    """Power-of-two heads take the fused q/k-norm + rotary + KV-write path, in decode and in
    prefill (whose attention then reads the keys back from the cache); in chunks of 6 tokens a
    prompt's later chunks attend to the pages its earlier ones wrote."""
    geometry = dict(GEOMETRIES["qwen3_moe"], head_dim=16, num_key_value_heads=7)
    model = build_reference("qwen3_moe", tmp_path, seed=4, **geometry)
    flags = ("--prefill-chunk-tokens", str(chunk)) if chunk else ()
    engine = make_engine(tmp_path, *flags)
    try:
        assert engine.model._fused_qk
        prompts = [prompt(20 + i, n) for i, n in enumerate((5, 13, 22))]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        scored = prompt(30, 19)
        logits = engine.score(scored)
    finally:
        engine.close()
    for ids, ours in zip(prompts, outputs, strict=True):
        ref, margins = hf_greedy(model, ids, 24)
        assert_same_greedy(ours, ref, margins)
    assert relative_error(logits, hf_logits(model, scored)) < 1e-4


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (MOELAB_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("head_dim", [16, 10], ids=["fused-qk", "unfused-qk"])
@pytest.mark.parametrize("cached", [0, 11], ids=["whole-prompt", "after-cached-tokens"])
def test_resident_prefill_never_waits_for_the_device(tmp_path, head_dim, cached):
    """With every expert resident, a prefill's forward is launches only: the host runs ahead of
    the device through all its layers (torch raises on a sync in this mode)."""
    geometry = dict(GEOMETRIES["qwen3_moe"], head_dim=head_dim, num_key_value_heads=7)
    build_reference("qwen3_moe", tmp_path, seed=5, **geometry)
    engine = make_engine(tmp_path)
    try:
        assert engine.cache.holds_everything
        kv, dev, n = engine.kv, engine.device, 30
        blocks = kv.allocate(kv.blocks_for(cached + n))
        new = range(cached, cached + n)
        batch = StepBatch(
            input_ids=torch.tensor(prompt(40, n), device=dev),
            positions=torch.tensor(list(new), device=dev),
            slots=torch.tensor([kv.slot(blocks, p) for p in new], device=dev),
            seqs=[SeqSlice(0, n, cached + n, kv.page_indices([(blocks, cached + n)])[0])],
            logits_index=torch.tensor([n - 1], device=dev),
        )
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = engine.model.forward(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(logits).all()
        kv.release(blocks)
    finally:
        engine.close()


def test_a_prompts_scores_are_transformers_log_softmax_in_any_chunks(reference):
    """prompt_logprobs: each prompt token's log probability given the tokens before it, with the
    likeliest tokens', as transformers' log-softmax over one pass, whatever the chunking."""
    _arch, model, _engine, path = reference
    ids = prompt(6, 30)
    expected = torch.log_softmax(hf_logits(model, ids), dim=-1)
    for chunk in ("7", "2048"):
        engine = make_engine(path, "--prefill-chunk-tokens", chunk)
        try:
            # a cached prefix first: a scored prompt computes every token anyway
            engine.generate([ids], SamplingParams(max_tokens=1))
            seq = engine.add(ids, SamplingParams(max_tokens=1, prompt_logprobs=3))
            engine.run_until_idle()
        finally:
            engine.close()
        assert seq.cached_tokens == 0
        assert [e.token for e in seq.prompt_logprobs] == ids[1:]
        for p, entry in enumerate(seq.prompt_logprobs):
            assert entry.logprob == pytest.approx(expected[p, ids[p + 1]].item(), abs=1e-4)
            values, tokens = expected[p].topk(3)
            assert [t for t, _ in entry.top] == tokens.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
