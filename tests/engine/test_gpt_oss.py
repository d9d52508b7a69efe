"""gpt-oss against transformers' GptOssForCausalLM: small random checkpoints that transformers
writes, served resident and offloaded, prompts past the sliding window, chunked prefill and mixed
batches; and the parts the comparison must catch (sinks, window, clamp, biases)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moelab.daemon.models import read_checkpoint
from moelab.engine.experts import miss_plan
from moelab.engine.experts.bank import build_in_memory
from moelab.engine.experts.h2d import address_of, host_functions
from moelab.engine.model import model as model_module
from moelab.engine.model import synth
from moelab.engine.model.spec import CheckpointError, ModelSpec
from moelab.engine.model.synth import SynthSource, make_config
from moelab.engine.process.launch import stop_engine
from moelab.engine.runtime.graphs import DecodeGraphs
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from moelab.kernels import mxfp4

from .reference import (
    DEVICE,
    assert_same_greedy,
    build_reference,
    decode_with_each_planner,
    hf_greedy,
    hf_logits,
    make_engine,
    relative_error,
)
from .served import assert_offloaded_experts_serve, serve
from .test_graphs import ReplayGraph

pytest.importorskip(
    "transformers", reason="transformers is the reference (pip install -e '.[test]')"
)

WINDOW = 6
# odd sizes, grouped KV heads, a window far shorter than the prompts, two sliding layers of
# three, yarn; a SwiGLU limit low enough that the clamps bite at unit-gain weights
GEOMETRY = dict(
    hidden_size=48,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=12,
    num_experts_per_tok=3,
    moe_intermediate_size=20,
    num_hidden_layers=3,
    sliding_window=WINDOW,
    swiglu_limit=1.5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
    },
)
OFFLOADED = ["--moe-cache-size", "6", "--moe-miss-policy", "split:0.5"]


@pytest.fixture(autouse=True)
def equal_rates(monkeypatch):
    """Bp = Bh, so the split policy runs misses on the CPU and by copies on any machine."""
    import moelab.engine.runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "measure_bp_gbps", lambda bank, device: 10.0)
    monkeypatch.setattr(engine_module, "measure_bh_gbps", lambda runner, bank: 10.0)


def prompt(seed: int, n: int, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    model = build_reference("gpt_oss", path, seed=7, **GEOMETRY)
    return model, path


def test_spec_reads_gpt_oss_config(reference):
    _model, path = reference
    spec = ModelSpec.from_dir(path)
    assert spec.arch == "gpt_oss"
    assert spec.sliding_window == WINDOW and spec.sliding_layers == (0, 2)
    assert spec.attention_sinks and spec.router_bias and spec.expert_bias
    assert spec.swiglu_limit == 1.5 and spec.norm_topk_prob
    assert spec.rope_scaling["rope_type"] == "yarn"
    # the biases count in an expert's bytes (fp32 here) and in the dense weights
    h, i = spec.hidden_size, spec.moe_intermediate_size
    assert spec.expert_bytes == (3 * h * i + 2 * i + h) * 4


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_logits_and_greedy_tokens_match_transformers(reference, placement):
    """A 37-token prompt (six windows) in two prefill chunks, then 24 greedy tokens decoded over
    the paged cache, resident and offloaded (misses split between copies and the CPU)."""
    model, path = reference
    flags = ["--moe-cache-rate", "1.0"] if placement == "resident" else OFFLOADED
    engine = make_engine(path, "--prefill-chunk-tokens", "20", *flags)
    ids = prompt(1, 37)
    try:
        assert engine.cache.holds_everything == (placement == "resident")
        ours = engine.score(ids)
        [tokens] = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))
        if placement == "offloaded":
            counters = engine.moe.counters
            assert counters.fills.sum() > 0 and counters.cpu.sum() > 0
    finally:
        engine.close()
    assert relative_error(ours, hf_logits(model, ids)) < 1e-4
    ref, margins = hf_greedy(model, ids, 24)
    assert_same_greedy(tokens, ref, margins)
    assert len(set(tokens)) >= 8, f"the continuation is not varied: {tokens}"


def test_the_native_planner_decodes_gpt_oss_as_the_python_planner_does(reference, monkeypatch):
    """gpt-oss's offloaded decode steps are planned by the native planner (its experts copied
    with their biases, its CPU jobs run with them and the clamped SwiGLU), with the Python
    planner's plans: the same tokens, the same hits, fills and CPU experts per layer."""
    _, path = reference
    prompts = [prompt(3, 9), prompt(4, 14)]
    native, python = decode_with_each_planner(monkeypatch, path, prompts, 12, *OFFLOADED)
    assert native == python
    _, (_, _, fills, cpu, _), *_ = native
    assert sum(fills) > 0 and sum(cpu) > 0


