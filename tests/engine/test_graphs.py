"""Decode steps replayed from captured pieces give the same tokens as eager steps."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import pytest
import torch

from moelab.engine.bench.report import staged_lines
from moelab.engine.experts import miss_plan, staged_decode
from moelab.engine.experts.h2d import address_of, host_functions, host_launch_functions
from moelab.engine.experts.miss_plan import Dispatch
from moelab.engine.experts.moe_stats import StagedStepTimes, plan_key
from moelab.engine.model import model as model_module
from moelab.engine.runtime.graphs import DecodeGraphs
from moelab.engine.runtime.sampling import Cut, SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from moelab.kernels import host_handoff, paged_attention
from moelab.kernels.common import compiled_variants

from .late_routing import TICK_S, LateRouting
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

    # the stand-in graphs by the exec handles they handed out (`_host_launches` replays them)
    by_handle: ClassVar[dict[int, ReplayGraph]] = {}

    def exec_handle(self) -> int:
        ReplayGraph.by_handle[id(self)] = self
        return id(self)


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def checkpoint(tmp_path_factory, request):
    """qwen2_moe: a shared expert, which the piece after each MoE layer adds before the residual;
    qwen3_moe: none, so that piece sums the routes into the residual and the next norm at once
    (sum_norm_when_ready)."""
    return synthesize(
        tmp_path_factory.mktemp("graphs"),
        arch=request.param,
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


def _eager_outputs(checkpoint, prompts: list[list[int]], max_tokens: int, *flags: str):
    """Each prompt's tokens from an engine with eager steps (the reference for replayed ones)."""
    eager = make_engine(checkpoint, *flags)
    try:
        return eager.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finally:
        eager.close()


def _host_driver(monkeypatch, calls: dict[str, int]) -> tuple:
    """Stand-ins for the driver's copy, sync and memset, on host memory: the native planner then
    takes its CUDA path (wait, plan, start, copy in one call) on the CPU device. Counts calls."""
    functions = host_functions(calls)
    addresses = tuple(address_of(f) for f in functions)
    monkeypatch.setattr(miss_plan, "driver_functions", lambda: addresses)
    return functions  # kept alive by the caller


def _host_launches(monkeypatch, calls: dict[str, int], errors: list[BaseException]) -> tuple:
    """Stand-ins for the driver's graph launch and event record and wait: the native planner
    then launches the next piece itself, a stand-in graph replayed as it is launched."""
    functions = host_launch_functions(
        lambda handle: ReplayGraph.by_handle[handle].replay(), calls, errors
    )
    addresses = tuple(address_of(f) for f in functions)
    monkeypatch.setattr(miss_plan, "launch_functions", lambda: addresses)
    return functions  # kept alive by the caller


OFFLOADED = ("--moe-cache-size", "20", "--moe-miss-policy", "split:0.5")


