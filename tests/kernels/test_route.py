"""The decode router in one launch (`route`) against its torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelab.kernels import host_handoff, route, router

from .kernel_inputs import DEVICE, assert_top_k, randn
from .test_router import assert_in_range

pytestmark = pytest.mark.usefixtures("triton_runs")

CUDA = DEVICE.type == "cuda"
ROUTERS = ["route_triton", "route_ref"]


def grid_inputs(
    gen: torch.Generator, tokens: int, experts: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] and router_w [E, H] of random multiples of 1/16 and 1/32 (|x| <= 1, |w| <= 1/2),
    exact in bf16: their products add up exactly in fp32 in any order, so the kernel's logits are
    the reference's bit for bit and only real routing differences fail a test."""
    x = torch.randint(-16, 17, (tokens, hidden), generator=gen) / 16
    w = torch.randint(-16, 17, (experts, hidden), generator=gen) / 32
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype)


def route_logits(x: torch.Tensor, router_w: torch.Tensor) -> torch.Tensor:
    """The logits HF's router computes: the linear in the model's dtype."""
    return F.linear(x.float(), router_w.float()).to(x.dtype)


def host_buffers(tokens: int, k: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """ids_h, weights_h and x_h in host memory (pinned when the kernels run on a GPU), filled with
    values the router never stores."""
    buffers = (
        torch.full((tokens, k), -7, dtype=torch.int32),
        torch.full((tokens, k), float("nan")),
        torch.full((tokens, hidden), float("nan")),
    )
    return tuple(b.pin_memory() for b in buffers) if CUDA else buffers


def finished() -> None:
    """Wait for what the kernels queued before the host reads its buffers."""
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "experts", "hidden", "k", "renormalize"),
    [
        (1, 128, 2048, 8, True),  # Qwen3-30B-A3B, one token: 64 programs in bf16
        (5, 128, 256, 8, True),  # Qwen3's experts, a decode batch
        (3, 60, 200, 4, False),  # Qwen2-MoE: not renormalized, odd experts, a partial H-step
        (8, 8, 256, 2, True),  # Mixtral: one program
        (16, 64, 128, 8, False),  # OLMoE's experts, the most tokens route takes
    ],
)
def test_route_matches_reference(gen, tokens, experts, hidden, k, renormalize, dtype):
    x, router_w = grid_inputs(gen, tokens, experts, hidden, dtype)
    weights, ids = route.route_triton(x, router_w, k, renormalize)
    logits = route_logits(x, router_w)
    assert_top_k(weights, ids, logits, k, renormalize)
    ref_weights, ref_ids = route.route_ref(x, router_w, k, renormalize)
    assert_top_k(ref_weights, ref_ids, logits, k, renormalize)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)


def test_route_rounds_the_logits_to_the_model_dtype():
    # fp32 logits 1 + n * 2^-9 for n = 0, 2, 6, 5, 7, where bf16 steps by 2^-7 (n = 4): to the
    # nearest, ties to even, they are 1, 1, 1 + 2^-6, 1 + 2^-7, 1 + 2^-6. Unrounded logits would
    # order the experts 4, 2, 3, 1, 0; truncated ones 2, 3, 4, 0, 1; ties rounded up 2, 4, 1, 3, 0.
    steps = torch.tensor([0.0, 2.0, 6.0, 5.0, 7.0]) * 2**-9
    x = torch.ones(1, 2, device=DEVICE, dtype=torch.bfloat16)
    router_w = torch.stack([torch.ones(5), steps], dim=1).to(DEVICE, torch.bfloat16)
    rounded = [1.0, 1.0, 1 + 2**-6, 1 + 2**-7, 1 + 2**-6]
    assert route_logits(x, router_w).float().tolist() == [rounded]
    for fn in ROUTERS:
        (ids,) = getattr(route, fn)(x, router_w, 5, False)[1].tolist()
        assert ids[:3] == [2, 4, 3], fn
        # experts 0 and 1 tie: the kernel takes the lower first; torch.topk does on the CPU only
        assert ids[3:] == [0, 1] or (fn == "route_ref" and CUDA and ids[3:] == [1, 0])


