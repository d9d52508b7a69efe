"""`moelab synth`: files, tokenizer, presets, determinism, routing skew, bounded activations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moelab.engine.model import synth
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import PRESETS, make_config, parse_overrides
from moelab.engine.model.tokenizer import IncrementalDecoder, Tokenizer
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from moelab.kernels import native_build

from .reference import make_engine, relative_error


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthesize(
        tmp_path_factory.mktemp("tiny"), arch="qwen3_moe", preset="tiny", routing_skew=1.0, seed=0
    )


def test_writes_a_hugging_face_checkpoint(tiny):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tiny / name).is_file(), name
    config = json.loads((tiny / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert (
        "<|im_start|>" in json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]
    )


def test_tokenizer_is_byte_level_bpe_and_round_trips(tiny):
    tok = Tokenizer(tiny)
    spec = json.loads((tiny / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "BPE" and spec["pre_tokenizer"]["type"] == "ByteLevel"
    for text in (
        "The harbour town woke before the sun.",
        "朝の港はまだ暗く 🌦️ emoji",
        "x = [1, 2]\n",
    ):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # merges were learned: common words are single tokens, not bytes
    assert len(tok.encode(" the")) == 1
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}


def test_the_token_floor_never_exceeds_the_real_count(tiny):
    tok = Tokenizer(tiny)
    assert tok.max_token_chars >= len("<|endoftext|>")  # the added tokens count too
    for text in (
        " the" * 5000,  # the most common merges: the fewest tokens per character
        "word " * 4000,
        "朝の港はまだ暗く 🌦️ " * 300,
        "<|im_end|>" * 500,  # special tokens, the longest ones
        " " * 10_000,
        "x",
    ):
        assert tok.min_tokens(text) <= len(tok.encode(text)), text[:20]
    assert tok.min_tokens(" the" * 5000) > 0  # and it is a floor that says something


def test_chat_template_is_chatml_with_thinking_switch(tiny):
    tok = Tokenizer(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_think = tok.apply_chat_template(messages, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    assert '"get_time"' in tok.apply_chat_template(messages, tools=tools)
    with pytest.raises(ValueError, match="unknown message role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_incremental_decoding_never_splits_a_character(tiny):
    tok = Tokenizer(tiny)
    text = "朝の港 🌦️ は暗く"
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len([p for p in pieces if p])  # some tokens were partial characters


def test_each_tokens_bytes_make_the_text_and_byte_fallback_pieces_are_their_byte(tiny, tmp_path):
    tok = Tokenizer(tiny)  # byte-level: pieces of a character map back to their bytes
    text = "朝の港 🌦️ は暗く, harbour"
    ids = tok.encode(text)
    assert b"".join(bytes(tok.token_bytes(i)) for i in ids) == text.encode()
    assert any("\ufffd" in tok.token_text(i) for i in ids)  # a piece alone is no character
    im_end = tok.token_to_id("<|im_end|>")  # a special token: its own text
    assert (
        tok.token_text(im_end) == "<|im_end|>" and bytes(tok.token_bytes(im_end)) == b"<|im_end|>"
    )
    # a SentencePiece-style vocabulary whose bytes fall back to <0xAB> pieces
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "▁a": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    fallback = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    fallback.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    (tmp_path / "sp").mkdir()
    fallback.save(str(tmp_path / "sp" / "tokenizer.json"))
    sp = Tokenizer(tmp_path / "sp")
    assert sp.token_bytes(2 + 0xE6) == [0xE6]
    assert sp.token_bytes(1) == list(b" a")


def test_a_second_start_maps_the_bank_the_first_one_wrote(tiny):
    # start-up times are scripts/startup_times.py's (docs/performance.md); what keeps the second
    # start short is that it writes nothing: the prepacked bank of the first is mapped as it is
    make_engine(tiny).close()
    (bank,) = (tiny / "bank").glob("*.bank.safetensors")
    before = bank.stat()
    make_engine(tiny).close()
    (again,) = (tiny / "bank").glob("*.bank.safetensors")
    after = again.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )


def test_presets_have_the_promised_sizes():
    small = ModelSpec.from_config(make_config("qwen3_moe", "small"))
    total = small.dense_bytes + small.expert_pool_bytes
    assert 0.8e9 < total < 1.3e9, total
    real = ModelSpec.from_config(make_config("qwen3_moe", "qwen3-30b-a3b"))
    assert (real.hidden_size, real.num_layers, real.num_experts, real.top_k) == (2048, 48, 128, 8)
    assert (real.moe_intermediate_size, real.num_heads, real.num_kv_heads, real.head_dim) == (
        768,
        32,
        4,
        128,
    )
    assert real.vocab_size == 151936 and real.norm_topk_prob
    # 30.5 B parameters, 3.3 B active, as Qwen publishes for Qwen3-30B-A3B
    params = real.dense_params + real.experts_total * real.expert_params
    assert 30.0e9 < params < 31.0e9, params
    active = real.dense_params + real.num_moe_layers * real.top_k * real.expert_params
    assert 3.0e9 < active < 3.6e9, active


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_every_architecture_synthesizes_and_generates(tmp_path, arch):
    path = synthesize(
        tmp_path / arch, arch=arch, preset="tiny", overrides={"num_experts": 8}, seed=1
    )
    engine = make_engine(path)
    try:
        assert engine.spec.arch == arch and engine.spec.num_experts == 8
        [out] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=16, ignore_eos=True))
        assert len(out) == 16 and len(set(out)) > 4
    finally:
        engine.close()


def test_a_checkpoint_without_weights_is_served_with_dummy_ones(tmp_path):
    path = synthesize(tmp_path / "geometry", preset="tiny", seed=3, weights=False)
    assert not list(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()
    engine = make_engine(path, "--dummy-weights")
    try:
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}]))  # fmt: skip
        [out] = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out) == 4
    finally:
        engine.close()


def test_seeded_and_deterministic(tmp_path):
    a = synthesize(tmp_path / "a", preset="tiny", seed=7, routing_skew=0.5)
    b = synthesize(tmp_path / "b", preset="tiny", seed=7, routing_skew=0.5)
    c = synthesize(tmp_path / "c", preset="tiny", seed=8, routing_skew=0.5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_large_checkpoints_are_sharded_with_an_index(tmp_path):
    path = synthesize(tmp_path / "s", preset="tiny", shard_bytes=256 * 1024)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (path / "model.safetensors").exists()
    engine = make_engine(path)
    try:
        [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out) == 4
    finally:
        engine.close()


def _pick_histograms(path, prompts: int = 24, length: int = 48) -> np.ndarray:
    engine = make_engine(path)
    spec = engine.spec
    counts = np.zeros((spec.num_layers, spec.num_experts), dtype=np.int64)

    def record(layer, x, ids):
        np.add.at(counts[layer], ids.flatten().numpy(), 1)

    engine.model.on_router = record
    gen = torch.Generator().manual_seed(12345)  # not the calibration's prompts
    try:
        for _ in range(prompts):
            engine.score(torch.randint(0, spec.vocab_size, (length,), generator=gen).tolist())
    finally:
        engine.close()
    return counts[[layer for layer in range(spec.num_layers) if spec.is_moe_layer(layer)]]


def _zipf_slope(histogram: np.ndarray) -> float:
    freq = np.sort(histogram)[::-1].astype(float)
    ranks = np.arange(1, freq.size + 1)
    return float(np.polyfit(np.log(ranks), np.log(freq + 1), 1)[0])


@pytest.mark.parametrize("skew", [0.0, 0.6, 1.2])
def test_routing_skew_follows_zipf(tmp_path, skew):
    path = synthesize(
        tmp_path / "m",
        preset="tiny",
        seed=3,
        routing_skew=skew,
        overrides={"num_experts": 16, "num_experts_per_tok": 2},
    )
    for histogram in _pick_histograms(path):
        slope = _zipf_slope(histogram)
        if skew == 0:
            share = histogram / histogram.sum()
            assert share.max() < 3 / 16 and share.min() > 1 / 48, share
        assert abs(slope + skew) < 0.3, f"skew {skew}: fitted Zipf slope {slope:.2f}"


def test_activations_stay_bounded_through_every_layer(tmp_path):
    path = synthesize(
        tmp_path / "deep",
        preset="tiny",
        seed=2,
        routing_skew=1.0,
        overrides={"num_hidden_layers": 24},
    )
    engine = make_engine(path)
    norms, spreads = [], []

    def record(layer, x, ids):
        norms.append(float(x.float().pow(2).mean().sqrt()))
        spreads.append(len(set(ids.flatten().tolist())))

    engine.model.on_router = record
    try:
        logits = engine.score(list(range(1, 200)))
    finally:
        engine.close()
    assert torch.isfinite(logits).all()
    assert max(norms) < 10 * min(norms), norms  # no blow-up or collapse across depth
    assert min(spreads) >= 6, spreads  # routing did not collapse onto a few experts
    assert logits.std() > 1.0  # next-token distributions are not flat


def test_transformers_loads_synth_checkpoints_and_agrees(tiny):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    engine = make_engine(tiny)
    try:
        ids = list(range(3, 40))
        ours = engine.score(ids)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        # bf16 weights upcast to fp32 on both sides
        assert relative_error(ours, ref) < 1e-4
    finally:
        engine.close()


def test_config_overrides_and_bad_presets():
    config = make_config("olmoe", "tiny", {"num_experts": 64, "num_hidden_layers": 2})
    assert config["num_experts"] == 64 and config["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="unknown preset"):
        make_config("olmoe", "huge")
    with pytest.raises(ValueError, match="unknown architecture"):
        make_config("llama", "tiny")
    assert set(PRESETS) == {
        "tiny", "small", "qwen3-30b-a3b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b",
        "gpt-oss-20b", "gpt-oss-120b",
    }  # fmt: skip


def test_set_items_are_json_values_or_strings_and_need_an_equals_sign():
    """--set FIELD=VALUE (synth, bench decode/prefill): JSON where the value is JSON."""
    items = ["num_experts=64", " mlp_only_layers =[]", "rope_theta=1e6", "name=a=b", "act=silu"]
    assert parse_overrides(items) == {"num_experts": 64, "mlp_only_layers": [],
                                      "rope_theta": 1e6, "name": "a=b", "act": "silu"}  # fmt: skip
    with pytest.raises(ValueError, match="--set 'num_experts': write FIELD=VALUE"):
        parse_overrides(["num_experts"])


def test_dummy_weights_are_the_weights_synth_writes_calibrated_by_the_source(tmp_path):
    """--dummy-weights on a synthetic checkpoint's config builds the weights `moelab synth` wrote
    for it, routers calibrated to the skew (on the CPU in fp32, as synth calibrates them): the
    engine calibrates them over its bank's experts, in a start-up phase of its own."""
    path = synthesize(tmp_path / "m", preset="tiny", routing_skew=1.0, seed=4)
    written, dummy = make_engine(path), make_engine(path, "--dummy-weights")
    try:
        assert "routing calibration" in dummy.startup_s
        assert "routing calibration" not in written.startup_s
        for layer in dummy.spec.moe_layers:
            routers = (e.model.weights.layers[layer].router for e in (written, dummy))
            assert torch.equal(*routers), layer
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        prompts = [[5, 6, 7, 8], list(range(40, 60))]
        assert written.generate(prompts, params) == dummy.generate(prompts, params)
    finally:
        written.close()
        dummy.close()


