"""A decode step's whole MoE router in one launch (`route`): the logits x @ router_w^T (rounded
to the model's dtype, as HF computes them), the softmax and top-k as `topk_softmax`
(kernels/router.py), and for offloaded decode the routing's store into pinned host memory (as
host_handoff's `routing_to_host`). Its programs each compute a block of experts' logits for
every token into a scratch row; an integer atomic counts the programs done, and the last one
reads all the logits back and routes them. No float atomics: the results are deterministic, and
a graph replay matches an eager call bit for bit. With a routing signal (offloaded decode), the
last program then sets it (`host_handoff.signal_host`), and the host waiting for the routing sees
it there sooner than the stream's completion. It saves a launch's time only where it replaces
three launches (one token, with the host's copy; docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import common, host_handoff
from .common import round_to, tl, triton
from .router import check_k_and_ids_out, topk_softmax_ref

# Most tokens `route` takes: a decode step's batch; the last program routes them all at once.
ROUTE_MAX_TOKENS = 16
ROUTE_MAX_BLOCK_E = 16
# Elements of x each step of a program's share of the host copy stores.
ROUTE_X_BLOCK = 1024
# One counter per device, of the programs of the `route` launch in flight (see _route_counter).
_ROUTE_COUNTERS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """The launch shape of `route_triton`.

    program_bytes: router_w bytes each program reads (the experts per program follow, a power of
    two up to ROUTE_MAX_BLOCK_E). tile_elements: elements of the [tokens, experts, H-step] product
    a program multiplies per step (the H-step shrinks as the tokens grow; 64 fp32 a thread at one
    warp). num_warps: one warp keeps the last program's softmax and top-k in warp shuffles, where
    a reduction across warps waits on shared memory at each of the k picks; the logits' part is
    spread over more programs instead. stages: H-steps of loads in flight.
    """

    program_bytes: int = 8 * 1024
    tile_elements: int = 2048
    num_warps: int = 1
    stages: int = 3

    def __post_init__(self) -> None:
        if self.program_bytes < 1 or self.tile_elements < 1 or self.num_warps < 1:
            raise ValueError(f"route config fields must be positive: {self}")
        if self.num_warps & (self.num_warps - 1) or self.stages < 1:
            raise ValueError(f"num_warps must be a power of two and stages >= 1: {self}")


def route_ref(
    x: torch.Tensor,
    router_w: torch.Tensor,
    k: int,
    renormalize: bool,
    ids_out: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    signal: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: logits x [T, H] @ router_w [E, H]^T in fp32 rounded to x's dtype (as HF's
    router computes them in the model's dtype), then `topk_softmax_ref`. host: (ids_h int32 [T, K],
    weights_h fp32 [T, K], x_h fp32 [T, H]) in host memory also receive ids, weights and x; then
    signal (a `host_handoff.routing_signal`, with host only) is set."""
    _check_route(x, router_w, k, ids_out, host, signal)
    logits = F.linear(x.float(), router_w.float()).to(x.dtype)
    weights, ids = topk_softmax_ref(logits, k, renormalize, ids_out)
    if host is not None:
        host_handoff.routing_to_host_ref(ids, weights, x, *host)
    if signal is not None:
        host_handoff.signal_routing(signal, x.device)
    return weights, ids


