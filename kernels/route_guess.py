"""A guess of an MoE layer's routing, sent to the host early (`guess_to_host`): the layer's
router logits computed from the residual stream as it stands before the layer's attention,
stored straight into pinned host memory, then a signal of their own.

In offloaded decode the CPU workers sit idle from the end of one layer's CPU job until the next
layer's routing reaches the host: the device's chain from the sum through attention to the
router. With a guess of that routing made right after the sum, the host plans the step it will
probably get and tells each worker which weights its first blocks will read (`Pool::hint`); they
fetch them into their own caches during the wait, and the real job, where its plan matches, hands
them those same blocks (kernels/csrc/decode_planner.h).

The guess's input is the layer's attention input x = rmsnorm(r) * w_in (the residual r just
after the MoE layer before, normalized by the layer's input norm), rescaled by
`scale = w_post / w_in` to rmsnorm(r) * w_post: the router's input as it would be if attention
added nothing. On this project's synthetic Qwen3-30B-A3B geometry it names most of the routed
experts (docs/cpu-experts.md, "Guessed steps").

A router with a bias (gpt-oss's) adds it to the guess's logits as to the routing's. The logits are
fp32 and not rounded to the model's dtype: only the host's top-k reads them. One
launch: each program stores its block of experts' logits for every token into host memory, an
integer atomic counts the programs, and the last one sets the signal (`host_handoff.signal_host`:
a host that sees it sees every program's logits). The engine launches it on a side stream, off
the chain to the router, which waits for it (engine/model/model.py, `Model._guess`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import common, host_handoff
from .common import tl, triton
from .route import logits_block

# Most tokens a guess takes (a decode batch), and experts per program.
GUESS_MAX_TOKENS = 16
GUESS_BLOCK_E = 2
# Elements of the [tokens, experts, H-step] product a program multiplies per step.
GUESS_TILE_ELEMENTS = 2048
# One counter per device, of the programs of the guess launch in flight.
_GUESS_COUNTERS: dict[torch.device, torch.Tensor] = {}


def guess_scale(input_norm: torch.Tensor, post_norm: torch.Tensor) -> torch.Tensor:
    """fp32 [H]: post_norm / input_norm, 0 where input_norm is 0 (that element of the attention
    input carries nothing of the residual to rescale)."""
    a, b = input_norm.float(), post_norm.float()
    return torch.where(a != 0, b / torch.where(a != 0, a, 1.0), 0.0)


def guess_to_host_ref(
    x: torch.Tensor,
    scale: torch.Tensor,
    router_w: torch.Tensor,
    logits_h: torch.Tensor,
    signal: torch.Tensor,
    router_b: torch.Tensor | None = None,
) -> None:
    """Reference: logits_h[:] = (x * scale) @ router_w^T + router_b in fp32 (x [T, H], scale
    fp32 [H], router_w [E, H], router_b [E] or None; logits_h fp32 [T, E] in host memory), then
    the signal set. Queued, not waited for, on a GPU (pinned destinations)."""
    _check_guess(x, scale, router_w, logits_h, signal, router_b)
    bias = router_b.float() if router_b is not None else None
    logits = F.linear(x.float() * scale, router_w.float(), bias)
    logits_h.copy_(logits, non_blocking=True)
    host_handoff.signal_routing(signal, x.device)


@triton.jit
def _guess_kernel(
    x_ptr, scale_ptr, w_ptr, b_ptr, logits_h_ptr, counter_ptr, signal_ptr,
    num_tokens, num_experts, hidden, stride_x, stride_w,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr,
    BIAS: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    common.pdl_start(PDL)
    pid = tl.program_id(0)
    t_idx = tl.arange(0, BLOCK_T)
    t_ok = t_idx < num_tokens
    e_idx = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e_idx < num_experts
    acc = logits_block(
        x_ptr, w_ptr, scale_ptr, t_idx, t_ok, e_idx, e_ok, hidden, stride_x, stride_w,
        BLOCK_T, BLOCK_E, BLOCK_H, STAGES, True,
    )  # fmt: skip
    if BIAS:
        acc += tl.load(b_ptr + e_idx, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        logits_h_ptr + t_idx[:, None] * num_experts + e_idx[None, :],
        acc,
        mask=t_ok[:, None] & e_ok[None, :],
    )
    # every thread's logits stored before the one thread's atomic, whose release covers them
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        # the last program: every program's logits are stored (their releases, this acquire)
        host_handoff.signal_host(signal_ptr, PTX)
        tl.store(counter_ptr, 0)  # every program has counted: zero for the next launch


def guess_to_host_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    router_w: torch.Tensor,
    logits_h: torch.Tensor,
    signal: torch.Tensor,
    router_b: torch.Tensor | None = None,
) -> None:
    """Triton: the same in one launch, storing into the (pinned) host memory from the device;
    graph-capturable. Launches on one device share a counter: issue them one at a time."""
    _check_guess(x, scale, router_w, logits_h, signal, router_b)
    num_tokens, hidden = x.shape
    num_experts = router_w.shape[0]
    block_t = common.next_pow2(num_tokens)
    block_h = min(
        common.next_pow2(hidden), common.next_pow2(GUESS_TILE_ELEMENTS // (block_t * GUESS_BLOCK_E))
    )
    # without a bias the router's weights stand in for it, never read
    bias = router_b if router_b is not None else router_w
    _guess_kernel[(triton.cdiv(num_experts, GUESS_BLOCK_E),)](
        x, scale, router_w, bias, logits_h, _guess_counter(x.device), signal,
        num_tokens, num_experts, hidden, x.stride(0), router_w.stride(0),
        BLOCK_T=block_t, BLOCK_E=GUESS_BLOCK_E, BLOCK_H=block_h, STAGES=3,
        BIAS=router_b is not None, PTX=common.inline_ptx(x.device), num_warps=1,
        **common.pdl_launch(x.device),
    )  # fmt: skip


def guess_to_host(
    x: torch.Tensor,
    scale: torch.Tensor,
    router_w: torch.Tensor,
    logits_h: torch.Tensor,
    signal: torch.Tensor,
    router_b: torch.Tensor | None = None,
) -> None:
    """A guess of a layer's router logits from x (its attention input) into host memory, then
    the guess's signal: the one-launch Triton kernel on a GPU, the reference elsewhere."""
    if x.is_cuda:
        guess_to_host_triton(x, scale, router_w, logits_h, signal, router_b)
    else:
        guess_to_host_ref(x, scale, router_w, logits_h, signal, router_b)