def test_split_misses_decode_gpt_oss_as_whole_ones_do(reference, monkeypatch):
    """The native planner's copies may split a miss: its first rows copied with their gate and up
    biases, its other rows and its down bias run on the CPU. The tokens are the Python planner's,
    whose misses are whole."""
    _, path = reference
    prompts = [prompt(3, 9), prompt(4, 14)]
    native, python = decode_with_each_planner(
        monkeypatch, path, prompts, 12, *OFFLOADED, split_misses=True
    )
    assert native[0] == python[0]
    assert native[3] > 0 and python[3] == 0


def test_early_cached_routes_decode_gpt_oss_as_heads_after_the_plan_do(reference, monkeypatch):
    """--moe-early-cached: each layer's cached routes run at its routing, their slots from the
    slot map's copy, with their biases and the clamped SwiGLU; the piece after adds the filled
    ones. The tokens are the Python planner's, whose steps run eagerly."""
    _, path = reference
    prompts = [prompt(3, 9), prompt(4, 14)]
    native, python = decode_with_each_planner(
        monkeypatch, path, prompts, 12, *OFFLOADED, "--moe-early-cached", "on", split_misses=True
    )
    assert native[0] == python[0]
    _, (_, hits, fills, cpu, _), *_ = native
    assert sum(hits) > 0 and sum(fills) > 0 and sum(cpu) > 0


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_a_mixed_batch_matches_each_prompt_alone(reference, placement):
    """Prompts shorter and longer than the window decoded together (continuous batching)."""
    model, path = reference
    flags = ["--moe-cache-rate", "1.0"] if placement == "resident" else OFFLOADED
    engine = make_engine(path, "--prefill-chunk-tokens", "16", *flags)
    prompts = [prompt(10 + i, n) for i, n in enumerate((3, 17, 5, 30))]
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    finally:
        engine.close()
    for ids, ours in zip(prompts, outputs, strict=True):
        ref, margins = hf_greedy(model, ids, 16)
        assert_same_greedy(ours, ref, margins)


def assert_logprobs_match(model, seq, tol: float) -> None:
    """Each token `seq` drew has the log probability transformers gives it after the same
    tokens (its prompt and what it drew before)."""
    ids = seq.prompt_ids + seq.output_ids
    logp = torch.log_softmax(hf_logits(model, ids), dim=-1)
    n = len(seq.prompt_ids)
    theirs = torch.tensor([logp[n - 1 + i, t].item() for i, t in enumerate(seq.output_ids)])
    ours = torch.tensor([lp.logprob for lp in seq.output_logprobs])
    assert len(ours) == len(seq.output_ids) > 0
    assert (ours - theirs).abs().max() < tol, (ours - theirs).abs().max()


@pytest.mark.parametrize(("kv_dtype", "tol"), [("auto", 1e-4), ("fp8", 0.1)])
def test_sliding_layers_keep_only_their_window_over_many_chunks(reference, kv_dtype, tol):
    """Pages of 4 tokens, so that a sliding layer keeps 8 tokens (the window of 6 in whole
    pages) and the one full layer of three keeps the pages: a 45-token prompt prefilled in seven
    chunks of 7 (each longer than the window and shorter than the ring, none on a page's edge),
    then 30 tokens decoded past it, beside a shorter prompt; each token's log probability as
    transformers gives it (with FP8 pages, within FP8's rounding)."""
    model, path = reference
    engine = make_engine(path, "--moe-cache-rate", "1.0", "--kv-block-size", "4",
                         "--prefill-chunk-tokens", "7", "--kv-cache-dtype", kv_dtype)  # fmt: skip
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=1)
    try:
        rings = engine.states
        assert rings is not None and rings.ring_tokens == 8
        assert engine.kv.k.shape[0] == 1 and rings.k.shape[0] == 2
        seqs = [engine.add(prompt(3, 9), params), engine.add(prompt(2, 45), params)]
        engine.run_until_idle()
        stats = engine.telemetry.stats(running=0, queued=0, model_name="m")["kv"]
    finally:
        engine.close()
    assert stats["window"]["tokens_per_seq"] == 8 and stats["attention_layers"] == 1
    for seq in seqs:
        assert_logprobs_match(model, seq, tol)