def piecewise_engine(checkpoint, *flags: str):
    """An offloaded engine on the CPU whose decode steps replay stand-in graphs of pieces."""
    engine = make_engine(checkpoint, *OFFLOADED, *flags)
    graphs = DecodeGraphs(
        engine.model, 4, engine.max_context, piecewise=True, graph_factory=ReplayGraph
    )
    graphs.capture()
    assert len(graphs.graphs[4]) == engine.spec.num_moe_layers + 1
    engine.stepper.graphs = graphs
    return engine


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
@pytest.mark.parametrize("early", [False, True], ids=["heads-after-plan", "early-heads"])
def test_a_capture_fixes_its_layer_stages_and_replays_reuse_their_records(checkpoint, early):
    """What a staged layer step takes of the captured pieces is fixed at capture: its layer and,
    where the native call launches the pieces, the next piece's (head, piece) execs and whether
    its router signals (every piece but the last); with --moe-early-cached, the next piece and
    the head of the piece after it (none after the last). Replayed steps hand the counters
    records that the staged decode reuses: a few records for every layer step of the run."""
    engine = piecewise_engine(checkpoint, *(("--moe-early-cached", "on") if early else ()))
    records: set[int] = set()
    stats = engine.moe.stats
    staged_steps = stats.staged_steps

    def kept(steps, replay_s, started) -> None:
        records.update(id(step) for step in steps)
        staged_steps(steps, replay_s, started)

    stats.staged_steps = kept
    try:
        graphs = engine.graphs
        layers = engine.spec.num_moe_layers
        for bs in graphs.sizes:
            assert [s.moe_layer for s in graphs.stages[bs]] == list(range(layers))
            assert all(s.launch is None and not s.signals for s in graphs.stages[bs])
            launched = graphs.launched_stages[bs]
            pieces, heads = graphs.graphs[bs], graphs.heads[bs]
            if early:
                assert [s.launch for s in launched] == [
                    (id(heads[p + 1]) if p < layers else 0, id(pieces[p]))
                    for p in range(1, layers + 1)
                ]
            else:
                assert [s.launch for s in launched] == [
                    (id(heads[p]), id(pieces[p])) for p in range(1, layers + 1)
                ]
            assert [s.signals for s in launched] == [True] * (layers - 1) + [False]
        engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.close()
    assert stats.staged_times.layer_steps >= 5 * layers
    assert 0 < len(records) <= 2


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
@pytest.mark.parametrize(
    "copies",
    ["python", "planner", "planner-split", "planner-launch", "python-early", "planner-split-early",
     "planner-launch-early"],
)  # fmt: skip
def test_piecewise_replay_matches_eager_steps_on_cpu(checkpoint, monkeypatch, copies, overlap):
    """python: the Python planner, copies by the host; planner: the native planner's CUDA path
    with whole misses only (the same decisions); planner-split: with split misses (the same
    tokens, other decisions); planner-launch: the same, the native call also launching the next
    piece's graphs (the fills joined by an event). -early: --moe-early-cached, each layer's
    cached routes run at its routing from the slot map's copy, before the host's plan (the
    native call launching the next piece and then the head after it)."""
    early = copies.endswith("-early")
    copies = copies.removesuffix("-early")
    eager = make_engine(checkpoint, *OFFLOADED)
    try:
        expected, expected_counts = _generate(eager)
    finally:
        eager.close()
    calls = {"copy": 0, "query": 0, "memset2d": 0, "copy2d": 0}
    driver = _host_driver(monkeypatch, calls) if copies != "python" else None
    launch_errors: list[BaseException] = []
    launches = _host_launches(monkeypatch, calls, launch_errors)
    native_launch = copies == "planner-launch"
    summed_into_norm = [0]
    sum_norm = staged_decode.sum_norm_when_ready

    def counted_sum_norm(*args, **kwargs):
        summed_into_norm[0] += 1
        return sum_norm(*args, **kwargs)

    monkeypatch.setattr(staged_decode, "sum_norm_when_ready", counted_sum_norm)
    engine = piecewise_engine(
        checkpoint, *(() if overlap else ("--no-overlap-decode",)),
        *(("--moe-early-cached", "on") if early else ()),
    )  # fmt: skip
    summed_into_norm[0] = 0  # the replays' own, not the capture's
    try:
        planner = engine.moe.planner
        if driver is not None:  # the fills queued by the native call
            planner.copies = True
            planner.split_misses = copies in ("planner-split", "planner-launch")
            planner.launches = native_launch
            planner._native = None
        joins = [0]
        join_fills = engine.moe.staged.join_fills

        def counted_join() -> None:
            joins[0] += 1
            join_fills()

        monkeypatch.setattr(engine.moe.staged, "join_fills", counted_join)
        graphs = engine.graphs
        replays, queued_behind, landed_while_staging = [], [], []
        run, land = graphs.run, engine.stepper._land
        staging = [False]

        def counted_run(rows):
            replays.append(len(rows))
            # a step queued behind an unread one takes its input tokens from the device
            queued_behind.append(all(row.source >= 0 for row in rows))
            staging[0] = True
            try:
                return run(rows)
            finally:
                staging[0] = False

        def recorded_land(flight, settled=None):
            landed_while_staging.append(staging[0])
            return land(flight, settled)

        graphs.run = counted_run
        engine.stepper._land = recorded_land
        outputs, counts = _generate(engine)
        staged = engine.telemetry.stats(running=0, queued=0, model_name="m")["experts"][
            "staged_layer_us"
        ]
    finally:
        engine.close()
    assert outputs == expected
    # each wait cleared the routing's signal for the next piece (the planner, on seeing it; the
    # Python path, after its sync)
    assert engine.moe.staged.buffers.signal[0] == 0
    # without a shared expert, every replayed piece after an MoE layer summed its routes into the
    # residual and the next norm in one pass; with one, none did
    shared = engine.model.norm_after_experts(0) is None
    assert shared == (engine.spec.arch == "qwen2_moe")
    assert summed_into_norm[0] == (0 if shared else len(replays) * engine.spec.num_moe_layers)
    # three sequences ran in the size-4 graphs: the padding row was never sent to the experts
    if copies in ("planner-split", "planner-launch"):  # a split counts on the CPU; other decisions
        assert counts["reads"] == expected_counts["reads"]
        # a split's two 2D copies (gate and up rows; down projection columns) and one memset
        assert 0 < staged["split_misses"] == calls["memset2d"] == calls["copy2d"] // 2
    else:
        assert counts == expected_counts and staged["split_misses"] == 0
    assert counts["fills"] > 0 and counts["cpu"] > 0
    # every replayed decode step staged every MoE layer once, and the host's time between the
    # pieces is accounted for by stage
    assert len(replays) >= 20
    assert staged["layer_steps"] == len(replays) * engine.spec.num_moe_layers
    stages = StagedStepTimes.STAGES
    assert all(staged[f"{name}_us"] > 0 for name in stages)
    assert staged["total_us"] == pytest.approx(sum(staged[f"{name}_us"] for name in stages))
    # each layer step but a token's last has its period, keyed by its plan
    periods = staged["period_by_plan"]
    assert sum(p["steps"] for p in periods.values()) == len(replays) * (
        engine.spec.num_moe_layers - 1
    )
    assert all(re.fullmatch(r"\d+\+\d+s?", plan) and p["us"] > 0 for plan, p in periods.items())
    assert any(plan.endswith("s") for plan in periods) == (copies != "planner" and bool(driver))
    # and each replayed step after another has the period from that one's last routing to its
    # first; a prefill between them breaks the chain (one prompt per sequence here, all at once)
    times = engine.moe.staged_times
    assert staged["boundary_us"] > 0 and times.boundaries == len(replays) - 1
    # of which the host's part ends as the next step's first piece is launched, before its
    # routing arrives
    assert 0 < staged["boundary_host_us"] < staged["boundary_us"]
    assert any(not plan.startswith("0+") for plan in periods)  # steps with fills
    if driver is not None:  # every staged wait took its piece's routing signal, none asked the
        # stream; two copies per staged fill (the decode steps run eagerly fill too, without them)
        assert calls["query"] == 0
        whole = calls["copy"]
        assert 0 < whole <= 2 * counts["fills"] and whole % 2 == 0
    layer_steps = staged["layer_steps"]
    if native_launch:  # each layer step launched its next piece's head and piece natively, and
        # joined the fills where it queued any, by the event; Python joined none (early: the
        # heads after the first layer's, which Python launches after the first piece)
        assert not launch_errors
        heads = layer_steps - (len(replays) if early else 0)
        assert calls["launch"] == layer_steps + heads and joins[0] == 0
        assert 0 < calls["record"] == calls["wait_event"] < layer_steps
    else:  # Python launched every piece after the first, joining the fills before each
        assert calls.get("launch", 0) == 0 and joins[0] == layer_steps
    del launches
    # overlapped: most steps were staged while the step before them was still unread, which the
    # host read in a wait of the staging
    assert sum(queued_behind) > len(replays) // 2 if overlap else not any(queued_behind)
    assert sum(landed_while_staging) == sum(queued_behind)


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
@pytest.mark.parametrize("launch", [False, True], ids=["python-launches", "planner-launches"])
def test_overlapped_decode_of_one_moe_layer_reads_each_step_tokens(tmp_path, monkeypatch, launch):
    """Two pieces a step: the last piece, which stores the step's tokens into the one host buffer
    they are read from, is launched by the first staging, so the step before is landed ahead of
    it (else its tokens would be read overwritten)."""
    one = synthesize(tmp_path, arch="qwen3_moe", preset="tiny", routing_skew=0.8, seed=3,
                     overrides={"num_experts": 16, "num_hidden_layers": 2})  # fmt: skip
    expected = _eager_outputs(one, PROMPTS, 12, *OFFLOADED)
    calls: dict[str, int] = {}
    driver = _host_driver(monkeypatch, calls)
    launches = _host_launches(monkeypatch, calls, errors := [])
    engine = piecewise_engine(one)
    try:
        assert engine.model.num_pieces == 2
        planner = engine.moe.planner
        planner.copies = planner.launches = launch
        planner._native = None
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.close()
    assert outputs == expected and not errors
    assert (calls.get("launch", 0) > 0) == launch
    del driver, launches


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
def test_overlapped_piecewise_decode_with_stops_and_a_shrinking_batch(checkpoint):
    """Requests that end at different steps, one on a stop token while the next step is already
    staged: the tokens of eager steps, and the CPU jobs of the dropped step do not leak."""
    eager = make_engine(checkpoint, *OFFLOADED)
    try:
        stop_token, expected_seqs = _run_with_a_stop(eager)
        expected = [(s.output_ids, s.finish_reason) for s in expected_seqs]
    finally:
        eager.close()
    assert expected[2][1] == "stop"
    engine = piecewise_engine(checkpoint)
    sources = _recording_sources(engine)
    try:
        _, seqs = _run_with_a_stop(engine, stop_token)
        assert engine.idle and engine.kv.used_blocks == 0
        assert engine.moe.staged._pending is None and not engine.moe.staged._uncounted
    finally:
        engine.close()
    assert [(s.output_ids, s.finish_reason) for s in seqs] == expected
    assert sum(all(src >= 0 for src in step) for step in sources) > len(sources) // 2


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
def test_an_error_in_landing_during_the_staging_comes_after_the_step_is_queued(checkpoint):
    """The previous step is landed inside the next one's staging; an error there (a streaming
    callback that fails) surfaces once the step is fully queued, and decoding goes on."""
    want = _eager_outputs(checkpoint, PROMPTS[:1], 8, *OFFLOADED)
    engine = piecewise_engine(checkpoint)
    try:
        seq = engine.add(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
        calls = [0]

        def on_token(s, token) -> None:
            calls[0] += 1
            if calls[0] == 3:
                raise ValueError("the client went away")

        seq.on_token = on_token
        with pytest.raises(ValueError, match="the client went away"):
            engine.run_until_idle()
        assert engine.stepper.in_flight and not engine.moe.staged._host_work
        engine.run_until_idle()
        assert engine.idle and engine.kv.used_blocks == 0
    finally:
        engine.close()
    assert seq.output_ids == want[0]


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
@pytest.mark.parametrize("planner", ["native", "python"])
def test_a_cpu_job_that_never_hands_over_fails_the_step_clearly(checkpoint, monkeypatch, planner):
    """The next piece waits for the CPU's part; if it never comes, the step fails with a message
    (not a hang, not a wrong token)."""
    monkeypatch.setattr(host_handoff, "TIMEOUT_S", 0.2)
    engine = make_engine(checkpoint, "--moe-cache-size", "20", "--moe-miss-policy", "cpu")
    try:
        graphs = DecodeGraphs(
            engine.model, 4, engine.max_context, piecewise=True, graph_factory=ReplayGraph
        )
        graphs.capture()
        engine.stepper.graphs = graphs
        # a job that never writes its epoch
        native = engine.moe.planner.native()
        if planner == "native":
            assert native is not None

            class NoHandover:
                def step(self, *args):
                    done_flag = 8  # step's argument: its address, 0 for none
                    return native.step(*args[:done_flag], 0, *args[done_flag + 1 :])

            monkeypatch.setattr(engine.moe.planner, "native", NoHandover)
        else:
            monkeypatch.setattr(engine.moe.planner, "native", lambda: None)
            submit = engine.moe.cpu.submit
            monkeypatch.setattr(engine.moe.cpu, "submit", lambda *a, **handoff: submit(*a))
        with pytest.raises(RuntimeError, match="gave up waiting for the CPU experts"):
            engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        engine.close()


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
def test_a_routing_that_never_signals_fails_the_step_clearly(checkpoint, monkeypatch):
    """The native planner's wait takes the routing's signal, and asks the stream now and then
    whether it is still running: a piece whose router stores the routing but never sets the
    signal, on a stream gone idle, fails the step with a message (not a hang)."""
    calls = {"copy": 0, "query": 0, "memset2d": 0, "copy2d": 0}
    driver = _host_driver(monkeypatch, calls)
    engine = piecewise_engine(checkpoint)
    try:
        engine.moe.planner.copies = True
        engine.moe.planner._native = None
        silent = lambda signal, device: None  # noqa: E731
        monkeypatch.setattr(host_handoff, "signal_routing", silent)  # route_ref's
        monkeypatch.setattr(model_module, "signal_routing", silent)  # the two-launch router's
        with pytest.raises(RuntimeError, match="went idle without the routing's signal"):
            engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))
        assert calls["query"] == 1  # asked once its polls were up, and idle
    finally:
        engine.close()
    del driver


