"""The native decode planner makes the Python planner's decisions, on the same cache state.

`plan_layer` over `ExpertCache` is the specification (engine/experts/miss_plan.py,
engine/experts/cache.py); the native `DecodePlanner` (kernels/csrc/decode_planner.h) plans
offloaded decode layer steps without Python. Two runners start from identical caches and get the
same routing, step after step, under cache pressure (steps that need more slots than are free) and
every kind of split.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.engine.experts import moe_kernels
from moelab.engine.experts.bank import ExpertBank
from moelab.engine.experts.cache import ExpertCache
from moelab.engine.experts.h2d import (
    COPY2D_FUNCTION,
    COPY_FUNCTION,
    LAUNCH_FUNCTION,
    MEMSET2D_FUNCTION,
    QUERY_FUNCTION,
    WAIT_EVENT_FUNCTION,
    address_of,
    host_functions,
)
from moelab.engine.experts.misses import (
    AHEAD_SHARE,
    COPY_FIXED,
    CPU_FIXED,
    SPLIT_FIXED,
    MissPolicy,
    split_chunks,
)
from moelab.engine.experts.moe import MoERunner
from moelab.kernels import fp8, mxfp4, nvfp4
from moelab.kernels.cpu_experts import CpuExpertRunner, cpu_experts_ref
from moelab.kernels.host_handoff import (
    DONE,
    EXPECTED,
    ROUTED,
    filled_mark,
    route_slots_from_host,
    routing_signal,
    routing_to_host,
)

from ..kernels.gate import Gate
from .late_routing import TICK_S, LateRouting

LAYERS, EXPERTS, HIDDEN, INTER = 3, 12, 32, 16
# an FP8 bank's: H of two blocks (the second ragged), I of three (a split at 128 or 256 rows)
FP8_HIDDEN, FP8_INTER = 160, 384
# an MXFP4 bank's: H of two groups of 32, I of three (a split at 32 or 64 rows)
MX_HIDDEN, MX_INTER = 64, 96
# an NVFP4 bank's: H of two groups of 16, I of three (a split at 16 or 32 rows)
NV_HIDDEN, NV_INTER = 32, 48
# gpt-oss's clamped SwiGLU, for the banks with biases ("-bias")
SWIGLU_LIMIT = 7.0


@pytest.fixture(scope="module")
def cpu():
    # redo_us=1: an idle worker runs again nearly every task of the planner's jobs it finds in
    # flight, and their outputs are still compared bit for bit (the Python planner's are not
    # redoable)
    with CpuExpertRunner(2, "native", redo_us=1) as runner:
        yield runner


def _runner(
    bank: ExpertBank,
    slots: int,
    fraction: float,
    cpu,
    top_k: int,
    admission: str = "recent",
    **settings,
) -> MoERunner:
    hidden, inter = bank.hidden_size, bank.intermediate_size
    cache = ExpertCache(LAYERS, EXPERTS, slots, hidden, inter, torch.bfloat16, torch.device("cpu"),
                        fmt=bank.fmt, bias=bool(bank.w13_bias),
                        swiglu_limit=bank.swiglu_limit, admission=admission)  # fmt: skip
    policy = MissPolicy("split", fraction)
    return MoERunner(
        bank, cache, policy, cpu, top_k=top_k, prefill_overlap=False, prefill_stream_min_tokens=64,
        **settings,
    )  # fmt: skip


def _nvfp4(w: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """Experts' weights [E, N, K] as NVFP4 values, scales and per-tensor scales [E, parts], one
    for each run of N / parts rows (w13: gate's, up's)."""
    values, scales, tensor_scales = nvfp4.quantize(w.unflatten(1, (parts, -1)))
    return values.flatten(1, 2), scales.flatten(1, 2), tensor_scales


def _bank(gen: torch.Generator, fmt: str = "bf16") -> ExpertBank:
    """Random experts: bf16 (HIDDEN, INTER), FP8 values with their block factors (FP8_HIDDEN,
    FP8_INTER; factors of several binades, weights of about unit outputs), MXFP4 blocks with
    their scales (MX_HIDDEN, MX_INTER; the same weights rounded), or NVFP4 values with their
    scales and per-tensor scales (NV_HIDDEN, NV_INTER). "-bias": gpt-oss's experts, with their
    biases and clamped SwiGLU."""
    fmt, biased = fmt.removesuffix("-bias"), fmt.endswith("-bias")
    if fmt == "bf16":
        w13 = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).bfloat16()
               for _ in range(LAYERS)]  # fmt: skip
        w2 = [torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).bfloat16() for _ in range(LAYERS)]
        bank = ExpertBank(w13, w2)
    else:
        hidden, inter, quantize = {
            "fp8": (FP8_HIDDEN, FP8_INTER, lambda w, parts: fp8.quantize(w)),
            "mxfp4": (MX_HIDDEN, MX_INTER, lambda w, parts: mxfp4.quantize(w)),
            "nvfp4": (NV_HIDDEN, NV_INTER, _nvfp4),
        }[fmt]
        layers = []
        for _ in range(LAYERS):
            for parts, shape in ((2, (EXPERTS, 2 * inter, hidden)), (1, (EXPERTS, hidden, inter))):
                # fan-in scaled, each expert in a binade of its own
                binades = torch.randint(-2, 2, (EXPERTS, 1, 1), generator=gen).float()
                w = torch.randn(shape, generator=gen) * torch.exp2(binades) / shape[2] ** 0.5
                layers.append(quantize(w, parts))
        # per projection: its values, scales (and per-tensor scales) of each layer
        w13, w2 = ([list(t) for t in zip(*layers[i::2], strict=True)] for i in (0, 1))
        bank = ExpertBank(w13[0], w2[0], w13[1], w2[1], *(w13[2:] + w2[2:]))
    if biased:
        hidden, inter = bank.hidden_size, bank.intermediate_size
        bank.w13_bias = [torch.randn(EXPERTS, 2 * inter, generator=gen) for _ in range(LAYERS)]
        bank.w2_bias = [torch.randn(EXPERTS, hidden, generator=gen) for _ in range(LAYERS)]
        bank.swiglu_limit = SWIGLU_LIMIT
    return bank


def _routes(rng: np.random.Generator, tokens: int, top_k: int) -> np.ndarray:
    """Skewed routing: distinct experts per row, low ids likelier."""
    p = 1.0 / np.arange(1, EXPERTS + 1)
    p /= p.sum()
    rows = [rng.choice(EXPERTS, top_k, replace=False, p=p) for _ in range(tokens)]
    return np.array(rows, dtype=np.int32)


def _cpu_part(on_cpu, ids, weights, x, bank: ExpertBank, layer: int) -> torch.Tensor:
    """The reference output of the routes whose experts run on the CPU."""
    rows, cols = (np.ascontiguousarray(a, dtype=np.int32) for a in np.nonzero(np.isin(ids, on_cpu)))
    pair_expert = torch.from_numpy(np.ascontiguousarray(ids[rows, cols]))
    pair_weight = weights[torch.from_numpy(rows).long(), torch.from_numpy(cols).long()].contiguous()
    return cpu_experts_ref(x, bank.w13[layer], bank.w2[layer], pair_expert, torch.from_numpy(rows),
                           pair_weight, **bank.cpu_args(layer))  # fmt: skip


def _layer_ref(x, ids, weights, bank: ExpertBank, layer: int) -> torch.Tensor:
    """The whole layer's output, every route from the bank."""
    ids = np.asarray(ids)
    return _cpu_part(np.unique(ids), ids, weights, x, bank, layer)


def _assert_marked(d, ids: np.ndarray, slot_of: np.ndarray) -> None:
    """A step with the planner's copies marks the routes its fills serve (the split one too)
    and leaves -1 on the CPU's routes and the slot on the cached ones'."""
    filled = {e: s for e, s in d.admitted}
    if d.split is not None:
        filled[d.split[0]] = d.split[1]
    on_cpu = set(d.on_cpu) - set(filled)
    for route, expert in np.ndenumerate(ids):
        want = (
            filled_mark(filled[expert]) if expert in filled
            else -1 if expert in on_cpu
            else slot_of[expert]
        )  # fmt: skip
        assert d.route_slots[route] == want, (route, expert)
        assert want != -1 or expert in on_cpu


