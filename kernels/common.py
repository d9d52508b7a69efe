"""Helpers shared by the Triton kernels: dtype mapping, buffer allocation, argument checks, and
programmatic dependent launch, and the count of compiled kernels. The kernel modules take Triton
from here: where it is not installed (a CPU-only install), its stand-in `no_triton`, whose kernels
say so when launched (HAVE_TRITON is False)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError:  # a CPU-only install: the engine runs the kernels' torch references
    from . import no_triton as triton

    tl = triton.language
    JITFunction = triton.JITFunction
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

try:  # programmatic dependent launch's intrinsics, where this triton has them
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton, or none: programmatic dependent launch off
    gdc_launch_dependents = gdc_wait = None

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """Map a torch floating dtype to the Triton dtype the kernels compute in."""
    if dtype not in _TL_DTYPES:
        raise ValueError(
            f"unsupported dtype {dtype}: the kernels take float32, bfloat16 or float16"
        )
    return _TL_DTYPES[dtype]


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a buffer a kernel fills completely (tests replace this to poison every buffer)."""
    return torch.empty(shape, dtype=dtype, device=device)


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), minimum)


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors, used to size split grids; off-GPU, 132 (the count of
    the Hopper GPUs the kernels are tuned for)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=8)
def pdl(device: torch.device) -> bool:
    """Whether the decode kernels on `device` use programmatic dependent launch (PDL): each is
    launched with `launch_pdl` and starts with `pdl_start`, so that on a Hopper GPU or later it is
    placed on the SMs while the kernel before it in the stream still runs, and waits there for
    that kernel's writes instead of being launched after it ends. Off on the CPU, under the Triton
    interpreter, on ROCm, before compute capability 9.0, with a triton that lacks it, and with
    MOELAB_PDL=0 (to measure what it gains)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.version.hip is not None:  # an NVIDIA launch attribute and instruction
        return False
    if os.environ.get("MOELAB_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def inline_ptx(device: torch.device) -> bool:
    """Whether kernels on `device` may use inline PTX (`signal_host`): an NVIDIA GPU, never the
    Triton interpreter (which runs no assembly) or ROCm."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET") != "1"
    )


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A decode kernel's launch settings for `device`, the two always together: its `PDL`
    constexpr (whether `pdl_start` waits) and Triton's `launch_pdl`."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait until the kernel before it in the stream has
    finished and its writes are visible, then let the kernel after it be placed (it will wait the
    same way). Every kernel launched with `launch_pdl` must call it before it reads anything
    another kernel wrote, and call it unconditionally: a kernel that skipped the wait could end
    before the one before it, and the next kernel's wait would cover neither."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """`pdl_start` without the early release: wait for the kernel before, and let the kernel after
    be placed only as this one's programs end (the implicit release). For a wide grid that fills
    the SMs itself (decode attention's context slices): released early, the next kernels' programs
    are placed among its own and slow it down, most at long contexts (docs/kernels.md)."""
    if PDL:
        gdc_wait()


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Raise a clear error when a tensor's rows are not contiguous (kernels step rows by stride)."""
    if tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (got strides {tensor.stride()})"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise a clear error when the tensors of one call live on different devices."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on one device: {listed}")


def check_expert_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Validate w13 [S, 2I, H] and w2 [S, H, I] against x [T, H]."""
    hidden = x.shape[1]
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [S, 2I, H] with H={hidden}, got {tuple(w13.shape)}")
    inter = w13.shape[1] // 2
    if w2.dim() != 3 or w2.shape != (w13.shape[0], hidden, inter):
        raise ValueError(
            f"w2 must be [S, H, I] = {(w13.shape[0], hidden, inter)}, got {tuple(w2.shape)}"
        )
    for name, tensor in (("x", x), ("w13", w13), ("w2", w2)):
        check_last_dim_contiguous(name, tensor)


def check_routes(
    x: torch.Tensor,
    ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    ids_name: str,
) -> None:
    """Validate x [T, H], routed ids and weights [T, K] and the expert weights (metadata only: no
    device sync), naming the ids as the caller calls them."""
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"x must be [T, H] and {ids_name} [T, K]: got {tuple(x.shape)} and {tuple(ids.shape)}"
        )
    if route_weights.shape != ids.shape:
        raise ValueError(
            f"route_weights {tuple(route_weights.shape)} must match {ids_name} {tuple(ids.shape)}"
        )
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{ids_name} must be int32 or int64, got {ids.dtype}")
    check_expert_weights(x, w13, w2)
    check_same_device(x=x, **{ids_name: ids}, route_weights=route_weights, w13=w13, w2=w2)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to the nearest `dtype` value (ties to even), kept in fp32."""
    if dtype == tl.bfloat16:
        # By hand: the Triton interpreter truncates fp32 -> bf16; this rounds alike on both.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def device_counter(
    counters: dict[torch.device, torch.Tensor], device: torch.device, who: str
) -> torch.Tensor:
    """The device's int32 count of a kernel's programs done (`counters` holds one per device):
    zeroed once, and back to zero at the end of each launch (its last program zeroes it). Made
    outside a CUDA graph capture, where its zeroing would run only at the graph's replays."""
    if device not in counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{who}'s first call on a device must come before a CUDA graph capture "
                "(it makes the device's counter): call it once eagerly, as a warm-up does"
            )
        counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counters[device]


def compiled_variants(kernels: Iterable[JITFunction] | None = None) -> int:
    """How many kernels Triton compiled in this process, one per specialization and device (a
    new one stalls its launch for a compilation): of `kernels`, or of every kernel in this
    package's imported modules. 0 under the interpreter, which compiles none."""
    if kernels is None:
        package = __name__.rpartition(".")[0]
        kernels = [
            kernel
            for name, module in list(sys.modules.items())
            if name.startswith(package + ".")
            for kernel in vars(module).values()
            if isinstance(kernel, JITFunction)
        ]
    # each device's cache is a tuple whose first entry holds the compiled kernels by key (triton
    # 3.6 and 3.9)
    caches = (getattr(k, "device_caches", {}) for k in kernels)  # none: interpreted
    return sum(len(by_device[0]) for c in caches for by_device in c.values())
