"""Host-to-device copies for one driver call each: the offloaded decode step's slot fills.

An offloaded decode layer step queues a few copies from pinned host memory (each fetched expert's
two matrices, the routes' slots) on the serial path between two captured pieces. torch's `copy_`
costs the host 10-15 µs per such copy on an H200's host (operator dispatch, and an event recorded
for the pinned allocator); the CUDA driver's cuMemcpyHtoDAsync queues the same copy in 1-2 µs.
Addresses are computed, not viewed: making a tensor view costs as much as the call.

The sources must stay valid until the copy has run: the bank lives as long as the engine, and a
step's small pinned buffers are rewritten only after the next routing sync.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _driver_copy() -> ctypes._CFuncPtr:
    lib = ctypes.CDLL("libcuda.so.1")  # the driver torch itself runs on
    fn = lib.cuMemcpyHtoDAsync_v2
    fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _driver_sync() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL("libcuda.so.1").cuStreamSynchronize
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _driver_memset() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL("libcuda.so.1").cuMemsetD8Async
    fn.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def driver_functions() -> tuple[int, int, int]:
    """The addresses of the driver's cuMemcpyHtoDAsync, cuStreamSynchronize and cuMemsetD8Async,
    for native code that queues the same copies (the decode planner, kernels/cpu_experts.py)."""
    return tuple(
        ctypes.cast(fn(), ctypes.c_void_p).value or 0
        for fn in (_driver_copy, _driver_sync, _driver_memset)
    )


class HostToDevice:
    """Queues copies from host memory into device memory on one CUDA stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._copy = _driver_copy()
        self._stream = ctypes.c_void_p(stream.cuda_stream)

    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        """Queue a copy of nbytes from host address src_ptr to device address dst_ptr."""
        err = self._copy(dst_ptr, src_ptr, nbytes, self._stream)
        if err:
            raise RuntimeError(f"cuMemcpyHtoDAsync failed with CUDA driver error {err}")
