"""Decode graphs of a model split across devices (`--devices cpu,cpu` emulates two on the CPU,
stand-in graphs replaying the captured work): each device's range of layers a graph of its own,
replayed with its device current, the residual stream crossing each boundary in one copy; the
same greedy tokens and fp32 logits as the eager split (which are one device's), overlapped
decode included. Offloaded, each device's pieces, its MoE layers staged between them by its own
runner: the eager split's tokens. On two CUDA devices: the graphs give one card's greedy
tokens, resident and offloaded."""

from __future__ import annotations

import pytest
import torch

from moelab.engine.config.config import EngineConfig
from moelab.engine.experts import miss_plan
from moelab.engine.experts.h2d import address_of, host_functions
from moelab.engine.model.placement import LayerPlacement
from moelab.engine.runtime.engine import Engine
from moelab.engine.runtime.graphs import DecodeGraphs
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.runtime.split_graphs import Crossing, SplitDecodeGraphs
from moelab.engine.synth_checkpoint import synthesize

from .late_routing import LateRouting
from .test_graphs import ReplayGraph, _host_driver, _host_launches, _LateRouting

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
    """On two GPUs in bf16, each card's graphs captured on it, replayed with overlapped decode:
    every expert resident, a graph per card; offloaded (six slots a card), each card's pieces,
    its MoE layers staged between them. The tokens of one card's graphs."""
    arch, path = checkpoint
    cache = () if resident else ("--moe-cache-size", "6")
    one = _engine(path, "--device", "cuda:0", *cache, dtype="bfloat16")
    split = _split(checkpoint, *cache, devices="cuda:0,cuda:1", dtype="bfloat16")
    try:
        graphs = split.graphs
        assert isinstance(graphs, SplitDecodeGraphs)
        assert split.config_in_force()["cuda_graph_mode"] == ("whole" if resident else "piecewise")
        assert all(p.graph_bytes > 0 for p in split.split.plans)
        if resident:
            [step] = graphs.graphs[graphs.max_bs]
            assert [s.part for s in step.steps] == [0, 1, 0]
        else:
            moe_ranges = split.layers_on.moe_ranges(split.spec.moe_layers)
            parts = [d for d, r in enumerate(moe_ranges) for _ in range(len(r) + 1)]
            assert [p.part for p in graphs.pieces[graphs.max_bs]] == [*parts, 0]
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        assert split.generate(PROMPTS, params) == one.generate(PROMPTS, params), arch
        if not resident:
            counters = split.moe.counters
            assert counters.fills.sum() > 0 and counters.cpu.sum() > 0, arch
    finally:
        one.close()
        split.close()


OFFLOADED = ("--moe-cache-size", "6", "--moe-miss-policy", "split:0.5")


def _with_pieces(engine) -> SplitDecodeGraphs:
    """The engine's offloaded decode steps replayed from stand-in graphs of each device's
    pieces."""
    assert not engine.cache.holds_everything
    graphs = SplitDecodeGraphs(
        engine.model, 4, engine.max_context, piecewise=True, graph_factory=ReplayGraph
    )
    graphs.capture()
    engine.stepper.graphs = graphs
    return graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="replays stand-in graphs on the CPU device")
