"""Host-to-device copies as driver calls (`h2d.HostToDevice`), on a GPU: the slot fills on the
copy stream, and a decode step's inputs on the stream its graphs replay on."""

from __future__ import annotations

import pytest
import torch

from moelab.engine.experts.h2d import HostToDevice

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_copy_runs_in_its_streams_order():
    """Queued behind a kernel that sleeps: the copy lands after the work queued before it and
    before the work queued after it, and copies what the source holds when it runs."""
    stream = torch.cuda.current_stream()
    h2d = HostToDevice(stream)
    src = torch.arange(1000, dtype=torch.int64).pin_memory()
    dst = torch.full((1000,), -1, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(20_000_000)
    dst.fill_(7)  # before the copy in stream order: overwritten
    h2d.copy(dst.data_ptr() + 8 * 100, src.data_ptr() + 8 * 100, 8 * 500)  # elements 100-599
    dst.mul_(2)  # after it
    stream.synchronize()
    want = torch.full((1000,), 14, dtype=torch.int64)
    want[100:600] = 2 * src[100:600]
    assert torch.equal(dst.cpu(), want)
