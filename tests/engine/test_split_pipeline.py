"""Micro-batch pipelining of a split's decode step (`--split-microbatches`, `--devices cpu,cpu`
emulating two devices on the CPU): a step's rows cut into micro-batches, each run through every
device before the next starts, gives the unpipelined step's greedy tokens and fp32 logits,
eager (resident and offloaded: each micro-batch routes and misses on its own) and from each
device's graphs (stand-in graphs replaying the captured work); hybrid models' recurrent states
and gpt-oss's window rings kept per row."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from moelab.engine.config.config import ConfigError, EngineConfig
from moelab.engine.config.split import launch_order, microbatch_count, microbatch_rows
from moelab.engine.model.placement import LayerPlacement
from moelab.engine.runtime.engine import Engine
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.runtime.split_graphs import Crossing, SplitDecodeGraphs
from moelab.engine.synth_checkpoint import synthesize

from .test_graphs import ReplayGraph
from .test_split_graphs import SPLITS, _recording_logits

# five sequences: micro-batches of 3 and 2 (M = 2) or 2, 2 and 1 (M = 3)
PROMPTS = [list(range(3, 23)), list(range(40, 47)), list(range(100, 131)), [7, 8, 9],
           list(range(60, 72))]  # fmt: skip
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
CACHES = {"resident": (), "offloaded": ("--moe-cache-size", "6", "--moe-miss-policy", "split:0.5")}


def test_a_pipelined_step_launches_each_micro_batch_through_every_device_in_turn():
    assert launch_order(2, 3) == ((0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1))
    assert launch_order(3, 1) == ((0, 0), (0, 1), (0, 2))
    # uneven rows: the first micro-batches the larger, every row in one, in order
    assert microbatch_rows(5, 3) == (range(0, 2), range(2, 4), range(4, 5))
    assert microbatch_rows(8, 2) == (range(0, 4), range(4, 8))
    # by default one micro-batch below 32 rows, two from there; never more than the rows
    assert [microbatch_count(None, rows) for rows in (1, 8, 31, 32, 64)] == [1, 1, 1, 2, 2]
    assert [microbatch_count(3, rows) for rows in (1, 2, 3, 5)] == [1, 2, 3, 3]


def test_micro_batches_without_a_split_are_refused_in_words():
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_flags(["--model-path", "m", "--split-microbatches", "2"])
    assert str(err.value).startswith(
        "--split-microbatches 2 pipelines a decode step across --devices; name two devices"
    )
    with pytest.raises(SystemExit):
        EngineConfig.from_flags(
            ["--model-path", "m", "--devices", "cpu,cpu", "--split-microbatches", "0"]
        )
    config = EngineConfig.from_flags(
        ["--model-path", "m", "--devices", "cpu,cpu", "--split-microbatches", "3"]
    )
    assert config.memory.split_microbatches == 3


@pytest.fixture(scope="module", params=list(SPLITS))
def checkpoint(tmp_path_factory, request):
    arch = request.param
    path = synthesize(
        tmp_path_factory.mktemp(arch), arch=arch, preset="tiny", routing_skew=0.8, seed=5
    )
    return arch, path


@pytest.fixture(scope="module", params=list(CACHES))
def split(request, checkpoint):
    """A split engine (eager steps, no prefix cache: every run of the prompts computes alike),
    whose micro-batches the tests set."""
    arch, path = checkpoint
    flags = ["--model-path", str(path), "--dtype", "float32", "--moe-cpu-threads", "1",
             "--bank-dir", str(path / "bank"), "--devices", "cpu,cpu", "--layer-split",
             SPLITS[arch], "--no-prefix-cache", "--no-overlap-decode",
             *CACHES[request.param]]  # fmt: skip
    engine = Engine(EngineConfig.from_flags(flags))
    yield arch, request.param, engine
    engine.close()


def _run(engine, micro: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The prompts' tokens and every step's logits with `micro` micro-batches a decode step."""
    stepper = engine.stepper
    stepper.pipelining.setting = micro
    sampler = stepper.sampler
    logits = _recording_logits(engine)
    try:
        tokens = engine.generate(PROMPTS, PARAMS)
    finally:
        stepper.sampler = sampler
    return tokens, logits


def _picks(engine) -> np.ndarray:
    """How often each expert of each MoE layer was routed to in decode, so far."""
    return engine.moe.counters.picks.copy()