def _device_part(d, x, weights, cache) -> torch.Tensor:
    """What the device runs of a step with the planner's copies: the cached routes, then the
    filled ones (the two tables `routed_cached` makes of the marked route slots)."""
    slots_h = d.route_slots_host
    cached = torch.empty(slots_h.shape, dtype=torch.int32, device=x.device)
    filled = torch.empty_like(cached)
    route_slots_from_host(slots_h, cached, filled)
    parts = (moe_kernels.decode(x, t, weights, cache.w13, cache.w2, **cache.kernel_args())
             for t in (cached, filled))  # fmt: skip
    return sum(parts)


def _slots(cache: ExpertCache) -> list[int]:
    """The cache's slot arrays as the native planner copies into them (`set_device`)."""
    return [t.data_ptr() for t in cache.tensors()]


def _state(r: MoERunner) -> tuple:
    c = r.cache
    return (c.slot_of.tolist(), c.key_of_slot.tolist(), c.last_use.tolist(), c.state.tolist(),
            r.counters.picks.tolist())  # fmt: skip


@pytest.mark.parametrize("fraction", [0.0, 0.1, 1 / 3, 0.39, 0.5, 0.72, 1.0])
def test_fetch_count_is_the_whole_split_that_ends_the_step_soonest(fraction):
    """The copies take q · (1 − f), the CPU (m − q) · f (in units of one expert's copy and CPU
    time), each side with work its fixed part: the step ends at the later; no whole q ends it
    sooner, and of equals the most fetched is taken."""
    policy = MissPolicy("split", fraction)
    for misses in range(17):
        q = policy.fetch_count(misses)
        ends = [
            max(k * (1 - fraction) + (COPY_FIXED if k else 0.0),
                (misses - k) * fraction + (CPU_FIXED if misses - k else 0.0))
            for k in range(misses + 1)
        ]  # fmt: skip
        assert ends[q] == min(ends), (misses, q)
        assert all(ends[k] > ends[q] for k in range(q + 1, misses + 1)), (misses, q)
    # where rounding m · f would copy more than the CPU's share allows
    assert MissPolicy("split", 0.39).fetch_count(4) == 1  # round(1.56) = 2 ends later


@pytest.mark.parametrize(
    ("fmt", "fraction"),
    # FP8: its jobs take the factors, MXFP4 its scales, NVFP4 its scales and per-tensor scales,
    # gpt-oss's its biases and clamped SwiGLU; fractions with copies, CPU jobs and cache pressure
    [
        ("bf16", 0.0),
        ("bf16", 0.35),
        ("bf16", 0.5),
        ("bf16", 1.0),
        ("fp8", 0.35),
        ("fp8", 0.5),
        ("mxfp4", 0.35),
        ("mxfp4-bias", 0.5),
        ("nvfp4", 0.35),
        ("bf16-bias", 0.35),
    ],
)
@pytest.mark.parametrize(("tokens", "top_k", "slots"), [(1, 4, 10), (3, 4, 6), (5, 3, 4)])
def test_native_plans_like_python(cpu, fraction, tokens, top_k, slots, fmt):
    """Step after step from identical caches: the same plans, cache states and pick counts,
    and CPU jobs of the same output bit for bit (an FP8 bank's with its factors, an MXFP4 one's
    with its scales, an NVFP4 one's with its scales and per-tensor scales, gpt-oss's experts
    with their biases)."""
    gen = torch.Generator().manual_seed(int(fraction * 100) + tokens)
    bank = _bank(gen, fmt)
    hidden = bank.w2[0].shape[1]
    python, native = (_runner(bank, slots, fraction, cpu, top_k) for _ in range(2))
    assert native.planner.native() is not None
    rng = np.random.default_rng(tokens * 7 + top_k)
    saw = {"admitted": 0, "cpu": 0, "short_of_slots": 0}
    for step in range(60):
        layer = step % LAYERS
        ids = _routes(rng, tokens, top_k)
        weights = torch.rand(tokens, top_k, generator=gen)
        x = torch.randn(tokens, hidden, generator=gen)
        want = python.planner.plan(layer, ids, decode=True)
        python.planner.start(want, layer, ids, weights, x)
        got = native.planner.plan_and_start(layer, ids, weights, x, decode=True)
        assert got.route_slots_host is not None
        for field in ("experts", "slots", "missing", "admitted", "on_cpu"):
            assert getattr(got, field) == getattr(want, field), (step, field)
        np.testing.assert_array_equal(got.route_slots, want.route_slots)
        assert _state(native) == _state(python), step
        assert (got.job is None) == (want.job is None)
        if want.job is not None:
            assert got.job.redoable() and not want.job.redoable()
            torch.testing.assert_close(got.job.wait(), want.job.wait(), rtol=0, atol=0)
            reference = _cpu_part(want.on_cpu, ids, weights, x, bank, layer)
            torch.testing.assert_close(got.job.wait(), reference, rtol=1e-4, atol=1e-4)
        saw["admitted"] += len(want.admitted)
        saw["cpu"] += len(want.on_cpu)
        q = MissPolicy("split", fraction).fetch_count(len(want.missing))
        saw["short_of_slots"] += len(want.admitted) < q
    # the comparison covered what it is about
    if fraction > 0:
        assert saw["admitted"] > 0 and python.cache.evictions > 0
    if fraction < 1:
        assert saw["cpu"] > 0
    if fraction == 1.0 and slots < tokens * top_k:
        assert saw["short_of_slots"] > 0


@pytest.mark.parametrize(("fmt", "tokens", "top_k", "slots"), [("bf16", 3, 4, 6), ("fp8", 5, 3, 8)])
def test_native_admits_by_frequency_like_python(cpu, fmt, tokens, top_k, slots):
    """--moe-cache-admission frequency: the native planner keeps the same fills back as
    `ExpertCache.admit` given the pick counts (a fill picked less often than the expert it
    evicts keeps that expert's last use), step after step; and the rule is at work: the caches
    end unlike those of recent admission over the same routing."""
    gen = torch.Generator().manual_seed(tokens)
    bank = _bank(gen, fmt)
    hidden = bank.w2[0].shape[1]
    runners = [_runner(bank, slots, 0.6, cpu, top_k, admission) for admission in
               ("frequency", "frequency", "recent")]  # fmt: skip
    python, native, recent = runners
    rng = np.random.default_rng(tokens)
    kept_back = 0
    for step in range(90):
        layer = step % LAYERS
        ids = _routes(rng, tokens, top_k)
        weights = torch.rand(tokens, top_k, generator=gen)
        x = torch.randn(tokens, hidden, generator=gen)
        before = int(python.cache.state[0])  # the use clock
        want = python.planner.plan(layer, ids, decode=True)
        kept_back += sum(int(python.cache.last_use[slot]) <= before for _, slot in want.admitted)
        python.planner.start(want, layer, ids, weights, x)
        got = native.planner.plan_and_start(layer, ids, weights, x, decode=True)
        for field in ("experts", "slots", "missing", "admitted", "on_cpu"):
            assert getattr(got, field) == getattr(want, field), (step, field)
        assert _state(native) == _state(python), step
        if want.job is not None:
            torch.testing.assert_close(got.job.wait(), want.job.wait(), rtol=0, atol=0)
        recent.planner.plan_and_start(layer, ids, weights, x, decode=True)
    assert kept_back > 0
    assert python.cache.hits > recent.cache.hits  # the hot experts stayed
    assert _state(recent) != _state(python)


