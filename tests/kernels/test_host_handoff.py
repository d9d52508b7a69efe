"""The CPU experts' handoff to the GPU: the epoch the CPU job writes, and the kernels that wait
for it (under the Triton interpreter without a GPU; on a GPU with pinned host memory, as the
engine runs them; in a replayed graph in test_cuda_real_shapes.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import pytest
import torch

from moelab.kernels import host_handoff
from moelab.kernels.cpu_experts import CpuExpertRunner, cpu_experts_ref
from moelab.kernels.host_handoff import DONE, EXPECTED, TIMED_OUT
from moelab.kernels.rmsnorm import fused_add_rmsnorm_triton, rmsnorm_ref

from .gate import Gate
from .kernel_inputs import DEVICE, randn
from .test_cpu_experts import make_inputs, slow_inputs

pytestmark = pytest.mark.usefixtures("triton_runs")

CUDA = DEVICE.type == "cuda"
T = TypeVar("T")
SUMMERS = {
    "triton": host_handoff.sum_when_ready_triton,
    "ref": host_handoff.sum_when_ready_ref,
}


def _host(t: torch.Tensor) -> torch.Tensor:
    """Host memory a GPU kernel can read: pinned when the kernels run on a GPU."""
    return t.pin_memory() if CUDA else t


def _sync() -> torch.Tensor:
    return host_handoff.handoff_sync(pin=CUDA)


def _finished() -> None:
    """Wait for what the kernels queued (they run at once under the interpreter)."""
    if CUDA:
        torch.cuda.synchronize()


def _once_the_epoch_is_done(run: Callable[[], T], sync, part, value: torch.Tensor) -> T:
    """`run()`, a sum that waits for the CPU's epoch, in a thread while the epoch is not done: it
    is still waiting a while later (it cannot return before the epoch), and the part it adds is
    `value`, written into `part` only then (one read before the epoch would be the stale part).
    Then the epoch is done, and run's result returned."""
    with ThreadPoolExecutor(1) as pool:
        summed = pool.submit(run)
        wait([summed], timeout=0.2)
        assert not summed.done(), "it added before the CPU's epoch was done"
        part.copy_(value)
        sync[DONE] = sync[EXPECTED]
        return summed.result()


# no giving up on the epoch while the test holds it back (only a stall of minutes would)
NO_GIVING_UP = {"triton": {}, "ref": {"timeout_s": 600.0}}


def _sum(summer: str, ys, part, sync, **kwargs) -> torch.Tensor:
    """sum_when_ready by `summer`, the Triton one into a poisoned output (an element left
    unwritten fails), waited for."""
    if summer == "ref":
        return host_handoff.sum_when_ready_ref(ys, part, sync, **kwargs)
    tokens, _, hidden = ys[0].shape
    dtype = kwargs.get("dtype", torch.float32)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=DEVICE)
    host_handoff.sum_when_ready_triton(ys, part, sync, out=out, **kwargs)
    _finished()
    return out


@pytest.mark.parametrize("summer", list(SUMMERS))
@pytest.mark.parametrize(("tokens", "parts"), [(1, 1), (3, 2), (2, 1)])
def test_sums_the_routes_and_adds_the_part_once_the_epoch_is_done(gen, summer, tokens, parts):
    """The fused MoE's per-route outputs (one tensor, or the hits' and the fills') summed over the
    routes, plus the CPU's part, only once its epoch is done."""
    hidden = 2500 if tokens == 2 else 1500  # not a multiple of the block; more than one block
    ys = [randn(gen, tokens, 4, hidden) for _ in range(parts)]
    value = torch.randn(tokens, hidden, generator=gen)
    part = _host(torch.full((tokens, hidden), float("nan")))
    expected = sum(y.sum(dim=1) for y in ys) + value.to(DEVICE)
    sync = _sync()
    sync[DONE], sync[EXPECTED] = 6, 7
    out = _once_the_epoch_is_done(
        lambda: _sum(summer, ys, part, sync, **NO_GIVING_UP[summer]), sync, part, value
    )
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)
    assert sync[TIMED_OUT] == 0


@pytest.mark.parametrize("summer", list(SUMMERS))
def test_an_epoch_already_done_adds_at_once(gen, summer):
    ys, part = [randn(gen, 2, 3, 64)], _host(torch.randn(2, 64, generator=gen))
    sync = _sync()
    sync[DONE], sync[EXPECTED] = 9, 4  # DONE past EXPECTED: still ready
    out = _sum(summer, ys, part, sync)
    torch.testing.assert_close(out, ys[0].sum(dim=1) + part.to(DEVICE))


