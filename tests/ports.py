"""Ports for the servers the tests start, free of the two ways a free port gets taken under us.

A port the kernel hands out for `bind(0)` comes from the ephemeral range, the same range every
outgoing connection's local port is drawn from: between the test's choice and an engine's own bind
(seconds later, after torch has loaded) another test's client could take it. And the tests run in
two or more processes (pytest-xdist) that choose at the same time. So each worker draws from its
own block below the ephemeral range (eleven blocks under Linux's default range; more workers
share them), and never hands out the same port twice in a run.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

FIRST, BLOCK = 10_000, 2_000


def _ephemeral() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32_768, 60_999
    return range(low, high + 1)


def _worker() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw0", "gw1", ...
    return int(name[2:]) if name[2:].isdigit() else 0


def _candidates() -> itertools.cycle | None:
    """This worker's ports in turn, from a random one (a rerun soon after does not meet the ports
    left in TIME_WAIT); None where no block lies below the ephemeral range."""
    blocks = (_ephemeral().start - FIRST) // BLOCK
    if blocks < 1:
        return None
    start = FIRST + BLOCK * (_worker() % blocks)
    block = list(range(start, start + BLOCK))
    offset = random.randrange(len(block))
    return itertools.cycle(block[offset:] + block[:offset])


_NEXT = _candidates()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, in this worker's block, not handed out before in this run
    (until the block wraps around); where the ephemeral range leaves no room for blocks, one the
    kernel picks."""
    if _NEXT is None:
        with socket.socket() as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    for _ in range(BLOCK):
        port = next(_NEXT)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block of {BLOCK}")