def _guess_counter(device: torch.device) -> torch.Tensor:
    """The device's int32 count of guess programs done (`common.device_counter`)."""
    return common.device_counter(_GUESS_COUNTERS, device, "guess_to_host")


def _check_guess(
    x: torch.Tensor,
    scale: torch.Tensor,
    router_w: torch.Tensor,
    logits_h: torch.Tensor,
    signal: torch.Tensor,
    router_b: torch.Tensor | None = None,
) -> None:
    """x [T, H] (1 <= T <= GUESS_MAX_TOKENS) and router_w [E, H] of one dtype, rows contiguous,
    scale contiguous fp32 [H] on their device, router_b contiguous [E] there or None; logits_h
    contiguous fp32 [T, E] in host memory (pinned with x on a GPU); the signal a
    `host_handoff.routing_signal`. Metadata only."""
    if x.dim() != 2 or router_w.dim() != 2 or router_w.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [T, H] and router_w [num_experts, H]: got {tuple(x.shape)} and "
            f"{tuple(router_w.shape)}"
        )
    num_tokens, hidden = x.shape
    if not 1 <= num_tokens <= GUESS_MAX_TOKENS:
        raise ValueError(f"x has {num_tokens} tokens: a guess takes 1 to {GUESS_MAX_TOKENS}")
    if x.dtype != router_w.dtype:
        raise ValueError(f"x and router_w must share one dtype, got {x.dtype} and {router_w.dtype}")
    common.tl_dtype(x.dtype)
    common.check_last_dim_contiguous("x", x)
    common.check_last_dim_contiguous("router_w", router_w)
    if scale.dtype != torch.float32 or scale.shape != (hidden,) or not scale.is_contiguous():
        raise ValueError(f"scale must be contiguous fp32 [{hidden}], got {scale.dtype} "
                         f"{tuple(scale.shape)}")  # fmt: skip
    common.check_same_device(x=x, router_w=router_w, scale=scale)
    if router_b is not None:
        if router_b.shape != (router_w.shape[0],) or not router_b.is_contiguous():
            raise ValueError(f"router_b must be contiguous [{router_w.shape[0]}], got "
                             f"{tuple(router_b.shape)}")  # fmt: skip
        common.check_same_device(x=x, router_b=router_b)
    shape = (num_tokens, router_w.shape[0])
    if logits_h.dtype != torch.float32 or logits_h.shape != shape or not logits_h.is_contiguous():
        raise ValueError(f"logits_h must be contiguous fp32 {list(shape)}, got {logits_h.dtype} "
                         f"{list(logits_h.shape)}")  # fmt: skip
    if logits_h.device.type != "cpu":
        raise ValueError(f"logits_h must be in host memory, got a tensor on {logits_h.device}")
    if x.is_cuda and not logits_h.is_pinned():
        raise ValueError("with x on a GPU, logits_h must be pinned host memory (pin_memory())")
    host_handoff.check_signal(signal, x.device)