# the interpreter's numpy warns of the NaN the test feeds on purpose
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("experts", [12, 16], ids=["padded", "power-of-two"])
def test_route_of_nan_hidden_states_picks_real_experts(gen, experts):
    """x with a NaN, x all -inf (their logits NaN, -inf - -inf NaN too): every pick names an
    expert 0..E-1 (NaN ranks first, the lower id first), also in the host's copy; a finite row
    routes as before."""
    x, router_w = grid_inputs(gen, 3, experts, 32, torch.float32)
    x[0, 3] = float("nan")
    x[1] = -float("inf")
    host = host_buffers(3, 4, 32)
    weights, ids = route.route_triton(x, router_w, 4, True, host=host)
    finished()
    assert_in_range(ids, experts)
    assert ids[:2].tolist() == [[0, 1, 2, 3]] * 2 and weights[:2].isnan().all()
    assert torch.equal(host[0], ids.cpu())
    assert_top_k(weights[2:], ids[2:], route_logits(x[2:], router_w), 4, True)


def test_route_ties_go_to_the_lower_expert_id():
    x = torch.ones(1, 1, device=DEVICE)
    router_w = torch.tensor([[1.0], [3.0], [3.0], [0.0], [3.0]], device=DEVICE)
    weights, ids = route.route_triton(x, router_w, 2, True)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]], device=DEVICE))


@pytest.mark.parametrize("fn", ROUTERS)
@pytest.mark.parametrize("signalled", [False, True], ids=["plain", "signalled"])
def test_route_stores_the_routing_into_host_buffers(gen, fn, signalled):
    x, router_w = grid_inputs(gen, 3, 128, 256, torch.bfloat16)
    x = x + randn(gen, 3, 256, scale=1e-3, dtype=torch.bfloat16)  # x_h: not only the grid's values
    ids_h, weights_h, x_h = host_buffers(3, 8, 256)
    signal = host_handoff.routing_signal(pin=CUDA)
    weights, ids = getattr(route, fn)(
        x, router_w, 8, True, host=(ids_h, weights_h, x_h), signal=signal if signalled else None
    )
    finished()
    assert_top_k(weights, ids, route_logits(x, router_w), 8, True)
    assert torch.equal(ids_h, ids.cpu())
    assert torch.equal(weights_h, weights.cpu())
    assert torch.equal(x_h, x.float().cpu())
    # the signal is set, its one element only (the rest of its line untouched)
    assert signal.tolist() == ([host_handoff.ROUTED] if signalled else [0]) + [0] * 15


def test_route_refuses_a_signal_it_cannot_set(gen):
    x, router_w = randn(gen, 2, 64), randn(gen, 16, 64)
    host = host_buffers(2, 4, 64)
    for fn in ROUTERS:
        signal = host_handoff.routing_signal(pin=False)
        with pytest.raises(ValueError, match="a routing signal needs the host buffers"):
            getattr(route, fn)(x, router_w, 4, True, signal=signal)
        with pytest.raises(ValueError, match=r"a routing_signal\(\) tensor, got torch.int64"):
            getattr(route, fn)(x, router_w, 4, True, host=host, signal=signal.long())
        assert signal[0] == 0


@pytest.mark.parametrize("fn", ROUTERS)
def test_route_writes_ids_into_a_strided_record(gen, fn):
    record = torch.full((6, 3, 8), -7, dtype=torch.int32, device=DEVICE)
    x, router_w = grid_inputs(gen, 4, 64, 128, torch.bfloat16)
    weights, ids = getattr(route, fn)(x, router_w, 8, True, ids_out=record[:4, 1])
    assert ids.data_ptr() == record[:4, 1].data_ptr()
    assert_top_k(weights, record[:4, 1], route_logits(x, router_w), 8, True)
    untouched = torch.ones_like(record, dtype=torch.bool)
    untouched[:4, 1] = False
    assert (record[untouched] == -7).all()


def test_route_launches_in_a_row_each_route_their_own_inputs(gen):
    # the last program zeroes the programs' counter: a launch that started from the previous
    # one's count would find no last program (or the wrong one) and leave its outputs unwritten
    for tokens, experts, hidden in ((2, 128, 256), (5, 60, 128), (1, 128, 256)):
        x, router_w = grid_inputs(gen, tokens, experts, hidden, torch.bfloat16)
        weights, ids = route.route_triton(x, router_w, 4, False)
        assert_top_k(weights, ids, route_logits(x, router_w), 4, False)
        assert route._route_counter(x.device).item() == 0
    again = route.route_triton(x, router_w, 4, False)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_route_replays_in_a_cuda_graph(gen):
    x, router_w = grid_inputs(gen, 4, 128, 2048, torch.bfloat16)
    ids_h, weights_h, x_h = host_buffers(4, 8, 2048)
    route.route_triton(x, router_w, 8, True)  # the counter, made before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route.route_triton(x, router_w, 8, True, host=(ids_h, weights_h, x_h))
    for _ in range(3):
        x.copy_(grid_inputs(gen, 4, 128, 2048, torch.bfloat16)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert_top_k(weights, ids, route_logits(x, router_w), 8, True)
        assert torch.equal(ids_h, ids.cpu()) and torch.equal(weights_h, weights.cpu())
        assert torch.equal(x_h, x.float().cpu())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8], ids=["route", "logits-then-copy"])