def test_a_prompt_resumes_from_a_cached_prefix_through_a_window_checkpoint(reference):
    """A second prompt that shares 24 tokens with a first one takes their pages from the prefix
    cache and its sliding layers' window from the checkpoint kept at 24 tokens, and its tokens
    have the log probabilities transformers gives them after the whole prompt."""
    model, path = reference
    flags = ["--kv-block-size", "4", "--prefill-chunk-tokens", "12",
             "--state-checkpoint-interval", "8"]  # fmt: skip
    engine = make_engine(path, "--moe-cache-rate", "1.0", *flags)
    first = prompt(4, 30)
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1)
    try:
        engine.generate([first], params)
        seq = engine.add(first[:24] + prompt(5, 10), params)
        engine.run_until_idle()
        assert engine.scheduler.cached_tokens == 24
        assert engine.states is not None and engine.states.checkpoints_resumed == 1
    finally:
        engine.close()
    assert_logprobs_match(model, seq, 1e-4)


def test_a_model_whose_layers_all_slide_keeps_no_pages(tmp_path):
    """Every layer a sliding-window one: the paged cache holds no layer and the rings all three,
    and each token's log probability is transformers'."""
    geometry = {**GEOMETRY, "layer_types": ["sliding_attention"] * 3}
    model = build_reference("gpt_oss", tmp_path, seed=8, **geometry)
    engine = make_engine(tmp_path, "--moe-cache-rate", "1.0", "--kv-block-size", "4",
                         "--prefill-chunk-tokens", "9")  # fmt: skip
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1)
    try:
        assert engine.kv.k.shape[0] == 0 and engine.states.k.shape[0] == 3
        seq = engine.add(prompt(6, 30), params)
        engine.run_until_idle()
    finally:
        engine.close()
    assert_logprobs_match(model, seq, 1e-4)


@pytest.mark.skipif(DEVICE != "cpu", reason="replays stand-in graphs on the CPU device")
@pytest.mark.parametrize("piecewise", [False, True], ids=["whole", "pieces"])
def test_replayed_decode_steps_read_the_rings_as_eager_steps(reference, piecewise):
    """Decode steps replayed from captured graphs (whole steps, or pieces around the offloaded
    MoE layers) write and read the sliding layers' rings through tables made inside the step
    from each row's state slot, and give the eager steps' tokens (three sequences in the size-4
    graphs: a padding row writes the pool's spare ring, never a sequence's)."""
    _model, path = reference
    flags = ("--kv-block-size", "4", "--prefill-chunk-tokens", "7", *OFFLOADED)
    prompts = [prompt(20, 30), prompt(21, 5), prompt(22, 13)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eager = make_engine(path, *flags)
    try:
        expected = eager.generate(prompts, params)
    finally:
        eager.close()
    replayed = make_engine(path, *flags)
    try:
        replayed.cache.device_slot_map()
        graphs = DecodeGraphs(replayed.model, 4, replayed.max_context, piecewise=piecewise,
                              graph_factory=ReplayGraph)  # fmt: skip
        graphs.capture()
        replayed.stepper.graphs = graphs
        outputs = replayed.generate(prompts, params)
    finally:
        replayed.close()
    assert outputs == expected


def test_the_comparison_catches_a_wrong_window_or_clamp(reference):
    model, path = reference
    engine = make_engine(path, "--moe-cache-rate", "1.0")
    ids = prompt(1, 37)
    try:
        windows = engine.model.windows
        engine.model.windows = [2 * w for w in windows]  # still within the ring of 16
        assert relative_error(engine.score(ids), hf_logits(model, ids)) > 1e-3
        engine.model.windows = windows
        engine.cache.swiglu_limit = 0.0
        assert relative_error(engine.score(ids), hf_logits(model, ids)) > 1e-3
    finally:
        engine.close()


def test_the_comparison_catches_dropped_sinks_and_biases(reference):
    model, path = reference
    engine = make_engine(path, "--moe-cache-rate", "1.0")
    ids = prompt(1, 37)
    try:
        layers = engine.model.weights.layers
        sinks = [layer.sinks.clone() for layer in layers]
        for layer in layers:
            layer.sinks.fill_(-torch.inf)
        assert relative_error(engine.score(ids), hf_logits(model, ids)) > 1e-3
        for layer, kept in zip(layers, sinks, strict=True):
            layer.sinks.copy_(kept)
        engine.cache.w2_bias.zero_()
        assert relative_error(engine.score(ids), hf_logits(model, ids)) > 1e-3
    finally:
        engine.close()


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to TF32's 10 mantissa bits, to the nearest, ties away from zero (the
    tensor cores' cvt.rna.tf32); infinities stay."""
    rounded = ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(x.isfinite(), rounded, x)


def split_tf32_sdpa(q, k, v, attn_mask, scale):
    """Scaled dot-product attention with q @ k^T as fused fp32 kernels take it on compute
    capability 8.0 and up (PyTorch's memory-efficient attention: CUTLASS's 3xTF32): each
    operand x as tf32(x) + tf32(x - tf32(x)), the three larger products summed."""
    big_q, big_k = tf32(q), tf32(k)
    small_q, small_k = tf32(q - big_q), tf32(k - big_k)
    scores = big_q @ big_k.mT + big_q @ small_k.mT + small_q @ big_k.mT
    scores = (scores * scale).masked_fill(~attn_mask, -torch.inf)
    return torch.softmax(scores, dim=-1) @ v


def sinkless_attention(device: str) -> tuple[torch.Tensor, ...]:
    """q [10, 4, 8], k and v [10, 2, 8] on `device` and the attention transformers gives them with
    every sink -inf under a window of 4: the softmax over the visible keys alone."""
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads, dim, window = 10, 4, 2, 8, 4
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (cols <= rows) & (cols > rows - window)
    kh, vh = (t.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for t in (k, v))
    scores = (q.transpose(0, 1) @ kh.mT * dim**-0.5).masked_fill(~visible, -torch.inf)
    expected = (torch.softmax(scores, dim=-1) @ vh).transpose(0, 1)
    return tuple(t.to(device) for t in (q, k, v, expected))


def test_attention_without_sinks_stays_finite_in_split_tf32_kernels(monkeypatch):
    """Sinks of -inf (the comparison's dropped sinks) through attention as a fused fp32 kernel of
    a GPU computes it: the softmax over the visible keys alone, as transformers gives it, where
    an infinite key's tf32 remainder (inf - inf) would make every score NaN."""
    from moelab.engine.model import gpt_oss

    q, k, v, expected = sinkless_attention("cpu")
    monkeypatch.setattr(gpt_oss.F, "scaled_dot_product_attention", split_tf32_sdpa)
    out = gpt_oss.attention(q, k, v, 8**-0.5, torch.full((4,), -torch.inf), 4)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attention_without_sinks_stays_finite_on_cuda():
    """The same through the fused attention a GPU picks for fp32 (on compute capability 8.0+,
    the memory-efficient kernel's 3xTF32)."""
    from moelab.engine.model import gpt_oss

    q, k, v, expected = sinkless_attention("cuda")
    out = gpt_oss.attention(q, k, v, 8**-0.5, torch.full((4,), -torch.inf, device="cuda"), 4)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)