@pytest.mark.parametrize("summer", list(SUMMERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_sum_is_rounded_once_to_the_model_dtype(gen, summer, dtype):
    """Written in the model's dtype, the sum is the fp32 sum rounded once (what a conversion
    after an fp32 sum gives), so the engine needs no conversion launch after it."""
    ys = [randn(gen, 2, 8, 2100) * 10 for _ in range(2)]
    part = _host(torch.randn(2, 2100, generator=gen) * 10)
    sync = _sync()
    sync[DONE], sync[EXPECTED] = 3, 3
    out = _sum(summer, ys, part, sync, dtype=dtype)
    assert out.dtype == dtype
    exact = ys[0].sum(dim=1) + ys[1].sum(dim=1) + part.to(DEVICE)
    # one rounding of (nearly) the same fp32 value, summed in another order: at most one step
    # of dtype apart, and the fp32 sums' own difference
    step = torch.finfo(dtype).eps * exact.abs()
    assert ((out.float() - exact).abs() <= step + 1e-4).all()
    if CUDA or dtype == torch.float16 or summer == "ref":  # the interpreter's bf16 store
        # truncates rather than rounds to nearest, so there it is held to the one step alone
        assert (out.float() == exact.to(dtype).float()).float().mean() > 0.95


@pytest.mark.parametrize("summer", list(SUMMERS))
def test_giving_up_sets_the_flag_and_returns_the_device_parts_alone(gen, summer):
    ys = [randn(gen, 2, 3, 64) for _ in range(2)]
    part = _host(torch.randn(2, 64, generator=gen))
    sync = _sync()
    sync[EXPECTED] = 1
    limit = {"max_polls": 8} if summer == "triton" else {"timeout_s": 0.05}
    out = _sum(summer, ys, part, sync, **limit)
    assert sync[TIMED_OUT] == 1
    torch.testing.assert_close(out, ys[0].sum(dim=1) + ys[1].sum(dim=1))


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_a_cpu_job_hands_its_output_to_the_waiting_kernel(gen, kernel):
    """The engine's chain: the job writes its part and then the epoch; the kernel adds it."""
    num_tokens, hidden = 3, 96
    pairs = [(0, 0), (2, 0), (1, 1), (2, 2), (0, 2)]
    args = make_inputs(gen, 3, hidden, 40, num_tokens, pairs, torch.bfloat16)
    ys = [randn(gen, num_tokens, 2, hidden)]
    expected = ys[0].sum(dim=1).cpu() + cpu_experts_ref(*args)
    part = _host(torch.full((num_tokens, hidden), float("nan")))  # a stale part must not be added
    sync = _sync()
    sync[EXPECTED] = 5
    with CpuExpertRunner(2, kernel) as runner:
        job = runner.submit(*args, out=part, done_flag=sync, done_value=5)
        out = _sum("triton", ys, part, sync)
        job.wait()
    assert sync[DONE] == 5
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_done_flag_comes_after_the_output(kernel):
    """The epoch is written once the whole output is: whoever sees it can read the output."""
    args = slow_inputs(torch.Generator().manual_seed(3))
    expected = cpu_experts_ref(*args)
    out = torch.full_like(expected, float("nan"))
    flag = torch.zeros(8, dtype=torch.int64)
    with CpuExpertRunner(1, kernel, **({"simd": "scalar"} if kernel == "native" else {})) as runner:
        gate = Gate(runner)
        job = runner.submit(*args, out=out, done_flag=flag, done_value=42)
        assert flag[0] == 0, "the epoch was written before the job ran"
        gate.open()
        while flag[0] != 42:
            time.sleep(0)
        seen = out.clone()  # read at the moment the epoch appeared, before wait()
        job.wait()
    torch.testing.assert_close(seen, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(flag[1:], torch.zeros(7, dtype=torch.int64)), "wrote past the flag"


def test_a_job_with_no_pairs_is_done_at_once(gen):
    x, w13, w2, *_ = make_inputs(gen, 3, 40, 24, 2, [(0, 0)], torch.bfloat16)
    none_i = torch.zeros(0, dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int64)
    out = torch.full((2, 40), 7.0)
    with CpuExpertRunner(2, "native") as runner:
        runner.submit(x, w13, w2, none_i, none_i, torch.zeros(0), out, done_flag=flag,
                      done_value=3)  # fmt: skip
        assert flag[0] == 3 and torch.equal(out, torch.zeros(2, 40))


@pytest.mark.parametrize(
    ("call", "words"),
    [
        ({"out": None}, "done_flag needs out"),
        ({"done_flag": torch.zeros(1, dtype=torch.int32)}, "int64 tensor in host memory"),
    ],
)
def test_bad_done_flags_get_a_clear_error(gen, call, words):
    args = make_inputs(gen, 3, 16, 8, 1, [(0, 0)], torch.float32)
    kwargs = {"out": torch.empty(1, 16), "done_flag": torch.zeros(1, dtype=torch.int64)} | call
    with CpuExpertRunner(1, "native") as runner, pytest.raises(ValueError, match=words):
        runner.submit(*args, **kwargs)


@pytest.mark.parametrize(
    ("out", "part", "sync", "words"),
    [
        (torch.zeros(2, 9), torch.zeros(2, 8), None, "the CPU part's shape"),
        (torch.zeros(2, 8, device="meta"), torch.zeros(2, 8), None, "out is on meta"),
        (torch.zeros(2, 8).bfloat16(), torch.zeros(2, 8), None, "torch.float32"),
        (torch.zeros(2, 8), torch.zeros(8, 2).t(), None, "contiguous"),
        (torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(3, dtype=torch.int64), "handoff_sync"),
    ],
)
def test_bad_handoff_outputs_get_a_clear_error(out, part, sync, words):
    sync = host_handoff.handoff_sync(pin=False) if sync is None else sync
    with pytest.raises(ValueError, match=words):
        host_handoff.sum_when_ready_triton([torch.zeros(2, 4, 8)], part, sync, out=out)


@pytest.mark.parametrize(
    ("parts", "part", "words"),
    [
        ([], torch.zeros(2, 8), "one or two"),
        ([torch.zeros(2, 4, 8)] * 3, torch.zeros(2, 8), "one or two"),
        ([torch.zeros(2, 4, 8), torch.zeros(2, 3, 8)], torch.zeros(2, 8), "of one shape"),
        ([torch.zeros(2, 8)], torch.zeros(2, 8), r"\[T, K, H\]"),
        ([torch.zeros(2, 4, 8).bfloat16()], torch.zeros(2, 8), "fp32"),
        ([torch.zeros(2, 4, 8)], torch.zeros(2, 9), r"must be \[2, 8\]"),
        ([torch.zeros(2, 4, 8)], torch.zeros(2, 8).bfloat16(), "contiguous fp32"),
    ],
)
def test_bad_sum_inputs_get_a_clear_error(parts, part, words):
    sync = host_handoff.handoff_sync(pin=False)
    for summer in SUMMERS.values():
        with pytest.raises(ValueError, match=words):
            summer(parts, part, sync)


def test_a_sum_in_an_unsupported_dtype_or_into_another_dtype_is_refused():
    parts, part = [torch.zeros(2, 4, 8)], torch.zeros(2, 8)
    sync = host_handoff.handoff_sync(pin=False)
    for summer in SUMMERS.values():
        with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
            summer(parts, part, sync, dtype=torch.int32)
    out = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"must be contiguous torch\.bfloat16"):
        host_handoff.sum_when_ready_triton(parts, part, sync, out=out, dtype=torch.bfloat16)


NORMERS = {
    "triton": host_handoff.sum_norm_when_ready_triton,
    "ref": host_handoff.sum_norm_when_ready_ref,
}


def _sum_norm(normer: str, ys, part, sync, residual, weight, **kwargs):
    """sum_norm_when_ready by `normer` (the Triton one's outputs poisoned: conftest), waited for."""
    out = NORMERS[normer](ys, part, sync, residual, weight, 1e-6, **kwargs)
    _finished()
    return out


@pytest.mark.parametrize("normer", list(NORMERS))
@pytest.mark.parametrize(("tokens", "parts"), [(1, 2), (1, 1), (3, 2)])
def test_the_sum_goes_into_the_residual_and_the_norm_once_the_epoch_is_done(
    gen, normer, tokens, parts
):
    """The MoE layer's output (the parts' routes and the CPU's part, added only once its epoch is
    done) added to the residual and normalized: one token waits in the sum's own program, more
    behind the one-warp wait."""
    hidden = 1500  # not a power of two: a masked tail
    ys = [randn(gen, tokens, 4, hidden) for _ in range(parts)]
    value = torch.randn(tokens, hidden, generator=gen)
    part = _host(torch.full((tokens, hidden), float("nan")))
    residual, weight = randn(gen, tokens, hidden), randn(gen, hidden)
    sync = _sync()
    sync[DONE], sync[EXPECTED] = 6, 7
    normed, new_residual = _once_the_epoch_is_done(
        lambda: _sum_norm(normer, ys, part, sync, residual, weight, **NO_GIVING_UP[normer]),
        sync, part, value,
    )  # fmt: skip
    expected_residual = sum(y.sum(dim=1) for y in ys) + value.to(DEVICE) + residual
    torch.testing.assert_close(new_residual, expected_residual, rtol=1e-6, atol=1e-5)
    expected = rmsnorm_ref(expected_residual, weight, 1e-6)
    torch.testing.assert_close(normed, expected, rtol=1e-5, atol=1e-5)
    assert sync[TIMED_OUT] == 0


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_sum_and_norm_give_the_bits_of_the_launches_they_replace(gen, tokens, dtype):
    """In the model's dtype, one launch gives what sum_when_ready then fused_add_rmsnorm gave:
    the routes' sum rounded once, added to the residual in that dtype, then normalized."""
    hidden = 2100
    ys = [randn(gen, tokens, 8, hidden) for _ in range(2)]
    part = _host(torch.randn(tokens, hidden, generator=gen))
    residual, weight = randn(gen, tokens, hidden, dtype=dtype), randn(gen, hidden, dtype=dtype)
    sync = _sync()
    sync[DONE], sync[EXPECTED] = 5, 5
    normed, new_residual = _sum_norm("triton", ys, part, sync, residual, weight)
    routed = host_handoff.sum_when_ready_triton(ys, part, sync, dtype=dtype)
    expected, expected_residual = fused_add_rmsnorm_triton(routed, residual, weight, 1e-6)
    _finished()
    assert normed.dtype == new_residual.dtype == dtype
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(normed, expected)


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("normer", list(NORMERS))
def test_giving_up_on_the_epoch_normalizes_the_device_parts_alone(gen, normer, tokens):
    ys = [randn(gen, tokens, 3, 64) for _ in range(2)]
    part = _host(torch.randn(tokens, 64, generator=gen))
    residual, weight = randn(gen, tokens, 64), randn(gen, 64)
    sync = _sync()
    sync[EXPECTED] = 1
    limit = {"max_polls": 8} if normer == "triton" else {"timeout_s": 0.05}
    normed, new_residual = _sum_norm(normer, ys, part, sync, residual, weight, **limit)
    assert sync[TIMED_OUT] == 1
    expected_residual = ys[0].sum(dim=1) + ys[1].sum(dim=1) + residual
    torch.testing.assert_close(new_residual, expected_residual)
    torch.testing.assert_close(normed, rmsnorm_ref(expected_residual, weight, 1e-6))


@pytest.mark.parametrize(
    ("residual", "weight", "words"),
    [
        (torch.zeros(2, 9), torch.zeros(8), r"residual must be contiguous \[2, 8\]"),
        (torch.zeros(8, 2).t(), torch.zeros(8), "residual must be contiguous"),
        (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(8), "fp32, bf16 or fp16"),
        (torch.zeros(2, 8), torch.zeros(9), r"weight must be contiguous \[8\]"),
        (torch.zeros(2, 8, device="meta"), torch.zeros(8), "the parts' device"),
    ],
)
def test_bad_norm_inputs_get_a_clear_error(residual, weight, words):
    parts, part = [torch.zeros(2, 4, 8)], torch.zeros(2, 8)
    sync = host_handoff.handoff_sync(pin=False)
    for normer in NORMERS.values():
        with pytest.raises(ValueError, match=words):
            normer(parts, part, sync, residual, weight, 1e-6)


SLOT_TABLES = {
    "triton": host_handoff.route_slots_from_host_triton,
    "ref": host_handoff.route_slots_from_host_ref,
}


@pytest.mark.parametrize("kernel", list(SLOT_TABLES))
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 8), (3, 5), (8, 8)])
def test_route_slots_split_into_the_cached_and_the_filled_tables(gen, kernel, tokens, top_k):
    """The planner's table (a slot, -1 on the CPU, or filled_mark(slot) for a route its fills
    serve) as the two tables the device runs: one route lands in exactly one of them."""
    slots = torch.randint(0, 384, (tokens, top_k), generator=gen, dtype=torch.int32)
    kind = torch.randint(0, 3, (tokens, top_k), generator=gen)  # cached, on the CPU, filled
    table = torch.where(kind == 0, slots, torch.where(kind == 1, -1, -2 - slots))
    table[0, 0], table[-1, -1] = -2, 0  # slot 0, filled and cached: the edges of the marks
    slots_h = _host(table.to(torch.int32))
    # poisoned: an element left unwritten fails
    cached = torch.full((tokens, top_k), -99, dtype=torch.int32, device=DEVICE)
    filled = torch.full_like(cached, -99)
    SLOT_TABLES[kernel](slots_h, cached, filled)
    _finished()
    want_cached = torch.where(kind == 0, slots, -1)
    want_filled = torch.where(kind == 2, slots, -1)
    want_cached[0, 0], want_filled[0, 0] = -1, 0
    want_cached[-1, -1], want_filled[-1, -1] = 0, -1
    assert torch.equal(cached.cpu(), want_cached)
    assert torch.equal(filled.cpu(), want_filled)
    assert host_handoff.filled_mark(0) == -2 and host_handoff.filled_mark(7) == -9