@triton.jit
def logits_block(
    x_ptr, w_ptr, scale_ptr, t_idx, t_ok, e_idx, e_ok, hidden, stride_x, stride_w,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_T, BLOCK_E]: the tokens t_idx of x [T, H] (times scale [H] fp32 where
    SCALED) dotted with the rows e_idx of w [E, H], over H in steps of BLOCK_H."""
    w_rows = w_ptr + e_idx[:, None].to(tl.int64) * stride_w
    x_rows = x_ptr + t_idx[:, None] * stride_x
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    # num_stages on the loop itself: the launch's num_stages pipelines only loads that feed tl.dot.
    for h0 in tl.range(0, hidden, BLOCK_H, num_stages=STAGES):
        h_idx = h0 + tl.arange(0, BLOCK_H)
        h_ok = h_idx < hidden
        w = tl.load(w_rows + h_idx[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
        xs = tl.load(x_rows + h_idx[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        xs = xs.to(tl.float32)
        if SCALED:
            xs = xs * tl.load(scale_ptr + h_idx, mask=h_ok, other=0.0)[None, :]
        # Multiplied and added in fp32 (no tl.dot: the products of bf16 operands are exact).
        acc += tl.sum(xs[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _route_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    counter_ptr,
    weights_ptr,
    ids_ptr,
    ids_h_ptr,
    weights_h_ptr,
    x_h_ptr,
    signal_ptr,
    num_tokens,
    num_experts,
    hidden,
    stride_x,
    stride_w,
    stride_i,
    x_per_program,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_ALL_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_X: tl.constexpr,
    STAGES: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HOST: tl.constexpr,
    SIGNAL: tl.constexpr,
    PTX: tl.constexpr,
    PDL: tl.constexpr,
):
    common.pdl_start(PDL)
    pid = tl.program_id(0)
    t_idx = tl.arange(0, BLOCK_T)
    t_ok = t_idx < num_tokens
    e_idx = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e_idx < num_experts
    acc = logits_block(
        x_ptr, w_ptr, x_ptr, t_idx, t_ok, e_idx, e_ok, hidden, stride_x, stride_w,
        BLOCK_T, BLOCK_E, BLOCK_H, STAGES, False,
    )  # fmt: skip
    # Rounded to the model's dtype, as HF's router linear gives them; kept in fp32 scratch.
    logits = round_to(acc, x_ptr.dtype.element_ty)
    tl.store(
        logits_ptr + t_idx[:, None] * num_experts + e_idx[None, :],
        logits,
        mask=t_ok[:, None] & e_ok[None, :],
    )
    if HOST:
        # Each program stores its share of x: the host reads it only after the whole launch.
        x_start = pid * x_per_program
        x_end = tl.minimum(x_start + x_per_program, num_tokens * hidden)
        for x0 in range(x_start, x_end, BLOCK_X):
            offs = x0 + tl.arange(0, BLOCK_X)
            x_ok = offs < x_end
            x_part = tl.load(x_ptr + (offs // hidden) * stride_x + offs % hidden, mask=x_ok)
            tl.store(x_h_ptr + offs, x_part.to(tl.float32), mask=x_ok)
    # Every thread's logits stored before the one thread's atomic, whose release then covers them.
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        # The last program: the others' logits are all stored (their releases, this acquire).
        # ".cg" reads them from L2, never from a line this SM's L1 might hold.
        e_all = tl.arange(0, BLOCK_ALL_E)
        e_all_ok = e_all < num_experts
        row_logits = tl.load(
            logits_ptr + t_idx[:, None] * num_experts + e_all[None, :],
            mask=t_ok[:, None] & e_all_ok[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )
        # padding rows: finite, so their (unstored) softmax is no NaN
        row_logits = tl.where(t_ok[:, None], row_logits, 0.0)
        # Each row as _topk_softmax_kernel routes it: the same arithmetic, ties and padding.
        exps = tl.exp(row_logits - tl.max(row_logits, axis=1)[:, None])
        probs = exps / tl.sum(exps, axis=1)[:, None]
        k_idx = tl.arange(0, BLOCK_K)
        top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
        # a NaN probability ranks above every real one, as in _topk_softmax_kernel
        remaining = tl.where(e_all_ok[None, :], tl.where(probs == probs, probs, 2.0), -1.0)
        for j in tl.static_range(TOP_K):
            best = tl.max(remaining, axis=1)
            best_id = tl.min(
                tl.where(remaining == best[:, None], e_all[None, :], BLOCK_ALL_E), axis=1
            )
            best = tl.where(best > 1.0, float("nan"), best)
            top_w = tl.where(k_idx[None, :] == j, best[:, None], top_w)
            top_i = tl.where(k_idx[None, :] == j, best_id[:, None], top_i)
            remaining = tl.where(e_all[None, :] == best_id[:, None], -2.0, remaining)
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=1)[:, None]
        tk_ok = t_ok[:, None] & (k_idx[None, :] < TOP_K)
        tk_offs = t_idx[:, None] * TOP_K + k_idx[None, :]
        tl.store(weights_ptr + tk_offs, top_w, mask=tk_ok)
        tl.store(ids_ptr + t_idx[:, None] * stride_i + k_idx[None, :], top_i, mask=tk_ok)
        if HOST:
            tl.store(ids_h_ptr + tk_offs, top_i, mask=tk_ok)
            tl.store(weights_h_ptr + tk_offs, top_w, mask=tk_ok)
        if SIGNAL:  # after every program's x and this one's routing (the acquire above)
            host_handoff.signal_host(signal_ptr, PTX)
        # Every program has counted: zero for the next launch (or graph replay).
        tl.store(counter_ptr, 0)


def route_triton(
    x: torch.Tensor,
    router_w: torch.Tensor,
    k: int,
    renormalize: bool,
    ids_out: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    config: RouteConfig | None = None,
    signal: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: the same in one launch, graph-capturable (no host sync; the host buffers pinned
    when x is on a GPU, read by the host once the signal is set or after a sync). Weights fp32
    [T, K] (descending), ids int32 [T, K] (into `ids_out` when given: rows may be strided).
    Launches on one device share a counter: issue them one at a time (decode does), never
    concurrently on two streams."""
    _check_route(x, router_w, k, ids_out, host, signal)
    num_tokens, hidden = x.shape
    num_experts = router_w.shape[0]
    config = config or RouteConfig()
    block_e = _route_block_e(num_experts, hidden, x.element_size(), config.program_bytes)
    programs = triton.cdiv(num_experts, block_e)
    block_t = common.next_pow2(num_tokens)
    logits = common.alloc((num_tokens, num_experts), torch.float32, x.device)
    weights = common.alloc((num_tokens, k), torch.float32, x.device)
    ids = ids_out if ids_out is not None else common.alloc((num_tokens, k), torch.int32, x.device)
    ids_h, weights_h, x_h = host if host is not None else (ids, weights, weights)
    pdl = common.pdl_launch(x.device)
    counter = _route_counter(x.device)
    _route_kernel[(programs,)](
        x,
        router_w,
        logits,
        counter,
        weights,
        ids,
        ids_h,
        weights_h,
        x_h,
        signal if signal is not None else counter,
        num_tokens,
        num_experts,
        hidden,
        x.stride(0),
        router_w.stride(0),
        ids.stride(0),
        triton.cdiv(num_tokens * hidden, programs),
        TOP_K=k,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_H=min(
            common.next_pow2(hidden),
            common.next_pow2(config.tile_elements // (block_t * block_e)),
        ),
        BLOCK_ALL_E=common.next_pow2(num_experts),
        BLOCK_K=common.next_pow2(k),
        BLOCK_X=ROUTE_X_BLOCK,
        STAGES=config.stages,
        RENORMALIZE=renormalize,
        HOST=host is not None,
        SIGNAL=signal is not None,
        PTX=common.inline_ptx(x.device),
        num_warps=config.num_warps,
        **pdl,
    )
    return weights, ids


def route(
    x: torch.Tensor,
    router_w: torch.Tensor,
    k: int,
    renormalize: bool,
    ids_out: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    signal: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's router (logits, softmax, top-k, and the routing into host buffers when
    given, then the routing's signal when given): the one-launch Triton kernel on CUDA, the
    reference elsewhere."""
    if x.is_cuda:
        return route_triton(x, router_w, k, renormalize, ids_out, host, signal=signal)
    return route_ref(x, router_w, k, renormalize, ids_out, host, signal)


def _route_block_e(num_experts: int, hidden: int, itemsize: int, program_bytes: int) -> int:
    """Experts per program of `route`: a power of two whose router_w rows come to about
    program_bytes, between 1 and ROUTE_MAX_BLOCK_E (and no more than the experts)."""
    block_e = 1
    while 2 * block_e * hidden * itemsize <= program_bytes and block_e < ROUTE_MAX_BLOCK_E:
        block_e *= 2
    return min(block_e, common.next_pow2(num_experts))


def _route_counter(device: torch.device) -> torch.Tensor:
    """The device's int32 count of `route` programs done (`common.device_counter`)."""
    return common.device_counter(_ROUTE_COUNTERS, device, "route")


def _check_route(
    x: torch.Tensor,
    router_w: torch.Tensor,
    k: int,
    ids_out: torch.Tensor | None,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    signal: torch.Tensor | None = None,
) -> None:
    """Validate x [T, H] (1 <= T <= ROUTE_MAX_TOKENS) and router_w [E, H] of one dtype, rows
    contiguous; k and ids_out as _check; the host buffers and the signal (metadata only: no
    device sync)."""
    if x.dim() != 2 or router_w.dim() != 2 or router_w.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [T, H] and router_w [num_experts, H]: got {tuple(x.shape)} and "
            f"{tuple(router_w.shape)}"
        )
    num_tokens, hidden = x.shape
    if not 1 <= num_tokens <= ROUTE_MAX_TOKENS:
        raise ValueError(
            f"x has {num_tokens} tokens: route takes 1 to {ROUTE_MAX_TOKENS} (a decode batch); "
            "for more, compute the logits and call topk_softmax"
        )
    if x.dtype != router_w.dtype:
        raise ValueError(f"x and router_w must share one dtype, got {x.dtype} and {router_w.dtype}")
    common.tl_dtype(x.dtype)
    common.check_last_dim_contiguous("x", x)
    common.check_last_dim_contiguous("router_w", router_w)
    common.check_same_device(x=x, router_w=router_w)
    check_k_and_ids_out(num_tokens, router_w.shape[0], k, ids_out)
    if ids_out is not None:
        common.check_same_device(x=x, ids_out=ids_out)
    if signal is not None:
        if host is None:
            raise ValueError("a routing signal needs the host buffers it tells of (host=)")
        host_handoff.check_signal(signal, x.device)
    if host is None:
        return
    if len(host) != 3:
        raise ValueError(f"host must be (ids_h, weights_h, x_h), got {len(host)} tensors")
    expected = {
        "ids_h": (torch.int32, (num_tokens, k)),
        "weights_h": (torch.float32, (num_tokens, k)),
        "x_h": (torch.float32, (num_tokens, hidden)),
    }
    for (name, (dtype, shape)), buffer in zip(expected.items(), host, strict=True):
        if buffer.dtype != dtype or buffer.shape != shape or not buffer.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous {dtype} {list(shape)}, got {buffer.dtype} "
                f"{list(buffer.shape)}{'' if buffer.is_contiguous() else ' (not contiguous)'}"
            )
        if buffer.device.type != "cpu":
            raise ValueError(f"{name} must be in host memory, got a tensor on {buffer.device}")
        if x.is_cuda and not buffer.is_pinned():
            raise ValueError(f"with x on a GPU, {name} must be pinned host memory (pin_memory())")