def math_flash_with_lse(q, k, v, scale):
    """gpt_oss._flash_with_lse in fp64 softmax attention (what flash attention computes): the
    lower-right causal mask, the key/value heads shared, and each query's log-sum-exp."""
    n, length = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    kh, vh = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ kh.mT * scale
    visible = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    scores = scores.masked_fill(~visible, -torch.inf)
    return (scores.softmax(-1) @ vh).to(q.dtype), torch.logsumexp(scores, -1).float()


@pytest.mark.parametrize(("n", "length"), [(7, 7), (5, 19)], ids=["prompt", "later-chunk"])
def test_flash_attention_then_the_sinks_equals_the_sink_as_a_key(monkeypatch, n, length):
    """gpt_oss.attention with `flash` on a layer without a window: attention over the keys alone
    (flash attention's output and log-sum-exp, here in fp64 softmax attention), each output
    times its keys' share of the denominator with the sink, as the sink-as-a-key path gives it;
    sinks of -inf leave the attention as it is. A windowed layer keeps the sink-as-a-key path."""
    from moelab.engine.model import gpt_oss

    monkeypatch.setattr(gpt_oss, "_flash_with_lse", math_flash_with_lse)
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(n, 8, 16, generator=gen)
    k, v = (torch.randn(length, 2, 16, generator=gen) for _ in range(2))
    sinks = torch.randn(8, generator=gen)
    for heads_sinks in (sinks, torch.full((8,), -torch.inf)):
        for window in (0, 4):
            flash = gpt_oss.attention(q, k, v, 0.25, heads_sinks, window, flash=True)
            keyed = gpt_oss.attention(q, k, v, 0.25, heads_sinks, window, flash=False)
            torch.testing.assert_close(flash, keyed, rtol=1e-5, atol=1e-5)
    calls = []
    monkeypatch.setattr(gpt_oss, "_flash_with_lse", lambda *a: calls.append(a) or 1 / 0)
    gpt_oss.attention(q, k, v, 0.25, sinks, 4, flash=True)
    assert not calls, "a windowed layer went to flash attention"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_long_prompts_chunk_attends_through_a_fused_kernel_on_cuda():
    """A prefill chunk of 512 queries over 4,096 keys at gpt-oss's heads (64 query heads and 8 KV
    heads of 64), full and windowed, in bf16, with flash attention and the sinks after it (the
    device runs it: the engine's check) and with the sink as a key: a fused attention backend
    takes it (only those are allowed here: the math one would hold every head's scores, 64 x
    512 x 4,097 of them here and 17 GB at a chunk of 2,048 over 32K), with the result of the
    reference's softmax over the visible keys and the sink."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moelab.engine.model import gpt_oss

    gen = torch.Generator(device="cuda").manual_seed(5)
    n, length, heads, kv_heads, dim = 512, 4096, 64, 8, 64
    q = torch.randn(n, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn(length, kv_heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    sinks = torch.randn(heads, generator=gen, device="cuda")
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    spec = ModelSpec.from_config(make_config("gpt_oss", "gpt-oss-20b"))
    assert model_module.flash_chunk_attention(spec, torch.device("cuda"), torch.bfloat16)
    for window, flash in ((0, True), (0, False), (128, True), (128, False)):
        with sdpa_kernel(fused):
            out = gpt_oss.attention(q, k, v, dim**-0.5, sinks, window, flash=flash)
        rows = torch.arange(length - n, length, device="cuda")[:, None]
        cols = torch.arange(length, device="cuda")[None, :]
        visible = (cols <= rows) & ((cols > rows - window) if window else True)
        kh, vh = (t.float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for t in (k, v))
        scores = (q.float().transpose(0, 1) @ kh.mT * dim**-0.5).masked_fill(~visible, -torch.inf)
        with_sink = torch.cat([scores, sinks[:, None, None].expand(heads, n, 1)], dim=2)
        weights = torch.softmax(with_sink, dim=-1)[..., :length]
        expected = (weights @ vh).transpose(0, 1)
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def mxfp4_checkpoint(src: Path, out: Path) -> Path:
    """`src`'s weights with the experts in OpenAI's MXFP4 release layout: `*_blocks` and
    `*_scales` of each projection as [E, out, in] (kernels/mxfp4.py quantizes), the biases and
    everything else as stored; config.json names quant_method mxfp4."""
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in list(f.keys()):
            t = f.get_tensor(name)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = mxfp4.quantize(t.transpose(1, 2).contiguous())
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            else:
                tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_an_mxfp4_checkpoint_matches_transformers_dequantizing_it(tmp_path, placement):
    """OpenAI's layout (experts in MXFP4 `_blocks`/`_scales`), kept 4-bit in the bank and the
    slots (--moe-expert-dtype auto), resident and offloaded (CPU jobs on the blocks, fills of
    them), against transformers' own reading of the same files (Mxfp4Config(dequantize=True))."""
    import transformers

    geometry = {**GEOMETRY, "hidden_size": 64, "moe_intermediate_size": 32, "swiglu_limit": 7.0}
    build_reference("gpt_oss", tmp_path / "bf16", seed=9, **geometry)
    path = mxfp4_checkpoint(tmp_path / "bf16", tmp_path / "mxfp4")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).eval()
    spec = ModelSpec.from_dir(path)
    assert spec.quantization == "mxfp4" and spec.expert_format() == "mxfp4"
    ids = prompt(1, 37)
    flags = ["--moe-cache-rate", "1.0"] if placement == "resident" else OFFLOADED
    engine = make_engine(path, "--prefill-chunk-tokens", "20", *flags)
    try:
        assert engine.bank.fmt == "mxfp4" and engine.bank.w13[0].dtype == torch.uint8
        assert engine.cache.w13.dtype == torch.uint8
        assert engine.cache.slot_bytes == spec.expert_bytes_as("mxfp4")
        assert engine.cache.holds_everything == (placement == "resident")
        ours = engine.score(ids)
        [tokens] = engine.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))
        if placement == "offloaded":
            counters = engine.moe.counters
            assert counters.fills.sum() > 0 and counters.cpu.sum() > 0
    finally:
        engine.close()
    ref_logits = hf_logits(model, ids)
    assert relative_error(ours, ref_logits) < 1e-4
    ref, margins = hf_greedy(model, ids, 16)
    assert_same_greedy(tokens, ref, margins)
    # the 4-bit rounding shows: the bf16 weights give other logits
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert relative_error(hf_logits(plain, ids), ref_logits) > 1e-3


