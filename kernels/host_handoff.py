"""Between the host and captured graphs through pinned memory: the CPU experts' output, awaited on
the device; the routing, stored to the host; the routes' slots, read from it.

In an offloaded decode step the CPU worker threads write their weighted sum of a layer's CPU routes
into pinned host memory, then a completion epoch (kernels/cpu_experts.py, `done_flag`). The next
piece of the step is queued before they finish; its `sum_when_ready` sums the GPU's routes, polls
the epoch over PCIe and adds the CPU's sum once it is there. The host neither waits for the CPU job
nor copies its result nor launches the piece late: the GPU starts the moment the workers finish.
One warp polls: each warp that reads the host's words adds a PCIe round trip, as reads of one
address queue behind each other, so polling from every warp of every program would cost far more
than the sum itself.
Where nothing is added to the routed output, `sum_norm_when_ready` also adds it to the residual
and applies the next RMSNorm; at one token in one launch, whose program polls from one thread.

The other direction, `routing_to_host`: a piece of an offloaded decode step ends by storing its
routing (ids, weights and the MoE input x as fp32, as the CPU experts read it) straight into pinned
host memory from one kernel, where the host reads it after its sync: three copies and a conversion
inside the graph would each pay the copy engine's start latency.

The host learns that a routing has arrived from a signal the router stores after it, into a word
of pinned memory of its own (`routing_signal`, `signal_host`): one thread of the router's last
program, after a system-wide fence, so that a host that sees the signal sees the routing. The
host sees it before `cuStreamQuery` says the kernel is done, and a read of the word costs the host
a fraction of a `cuStreamQuery` call (docs/kernels.md).

A decode step's greedy tokens go to the host the same way, stored by its last piece's last
kernel into pinned memory (`tokens_to_host`), where the host reads them once a later step's
routing has arrived.

The routes' slots go the same way as the CPU's part: the host writes them into a pinned table,
marking the routes that this step's fills serve (`filled_mark`), and the next piece's first graph
reads it with `route_slots_from_host`, which splits it into the cached experts' slots and the
filled ones' on the device, so the cached routes run while the fills cross PCIe.

The handoff's state is one pinned int64 tensor (`handoff_sync`), a cache line per field:
- DONE: the last epoch the CPU has finished (written by the workers, or by the host when a layer
  has no CPU routes);
- EXPECTED: the epoch the next `sum_when_ready` waits for (written by the host before it queues it);
- TIMED_OUT: set by the wait when it gave up (the host checks it after each sync).

The routing's signal is apart from it, one int32 on its own cache line: 0 until the router sets
it to ROUTED; the host's wait clears it once it has seen it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from . import common
from .common import tl, triton
from .rmsnorm import add_residual, fused_add_rmsnorm_ref, norm_row, row_warps

DONE, EXPECTED, TIMED_OUT = 0, 8, 16  # int64 indices: 64 bytes apart
_SYNC_LEN = 24
# tokens_to_host's one program holds them all
TOKENS_MAX = 4096
# the routing's signal: its value once set, and its int32 elements (one cache line)
ROUTED = 1
_SIGNAL_LEN = 16
BLOCK = 1024
# sum_when_ready's sum: elements of H per program, and its warps
SUM_BLOCK = 1024
SUM_WARPS = 4
# route_slots_from_host reads every route in one program: a decode step's batch times top-k
ROUTE_SLOTS_MAX = 1 << 14
# Polls of the epoch before giving up: one is a PCIe round trip of about a microsecond, so a few
# seconds, where a CPU job takes well under a millisecond. The reference waits as long by the clock.
MAX_POLLS = 1 << 22
TIMEOUT_S = 5.0


def handoff_sync(pin: bool) -> torch.Tensor:
    """A zeroed handoff state in host memory (pinned, so a GPU kernel can read it, when pin)."""
    return torch.zeros(_SYNC_LEN, dtype=torch.int64, pin_memory=pin)


def routing_signal(pin: bool) -> torch.Tensor:
    """A cleared routing signal in host memory: element 0 of an int32 cache line of its own
    (pinned, so that a GPU kernel can store it, when pin)."""
    return torch.zeros(_SIGNAL_LEN, dtype=torch.int32, pin_memory=pin)


@triton.jit
def signal_host(signal_ptr, PTX: tl.constexpr):
    """A program's last statement where the host waits for its writes: store ROUTED at signal_ptr
    (pinned host memory) once every write of this program, and every write it has seen through an
    acquire (another program's, before an atomic this one read), is visible to the host. With PTX,
    every thread fences at system scope (`fence.sc.sys`, cumulative: it orders what the thread has
    seen too) and thread 0 alone stores, so that there is one store, which the host clears once
    it has seen it with no late duplicate to fear. Without (the interpreter), a plain store."""
    tl.debug_barrier()  # the program's threads' writes before thread 0's signal
    if PTX:
        tl.inline_asm_elementwise(
            """{
            .reg .pred sig_p;
            .reg .b32 sig_t;
            mov.u32 sig_t, %tid.x;
            setp.eq.u32 sig_p, sig_t, 0;
            mov.u32 sig_t, 1;
            fence.sc.sys;
            @sig_p st.relaxed.sys.global.b32 [$1], sig_t;
            mov.u32 $0, 0;
            }""",
            "=r,l",
            [signal_ptr],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(signal_ptr, 1)


@triton.jit
def _signal_kernel(signal_ptr, PTX: tl.constexpr, PDL: tl.constexpr):
    common.pdl_start(PDL)
    signal_host(signal_ptr, PTX)


def signal_routing(signal: torch.Tensor, device: torch.device) -> None:
    """Set the routing's signal after the work queued before it on `device` (a routing stored to
    the host by `routing_to_host`): a one-thread kernel on a GPU, a plain store elsewhere."""
    check_signal(signal, device)
    if device.type == "cuda":
        _signal_kernel[(1,)](
            signal, PTX=common.inline_ptx(device), num_warps=1, **common.pdl_launch(device)
        )
    else:
        signal[0] = ROUTED


def check_signal(signal: torch.Tensor, device: torch.device) -> None:
    if signal.dtype != torch.int32 or signal.numel() < 1 or signal.device.type != "cpu":
        raise ValueError(
            f"the routing's signal must be a routing_signal() tensor, got {signal.dtype} "
            f"{tuple(signal.shape)} on {signal.device}"
        )
    if device.type == "cuda" and not signal.is_pinned():
        raise ValueError("with the routing on a GPU, its signal must be pinned host memory")


def sum_when_ready_ref(
    parts: Sequence[torch.Tensor],
    cpu_part: torch.Tensor,
    sync: torch.Tensor,
    timeout_s: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference: the routes' sum of each of parts (fp32 [T, K, H], the fused MoE's per-route
    outputs) plus cpu_part (fp32 [T, H] in host memory) once sync's DONE reaches EXPECTED, waiting
    on the host; [T, H], summed in fp32 and rounded to `dtype` once. On a timeout, sets TIMED_OUT
    and returns the parts' sum alone."""
    _check_sum(parts, cpu_part, sync)
    _check_dtype(dtype)
    out = parts[0].sum(dim=1)
    for extra in parts[1:]:
        out += extra.sum(dim=1)
    state = sync.numpy()  # a view: each read sees the memory now
    deadline = time.monotonic() + (TIMEOUT_S if timeout_s is None else timeout_s)
    while state[DONE] < state[EXPECTED]:
        if time.monotonic() > deadline:
            state[TIMED_OUT] = 1
            return out.to(dtype)
        time.sleep(0)
    out += cpu_part.to(out.device)
    return out.to(dtype)


