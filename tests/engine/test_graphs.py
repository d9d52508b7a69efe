"""Decode steps replayed from captured pieces give the same tokens as eager steps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moelab.engine.graphs import DecodeGraphs
from moelab.engine.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize

from .reference import DEVICE, make_engine

PROMPTS = [list(range(3, 23)), list(range(40, 47)), list(range(100, 131))]


class ReplayGraph:
    """Stands in for a CUDA graph on the CPU: replay runs the captured work again and writes its
    results into the tensors the capture returned, as a graph rewrites its outputs in place; so
    the plumbing between pieces (fixed buffers, padding rows, the staged experts) is tested."""

    def __init__(self, pool: object | None) -> None:
        self.pool = pool
        self.work: Callable[[], tuple] | None = None
        self.outputs: tuple = ()

    def capture(self, work: Callable[[], tuple]) -> tuple:
        self.work = work
        self.outputs = work()
        return self.outputs

    def replay(self) -> None:
        assert self.work is not None
        for kept, fresh in zip(self.outputs, self.work(), strict=True):
            if kept is not None:
                kept.copy_(fresh)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return synthesize(
        tmp_path_factory.mktemp("graphs"),
        arch="qwen2_moe",  # a shared expert: the piece after each MoE layer adds it
        preset="tiny",
        routing_skew=0.8,
        seed=9,
        overrides={"num_experts": 16},
    )


def _generate(engine) -> tuple[list[list[int]], dict[str, int]]:
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    c = engine.moe.counters
    counts = {k: int(getattr(c, k).sum()) for k in ("reads", "hits", "fills", "cpu")}
    return outputs, counts


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
def test_piecewise_replay_matches_eager_steps_on_cpu(checkpoint):
    flags = ("--moe-cache-size", "20", "--moe-miss-policy", "split:0.5")
    eager = make_engine(checkpoint, *flags)
    try:
        expected, expected_counts = _generate(eager)
    finally:
        eager.close()
    engine = make_engine(checkpoint, *flags)
    try:
        graphs = DecodeGraphs(
            engine.model, 4, engine.max_context, piecewise=True, graph_factory=ReplayGraph
        )
        graphs.capture()
        assert len(graphs.graphs[4]) == engine.spec.num_moe_layers + 1
        engine.graphs = graphs
        outputs, counts = _generate(engine)
    finally:
        engine.close()
    assert outputs == expected
    # three sequences ran in the size-4 graphs: the padding row was never sent to the experts
    assert counts == expected_counts
    assert counts["fills"] > 0 and counts["cpu"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_decode_replays_captured_pieces_on_cuda(checkpoint):
    flags = ("--device", "cuda", "--moe-cache-size", "20", "--moe-miss-policy", "split:0.5")
    eager = make_engine(checkpoint, *flags, "--no-cuda-graph")
    try:
        expected, expected_counts = _generate(eager)
    finally:
        eager.close()
    engine = make_engine(checkpoint, *flags)
    try:
        assert engine.config_in_force()["cuda_graph_mode"] == "piecewise"
        outputs, counts = _generate(engine)
    finally:
        engine.close()
    assert outputs == expected
    assert counts == expected_counts and counts["fills"] > 0 and counts["cpu"] > 0
