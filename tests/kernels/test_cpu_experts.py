"""The CPU expert kernel against an exact fp64 evaluation, its asynchronous runner and its fallback.

The native kernel is compiled once per machine (cached in the user cache dir) and loaded once per
test session. Inputs are fresh random numbers on every run; the seed is in every failure message.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import re
import sys
import threading
import time
import weakref
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moelab.kernels import cpu_experts, cpu_experts_bench
from moelab.kernels.cpu_experts import (
    CpuExpertRunner,
    NativeKernelError,
    cpu_experts_ref,
    host_read_gbps,
    load_native,
)

from .gate import Gate

# fresh inputs each run; MOELAB_TEST_SEED replays the seed a failure message names
SEED = int(os.environ.get("MOELAB_TEST_SEED") or random.SystemRandom().randrange(2**31))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
UNIT_ROUNDOFF = 2.0**-24  # fp32


@pytest.fixture(scope="session")
def simd_levels() -> list[str]:
    """The code paths the native build has on this CPU (building it if needed, once)."""
    return list(load_native().simd_levels())


def gamma(n: int) -> float:
    """Higham's gamma_n: an n-term fp32 dot product errs by at most gamma_n * sum |terms|."""
    return n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


# With rounding errors of random sign (Higham & Mary 2019), an n-term dot product errs by at most
# about LAMBDA * sqrt(n) * u * sum |terms|, with probability 1 - 2 exp(-LAMBDA^2 / 2) = 1 - 3e-14.
LAMBDA = 8.0