def test_a_host_that_sees_the_signal_sees_the_routing(gen, tokens):
    """As offloaded decode's wait reads them: the host polls the signal of a replayed graph, with
    no sync, then reads the routing at once; it must be whole, every time. One token: the router's
    last program signals; eight: the logits, top-k and copy, then `signal_routing`'s kernel."""
    hidden, experts, k = 2048, 128, 8
    x, router_w = grid_inputs(gen, tokens, experts, hidden, torch.bfloat16)
    host = host_buffers(tokens, k, hidden)
    signal = host_handoff.routing_signal(pin=True)

    def routing() -> tuple[torch.Tensor, torch.Tensor]:
        if tokens == 1:
            return route.route_triton(x, router_w, k, True, host=host, signal=signal)
        weights, ids = router.topk_softmax(route_logits(x, router_w), k, True)
        host_handoff.routing_to_host(ids, weights, x, *host)
        host_handoff.signal_routing(signal, x.device)
        return weights, ids

    routing()  # the counter and the kernels, made before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = routing()
    for _ in range(50):
        x.copy_(grid_inputs(gen, tokens, experts, hidden, torch.bfloat16)[0])
        for b in host:
            b.fill_(-7)  # never a routing's value
        signal[0] = 0
        torch.cuda.synchronize()
        graph.replay()
        while signal[0] == 0:
            pass
        seen = [b.clone() for b in host]  # what the host reads on the signal, with no sync
        torch.cuda.synchronize()
        assert torch.equal(seen[0], ids.int().cpu()) and torch.equal(seen[1], weights.cpu())
        assert torch.equal(seen[2], x.float().cpu())
        assert_top_k(weights, ids, route_logits(x, router_w), k, True)
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    ("shape_x", "shape_w", "k", "dtype_w", "message"),
    [
        ((2, 64), (16, 32), 4, torch.float32, "router_w \\[num_experts, H\\]: got \\(2, 64\\)"),
        ((17, 64), (16, 64), 4, torch.float32, "x has 17 tokens: route takes 1 to 16"),
        ((2, 64), (16, 64), 17, torch.float32, "k must be between 1 and the number of experts"),
        ((2, 64), (16, 64), 4, torch.bfloat16, "x and router_w must share one dtype"),
    ],
)
def test_route_refuses_inputs_it_cannot_route(gen, shape_x, shape_w, k, dtype_w, message):
    x = randn(gen, *shape_x)
    router_w = randn(gen, *shape_w, dtype=dtype_w)
    for fn in ROUTERS:
        with pytest.raises(ValueError, match=message):
            getattr(route, fn)(x, router_w, k, True)


@pytest.mark.parametrize(
    ("index", "bad", "message"),
    [
        (0, torch.zeros(2, 4), "ids_h must be contiguous torch.int32 .*, got torch.float32"),
        (2, torch.zeros(2, 32), "x_h must be .* \\[2, 64\\], got torch.float32 \\[2, 32\\]"),
        (1, torch.zeros(4, 2).t(), "weights_h .*\\(not contiguous\\)"),
    ],
)
def test_route_refuses_host_buffers_it_cannot_fill(gen, index, bad, message):
    x, router_w = randn(gen, 2, 64), randn(gen, 16, 64)
    host = list(host_buffers(2, 4, 64))
    host[index] = bad
    for fn in ROUTERS:
        with pytest.raises(ValueError, match=message):
            getattr(route, fn)(x, router_w, 4, True, host=tuple(host))


def test_route_sends_cpu_tensors_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(route, "route_triton", refuse)
    x = torch.randn(3, 32, generator=gen)
    router_w = torch.randn(16, 32, generator=gen)
    out = route.route(x, router_w, 4, True)
    ref = route.route_ref(x, router_w, 4, True)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