def test_a_layer_steps_plan_key_marks_its_split_and_its_guess():
    """`plan_key`: "q+c" (copied + on the CPU), "s" for a split miss, then "p" where the CPU
    job's first blocks were its workers' (a matching guess), "w" where a guess of CPU work came
    and the job was another, nothing where no such guess came; then "a" where the device's first
    miss was copied in part ahead of the routing."""

    def dispatch(**fields) -> Dispatch:
        none = np.zeros((1, 2), dtype=np.int64)
        return Dispatch([3, 5, 9], [0, -1, -1], [5, 9], [(5, 1)], [9], none, None, **fields)

    assert plan_key(dispatch()) == "1+1"
    assert plan_key(dispatch(split=(9, 2, 16))) == "1+1s"
    assert plan_key(dispatch(guessed=True, owned_blocks=4)) == "1+1p"
    assert plan_key(dispatch(split=(9, 2, 16), guessed=True)) == "1+1sw"
    assert plan_key(dispatch(guessed=True, ahead_rows=8)) == "1+1wa"
    assert plan_key(dispatch(ahead_rows=8)) == "1+1a"


class _LateRouting:
    """The native planner's `step`, with each routing taken back as the wait begins and set
    again at its next query of the stream, 2 ms after by the wait's clock (`LateRouting`), as a
    GPU's would come after the guess (the stand-in graphs run as they are launched, so the
    routing is there before the wait begins); it notes the MoE layers whose waits got a guess."""

    LATE_S = 0.002

    def __init__(self, native, signal, routing: LateRouting) -> None:
        self.native, self.signal, self.routing = native, signal, routing
        self.guessed_layers: set[int] = set()
        routing.set_clock_of(native)

    def step(self, *args):
        if args[-3]:  # the guess's logits
            self.guessed_layers.add(args[0])
        if self.signal[0]:
            self.routing.arm(self.signal)
        return self.native.step(*args)


