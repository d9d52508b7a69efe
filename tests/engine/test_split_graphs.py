"""Decode graphs of a model split across devices (`--devices cpu,cpu` emulates two on the CPU,
stand-in graphs replaying the captured work): each device's range of layers a graph of its own,
replayed with its device current, the residual stream crossing each boundary in one copy; the
same greedy tokens and fp32 logits as the eager split (which are one device's), overlapped
decode included. On two CUDA devices: the graphs give one card's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from moelab.engine.config.config import EngineConfig
from moelab.engine.model.placement import LayerPlacement
from moelab.engine.runtime.engine import Engine
from moelab.engine.runtime.graphs import DecodeGraphs
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.runtime.split_graphs import Crossing, SplitDecodeGraphs
from moelab.engine.synth_checkpoint import synthesize

from .test_graphs import ReplayGraph

PROMPTS = [list(range(3, 23)), list(range(40, 47)), list(range(100, 131))]

# qwen3_moe: a dense layer 0 before its MoE ones; qwen3_next: linear attention layers 0-2 with
# their recurrent states (the boundary after layer 1), a full attention layer 3; gpt_oss:
# sliding-window layers 0 and 2 with their rings, one on each side of the boundary
SPLITS = {"qwen3_moe": "2,2", "qwen3_next": "2,2", "gpt_oss": "1,3"}


@pytest.fixture(scope="module", params=list(SPLITS))
def checkpoint(tmp_path_factory, request):
    arch = request.param
    path = synthesize(
        tmp_path_factory.mktemp(arch), arch=arch, preset="tiny", routing_skew=0.8, seed=5
    )
    return arch, path


def _engine(path, *flags: str, dtype: str = "float32") -> Engine:
    common = ["--dtype", dtype, "--moe-cpu-threads", "1", "--bank-dir", str(path / "bank")]
    return Engine(EngineConfig.from_flags(["--model-path", str(path), *common, *flags]))


def _split(checkpoint, *flags: str, devices: str = "cpu,cpu", dtype: str = "float32") -> Engine:
    arch, path = checkpoint
    split = ("--devices", devices, "--layer-split", SPLITS[arch])
    return _engine(path, *split, *flags, dtype=dtype)


def _with_graphs(engine) -> SplitDecodeGraphs:
    """The engine's decode steps replayed from stand-in graphs of each device's layers."""
    assert engine.cache.holds_everything
    graphs = SplitDecodeGraphs(engine.model, 4, engine.max_context, graph_factory=ReplayGraph)
    graphs.capture()
    engine.stepper.graphs = graphs
    return graphs


class _RecordingSampler:
    """The engine's sampler, keeping every step's logits as the host reads them."""

    def __init__(self, sampler) -> None:
        self._sampler = sampler
        self.logits: list[torch.Tensor] = []

    def sample(self, logits: torch.Tensor, seqs: list):
        self.logits.append(logits.clone())
        return self._sampler.sample(logits, seqs)

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)


def _recording_logits(engine) -> list[torch.Tensor]:
    """Every step's logits as the host sampler reads them, from now on."""
    engine.stepper.sampler = recording = _RecordingSampler(engine.stepper.sampler)
    return recording.logits


def _generate(engine) -> list[list[int]]:
    return engine.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="replays stand-in graphs on the CPU device")
def test_replayed_split_steps_give_the_eager_splits_tokens_and_logits(checkpoint):
    """The replayed split's tokens are the eager split's and one device's; its logits are one
    device's replayed graphs' to the bit (both pad a batch of three to four rows) and the
    eager split's within fp32's rounding."""
    arch, path = checkpoint
    one = _engine(path, "--device", "cpu", "--no-overlap-decode")
    eager = _split(checkpoint, "--no-overlap-decode")
    replayed = _split(checkpoint, "--no-overlap-decode")
    try:
        one.stepper.graphs = DecodeGraphs(one.model, 4, one.max_context, graph_factory=ReplayGraph)
        one.stepper.graphs.capture()
        graphs = _with_graphs(replayed)
        steps = []
        run = graphs.run
        graphs.run = lambda rows: steps.append(len(rows)) or run(rows)
        logits = [_recording_logits(e) for e in (one, eager, replayed)]
        expected = _generate(eager)
        assert _generate(replayed) == expected == _generate(one), arch
    finally:
        one.close()
        eager.close()
        replayed.close()
    # the prefill, the first decode step (which telemetry times by phase, eagerly), then every
    # decode step replayed
    assert steps == [3] * 14
    ones, eagers, ours = logits
    assert len(ours) == len(eagers) == len(ones) == 16
    for mine, alone, theirs in zip(ours, ones, eagers, strict=True):
        assert torch.equal(mine, alone), arch
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-4), arch


@pytest.mark.skipif(torch.cuda.is_available(), reason="replays stand-in graphs on the CPU device")
def test_overlapped_split_decode_crosses_once_per_boundary_on_each_device(checkpoint, monkeypatch):
    """Overlapped decode over the split's graphs: the eager split's tokens, most steps queued
    before the one before them is read; each replayed step enters the first device, the
    second, then the first again for its tokens, and sends the residual stream across the
    boundary once."""
    arch, _ = checkpoint
    eager = _split(checkpoint)
    try:
        expected = _generate(eager)
    finally:
        eager.close()
    engine = _split(checkpoint)
    try:
        entered, sent, queued = [], [], []
        enter, send = LayerPlacement.enter, Crossing.send
        monkeypatch.setattr(
            LayerPlacement, "enter", lambda self, part: entered.append(part) or enter(self, part)
        )
        monkeypatch.setattr(Crossing, "send", lambda self: sent.append(self) or send(self))
        graphs = _with_graphs(engine)
        entered.clear()  # (the capture's)
        sent.clear()
        run = graphs.run
        graphs.run = lambda rows: queued.append([r.source for r in rows]) or run(rows)
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        seqs = [engine.add(p, params) for p in PROMPTS]
        in_flight = 0
        while not engine.idle:
            engine.step()
            in_flight += engine.stepper.in_flight
    finally:
        engine.close()
    assert [s.output_ids for s in seqs] == expected, arch
    assert in_flight > len(queued) // 2
    assert sum(all(src >= 0 for src in step) for step in queued) > len(queued) // 2
    assert entered == [0, 1, 0] * len(queued)
    assert len(sent) == len(queued)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "offloaded"])
def test_two_gpus_decode_graphs_give_one_cards_greedy_tokens(checkpoint, resident):
    """On two GPUs in bf16, every expert resident: each card's graph captured on it, replayed
    with overlapped decode, the tokens of one card's graphs. Offloaded, the split steps
    eagerly and gives one card's eager tokens."""
    arch, path = checkpoint
    cache = () if resident else ("--moe-cache-size", "6", "--no-cuda-graph")
    one = _engine(path, "--device", "cuda:0", *cache, dtype="bfloat16")
    split = _split(checkpoint, *cache[:2], devices="cuda:0,cuda:1", dtype="bfloat16")
    try:
        graphs = split.graphs
        assert (graphs is not None) == resident
        assert split.config_in_force()["cuda_graphs"] == resident
        if resident:
            assert isinstance(graphs, SplitDecodeGraphs)
            [step] = graphs.graphs[graphs.max_bs]
            assert [s.part for s in step.steps] == [0, 1, 0]
            assert all(p.graph_bytes > 0 for p in split.split.plans)
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        assert split.generate(PROMPTS, params) == one.generate(PROMPTS, params), arch
    finally:
        one.close()
        split.close()
