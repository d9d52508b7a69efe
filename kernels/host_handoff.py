"""The CPU experts' output handed to the GPU without the host: a kernel that waits for it there.

In an offloaded decode step the CPU worker threads write their weighted sum of a layer's CPU routes
into pinned host memory, then a completion epoch (kernels/cpu_experts.py, `done_flag`). The next
piece of the step is queued before they finish; its `add_when_ready` polls the epoch over PCIe
and adds the CPU's sum to the GPU's once it is there. The host neither waits for the CPU job nor
copies its result nor launches the piece late: the GPU starts the moment the workers finish.

The handoff's state is one pinned int64 tensor (`handoff_sync`), a cache line per field:
- DONE: the last epoch the CPU has finished (written by the workers, or by the host when a layer
  has no CPU routes);
- EXPECTED: the epoch the next `add_when_ready` waits for (written by the host before it queues it);
- TIMED_OUT: set by the kernel when it gave up waiting (the host checks it after each sync).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from . import common

DONE, EXPECTED, TIMED_OUT = 0, 8, 16  # int64 indices: 64 bytes apart
_SYNC_LEN = 24
BLOCK = 1024
# Polls of the epoch before giving up: one is a PCIe round trip of about a microsecond, so a few
# seconds, where a CPU job takes well under a millisecond. The reference waits as long by the clock.
MAX_POLLS = 1 << 22
TIMEOUT_S = 5.0


def handoff_sync(pin: bool) -> torch.Tensor:
    """A zeroed handoff state in host memory (pinned, so a GPU kernel can read it, when pin)."""
    return torch.zeros(_SYNC_LEN, dtype=torch.int64, pin_memory=pin)


def add_when_ready_ref(
    out: torch.Tensor, part: torch.Tensor, sync: torch.Tensor, timeout_s: float | None = None
) -> torch.Tensor:
    """Reference: wait (on the host) until sync's DONE reaches EXPECTED, then out += part (in
    place; out fp32 [T, H], part fp32 [T, H] in host memory). On a timeout, sets TIMED_OUT and
    leaves out as it was."""
    _check(out, part, sync)
    state = sync.numpy()  # a view: each read sees the memory now
    deadline = time.monotonic() + (TIMEOUT_S if timeout_s is None else timeout_s)
    while state[DONE] < state[EXPECTED]:
        if time.monotonic() > deadline:
            state[TIMED_OUT] = 1
            return out
        time.sleep(0)
    out += part.to(out.device)
    return out


@triton.jit
def _add_when_ready_kernel(out_ptr, part_ptr, sync_ptr, n, max_polls, BLOCK: tl.constexpr):
    expected = tl.load(sync_ptr + 8, volatile=True)
    done = tl.load(sync_ptr, volatile=True)
    polls = 0
    while (done < expected) & (polls < max_polls):
        done = tl.load(sync_ptr, volatile=True)
        polls += 1
    if done < expected:
        tl.store(sync_ptr + 16, 1)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        # volatile: read the host's memory now, never a copy cached before the epoch was seen
        part = tl.load(part_ptr + offs, mask=mask, volatile=True)
        acc = tl.load(out_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, acc + part, mask=mask)


def add_when_ready_triton(
    out: torch.Tensor, part: torch.Tensor, sync: torch.Tensor, max_polls: int = MAX_POLLS
) -> torch.Tensor:
    """Triton: the same, waiting on the device (graph-capturable: no host sync). part and sync
    must be pinned host memory when out is on a GPU."""
    _check(out, part, sync)
    n = out.numel()
    _add_when_ready_kernel[(triton.cdiv(n, BLOCK),)](out, part, sync, n, max_polls, BLOCK=BLOCK)
    return out


def add_when_ready(out: torch.Tensor, part: torch.Tensor, sync: torch.Tensor) -> torch.Tensor:
    """out += part once the CPU has finished the awaited epoch: the Triton kernel on CUDA, the
    reference elsewhere."""
    if out.is_cuda:
        return add_when_ready_triton(out, part, sync)
    return add_when_ready_ref(out, part, sync)


def _check(out: torch.Tensor, part: torch.Tensor, sync: torch.Tensor) -> None:
    if out.dtype != torch.float32 or part.dtype != torch.float32 or out.shape != part.shape:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} and part {tuple(part.shape)} {part.dtype} must "
            "be fp32 of one shape"
        )
    if not (out.is_contiguous() and part.is_contiguous()):
        raise ValueError("out and part must be contiguous")
    if sync.dtype != torch.int64 or sync.numel() < _SYNC_LEN or sync.device.type != "cpu":
        raise ValueError(f"sync must be a handoff_sync() tensor, got {sync.dtype} {sync.shape}")
    if out.is_cuda and not (part.is_pinned() and sync.is_pinned()):
        raise ValueError("with out on a GPU, part and sync must be pinned host memory")
    if not out.is_cuda:
        common.check_same_device(out=out, part=part)