@pytest.mark.parametrize("admission", ["recent", "frequency"])
def test_native_steps_between_python_ones_plan_like_python(cpu, admission):
    """Prefill plans in Python (`plan`) over the cache the native planner decodes with: the
    native planner picks its fills and evictions from the cache as the Python steps left it
    (its slot order rebuilt from their writes), step after step against a cache only Python
    plans for."""
    gen = torch.Generator().manual_seed(11)
    bank = _bank(gen)
    python, mixed = (_runner(bank, 7, 0.6, cpu, 4, admission) for _ in range(2))
    rng = np.random.default_rng(5)
    natives = 0
    for step in range(120):
        layer = step % LAYERS
        tokens = int(rng.integers(1, 4))
        ids = _routes(rng, tokens, 4)
        weights = torch.rand(tokens, 4, generator=gen)
        x = torch.randn(tokens, HIDDEN, generator=gen)
        want = python.planner.plan(layer, ids, decode=True)
        python.planner.start(want, layer, ids, weights, x)
        if rng.random() < 0.4:  # a run of the mixed cache's steps planned in Python
            got = mixed.planner.plan(layer, ids, decode=True)
            mixed.planner.start(got, layer, ids, weights, x)
        else:
            got = mixed.planner.plan_and_start(layer, ids, weights, x, decode=True)
            natives += 1
        for field in ("experts", "slots", "missing", "admitted", "on_cpu"):
            assert getattr(got, field) == getattr(want, field), (step, field)
        assert _state(mixed) == _state(python), step
        for d in (want, got):
            if d.job is not None:
                d.job.wait()
    assert natives > 40 and python.cache.evictions > 40


def test_fetch_plan_splits_a_miss_where_that_ends_the_step_sooner():
    policy = MissPolicy("split", 0.39)
    # two misses: one whole copy (0.61 + its fixed 0.15) or the CPU alone (0.78 + 0.09) against
    # copying 10/16 of one (0.38125 + 0.15 + the split's 0.1) while the CPU runs the rest
    # (1.375 * 0.39 + 0.09): 0.631 and 0.626
    assert policy.fetch_count(2) == 1
    assert policy.fetch_plan(2, 16) == (0, 10)

    def ends(misses: int, q: int, u: float) -> float:
        copied, on_cpu = q + u, misses - q - u
        copies = copied * 0.61 + (COPY_FIXED + (SPLIT_FIXED if u else 0.0) if copied else 0.0)
        return max(copies, on_cpu * 0.39 + (CPU_FIXED if on_cpu else 0.0))

    for misses in range(9):  # a split never ends later than the whole split, and only replaces it
        q, j = policy.fetch_plan(misses, 16)
        whole = policy.fetch_count(misses)
        assert ends(misses, q, j / 16) <= ends(misses, whole, 0.0)
        assert j > 0 or q == whole
        assert policy.fetch_plan(misses, 0) == (whole, 0)
    assert MissPolicy("gpu", 1.0).fetch_plan(3, 16) == (3, 0)
    assert MissPolicy("cpu", 0.0).fetch_plan(3, 16) == (0, 0)
    # one miss: 0.39 + 0.09 on the CPU; split at 4/16, the copies end at 0.25 * 0.61 + 0.25
    # (0.4025) and the CPU at 0.75 * 0.39 + 0.09 (0.3825)
    assert policy.fetch_plan(1, 16) == (0, 4)


def test_a_split_cuts_whole_blocks_in_at_most_sixteen_chunks():
    """split_chunks: as many chunks as divide I into whole blocks, at most 16; none below 2."""
    assert split_chunks(768, 1) == 16  # Qwen3-30B-A3B in bf16
    assert split_chunks(768, 128) == 6  # in FP8: its six 128-row blocks
    assert split_chunks(384, 128) == 3 and split_chunks(256, 128) == 2
    assert split_chunks(2880, 32) == 15  # 90 blocks of 32 (gpt-oss's I in MXFP4's blocks)
    assert split_chunks(1000, 1) == 10
    # one block, a ragged last block, or a prime count of rows: no split
    assert split_chunks(128, 128) == split_chunks(200, 128) == split_chunks(37, 1) == 0


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.39, 0.7, 1.0])
def test_a_lead_copied_ahead_gives_the_device_those_rows_where_that_ends_the_step_no_later(
    fraction,
):
    """lead_plan (the gate and up of the share `lead` of the device's first miss's rows copied
    ahead of the routing, AHEAD_SHARE of those rows' bytes): the device takes at least those
    rows, and the plan ends soonest of all such divisions (counting those bytes as copied), no
    later than fetch_plan's; where every such division ends later (a CPU far faster than the
    copies), the lead is left unused (None)."""
    policy = MissPolicy("split", fraction)
    f = fraction

    def ends(misses: int, q: int, u: float, lead: float) -> float:
        copied, on_cpu = q + u, misses - q - u
        copies = max(0.0, copied - lead * AHEAD_SHARE) * (1 - f)
        if copied:
            copies += COPY_FIXED + (SPLIT_FIXED if u else 0.0)
        return max(copies, on_cpu * f + (CPU_FIXED if on_cpu else 0.0))

    unused = 0
    for misses in range(1, 7):
        q0, j0 = policy.fetch_plan(misses, 16)
        plain = ends(misses, q0, j0 / 16, 0.0)
        for lead in (1 / 16, 0.1, 0.3, 0.5, 1.0):
            choices = [(k, 0) for k in range(1, misses + 1)] + [
                (k, i) for k in range(misses) for i in range(1, 16) if k or i / 16 >= lead
            ]
            best = min(ends(misses, k, i / 16, lead) for k, i in choices)
            plan = policy.lead_plan(misses, 16, lead)
            if plan is None:
                assert best > plain
                unused += 1
                continue
            q, j = plan
            assert q >= 1 or j / 16 >= lead  # the rows copied ahead stay on the device
            assert ends(misses, q, j / 16, lead) == best <= plain
    # at 0 the CPU's part costs only its fixed part: no division that takes the lead ends sooner
    assert unused > 0 or fraction != 0.0
    if fraction == 0.39:
        # one miss with the gate and up of a third of its rows ahead (2/9 of its bytes): the
        # split moves from 4/16 to 6/16, the copies taking the rest of those rows (0.153 of an
        # expert: 0.093 + 0.25) while the CPU runs 10/16 (0.334): 0.343, sooner than 0.4025
        assert policy.fetch_plan(1, 16) == (0, 4)
        assert policy.lead_plan(1, 16, 1 / 3) == (0, 6)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "mxfp4-bias", "nvfp4", "bf16-bias"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_split_miss_is_computed_once_between_the_device_and_the_cpu(cpu, tokens, fmt):
    """With the planner's copies (stand-ins on host memory, the cache in host memory too), a
    split miss's slot holds its first gate and up rows and the same columns of its down
    projection, its other gate and up rows are zero, and the device's routes plus the CPU's part
    are the whole layer's output. An FP8 expert splits at whole blocks (`split_chunks`), its
    factors copied with its values; an MXFP4 one at whole groups of 32 columns of its down
    projection, its scales with its blocks; an NVFP4 one at whole groups of 16, its scales with
    its values and its per-tensor scales whole. gpt-oss's experts: the gate and up biases of the
    device's rows go with them (the others zero), and the down bias is added once, by the CPU's
    part (the slot's zero)."""
    gen = torch.Generator().manual_seed(11)
    bank = _bank(gen, fmt)
    hidden, inter = bank.hidden_size, bank.intermediate_size
    chunks = split_chunks(inter, bank.block_rows)
    assert chunks == {"bf16": 16, "fp8": 3, "mxfp4": 3, "nvfp4": 3}[bank.fmt]
    r = _runner(bank, 6, 0.39, cpu, 4, split_misses=True)
    planner = r.planner.native()
    functions = host_functions()
    cache = r.cache
    planner.set_device(*(address_of(f) for f in functions), 0, 0, _slots(cache))
    rng = np.random.default_rng(5)
    splits = 0
    for step in range(12):
        layer = step % LAYERS
        ids = torch.from_numpy(_routes(rng, tokens, 4))
        weights = torch.rand(tokens, 4, generator=gen)
        x = torch.randn(tokens, hidden, generator=gen)
        out = torch.zeros(tokens, hidden)
        d, _ = r.planner.native_step(planner, layer, ids, weights, x, out, False, copies=True)
        _assert_marked(d, ids.numpy(), r.cache.slot_of[layer])
        # the native planner's division is the Python policy's (there is room for it in these steps)
        q, j = r.policy.fetch_plan(len(d.missing), chunks)
        assert len(d.admitted) == q
        assert (d.split[2] if d.split else 0) == j * inter // chunks
        for expert, slot in d.admitted:
            assert _slot_holds(cache, bank, layer, expert, slot, inter)
        device_part = _device_part(d, x, weights, cache)
        cpu_part = d.job.wait() if d.job is not None else torch.zeros(tokens, hidden)
        want = _layer_ref(x, ids, weights, bank, layer)
        torch.testing.assert_close(device_part + cpu_part, want, rtol=1e-4, atol=1e-4)
        if d.split is None:
            continue
        splits += 1
        expert, slot, row = d.split
        assert d.on_cpu[0] == expert and expert not in [e for e, _ in d.admitted]
        assert set(d.route_slots[ids.numpy() == expert].tolist()) == {filled_mark(slot)}
        assert 0 < row < inter and d.split_share == row / inter
        assert row % bank.block_rows == 0
        assert _slot_holds(cache, bank, layer, expert, slot, row, zeroed=True)
        # the borrowed slot holds no expert after the step
        assert cache.key_of_slot[slot] == -1 and cache.slot_of[layer, expert] == -1
    assert splits >= 3


