"""Where the CPU expert workers run: the placement plan, and the native pool keeping to it."""

from __future__ import annotations

import os
import threading

import pytest

from moelab.engine.config.args import build_parser
from moelab.engine.experts.cpu import (
    ProcessPlacement,
    cpu_ranges,
    plan_worker_cpus,
    spare_cpus,
    start_cpu_executor,
    worker_cpus,
)
from moelab.engine.runtime.sampling import SamplingParams
from moelab.kernels.cpu_experts import CpuExpertRunner, process_thread_ids

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
linux_only = pytest.mark.skipif(not ALLOWED, reason="needs Linux's thread affinity")
spare_core = pytest.mark.skipif(
    len(worker_cpus(1)) != 1, reason="needs a core beside the one worker's"
)


def test_one_cpu_per_core_leaves_the_first_core_to_the_feeder():
    cpus = list(range(16))
    assert plan_worker_cpus(15, cpus, {c: c for c in cpus}) == list(range(1, 16))
    assert plan_worker_cpus(4, cpus, {c: c for c in cpus}) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("core_of", "threads", "expected"),
    [
        ({c: c % 8 for c in range(16)}, 7, [1, 2, 3, 4, 5, 6, 7]),  # siblings c and c + 8
        ({c: c // 2 for c in range(16)}, 3, [2, 4, 6]),  # siblings 2k and 2k + 1
    ],
)
def test_hyperthreads_get_one_worker_per_physical_core(core_of, threads, expected):
    assert plan_worker_cpus(threads, range(16), core_of) == expected


def test_too_few_cores_leave_the_placement_to_the_os():
    cpus = [0, 1, 2, 3]
    assert plan_worker_cpus(4, cpus, {c: c for c in cpus}) == []
    assert plan_worker_cpus(5, cpus, {c: c for c in cpus}) == []
    # eight logical CPUs on four cores: three workers fit beside the feeder's core, four do not
    smt = {c: c // 2 for c in range(8)}
    assert plan_worker_cpus(3, range(8), smt) == [2, 4, 6]
    assert plan_worker_cpus(4, range(8), smt) == []


def test_only_the_allowed_cpus_are_used_and_unknown_cores_count_as_their_own():
    assert plan_worker_cpus(2, [7, 4, 6, 5], {}) == [5, 6]
    assert plan_worker_cpus(2, [4, 5, 6, 7], {4: "a", 5: "a", 6: "b", 7: "c"}) == [6, 7]


@linux_only
def test_this_machines_plan_is_made_of_allowed_cpus_on_distinct_cores():
    for threads in range(1, len(ALLOWED) + 1):
        cpus = worker_cpus(threads)
        assert cpus == [] or (len(cpus) == threads and set(cpus) <= set(ALLOWED[1:]))
        assert len(set(cpus)) == len(cpus)


@linux_only
def test_a_pinned_worker_stays_on_its_cpu():
    cpu = ALLOWED[-1]
    with CpuExpertRunner(1, "native", cpus=[cpu]) as runner:
        assert runner.worker_cpus() == [[cpu]] and runner.cpus == [cpu]
    with CpuExpertRunner(2, "native") as runner:
        assert runner.worker_cpus() == [ALLOWED, ALLOWED] and runner.cpus is None
    with CpuExpertRunner(1, "torch", cpus=[cpu]) as runner:  # places its own threads
        assert runner.worker_cpus() is None and runner.cpus is None


@linux_only
@pytest.mark.parametrize(
    ("cpus", "words"),
    [([100_000], "cannot pin a worker to CPU 100000"), ([0, 0], "one CPU per thread")],
)
def test_a_bad_placement_gets_a_clear_error(cpus, words):
    with pytest.raises(ValueError, match=words):
        CpuExpertRunner(1, "native", cpus=cpus)


@linux_only
@pytest.mark.parametrize("pin", [True, False])
def test_the_engine_pins_its_workers_unless_told_not_to(pin):
    runner = start_cpu_executor(1, "native", spin_us=0, pin=pin)
    try:
        planned = worker_cpus(1) if pin else []
        assert runner.worker_cpus() == ([[c] for c in planned] if planned else [ALLOWED])
        assert runner.cpus == (planned or None)
    finally:
        runner.close()


def test_cpu_lists_are_written_as_ranges():
    assert cpu_ranges([1, 2, 3, 5, 7, 8]) == "1-3,5,7-8"
    assert cpu_ranges([4]) == "4"


def test_the_spare_cpus_are_those_of_cores_without_a_worker():
    cpus = list(range(16))
    assert spare_cpus(cpus, {c: c for c in cpus}, range(1, 16)) == [0]
    assert spare_cpus(cpus, {c: c for c in cpus}, [1, 2]) == [0, *range(3, 16)]
    # hyperthreads: a worker on CPU 1 takes its sibling 9 off the spare list too
    assert spare_cpus(cpus, {c: c % 8 for c in cpus}, range(1, 8)) == [0, 8]
    assert spare_cpus([0, 1], {}, [0, 1]) == []


@linux_only
@spare_core
def test_isolate_keeps_the_rest_of_the_process_off_the_workers_and_puts_it_back():
    me = threading.get_native_id()
    mine = os.sched_getaffinity(me)
    runner = start_cpu_executor(1, "native", spin_us=0)
    try:
        (worker,) = runner.thread_ids
        assert worker in process_thread_ids() and worker != me
        placement = ProcessPlacement.around(runner)
        assert placement is not None and runner.cpus[0] not in placement.cpus
        assert os.sched_getaffinity(me) == set(placement.cpus)  # this thread: the feeder
        assert os.sched_getaffinity(worker) == set(runner.cpus)  # the worker: its own CPU
        seen = []  # a thread started now is born on the spare CPUs
        started = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        started.start()
        started.join()
        assert seen == [set(placement.cpus)]
        placement.restore()
        assert os.sched_getaffinity(me) == mine
        assert os.sched_getaffinity(worker) == set(runner.cpus)
    finally:
        runner.close()
    unpinned = start_cpu_executor(1, "native", spin_us=0, pin=False)
    try:
        assert ProcessPlacement.around(unpinned) is None  # nothing to keep off
    finally:
        unpinned.close()


def test_the_flag_takes_cores_isolate_or_off():
    parser = build_parser()
    assert parser.parse_args(["--model-path", "m"]).moe_cpu_pin == "cores"
    for choice in ("isolate", "off"):
        args = parser.parse_args(["--model-path", "m", "--moe-cpu-pin", choice])
        assert args.moe_cpu_pin == choice
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--moe-cpu-pin", "all"])


@linux_only
@spare_core
def test_an_isolated_engine_keeps_its_threads_off_the_worker_and_gives_them_back(tmp_path):
    from moelab.engine.synth_checkpoint import synthesize

    from .reference import make_engine

    path = synthesize(tmp_path / "m", preset="tiny", seed=3)
    me = threading.get_native_id()
    mine = os.sched_getaffinity(me)
    engine = make_engine(path, "--moe-cpu-pin", "isolate")  # the last flag wins
    try:
        config = engine.config_in_force()
        spare = engine.placement.cpus
        assert config["cpu_pin"] == "isolate" and config["process_cpus"] == cpu_ranges(spare)
        assert os.sched_getaffinity(me) == set(spare)
        assert not set(spare) & set(engine.cpu.cpus)
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0]) == 4  # decodes as before, from the spare CPUs
    finally:
        engine.close()
    assert os.sched_getaffinity(me) == mine