@triton.jit
def _wait_epoch_kernel(sync_ptr, ready_ptr, max_polls, PDL: tl.constexpr):
    common.pdl_start(PDL)
    # one program of one warp: every warp that reads the host's words costs a PCIe round trip,
    # and reads of one address queue behind each other
    expected = tl.load(sync_ptr + 8, volatile=True)
    done = tl.load(sync_ptr, volatile=True)
    polls = 0
    while (done < expected) & (polls < max_polls):
        done = tl.load(sync_ptr, volatile=True)
        polls += 1
    ready = done >= expected
    if not ready:
        tl.store(sync_ptr + 16, 1)
    tl.store(ready_ptr, ready.to(tl.int32))


@triton.jit
def _routes_sum(
    y_ptr, y2_ptr, t, offs, mask, hidden, K: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr
):
    """Token t's routes summed in fp32 at offs of H (BLOCK of them): the K routes of the device
    part y (and of y2, with TWO), added route by route, both parts' k-th together."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(y_ptr + (t * K + k) * hidden + offs, mask=mask, other=0.0)
        if TWO:
            acc += tl.load(y2_ptr + (t * K + k) * hidden + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _sum_parts_kernel(
    y_ptr, y2_ptr, part_ptr, out_ptr, ready_ptr, hidden,
    K: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    common.pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = _routes_sum(y_ptr, y2_ptr, t, offs, mask, hidden, K, TWO, BLOCK)
    # device memory, written by the wait just before: none of the part if it gave up
    part_len = tl.where(tl.load(ready_ptr) != 0, hidden, 0)
    # volatile: read the host's memory now, never a copy cached before the epoch was seen
    part = tl.load(part_ptr + t * hidden + offs, mask=offs < part_len, other=0.0, volatile=True)
    # rounded once, to the output's type (the model's: no separate conversion launch after)
    tl.store(out_ptr + t * hidden + offs, (acc + part).to(out_ptr.dtype.element_ty), mask=mask)


def sum_when_ready_triton(
    parts: Sequence[torch.Tensor],
    cpu_part: torch.Tensor,
    sync: torch.Tensor,
    max_polls: int = MAX_POLLS,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Triton: the same in two launches, waiting on the device (graph-capturable): a single warp
    polls the epoch, then the sum reads the CPU's part over PCIe. cpu_part and sync must be pinned
    host memory when the parts are on a GPU. out: where to write ([T, H] of `dtype`); new if
    None."""
    _check_sum(parts, cpu_part, sync)
    _check_dtype(dtype)
    y = parts[0]
    tokens, top_k, hidden = y.shape
    if out is None:
        out = torch.empty((tokens, hidden), dtype=dtype, device=y.device)
    elif out.dtype != dtype or out.shape != cpu_part.shape or not out.is_contiguous():
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must be contiguous {dtype} of the CPU part's "
            f"shape {tuple(cpu_part.shape)}"
        )
    elif out.device != y.device:
        raise ValueError(f"out is on {out.device}, the parts on {y.device}")
    ready = torch.empty(1, dtype=torch.int32, device=y.device)
    pdl = common.pdl_launch(y.device)
    _wait_epoch_kernel[(1,)](sync, ready, max_polls, num_warps=1, **pdl)
    block = min(SUM_BLOCK, triton.next_power_of_2(hidden))
    _sum_parts_kernel[(tokens, triton.cdiv(hidden, block))](
        y, parts[-1], cpu_part, out, ready, hidden,
        K=top_k, TWO=len(parts) == 2, BLOCK=block, num_warps=SUM_WARPS, **pdl,
    )  # fmt: skip
    return out