def test_a_bad_route_is_refused_and_changes_nothing(cpu):
    bank = _bank(torch.Generator().manual_seed(0))
    r = _runner(bank, 6, 0.5, cpu, 2)
    before = _state(r)
    ids = np.array([[1, EXPERTS]], dtype=np.int32)
    with pytest.raises(ValueError, match=f"routed expert {EXPERTS} is outside 0..{EXPERTS - 1}"):
        r.planner.plan_and_start(0, ids, torch.rand(1, 2), torch.randn(1, HIDDEN), decode=True)
    assert _state(r) == before
    # and the planner still works
    d = r.planner.plan_and_start(0, np.array([[1, 2]], dtype=np.int32), torch.rand(1, 2),
                                 torch.randn(1, HIDDEN), decode=True)  # fmt: skip
    assert d.experts == [1, 2] and d.missing == [1, 2]


def test_a_resized_cache_gets_a_new_planner(cpu):
    bank = _bank(torch.Generator().manual_seed(1))
    r = _runner(bank, 6, 1.0, cpu, 2)
    first = r.planner.native()
    r.planner.plan_and_start(0, np.array([[3, 4]], dtype=np.int32), torch.rand(1, 2),
                             torch.randn(1, HIDDEN), decode=True)  # fmt: skip
    r.cache.resize(3, r.refill)
    assert r.planner.native() is not first
    assert sorted(r.cache.key_of_slot.tolist()) == [-1, 3, 4]
    d = r.planner.plan_and_start(0, np.array([[4, 5]], dtype=np.int32), torch.rand(1, 2),
                                 torch.randn(1, HIDDEN), decode=True)  # fmt: skip
    assert d.slots[0] >= 0 and d.admitted == [(5, int(r.cache.slot_of[0, 5]))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "mxfp4-bias", "nvfp4"])
def test_on_cuda_one_call_waits_for_the_routing_plans_and_queues_the_copies(cpu, fmt):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    bank = _bank(gen, fmt)
    hidden, inter = bank.hidden_size, bank.intermediate_size
    cache = ExpertCache(LAYERS, EXPERTS, 6, hidden, inter, torch.bfloat16, dev, fmt=bank.fmt,
                        bias=bool(bank.w13_bias), swiglu_limit=bank.swiglu_limit)  # fmt: skip
    r = MoERunner(bank, cache, MissPolicy("split", 0.5), cpu, top_k=4, prefill_overlap=False,
                  prefill_stream_min_tokens=64, split_misses=True)  # fmt: skip
    planner = r.planner.native()
    rng = np.random.default_rng(3)
    splits = 0
    for step in range(8):
        layer = step % LAYERS
        ids = torch.from_numpy(_routes(rng, 2, 4)).to(dev)
        weights = torch.rand(2, 4, generator=gen).to(dev)
        x = torch.randn(2, hidden, generator=gen).bfloat16().to(dev)
        torch.cuda._sleep(20_000_000)  # the routing arrives late: the step must wait for it
        ids_h, w_h, x_h = r.staged.buffers.routing(2)
        routing_to_host(ids, weights, x, ids_h, w_h, x_h)
        out = torch.empty(2, hidden)
        d, (wait_s, *_) = r.planner.native_step(
            planner, layer, ids_h, w_h, x_h, out, False, sync=True, copies=True
        )
        assert wait_s > 0
        assert d.experts == sorted(set(ids.cpu().flatten().tolist()))
        torch.cuda.synchronize()  # the fills, on the copy stream
        _assert_marked(d, ids_h.numpy(), r.cache.slot_of[layer])
        for expert, slot in d.admitted:
            assert _slot_holds(cache, bank, layer, expert, slot, inter)
        if d.split is not None:  # the device's rows of a split miss, the rest zero
            splits += 1
            expert, slot, row = d.split
            assert _slot_holds(cache, bank, layer, expert, slot, row, zeroed=True)
        # the cached and copied routes on the device plus the CPU's part: the whole layer
        device_part = _device_part(d, x, weights, cache).cpu()
        cpu_part = d.job.wait() if d.job is not None else 0.0
        want = _layer_ref(x.float().cpu(), ids.int().cpu(), weights.cpu(), bank, layer)
        # bf16 activations on the device: compared as a whole (a lost or doubled part of a
        # split miss is a tenth of it or more)
        assert ((device_part + cpu_part - want).norm() / want.norm()).item() < 1e-2
    assert splits > 0


def _no_2d() -> tuple:
    """Stand-ins for the driver's 2D memset and copy that do nothing (no split in the test)."""
    return (MEMSET2D_FUNCTION(lambda dst, pitch, value, width, height, stream: 0),
            COPY2D_FUNCTION(lambda copy, stream: 0))  # fmt: skip


@pytest.mark.parametrize(
    ("top_k", "copies_first"), [(2, True), (3, False)], ids=["copies-longer", "cpu-longer"]
)
def test_the_side_that_ends_later_starts_first(cpu, top_k, copies_first):
    """At a copy share of 0.39, two misses are one copy and one CPU expert: the copy ends later,
    so it is queued before the CPU job starts. Three misses are one copy and two on the CPU: the
    CPU job starts first. The stand-in copy looks, as it is called, whether the job was started:
    the epoch the next piece waits for (EXPECTED), which the call stores as it starts the job."""
    r = _runner(_bank(torch.Generator().manual_seed(6)), 6, 0.39, cpu, top_k)
    planner = r.planner.native()
    state = r.planner.handoff.state
    seen: list[bool] = []

    def copy(dst, src, nbytes, stream) -> int:
        if not seen:  # the first copy: has the CPU job been started?
            seen.append(bool(state[EXPECTED] == r.planner.handoff.epoch + 1))
        return 0

    functions = (COPY_FUNCTION(copy), QUERY_FUNCTION(lambda stream: 0), *_no_2d())
    planner.set_device(*(address_of(f) for f in functions), 0, 0, [1 << 40, 1 << 41])
    ids = torch.arange(top_k, dtype=torch.int32)[None]
    weights, x, out = torch.rand(1, top_k), torch.randn(1, HIDDEN), torch.zeros(1, HIDDEN)
    d, _ = r.planner.native_step(planner, 0, ids, weights, x, out, True, copies=True, expected=True)
    assert (len(d.admitted), len(d.on_cpu)) == (1, top_k - 1)
    d.job.wait()
    assert seen == [not copies_first]


