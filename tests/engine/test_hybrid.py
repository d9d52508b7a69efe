"""Qwen3-Next and Qwen3.5/3.6 MoE (both layouts) against transformers' own implementations:
Gated DeltaNet layers over the state pool, gated attention with partial rotary, zero-centred norms
and the shared expert, resident and offloaded, batch 1 and mixed batches."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moelab.engine.model.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moelab.engine.model.synth_tokenizer import write_tokenizer_files
from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.process.launch import stop_engine
from moelab.engine.runtime.graphs import DecodeGraphs
from moelab.engine.runtime.sampling import SamplingParams
from moelab.kernels import fp8

from .reference import (
    DEVICE,
    assert_same_greedy,
    hf_greedy,
    hf_logits,
    make_engine,
    relative_error,
    scale_up_weights,
)
from .served import serve
from .test_fp8 import dequantize_checkpoint
from .test_graphs import OFFLOADED, ReplayGraph, piecewise_engine
from .test_tool_calls import ScriptedWorker, served

transformers = pytest.importorskip(
    "transformers", reason="transformers is the reference (pip install -e '.[test]')"
)

L, F = LINEAR_ATTENTION, FULL_ATTENTION
VOCAB = 97
# odd head counts per key head, a convolution of 4, two attention layers between linear ones:
# nothing tuned to one shape
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=40,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=7,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
    shared_expert_intermediate_size=20,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    layer_types=[L, F, L, L, F],
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
KINDS = ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"]
CHUNK = "24"  # prefill chunk tokens: the long prompt takes more than two


def build_hybrid(kind: str, path, seed: int = 0, **geometry):
    """A scaled-up random transformers model of `kind` (TEXT's geometry, and `geometry`) saved
    to `path` (fp32, eval)."""
    torch.manual_seed(seed)
    text = {**TEXT, **geometry}
    if kind == "qwen3_next":
        config = transformers.Qwen3NextConfig(**text, intermediate_size=24)
        model = transformers.Qwen3NextForCausalLM(config)
    elif kind == "qwen3_5_moe_text":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    else:
        vision = dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=40
        )
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    model = model.float().eval()
    # (the multimodal model's decoder geometry is in its text_config)
    decoder = getattr(model.config, "text_config", model.config)
    scale_up_weights(SimpleNamespace(config=decoder, named_parameters=model.named_parameters), seed)
    model.save_pretrained(path)
    return model


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=KINDS)
def reference(request, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    # (seeds whose models transformers' own chunked and token-by-token paths agree on to 1e-5:
    # a random model can have a DeltaNet head whose output nearly cancels at some token, where
    # any two orders of fp32 arithmetic differ by more)
    model = build_hybrid(kind, path, seed=KINDS.index(kind) + 2)
    engine = make_engine(path, "--prefill-chunk-tokens", CHUNK)
    yield kind, model, engine, path
    engine.close()


def test_logits_match_reference(reference):
    kind, model, engine, _ = reference
    assert engine.spec.attention_layers == (1, 4) and engine.spec.linear_layers == (0, 2, 3)
    ids = prompt(1, 150)  # more than two of the DeltaNet's chunks of 64
    ours, ref = engine.score(ids), hf_logits(model, ids)
    assert ours.shape == ref.shape
    assert relative_error(ours, ref) < 1e-4, kind


def test_greedy_continuation_of_a_long_prompt_matches(reference):
    """A prompt of more than two prefill chunks, then decode steps from the state slot."""
    kind, model, engine, _ = reference
    ids = prompt(2, 61)
    [ours] = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))
    ref, margins = hf_greedy(model, ids, 24)
    assert_same_greedy(ours, ref, margins)
    assert len(set(ours)) >= 6, f"{kind}: continuation is not varied: {ours}"
    assert engine.states.used_slots == 0  # the finished sequence gave its slot back


def test_batch_of_different_lengths_matches_alone(reference):
    """Sequences of different lengths prefilled and decoded together, each in its own slot."""
    _kind, model, engine, _ = reference
    prompts = [prompt(10 + i, n) for i, n in enumerate((3, 50, 9, 30))]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for ids, ours in zip(prompts, outputs, strict=True):
        ref, margins = hf_greedy(model, ids, 16)
        assert_same_greedy(ours, ref, margins)


def test_offloaded_experts_match(reference):
    """Two expert slots of 35: most experts run from the host bank, prefill and decode."""
    kind, model, _engine, path = reference
    engine = make_engine(path, "--prefill-chunk-tokens", CHUNK, "--moe-cache-size", "2")
    try:
        assert not engine.plan.all_resident
        ids = prompt(1, 150)
        assert relative_error(engine.score(ids), hf_logits(model, ids)) < 1e-4, kind
        prompts = [prompt(20, 55), prompt(21, 7)]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        _reads, misses = engine.moe.decode_reads
        assert misses > 0  # the offloaded path ran
    finally:
        engine.close()
    for ids, ours in zip(prompts, outputs, strict=True):
        ref, margins = hf_greedy(model, ids, 16)
        assert_same_greedy(ours, ref, margins)


def run_recorded(engine, ids: list[int], n: int, boundaries: tuple[int, ...] = ()):
    """One request of `n` greedy tokens run alone, and the logits [vocab] its prompt ended with
    (the first step's that gives any: the prefill step that completes the prompt)."""
    rows = []
    forward = engine.model.forward

    def recording(batch):
        logits = forward(batch)
        rows.append(logits.detach().clone())
        return logits

    engine.model.forward = recording
    try:
        seq = engine.add(ids, SamplingParams(max_tokens=n, ignore_eos=True), boundaries=boundaries)
        engine.run_until_idle()
    finally:
        del engine.model.forward
    return seq, next(row for row in rows if len(row))[0]


def assert_as_full_prefill(model, ids: list[int], seq, logits: torch.Tensor) -> None:
    """The logits the prompt ended with are those transformers gives from the whole prompt
    (within 1e-4), and so are the greedy tokens after them."""
    assert relative_error(logits, hf_logits(model, ids)[-1]) < 1e-4
    ref, margins = hf_greedy(model, ids, len(seq.output_ids))
    assert_same_greedy(seq.output_ids, ref, margins)


def test_a_second_turn_resumes_from_the_first_turns_state_checkpoint(reference):
    """The first turn keeps the state where its last message ends (token 37, kept at 32: whole
    pages of 16); the second turn (the first, its reply and more) takes those pages and that
    state, prefills the rest, and gives transformers' tokens and logits from the whole prompt."""
    _kind, model, engine, _ = reference
    first = prompt(4, 40)
    kept = engine.states.checkpoints_kept
    one, _ = run_recorded(engine, first, 10, boundaries=(37,))
    assert engine.states.checkpoints_kept == kept + 1
    second = first + one.output_ids + prompt(5, 9)
    seq, logits = run_recorded(engine, second, 12)
    assert seq.cached_tokens == 32
    assert_as_full_prefill(model, second, seq, logits)


def test_resuming_from_a_wrong_state_gives_other_logits(reference):
    """Zeroing the kept checkpoints after the first turn changes the second turn's logits: the
    comparison above sees the state the second turn resumes from."""
    _kind, model, engine, _ = reference
    first = prompt(6, 40)
    run_recorded(engine, first, 4, boundaries=(40,))
    pool, spare = engine.states, engine.states.pad_slot + 1
    pool.conv[:, spare:].zero_()
    pool.recurrent[:, spare:].zero_()
    second = first + prompt(7, 9)
    seq, logits = run_recorded(engine, second, 4)
    assert seq.cached_tokens == 32
    assert relative_error(logits, hf_logits(model, second)[-1]) > 1e-2


def test_a_prompt_that_parts_inside_a_checkpointed_span_resumes_before_it(reference):
    """Checkpoints at 16 and 32 tokens: a prompt that differs at token 20 resumes at 16, one
    that differs at token 5 at none, and both continue as transformers from the whole prompt."""
    _kind, model, engine, _ = reference
    first = prompt(8, 45)
    run_recorded(engine, first, 2, boundaries=(19, 40))
    for at, cached in ((20, 16), (5, 0)):
        other = list(first)
        other[at] = (other[at] + 1) % VOCAB
        seq, logits = run_recorded(engine, other + prompt(9, 6), 8)
        assert seq.cached_tokens == cached, at
        assert_as_full_prefill(model, other + prompt(9, 6), seq, logits)


def test_the_least_recently_used_checkpoint_goes_first(reference):
    """Two checkpoints of room: a third prompt's checkpoint takes the place of the one least
    recently kept or resumed from, whose prompt is then prefilled whole; a long prompt keeps one
    every --state-checkpoint-interval tokens."""
    _kind, model, _engine, path = reference
    engine = make_engine(path, "--prefill-chunk-tokens", CHUNK, "--state-checkpoints", "2",
                         "--state-checkpoint-interval", "32")  # fmt: skip
    try:
        a, b, c = prompt(40, 40), prompt(41, 40), prompt(42, 40)
        for ids in (a, b):
            run_recorded(engine, ids, 1)  # each keeps its state at 32
        again, _ = run_recorded(engine, [*a, 1, 2], 1)  # resumes from a's: now the most recent
        assert again.cached_tokens == 32
        run_recorded(engine, c, 1)  # takes b's room
        assert engine.states.checkpoints_held == 2
        # (b's last: its prompt, prefilled whole, keeps its state again in the oldest's room)
        cached = {
            name: run_recorded(engine, [*ids, 3], 1)[0].cached_tokens
            for name, ids in (("a", a), ("c", c), ("b", b))
        }
        assert cached == {"b": 0, "a": 32, "c": 32}
        long = prompt(43, 100)  # states kept at 32, 64 and 96
        run_recorded(engine, long, 1)
        seq, logits = run_recorded(engine, long[:70] + prompt(44, 5), 6)
        assert seq.cached_tokens == 64
        assert_as_full_prefill(model, long[:70] + prompt(44, 5), seq, logits)
    finally:
        engine.close()


def test_without_state_checkpoints_a_repeated_prompt_is_prefilled_again(reference):
    """--state-checkpoints 0: nothing to resume a state from, so the prefix cache is off and a
    second turn is prefilled whole, and still continues as transformers."""
    _kind, model, _engine, path = reference
    engine = make_engine(path, "--prefill-chunk-tokens", CHUNK, "--state-checkpoints", "0")
    try:
        assert not engine.kv.prefix_cache
        first = prompt(4, 40)
        one, _ = run_recorded(engine, first, 6, boundaries=(37,))
        second = first + one.output_ids + prompt(5, 9)
        seq, logits = run_recorded(engine, second, 6)
    finally:
        engine.close()
    assert seq.cached_tokens == 0 and engine.states.checkpoints_held == 0
    assert_as_full_prefill(model, second, seq, logits)


def test_comparison_catches_a_missed_state_carry(reference, monkeypatch):
    """Zeroing the states before every step (as if no slot carried them from one prefill chunk
    or decode step to the next) changes the tokens: the comparisons above see the carry."""
    _kind, _model, engine, _ = reference
    ids = prompt(6, 60)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [ours] = engine.generate([ids], params)
    original = engine.model._linear_attention

    def forgetful(index, layer, x, batch):
        for s in batch.seqs:
            for pool in engine.states.layer(index):
                pool[s.state_slot].zero_()
        return original(index, layer, x, batch)

    monkeypatch.setattr(engine.model, "_linear_attention", forgetful)
    [wrong] = engine.generate([ids], params)
    assert wrong != ours


def test_the_multimodal_layout_skips_the_vision_encoder_with_a_note(tmp_path, caplog):
    build_hybrid("qwen3_5_moe", tmp_path)
    with caplog.at_level(logging.INFO, logger="moelab.engine"):
        engine = make_engine(tmp_path)
    engine.close()
    notes = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(notes) == 1 and "the vision encoder" in notes[0], notes


@pytest.mark.skipif(DEVICE != "cpu", reason="replays stand-in graphs on the CPU device")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_replayed_decode_steps_carry_each_rows_state_slot(reference, overlap):
    """Decode steps replayed from captured whole steps read each row's state slot from the
    graphs' input buffer (three sequences in the size-4 graphs: a padding row advances the
    pool's spare slot, never a sequence's) and give the eager steps' tokens."""
    _kind, _model, engine, path = reference
    prompts = [prompt(30, 33), prompt(31, 5), prompt(32, 12)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = engine.generate(prompts, params)
    flags = () if overlap else ("--no-overlap-decode",)
    replayed = make_engine(path, "--prefill-chunk-tokens", CHUNK, *flags)
    try:
        replayed.cache.device_slot_map()
        graphs = DecodeGraphs(replayed.model, 4, replayed.max_context, graph_factory=ReplayGraph)
        graphs.capture()
        replayed.stepper.graphs = graphs
        runs = []
        run = graphs.run
        graphs.run = lambda rows: runs.append([r.state_slot for r in rows]) or run(rows)
        outputs = replayed.generate(prompts, params)
    finally:
        replayed.close()
    assert outputs == expected
    assert runs and all(sorted(slots) == [0, 1, 2] for slots in runs[:5]), runs[:5]


@pytest.mark.skipif(DEVICE != "cpu", reason="replays stand-in graphs on the CPU device")
def test_offloaded_pieces_with_early_cached_routes_give_the_eager_tokens(reference):
    """Offloaded decode replayed from captured pieces, each layer's cached routes run at its
    routing from the slot map's copy (--moe-early-cached), beside the shared expert and the
    DeltaNet states: the eager steps' tokens."""
    _kind, _model, _engine, path = reference
    prompts = [prompt(40, 9), prompt(41, 17), prompt(42, 4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eager = make_engine(path, *OFFLOADED, "--prefill-chunk-tokens", CHUNK)
    try:
        expected = eager.generate(prompts, params)
    finally:
        eager.close()
    replayed = piecewise_engine(path, "--prefill-chunk-tokens", CHUNK, "--moe-early-cached", "on")
    try:
        outputs = replayed.generate(prompts, params)
        counters = replayed.moe.counters
        layer_steps = replayed.moe.staged_times.layer_steps
    finally:
        replayed.close()
    assert outputs == expected
    assert layer_steps > 0 and counters.hits.sum() > 0 and counters.fills.sum() > 0


# the projections an FP8 release quantizes (the routers, gates, norms, convolution, embeddings and
# a and b stay as they are, as Qwen's FP8 releases keep them)
FP8_PROJECTIONS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_qkv", "in_proj_z",
    "out_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


def fp8_copy(src: Path, out: Path) -> Path:
    """`src` with its projections in Hugging Face's fine-grained FP8 layout (e4m3 values and one
    fp32 factor per 128x128 block, `<name>_scale_inv`) and the quantization_config saying so."""
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
            t = f.get_tensor(name)
            if name.endswith(".weight") and name.split(".")[-2] in FP8_PROJECTIONS:
                tensors[name], tensors[name + "_scale_inv"] = fp8.quantize(t)
            else:
                tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_an_fp8_release_matches_transformers_on_its_dequantized_weights(kind, tmp_path):
    """FP8 projections (attention, DeltaNet in/out, routed and shared experts; I = 128, so gate
    and up keep their own blocks), offloaded: logits and greedy tokens against transformers on
    the same weights dequantized."""
    build_hybrid(kind, tmp_path / "bf", seed=5, moe_intermediate_size=128)
    path = fp8_copy(tmp_path / "bf", tmp_path / "fp8")
    plain = dequantize_checkpoint(path, tmp_path / "plain")
    cls = {
        "qwen3_next": transformers.Qwen3NextForCausalLM,
        "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
    }[kind]
    model = cls.from_pretrained(plain, dtype=torch.float32).eval()
    ids = prompt(7, 70)
    engine = make_engine(path, "--prefill-chunk-tokens", CHUNK, "--moe-cache-size", "4")
    try:
        assert engine.spec.quantization == "fp8" and engine.bank.fmt == "fp8"
        ours = engine.score(ids)
        [tokens] = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.close()
    assert relative_error(ours, hf_logits(model, ids)) < 1e-4
    ref, margins = hf_greedy(model, ids, 12)
    assert_same_greedy(tokens, ref, margins)


def test_a_chat_request_names_where_its_system_prompt_and_last_message_end(tmp_path):
    """The server hands a hybrid model's engine the token counts where the rendered chat's
    system prompt and its last message end (an agent's next request repeats both); for a model
    without state checkpoints, none."""
    write_tokenizer_files(tmp_path, 2048)
    tokenizer = Tokenizer(tmp_path)
    messages = [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Looking."},
        {"role": "tool", "content": "Rain, 4 degrees."},
    ]
    for checkpointing in (True, False):
        worker = ScriptedWorker(tokenizer, "Rain.", checkpointing=checkpointing)
        r = served(worker).post("/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 200, r.text
        [req] = worker.requests
        if not checkpointing:
            assert req.boundaries == ()
            continue
        ends = [
            tokenizer.apply_chat_template(messages[:n], add_generation_prompt=False) for n in (1, 4)
        ]
        assert req.boundaries == tuple(len(tokenizer.encode(text)) for text in ends)
        assert req.prompt_ids[: req.boundaries[1]] == tokenizer.encode(ends[1])
        assert 0 < req.boundaries[0] < req.boundaries[1] < len(req.prompt_ids)


def test_moelab_serve_answers_a_chat_from_a_qwen36_layout_checkpoint(tmp_path):
    """A real `moelab serve` process on a multimodal Qwen3.5/3.6 MoE checkpoint transformers
    wrote (with the synthetic tokenizer and Qwen's chat template), its experts offloaded: a chat
    completion, the same again (resumed from the state kept where its last message ends), and
    the chat's second turn, which resumes from the first turn's state as well."""
    path = tmp_path / "m"
    build_hybrid("qwen3_5_moe", path, seed=8, vocab_size=2048)
    write_tokenizer_files(path, 2048)
    messages = [
        {"role": "system", "content": "You answer questions about hybrid models, exactly."},
        {"role": "user", "content": "Which layers keep a state?"},
    ]
    engine = serve(path, tmp_path, "--moe-cache-rate", "0.5", "--max-running-requests", "1")
    try:

        def chat(messages: list[dict]) -> dict:
            body = {"messages": messages, "max_tokens": 12, "temperature": 0}
            r = httpx.post(engine.base_url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        first, again = chat(messages), chat(messages)
        reply = first["choices"][0]["message"]
        turn = chat([*messages, reply, {"role": "user", "content": "And the others?"}])
        stats = httpx.get(engine.base_url + "/v1/stats", timeout=30).json()
    finally:
        stop_engine(engine)
    assert first["usage"]["completion_tokens"] > 0
    assert reply["content"]
    # the same greedy reply from the kept state as from a fresh slot
    assert again["choices"][0]["message"] == reply

    def cached(response: dict) -> int:
        return response["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(first) == 0
    # the first turn's prompt up to its last message's end, in whole pages of 16
    assert 0 < cached(again) <= first["usage"]["prompt_tokens"] - 1
    assert cached(turn) == cached(again)
    checkpoints = stats["kv"]["prefix_cache"]["state_checkpoints"]
    assert checkpoints["resumed"] == 2 and checkpoints["capacity"] == 8