@pytest.mark.parametrize("dtype", ["bf16", "mxfp4"])
def test_synth_writes_gpt_oss_that_transformers_reads_as_the_engine_does(tmp_path, dtype):
    """`moelab synth --arch gpt_oss` (bf16, or the experts in MXFP4 as OpenAI ships them),
    its routing skewed by the calibration: transformers' logits and the engine's agree."""
    import transformers

    path = synthesize(tmp_path / "m", arch="gpt_oss", preset="tiny", seed=5, routing_skew=0.8,
                      overrides={"sliding_window": 8}, dtype=dtype)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        if dtype == "mxfp4":
            assert config["quantization_config"]["quant_method"] == "mxfp4"
            blocks = f.get_tensor("model.layers.1.mlp.experts.down_proj_blocks")
            assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (16, 64, 1, 16)
            assert "model.layers.1.mlp.experts.down_proj" not in names
        assert "model.layers.1.self_attn.sinks" in names
    quantized = {"quantization_config": transformers.Mxfp4Config(dequantize=True)}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **(quantized if dtype == "mxfp4" else {})
    ).eval()
    ids = prompt(2, 30, vocab=2048)
    engine = make_engine(path, "--moe-cache-size", "12")
    try:
        ours = engine.score(ids)
    finally:
        engine.close()
    assert relative_error(ours, hf_logits(model, ids)) < 1e-4