def exact_and_bound(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_token: torch.Tensor,
    pair_weight: torch.Tensor,
    worst_case: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact output (fp64) and a bound on the error of any fp32 evaluation of it.

    Weights convert to fp32 exactly, so every error comes from fp32 arithmetic: the gate/up dot
    products (gamma_H of their absolute sums), silu (1.1-Lipschitz) times up with a few roundings
    for exp, divide and multiply (8 ulps), the down dot product (gamma_I of its absolute sum, plus
    the h errors it carries) and the weighted sum of the pairs (gamma_{J+1}). worst_case=False
    takes the random-sign bound instead (sqrt(n) growth, h errors adding in quadrature): the worst
    case of a 2048-term dot product carried through a 768-term one is too loose to test anything.
    """
    num_tokens, hidden = x.shape
    inter = w2.shape[2]

    def dot_error(n: int) -> float:
        return gamma(n) if worst_case else LAMBDA * math.sqrt(n) * UNIT_ROUNDOFF

    exact = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    bound = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for e, t, w in zip(
        pair_expert.tolist(), pair_token.tolist(), pair_weight.tolist(), strict=True
    ):
        gate_up, down = w13[e].double(), w2[e].double()
        xt = x[t].double()
        gu = gate_up @ xt
        gu_err = dot_error(hidden) * (gate_up.abs() @ xt.abs())
        g, u, g_err, u_err = gu[:inter], gu[inter:], gu_err[:inter], gu_err[inter:]
        s = F.silu(g)
        s_err = 1.1 * g_err
        h = s * u
        h_err = s_err * (u.abs() + u_err) + s.abs() * u_err
        h_err += 8 * UNIT_ROUNDOFF * (s.abs() + s_err) * (u.abs() + u_err)
        y = down @ h
        carried = down.abs() @ h_err if worst_case else LAMBDA * ((down**2) @ (h_err**2)).sqrt()
        y_err = dot_error(inter) * (down.abs() @ (h.abs() + h_err)) + carried
        exact[t] += w * y
        bound[t] += abs(w) * y_err + gamma(len(pair_expert) + 1) * abs(w) * (y.abs() + y_err)
    return exact, bound


def assert_within_bound(
    out: torch.Tensor,
    exact: torch.Tensor,
    bound: torch.Tensor,
    what: str,
    max_bound_share: float = 1e-2,
) -> None:
    # The bound must be tight enough that a wrong term (a missing row, a wrong expert) breaks it;
    # a few per mille of the largest output is typical here, 1% the most these inputs ever need.
    assert bound.max() <= max_bound_share * exact.abs().max(), f"{what}: bound too loose to test"
    excess = (out.double() - exact).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{what} (seed {SEED}): |error| exceeds the fp32 bound at flat index {worst}: "
        f"got {out.flatten()[worst].item()}, exact {exact.flatten()[worst].item()}, "
        f"bound {bound.flatten()[worst].item()}"
    )


def make_inputs(
    gen: torch.Generator,
    num_experts: int,
    hidden: int,
    inter: int,
    num_tokens: int,
    pairs: list[tuple[int, int]],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """Random x and weights (std 1/sqrt(fan-in), as in a trained model); the given pairs."""
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / math.sqrt(inter)).to(dtype)
    pair_expert = torch.tensor([e for e, _ in pairs], dtype=torch.int32)
    pair_token = torch.tensor([t for _, t in pairs], dtype=torch.int32)
    pair_weight = torch.rand(len(pairs), generator=gen) + 0.1
    return x, w13, w2, pair_expert, pair_token, pair_weight


# (experts in the layer, H, I, tokens, (expert, token) pairs). Odd sizes leave SIMD tails; token 4
# of the batch case has no pair (its output row must be zero); expert 2 serves six tokens (more
# than one tile of four) and one (expert, token) pair repeats.
CASES = {
    "decode-1": (5, 37, 13, 1, [(3, 0)]),
    "decode-8": (11, 100, 50, 1, [(e, 0) for e in (7, 0, 10, 3, 5, 1, 9, 2)]),
    "decode-3-aligned": (4, 64, 32, 1, [(1, 0), (3, 0), (0, 0)]),
    "batch-shared": (
        6,
        161,
        67,
        7,
        [(2, 0), (2, 1), (5, 1), (2, 2), (2, 3), (0, 3), (2, 5), (2, 6), (0, 6), (0, 6), (5, 0)],
    ),
    "batch-1-expert-per-token": (3, 48, 20, 3, [(0, 0), (1, 1), (2, 2)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("simd", ["avx512", "avx2", "scalar"])
def test_native_matches_exact_within_fp32_bound(
    case: str, dtype: str, simd: str, simd_levels: list[str]
) -> None:
    if simd not in simd_levels:
        pytest.skip(f"this CPU has no {simd}")
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(f"{case} {dtype} {simd}".encode()))
    num_experts, hidden, inter, num_tokens, pairs = CASES[case]
    args = make_inputs(gen, num_experts, hidden, inter, num_tokens, pairs, DTYPES[dtype])
    exact, bound = exact_and_bound(*args)
    poisoned = torch.full((num_tokens, hidden), float("nan"))
    with CpuExpertRunner(3, "native", simd) as runner:
        fresh = runner.run(*args)
        into = runner.run(*args, out=poisoned)
    assert into.data_ptr() == poisoned.data_ptr()
    assert_within_bound(fresh, exact, bound, f"{case} {dtype} {simd}")
    assert torch.equal(into, fresh), "writing into a NaN-filled buffer changed the result"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_matches_exact_within_fp32_bound(dtype: str) -> None:
    gen = torch.Generator().manual_seed(SEED)
    num_experts, hidden, inter, num_tokens, pairs = CASES["batch-shared"]
    args = make_inputs(gen, num_experts, hidden, inter, num_tokens, pairs, DTYPES[dtype])
    assert_within_bound(cpu_experts_ref(*args), *exact_and_bound(*args), f"reference {dtype}")


def test_qwen3_shape_is_right_and_independent_of_thread_count() -> None:
    """The Qwen3-30B-A3B expert shape, bf16: 8 experts for one token, then a batch of 3 sharing."""
    gen = torch.Generator().manual_seed(SEED)
    decode = [(e, 0) for e in (6, 1, 7, 0, 3, 5, 2, 4)]
    batch = [*decode, (1, 1), (6, 1), (1, 2), (3, 2)]
    for pairs, num_tokens in ((decode, 1), (batch, 3)):
        args = make_inputs(gen, 8, 2048, 768, num_tokens, pairs, torch.bfloat16)
        with CpuExpertRunner(1, "native") as one, CpuExpertRunner(3, "native") as three:
            alone = one.run(*args)
            shared = three.run(*args)
            again = three.run(*args)
        # many small tasks, a few large ones, and more threads than cores (the tasks' sizes
        # follow the thread count)
        for threads, task_kb in ((3, 8), (3, 1024), (16, 96), (16, 1024)):
            with CpuExpertRunner(threads, "native", task_kb=task_kb) as runner:
                assert torch.equal(runner.run(*args), shared), (
                    f"tasks of {task_kb} KiB on {threads} threads differ"
                )
        exact, bound = exact_and_bound(*args, worst_case=False)
        assert_within_bound(shared, exact, bound, f"qwen3 shape, {len(pairs)} pairs", 5e-2)
        assert torch.equal(alone, shared), "the result depends on the number of threads"
        assert torch.equal(shared, again), "two runs of the same call differ"


# The rows, and the (rows per block, threads, quantum) of a job's blocks the block tests cut.
BLOCK_ROWS = pytest.mark.parametrize("n", [0, 1, 7, 64, 100, 768, 2048, 2049])
BLOCK_SHAPES = pytest.mark.parametrize(
    "per_block,threads,quantum", [(12, 15, 1), (36, 15, 1), (2, 3, 2), (8, 4, 4)]
)


@BLOCK_ROWS
@BLOCK_SHAPES
def test_blocks_are_even_and_as_many_as_a_multiple_of_the_threads(
    n: int, per_block: int, threads: int, quantum: int
) -> None:
    """A job's blocks (kernels/csrc/expert_job.h): n rows in blocks of whole quanta but the last,
    their sizes at most a quantum apart, as many as a multiple of the threads near n / per_block
    (one a thread at least, where there are that many quanta): 768 pairs in blocks of about 12 on
    15 workers are 60 blocks, not 64, of which 4 workers would run a fifth while 11 waited."""
    bounds = load_native().even_blocks(n, per_block, threads, quantum)
    blocks = len(bounds) - 1
    assert bounds[0] == 0 and bounds[-1] == n
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert all(b % quantum == 0 for b in bounds[:-1])
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert not sizes or max(sizes[:-1] or sizes) - min(sizes[:-1] or sizes) <= quantum
    units = -(-n // quantum)
    if units >= threads:
        assert blocks % threads == 0
        # at least one block a thread, else the nearest multiple to the blocks of per_block rows
        assert blocks == threads or abs(blocks - n / per_block) <= threads / 2 + 1
    else:
        assert blocks == units
    if (n, per_block, threads) == (768, 12, 15):
        assert blocks == 60


@BLOCK_ROWS
@BLOCK_SHAPES
def test_tapered_blocks_cut_the_last_round_in_half(
    n: int, per_block: int, threads: int, quantum: int
) -> None:
    """The blocks a job's phases use: EvenBlocks' rounds but the last, then that round's rows in
    blocks of about half the size, as many as a multiple of the threads; one round stays as it
    is. 768 pairs in blocks of 12 on 15 workers: 45 blocks of 12 or 13 rows, then 30 of 6 or 7."""
    native = load_native()
    even = native.even_blocks(n, per_block, threads, quantum)
    bounds = native.tapered_blocks(n, per_block, threads, quantum)
    assert bounds[0] == 0 and bounds[-1] == n
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert all(b % quantum == 0 for b in bounds[:-1])
    rounds = (len(even) - 1) // threads
    if rounds < 2:
        assert bounds == even
        return
    head = even[: len(even) - threads]  # the rounds before the last, as EvenBlocks cut them
    assert bounds[: len(head)] == head
    tail = [b - head[-1] for b in bounds[len(head) - 1 :]]
    assert tail == native.even_blocks(n - head[-1], max(1, per_block // 2), threads, quantum)
    assert (len(bounds) - 1) % threads == 0
    # more blocks, unless they were a quantum each already
    assert len(bounds) > len(even) or per_block <= quantum
    if (n, per_block, threads) == (768, 12, 15):
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        assert len(sizes) == 75 and set(sizes[:45]) == {12, 13} and set(sizes[45:]) <= {6, 7}


def test_a_queued_job_has_a_multiple_of_the_threads_tasks_in_each_phase() -> None:
    """A job queued behind a gate has all its tasks unclaimed: 100 gate/up pairs in blocks of
    two pairs (task_kb=1 at H = 256, bf16) and 256 output rows in blocks of 8 make 50 + 32 = 82
    tasks by size, 51 + 33 = 84 on 3 workers, and with each phase's last round in blocks of half
    the size, 48 + 6 and 30 + 6 = 90; the result is the same."""
    gen = torch.Generator().manual_seed(SEED)
    args = make_inputs(gen, 2, 256, 100, 1, [(1, 0)], torch.bfloat16)
    with CpuExpertRunner(3, "native", "scalar", task_kb=1) as runner:
        gate = Gate(runner)
        job = runner.submit(*args)
        assert job.unclaimed() == 90
        gate.open()
        out = job.wait()
    torch.testing.assert_close(out, cpu_experts_ref(*args), rtol=1e-4, atol=1e-4)


def test_the_task_size_and_redo_defaults_are_one_across_the_flag_the_runner_and_the_pool():
    from moelab.engine.config.args import build_parser

    args = build_parser().parse_args(["--model-path", "m"])
    with CpuExpertRunner(2, "native") as runner:
        pool_kb = runner._pool.task_bytes // 1024
        runner_redo = runner.redo_us
    assert args.moe_cpu_task_kb == cpu_experts.DEFAULT_TASK_KB == pool_kb
    native_redo = load_native().Pool(1).redo_us  # the pool's own default
    assert args.moe_cpu_redo_us == cpu_experts.DEFAULT_REDO_US == runner_redo == native_redo
    with CpuExpertRunner(2, "native", task_kb=192) as runner:
        assert runner._pool.task_bytes == 192 * 1024


def test_native_job_loop_rate_is_plausible_and_checks_its_bank() -> None:
    gen = torch.Generator().manual_seed(SEED)
    w13 = torch.randn(8, 64, 128, generator=gen).bfloat16()
    w2 = torch.randn(8, 128, 32, generator=gen).bfloat16()
    # a busy machine only lowers a rate: no bound below but 0, and none above that any host's
    # memory reaches (a rate in MB/s would pass it)
    with CpuExpertRunner(2, "native") as runner:
        assert 0 < runner.jobs_gbps(w13, w2, k=2, iterations=20) < 5000
        profile = runner.jobs_profile(w13, w2, k=1, iterations=20)
        assert 0 < profile["gbps"] < 5000
        assert 0 < profile["phase1_us"] <= profile["run_us"] and profile["wait_us"] >= 0
        with pytest.raises(ValueError, match="does not match"):
            runner.jobs_gbps(w13, w2[:, :, :16], k=2, iterations=1)
        with pytest.raises(ValueError, match="1 <= k <= experts"):
            runner.jobs_gbps(w13, w2, k=9, iterations=1)
    with CpuExpertRunner(2, "torch") as runner, pytest.raises(RuntimeError, match="native"):
        runner.jobs_gbps(w13, w2, k=2, iterations=1)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_no_pairs_gives_zeros(kernel: str) -> None:
    gen = torch.Generator().manual_seed(SEED)
    x, w13, w2, *_ = make_inputs(gen, 3, 40, 24, 2, [(0, 0)], torch.bfloat16)
    none_i = torch.zeros(0, dtype=torch.int32)
    with CpuExpertRunner(2, kernel) as runner:
        out = runner.run(x, w13, w2, none_i, none_i, torch.zeros(0), out=torch.full((2, 40), 7.0))
    assert torch.equal(out, torch.zeros(2, 40))


def test_torch_kernel_is_the_reference_and_fills_out() -> None:
    gen = torch.Generator().manual_seed(SEED)
    num_experts, hidden, inter, num_tokens, pairs = CASES["batch-shared"]
    args = make_inputs(gen, num_experts, hidden, inter, num_tokens, pairs, torch.bfloat16)
    poisoned = torch.full((num_tokens, hidden), float("nan"))
    expected = cpu_experts_ref(*args)
    with CpuExpertRunner(2, "torch") as runner:
        assert (runner.kernel, runner.num_threads) == ("torch", 2)
        # the same function on the runner's own thread count: equal up to summation order
        torch.testing.assert_close(runner.run(*args), expected, rtol=1e-5, atol=1e-6)
        out = runner.run(*args, out=poisoned)
        assert out.data_ptr() == poisoned.data_ptr()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def slow_inputs(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A call that takes the scalar kernel on one thread about a second (1.2 G multiply-adds)."""
    pairs = [(e, t) for t in range(192) for e in (0, 1)]
    return make_inputs(gen, 2, 1024, 1024, 192, pairs, torch.float32)


def python_loop_count(duration_s: float) -> int:
    count, end_s = 0, time.perf_counter() + duration_s
    while time.perf_counter() < end_s:
        count += 1
    return count


def small_inputs(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return make_inputs(gen, 4, 96, 40, 3, [(0, 0), (2, 0), (1, 1), (3, 2), (0, 2)], torch.float32)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_submit_returns_at_once_and_the_workers_leave_python_running(kernel: str) -> None:
    """submit() only queues the job: behind a gate that holds the runner's one worker, the job
    has not run when submit returns, and this thread goes on running Python (it computes the
    reference) while the worker is in a job. Opened, the worker runs the job."""
    args = small_inputs(torch.Generator().manual_seed(SEED))
    with CpuExpertRunner(1, kernel) as runner:
        gate = Gate(runner)
        job = runner.submit(*args)
        assert not job.done(), "submit() returned after the work was done"
        expected = cpu_experts_ref(*args)
        assert not job.done(), "the job ran before the gate ahead of it opened"
        gate.open()
        out = job.wait()
    assert gate.opened()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_jobs_own_timing_lies_within_the_call() -> None:
    """A finished native job's times, each in seconds and within the call that made it: the
    workers' reaction (here the gate's hold ahead of it too), then the run; its one worker began
    it as it took the first task and was in tasks within the run; its gate/up rows ended within
    the run, and it never waited for rows it made itself."""
    args = small_inputs(torch.Generator().manual_seed(SEED))
    with CpuExpertRunner(1, "native") as runner:
        gate = Gate(runner)
        started_s = time.perf_counter()
        job = runner.submit(*args)
        assert job.seconds() is None and job.worker_seconds() is None  # not done yet
        gate.open()
        job.wait()
        total_s = time.perf_counter() - started_s
    start_s, run_s = job.seconds()
    assert start_s >= 0 and run_s > 0 and start_s + run_s < total_s
    last_start_s, busy_s = job.worker_seconds()
    assert last_start_s == pytest.approx(start_s, abs=1e-6)  # one clock reading, in ns
    assert 0 < busy_s <= run_s * 1.001
    phase1_s, wait_s = job.phase_seconds()
    assert 0 < phase1_s < run_s and wait_s == 0.0


def test_worker_seconds_of_a_job_on_several_workers() -> None:
    """The workers' times of a finished job: none before it is done or for the torch kernel; the
    last worker's start within the run; their time in tasks within workers times the run."""
    gen = torch.Generator().manual_seed(SEED)
    args = make_inputs(gen, 4, 512, 512, 2, [(e, t) for e in range(4) for t in range(2)],
                       torch.bfloat16)  # fmt: skip
    with CpuExpertRunner(2, "native", task_kb=8) as runner:
        for _ in range(5):
            job = runner.submit(*args)
            job.wait()
            (start_s, run_s), (last_start_s, busy_s) = job.seconds(), job.worker_seconds()
            assert start_s <= last_start_s <= start_s + run_s
            assert 0 < busy_s <= 2 * run_s * 1.001
            phase1_s, wait_s = job.phase_seconds()
            assert 0 < phase1_s <= run_s and 0 <= wait_s <= 2 * run_s
    with CpuExpertRunner(2, "torch") as runner:
        job = runner.submit(*args)
        job.wait()
        assert job.worker_seconds() is None and job.phase_seconds() is None


def test_wait_releases_the_gil() -> None:
    """A thread waiting for a job lets other threads run Python. Here the job is queued behind a
    gate that only another thread opens, and that thread can get the GIL only from the waiting
    one: the switch interval is made longer than the gate waits, so the interpreter never takes
    the GIL from a thread on its own. Had wait() kept the GIL, the gate would have given up."""
    args = small_inputs(torch.Generator().manual_seed(SEED))
    expected = cpu_experts_ref(*args)
    with CpuExpertRunner(1, "native") as runner:
        gate = Gate(runner, limit_s=30.0)
        job = runner.submit(*args)
        go = threading.Lock()
        go.acquire()

        def opener() -> None:
            with go:
                gate.open()

        thread = threading.Thread(target=opener)
        thread.start()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(60.0)
        try:
            go.release()  # from here the opener waits for the GIL alone
            out = job.wait()
            opened = gate.opened()  # before this thread lets go of the GIL again
        finally:
            sys.setswitchinterval(interval)
        thread.join()
    assert opened, "wait() kept the GIL: the thread that opens the gate never ran"
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_jobs_in_flight_are_independent(kernel: str) -> None:
    """Several calls queued back to back and waited in reverse order, while the caller works."""
    gen = torch.Generator().manual_seed(SEED)
    calls = [
        make_inputs(gen, 4, 96, 40, 2, [(k % 4, 0), (3, 1), (k % 3, 1)], torch.bfloat16)
        for k in range(5)
    ]
    with CpuExpertRunner(2, kernel) as runner:
        jobs = [runner.submit(*args) for args in calls]
        python_loop_count(0.01)
        outs = [job.wait() for job in reversed(jobs)][::-1]
    for k, (args, out) in enumerate(zip(calls, outs, strict=True)):
        assert_within_bound(out, *exact_and_bound(*args), f"{kernel} call {k}")


def test_submits_from_several_python_threads() -> None:
    gen = torch.Generator().manual_seed(SEED)
    calls = [make_inputs(gen, 3, 80, 30, 1, [(k % 3, 0), (2, 0)], torch.float16) for k in range(6)]
    results: dict[int, torch.Tensor] = {}
    with CpuExpertRunner(2, "native") as runner:

        def caller(first: int) -> None:
            for k in range(first, len(calls), 2):
                for _ in range(10):
                    results[k] = runner.run(*calls[k])

        threads = [threading.Thread(target=caller, args=(first,)) for first in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for k, args in enumerate(calls):
        assert_within_bound(results[k], *exact_and_bound(*args), f"thread call {k}")


@pytest.mark.timeout(120)
def test_many_jobs_from_several_threads_some_never_waited() -> None:
    """Thousands of small jobs from three threads on four workers, every other one dropped by its
    caller without a wait of its own (the workers take jobs without a lock, and the pool frees a
    job only once no worker runs it): the waited ones are right, and closing the runner with jobs
    still queued finishes them."""
    gen = torch.Generator().manual_seed(SEED)
    calls = [make_inputs(gen, 3, 64, 32, 2, [(k % 3, 0), (2, 1)], torch.bfloat16) for k in range(3)]
    expected = [exact_and_bound(*args) for args in calls]
    bad: list[str] = []
    runner = CpuExpertRunner(4, "native")

    def caller(k: int) -> None:
        for n in range(600):
            job = runner.submit(*calls[k])
            if n % 2:
                out = job.wait()
                if not (out - expected[k][0]).abs().le(expected[k][1] * 1e-2 + 1e-6).all():
                    bad.append(f"thread {k}, job {n}")

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queued = [runner.submit(*calls[k % 3]) for k in range(50)]
    runner.close()
    assert not bad, bad[:5]
    assert all(job.done() for job in queued), "close() returned with jobs still queued"
    for k, job in enumerate(queued):
        assert_within_bound(job.wait(), *expected[k % 3], f"queued job {k}")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_workers_that_never_spin_still_take_every_job() -> None:
    args = slow_inputs(torch.Generator().manual_seed(SEED))
    expected = cpu_experts_ref(*args)
    with CpuExpertRunner(2, "native", spin_us=0) as runner:
        for _ in range(3):  # each job finds the workers asleep and must wake them
            time.sleep(0.01)
            torch.testing.assert_close(runner.run(*args), expected, rtol=1e-4, atol=1e-4)


def test_workers_are_a_persistent_pool() -> None:
    def os_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    gen = torch.Generator().manual_seed(SEED)
    args = make_inputs(gen, 2, 32, 16, 1, [(0, 0), (1, 0)], torch.bfloat16)
    before = os_threads()
    runner = CpuExpertRunner(3, "native")
    assert os_threads() == before + 3
    for _ in range(20):
        runner.run(*args)
    assert os_threads() == before + 3, "calls started threads of their own"
    runner.close()
    assert os_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(*args)


def test_auto_falls_back_to_torch_when_the_build_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = tmp_path / "broken-c++"
    compiler.write_text(
        "#!/bin/sh\necho 'cpu_experts.cpp:1:1: error: simulated compiler failure' >&2\nexit 1\n"
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("TORCH_DONT_CHECK_COMPILER_ABI", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where nothing is built yet
    gen = torch.Generator().manual_seed(SEED)
    args = make_inputs(gen, 3, 40, 24, 2, [(0, 0), (2, 1), (0, 1)], torch.bfloat16)

    with caplog.at_level(logging.WARNING, logger=cpu_experts.__name__):
        runner = CpuExpertRunner(2, "auto")
    assert runner.kernel == "torch"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "simulated compiler failure" in said[0], said
    with runner:
        assert torch.equal(runner.run(*args), cpu_experts_ref(*args))
    with pytest.raises(NativeKernelError, match="simulated compiler failure"):
        CpuExpertRunner(2, "native")


def bad_calls() -> dict[str, tuple[dict, str]]:
    """Argument overrides of a valid call and the words the error must contain."""
    x = torch.randn(2, 16)
    w13 = torch.randn(3, 10, 16).bfloat16()
    return {
        "x float64": ({"x": x.double()}, "x must be"),
        "x on meta": ({"x": torch.empty(2, 16, device="meta")}, "CPU tensor"),
        "H mismatch": ({"x": torch.randn(2, 17)}, "w13 must be"),
        "w13 not contiguous": ({"w13": w13.transpose(1, 2).contiguous().transpose(1, 2)}, "contig"),
        "dtype mismatch": ({"w2": torch.randn(3, 16, 5)}, "share one dtype"),
        "int8 weights": (
            {"w13": w13.to(torch.int8), "w2": torch.zeros(3, 16, 5, dtype=torch.int8)},
            "share one dtype",
        ),
        "int64 experts": ({"pair_expert": torch.tensor([0, 1])}, "int32"),
        "pair lengths": ({"pair_weight": torch.ones(3)}, "one length"),
        "expert out of range": (
            {"pair_expert": torch.tensor([0, 3], dtype=torch.int32)},
            "pair_expert[1] = 3",
        ),
        "token out of range": (
            {"pair_token": torch.tensor([-1, 0], dtype=torch.int32)},
            "pair_token[0] = -1",
        ),
        "out shape": ({"out": torch.empty(2, 15)}, "out must be"),
        "out overlaps x": ({"x": x, "out": x}, "overlap"),
    }


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("bad", list(bad_calls()))
def test_bad_inputs_get_a_clear_error(kernel: str, bad: str) -> None:
    overrides, words = bad_calls()[bad]
    call = {
        "x": torch.randn(2, 16),
        "w13": torch.randn(3, 10, 16).bfloat16(),
        "w2": torch.randn(3, 16, 5).bfloat16(),
        "pair_expert": torch.tensor([0, 2], dtype=torch.int32),
        "pair_token": torch.tensor([0, 1], dtype=torch.int32),
        "pair_weight": torch.tensor([0.5, 0.5]),
    } | overrides
    with CpuExpertRunner(1, kernel) as runner, pytest.raises(ValueError, match=re.escape(words)):
        runner.submit(**call)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_threads": 0}, "positive int"),
        ({"num_threads": 2, "kernel": "gpu"}, "kernel must be one of"),
        ({"num_threads": 2, "simd": "neon"}, "simd must be one of"),
        ({"num_threads": 2, "kernel": "torch", "simd": "avx2"}, "native kernel only"),
        ({"num_threads": 2, "kernel": "native", "spin_us": -1}, "spin_us must be"),
        ({"num_threads": 2, "kernel": "native", "task_kb": 0}, "task_kb must be"),
    ],
)
def test_bad_runner_settings_get_a_clear_error(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        CpuExpertRunner(**kwargs)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_read_rate_is_plausible(kernel: str) -> None:
    with CpuExpertRunner(2, kernel) as runner:
        gbps = runner.read_gbps(size_bytes=64 << 20, repeats=2)
    # a busy machine only lowers it: above 0, and below what any host's memory reaches
    assert 0 < gbps < 5000, f"{kernel}: {gbps} GB/s is not a memory read rate"
    assert 0 < host_read_gbps(1, size_bytes=64 << 20) < 5000


def test_bench_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--threads", "1,2", "--experts", "2,1", "--hidden", "64", "--intermediate", "32"]
    argv += ["--num-experts", "6", "--min-seconds", "0.01", "--read-mib", "16", "--json"]
    assert cpu_experts_bench.main([*argv, "--task-kb", "4,96"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = [(row["threads"], row["dtype"], row["task_kb"]) for row in result["results"]]
    assert rows == [
        (threads, dtype, kb)
        for threads in (1, 2)
        for dtype in ("bf16", "fp8", "mxfp4", "nvfp4")
        for kb in (4, 96)
    ]
    for row in result["results"]:
        assert row["host_read_gbps"] > 0
        assert set(row["experts"]) == {"2", "1"}
        for rates in row["experts"].values():
            assert rates["native_gbps"] > 0 and rates["torch_gbps"] > 0
            share = rates["native_gbps"] / row["host_read_gbps"]
            assert rates["native_share_of_host"] == pytest.approx(share)


def test_bench_rejects_bad_lists(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cpu_experts_bench.main(["--threads", "0,2"])
    assert "positive comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cpu_experts_bench.main(["--task-kb", "96,-1"])


@pytest.mark.parametrize("case", ["decode-8", "decode-3-aligned", "batch-shared"])
@pytest.mark.parametrize("threads", [2, 3])
def test_owned_blocks_give_the_same_output_bit_for_bit(case: str, threads: int) -> None:
    """Blocks owned by the workers (own_rounds) are run by their owners or, late, by anyone: the
    same tasks, each once, so the same output whatever the rounds (more than the job has too)."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(case.encode()))
    num_experts, hidden, inter, num_tokens, pairs = CASES[case]
    args = make_inputs(gen, num_experts, hidden, inter, num_tokens, pairs, torch.bfloat16)
    with CpuExpertRunner(threads, "native", task_kb=1) as runner:
        plain = runner.run(*args)
        for rounds in (1, 2, 50):
            poisoned = torch.full((num_tokens, hidden), float("nan"))
            owned = runner.submit(*args, out=poisoned, own_rounds=rounds).wait()
            assert torch.equal(owned, plain), (case, threads, rounds)


def test_owned_blocks_end_when_their_owners_are_late() -> None:
    """A job whose owners are still in the job before (or asleep) ends all the same: its other
    workers take the owned blocks once the rest are handed out, or while they wait for them."""
    gen = torch.Generator().manual_seed(SEED)
    big = make_inputs(gen, 16, 512, 256, 1, [(e, 0) for e in range(16)], torch.bfloat16)
    small = make_inputs(gen, 4, 256, 96, 1, [(1, 0), (3, 0)], torch.bfloat16)
    with CpuExpertRunner(3, "native", spin_us=0, task_kb=1) as runner:
        want_big, want_small = runner.run(*big), runner.run(*small)
        for _ in range(20):
            first = runner.submit(*big)
            second = runner.submit(*small, own_rounds=2)
            assert torch.equal(second.wait(), want_small)
            assert torch.equal(first.wait(), want_big)


def test_jobs_profile_with_a_gap_and_owned_blocks_fetched() -> None:
    gen = torch.Generator().manual_seed(SEED)
    _, w13, w2, *_ = make_inputs(gen, 8, 256, 64, 1, [(0, 0)], torch.bfloat16)
    with CpuExpertRunner(2, "native", task_kb=4) as runner:
        plain = runner.jobs_profile(w13, w2, 2, 20)
        fetched = runner.jobs_profile(w13, w2, 2, 20, gap_us=20, own_rounds=2, fetch_own=True)
        for profile in (plain, fetched):
            assert profile["gbps"] > 0 and profile["run_us"] > 0
            assert 0 < profile["phase1_us"] <= profile["run_us"]
        # 20 jobs 20 µs apart take at least 400 µs: the gaps are in the rate
        job_bytes = 2 * (w13[0].nbytes + w2[0].nbytes)
        assert fetched["gbps"] < 20 * job_bytes / 400e-6 / 1e9
        with pytest.raises(ValueError, match="gap_us and own_rounds"):
            runner.jobs_profile(w13, w2, 2, 5, gap_us=-1.0)


@pytest.mark.parametrize(("threads", "hinted_rounds"), [(20, 4), (70, 3)])
def test_many_workers_are_told_of_the_rounds_the_hint_holds(threads: int, hinted_rounds: int):
    """4 ranges a worker a round, 1024 in all: 20 workers are told of all 4 rounds of their
    blocks (the hint once held 256 ranges and told more than 16 workers nothing), 70 of the 3
    that fit; the blocks owned are 4 rounds' either way, and the output is the same bit for bit."""
    gen = torch.Generator().manual_seed(SEED + threads)
    num_experts, hidden, inter = 8, 64, 256
    pairs = [(e, 0) for e in range(num_experts)]
    args = make_inputs(gen, num_experts, hidden, inter, 1, pairs, torch.bfloat16)
    _, w13, w2, *_ = args
    with CpuExpertRunner(threads, "native", spin_us=0, task_kb=1) as runner:
        plain = runner.run(*args)
        poisoned = torch.full((1, hidden), float("nan"))
        assert torch.equal(runner.submit(*args, out=poisoned, own_rounds=4).wait(), plain)
        runner.jobs_profile(w13, w2, num_experts, 1, own_rounds=4, fetch_own=True)
        ranges, per = runner._pool.hinted()
    assert per == 4 * hinted_rounds and len(ranges) == per * threads <= 1024
    # 2048 gate/up rows in blocks of a few rows (1 KiB tasks of 128-byte rows), more than 4
    # rounds of them: each worker's every hinted round names its block's gate rows and the same
    # rows of up, of one expert or two, in the bank
    row, low, high = hidden * 2, w13.data_ptr(), w13.data_ptr() + w13.nbytes
    for w in range(threads):
        own = ranges[w * per : (w + 1) * per]
        for r in range(hinted_rounds):
            parts = [part for part in own[4 * r : 4 * r + 4] if part != (0, 0)]
            assert len(parts) in (2, 4), (w, r, parts)
            for gate, up in zip(parts[::2], parts[1::2], strict=True):
                assert gate[1] == up[1] > 0 and gate[1] % row == 0
                assert up[0] - gate[0] == inter * row
                assert low <= gate[0] and up[0] + up[1] <= high


def test_bench_with_a_gap_and_owned_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--threads", "2", "--experts", "1", "--hidden", "64", "--intermediate", "32"]
    argv += ["--num-experts", "6", "--min-seconds", "0.01", "--read-mib", "16", "--json"]
    assert (
        cpu_experts_bench.main([*argv, "--gap-us", "10", "--own-rounds", "0,2", "--dtype", "fp8"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    rows = [(row["gap_us"], row["own_rounds"]) for row in result["results"]]
    assert rows == [(10.0, 0), (10.0, 2)]
    assert all(row["experts"]["1"]["native_gbps"] > 0 for row in result["results"])
    with pytest.raises(SystemExit):
        cpu_experts_bench.main(["--own-rounds", "-1"])
    with pytest.raises(SystemExit):
        cpu_experts_bench.main(["--gap-us", "-5"])


def test_unchecked_submit_computes_the_same_and_still_checks_the_pairs() -> None:
    """check=False (the engine's decode path) skips the Python checks, not the native ones."""
    gen = torch.Generator().manual_seed(SEED)
    num_experts, hidden, inter, num_tokens, pairs = CASES["batch-shared"]
    args = make_inputs(gen, num_experts, hidden, inter, num_tokens, pairs, torch.bfloat16)
    with CpuExpertRunner(2, "native") as runner:
        checked = runner.run(*args)
        unchecked = runner.submit(*args, check=False).wait()
        assert torch.equal(checked, unchecked)
        x, w13, w2, _, pair_token, pair_weight = args
        bad_expert = torch.full_like(pair_token, num_experts)
        with pytest.raises(ValueError, match=re.escape(f"pair_expert[0] = {num_experts}")):
            runner.submit(x, w13, w2, bad_expert, pair_token, pair_weight, check=False)


# A job whose tasks take tens of microseconds: 16 experts of 512 x 256 for one token.
def long_tasks_inputs(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return make_inputs(gen, 16, 512, 256, 1, [(e, 0) for e in range(16)], torch.bfloat16)


@pytest.mark.parametrize("case", ["decode-8", "batch-shared", "batch-1-expert-per-token", "long"])
def test_tasks_run_again_give_the_same_output_bit_for_bit(case: str) -> None:
    """With redo_us=1 an idle worker runs again nearly every task it finds in flight, so two
    runs of a task race to write it: the output must be the single run's, bit for bit, whichever
    finishes first (the other writes nothing: out is NaN-poisoned, h is the job's own). More
    workers than cores, owned blocks too, and a split expert in the planner's test below. How
    many runs again finish first is the machine's; that one does is the next test's."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(case.encode()))
    if case == "long":
        args, num_tokens, hidden = long_tasks_inputs(gen), 1, 512
    else:
        num_experts, hidden, inter, num_tokens, pairs = CASES[case]
        args = make_inputs(gen, num_experts, hidden, inter, num_tokens, pairs, torch.bfloat16)
    with CpuExpertRunner(4, "native", task_kb=1, redo_us=0) as runner:
        want = runner.run(*args)
        assert runner.submit(*args, redoable=True).redoable() is False  # redo_us=0: never
    with CpuExpertRunner(4, "native", task_kb=1, redo_us=1) as runner:
        for i in range(200):
            poisoned = torch.full((num_tokens, hidden), float("nan"))
            job = runner.submit(*args, out=poisoned, own_rounds=i % 3, redoable=True)
            assert job.redoable()
            assert torch.equal(job.wait(), want), (case, i)


def test_a_stalled_task_is_run_again_by_an_idle_worker_and_counts_once() -> None:
    """A task of a redoable job in flight for longer than redo_us is run again by a worker with
    nothing else to do, and the run that finishes first is the one that counts: here the task's
    first run is held at a gate (a redoable one, whose run again passes), so the job ends by the
    second run while the first still waits; let go, the first commits nothing."""
    with CpuExpertRunner(2, "native", redo_us=1) as runner:
        word = torch.zeros(1, dtype=torch.int64)
        job = runner._module.submit_gate(runner._pool, word.data_ptr(), 60.0, True)
        assert job.redoable()
        job.wait()
        assert job.redone() == 1 and word[0] == 0  # ended while its first run was held
        word[0] = 1
    assert job.redone() == 1 and word[0] == 1  # the first run, let go, changed nothing


def test_only_jobs_asked_to_be_are_run_again() -> None:
    """A job not submitted redoable (its weights may go once it is done) is never run again,
    however long its tasks; nor is one whose x is too large to copy (T * H > 65536)."""
    gen = torch.Generator().manual_seed(SEED)
    args = long_tasks_inputs(gen)
    wide = make_inputs(gen, 2, 4096, 32, 17, [(0, t) for t in range(17)], torch.bfloat16)
    with CpuExpertRunner(4, "native", task_kb=1, redo_us=1) as runner:
        want = runner.run(*args)
        for _ in range(50):
            job = runner.submit(*args)
            assert not job.redoable()
            assert torch.equal(job.wait(), want) and job.redone() == 0
        big = runner.submit(*wide, redoable=True)
        assert not big.redoable()
        assert torch.equal(big.wait(), runner.run(*wide))
    with CpuExpertRunner(2, "torch") as runner:
        job = runner.submit(*args, redoable=True)
        job.wait()
        assert not job.redoable() and job.redone() == 0 and runner.redo_us == 0


def test_the_runner_holds_the_weights_of_redoable_jobs_until_it_closes() -> None:
    """A late run of a task goes on reading the weights after its job is done: the runner keeps
    them alive until its workers have ended (and only those of redoable jobs)."""

    gen = torch.Generator().manual_seed(SEED)
    x, w13, w2, pe, pt, pw = long_tasks_inputs(gen)
    w13_other, w2_other = w13.clone(), w2.clone()
    held = [weakref.ref(w13), weakref.ref(w2)]
    not_held = [weakref.ref(w13_other), weakref.ref(w2_other)]
    runner = CpuExpertRunner(2, "native", redo_us=50)
    runner.submit(x, w13, w2, pe, pt, pw, redoable=True).wait()
    runner.submit(x, w13_other, w2_other, pe, pt, pw).wait()
    del w13, w2, w13_other, w2_other
    assert all(ref() is not None for ref in held)
    assert all(ref() is None for ref in not_held)
    runner.close()
    assert all(ref() is None for ref in held)


def test_redo_us_is_checked_and_changes_while_the_workers_run() -> None:
    with pytest.raises(ValueError, match="redo_us must be an int of 0 or more"):
        CpuExpertRunner(2, "native", redo_us=-1)
    with CpuExpertRunner(2, "native") as runner:
        assert runner.redo_us == cpu_experts.DEFAULT_REDO_US
        runner.redo_us = 0
        assert runner.redo_us == 0
        with pytest.raises(ValueError, match="redo_us must be"):
            runner.redo_us = 1.5