@pytest.mark.parametrize(
    ("overlap", "launch"),
    [(True, False), (False, False), (True, True)],
    ids=["overlapped", "synchronous", "planner-launch"],
)
def test_replayed_offloaded_split_pieces_give_the_eager_splits_tokens(
    checkpoint, monkeypatch, overlap, launch
):
    """An offloaded split (six expert slots a device, half of the misses copied, half run on
    the CPU) decodes from each device's pieces: the eager split's tokens and one device's; each
    device's MoE layers staged by its own runner, with misses copied into its own cache and
    run on the CPU; the residual stream crossing the boundary once a step, after the first
    device's last piece. planner-launch: each device's native planner (its CUDA path, with
    stand-ins for the driver) copies the fills and launches the device's next piece itself."""
    arch, path = checkpoint
    flags = OFFLOADED + (() if overlap else ("--no-overlap-decode",))
    one = _engine(path, "--device", "cpu", *flags)
    eager = _split(checkpoint, *flags)
    try:
        expected = _generate(eager)
        assert _generate(one) == expected, arch
    finally:
        one.close()
        eager.close()
    engine = _split(checkpoint, *flags)
    try:
        entered, sent, staged = [], [], []
        enter, send = LayerPlacement.enter, Crossing.send
        monkeypatch.setattr(
            LayerPlacement, "enter", lambda self, part: entered.append(part) or enter(self, part)
        )
        monkeypatch.setattr(Crossing, "send", lambda self: sent.append(self) or send(self))
        calls: dict[str, int] = {"copy": 0, "query": 0, "memset2d": 0, "copy2d": 0}
        launch_errors: list[BaseException] = []
        if launch:  # kept alive until the engine is closed
            stand_ins = (_host_driver(monkeypatch, calls),
                         _host_launches(monkeypatch, calls, launch_errors))  # fmt: skip
            for runner in engine.moe.runners:
                planner = runner.planner
                planner.copies = planner.launches = True
                planner._native = None
        graphs = _with_pieces(engine)
        runners = engine.moe.runners
        for d, runner in enumerate(runners):
            stage_decode = runner.staged.stage_decode

            def staging(stage, rows, launched=None, d=d, stage_decode=stage_decode):
                staged.append((d, stage.moe_layer))
                return stage_decode(stage, rows, launched)

            monkeypatch.setattr(runner.staged, "stage_decode", staging)
        entered.clear()  # (the capture's)
        sent.clear()
        replays = []
        run = graphs.run
        graphs.run = lambda rows: replays.append(len(rows)) or run(rows)
        assert _generate(engine) == expected, arch
        counters = engine.moe.counters
    finally:
        engine.close()
    moe_ranges = engine.layers_on.moe_ranges(engine.spec.moe_layers)
    # each device's pieces: one per MoE layer of its range, then its last one
    pieces = [len(r) + 1 for r in moe_ranges]
    assert len(replays) >= 10
    if launch:
        del stand_ins
        # every stage launched its device's next piece: its head and the piece
        assert not launch_errors
        assert calls["launch"] == 2 * engine.spec.num_moe_layers * len(replays)
        assert calls["copy"] > 0
    else:
        assert calls.get("launch", 0) == 0
    # each step asks each device's planner with its device current, then replays each device's
    # pieces with it current, then the first device's sampling
    assert entered == ([0, 1] + [0] * pieces[0] + [1] * pieces[1] + [0]) * len(replays)
    assert len(sent) == len(replays)
    # every replayed step staged each device's MoE layers, in order, on that device's runner
    layers = [(d, m) for d, r in enumerate(moe_ranges) for m in range(len(r))]
    assert staged == layers * len(replays)
    # misses copied into each device's cache and run on the CPU
    for span in moe_ranges:
        rows = slice(span.start, span.stop)
        if len(span):
            assert counters.fills[rows].sum() > 0 and counters.cpu[rows].sum() > 0, arch


@pytest.mark.skipif(torch.cuda.is_available(), reason="replays stand-in graphs on the CPU device")
def test_a_split_with_one_device_resident_decodes_from_pieces_on_both(tmp_path):
    """Sixteen slots a device: the first device holds every expert of its one MoE layer, the
    second misses some of its two layers'. The step runs from both devices' pieces (the first
    device's layer staged with every expert a hit) and gives the eager split's tokens."""
    path = synthesize(tmp_path, arch="qwen3_moe", preset="tiny", routing_skew=0.8, seed=5)
    flags = ("--moe-cache-size", "16", "--moe-miss-policy", "split:0.5")
    eager = _split(("qwen3_moe", path), *flags)
    try:
        expected = _generate(eager)
    finally:
        eager.close()
    engine = _split(("qwen3_moe", path), *flags)
    try:
        first, second = engine.cache.caches
        assert first.holds_everything and not second.holds_everything
        graphs = _with_pieces(engine)
        replays = []
        run = graphs.run
        graphs.run = lambda rows: replays.append(len(rows)) or run(rows)
        assert _generate(engine) == expected
        counters = engine.moe.counters
    finally:
        engine.close()
    assert len(replays) >= 10
    assert counters.fills[0] == counters.cpu[0] == 0
    assert counters.fills[1:].sum() > 0 and counters.cpu[1:].sum() > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="replays stand-in graphs on the CPU device")
