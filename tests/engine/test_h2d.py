"""The decode step's own copies and stream joins as driver calls (`h2d.StreamOps`), on a GPU."""

from __future__ import annotations

import pytest
import torch

from moelab.engine.h2d import StreamOps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_copies_both_ways_run_in_the_streams_order():
    """Queued behind a kernel that sleeps: the copy to the device lands after it, in order with
    the stream's work, and the copy back to the host carries what the stream computed."""
    stream = torch.cuda.current_stream()
    ops = StreamOps(stream)
    src = torch.arange(1000, dtype=torch.int64).pin_memory()
    dst = torch.full((1000,), -1, dtype=torch.int64, device="cuda")
    back = torch.full((1000,), -1, dtype=torch.int64).pin_memory()
    torch.cuda._sleep(20_000_000)
    dst.fill_(7)  # before the copy in stream order: the copy overwrites it
    ops.copy(dst.data_ptr(), src.data_ptr(), src.nbytes)
    dst.mul_(2)
    ops.to_host(back.data_ptr(), dst.data_ptr(), 8 * 500)  # the first half only
    stream.synchronize()
    assert torch.equal(back[:500], 2 * src[:500]) and (back[500:] == -1).all()


def test_a_join_orders_the_stream_after_the_other_streams_work():
    """join(other): the stream's later work waits for what `other` had queued (as wait_stream),
    again and again with the one event."""
    stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    ops = StreamOps(stream)
    x = torch.zeros(1 << 20, device="cuda")
    for value in (3.0, 5.0):
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            x.fill_(value)
        ops.join(side)
        y = x * 2  # on the current stream: after the side stream's fill
        stream.synchronize()
        assert (y == 2 * value).all()