def _guessing_engine(checkpoint, monkeypatch, calls: dict, launch_errors: list, *flags: str):
    """An offloaded engine on the CPU whose one-token pieces (stand-in graphs, launched by the
    native planner through stand-in driver functions on host memory) send guesses of their
    routing, and whose routings come late (`_LateRouting`): (engine, the late planner)."""
    routing = LateRouting(_LateRouting.LATE_S)
    functions = list(host_functions(calls))
    functions[1] = routing.query  # the stream busy until the routing comes: the signals decide
    addresses = tuple(address_of(f) for f in functions)
    monkeypatch.setattr(miss_plan, "driver_functions", lambda: addresses)
    launches = _host_launches(monkeypatch, calls, launch_errors)
    engine = make_engine(checkpoint, *OFFLOADED, *flags)
    moe = engine.moe
    moe.planner.copies = moe.planner.launches = moe.planner.split_misses = True
    moe.planner._native = None
    graphs = DecodeGraphs(
        engine.model, 4, engine.max_context, piecewise=True, graph_factory=ReplayGraph
    )
    graphs.capture()
    engine.stepper.graphs = graphs
    assert graphs.routing_guess is moe.staged.guess_buffers() is not None
    late = _LateRouting(moe.planner.native(), moe.staged.buffers.signal, routing)
    late.stand_ins = (functions, launches)  # alive while their addresses are in use
    monkeypatch.setattr(moe.planner, "native", lambda: late)
    return engine, late


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
def test_guessed_routings_have_the_workers_fetch_their_blocks_and_change_no_token(
    checkpoint, monkeypatch
):
    """With --moe-cpu-prefetch-rounds, each one-token piece that ends in a router (the first
    one too, from the embedding) sends a guess of its routing ahead of it, which the planner's
    wait plans: the CPU jobs whose plan was guessed
    run with their first blocks their workers' own, and every token is the eager steps' token."""
    prompts = PROMPTS[:1]  # one sequence: the size-1 graphs, which guess
    expected = _eager_outputs(checkpoint, prompts, 24, *OFFLOADED)
    calls = {"copy": 0, "query": 0, "memset2d": 0, "copy2d": 0}
    launch_errors: list[BaseException] = []
    engine, late = _guessing_engine(
        checkpoint, monkeypatch, calls, launch_errors,
        "--moe-cpu-prefetch-rounds", "2", "--moe-copy-ahead", "0",
    )  # fmt: skip
    moe = engine.moe
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        staged = engine.telemetry.stats(running=0, queued=0, model_name="m")["experts"][
            "staged_layer_us"
        ]
        # between runs (bench decode --alternate-prefetch-rounds), 0 rounds: the pieces still
        # send guesses, the waits ignore them; then 2 again
        again = []
        for rounds in (0, 2):
            moe.set_prefetch_rounds(rounds)
            assert engine.config_in_force()["cpu_prefetch_rounds"] == rounds
            moe.staged_times = StagedStepTimes()
            params = SamplingParams(max_tokens=24, ignore_eos=True)
            again.append((engine.generate(prompts, params), moe.staged_times))
    finally:
        engine.close()
    assert outputs == expected and not launch_errors and late.routing.arrivals
    assert late.guessed_layers == set(range(len(engine.spec.moe_layers)))
    (ignored, ignoring), (resumed, resuming) = again
    assert ignored == resumed == expected
    assert ignoring.guesses == ignoring.prefetched_jobs == 0 and ignoring.cpu_jobs > 0
    assert resuming.guesses > 0 and resuming.prefetched_jobs > 0
    # the layer steps had guesses; those of CPU work told the workers what to fetch, and the
    # jobs whose plan they named gave them their blocks
    assert staged["cpu_jobs"] > 0 and 0 < staged["prefetched_jobs"] <= staged["guesses"]
    assert staged["prefetched_jobs"] <= staged["cpu_jobs"]
    assert staged["copied_ahead"] == staged["ahead_missed"] == 0  # --moe-copy-ahead 0
    assert moe.staged.buffers.guess[1][0] == 0  # cleared with each routing's signal
    # their layer steps' periods apart from the others' (plans marked "p"), and said by the bench
    periods = staged["period_by_plan"]
    prefetched = sum(p["steps"] for plan, p in periods.items() if plan.endswith("p"))
    assert 0 < prefetched <= staged["prefetched_jobs"]
    # the steps whose guess named another job (plans marked "w") apart too: with the prefetched
    # ones, at most one a guess
    wrong = sum(p["steps"] for plan, p in periods.items() if plan.endswith("w"))
    assert prefetched + wrong <= staged["guesses"]
    said = f"blocks (plans marked p): {staged['prefetched_jobs']} of {staged['cpu_jobs']}"
    assert said in staged_lines(staged)


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
@pytest.mark.parametrize("rounds", ["0", "2"])
def test_copies_ahead_of_the_routing_change_no_token(checkpoint, monkeypatch, rounds):
    """With --moe-copy-ahead (here without the workers' prefetch too), each guess starts copying
    the first rows of its step's first device miss into a slot before the routing comes; the
    steps whose miss it was take those rows on the device and copy only the rest, and every
    token is the eager steps' token. The first guesses copy nothing: the lead they size the
    copy by is measured from them. Then 0 between runs (`set_copy_ahead`): no copies ahead."""
    prompts = PROMPTS[:1]
    expected = _eager_outputs(checkpoint, prompts, 24, *OFFLOADED)
    calls = {"copy": 0, "query": 0, "memset2d": 0, "copy2d": 0}
    launch_errors: list[BaseException] = []
    engine, late = _guessing_engine(
        checkpoint, monkeypatch, calls, launch_errors,
        "--moe-cpu-prefetch-rounds", rounds, "--moe-copy-ahead", "1",
    )  # fmt: skip
    moe = engine.moe
    # a rate at which the lead (the routing's 2 ms, and the wait's two readings of its clock
    # after the guess's) copies half an expert's rows (the engine's own, the rate of host copies
    # on this machine, would copy whole ones)
    lead_s = _LateRouting.LATE_S + 2 * TICK_S
    inter = moe.bank.w2[0].shape[-1]
    row_bytes = 2 * moe.bank.w2[0].shape[1] * moe.bank.w2[0].element_size()  # gate and up
    moe.planner.copy_rate = (inter // 2 + 0.5) * row_bytes / lead_s
    moe.set_copy_ahead(1.0)
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        staged = moe.staged_times.to_dict()
        lead = moe.guess_lead_seconds()
        moe.set_copy_ahead(0.0)
        assert engine.config_in_force()["copy_ahead"] == 0.0
        moe.staged_times = StagedStepTimes()
        off = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        off_staged = moe.staged_times.to_dict()
    finally:
        engine.close()
    assert outputs == off == expected and not launch_errors and late.routing.arrivals
    assert lead == pytest.approx(lead_s)  # every routing came 2 ms after its guess
    assert staged["copied_ahead"] > 0 and off_staged["copied_ahead"] == 0
    assert off_staged["ahead_missed"] == 0
    # marked "a" in the periods, and said by the bench
    periods = staged["period_by_plan"]
    ahead = sum(p["steps"] for plan, p in periods.items() if plan.endswith("a"))
    assert 0 < ahead <= staged["copied_ahead"]
    lines = staged_lines({**staged, "guess_lead_us": 1e6 * lead})
    assert f"(plans marked a): {staged['copied_ahead']} steps took one" in lines
    # the guesses the wait planned, and the host's time on them (one reading of the wait's
    # clock each; the routings came 2 ms late)
    assert staged["guess_plans"] >= staged["copied_ahead"]
    assert staged["guess_plan_us"] == pytest.approx(1e6 * TICK_S)
    assert staged["guess_late"] == 0
    assert f"guesses planned in the wait: {staged['guess_plans']}, " in lines


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """An FP8 checkpoint whose experts' I is two blocks of 128 rows: a miss splits at one."""
    return synthesize(
        tmp_path_factory.mktemp("graphs-fp8"), arch="qwen3_moe", preset="tiny", routing_skew=0.8,
        seed=9, overrides={"num_experts": 16, "moe_intermediate_size": 256}, dtype="fp8",
    )  # fmt: skip


@pytest.mark.skipif(DEVICE != "cpu", reason="replays the pieces on the CPU device")
def test_fp8_experts_split_and_copied_ahead_by_the_native_planner_change_no_token(
    fp8_checkpoint, monkeypatch
):
    """FP8 experts through the native planner's CUDA path on the CPU (stand-in driver functions
    on host memory, pieces launched by the planner, guesses of the routing): whole fills copy an
    expert's values and factors, split misses split at the block between I's two blocks, and a
    copy ahead takes the first block's rows; every token is the eager steps' (which plan with
    the same native planner, without copies)."""
    prompts = PROMPTS[:1]
    expected = _eager_outputs(fp8_checkpoint, prompts, 24, *OFFLOADED)
    calls = {"copy": 0, "query": 0, "memset2d": 0, "copy2d": 0}
    launch_errors: list[BaseException] = []
    engine, late = _guessing_engine(
        fp8_checkpoint, monkeypatch, calls, launch_errors,
        "--moe-cpu-prefetch-rounds", "2", "--moe-copy-ahead", "1",
    )  # fmt: skip
    moe = engine.moe
    assert moe.bank.fmt == "fp8" and moe.cache.fmt == "fp8"
    # a rate at which the lead copies 200 of the 256 rows' gate and up with their factors: whole
    # blocks, so 128
    lead_s = _LateRouting.LATE_S + 2 * TICK_S
    row_bytes = sum(t[0].nbytes for t in moe.bank.layer_tensors(0)[::2]) / 256
    moe.planner.copy_rate = 200.5 * row_bytes / lead_s
    moe.set_copy_ahead(1.0)
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        staged = moe.staged_times.to_dict()
    finally:
        engine.close()
    assert outputs == expected and not launch_errors and late.routing.arrivals
    assert staged["split_misses"] > 0 and staged["copied_ahead"] > 0
    # per split, values and factors: a memset of gate and up's other rows each, and 2D copies
    # of their first rows and of the down projection's first columns each (one of those less
    # where the copy ahead took all of the device's rows); per copy ahead two more
    assert calls["memset2d"] == 2 * staged["split_misses"]
    assert calls["copy"] > 0 and calls["copy2d"] >= 2 * staged["copied_ahead"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("early", [False, True], ids=["heads-after-plan", "early-heads"])
@pytest.mark.parametrize("split", [True, False], ids=["split-misses", "whole-misses"])
def test_offloaded_decode_replays_captured_pieces_on_cuda(checkpoint, split, early):
    """Split misses are the default; --no-split-misses copies or runs every miss whole.
    --moe-early-cached runs each layer's cached routes at its routing, from the slot map's
    copy, while the host plans."""
    flags = ("--device", "cuda", "--moe-cache-size", "20", "--moe-miss-policy", "split:0.5")
    eager = make_engine(checkpoint, *flags, "--no-cuda-graph")
    try:
        expected, expected_counts = _generate(eager)
    finally:
        eager.close()
    engine = make_engine(
        checkpoint, *flags, *(() if split else ("--no-split-misses",)),
        *(("--moe-early-cached", "on") if early else ()),
    )  # fmt: skip
    try:
        assert engine.config_in_force()["cuda_graph_mode"] == "piecewise"
        outputs, counts = _generate(engine)
        split_misses = engine.moe.staged_times.split_misses
    finally:
        engine.close()
    assert outputs == expected
    assert counts["fills"] > 0 and counts["cpu"] > 0
    if split:  # other decisions (a split miss counts on the CPU), the same tokens
        assert counts["reads"] == expected_counts["reads"] and split_misses > 0
    else:
        assert counts == expected_counts and split_misses == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_guessed_routings_on_cuda_run_beside_the_chain_and_change_no_token(checkpoint):
    """--moe-cpu-prefetch-rounds on CUDA: each one-token piece's guess runs on a side stream of
    its captured graph, joined before the router (Model._guess); the guesses reach the host and
    the tokens are the eager steps'. Whether the host plans a guess depends on its wait starting
    before the routing comes, which on this small model it often does not (on the H200, no guess
    was planned in three of four runs, one of two with the guess on the chain); the planning is
    tested with a late routing on the CPU
    (`test_guessed_routings_have_the_workers_fetch_their_blocks_and_change_no_token`)."""
    flags = ("--device", "cuda", "--moe-cache-size", "20", "--moe-miss-policy", "split:0.5")
    prompts = PROMPTS[:1]  # one sequence: the size-1 graphs, which guess
    expected = _eager_outputs(checkpoint, prompts, 24, *flags, "--no-cuda-graph")
    engine = make_engine(checkpoint, *flags, "--moe-cpu-prefetch-rounds", "2")
    try:
        assert engine.config_in_force()["cuda_graph_mode"] == "piecewise"
        assert engine.graphs.routing_guess is engine.moe.staged.guess_buffers() is not None
        logits, signal = engine.graphs.routing_guess
        logits.fill_(0.0)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        cpu_jobs = engine.telemetry.stats(running=0, queued=0, model_name="m")["experts"][
            "staged_layer_us"
        ]["cpu_jobs"]
    finally:
        engine.close()
    assert outputs == expected and cpu_jobs > 0
    # the replayed pieces stored their guesses' logits (a router's, never all zero) and the
    # waits cleared their signal with the routing's
    assert torch.count_nonzero(logits) > 0 and signal[0] == 0


def _resident_engine_with_replay_graphs(checkpoint, *flags: str):
    """An all-resident engine on the CPU whose decode steps replay whole-step stand-in graphs."""
    engine = make_engine(checkpoint, *flags)
    assert engine.cache.holds_everything
    graphs = DecodeGraphs(engine.model, 4, engine.max_context, graph_factory=ReplayGraph)
    graphs.capture()
    engine.stepper.graphs = graphs
    return engine


def _mixed_requests(engine, stop_token: int | None) -> list:
    """Four requests ending at different steps, so the batch shrinks while steps are in flight."""
    stop = (stop_token,) if stop_token is not None else ()
    return [
        engine.add(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True)),
        engine.add(PROMPTS[1], SamplingParams(max_tokens=7, ignore_eos=True)),
        engine.add(PROMPTS[2], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=stop)),
        engine.add(list(range(60, 64)), SamplingParams(max_tokens=1, ignore_eos=True)),
    ]