def test_one_token_split_pieces_send_each_devices_planner_their_guesses(checkpoint, monkeypatch):
    """With --moe-cpu-prefetch-rounds and each device's native planner launching its pieces,
    every one-token piece that ends in a router sends a guess of its routing to its own
    device's planner, whose wait plans it: the workers fetch the guessed jobs' blocks, and every
    token is the eager split's."""
    arch, _ = checkpoint
    prompts = PROMPTS[:1]  # one sequence: the size-1 graphs, which guess
    flags = (*OFFLOADED, "--moe-cpu-prefetch-rounds", "2", "--moe-copy-ahead", "0")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eager = _split(checkpoint, *flags)
    try:
        expected = eager.generate(prompts, params)
    finally:
        eager.close()
    calls: dict[str, int] = {"copy": 0, "query": 0, "memset2d": 0, "copy2d": 0}
    launch_errors: list[BaseException] = []
    # the routings come late, while each planner waits (as in test_graphs.py's guessing engine)
    routing = LateRouting(_LateRouting.LATE_S)
    functions = list(host_functions(calls))
    functions[1] = routing.query
    addresses = tuple(address_of(f) for f in functions)
    monkeypatch.setattr(miss_plan, "driver_functions", lambda: addresses)
    stand_ins = (functions, _host_launches(monkeypatch, calls, launch_errors))
    engine = _split(checkpoint, *flags)
    try:
        for runner in engine.moe.runners:
            planner = runner.planner
            planner.copies = planner.launches = planner.split_misses = True
            planner._native = None
            late = _LateRouting(planner.native(), runner.staged.buffers.routing_signal(), routing)
            monkeypatch.setattr(planner, "native", lambda late=late: late)
        graphs = _with_pieces(engine)
        assert graphs.routing_guess is not None
        guessed = []
        for d, runner in enumerate(engine.moe.runners):
            assert runner.staged.buffers.guess is not None
            stage_decode = runner.staged.stage_decode

            def staging(stage, rows, launched=None, d=d, stage_decode=stage_decode):
                guessed.append((d, stage.moe_layer, stage.guess))
                return stage_decode(stage, rows, launched)

            monkeypatch.setattr(runner.staged, "stage_decode", staging)
        assert engine.generate(prompts, params) == expected, arch
        staged = engine.telemetry.stats(running=0, queued=0, model_name="m")["experts"][
            "staged_layer_us"
        ]
    finally:
        engine.close()
    del stand_ins
    assert not launch_errors and routing.arrivals
    moe_ranges = engine.layers_on.moe_ranges(engine.spec.moe_layers)
    layers = [(d, m, True) for d, r in enumerate(moe_ranges) for m in range(len(r))]
    assert guessed and guessed == layers * (len(guessed) // len(layers))
    assert staged["guesses"] > 0 and 0 < staged["prefetched_jobs"] <= staged["cpu_jobs"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="replays stand-in graphs on the CPU device")
@pytest.mark.parametrize("cache", ["resident", "offloaded"])
def test_a_device_with_only_dense_layers_decodes_from_its_graphs(tmp_path, cache):
    """qwen3_moe split after its dense layer 0: the first device has no MoE layer, so no
    expert cache and no runner; resident, each device's graph, offloaded, each device's pieces
    (the first device's range one piece, nothing staged on it) give the eager split's tokens
    and one device's, and one device's replayed logits to the bit."""
    path = synthesize(tmp_path, arch="qwen3_moe", preset="tiny", routing_skew=0.8, seed=5)
    flags = ("--no-overlap-decode", *(OFFLOADED if cache == "offloaded" else ()))
    split = ("--devices", "cpu,cpu", "--layer-split", "1,3")
    one = _engine(path, "--device", "cpu", *flags)
    eager = _engine(path, *split, *flags)
    replayed = _engine(path, *split, *flags)
    try:
        assert replayed.spec.moe_layers[0] == 1
        assert replayed.cache.caches[0] is None and replayed.moe.runners[0] is None
        if cache == "resident":
            one.stepper.graphs = DecodeGraphs(
                one.model, 4, one.max_context, graph_factory=ReplayGraph
            )
            one.stepper.graphs.capture()
            graphs = _with_graphs(replayed)
        else:
            graphs = _with_pieces(replayed)
            # the first device's range is one piece; the second's, one per MoE layer and its last
            assert [p.part for p in graphs.pieces[4]] == [0] + [1] * 4 + [0]
        replays = []
        run = graphs.run
        graphs.run = lambda rows: replays.append(len(rows)) or run(rows)
        logits = [_recording_logits(e) for e in (one, eager, replayed)]
        expected = _generate(eager)
        assert _generate(replayed) == expected == _generate(one)
        counters = replayed.moe.counters
    finally:
        one.close()
        eager.close()
        replayed.close()
    assert len(replays) == 14
    ones, eagers, ours = logits
    for mine, alone, theirs in zip(ours, ones, eagers, strict=True):
        if cache == "resident":
            assert torch.equal(mine, alone)
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-4)
    if cache == "offloaded":  # the second device's misses were copied and run on the CPU
        assert counters.fills.sum() > 0 and counters.cpu.sum() > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "offloaded"])
def test_two_gpus_with_only_dense_layers_on_one_give_one_cards_tokens(tmp_path, resident):
    """qwen3_moe split after its dense layer 0 across two GPUs in bf16: the first card holds no
    expert cache; its graph (resident) or its one piece (offloaded) and the second card's give
    one card's tokens."""
    path = synthesize(tmp_path, arch="qwen3_moe", preset="tiny", routing_skew=0.8, seed=5)
    cache = () if resident else ("--moe-cache-size", "6")
    one = _engine(path, "--device", "cuda:0", *cache, dtype="bfloat16")
    split = _engine(path, "--devices", "cuda:0,cuda:1", "--layer-split", "1,3", *cache,
                    dtype="bfloat16")  # fmt: skip
    try:
        graphs = split.graphs
        assert isinstance(graphs, SplitDecodeGraphs) and split.cache.caches[0] is None
        if not resident:
            assert [p.part for p in graphs.pieces[graphs.max_bs]] == [0] + [1] * 4 + [0]
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        assert split.generate(PROMPTS, params) == one.generate(PROMPTS, params)
    finally:
        one.close()
        split.close()