def test_eager_micro_batches_give_the_unpipelined_steps_tokens_and_logits(split, monkeypatch):
    """M = 1, 2, 3 at batch 5: the same tokens, and logits within fp32's rounding (a matmul of
    fewer rows may sum in another order; the prefill runs whole, its logits to the bit); each
    micro-batch crosses
    the boundary on its own, and /v1/stats reports the micro-batches of the last decode step.
    The experts' decode counters count every row's routing as unpipelined. Offloaded, each
    micro-batch's misses are fetched or run on the CPU."""
    arch, cache, engine = split
    crossed = []
    cross = LayerPlacement.cross
    monkeypatch.setattr(
        LayerPlacement, "cross",
        lambda self, layer, state: crossed.append(state.batch.input_ids.shape[0]) or
        cross(self, layer, state),
    )  # fmt: skip
    reads_before = engine.moe.decode_reads[1]
    before = _picks(engine)
    expected, expected_logits = _run(engine, 1)
    picks = _picks(engine) - before
    for micro in (2, 3):
        crossed.clear()
        before = _picks(engine)
        tokens, logits = _run(engine, micro)
        assert tokens == expected, (arch, cache, micro)
        # every row's routing counted once, in its place (the heatmaps' figures)
        assert np.array_equal(_picks(engine) - before, picks), (arch, cache, micro)
        assert len(logits) == len(expected_logits)
        for mine, whole in zip(logits, expected_logits, strict=True):
            assert torch.allclose(mine, whole, rtol=0, atol=1e-4), (arch, cache, micro)
        assert torch.equal(logits[0], expected_logits[0])  # the prefill, whole
        # the prefill crosses whole; each of the 7 decode steps once per micro-batch, in order
        rows = [len(r) for r in microbatch_rows(5, micro)]
        assert crossed == [sum(len(p) for p in PROMPTS)] + rows * 7
        devices = engine.telemetry.stats(running=0, queued=0, model_name="m")["devices"]
        assert [d["microbatches"] for d in devices] == [micro, micro]
    if cache == "offloaded":
        assert engine.moe.decode_reads[1] > reads_before


def test_a_batch_of_one_runs_whole(split):
    """Asked for three micro-batches, a step of one sequence runs whole, and is not counted as
    pipelined."""
    _arch, _cache, engine = split
    engine.stepper.pipelining.setting = 3
    steps = engine.stepper.pipelining.steps
    engine.generate(PROMPTS[:1], PARAMS)
    report = engine.telemetry.stats(running=0, queued=0, model_name="m")["devices"][0]
    assert report["microbatches"] == 1 and report["pipelined_steps"] == steps