@linux_only
@spare_core
def test_an_engine_switches_between_cores_and_isolate_between_runs(tmp_path):
    """Engine.set_cpu_pin (bench decode --alternate-cpu-pin): isolate moves the rest of the
    engine off the worker's core, cores gives its threads their CPUs back, each as often as
    asked; the config says which is in force; off or another word is refused."""
    from moelab.engine.synth_checkpoint import synthesize

    from .reference import make_engine

    path = synthesize(tmp_path / "m", preset="tiny", seed=3)
    me = threading.get_native_id()
    mine = os.sched_getaffinity(me)
    engine = make_engine(path, "--moe-cpu-pin", "cores")
    try:
        assert engine.placement is None and engine.config_in_force()["cpu_pin"] == "cores"
        for _ in range(2):
            engine.set_cpu_pin("isolate")
            spare = engine.placement.cpus
            assert not set(spare) & set(engine.cpu.cpus)
            assert os.sched_getaffinity(me) == set(spare)
            config = engine.config_in_force()
            assert config["cpu_pin"] == "isolate" and config["process_cpus"] == cpu_ranges(spare)
            engine.set_cpu_pin("cores")
            assert engine.placement is None and os.sched_getaffinity(me) == mine
            assert engine.config_in_force()["cpu_pin"] == "cores"
        for wrong in ("off", "all"):
            with pytest.raises(ValueError, match="'cores' or 'isolate'"):
                engine.set_cpu_pin(wrong)
        assert engine.config_in_force()["cpu_pin"] == "cores"
    finally:
        engine.close()
    assert os.sched_getaffinity(me) == mine


@linux_only
def test_isolate_is_refused_where_the_workers_are_not_pinned(tmp_path):
    from moelab.engine.synth_checkpoint import synthesize

    from .reference import make_engine

    path = synthesize(tmp_path / "m", preset="tiny", seed=3)
    engine = make_engine(path, "--moe-cpu-pin", "off")
    try:
        with pytest.raises(ValueError, match="pinned to cores"):
            engine.set_cpu_pin("isolate")
        assert engine.placement is None and engine.config_in_force()["cpu_pin"] == "off"
    finally:
        engine.close()
