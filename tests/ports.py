"""Ports for the servers the tests start, free of the two ways a free port gets taken under us.

A port the kernel hands out for `bind(0)` comes from the ephemeral range, the same range every
outgoing connection's local port is drawn from: between the test's choice and an engine's own bind
(seconds later, after torch has loaded) another test's client could take it. And the tests run in
two or more processes (pytest-xdist) that choose at the same time. So each worker draws from its
own block below the ephemeral range, and never hands out the same port twice in a run.
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


def _candidates() -> itertools.cycle:
    start = FIRST + BLOCK * _worker()
    block = [p for p in range(start, start + BLOCK) if p not in _ephemeral()]
    offset = random.randrange(len(block))  # a rerun soon after does not meet TIME_WAIT ports
    return itertools.cycle(block[offset:] + block[:offset])


_NEXT = _candidates()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, in this worker's block, not handed out before in this run
    (until the block wraps around)."""
    for _ in range(BLOCK):
        port = next(_NEXT)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block of {BLOCK}")
