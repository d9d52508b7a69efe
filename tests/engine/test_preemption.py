"""Requests whose decodes outgrow a small KV cache together: the scheduler preempts the most
recently admitted, recomputes it when blocks free up, and every request still gets the greedy
tokens, and each token the log probability, that transformers gives after the same tokens and
that a run with room for all of them gives: qwen3_moe, a hybrid model (Gated DeltaNet states,
resumed from a state checkpoint too) and gpt-oss (sliding-window rings)."""

from __future__ import annotations

import contextlib
import json
import re

import httpx
import pytest
import torch

from moelab.engine.process.launch import stop_engine
from moelab.engine.runtime.graphs import DecodeGraphs
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.runtime.scheduler import Sequence
from moelab.engine.synth_checkpoint import synthesize

from .reference import (
    DEVICE,
    assert_same_greedy,
    build_reference,
    hf_greedy,
    hf_logits,
    make_engine,
    relative_error,
)
from .served import serve
from .test_gpt_oss import GEOMETRY as GPT_OSS
from .test_graphs import ReplayGraph
from .test_hybrid import build_hybrid
from .test_reference import GEOMETRIES
from .test_server import _post, _until

pytest.importorskip(
    "transformers", reason="transformers is the reference (pip install -e '.[test]')"
)

# a KV cache of 8 pages of 16: three prompts of 2 to 3 pages start together, and their decodes
# need more pages than the cache has
SMALL = ("--moe-cache-rate", "1.0", "--kv-reserve-tokens", "128", "--max-context", "128")
ROOMY = ("--moe-cache-rate", "1.0", "--kv-reserve-tokens", "1024", "--max-context", "128")
N = 48  # tokens each request decodes


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(1, 45), prompt(2, 33), prompt(3, 20)]


def run_together(path, *flags: str) -> tuple[list[Sequence], int, dict]:
    """The prompts' greedy decodes run together by an engine with `flags`; its preemptions
    and its state pool's counts (resumed checkpoints)."""
    engine = make_engine(path, *flags)
    params = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=1)
    try:
        seqs = [engine.add(p, params) for p in PROMPTS]
        engine.run_until_idle()
        states = engine.states
        resumed = states.checkpoints_resumed if states is not None else 0
        assert engine.kv.used_blocks == 0 and (states is None or states.used_slots == 0)
        stats = engine.telemetry.stats(
            running=0, queued=0, preempted=engine.scheduler.preemptions, model_name="m"
        )
        return seqs, resumed, stats
    finally:
        engine.close()


def assert_as_transformers(model, seq: Sequence, tolerance: float = 1e-4) -> None:
    """Its greedy tokens are transformers' from the prompt, and each has the log probability
    transformers gives it after the tokens before it (within `tolerance` of the largest)."""
    ref, margins = hf_greedy(model, seq.prompt_ids, len(seq.output_ids))
    assert_same_greedy(seq.output_ids, ref, margins)
    logp = torch.log_softmax(hf_logits(model, seq.prompt_ids + seq.output_ids), dim=-1)
    n = len(seq.prompt_ids)
    theirs = torch.tensor([logp[n - 1 + i, t].item() for i, t in enumerate(seq.output_ids)])
    ours = torch.tensor([lp.logprob for lp in seq.output_logprobs])
    assert len(ours) == len(seq.output_ids) == N
    assert relative_error(ours, theirs) < tolerance


def assert_preempted_as_unpreempted(
    model, path, *flags: str, tolerance: float = 1e-4
) -> tuple[list[Sequence], int]:
    """Run the prompts in the small cache and in a roomy one: the small one preempts, the
    roomy one does not, and both give transformers' tokens and log probabilities."""
    seqs, resumed, stats = run_together(path, *SMALL, *flags)
    roomy, _, roomy_stats = run_together(path, *ROOMY, *flags)
    assert stats["requests"]["preempted"] > 0 and roomy_stats["requests"]["preempted"] == 0
    for seq, alone in zip(seqs, roomy, strict=True):
        assert seq.output_ids == alone.output_ids
        assert_as_transformers(model, seq, tolerance)
    assert sum(s.preemptions for s in seqs) == stats["requests"]["preempted"]
    # the counts of prompt tokens and of cached ones are the requests', not their recomputes'
    assert stats["kv"]["prefix_cache"]["prompt_tokens"] == sum(map(len, PROMPTS))
    return seqs, resumed


def test_qwen3_moe_requests_preempted_and_recomputed_get_their_tokens(tmp_path):
    model = build_reference("qwen3_moe", tmp_path, seed=9, **GEOMETRIES["qwen3_moe"])
    seqs, _ = assert_preempted_as_unpreempted(model, tmp_path, "--prefill-chunk-tokens", "24")
    # (what a recompute takes from the prefix cache is not the request's cached prompt)
    assert [s.cached_tokens for s in seqs] == [0, 0, 0]


