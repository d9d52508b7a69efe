"""The routing guess sent to the host (`guess_to_host`) against its torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelab.kernels import host_handoff, route_guess

from .kernel_inputs import DEVICE, randn

pytestmark = pytest.mark.usefixtures("triton_runs")

CUDA = DEVICE.type == "cuda"
GUESSERS = ["guess_to_host_triton", "guess_to_host_ref"]


def logits_buffer(tokens: int, experts: int) -> torch.Tensor:
    """The host's logits buffer (pinned on a GPU), full of NaN: no guess stores that."""
    buffer = torch.full((tokens, experts), float("nan"))
    return buffer.pin_memory() if CUDA else buffer


def finished() -> None:
    if CUDA:
        torch.cuda.synchronize()


def exact(x: torch.Tensor, scale: torch.Tensor, router_w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double().cpu() * scale.double().cpu(), router_w.double().cpu())


@pytest.mark.parametrize("fn", GUESSERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "experts", "hidden"),
    [(1, 128, 2048), (3, 60, 200), (16, 8, 128)],  # Qwen3-30B-A3B; odd sizes; the most tokens
)
def test_the_guess_is_the_rescaled_input_through_the_router(
    gen, fn, dtype, tokens, experts, hidden
):
    x = randn(gen, tokens, hidden, dtype=dtype)
    router_w = randn(gen, experts, hidden, scale=hidden**-0.5, dtype=dtype)
    scale = torch.rand(hidden, generator=gen).to(DEVICE) + 0.5
    logits_h = logits_buffer(tokens, experts)
    signal = host_handoff.routing_signal(pin=CUDA)
    getattr(route_guess, fn)(x, scale, router_w, logits_h, signal)
    finished()
    want = exact(x, scale, router_w)
    assert not logits_h.isnan().any()
    assert (logits_h.double() - want).norm() / want.norm() < 1e-5
    # the signal is set, its one element only
    assert signal.tolist() == [host_handoff.ROUTED] + [0] * 15


@pytest.mark.parametrize("fn", GUESSERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_router_bias_is_added_to_the_guess(gen, fn, dtype):
    """gpt-oss's routers carry a bias, which decides picks as much as the weights do: a guess
    without it names other experts."""
    tokens, experts, hidden = 2, 32, 96
    x = randn(gen, tokens, hidden, dtype=dtype)
    router_w = randn(gen, experts, hidden, scale=hidden**-0.5, dtype=dtype)
    router_b = randn(gen, experts, scale=2.0, dtype=dtype)
    scale = torch.rand(hidden, generator=gen).to(DEVICE) + 0.5
    logits_h = logits_buffer(tokens, experts)
    signal = host_handoff.routing_signal(pin=CUDA)
    getattr(route_guess, fn)(x, scale, router_w, logits_h, signal, router_b)
    finished()
    want = exact(x, scale, router_w) + router_b.double().cpu()
    assert (logits_h.double() - want).norm() / want.norm() < 1e-5
    assert signal.tolist() == [host_handoff.ROUTED] + [0] * 15


def test_a_router_bias_of_another_length_is_refused(gen):
    x = randn(gen, 1, 64)
    router_w = randn(gen, 8, 64)
    with pytest.raises(ValueError, match=r"router_b must be contiguous \[8\]"):
        route_guess.guess_to_host_ref(
            x, torch.ones(64, device=DEVICE), router_w, logits_buffer(1, 8),
            host_handoff.routing_signal(pin=CUDA), randn(gen, 7),
        )  # fmt: skip


def test_the_guess_scale_rescales_one_norm_into_the_other():
    input_norm = torch.tensor([1.0, 2.0, 0.0, -0.5])
    post_norm = torch.tensor([3.0, 1.0, 4.0, 1.0])
    assert route_guess.guess_scale(input_norm, post_norm).tolist() == [3.0, 0.5, 0.0, -2.0]
    # rmsnorm(r) * input_norm * scale is rmsnorm(r) * post_norm where input_norm is not zero
    r = torch.randn(4)
    normed = r * torch.rsqrt(r.pow(2).mean())
    rescaled = normed * input_norm * route_guess.guess_scale(input_norm, post_norm)
    assert torch.allclose(rescaled[[0, 1, 3]], (normed * post_norm)[[0, 1, 3]])


def test_launches_in_a_row_each_guess_their_own_inputs(gen):
    # the last program zeroes the counter: a launch that started from the previous one's count
    # would find no last program and leave the signal clear
    for tokens, experts, hidden in ((1, 128, 256), (4, 60, 128), (1, 128, 256)):
        x, router_w = randn(gen, tokens, hidden), randn(gen, experts, hidden)
        scale = torch.ones(hidden, device=DEVICE)
        logits_h = logits_buffer(tokens, experts)
        signal = host_handoff.routing_signal(pin=CUDA)
        route_guess.guess_to_host_triton(x, scale, router_w, logits_h, signal)
        finished()
        want = exact(x, scale, router_w)
        assert (logits_h.double() - want).norm() / want.norm() < 1e-5
        assert signal[0] == host_handoff.ROUTED
        assert route_guess._guess_counter(x.device).item() == 0


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_host_that_sees_the_guess_signal_sees_the_logits(gen):
    """As the planner's wait reads them: polled with no sync on a replayed graph, whole every
    time."""
    x, router_w = randn(gen, 1, 2048, dtype=torch.bfloat16), randn(gen, 128, 2048, scale=0.02)
    router_w = router_w.bfloat16()
    scale = torch.rand(2048, generator=gen).to(DEVICE)
    logits_h = logits_buffer(1, 128)
    signal = host_handoff.routing_signal(pin=True)
    route_guess.guess_to_host_triton(x, scale, router_w, logits_h, signal)  # the counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route_guess.guess_to_host_triton(x, scale, router_w, logits_h, signal)
    for _ in range(50):
        x.copy_(randn(gen, 1, 2048, dtype=torch.bfloat16))
        logits_h.fill_(float("nan"))
        signal[0] = 0
        torch.cuda.synchronize()
        graph.replay()
        while signal[0] == 0:
            pass
        seen = logits_h.clone()
        want = exact(x, scale, router_w)
        assert (seen.double() - want).norm() / want.norm() < 1e-5
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": (17, 64)}, "x has 17 tokens: a guess takes 1 to 16"),
        ({"router_w": (16, 32)}, r"router_w \[num_experts, H\]"),
        ({"scale": (32,)}, r"scale must be contiguous fp32 \[64\]"),
        ({"logits_h": (2, 8)}, r"logits_h must be contiguous fp32 \[2, 16\]"),
    ],
)
def test_the_guess_refuses_inputs_it_cannot_take(gen, change, message):
    shapes = {"x": (2, 64), "router_w": (16, 64), "scale": (64,), "logits_h": (2, 16)} | change
    x, router_w = randn(gen, *shapes["x"]), randn(gen, *shapes["router_w"])
    scale = torch.ones(shapes["scale"], device=DEVICE)
    logits_h = logits_buffer(*shapes["logits_h"])
    signal = host_handoff.routing_signal(pin=CUDA)
    for fn in GUESSERS:
        with pytest.raises(ValueError, match=message):
            getattr(route_guess, fn)(x, scale, router_w, logits_h, signal)
    assert signal[0] == 0