def test_driver_failures_are_errors_and_a_failed_fill_leaves_no_slot_behind(cpu):
    """Stand-in driver functions (the planner only has their addresses): a failing query of the
    stream changes nothing; a failing fill raises, and the experts it was filling are not left
    resident."""
    bank = _bank(torch.Generator().manual_seed(4))
    r = _runner(bank, 6, 1.0, cpu, 2)
    planner = r.planner.native()
    copies: list[int] = []

    def failing_second_copy(dst, src, nbytes, stream) -> int:
        copies.append(nbytes)
        return 0 if len(copies) < 2 else 700  # cudaErrorIllegalAddress's code, say

    copy = COPY_FUNCTION(failing_second_copy)
    sync_result = [999]
    sync = QUERY_FUNCTION(lambda stream: sync_result[0])
    two_d = _no_2d()
    planner.set_device(address_of(copy), address_of(sync), *(address_of(f) for f in two_d), 0, 0,
                       [1 << 40, 1 << 41])  # fmt: skip
    ids = torch.tensor([[3, 4]], dtype=torch.int32)
    weights, x, out = torch.rand(1, 2), torch.randn(1, HIDDEN), torch.zeros(1, HIDDEN)
    before = _state(r)
    with pytest.raises(RuntimeError, match="cuStreamQuery failed with CUDA driver error 999"):
        r.planner.native_step(planner, 0, ids, weights, x, out, False, sync=True, copies=True)
    assert _state(r) == before and not copies
    sync_result[0] = 0
    with pytest.raises(RuntimeError, match="cuMemcpyHtoDAsync failed with CUDA driver error 700"):
        r.planner.native_step(planner, 0, ids, weights, x, out, False, sync=True, copies=True)
    # expert 3's two matrices; the second failed
    assert copies == [2 * INTER * HIDDEN * 2, HIDDEN * INTER * 2]
    assert r.cache.slot_of[0, 3] == -1 and r.cache.slot_of[0, 4] == -1
    assert r.cache.resident == 0
    # the next step fetches them again
    copies.clear()
    copy_ok = COPY_FUNCTION(lambda dst, src, nbytes, stream: 0)
    planner.set_device(address_of(copy_ok), address_of(sync), *(address_of(f) for f in two_d),
                       0, 0, [1 << 40, 1 << 41])  # fmt: skip
    d, _ = r.planner.native_step(planner, 0, ids, weights, x, out, False, sync=True, copies=True)
    assert [e for e, _ in d.admitted] == [3, 4] and r.cache.resident == 2


def test_the_wait_polls_the_stream_until_it_is_idle(cpu):
    """With the device set, a step first polls the compute stream (cuStreamQuery) until it has
    no work left, and plans only then: here a stand-in answers CUDA_ERROR_NOT_READY three times."""
    bank = _bank(torch.Generator().manual_seed(5))
    r = _runner(bank, 6, 0.0, cpu, 2)
    planner = r.planner.native()
    answers = [600, 600, 600, 0]
    asked: list[int] = []

    def query(stream) -> int:
        asked.append(stream)
        return answers[len(asked) - 1]

    query_fn = QUERY_FUNCTION(query)
    copy = COPY_FUNCTION(lambda dst, src, nbytes, stream: 0)
    planner.set_device(address_of(copy), address_of(query_fn), *(address_of(f) for f in _no_2d()),
                       77, 0, [1 << 40, 1 << 41])  # fmt: skip
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    weights, x, out = torch.rand(1, 2), torch.randn(1, HIDDEN), torch.zeros(1, HIDDEN)
    before = r.cache.state.copy()
    d, (wait_s, *_) = r.planner.native_step(planner, 0, ids, weights, x, out, False, sync=True)
    assert asked == [77] * 4  # the compute stream's handle, until it answered 0
    assert wait_s > 0 and d.job is not None
    d.job.wait()
    assert r.counters.picks[0, [1, 2]].tolist() == [1, 1]
    assert r.cache.state[2] == before[2]  # policy 0.0: no fills, both on the CPU
    assert sorted(d.on_cpu) == [1, 2]


def test_the_wait_takes_the_routing_signal_and_asks_the_stream_only_now_and_then(cpu):
    """With a routing signal, a step polls it (not the stream) until the router sets it, then
    clears it: here the router sets it as the stand-in stream, still busy, is asked the third
    time. The stream is asked every kPollsPerQuery polls only, for its errors, and no more once
    the signal is set: one error fails the step and changes nothing."""
    bank = _bank(torch.Generator().manual_seed(6))
    r = _runner(bank, 6, 0.0, cpu, 2)
    planner = r.planner.native()
    signal = routing_signal(pin=False)
    answers = [600]
    asked = [0]

    def query(stream) -> int:
        asked[0] += 1
        if asked[0] == 3:
            signal[0] = ROUTED
        return answers[0]

    query_fn = QUERY_FUNCTION(query)
    copy = COPY_FUNCTION(lambda dst, src, nbytes, stream: 0)
    planner.set_device(address_of(copy), address_of(query_fn), *(address_of(f) for f in _no_2d()),
                       77, 0, [1 << 40, 1 << 41])  # fmt: skip
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    weights, x, out = torch.rand(1, 2), torch.randn(1, HIDDEN), torch.zeros(1, HIDDEN)
    d, (wait_s, *_) = r.planner.native_step(planner, 0, ids, weights, x, out, False, sync=True,
                                       signal=signal)  # fmt: skip
    assert asked[0] == 3 and wait_s > 0  # returned only after the signal, asking no more
    assert signal[0] == 0  # cleared once seen, for the next piece's router
    assert d.job is not None and sorted(d.on_cpu) == [1, 2]
    d.job.wait()
    assert r.counters.picks[0, [1, 2]].tolist() == [1, 1]
    # a failing stream while the signal is clear: the driver's error, nothing changed
    answers[0] = 999
    before = _state(r)
    with pytest.raises(RuntimeError, match="cuStreamQuery failed with CUDA driver error 999"):
        r.planner.native_step(planner, 0, ids, weights, x, out, False, sync=True, signal=signal)
    assert _state(r) == before


def test_the_job_made_during_the_wait_serves_steps_of_any_size(cpu):
    """The wait makes the step's CPU job before the routing is there, with room for the step's
    routes, and the step only gives it its pairs: steps of 1, 3, 1 and 2 tokens in turn, each
    through a job made in its own wait for its own size, compute their routes right."""
    gen = torch.Generator().manual_seed(12)
    bank = _bank(gen)
    r = _runner(bank, 6, 0.0, cpu, 2)
    planner = r.planner.native()
    query = QUERY_FUNCTION(lambda stream: 0)
    copy = COPY_FUNCTION(lambda dst, src, nbytes, stream: 0)
    planner.set_device(address_of(copy), address_of(query), *(address_of(f) for f in _no_2d()),
                       0, 0, [1 << 40, 1 << 41])  # fmt: skip
    rng = np.random.default_rng(12)
    for step, tokens in enumerate((1, 3, 1, 2)):
        layer = step % LAYERS
        ids = torch.from_numpy(_routes(rng, tokens, 2))
        weights = torch.rand(tokens, 2, generator=gen)
        x = torch.randn(tokens, HIDDEN, generator=gen)
        out = torch.full((tokens, HIDDEN), float("nan"))
        d, _ = r.planner.native_step(planner, layer, ids, weights, x, out, False, sync=True)
        assert d.job is not None and sorted(d.on_cpu) == d.experts  # policy 0.0: all on the CPU
        want = _cpu_part(d.on_cpu, ids.numpy(), weights, x, bank, layer)
        torch.testing.assert_close(d.job.wait(), want, rtol=1e-4, atol=1e-4)


def test_the_wait_works_on_the_last_cpu_job_while_the_workers_are_busy():
    """The planner's wait first runs the CPU job its last step started, on the waiting thread,
    leaving as many tasks as the pool has workers: here the pool's one worker is held by a gate
    queued before it, so only that thread can have taken the step's tasks, all but one when the
    next step returns."""
    with CpuExpertRunner(1, "native") as one:
        r = _runner(_bank(torch.Generator().manual_seed(8)), 6, 0.0, one, 2)
        planner = r.planner.native()
        functions = (COPY_FUNCTION(lambda dst, src, nbytes, stream: 0),
                     QUERY_FUNCTION(lambda stream: 0), *_no_2d())  # fmt: skip
        planner.set_device(*(address_of(f) for f in functions), 0, 0, [1 << 40, 1 << 41])
        gen = torch.Generator().manual_seed(9)
        gate = Gate(one)
        ids = torch.tensor([[1, 2]], dtype=torch.int32)
        weights, x = torch.rand(1, 2, generator=gen), torch.randn(1, HIDDEN, generator=gen)
        out = [torch.zeros(1, HIDDEN) for _ in range(2)]
        first, _ = r.planner.native_step(planner, 0, ids, weights, x, out[0], False, sync=True)
        assert first.job is not None and first.job.unclaimed() > 1  # behind the gate
        second, _ = r.planner.native_step(planner, 1, ids, weights, x, out[1], False, sync=True)
        assert first.job.unclaimed() == 1
        assert second.job is not None and second.job.unclaimed() > 1  # for the next step
        gate.open()
        token = torch.zeros(2, dtype=torch.int32)
        want = cpu_experts_ref(x, r.bank.w13[0], r.bank.w2[0], ids[0], token, weights[0])
        assert torch.allclose(first.job.wait(), want, rtol=1e-5, atol=1e-5)
        second.job.wait()
        assert gate.opened()