# 64 experts: each expert tensor is past the size a random draw of its own is made for, and is
# tiled from the source's random block (16, the tiny preset's: a draw of its own)
@pytest.mark.parametrize("experts", [16, 64])
def test_synthetic_mxfp4_experts_are_made_as_blocks_and_scales(experts):
    """A synthetic gpt_oss source in MXFP4 holds each expert projection as an MXFP4 checkpoint
    does, its `_blocks` and `_scales`, made without quantizing the experts: values of the bf16
    source's spread, each block a quantized one (quantizing its values again gives its bits),
    the down projection's output row 0 zero; a tensor small enough for a draw of its own is the
    bf16 source's quantized. The bank built from it holds those bits, gate's rows then up's."""
    spec = ModelSpec.from_config(make_config("gpt_oss", "tiny", {"num_experts": experts}))
    plain, source = SynthSource(spec, seed=3), SynthSource(spec, seed=3, expert_format="mxfp4")
    names = set(source.names())
    prefix = "model.layers.1.mlp.experts."
    assert prefix + "down_proj" not in names and prefix + "down_proj_blocks" in names
    for proj, (fan_in, fan_out) in {"gate_up_proj": (64, 64), "down_proj": (32, 64)}.items():
        blocks, scales = (source.get(prefix + proj + part) for part in ("_blocks", "_scales"))
        assert blocks.shape == source.shape(prefix + proj + "_blocks")
        assert blocks.shape == (experts, fan_out, fan_in // 32, 16) and blocks.dtype == torch.uint8
        assert scales.shape == (experts, fan_out, fan_in // 32) and scales.dtype == torch.uint8
        weight = mxfp4.dequantize(blocks, scales)
        again = mxfp4.quantize(weight)
        assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
        bf16 = plain.get(prefix + proj).transpose(1, 2).float()
        if experts == 16:
            assert torch.equal(weight, mxfp4.dequantize(*mxfp4.quantize(bf16)))
        assert weight.std().item() == pytest.approx(bf16.std().item(), rel=0.05)
        if proj == "down_proj":
            assert not weight[:, 0].any() and weight[:, 1:].any()
    bank = build_in_memory(spec, source, torch.float32, pin=False, fmt="mxfp4")
    gate_up = source.get(prefix + "gate_up_proj_blocks")[5]
    assert torch.equal(bank.w13[1][5], torch.cat([gate_up[0::2], gate_up[1::2]]))
    assert torch.equal(bank.w2_scale[1], source.get(prefix + "down_proj_scales"))


def test_a_calibration_over_mxfp4_blocks_runs_them_in_the_mxfp4_kernel(monkeypatch):
    """Calibrating over an MXFP4 bank's layers (an engine's on CUDA, where a widened copy of
    gpt-oss-120b's experts would not fit the host) runs its blocks in the MXFP4 kernel, and
    gives the routers a calibration over the widened experts gives (fewer passes here: on the
    CPU the kernel runs in Triton's interpreter). On the test device: a GPU runs Triton's
    kernels only over its own memory."""
    monkeypatch.setattr(synth, "CALIBRATION_PROMPT_TOKENS", 16)
    monkeypatch.setattr(synth, "CALIBRATION_TOKENS", 32)
    monkeypatch.setattr(synth, "CALIBRATION_ROUNDS", 2)
    kernel, calls = synth.grouped_moe_mxfp4, []

    def counted(*args, **kwargs):
        calls.append(args[3].dtype)  # w13: the layer's blocks
        return kernel(*args, **kwargs)

    monkeypatch.setattr(synth, "grouped_moe_mxfp4", counted)
    spec = ModelSpec.from_config(make_config("gpt_oss", "tiny"))
    device = torch.device(DEVICE)
    sources = [SynthSource(spec, seed=2, skew=1.0, expert_format="mxfp4") for _ in range(2)]
    bank = build_in_memory(spec, sources[0], torch.float32, pin=False, fmt="mxfp4")
    blocks = [tuple(bank.layer_tensors(m)) for m in range(bank.num_layers)]
    sources[0].calibrate(device, torch.float32, experts=blocks)
    assert calls and set(calls) == {torch.uint8}
    sources[1].calibrate(device, torch.float32)  # the source's experts, widened
    # on CUDA the two kernels' rounding may flip a pick of the passes: a few picks' worth
    atol = 1e-4 if DEVICE == "cpu" else 0.05
    for layer in spec.moe_layers:
        np.testing.assert_allclose(sources[0].biases[layer], sources[1].biases[layer], atol=atol)


def test_dummy_mxfp4_weights_are_the_weights_synth_writes(tmp_path):
    """--dummy-weights on the config of `moelab synth --dtype mxfp4` (experts tiled from the
    quantized random block) builds the MXFP4 experts synth wrote and calibrates its routers over
    them: on the CPU as synth did (the same routers, the same tokens), on CUDA over its bank in
    the MXFP4 kernel (the routers as close as its rounding leaves them)."""
    path = synthesize(tmp_path / "m", arch="gpt_oss", preset="tiny", seed=6, routing_skew=1.0,
                      overrides={"num_experts": 64}, dtype="mxfp4")  # fmt: skip
    written, dummy = make_engine(path), make_engine(path, "--dummy-weights")
    try:
        assert dummy.bank.fmt == "mxfp4"
        assert all(torch.equal(a, b) for a, b in zip(written.bank.w13, dummy.bank.w13, strict=True))
        for layer in dummy.spec.moe_layers:
            routers = [e.model.weights.layers[layer].router for e in (written, dummy)]
            if DEVICE == "cpu":
                assert torch.equal(*routers), layer
            else:
                # the kernel's rounding may flip a pick of the passes: a few picks' worth
                torch.testing.assert_close(*routers, rtol=0, atol=0.05)
        if DEVICE == "cpu":
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            prompts = [[5, 6, 7, 8], list(range(40, 60))]
            assert written.generate(prompts, params) == dummy.generate(prompts, params)
    finally:
        written.close()
        dummy.close()


@pytest.mark.parametrize(
    ("preset", "total_b", "active_b"), [("gpt-oss-20b", 20.9, 3.6), ("gpt-oss-120b", 116.8, 5.1)]
)
def test_presets_have_gpt_oss_parameter_counts(preset, total_b, active_b):
    """The presets' geometries give the parameter counts OpenAI publishes (model card)."""
    spec = ModelSpec.from_config(make_config("gpt_oss", preset))
    experts = spec.experts_total * spec.expert_params
    active = spec.dense_params - spec.vocab_size * spec.hidden_size
    active += spec.num_moe_layers * spec.top_k * spec.expert_params
    assert abs((spec.dense_params + experts) / 1e9 - total_b) < 0.1
    assert abs(active / 1e9 - active_b) < 0.1
    assert spec.sliding_window == 128 and len(spec.sliding_layers) == spec.num_layers // 2


def test_moelab_serve_answers_from_an_mxfp4_gpt_oss_checkpoint(tmp_path):
    """A real `moelab serve` process on the MXFP4 checkpoint `moelab synth --arch gpt_oss`
    writes, its experts offloaded, and the manager's catalog reading it as servable; a chat's
    second turn takes the first's prompt from the prefix cache."""
    path = synthesize(tmp_path / "m", arch="gpt_oss", preset="tiny", seed=21, routing_skew=1.0,
                      overrides={"sliding_window": 8}, dtype="mxfp4")  # fmt: skip
    entry = read_checkpoint(path, "data dir")
    assert entry.error is None and entry.model_type == "gpt_oss" and entry.expert_bytes > 0
    engine = serve(path, tmp_path, "--moe-cache-rate", "0.5")
    try:
        assert_offloaded_experts_serve(engine, path, "mxfp4", 24)
        # a chat's next turn resumes where the last one's messages ended: the full layers'
        # pages from the prefix cache, the sliding layers' windows from their checkpoint there
        turn = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Name a colour."}]  # fmt: skip
        chat = {"messages": turn, "max_tokens": 6, "temperature": 0}
        first = httpx.post(engine.base_url + "/v1/chat/completions", json=chat, timeout=60)
        assert first.status_code == 200, first.text
        reply = first.json()["choices"][0]["message"]["content"] or "red"
        turn += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
        second = httpx.post(engine.base_url + "/v1/chat/completions", json=chat, timeout=60)
        assert second.status_code == 200, second.text
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert prompt_tokens - 2 * 16 < cached < prompt_tokens and cached % 16 == 0
        kv = httpx.get(engine.base_url + "/v1/stats").json()["kv"]
        assert kv["window"]["window"] == 8 and kv["window"]["tokens_per_seq"] == 16
        assert kv["prefix_cache"]["state_checkpoints"]["resumed"] == 1
    finally:
        stop_engine(engine)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["sliding_attention"]}, "layer_types must be a list of 4 of"),
        ({"layer_types": ["local"] * 4}, "sliding_attention / full_attention"),
        ({"swiglu_alpha": 1.5}, "swiglu_alpha must be 1.702"),
        ({"swiglu_limit": -1}, "swiglu_limit must be a number above zero"),
    ],
)
def test_a_config_moelab_cannot_serve_is_refused_naming_the_field(change, message):
    config = {**make_config("gpt_oss", "tiny"), **change}
    with pytest.raises(CheckpointError, match=message):
        ModelSpec.from_config(config, "m/config.json")