@dataclass
class Replayed:
    """A run of the prompts from stand-in graphs: what came out and what the replays did."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    entered: list[int]  # the devices made current, in order
    sent: list[Crossing]  # the boundary copies
    replays: int
    picks: np.ndarray  # the experts' decode picks counted


def _replayed(engine, micro: int, monkeypatch) -> Replayed:
    """The prompts decoded from stand-in graphs of each device's micro-batches (sizes up to 5,
    so that the batch of 5 is its own size)."""
    engine.stepper.pipelining.setting = micro
    entered, sent = [], []
    enter, send = LayerPlacement.enter, Crossing.send
    monkeypatch.setattr(
        LayerPlacement, "enter", lambda self, part: entered.append(part) or enter(self, part)
    )
    monkeypatch.setattr(Crossing, "send", lambda self: sent.append(self) or send(self))
    graphs = SplitDecodeGraphs(
        engine.model, 5, engine.max_context, graph_factory=ReplayGraph,
        pipelining=engine.stepper.pipelining,
    )  # fmt: skip
    graphs.capture()
    entered.clear()  # (the capture's)
    sent.clear()
    # each device's graphs of sizes 1, 2, 4 and 5: one per rows, a step's or a micro-batch's,
    # where a micro-batch from row 0 replays the smaller size's graph. M = 2: rows 0-2 and 3-4
    # of 5, 0-1 and 2-3 of 4, 0 and 1 of 2, and 1 whole: 6 graphs, not 7; M = 3: 0-1, 2-3 and
    # 4 of 5, 0-1, 2 and 3 of 4, 0 and 1 of 2, 1 whole: 7, not 9
    for part in (0, 1):
        captured = {id(step.graph) for bs in graphs.sizes
                    for step in graphs.graphs[bs][0].steps[:-1] if step.part == part}  # fmt: skip
        assert len(captured) == {1: 4, 2: 6, 3: 7}[micro]
    replays = []
    run = graphs.run
    graphs.run = lambda rows: replays.append(len(rows)) or run(rows)
    engine.stepper.graphs = graphs
    before = _picks(engine)
    try:
        tokens, logits = _run(engine, micro)
    finally:
        engine.stepper.graphs = None
        monkeypatch.undo()
    assert len(replays) >= 6 and set(replays) == {5}
    return Replayed(tokens, logits, entered, sent, len(replays), _picks(engine) - before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="replays stand-in graphs on the CPU device")
@pytest.mark.parametrize("split", ["resident"], indirect=True)
def test_replayed_micro_batches_give_the_unpipelined_graphs_tokens_and_logits(split, monkeypatch):
    """Each device's graphs captured per micro-batch of the batch of 5 (M = 2: rows 0-2 and 3-4;
    M = 3: 0-1, 2-3 and 4), replayed in launch order: the tokens of the unpipelined graphs and
    of the eager step, their logits within fp32's rounding. Every replayed step enters dev0,
    dev1 per micro-batch, then dev0 for the sampling, and copies each micro-batch across the
    boundary once."""
    arch, _cache, engine = split
    eager, _ = _run(engine, 1)
    whole = _replayed(engine, 1, monkeypatch)
    assert whole.tokens == eager, arch
    for micro in (2, 3):
        ours = _replayed(engine, micro, monkeypatch)
        assert ours.tokens == whole.tokens, (arch, micro)
        for mine, theirs in zip(ours.logits, whole.logits, strict=True):
            assert torch.allclose(mine, theirs, rtol=0, atol=1e-4), (arch, micro)
        # each micro-batch's graphs record its rows' routing in their place
        assert np.array_equal(ours.picks, whole.picks), (arch, micro)
        assert ours.entered == ([0, 1] * micro + [0]) * ours.replays
        assert len(ours.sent) == micro * ours.replays
        # a boundary buffer per micro-batch
        assert len({c.into.data_ptr() for c in ours.sent}) == micro


@pytest.mark.skipif(torch.cuda.is_available(), reason="replays stand-in graphs on the CPU device")
@pytest.mark.parametrize("split", ["offloaded"], indirect=True)
def test_offloaded_pieces_run_each_step_whole(split):
    """An offloaded split's pieces stage each MoE layer from the host between them, one device
    at a time: asked for two micro-batches, its replayed steps run whole, with the eager step's
    tokens, and /v1/stats says one micro-batch."""
    arch, _cache, engine = split
    expected, _ = _run(engine, 2)
    devices = engine.telemetry.stats(running=0, queued=0, model_name="m")["devices"]
    assert [d["microbatches"] for d in devices] == [2, 2]  # (eagerly)
    graphs = SplitDecodeGraphs(
        engine.model, 5, engine.max_context, piecewise=True, graph_factory=ReplayGraph,
        pipelining=engine.stepper.pipelining,
    )  # fmt: skip
    graphs.capture()
    replays = []
    run = graphs.run
    graphs.run = lambda rows: replays.append(len(rows)) or run(rows)
    engine.stepper.graphs = graphs
    try:
        tokens = engine.generate(PROMPTS, PARAMS)
    finally:
        engine.stepper.graphs = None
    assert tokens == expected, arch
    assert len(replays) >= 6
    devices = engine.telemetry.stats(running=0, queued=0, model_name="m")["devices"]
    assert [d["microbatches"] for d in devices] == [1, 1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_two_gpus_in_micro_batches_decode_as_one_micro_batch_does(checkpoint, graphs):
    """On two GPUs in bf16, resident, batch 5: two micro-batches a step (each card's graphs per
    micro-batch, its copies queued behind the next card's receive stream; or eager) give the
    tokens of one."""
    arch, path = checkpoint
    flags = ["--model-path", str(path), "--dtype", "bfloat16", "--moe-cpu-threads", "1",
             "--bank-dir", str(path / "bank"), "--devices", "cuda:0,cuda:1", "--layer-split",
             SPLITS[arch], *(() if graphs else ("--no-cuda-graph",))]  # fmt: skip
    tokens = []
    for micro in ("1", "2"):
        engine = Engine(EngineConfig.from_flags([*flags, "--split-microbatches", micro]))
        try:
            assert isinstance(engine.graphs, SplitDecodeGraphs) == graphs
            tokens.append(engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True)))
            report = engine.telemetry.stats(running=0, queued=0, model_name="m")["devices"][0]
            assert (report["pipelined_steps"] > 0) == (micro == "2")
        finally:
            engine.close()
    assert tokens[0] == tokens[1], arch