def _run_with_a_stop(engine, stop_token: int | None = None) -> tuple[int, list]:
    """The mixed requests to the end, then again with the third stopping on a token it makes
    mid-way (taken from the first run when stop_token is None): both engines of a comparison
    then have the same history. Returns the stop token and the second run's sequences."""
    probe = _mixed_requests(engine, None)
    engine.run_until_idle()
    if stop_token is None:
        stop_token = probe[2].output_ids[9]
    seqs = _mixed_requests(engine, stop_token)
    engine.run_until_idle()
    return stop_token, seqs


def _recording_sources(engine) -> list[list[int]]:
    """Each replayed step's rows' token sources (-1: a token the host sent), from now on."""
    sources: list[list[int]] = []
    run = engine.graphs.run
    engine.graphs.run = lambda rows: sources.append([r.source for r in rows]) or run(rows)
    return sources


@pytest.mark.skipif(DEVICE != "cpu", reason="replays stand-in graphs on the CPU device")
def test_overlapped_decode_gives_the_tokens_of_synchronous_steps(checkpoint):
    eager = make_engine(checkpoint)
    try:
        stop_token, expected_seqs = _run_with_a_stop(eager)
        expected = [(s.output_ids, s.finish_reason) for s in expected_seqs]
        c = eager.moe.counters
        expected_counts = {k: int(getattr(c, k).sum()) for k in ("reads", "hits", "picks")}
    finally:
        eager.close()
    assert expected[2][1] == "stop" and len(expected[2][0]) < 24
    engine = _resident_engine_with_replay_graphs(checkpoint)
    sources = _recording_sources(engine)
    try:
        _, seqs = _run_with_a_stop(engine, stop_token)
        assert engine.idle and engine.kv.used_blocks == 0
        c = engine.moe.counters
        counts = {k: int(getattr(c, k).sum()) for k in ("reads", "hits", "picks")}
        picks_per_token = engine.spec.num_moe_layers * engine.spec.top_k
    finally:
        engine.close()
    assert [(s.output_ids, s.finish_reason) for s in seqs] == expected
    # the request that stopped on a token had one more step queued behind it: its token was
    # dropped, its experts were read (and counted)
    assert counts["picks"] == expected_counts["picks"] + picks_per_token
    assert counts["hits"] == counts["reads"] >= expected_counts["reads"]
    # most steps read their input tokens from the step before them, still on the device
    assert sum(all(src >= 0 for src in step) for step in sources) > len(sources) // 2


