"""Kernel tests: the Triton interpreter when there is no GPU, poisoned buffers, per-test seeds."""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator

import pytest
import torch

# Triton decides whether to interpret when it is imported (its own library functions are decorated
# then), so the variable must be set before anything imports triton.
TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from moelab.kernels import common  # noqa: E402


def poisoned_alloc(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A buffer full of a value no kernel writes: NaN for floats, the lowest int for integers."""
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, dtype=dtype, device=device)


@pytest.fixture
def triton_runs() -> None:
    """Fail with the cure, rather than with Triton's error, when the interpreter cannot run."""
    if TRITON_IMPORTED_TOO_EARLY and not torch.cuda.is_available():
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
            "on the CPU: set it in tests/conftest.py (or the environment) when there is no GPU"
        )


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer a kernel wrapper allocates starts poisoned, so an unwritten element shows."""
    monkeypatch.setattr(common, "alloc", poisoned_alloc)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> Iterator[torch.Generator]:
    """A generator seeded from the test's name: fresh inputs per test, reproducible per test."""
    generator = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield generator