@pytest.mark.parametrize(
    ("slots_h", "cached", "words"),
    [
        (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int32), "int32"),
        (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), "shape"),
        (torch.zeros(4, 2, dtype=torch.int32).t(), torch.zeros(2, 4, dtype=torch.int32),
         "contiguous"),
        (torch.zeros(1, 1 << 15, dtype=torch.int32), torch.zeros(1, 1 << 15, dtype=torch.int32),
         "at most"),
    ],
)  # fmt: skip
def test_bad_route_slot_tables_get_a_clear_error(slots_h, cached, words):
    for kernel in SLOT_TABLES.values():
        with pytest.raises(ValueError, match=words):
            kernel(slots_h, cached, cached.clone())


MAP_LOOKUPS = {
    "triton": host_handoff.route_slots_from_map_triton,
    "ref": host_handoff.route_slots_from_map_ref,
}


@pytest.mark.parametrize("kernel", list(MAP_LOOKUPS))
@pytest.mark.parametrize(
    ("tokens", "top_k", "ids_dtype"),
    [(1, 8, torch.int32), (3, 5, torch.int64), (8, 8, torch.int32)],
)
def test_cached_routes_are_looked_up_in_the_layers_row_of_the_slot_map(
    gen, kernel, tokens, top_k, ids_dtype
):
    """Each route's slot read from the layer's row of the slot map (-1: not cached), without
    the host's plan; a padding row (its length 0) runs no route."""
    experts = 64
    row = torch.randint(-1, 300, (experts,), generator=gen, dtype=torch.int32)
    row[:3] = torch.tensor([-1, 0, 299], dtype=torch.int32)  # the edges of the slots
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[0, :3] = torch.tensor([0, 1, 2])
    seq_lens = torch.randint(1, 9000, (tokens + 2,), generator=gen, dtype=torch.int32)
    if tokens > 1:
        seq_lens[tokens - 1] = 0  # a padding row
    cached = torch.full((tokens, top_k), -99, dtype=torch.int32, device=DEVICE)  # poisoned
    MAP_LOOKUPS[kernel](ids.to(ids_dtype).to(DEVICE), _host(row), seq_lens.to(DEVICE), cached)
    _finished()
    want = torch.where(seq_lens[:tokens, None] > 0, row[ids], -1)
    assert torch.equal(cached.cpu(), want)
    assert cached[0, :3].tolist() == [-1, 0, 299]