def _drawn_requests(engine) -> list:
    """Seeded requests whose tokens are drawn beside a greedy one, ending at different steps:
    the batch's widest cut (sampling.Cut) is the sort while the top-p request runs, then the
    top-k one's, then the top logit's."""

    def params(max_tokens: int, **draw) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **draw)

    return [
        engine.add(PROMPTS[0], params(20, temperature=0.9, seed=1)),
        engine.add(PROMPTS[1], params(14)),
        engine.add(PROMPTS[2], params(14, temperature=1.1, top_p=0.9, top_k=40, seed=2)),
        engine.add(list(range(60, 64)), params(6, temperature=0.7, top_p=0.8, min_p=0.05, seed=3)),
    ]


def _counting_draws(engine) -> dict[tuple[int, Cut], int]:
    """How often each draw graph (batch size, cut) replays, from now on."""
    replays: dict[tuple[int, Cut], int] = {}
    for key, graph in engine.graphs.draws.items():

        def counted(replay=graph.replay, key=key) -> None:
            replays[key] = replays.get(key, 0) + 1
            replay()

        graph.replay = counted
    return replays


@pytest.mark.skipif(DEVICE != "cpu", reason="replays stand-in graphs on the CPU device")
@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_drawn_tokens_taken_on_the_device_are_the_host_samplers(checkpoint, pieces):
    """Requests with a temperature overlap their steps too: the graphs draw their tokens on the
    device with the host sampler's function, so a seeded request gets the same tokens as from
    an engine whose host samples every step."""
    flags = OFFLOADED if pieces else ()
    eager = make_engine(checkpoint, *flags)
    try:
        expected = [s.output_ids for s in _drawn_requests(eager)]
        eager.run_until_idle()
        greedy = eager.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    finally:
        eager.close()
    engine = (
        piecewise_engine(checkpoint) if pieces else _resident_engine_with_replay_graphs(checkpoint)
    )
    sources = _recording_sources(engine)
    replays = _counting_draws(engine)
    try:
        seqs = _drawn_requests(engine)
        engine.run_until_idle()
    finally:
        engine.close()
    assert [s.output_ids for s in seqs] == expected
    # the draws are draws: not the greedy tokens
    assert expected[0] != greedy[0] and expected[2] != greedy[2][:14]
    # most steps took their input tokens from the step before, on the device; each drawn
    # step's tokens came from a draw graph, the one of the batch's widest cut
    assert sum(all(src >= 0 for src in step) for step in sources) > len(sources) // 2
    assert sum(replays.values()) == len(sources)
    assert replays.get((4, Cut.SORT), 0) >= 3 and replays.get((4, Cut.NARROW), 0) >= 5
    assert replays.get((1, Cut.TOP), 0) >= 3


