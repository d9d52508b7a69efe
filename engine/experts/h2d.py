"""Host-to-device copies for one driver call each: the offloaded decode step's slot fills, and
a decode step's inputs (engine/runtime/graphs.py); and the driver's graph launches and event waits,
which the decode planner calls to launch the next captured piece.

An offloaded decode layer step queues a few copies from pinned host memory (each fetched expert's
two matrices, the routes' slots) on the serial path between two captured pieces. torch's `copy_`
costs the host several times what the CUDA driver's cuMemcpyHtoDAsync does for the same copy
(operator dispatch, and an event recorded for the pinned allocator).
Addresses are computed, not viewed: making a tensor view costs as much as the call.

The sources must stay valid until the copy has run: the bank lives as long as the engine, and a
step's small pinned buffers are rewritten only after the next routing sync.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch


@functools.cache
def _driver_copy() -> ctypes._CFuncPtr:
    lib = ctypes.CDLL("libcuda.so.1")  # the driver torch itself runs on
    fn = lib.cuMemcpyHtoDAsync_v2
    fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _driver_query() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL("libcuda.so.1").cuStreamQuery
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _driver_memset2d() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL("libcuda.so.1").cuMemsetD2D8Async
    fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_ubyte, ctypes.c_size_t,
                   ctypes.c_size_t, ctypes.c_void_p]  # fmt: skip
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _driver_copy2d() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL("libcuda.so.1").cuMemcpy2DAsync_v2
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def driver_functions() -> tuple[int, int, int, int]:
    """The addresses of the driver's cuMemcpyHtoDAsync, cuStreamQuery, cuMemsetD2D8Async
    and cuMemcpy2DAsync, for native code that queues the same copies (the decode planner,
    kernels/cpu_experts.py)."""
    return tuple(
        address_of(fn()) for fn in (_driver_copy, _driver_query, _driver_memset2d, _driver_copy2d)
    )


@functools.cache
def _driver_launches() -> tuple[ctypes._CFuncPtr, ...]:
    lib = ctypes.CDLL("libcuda.so.1")
    launch, record, wait = lib.cuGraphLaunch, lib.cuEventRecord, lib.cuStreamWaitEvent
    launch.argtypes = record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    for fn in (launch, record, wait):
        fn.restype = ctypes.c_int
    return launch, record, wait


def launch_functions() -> tuple[int, int, int]:
    """The addresses of the driver's cuGraphLaunch, cuEventRecord and cuStreamWaitEvent, for
    native code that launches the next captured piece of a decode step (the decode planner)."""
    return tuple(address_of(fn) for fn in _driver_launches())


class DriverEvent:
    """A CUDA event of the driver's own (no timing), for native code to record and wait on; it
    lives as long as this object."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        handle = ctypes.c_void_p()
        _check(lib.cuEventCreate(ctypes.byref(handle), ctypes.c_uint(2)), "cuEventCreate")
        self.handle: int = handle.value or 0
        self._destroy = lib.cuEventDestroy_v2
        self._destroy.argtypes = [ctypes.c_void_p]

    def __del__(self) -> None:
        if getattr(self, "handle", 0):
            self._destroy(ctypes.c_void_p(self.handle))
            self.handle = 0


# The signatures of the driver functions above, for stand-ins written in Python
COPY_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_void_p)  # fmt: skip
QUERY_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
MEMSET2D_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t,
                                     ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_size_t,
                                     ctypes.c_void_p)  # fmt: skip
COPY2D_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
LAUNCH_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)  # and record
WAIT_EVENT_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_uint)  # fmt: skip