@pytest.mark.parametrize(
    ("on_cpu", "top_k", "fraction", "head_first"),
    [(True, 2, 0.5, False), (False, 2, 1.0, False), (True, 3, 0.39, True)],
    ids=["cpu-job", "no-cpu-job", "cpu-longer"],
)
def test_a_step_hands_over_and_launches_the_next_piece(cpu, on_cpu, top_k, fraction, head_first):
    """With its launches set, one step completes the CPU part's handoff (the epoch the next piece
    waits for; a zero part and its epoch where nothing runs on the CPU), marks the padding rows'
    routes, launches the next piece's head, joins the fills (record on the fill stream, the
    compute stream's wait) and launches the piece, in that order, after everything else; where
    the CPU's part is the longer side (one copy, two CPU experts at a copy share of 0.39), the
    head is launched before the fills are queued, the piece still after them."""
    r = _runner(_bank(torch.Generator().manual_seed(11)), 6, fraction, cpu, top_k)
    planner = r.planner.native()
    sync = r.planner.handoff.state
    order: list[tuple] = []

    def copy(dst, src, nbytes, stream) -> int:
        order.append(("copy", stream))
        return 0

    def launch(handle, stream) -> int:  # what the piece would read, as it is launched
        order.append(("launch", handle, stream, int(sync[EXPECTED]), slots.copy()))
        return 0

    functions = (COPY_FUNCTION(copy), QUERY_FUNCTION(lambda stream: 0), *_no_2d())
    planner.set_device(*(address_of(f) for f in functions), 7, 8, [1 << 40, 1 << 41])

    def record(event, stream) -> int:
        order.append(("record", event, stream))
        return 0

    def wait(stream, event, flags) -> int:
        order.append(("wait", stream, event))
        return 0

    launches = (LAUNCH_FUNCTION(launch), LAUNCH_FUNCTION(record), WAIT_EVENT_FUNCTION(wait))
    planner.set_launch(*(address_of(f) for f in launches), 99)
    table = torch.full((3, top_k), 5, dtype=torch.int32)  # a size-3 batch's table, one real row
    slots = table.numpy()
    ids = torch.tensor([[3, 4, 1][:top_k]], dtype=torch.int32)
    weights, x = torch.rand(1, top_k), torch.randn(1, HIDDEN)
    out = torch.full((1, HIDDEN), float("nan"))
    epoch = r.planner.handoff.epoch
    d, seconds = r.planner.native_step(
        planner, 0, ids, weights, x, out, True, sync=True, copies=True, route_slots=table[:1],
        expected=True, launch=(21, 22), pad_rows=2,
    )  # fmt: skip
    assert len(seconds) == 4 and seconds[3] >= 0
    assert r.planner.handoff.epoch == epoch + 1 and sync[EXPECTED] == epoch + 1
    assert (d.job is not None) == on_cpu and d.admitted
    if head_first:
        assert (len(d.admitted), len(d.on_cpu)) == (1, 2)
        head, *copies, record, wait, piece = order
    else:
        *copies, head, record, wait, piece = order
    assert copies and all(c == ("copy", 8) for c in copies)  # the fills, on the fill stream
    assert head[:4] == ("launch", 21, 7, epoch + 1) and piece[:4] == ("launch", 22, 7, epoch + 1)
    assert (record, wait) == (("record", 99, 8), ("wait", 7, 99))
    # the padding rows were marked before the head was launched; the real row is the plan's
    assert (head[4][1:] == -1).all() and (head[4][0] != 5).all()
    if on_cpu:
        torch.testing.assert_close(d.job.wait(), out)
        assert sync[DONE] == epoch + 1
    else:  # its part zero, its epoch done before the launch
        assert sync[DONE] == epoch + 1 and (out == 0).all()
    if not head_first:  # the same routing again: its copied experts are hits now
        # without fills nothing is joined
        order.clear()
        d, _ = r.planner.native_step(planner, 0, ids, weights, x, out, True, sync=True, copies=True,
                              route_slots=table[:1], expected=True, launch=(0, 22))  # fmt: skip
        assert not d.admitted and order[-1][:2] == ("launch", 22)
        assert not any(o[0] in ("record", "wait") for o in order)
    # wrong arguments change nothing and launch nothing
    if d.job is not None:
        d.job.wait()
    order.clear()
    before = _state(r)
    with pytest.raises(ValueError, match="pad_rows"):
        r.planner.native_step(
            planner, 0, ids, weights, x, out, True, sync=True, copies=True,
            route_slots=table[:1], expected=True, launch=(21, 22), pad_rows=-1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs set_launch and the copies"):
        r.planner.native_step(planner, 0, ids, weights, x, out, True, sync=True, launch=(21, 22))
    assert _state(r) == before and not order


def test_a_failed_launch_is_an_error(cpu):
    """A graph launch the driver refuses fails the step with its code."""
    r = _runner(_bank(torch.Generator().manual_seed(12)), 6, 1.0, cpu, 2)
    planner = r.planner.native()
    functions = (COPY_FUNCTION(lambda dst, src, nbytes, stream: 0),
                 QUERY_FUNCTION(lambda stream: 0), *_no_2d())  # fmt: skip
    planner.set_device(*(address_of(f) for f in functions), 0, 0, [1 << 40, 1 << 41])
    launches = (LAUNCH_FUNCTION(lambda handle, stream: 0 if handle == 1 else 400),
                LAUNCH_FUNCTION(lambda event, stream: 0),
                WAIT_EVENT_FUNCTION(lambda stream, event, flags: 0))  # fmt: skip
    planner.set_launch(*(address_of(f) for f in launches), 0)
    ids = torch.tensor([[3, 4]], dtype=torch.int32)
    weights, x, out = torch.rand(1, 2), torch.randn(1, HIDDEN), torch.zeros(1, HIDDEN)
    epoch = r.planner.handoff.epoch
    with pytest.raises(RuntimeError, match="cuGraphLaunch failed with CUDA driver error 400"):
        r.planner.native_step(planner, 0, ids, weights, x, out, True, sync=True, copies=True,
                       expected=True, launch=(1, 2))  # fmt: skip
    # the call had handed its epoch over: the next step's is past it
    assert r.planner.handoff.state[EXPECTED] == epoch + 1 and r.planner.handoff.epoch == epoch + 1


Hint = tuple[list[tuple[int, int]], int]  # Pool.hinted(): the ranges, how many are each worker's


def _hint_of(module, bank: ExpertBank, layer: int, pair_experts: list[int], split, rounds: int,
             threads: int, task_bytes: int) -> tuple[Hint, int]:  # fmt: skip
    """The hint a CPU job of these pairs gives the pool for its first `rounds` rounds of gate/up
    blocks (`ExpertJobShell::own_gate_up`: its ranges and how many are each worker's), and how
    many blocks that is, laid out here from the job's rules: its groups by expert, their rows (a
    split expert's from its first CPU row), TaperedBlocks of them, block b worker b % threads's,
    each block's gate and up rows of at most two groups."""
    experts = sorted(set(pair_experts))
    first = {e: split[2] if split is not None and split[0] == e else 0 for e in experts}
    starts = np.cumsum([0] + [INTER - first[e] for e in experts])
    row = HIDDEN * bank.w13[layer].element_size()
    per_task = max(2, -(-(task_bytes // (2 * row)) // 2) * 2)
    one_each = all(pair_experts.count(e) == 1 for e in experts)
    bounds = module.tapered_blocks(int(starts[-1]), per_task, threads, 1 if one_each else 2)
    per, owned = 4 * rounds, min(rounds * threads, len(bounds) - 1)
    ranges = [(0, 0)] * (per * threads)
    for b in range(owned):
        at = (b % threads) * per + (b // threads) * 4
        for g, e in enumerate(experts):
            lo, hi = max(bounds[b], starts[g]), min(bounds[b + 1], starts[g + 1])
            if lo >= hi or at == (b % threads) * per + (b // threads) * 4 + 4:
                continue
            gate = bank.w13[layer][e].data_ptr() + (first[e] + lo - starts[g]) * row
            ranges[at : at + 2] = [(gate, (hi - lo) * row), (gate + INTER * row, (hi - lo) * row)]
            at += 2
    return (ranges, per), owned


def test_a_guess_before_the_routing_has_the_workers_fetch_the_blocks_the_job_gives_them():
    """A guess of the routing (its logits and signal, set before the routing's) is planned during
    the wait: each worker is told the gate and up rows of its first blocks of the guessed CPU job
    (Pool.hinted), and the real step, where it plans that job, gives the workers those blocks.
    A wrong guess, or none, gives them none. Whatever the guess, the plans and the CPU's results
    are those of a planner given no guesses, bit for bit (two runners in step)."""
    gen = torch.Generator().manual_seed(14)
    bank = _bank(gen)
    rounds = 2
    with CpuExpertRunner(2, "native", task_kb=1) as guessing, CpuExpertRunner(2, "native") as plain:
        runners = [
            _runner(bank, 6, 0.39, cpu, 4, split_misses=True, prefetch_rounds=rounds)
            for cpu in (guessing, plain)
        ]
        late = LateRouting(late_s=0.0)  # these planners keep their own clock: no lead is used
        functions = list(host_functions())
        functions[1] = late.query  # busy until the routing comes
        planners = []
        for r in runners:
            planner = r.planner.native()
            planner.set_device(*(address_of(f) for f in functions), 0, 0,
                               _slots(r.cache))  # fmt: skip
            planners.append(planner)
        signal, guess_signal = routing_signal(pin=False), routing_signal(pin=False)
        logits = torch.zeros(1, EXPERTS)
        rng = np.random.default_rng(14)
        owned_steps = wrong_steps = 0
        for step in range(18):
            layer = step % LAYERS
            ids = torch.from_numpy(_routes(rng, 1, 4))
            weights, x = torch.rand(1, 4, generator=gen), torch.randn(1, HIDDEN, generator=gen)
            kind = ("right", "wrong", "none")[step % 3]
            # a wrong guess names none of the routed experts: its CPU job cannot be the real one
            others = np.setdiff1d(np.arange(EXPERTS), ids[0].numpy())[:4]
            named = ids[0] if kind == "right" else torch.from_numpy(others)
            logits.copy_(torch.randn(1, EXPERTS, generator=gen) - 10)
            logits[0, named.long()] = torch.arange(4, 0, -1, dtype=torch.float32)
            outs = [torch.zeros(1, HIDDEN) for _ in runners]
            steps = []
            for r, planner, out, guess in zip(runners, planners, outs, (True, False), strict=True):
                guess_signal[0] = ROUTED if guess and kind != "none" else 0
                late.arm(signal)  # the guess first, then the routing, during the wait
                d, _ = r.planner.native_step(
                    planner, layer, ids, weights, x, out, False, sync=True, copies=True,
                    signal=signal, guess=(logits, guess_signal) if guess else None,
                )  # fmt: skip
                assert signal[0] == 0 and guess_signal[0] == 0  # both cleared
                steps.append(d)
            d, same = steps
            assert (d.experts, d.admitted, d.on_cpu, d.split) == (
                same.experts,
                same.admitted,
                same.on_cpu,
                same.split,
            )
            assert _state(runners[0]) == _state(runners[1])
            assert not same.guessed and same.owned_blocks == 0
            if d.job is None:
                continue
            assert torch.equal(d.job.wait(), same.job.wait())  # bit for bit
            pairs = [e for e in ids[0].tolist() if e in d.on_cpu]
            hint, owned = _hint_of(guessing._module, bank, layer, pairs, d.split, rounds, 2, 1024)
            if kind == "right":  # told its blocks, and given them
                assert d.guessed and d.owned_blocks == owned > 0
                assert guessing._pool.hinted() == hint
                owned_steps += 1
            else:  # a wrong guess told the workers of other blocks (where it had CPU work)
                assert d.owned_blocks == 0 and not (kind == "none" and d.guessed)
                wrong_steps += d.guessed
        assert owned_steps >= 3 and wrong_steps >= 3
        assert late.arrivals == 2 * 18  # every routing came during its wait


def _bits(t: torch.Tensor) -> torch.Tensor:
    """FP8 values as their bytes (compared and tested for zero as such); others as they are."""
    return t.cpu().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.cpu()


WHOLE = "whole"  # `_slot_holds`: a tensor a slot holds whole, a split or not


def _slot_holds(cache, bank, layer: int, expert: int, slot: int, rows: int,
                zeroed: bool = False) -> bool:  # fmt: skip
    """Whether `slot` holds the expert's first `rows` gate and up rows and the same columns of
    its down projection (all of it where rows is I) in each of its tensors (an FP8 expert's
    factors: their blocks of those rows; an MXFP4 one's down blocks and scales: their groups of
    32 columns; an NVFP4 one's down values, two columns a byte, and scales, a group of 16
    columns each), and with `zeroed` zeros in its other gate and up rows. NVFP4's per-tensor
    scales are whole. gpt-oss's gate and up biases go with their rows, and its down bias is
    whole, or with `zeroed` (a split miss's: the CPU's part adds it) zero."""
    slots, tensors = cache.tensors(), bank.layer_tensors(layer)
    # per tensor: whether its rows are gate and up rows (None: the down bias; WHOLE: a
    # per-tensor scale), and the rows of gate and up (columns of the down projection) one of its
    # entries covers
    values, scales = {"mxfp4": (mxfp4.BLOCK,) * 2, "nvfp4": (2, nvfp4.BLOCK)}.get(bank.fmt, (1, 1))
    kinds = [(True, 1), (False, values)]
    if bank.w13_scale:
        kinds += [(True, fp8.BLOCK), (False, fp8.BLOCK)] if bank.fmt == "fp8" else [
            (True, 1), (False, scales)
        ]  # fmt: skip
    if bank.w13_scale_2:
        kinds += [(WHOLE, 1), (WHOLE, 1)]
    if bank.w13_bias:
        kinds += [(True, 1), (None, 1)]
    for dst, src, (rows_of_gate_up, block) in zip(slots, tensors, kinds, strict=True):
        n, got, want = rows // block, _bits(dst[slot]), _bits(src[expert])
        if rows_of_gate_up is WHOLE:
            if not torch.equal(got, want):
                return False
            continue
        if rows_of_gate_up is None:
            if not torch.equal(got, torch.zeros_like(got) if zeroed else want):
                return False
            continue
        if not rows_of_gate_up:
            if not torch.equal(got[:, :n], want[:, :n]):
                return False
            continue
        half = got.shape[0] // 2
        for first in (0, half):  # gate's rows, then up's
            if not torch.equal(got[first : first + n], want[first : first + n]):
                return False
            if zeroed and got[first + n : first + half].any():
                return False
    return True


@pytest.mark.parametrize(
    ("fmt", "rounds"),
    [("bf16", 0), ("bf16", 2), ("fp8", 0), ("fp8", 2), ("mxfp4", 0), ("mxfp4-bias", 2),
     ("nvfp4", 0)],
)  # fmt: skip
def test_a_guess_copies_its_first_device_miss_ahead_of_the_routing(cpu, fmt, rounds):
    """With copies ahead (`set_copy_ahead`), a guess of the routing that comes before it starts
    copying the first rows of the guessed step's first device miss into a slot (the least
    recently used one no guessed expert holds, its expert evicted), as many as the copies move
    in that share of the guesses' usual lead. The step takes that expert on the device, whole or
    split at no fewer rows, copies only the rest, and divides the misses as
    `MissPolicy.fetch_plan` with that lead; its output is the layer's. A wrong guess's copy
    serves nothing and its slot stays free; the first guess copies nothing (no lead measured).
    An FP8 expert's copy ahead takes whole blocks of rows (its factors with them), fewer rows
    where the lead moves a part of one more; an MXFP4 one's whole groups of 32 rows (their
    scales with them), an NVFP4 one's whole groups of 16 (its per-tensor scales copied with the
    rest), gpt-oss's their gate and up biases too."""
    gen = torch.Generator().manual_seed(21)
    bank = _bank(gen, fmt)
    hidden, inter = bank.hidden_size, bank.intermediate_size
    block, chunks = bank.block_rows, split_chunks(inter, bank.block_rows)
    r = _runner(bank, 6, 0.39, cpu, 4, split_misses=True, prefetch_rounds=rounds,
                copy_ahead=1.0, copy_rate=1.0)  # fmt: skip
    planner = r.planner.native()
    # the routing comes once a step: 3 ms after the guess, or (`on_copy`) as the guess's copy
    # ahead is queued, in the middle of its planning, which the step then reports
    late = LateRouting(late_s=0.003)
    late.set_clock_of(planner)
    on_copy = [False]
    functions = list(host_functions())
    functions[1] = late.query
    copy2d = functions[3]

    def copy2d_routing(address: int, stream: int) -> int:
        if on_copy[0]:
            late.come(after_s=0.0)
        return copy2d(address, stream)

    functions[3] = COPY2D_FUNCTION(copy2d_routing)
    signal, guess_signal = routing_signal(pin=False), routing_signal(pin=False)
    cache = r.cache
    planner.set_device(*(address_of(f) for f in functions), 0, 0, _slots(cache))
    logits = torch.zeros(1, EXPERTS)
    rng = np.random.default_rng(21)
    # a copy ahead moves a row's gate and up (and their share of the factors; NVFP4's
    # per-tensor scales are no rows')
    whole = bank.w13_scale_2[0][0].nbytes if bank.w13_scale_2 else 0
    row_bytes = (sum(t[0].nbytes for t in bank.layer_tensors(0)[::2]) - whole) / inter
    seen = {"whole": 0, "split": 0, "wrong": 0, "all_rows": 0, "late": 0}
    for step in range(30):
        layer = step % LAYERS
        ids = torch.from_numpy(_routes(rng, 1, 4))
        weights, x = torch.rand(1, 4, generator=gen), torch.randn(1, hidden, generator=gen)
        right = step % 4 != 3
        others = np.setdiff1d(np.arange(EXPERTS), ids[0].numpy())[:4]
        named = ids[0] if right else torch.from_numpy(others)
        logits.copy_(torch.randn(1, EXPERTS, generator=gen) - 10)
        logits[0, named.long()] = torch.arange(4, 0, -1, dtype=torch.float32)
        # the rate at which the lead measured so far copies `want` rows (half a row more: floor)
        lead = planner.guess_lead_seconds()
        want = {
            "bf16": (3, 8, 13, inter, 5),
            "fp8": (128, 200, 256, inter, 300),
            "mxfp4": (32, 50, 64, inter, 70),
            "nvfp4": (16, 25, 32, inter, 35),
        }[bank.fmt][step % 5]
        rows = want // block * block  # all of its rows too; FP8: whole blocks
        rate = (want + 0.5) * row_bytes / lead if lead else 1.0
        planner.set_copy_ahead(1.0, rate)
        slot_of_before = cache.slot_of[layer].copy()
        missing = [e for e in np.unique(ids) if slot_of_before[e] < 0]
        guess_signal[0] = ROUTED
        late.arm(signal)
        on_copy[0] = step % 3 == 2
        out = torch.zeros(1, hidden)
        d, _ = r.planner.native_step(
            planner, layer, ids, weights, x, out, True, sync=True, copies=True,
            signal=signal, guess=(logits, guess_signal),
        )  # fmt: skip
        assert signal[0] == 0 and guess_signal[0] == 0
        # the guess came first and was planned (one reading of the wait's clock); the routing
        # came during that planning where it came with the copy ahead
        copied = d.ahead_rows > 0 or d.ahead_missed
        assert d.guess_s == pytest.approx(TICK_S)
        assert d.guess_late == (on_copy[0] and copied)
        if not d.guess_late:  # the lead is the routing's 3 ms by the wait's clock
            assert planner.guess_lead_seconds() == pytest.approx(
                lead + (0.003 + 2 * TICK_S - lead) / 16 if lead else 0.003 + 2 * TICK_S
            )
        seen["late"] += d.guess_late
        # the device's part and the CPU's are the layer's output, whatever was copied ahead
        _assert_marked(d, ids.numpy(), cache.slot_of[layer])
        device_part = _device_part(d, x, weights, cache)
        cpu_part = d.job.wait() if d.job is not None else torch.zeros(1, hidden)
        want_out = _layer_ref(x, ids, weights, bank, layer)
        torch.testing.assert_close(device_part + cpu_part, want_out, rtol=1e-4, atol=1e-4)
        if not lead:  # the first guess: no lead measured, nothing copied ahead
            assert d.ahead_rows == 0 and not d.ahead_missed
            continue
        if not right:  # a copy ahead of an expert the step did not miss (where it had one)
            assert d.ahead_rows == 0
            seen["wrong"] += d.ahead_missed
            continue
        if not missing:
            assert d.ahead_rows == 0 and not d.ahead_missed
            continue
        assert d.ahead_rows == rows and not d.ahead_missed
        seen["all_rows"] += rows == inter
        q, j = MissPolicy("split", 0.39).lead_plan(len(missing), chunks, rows / inter)
        assert len(d.admitted) == q and (d.split[2] if d.split else 0) == j * inter // chunks
        if q:  # the expert copied ahead is the first admitted, whole now
            expert, slot = d.admitted[0]
            assert _slot_holds(cache, bank, layer, expert, slot, inter)
            assert cache.slot_of[layer, expert] == slot
            seen["whole"] += 1
        else:  # split at no fewer rows than were copied ahead
            expert, slot, row = d.split
            assert row >= rows and _slot_holds(cache, bank, layer, expert, slot, row, zeroed=True)
            seen["split"] += 1
        assert expert in missing
    assert all(seen.values()), seen


@pytest.mark.parametrize("cached_map", [False, True], ids=["heads-after-plan", "early-heads"])
def test_with_early_heads_a_copy_ahead_takes_no_slot_of_its_own_layer(cpu, cached_map):
    """With the cached routes run at the routing (`set_cached_map`, --moe-early-cached) a layer's
    head may be reading the slot of any of its cached experts while the host waits, so a guess's
    copy ahead takes no slot of its own layer: once the cache holds only that layer's experts, no
    copy ahead comes; without the map one does (the least recently used slot)."""
    gen = torch.Generator().manual_seed(23)
    bank = _bank(gen)
    r = _runner(bank, 6, 0.39, cpu, 4, split_misses=True)
    planner = r.planner.native()
    planner.set_copy_ahead(1.0, 1e12)  # a copy ahead takes all of an expert's rows
    if cached_map:
        layer_map = torch.full(r.cache.slot_of.shape, -1, dtype=torch.int32)
        planner.set_cached_map(layer_map.data_ptr())
    late = LateRouting(late_s=0.003)
    late.set_clock_of(planner)
    functions = list(host_functions())
    functions[1] = late.query
    planner.set_device(*(address_of(f) for f in functions), 0, 0, _slots(r.cache))
    signal, guess_signal = routing_signal(pin=False), routing_signal(pin=False)
    logits = torch.zeros(1, EXPERTS)
    rng = np.random.default_rng(23)
    copied_when_full = full_steps = 0
    for _ in range(24):  # every step on layer 0: its experts fill the cache
        ids = torch.from_numpy(_routes(rng, 1, 4))
        weights, x = torch.rand(1, 4, generator=gen), torch.randn(1, HIDDEN, generator=gen)
        logits.copy_(torch.randn(1, EXPERTS, generator=gen) - 10)
        logits[0, ids[0].long()] = torch.arange(4, 0, -1, dtype=torch.float32)
        full = bool((r.cache.key_of_slot >= 0).all())
        assert (r.cache.key_of_slot < EXPERTS).all()  # layer 0's keys only
        guess_signal[0] = ROUTED
        late.arm(signal)
        d, _ = r.planner.native_step(
            planner, 0, ids, weights, x, torch.zeros(1, HIDDEN), True, sync=True, copies=True,
            signal=signal, guess=(logits, guess_signal),
        )  # fmt: skip
        if d.job is not None:
            d.job.wait()
        copied_when_full += full and (d.ahead_rows > 0 or d.ahead_missed)
        full_steps += full
    assert full_steps >= 5
    assert (copied_when_full == 0) if cached_map else (copied_when_full > 0)