@pytest.mark.skipif(DEVICE != "cpu", reason="replays stand-in graphs on the CPU device")
def test_cancel_and_sampled_requests_while_a_step_is_in_flight(checkpoint):
    expected = _eager_outputs(checkpoint, PROMPTS[:2], 16)
    engine = _resident_engine_with_replay_graphs(checkpoint)
    try:
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        first, second = (engine.add(p, params) for p in PROMPTS[:2])
        while len(first.output_ids) < 4:
            engine.step()
        assert engine.stepper.in_flight and first.pending == 1
        engine.cancel(first)
        # a request asking for log probabilities joins: the host reads its logits, so its
        # steps wait for their tokens
        sampled = engine.add(
            PROMPTS[2], SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=2)
        )
        in_flight = []  # while it runs
        while not sampled.finished:
            engine.step()
            in_flight.append(engine.stepper.in_flight)
        engine.run_until_idle()
        assert engine.kv.used_blocks == 0
    finally:
        engine.close()
    assert first.finish_reason == "cancelled"
    assert first.output_ids == expected[0][: len(first.output_ids)]
    assert second.output_ids == expected[1]
    assert len(sampled.output_ids) == 5 and sampled.finish_reason == "length"
    assert len(sampled.output_logprobs) == 5 and not any(in_flight)