def test_hybrid_requests_preempted_resume_their_states_exactly(tmp_path):
    """Qwen3.5 MoE: a preempted sequence's recurrent states go with its slot; its recompute
    prefills its prompt and output from the start (no checkpoints), or from the state
    checkpoint kept every 16 tokens of its first prefill with the pages before it."""
    model = build_hybrid("qwen3_5_moe_text", tmp_path, seed=3)
    flags = ("--prefill-chunk-tokens", "24")
    # 48 decode steps carry the recurrent states' fp32 rounding, which transformers' recompute
    # of the whole sequence (its chunked delta rule) does not share: 4e-5 to 1.3e-4 of the
    # largest log probability on the CI machines, preempted or not (the tokens are identical)
    tolerance = 3e-4
    _, resumed = assert_preempted_as_unpreempted(model, tmp_path, *flags, "--state-checkpoints",
                                                 "0", tolerance=tolerance)  # fmt: skip
    assert resumed == 0
    _, resumed = assert_preempted_as_unpreempted(
        model, tmp_path, *flags, "--state-checkpoint-interval", "16", tolerance=tolerance
    )
    assert resumed > 0


def test_gpt_oss_requests_preempted_rebuild_their_windows(tmp_path):
    """gpt-oss: a preempted sequence's sliding layers' ring goes with its slot; the recompute
    fills it again from the prompt and the output."""
    model = build_reference("gpt_oss", tmp_path, seed=7, **GPT_OSS)
    assert_preempted_as_unpreempted(model, tmp_path, "--prefill-chunk-tokens", "20")


def test_overlapped_decode_preempts_a_sequence_whose_token_is_in_flight(tmp_path):
    """Decode steps replayed from graphs (stand-ins on the CPU, the engine's on CUDA), each
    queued before the previous one's tokens are read: a sequence preempted while its token is in
    flight gets that token when the step lands, and is recomputed with it, to the tokens of the
    roomy run (a hybrid model: its state slot goes back with it)."""
    build_hybrid("qwen3_5_moe_text", tmp_path, seed=3)
    flags = ("--prefill-chunk-tokens", "24", "--state-checkpoint-interval", "16")
    roomy, _, _ = run_together(tmp_path, *ROOMY, *flags)
    engine = make_engine(tmp_path, *SMALL, *flags)
    in_flight = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: in_flight.append(seq.pending) or preempt(seq)
    try:
        if DEVICE == "cpu":
            engine.cache.device_slot_map()
            graphs = DecodeGraphs(engine.model, 4, engine.max_context, graph_factory=ReplayGraph)
            graphs.capture()
            engine.stepper.graphs = graphs
        assert engine.stepper.graphs is not None and engine.stepper.overlap_decode
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True))
    finally:
        engine.close()
    assert outputs == [s.output_ids for s in roomy]
    assert in_flight and all(in_flight), in_flight


def test_served_requests_with_large_max_tokens_run_together_and_all_complete(tmp_path):
    """`moelab serve` with a KV cache of 640 tokens and three streamed requests of 600 tokens
    each: they run together (admitted on their prompts), the cache preempts and recomputes some
    of them, and each stream still carries 600 tokens, the text of the same request run alone;
    /v1/stats and the metrics count the preemptions."""
    model = synthesize(tmp_path / "model", preset="tiny", seed=21)
    engine = serve(model, tmp_path, "--moe-cache-rate", "1.0", "--kv-reserve-tokens", "640",
                   "--max-context", "640")  # fmt: skip
    url = engine.base_url
    body = {"prompt": "The harbour town", "max_tokens": 600, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    try:
        with contextlib.ExitStack() as streams:
            started = []
            for _ in range(3):
                stream = {**body, "stream": True}
                response = streams.enter_context(
                    httpx.stream("POST", url + "/v1/completions", json=stream, timeout=120)
                )
                lines = response.iter_lines()
                started.append((next(x for x in lines if x.startswith("data: ")), lines))
            _until(lambda: httpx.get(url + "/v1/stats").json()["requests"]["running"] == 3,
                   "three requests to run together")  # fmt: skip
            texts = [streamed_text([first, *lines]) for first, lines in started]
        stats = httpx.get(url + "/v1/stats").json()
        metrics = httpx.get(url + "/metrics").text
        alone = _post(engine, "/v1/completions", body).json()
    finally:
        stop_engine(engine)
    assert alone["usage"]["completion_tokens"] == 600
    assert texts == [alone["choices"][0]["text"]] * 3
    preempted = stats["requests"]["preempted"]
    counted = re.search(r"^moelab_requests_preempted_total\{.*\} (\S+)$", metrics, re.M)
    assert preempted > 0 and counted and float(counted[1]) == preempted


def streamed_text(lines: list[str]) -> str:
    """The text of a streamed completion's events."""
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(
        json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]
    )