class Memcpy2D(ctypes.Structure):
    """cuda.h's CUDA_MEMCPY2D (memory types: 1 host, 2 device)."""

    _fields_ = [
        ("src_x_bytes", ctypes.c_size_t), ("src_y", ctypes.c_size_t),
        ("src_memory_type", ctypes.c_int), ("src_host", ctypes.c_void_p),
        ("src_device", ctypes.c_uint64), ("src_array", ctypes.c_void_p),
        ("src_pitch", ctypes.c_size_t),
        ("dst_x_bytes", ctypes.c_size_t), ("dst_y", ctypes.c_size_t),
        ("dst_memory_type", ctypes.c_int), ("dst_host", ctypes.c_void_p),
        ("dst_device", ctypes.c_uint64), ("dst_array", ctypes.c_void_p),
        ("dst_pitch", ctypes.c_size_t),
        ("width_bytes", ctypes.c_size_t), ("height", ctypes.c_size_t),
    ]  # fmt: skip


def host_functions(calls: dict[str, int] | None = None) -> tuple:
    """Stand-ins for the four functions of `driver_functions` that work on host memory (a
    device address is a host address there), counting their calls by name in `calls`: the
    native planner's CUDA path, run on the CPU (tests). Keep them alive while their addresses
    (`address_of`) are in use."""
    calls = {} if calls is None else calls

    def count(name: str) -> None:
        calls[name] = calls.get(name, 0) + 1

    def copy(dst: int, src: int, nbytes: int, stream: int) -> int:
        count("copy")
        ctypes.memmove(dst, src, nbytes)
        return 0

    def query(stream: int) -> int:  # every stream is idle
        count("query")
        return 0

    def memset2d(dst: int, pitch: int, value: int, width: int, height: int, stream: int) -> int:
        count("memset2d")
        for row in range(height):
            ctypes.memset(dst + row * pitch, value, width)
        return 0

    def copy2d(address: int, stream: int) -> int:
        count("copy2d")
        c = Memcpy2D.from_address(address)
        if (c.src_memory_type, c.dst_memory_type) != (1, 2) or c.src_x_bytes or c.dst_x_bytes:
            return 1  # CUDA_ERROR_INVALID_VALUE: only host-to-device copies from offset 0 here
        for row in range(c.height):
            ctypes.memmove(c.dst_device + (c.dst_y + row) * c.dst_pitch,
                           c.src_host + (c.src_y + row) * c.src_pitch, c.width_bytes)  # fmt: skip
        return 0

    return (COPY_FUNCTION(copy), QUERY_FUNCTION(query), MEMSET2D_FUNCTION(memset2d),
            COPY2D_FUNCTION(copy2d))  # fmt: skip


def host_launch_functions(
    replay: Callable[[int], None],
    calls: dict[str, int] | None = None,
    errors: list[BaseException] | None = None,
) -> tuple:
    """Stand-ins for the three functions of `launch_functions` on the CPU, where work runs as it
    is launched: a launch calls replay(handle) (a stand-in graph's work; what it raises goes into
    `errors`, and the launch fails as the driver's would), an event's record and a stream's wait
    for it only count (every copy has already landed there). Counts calls by name in `calls`.
    Keep them alive while their addresses (`address_of`) are in use."""
    calls = {} if calls is None else calls
    errors = [] if errors is None else errors

    def count(name: str) -> None:
        calls[name] = calls.get(name, 0) + 1

    def launch(handle: int, stream: int) -> int:
        count("launch")
        try:
            replay(handle)
        except Exception as e:  # a callback cannot raise into native code: a driver-like error
            errors.append(e)
            return 1
        return 0

    def record(event: int, stream: int) -> int:
        count("record")
        return 0

    def wait(stream: int, event: int, flags: int) -> int:
        count("wait_event")
        return 0

    return LAUNCH_FUNCTION(launch), LAUNCH_FUNCTION(record), WAIT_EVENT_FUNCTION(wait)


def address_of(function: ctypes._CFuncPtr) -> int:
    """A ctypes function's address (keep the function itself alive while it is used)."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0


class HostToDevice:
    """Queues copies from host memory into device memory on one CUDA stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._copy = _driver_copy()
        self._stream = ctypes.c_void_p(stream.cuda_stream)

    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        """Queue a copy of nbytes from host address src_ptr to device address dst_ptr."""
        _check(self._copy(dst_ptr, src_ptr, nbytes, self._stream), "cuMemcpyHtoDAsync")


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed with CUDA driver error {err}")