def _steps_in_flight(engine) -> int:
    """Step the engine until it is idle; how many steps left one in flight."""
    in_flight = 0
    while not engine.idle:
        engine.step()
        in_flight += engine.stepper.in_flight
    return in_flight


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_decode_on_cuda_gives_the_tokens_of_eager_steps(checkpoint):
    flags = ("--device", "cuda")
    eager = make_engine(checkpoint, *flags, "--no-cuda-graph")
    try:
        expected_seqs = _mixed_requests(eager, None)
        eager.run_until_idle()
    finally:
        eager.close()
    engine = make_engine(checkpoint, *flags)
    try:
        assert engine.config_in_force()["cuda_graph_mode"] == "whole"
        seqs = _mixed_requests(engine, None)
        in_flight = _steps_in_flight(engine)
    finally:
        engine.close()
    assert in_flight > 10
    assert [(s.output_ids, s.finish_reason) for s in seqs] == [
        (s.output_ids, s.finish_reason) for s in expected_seqs
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_drawn_tokens_on_cuda_are_the_host_samplers(checkpoint, pieces):
    """The CUDA draw graphs (one with torch's sort captured) give a seeded request the tokens
    that the host's sampler draws from the same graphs' logits."""
    flags = ("--device", "cuda", *(OFFLOADED if pieces else ()))
    synchronous = make_engine(checkpoint, *flags, "--no-overlap-decode")
    try:
        expected = [s.output_ids for s in _drawn_requests(synchronous)]
        synchronous.run_until_idle()
    finally:
        synchronous.close()
    engine = make_engine(checkpoint, *flags)
    try:
        mode = engine.config_in_force()["cuda_graph_mode"]
        assert mode == ("piecewise" if pieces else "whole")
        replays = _counting_draws(engine)
        seqs = _drawn_requests(engine)
        in_flight = _steps_in_flight(engine)
    finally:
        engine.close()
    assert [s.output_ids for s in seqs] == expected
    assert in_flight > 10 and sum(replays.values()) >= in_flight


def _attention_variants() -> int:
    return compiled_variants((paged_attention._split_kernel, paged_attention._merge_kernel))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eager_decode_steps_beside_the_graphs_compile_no_attention_variant(checkpoint, monkeypatch):
    """A decode step run eagerly beside the captured graphs (the telemetry's phase-timed step,
    one every 30 s) launches the attention with the graphs' table width, so that sequences of
    any length compile nothing new. Tables as wide as the batch's longest sequence compiled a
    variant for each new width such a step met."""
    engine = make_engine(checkpoint, "--device", "cuda")
    try:
        assert engine.config_in_force()["cuda_graph_mode"] == "whole"
        captured = _attention_variants()
        monkeypatch.setattr(engine.telemetry, "want_timing", lambda: True)  # every step eager
        # 2, 6 and 4 pages of 16 tokens: one, two and one context slices at their own width
        for prompts, max_tokens in ((PROMPTS[:1], 4), (PROMPTS[2:], 60), (PROMPTS[:2], 30)):
            engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        timed = engine.telemetry.breakdown
    finally:
        engine.close()
    assert captured > 0 and timed["step_s"] > 0
    assert _attention_variants() == captured
