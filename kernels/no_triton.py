"""What the kernel modules see of Triton where it is not installed (a CPU-only install).

Triton comes with PyTorch's CUDA builds and runs the kernels on a GPU; a CPU-only install has no
use for it (the engine runs each kernel's torch reference off CUDA), so moelab does not require
it. Without it the kernel modules still define their kernels, as `JITFunction`s that say what
is missing when something launches one. `kernels/common.py` picks this module or Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

MISSING = (
    "Triton is not installed, and the engine's CUDA kernels need it: install PyTorch's CUDA "
    "build, which brings it, or `pip install 'moelab[cuda]'`; or run on the CPU (--device cpu)"
)


class TritonMissing(RuntimeError):
    """A Triton kernel was launched where Triton is not installed."""


class JITFunction:
    """A kernel that cannot run here: launching it raises TritonMissing."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        raise TritonMissing(f"{self.__name__}: {MISSING}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonMissing(f"{self.__name__}: {MISSING}")


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """`triton.jit`, bare or with options."""
    if fn is None:
        return JITFunction
    return JITFunction(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# the names the kernel modules read from triton.language outside their kernels
language = SimpleNamespace(
    float32="fp32", bfloat16="bf16", float16="fp16", dtype=str, constexpr=Any
)