@pytest.mark.parametrize(
    ("ids", "row", "lens", "words"),
    [
        (torch.zeros(2, 4, dtype=torch.int16), torch.zeros(8, dtype=torch.int32), 2, "int32 or"),
        (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(8), 2, "row"),
        (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32), 2, "row"),
        (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 1, "seq_lens"),
        (torch.zeros(1, 1 << 15, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 1,
         "at most"),
    ],
)  # fmt: skip
def test_bad_slot_map_lookups_get_a_clear_error(ids, row, lens, words):
    cached = torch.zeros(ids.shape, dtype=torch.int32)
    for kernel in MAP_LOOKUPS.values():
        with pytest.raises(ValueError, match=words):
            kernel(ids, row, torch.ones(lens, dtype=torch.int32), cached)


ROUTING = {
    "triton": host_handoff.routing_to_host_triton,
    "ref": host_handoff.routing_to_host_ref,
}


@pytest.mark.parametrize("kernel", list(ROUTING))
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 8, 1500), (3, 4, 64), (8, 8, 2048)])
def test_routing_to_host_stores_every_element_converted(gen, kernel, tokens, top_k, hidden):
    ids = torch.stack([torch.randperm(128, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    x = randn(gen, tokens, hidden, dtype=torch.bfloat16)
    # poisoned destinations: an element left unwritten fails
    ids_h = _host(torch.full((tokens, top_k), -99, dtype=torch.int32))
    w_h = _host(torch.full((tokens, top_k), float("nan")))
    x_h = _host(torch.full((tokens, hidden), float("nan")))
    ROUTING[kernel](ids, weights, x, ids_h, w_h, x_h)
    _finished()
    assert torch.equal(ids_h, ids.int().cpu())
    assert torch.equal(w_h, weights.cpu())
    assert torch.equal(x_h, x.float().cpu())


TOKENS = {"triton": host_handoff.tokens_to_host_triton, "ref": host_handoff.tokens_to_host_ref}


@pytest.mark.parametrize("kernel", list(TOKENS))
@pytest.mark.parametrize("n", [1, 3, 8, 100])
def test_tokens_to_host_stores_every_token(gen, kernel, n):
    tokens = torch.randint(0, 151936, (n,), generator=gen).to(DEVICE)
    tokens_h = _host(torch.full((n + 2,), -99, dtype=torch.int64))  # poisoned, one past the end
    TOKENS[kernel](tokens, tokens_h[:n])
    _finished()
    assert torch.equal(tokens_h[:n], tokens.cpu())
    assert (tokens_h[n:] == -99).all()


@pytest.mark.parametrize(
    ("tokens", "tokens_h", "words"),
    [
        (torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), "int64"),
        (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), r"must be \[n\]"),
        (torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64), r"\[n\]"),
        (torch.zeros(5000, dtype=torch.int64), torch.zeros(5000, dtype=torch.int64), "at most"),
    ],
)  # fmt: skip
def test_bad_token_buffers_get_a_clear_error(tokens, tokens_h, words):
    for kernel in TOKENS.values():
        with pytest.raises(ValueError, match=words):
            kernel(tokens, tokens_h)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"ids_h": torch.zeros(1, 4, dtype=torch.int64)}, "int32 ids"),
        ({"x_h": torch.zeros(1, 32, dtype=torch.bfloat16)}, "fp32 x"),
        ({"x_h": torch.zeros(2, 32)}, "shapes differ"),
        ({"x": torch.zeros(2, 32), "x_h": torch.zeros(2, 32)}, "of one T"),
    ],
)
def test_bad_routing_buffers_get_a_clear_error(change, words):
    args = {
        "ids": torch.zeros(1, 4, dtype=torch.int64), "weights": torch.zeros(1, 4),
        "x": torch.zeros(1, 32), "ids_h": torch.zeros(1, 4, dtype=torch.int32),
        "weights_h": torch.zeros(1, 4), "x_h": torch.zeros(1, 32),
    } | change  # fmt: skip
    with pytest.raises(ValueError, match=words):
        host_handoff.routing_to_host(**args)


