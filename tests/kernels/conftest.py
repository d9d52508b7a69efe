"""Kernel tests: the Triton interpreter when there is no GPU, poisoned buffers, per-test seeds."""

from __future__ import annotations

import importlib
import os
import sys
import zlib
from collections.abc import Iterator

import pytest
import torch

# The modules that define Triton kernels (common first: the others import it).
TRITON_MODULES = ("common", "fused_moe", "grouped_moe", "paged_attention", "rmsnorm", "router")

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated: set it before the kernel modules are imported,
    # and re-decorate any that another test package imported first.
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in TRITON_MODULES:
        if f"moelab.kernels.{_name}" in sys.modules:
            importlib.reload(sys.modules[f"moelab.kernels.{_name}"])

from moelab.kernels import common  # noqa: E402


def poisoned_alloc(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A buffer full of a value no kernel writes: NaN for floats, the lowest int for integers."""
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer a kernel wrapper allocates starts poisoned, so an unwritten element shows."""
    monkeypatch.setattr(common, "alloc", poisoned_alloc)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> Iterator[torch.Generator]:
    """A generator seeded from the test's name: fresh inputs per test, reproducible per test."""
    generator = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield generator