def test_a_dummy_engine_keeps_its_routing_calibration_for_the_next_start(tmp_path, monkeypatch):
    """An engine with --dummy-weights saves its routers' calibration under a key of what made it;
    the next start with the same key takes the same routers back without calibrating, one with
    another skew calibrates its own, and a damaged file is calibrated again and replaced."""
    # an empty cache for the calibrations; the native CPU kernel's build stays the user's
    # (kernels/native_build.py, keyed by its source), where an empty cache would compile it
    extensions_dir = native_build.extensions_dir()
    monkeypatch.setattr(native_build, "extensions_dir", lambda: extensions_dir)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first_path = synthesize(tmp_path / "m", preset="tiny", routing_skew=1.0, seed=4)
    other_path = synthesize(tmp_path / "o", preset="tiny", routing_skew=0.5, seed=4)
    calibrations = []
    calibrate = synth.SynthSource.calibrate

    def counted(self, *args, **kwargs):
        calibrations.append(self.skew)
        return calibrate(self, *args, **kwargs)

    monkeypatch.setattr(synth.SynthSource, "calibrate", counted)

    def routers(path: Path) -> list[torch.Tensor]:
        engine = make_engine(path, "--dummy-weights")
        try:
            layers = engine.model.weights.layers
            return [layers[layer].router.clone() for layer in engine.spec.moe_layers]
        finally:
            engine.close()

    calibrated = routers(first_path)
    (saved,) = synth.calibration_dir().glob("*.json")
    assert calibrations == [1.0]
    restored = routers(first_path)
    assert calibrations == [1.0]  # taken back, not calibrated
    assert all(torch.equal(a, b) for a, b in zip(calibrated, restored, strict=True))
    other = routers(other_path)
    assert calibrations == [1.0, 0.5] and len(list(synth.calibration_dir().glob("*.json"))) == 2
    assert not all(torch.equal(a, b) for a, b in zip(calibrated, other, strict=True))
    saved.write_text(saved.read_text()[:40])  # cut short, as by a crash mid-write elsewhere
    again = routers(first_path)
    assert calibrations == [1.0, 0.5, 1.0]
    assert all(torch.equal(a, b) for a, b in zip(calibrated, again, strict=True))
    assert json.loads(saved.read_text())["key"] == saved.stem  # replaced whole
