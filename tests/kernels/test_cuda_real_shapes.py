"""The Triton kernels at Qwen3-30B-A3B shapes in bf16 on a GPU, against fp32 torch references.

Run on a CUDA machine: pytest tests/kernels/test_cuda_real_shapes.py
"""

from __future__ import annotations

import time

import pytest
import torch

from moelab.kernels import (
    fp8,
    fused_moe,
    grouped_moe,
    host_handoff,
    paged_attention,
    rmsnorm,
    router,
)
from moelab.kernels.cpu_experts import CpuExpertRunner, cpu_experts_ref
from moelab.kernels.host_handoff import DONE, EXPECTED, TIMED_OUT

from .kernel_inputs import assert_matches, assert_top_k

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 128, 16
BF16 = torch.bfloat16


def cuda_randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to("cuda", BF16)


def expert_weights(gen: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = cuda_randn(gen, count, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
    w2 = cuda_randn(gen, count, HIDDEN, INTER, scale=INTER**-0.5)
    return w13, w2


def routes(gen: torch.Generator, tokens: int, choices: int, masked: float) -> torch.Tensor:
    picks = torch.stack([torch.randperm(choices, generator=gen)[:TOP_K] for _ in range(tokens)])
    drop = torch.rand(tokens, TOP_K, generator=gen) < masked
    return torch.where(drop, -1, picks).to("cuda", torch.int32)


def as_fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() if t.is_floating_point() else t for t in tensors]


@pytest.mark.parametrize(("tokens", "slots"), [(1, 64), (4, 64), (16, 64), (16, 12)])
def test_fused_moe_decode(gen, tokens, slots):
    x = cuda_randn(gen, tokens, HIDDEN)
    slot_ids = routes(gen, tokens, slots, masked=0.25)
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda()
    w13, w2 = expert_weights(gen, slots)
    out = fused_moe.fused_moe_decode(x, slot_ids, weights, w13, w2)
    ref = fused_moe.fused_moe_decode_ref(*as_fp32(x, slot_ids, weights, w13, w2))
    assert_matches(out, ref, tol=2e-2)


@pytest.mark.parametrize("masked", [0.25, 0.8])
@pytest.mark.parametrize("few_routes", [False, True])
def test_fused_moe_decode_one_token_parts(gen, few_routes, masked):
    """The engine's resident step: one token, the routes' outputs unsummed; few_routes: the
    launch after a layer step's fills, one or two routes live mostly (masked=0.8)."""
    x = cuda_randn(gen, 1, HIDDEN)
    slot_ids = routes(gen, 1, 64, masked=masked)
    weights = torch.rand(1, TOP_K, generator=gen).cuda()
    w13, w2 = expert_weights(gen, 64)
    parts = fused_moe.fused_moe_decode(
        x, slot_ids, weights, w13, w2, reduce=False, few_routes=few_routes
    )
    ref = fused_moe.fused_moe_decode_ref(*as_fp32(x, slot_ids, weights, w13, w2), reduce=False)
    assert_matches(parts, ref, tol=2e-2)


@pytest.mark.parametrize("tokens", [1, 4])
def test_fused_moe_decode_replays_in_a_cuda_graph(gen, tokens):
    x = cuda_randn(gen, tokens, HIDDEN)
    slot_ids = routes(gen, tokens, 32, masked=0.25)
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda()
    w13, w2 = expert_weights(gen, 32)
    fused_moe.fused_moe_decode(x, slot_ids, weights, w13, w2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_moe_decode(x, slot_ids, weights, w13, w2)
    # New routing and inputs in the captured buffers, as the engine does each step.
    x.copy_(cuda_randn(gen, tokens, HIDDEN))
    slot_ids.copy_(routes(gen, tokens, 32, masked=0.25))
    weights.copy_(torch.rand(tokens, TOP_K, generator=gen))
    graph.replay()
    ref = fused_moe.fused_moe_decode_ref(*as_fp32(x, slot_ids, weights, w13, w2))
    assert_matches(out, ref, tol=2e-2)


@pytest.mark.parametrize("tokens", [64, 1024])
def test_grouped_moe(gen, tokens):
    x = cuda_randn(gen, tokens, HIDDEN)
    expert_ids = routes(gen, tokens, EXPERTS, masked=0.05)
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda()
    w13, w2 = expert_weights(gen, EXPERTS)
    out = grouped_moe.grouped_moe(x, expert_ids, weights, w13, w2)
    ref = grouped_moe.grouped_moe_ref(*as_fp32(x, expert_ids, weights, w13, w2))
    assert_matches(out, ref, tol=2e-2)


def test_grouped_moe_unchecked_never_waits_for_the_device(gen):
    """The engine's call (checked=False): no host sync in the whole layer, so a prefill's host
    runs ahead of the device (torch raises on a sync in this mode)."""
    x = cuda_randn(gen, 512, HIDDEN)
    expert_ids = routes(gen, 512, EXPERTS, masked=0.05)
    weights = torch.rand(512, TOP_K, generator=gen).cuda()
    w13, w2 = expert_weights(gen, EXPERTS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_moe.grouped_moe(
            x, expert_ids, weights, w13, w2, layer_experts=EXPERTS, checked=False
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = grouped_moe.grouped_moe_ref(*as_fp32(x, expert_ids, weights, w13, w2))
    assert_matches(out, ref, tol=2e-2)


def fp8_experts(gen: torch.Generator, count: int):
    """An FP8 bank of `count` random experts (fp8.quantize), float8_e4m3fn, with its factors as
    the kernels take them, and the fp32 weights it dequantizes to (the reference's)."""
    w13, s13 = fp8.quantize(cuda_randn(gen, count, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5))
    w2, s2 = fp8.quantize(cuda_randn(gen, count, HIDDEN, INTER, scale=INTER**-0.5))
    scales = {"w13_scale_inv": s13, "w2_scale_inv": s2}
    return w13, w2, scales, (fp8.dequantize(w13, s13), fp8.dequantize(w2, s2))


@pytest.mark.parametrize(("tokens", "slots"), [(1, 64), (4, 64), (16, 64), (16, 12)])
def test_fused_moe_decode_fp8(gen, tokens, slots):
    x = cuda_randn(gen, tokens, HIDDEN)
    slot_ids = routes(gen, tokens, slots, masked=0.25)
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda()
    w13, w2, scales, wide = fp8_experts(gen, slots)
    out = fused_moe.fused_moe_decode(x, slot_ids, weights, w13, w2, **scales)
    ref = fused_moe.fused_moe_decode_ref(*as_fp32(x, slot_ids, weights), *wide)
    assert_matches(out, ref, tol=2e-2)


@pytest.mark.parametrize("masked", [0.25, 0.8])
@pytest.mark.parametrize("few_routes", [False, True])
def test_fused_moe_decode_fp8_one_token_parts(gen, few_routes, masked):
    """The engine's resident step and the launch after a layer step's fills, over FP8 slots."""
    x = cuda_randn(gen, 1, HIDDEN)
    slot_ids = routes(gen, 1, 64, masked=masked)
    weights = torch.rand(1, TOP_K, generator=gen).cuda()
    w13, w2, scales, wide = fp8_experts(gen, 64)
    parts = fused_moe.fused_moe_decode(
        x, slot_ids, weights, w13, w2, reduce=False, few_routes=few_routes, **scales
    )
    ref = fused_moe.fused_moe_decode_ref(*as_fp32(x, slot_ids, weights), *wide, reduce=False)
    assert_matches(parts, ref, tol=2e-2)


@pytest.mark.parametrize("tokens", [1, 4])
def test_fused_moe_decode_fp8_replays_in_a_cuda_graph(gen, tokens):
    x = cuda_randn(gen, tokens, HIDDEN)
    slot_ids = routes(gen, tokens, 32, masked=0.25)
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda()
    w13, w2, scales, wide = fp8_experts(gen, 32)
    fused_moe.fused_moe_decode(x, slot_ids, weights, w13, w2, **scales)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_moe_decode(x, slot_ids, weights, w13, w2, **scales)
    x.copy_(cuda_randn(gen, tokens, HIDDEN))
    slot_ids.copy_(routes(gen, tokens, 32, masked=0.25))
    weights.copy_(torch.rand(tokens, TOP_K, generator=gen))
    graph.replay()
    ref = fused_moe.fused_moe_decode_ref(*as_fp32(x, slot_ids, weights), *wide)
    assert_matches(out, ref, tol=2e-2)


@pytest.mark.parametrize("tokens", [64, 1024])
def test_grouped_moe_fp8_never_waits_for_the_device(gen, tokens):
    x = cuda_randn(gen, tokens, HIDDEN)
    expert_ids = routes(gen, tokens, EXPERTS, masked=0.05)
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda()
    w13, w2, scales, wide = fp8_experts(gen, EXPERTS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_moe.grouped_moe(
            x, expert_ids, weights, w13, w2, layer_experts=EXPERTS, checked=False, **scales
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = grouped_moe.grouped_moe_ref(*as_fp32(x, expert_ids, weights), *wide)
    assert_matches(out, ref, tol=2e-2)


def paged_kv(gen: torch.Generator, seq_lens: list[int], max_blocks: int):
    num_blocks = len(seq_lens) * max_blocks
    k_cache = cuda_randn(gen, num_blocks, PAGE, KV_HEADS, HEAD_DIM)
    v_cache = cuda_randn(gen, num_blocks, PAGE, KV_HEADS, HEAD_DIM)
    tables = torch.randperm(num_blocks, generator=gen).view(len(seq_lens), max_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return k_cache, v_cache, tables.to("cuda", torch.int32), lens.cuda()


@pytest.mark.parametrize("seq_lens", [[32768], [1, 100, 4096, 8191], [17] * 8])
def test_paged_attention_decode(gen, seq_lens):
    max_blocks = -(-max(seq_lens) // PAGE)
    k_cache, v_cache, tables, lens = paged_kv(gen, seq_lens, max_blocks)
    q = cuda_randn(gen, len(seq_lens), Q_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    out = paged_attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)
    ref = paged_attention.paged_attention_decode_ref(
        *as_fp32(q, k_cache, v_cache, tables, lens), scale
    )
    assert_matches(out, ref.to(BF16), tol=2e-2)


def test_paged_attention_replays_in_a_cuda_graph_as_the_context_grows(gen):
    k_cache, v_cache, tables, lens = paged_kv(gen, [300, 5000], max_blocks=400)
    q = cuda_randn(gen, 2, Q_HEADS, HEAD_DIM)
    paged_attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.1)
    for step in range(3):
        lens.add_(97 * step + 1)
        q.copy_(cuda_randn(gen, 2, Q_HEADS, HEAD_DIM))
        graph.replay()
        ref = paged_attention.paged_attention_decode_ref(
            *as_fp32(q, k_cache, v_cache, tables, lens), 0.1
        )
        assert_matches(out, ref.to(BF16), tol=2e-2)


def test_paged_attention_graph_replays_agree_many_times(gen):
    """The merge counters are shared by every replay: 200 replays, each against the reference,
    so a counter left unreset or a merge racing the partials' stores shows."""
    k_cache, v_cache, tables, lens = paged_kv(gen, [32768, 700, 9000], max_blocks=2048)
    q = cuda_randn(gen, 3, Q_HEADS, HEAD_DIM)
    paged_attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.1)
    kv32 = as_fp32(k_cache, v_cache, tables)
    for step in range(200):
        q.copy_(cuda_randn(gen, 3, Q_HEADS, HEAD_DIM))
        lens[1:].add_(step % 3)
        graph.replay()
        ref = paged_attention.paged_attention_decode_ref(q.float(), *kv32[:2], tables, lens, 0.1)
        assert_matches(out, ref.to(BF16), tol=2e-2)


def test_rmsnorm_rounds_as_hf(gen):
    x = cuda_randn(gen, 7, HIDDEN, scale=3.0)
    residual = cuda_randn(gen, 7, HIDDEN, scale=3.0)
    weight = cuda_randn(gen, HIDDEN)
    normed, new_residual = rmsnorm.fused_add_rmsnorm(x, residual, weight, 1e-6)
    ref_normed, ref_residual = rmsnorm.fused_add_rmsnorm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    # inv_rms may differ in its last bit (another summation order): a unit or so in bf16
    torch.testing.assert_close(normed, ref_normed, rtol=2**-6, atol=0)
    torch.testing.assert_close(
        rmsnorm.rmsnorm(x, weight, 1e-6), rmsnorm.rmsnorm_ref(x, weight, 1e-6), rtol=2**-6, atol=0
    )


def test_router(gen):
    logits = cuda_randn(gen, 16, EXPERTS, scale=2.0)  # bf16: equal logits happen, ties in any order
    weights, ids = router.topk_softmax(logits, TOP_K, True)
    assert_top_k(weights, ids, logits, TOP_K, renormalize=True)


@pytest.mark.parametrize(("tokens", "parts"), [(1, 1), (1, 2), (8, 2)])
def test_sum_when_ready_waits_in_a_graph_for_the_host(gen, tokens, parts):
    """A captured sum of the routes' parts that adds the CPU's part only after the host writes
    the epoch, replay after replay."""
    ys = [torch.randn(tokens, TOP_K, HIDDEN, generator=gen).cuda() for _ in range(parts)]
    part = torch.randn(tokens, HIDDEN, generator=gen).pin_memory()
    sync = host_handoff.handoff_sync(pin=True)
    out = torch.full((tokens, HIDDEN), float("nan"), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        host_handoff.sum_when_ready_triton(ys, part, sync, out=out)
    for epoch in range(1, 4):
        out.fill_(float("nan"))
        part.normal_(generator=gen)
        sync[EXPECTED] = epoch
        graph.replay()
        time.sleep(0.02)
        assert not torch.cuda.current_stream().query(), "the kernel ended before the epoch"
        sync[DONE] = epoch
        torch.cuda.synchronize()
        expected = sum(y.sum(dim=1) for y in ys) + part.cuda()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert sync[TIMED_OUT] == 0


@pytest.mark.parametrize("tokens", [1, 8])
def test_routing_to_host_stores_into_pinned_memory_from_a_graph(gen, tokens):
    """The kernel a piece ends with: one launch, captured, storing over PCIe into pinned buffers."""
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    ids = ids.cuda()
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda()
    x = cuda_randn(gen, tokens, HIDDEN)
    ids_h = torch.full((tokens, TOP_K), -99, dtype=torch.int32).pin_memory()
    w_h = torch.full((tokens, TOP_K), float("nan")).pin_memory()
    x_h = torch.full((tokens, HIDDEN), float("nan")).pin_memory()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        host_handoff.routing_to_host(ids, weights, x, ids_h, w_h, x_h)
    for _ in range(3):
        ids.copy_(ids.roll(1, dims=1))
        x.mul_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids_h, ids.int().cpu())
        assert torch.equal(w_h, weights.cpu())
        assert torch.equal(x_h, x.float().cpu())


def test_cpu_jobs_hand_over_to_a_replayed_graph(gen):
    """The engine's staged step: a captured graph adds what each native CPU job wrote, epoch by
    epoch, with the host queueing the replay before the job ends."""
    tokens, experts = 2, 4
    w13 = (torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5).to(BF16)
    w2 = (torch.randn(experts, HIDDEN, INTER, generator=gen) * INTER**-0.5).to(BF16)
    part = torch.zeros(tokens, HIDDEN).pin_memory()
    sync = host_handoff.handoff_sync(pin=True)
    gpu_part = torch.zeros(tokens, 1, HIDDEN, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = host_handoff.sum_when_ready([gpu_part], part, sync)
    with CpuExpertRunner(8, "native") as runner:
        for epoch in range(1, 21):
            x = torch.randn(tokens, HIDDEN, generator=gen)
            pair_expert = torch.randint(0, experts, (5,), generator=gen, dtype=torch.int32)
            pair_token = torch.randint(0, tokens, (5,), generator=gen, dtype=torch.int32)
            pair_weight = torch.rand(5, generator=gen)
            args = (x, w13, w2, pair_expert, pair_token, pair_weight)
            gpu_part.copy_(torch.randn(tokens, 1, HIDDEN, generator=gen))
            job = runner.submit(*args, out=part, done_flag=sync, done_value=epoch)
            sync[EXPECTED] = epoch
            graph.replay()
            torch.cuda.synchronize()
            job.wait()
            expected = gpu_part[:, 0].cpu() + cpu_experts_ref(*args)
            torch.testing.assert_close(out.cpu(), expected, rtol=1e-3, atol=1e-3)
    assert sync[TIMED_OUT] == 0