def sum_when_ready(
    parts: Sequence[torch.Tensor],
    cpu_part: torch.Tensor,
    sync: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The routes' sum of the device parts plus the CPU's part once its epoch is done, in
    `dtype`: the Triton kernels on CUDA, the reference elsewhere."""
    if parts[0].is_cuda:
        return sum_when_ready_triton(parts, cpu_part, sync, dtype=dtype)
    return sum_when_ready_ref(parts, cpu_part, sync, dtype=dtype)


def sum_norm_when_ready_ref(
    parts: Sequence[torch.Tensor],
    cpu_part: torch.Tensor,
    sync: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    timeout_s: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `sum_when_ready_ref` in the residual's dtype, then the residual add and the
    RMSNorm after the MoE layer (`fused_add_rmsnorm_ref`): (normed, new_residual)."""
    _check_norm(parts, residual, weight)
    routed = sum_when_ready_ref(parts, cpu_part, sync, timeout_s, dtype=residual.dtype)
    return fused_add_rmsnorm_ref(routed, residual, weight, eps)


@triton.jit
def _poll_epoch(sync_ptr, offs, max_polls):
    """Whether the CPU's epoch is done (DONE >= EXPECTED), polled by the one thread that holds
    element 0 of offs (a row's offsets) and handed to every thread by a reduction; sets TIMED_OUT
    after max_polls polls. One thread, not the program: each warp that reads the host's word
    costs a PCIe round trip more, as reads of one address queue behind each other."""
    first = offs == 0
    at = offs * 0
    expected = tl.max(tl.load(sync_ptr + 8 + at, mask=first, other=0, volatile=True), axis=0)
    done = tl.max(tl.load(sync_ptr + at, mask=first, other=0, volatile=True), axis=0)
    polls = 0
    while (done < expected) & (polls < max_polls):
        done = tl.max(tl.load(sync_ptr + at, mask=first, other=0, volatile=True), axis=0)
        polls += 1
    ready = done >= expected
    if not ready:
        tl.store(sync_ptr + 16 + at, at + 1, mask=first)
    return ready


@triton.jit
def _sum_norm_kernel(
    y_ptr, y2_ptr, part_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, sync_ptr,
    ready_ptr, hidden, eps, max_polls,
    K: tl.constexpr, TWO: tl.constexpr, POLL: tl.constexpr, MODEL: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    common.pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    # everything on the device first: the parts, the residual and the weight are loaded while
    # the CPU job still runs
    acc = _routes_sum(y_ptr, y2_ptr, t, offs, mask, hidden, K, TWO, BLOCK)
    residual = tl.load(residual_ptr + t * hidden + offs, mask=mask, other=0.0)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    if POLL:  # noqa: SIM108 (one program, one token: it waits for the epoch itself)
        ready = _poll_epoch(sync_ptr, offs, max_polls)
    else:  # written by _wait_epoch_kernel just before
        ready = tl.load(ready_ptr) != 0
    part_len = tl.where(ready, hidden, 0)
    # volatile: read the host's memory now, never a copy cached before the epoch was seen
    part = tl.load(part_ptr + t * hidden + offs, mask=offs < part_len, other=0.0, volatile=True)
    # the MoE layer's output rounded once to the model's dtype, as sum_when_ready writes it
    x = add_residual((acc + part).to(MODEL), residual, MODEL)
    tl.store(new_residual_ptr + t * hidden + offs, x, mask=mask)
    out = norm_row(x, weight, hidden, eps, MODEL)
    tl.store(out_ptr + t * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def sum_norm_when_ready_triton(
    parts: Sequence[torch.Tensor],
    cpu_part: torch.Tensor,
    sync: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    max_polls: int = MAX_POLLS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: the same, graph-capturable. One token: one launch, whose program loads the device
    parts, the residual and the weight, then polls the epoch from one thread, reads the CPU's part
    and normalizes (the wait, the sum and the norm were three launches). More tokens: the one-warp
    wait, then the sum and the norm in one launch."""
    _check_sum(parts, cpu_part, sync)
    _check_norm(parts, residual, weight)
    y = parts[0]
    tokens, top_k, hidden = y.shape
    out = common.alloc(
        (tokens, hidden), torch.promote_types(weight.dtype, residual.dtype), y.device
    )
    new_residual = common.alloc((tokens, hidden), residual.dtype, y.device)
    ready = torch.empty(1, dtype=torch.int32, device=y.device)
    pdl = common.pdl_launch(y.device)
    poll = tokens == 1
    if not poll:
        _wait_epoch_kernel[(1,)](sync, ready, max_polls, num_warps=1, **pdl)
    block = common.next_pow2(hidden)
    _sum_norm_kernel[(tokens,)](
        y, parts[-1], cpu_part, residual, weight, out, new_residual, sync, ready, hidden, eps,
        max_polls, K=top_k, TWO=len(parts) == 2, POLL=poll, MODEL=common.tl_dtype(residual.dtype),
        BLOCK=block, num_warps=row_warps(block), **pdl,
    )  # fmt: skip
    return out, new_residual


def sum_norm_when_ready(
    parts: Sequence[torch.Tensor],
    cpu_part: torch.Tensor,
    sync: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer's output (the device parts' routes plus the CPU's part once its epoch is
    done, rounded to the residual's dtype) added to the residual and normalized by the RMSNorm
    that follows the layer: (normed, new_residual). The Triton kernels on CUDA, the reference
    elsewhere."""
    if parts[0].is_cuda:
        return sum_norm_when_ready_triton(parts, cpu_part, sync, residual, weight, eps)
    return sum_norm_when_ready_ref(parts, cpu_part, sync, residual, weight, eps)


def filled_mark(slot: int) -> int:
    """How a route slots table marks a route served by this step's fill of `slot`: -2 - slot
    (-1 is a route on the CPU; >= 0 a cached expert's slot)."""
    return -2 - slot


def route_slots_from_host_ref(
    slots_h: torch.Tensor, cached: torch.Tensor, filled: torch.Tensor
) -> None:
    """Reference: the planner's route slots (int32 [T, K] in host memory, `filled_mark` for the
    routes this step's fills serve) as two slot tables on the device: cached [T, K], the slot of
    each route to an expert already cached, and filled [T, K], that of each route to one being
    filled (-1 elsewhere in both)."""
    _check_route_slots(slots_h, cached, filled)
    slots = slots_h.to(cached.device)
    cached.copy_(torch.where(slots >= 0, slots, -1))
    filled.copy_(torch.where(slots <= -2, -2 - slots, -1))


@triton.jit
def _route_slots_from_host_kernel(
    slots_h_ptr, cached_ptr, filled_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    common.pdl_start(PDL)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    # volatile: the host wrote them just before the launch; never a copy cached before
    slots = tl.load(slots_h_ptr + offs, mask=mask, other=-1, volatile=True)
    tl.store(cached_ptr + offs, tl.where(slots >= 0, slots, -1), mask=mask)
    tl.store(filled_ptr + offs, tl.where(slots <= -2, -2 - slots, -1), mask=mask)


def route_slots_from_host_triton(
    slots_h: torch.Tensor, cached: torch.Tensor, filled: torch.Tensor
) -> None:
    """Triton: the same in one launch reading the (pinned) host table over PCIe; graph-capturable,
    and unlike a copy it never queues behind the fills on a copy engine."""
    _check_route_slots(slots_h, cached, filled)
    n = slots_h.numel()
    _route_slots_from_host_kernel[(1,)](
        slots_h, cached, filled, n, BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1,
        **common.pdl_launch(cached.device),
    )  # fmt: skip


def route_slots_from_host(
    slots_h: torch.Tensor, cached: torch.Tensor, filled: torch.Tensor
) -> None:
    """The planner's route slots into the device's two tables: the Triton kernel on a GPU, the
    reference elsewhere."""
    if cached.is_cuda:
        route_slots_from_host_triton(slots_h, cached, filled)
    else:
        route_slots_from_host_ref(slots_h, cached, filled)


def route_slots_from_map_ref(
    ids: torch.Tensor, slot_map_h: torch.Tensor, seq_lens: torch.Tensor, cached: torch.Tensor
) -> None:
    """Reference: the cached routes' slots looked up on the device, without the host's plan:
    cached[t, k] = slot_map_h[ids[t, k]] (the layer's row of the cache's slot map, int32 [E] in
    host memory: a slot, or -1 for an expert not cached), -1 for every route of a padding row
    (seq_lens[t] == 0)."""
    _check_route_map(ids, slot_map_h, seq_lens, cached)
    rows = seq_lens[: ids.shape[0]].to(cached.device)
    slots = slot_map_h.to(cached.device)[ids.long()]
    cached.copy_(torch.where(rows[:, None] > 0, slots, -1))


@triton.jit
def _route_slots_from_map_kernel(
    ids_ptr, map_h_ptr, lens_ptr, cached_ptr, n, top_k, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    common.pdl_start(PDL)  # then the router's ids are there
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    live = tl.load(lens_ptr + offs // top_k, mask=mask, other=0) > 0
    # volatile: the host wrote the row just before the launch; never a copy cached before
    slots = tl.load(map_h_ptr + ids, mask=mask & live, other=-1, volatile=True)
    tl.store(cached_ptr + offs, slots, mask=mask)


def route_slots_from_map_triton(
    ids: torch.Tensor, slot_map_h: torch.Tensor, seq_lens: torch.Tensor, cached: torch.Tensor
) -> None:
    """Triton: the same in one launch reading the (pinned) row over PCIe, one read a route;
    graph-capturable."""
    _check_route_map(ids, slot_map_h, seq_lens, cached)
    n = ids.numel()
    _route_slots_from_map_kernel[(1,)](
        ids, slot_map_h, seq_lens, cached, n, ids.shape[1],
        BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1, **common.pdl_launch(cached.device),
    )  # fmt: skip


def route_slots_from_map(
    ids: torch.Tensor, slot_map_h: torch.Tensor, seq_lens: torch.Tensor, cached: torch.Tensor
) -> None:
    """The cached routes' slots from the layer's row of the slot map: the Triton kernel on a GPU,
    the reference elsewhere."""
    if cached.is_cuda:
        route_slots_from_map_triton(ids, slot_map_h, seq_lens, cached)
    else:
        route_slots_from_map_ref(ids, slot_map_h, seq_lens, cached)


def _check_route_map(
    ids: torch.Tensor, slot_map_h: torch.Tensor, seq_lens: torch.Tensor, cached: torch.Tensor
) -> None:
    if ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous() or ids.dim() != 2:
        raise ValueError(f"ids must be a contiguous int32 or int64 [T, K] table, got {ids.dtype}")
    if cached.dtype != torch.int32 or not cached.is_contiguous():
        raise ValueError(f"cached must be a contiguous int32 table, got {cached.dtype}")
    if cached.shape != ids.shape or ids.device != cached.device:
        raise ValueError("cached must be the routes' shape, on their device")
    if slot_map_h.dtype != torch.int32 or slot_map_h.dim() != 1 or not slot_map_h.is_contiguous():
        raise ValueError("slot_map_h must be a contiguous int32 row [E]")
    if slot_map_h.device.type != "cpu" or (cached.is_cuda and not slot_map_h.is_pinned()):
        raise ValueError("slot_map_h must be in host memory, pinned where the routes are on a GPU")
    if seq_lens.dim() != 1 or seq_lens.shape[0] < ids.shape[0] or seq_lens.device != ids.device:
        raise ValueError("seq_lens must hold a length for every row of the routes, on their device")
    if ids.numel() > ROUTE_SLOTS_MAX:
        raise ValueError(f"at most {ROUTE_SLOTS_MAX} routes, got {ids.numel()}")


def _check_route_slots(slots_h: torch.Tensor, cached: torch.Tensor, filled: torch.Tensor) -> None:
    for name, t in (("slots_h", slots_h), ("cached", cached), ("filled", filled)):
        if t.dtype != torch.int32 or not t.is_contiguous() or t.shape != slots_h.shape:
            raise ValueError(
                f"{name} must be a contiguous int32 table of the route slots' shape "
                f"{tuple(slots_h.shape)}, got {tuple(t.shape)} {t.dtype}"
            )
    if slots_h.device.type != "cpu" or cached.device != filled.device:
        raise ValueError("slots_h must be in host memory, cached and filled on one device")
    if cached.is_cuda and not slots_h.is_pinned():
        raise ValueError("with the tables on a GPU, slots_h must be pinned host memory")
    if slots_h.numel() > ROUTE_SLOTS_MAX:
        raise ValueError(f"at most {ROUTE_SLOTS_MAX} routes, got {slots_h.numel()}")


def routing_to_host_ref(
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    ids_h: torch.Tensor,
    weights_h: torch.Tensor,
    x_h: torch.Tensor,
) -> None:
    """Reference: ids_h[:] = ids (as int32), weights_h[:] = weights, x_h[:] = x (as fp32); the
    destinations in host memory. Queued, not waited for, on a GPU (pinned destinations)."""
    _check_routing(ids, weights, x, ids_h, weights_h, x_h)
    ids_h.copy_(ids, non_blocking=True)
    weights_h.copy_(weights, non_blocking=True)
    x_h.copy_(x.float(), non_blocking=True)  # converted on the device


@triton.jit
def _routing_to_host_kernel(
    ids_ptr, w_ptr, x_ptr, ids_h_ptr, w_h_ptr, x_h_ptr, n_routes, n_x,
    BLOCK: tl.constexpr, ROUTES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    common.pdl_start(PDL)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_x
    tl.store(x_h_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float32), mask=mask)
    if pid == 0:
        r = tl.arange(0, ROUTES)
        rm = r < n_routes
        tl.store(ids_h_ptr + r, tl.load(ids_ptr + r, mask=rm).to(tl.int32), mask=rm)
        tl.store(w_h_ptr + r, tl.load(w_ptr + r, mask=rm).to(tl.float32), mask=rm)


def routing_to_host_triton(
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    ids_h: torch.Tensor,
    weights_h: torch.Tensor,
    x_h: torch.Tensor,
) -> None:
    """Triton: the same in one launch, storing into the (pinned) host memory from the device;
    graph-capturable. Inputs and destinations contiguous."""
    _check_routing(ids, weights, x, ids_h, weights_h, x_h)
    if not all(t.is_contiguous() for t in (ids, weights, x, ids_h, weights_h, x_h)):
        raise ValueError("routing_to_host_triton needs contiguous tensors")
    n_x, n_routes = x.numel(), ids.numel()
    grid = (max(1, triton.cdiv(n_x, BLOCK)),)
    _routing_to_host_kernel[grid](
        ids, weights, x, ids_h, weights_h, x_h, n_routes, n_x,
        BLOCK=BLOCK, ROUTES=max(16, triton.next_power_of_2(n_routes)),
        **common.pdl_launch(x.device),
    )  # fmt: skip


def routing_to_host(ids, weights, x, ids_h, weights_h, x_h) -> None:
    """A layer's routing into host buffers: the Triton kernel from a GPU, copies elsewhere."""
    if x.is_cuda and all(t.is_contiguous() for t in (ids, weights, x)):
        routing_to_host_triton(ids, weights, x, ids_h, weights_h, x_h)
    else:
        routing_to_host_ref(ids, weights, x, ids_h, weights_h, x_h)


def tokens_to_host_ref(tokens: torch.Tensor, tokens_h: torch.Tensor) -> None:
    """Reference: tokens_h[:] = tokens (int64 [n]; the destination in host memory). Queued, not
    waited for, on a GPU (a pinned destination)."""
    _check_tokens(tokens, tokens_h)
    tokens_h.copy_(tokens, non_blocking=True)


@triton.jit
def _tokens_to_host_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    common.pdl_start(PDL)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def tokens_to_host_triton(tokens: torch.Tensor, tokens_h: torch.Tensor) -> None:
    """Triton: the same from one program, storing into the (pinned) host memory from the device;
    graph-capturable (a decode step's greedy tokens, stored by its last piece: torch's copy to
    the host would cost the host a launch and a sync per step, after the graphs' launches)."""
    _check_tokens(tokens, tokens_h)
    if not (tokens.is_contiguous() and tokens_h.is_contiguous()):
        raise ValueError("tokens_to_host_triton needs contiguous tensors")
    n = tokens.numel()
    _tokens_to_host_kernel[(1,)](
        tokens, tokens_h, n, BLOCK=max(16, triton.next_power_of_2(n)),
        **common.pdl_launch(tokens.device),
    )  # fmt: skip


def tokens_to_host(tokens: torch.Tensor, tokens_h: torch.Tensor) -> None:
    """A step's tokens into a host buffer: the Triton kernel from a GPU, a copy elsewhere."""
    if tokens.is_cuda and tokens.is_contiguous():
        tokens_to_host_triton(tokens, tokens_h)
    else:
        tokens_to_host_ref(tokens, tokens_h)


def _check_tokens(tokens: torch.Tensor, tokens_h: torch.Tensor) -> None:
    if tokens.dtype != torch.int64 or tokens_h.dtype != torch.int64:
        raise ValueError("tokens and their host buffer must be int64")
    if tokens.dim() != 1 or tokens.shape != tokens_h.shape:
        raise ValueError(f"tokens must be [n] as their host buffer, got {tuple(tokens.shape)} -> "
                         f"{tuple(tokens_h.shape)}")  # fmt: skip
    if tokens_h.device.type != "cpu":
        raise ValueError("the tokens' buffer must be in host memory")
    if tokens.numel() > TOKENS_MAX:
        raise ValueError(f"at most {TOKENS_MAX} tokens, got {tokens.numel()}")


def _check_routing(ids, weights, x, ids_h, weights_h, x_h) -> None:
    if ids_h.dtype != torch.int32 or weights_h.dtype != torch.float32 or x_h.dtype != torch.float32:
        raise ValueError("the routing's host buffers must be int32 ids, fp32 weights and fp32 x")
    if ids.shape != ids_h.shape or weights.shape != weights_h.shape or x.shape != x_h.shape:
        raise ValueError(
            f"shapes differ: ids {tuple(ids.shape)} -> {tuple(ids_h.shape)}, weights "
            f"{tuple(weights.shape)} -> {tuple(weights_h.shape)}, x {tuple(x.shape)} -> "
            f"{tuple(x_h.shape)}"
        )
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError("ids and weights must be [T, K] and x [T, H] of one T")
    hosts = (ids_h, weights_h, x_h)
    if any(t.device.type != "cpu" for t in hosts):
        raise ValueError("the routing's buffers must be in host memory")
    if x.is_cuda and not all(t.is_pinned() for t in hosts):
        raise ValueError("from a GPU, the routing's host buffers must be pinned")


def _check_part(part: torch.Tensor, sync: torch.Tensor, device: torch.device) -> None:
    """The CPU's part and the handoff state, for device parts on `device`."""
    if part.dtype != torch.float32 or not part.is_contiguous():
        raise ValueError(f"the CPU's part must be contiguous fp32, got {part.dtype}")
    if sync.dtype != torch.int64 or sync.numel() < _SYNC_LEN or sync.device.type != "cpu":
        raise ValueError(f"sync must be a handoff_sync() tensor, got {sync.dtype} {sync.shape}")
    if device.type == "cuda":
        if not (part.is_pinned() and sync.is_pinned()):
            raise ValueError("with the output on a GPU, part and sync must be pinned host memory")
    elif part.device != device:
        raise ValueError(f"all tensors must be on one device: out on {device}, part on "
                         f"{part.device}")  # fmt: skip


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the sum is written in fp32, bf16 or fp16, not {dtype}")


def _check_norm(
    parts: Sequence[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor
) -> None:
    tokens, _, hidden = parts[0].shape
    if residual.shape != (tokens, hidden) or not residual.is_contiguous():
        raise ValueError(
            f"the residual must be contiguous [{tokens}, {hidden}], got {tuple(residual.shape)}"
        )
    _check_dtype(residual.dtype)
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"the norm's weight must be contiguous [{hidden}], got "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if residual.device != parts[0].device or weight.device != parts[0].device:
        raise ValueError("the residual and the norm's weight must be on the parts' device")


def _check_sum(parts: Sequence[torch.Tensor], cpu_part: torch.Tensor, sync: torch.Tensor) -> None:
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"sum_when_ready takes one or two device parts, got {len(parts)}")
    y = parts[0]
    for p in parts:
        if p.dtype != torch.float32 or p.dim() != 3 or p.shape != y.shape:
            raise ValueError(
                f"the parts must be fp32 [T, K, H] of one shape, got {tuple(p.shape)} {p.dtype}"
            )
        if not p.is_contiguous() or p.device != y.device:
            raise ValueError("the parts must be contiguous, on one device")
    tokens, _, hidden = y.shape
    if cpu_part.shape != (tokens, hidden):
        shape = tuple(cpu_part.shape)
        raise ValueError(f"the CPU's part must be [{tokens}, {hidden}], got {shape}")
    _check_part(cpu_part, sync, y.device)