def test_the_routing_signal_is_set_after_the_routing(gen):
    """signal_routing sets the routing's signal (element 0 of its own cache line) after the work
    queued before it: on a GPU a kernel after the routing's copy (test_route.py reads both with
    no sync), elsewhere at once."""
    signal = host_handoff.routing_signal(pin=DEVICE.type == "cuda")
    assert signal.shape == (16,) and signal.dtype == torch.int32 and not signal.any()
    ids, weights = torch.zeros(1, 4, dtype=torch.int64, device=DEVICE), torch.rand(1, 4).to(DEVICE)
    x = randn(gen, 1, 64, dtype=torch.bfloat16)
    host = (_host(torch.zeros(1, 4, dtype=torch.int32)), _host(torch.zeros(1, 4)),
            _host(torch.zeros(1, 64)))  # fmt: skip
    host_handoff.routing_to_host(ids, weights, x, *host)
    host_handoff.signal_routing(signal, DEVICE)
    _finished()
    assert signal.tolist() == [host_handoff.ROUTED] + [0] * 15


@pytest.mark.parametrize(
    ("signal", "device", "words"),
    [
        (torch.zeros(16, dtype=torch.int64), "cpu", "routing_signal\\(\\) tensor, got torch.int64"),
        (torch.zeros(0, dtype=torch.int32), "cpu", "routing_signal\\(\\) tensor"),
        (torch.zeros(16, dtype=torch.int32), "cuda", "must be pinned host memory"),
    ],
)
def test_bad_routing_signals_get_a_clear_error(signal, device, words):
    with pytest.raises(ValueError, match=words):
        host_handoff.signal_routing(signal, torch.device(device))
