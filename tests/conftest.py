"""Test session setup shared by every folder."""

from __future__ import annotations

import os
from pathlib import Path

# Triton must be told to interpret before anything imports it; engine tests import the kernels
# during collection. On a machine with an NVIDIA GPU the kernels run for real.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