def test_fp8_experts_keep_their_biases(reference):
    """--moe-expert-dtype fp8 on gpt_oss: the bank quantizes the weights and keeps the biases
    beside them, so the logits stay within FP8's rounding of transformers'."""
    model, path = reference
    engine = make_engine(path, "--moe-expert-dtype", "fp8", *OFFLOADED)
    ids = prompt(1, 37)
    try:
        assert engine.bank.fmt == "fp8" and engine.bank.w13_bias
        ours = engine.score(ids)
    finally:
        engine.close()
    assert 1e-5 < relative_error(ours, hf_logits(model, ids)) < 0.05


@pytest.mark.skipif(DEVICE != "cpu", reason="replays stand-in graphs on the CPU device")
def test_the_routing_guess_adds_the_router_bias(reference, monkeypatch):
    """A one-token piece's guess of its MoE routing (Model._guess) goes through the layer's
    router with its bias, as the routing itself does: gpt-oss's biases shift its picks, and a
    guess without them names experts the routing will not."""
    _model, path = reference
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    guess = model_module.guess_to_host

    def recorded(x, scale, router_w, logits_h, signal, router_b=None):
        seen.append((router_w, router_b))
        guess(x, scale, router_w, logits_h, signal, router_b)

    monkeypatch.setattr(model_module, "guess_to_host", recorded)
    # the native planner's CUDA path through stand-ins of the driver (`take_the_cuda_path`),
    # set up before the capture, which sends guesses only for a planner with its copies
    functions = host_functions({"copy": 0, "query": 0, "memset2d": 0, "copy2d": 0})
    addresses = tuple(address_of(f) for f in functions)
    monkeypatch.setattr(miss_plan, "driver_functions", lambda: addresses)
    engine = make_engine(path, *OFFLOADED, "--moe-cpu-prefetch-rounds", "2")
    try:
        if engine.cpu is None or engine.cpu.kernel != "native":
            pytest.skip("the native CPU kernel did not build here")
        engine.moe.planner.copies = True
        engine.moe.planner._native = None  # made again, with the stand-ins
        graphs = DecodeGraphs(engine.model, 4, engine.max_context, piecewise=True,
                              graph_factory=ReplayGraph)  # fmt: skip
        graphs.capture()
        engine.stepper.graphs = graphs
        assert graphs.routing_guess is not None
        engine.generate([prompt(23, 9)], SamplingParams(max_tokens=6, ignore_eos=True))
        layers = engine.model.weights.layers
        biases = {id(layers[m].router): layers[m].router_bias for m in engine.spec.moe_layers}
    finally:
        engine.close()
    assert seen
    for router_w, router_b in seen:
        assert router_b is not None and router_b is biases[id(router_w)]
