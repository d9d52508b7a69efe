"""Test session setup shared by every folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton must be told to interpret before anything imports it; engine tests import the kernels
# during collection. On a machine with an NVIDIA GPU the kernels run for real.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository's root must be on sys.path so that `tests` imports, but behind site-packages: its
# folders are moelab's subpackages under plain names, and ahead of site-packages kernels/ hides
# Hugging Face's `kernels`, which transformers (the reference in the model tests) imports.
# pyproject's --import-mode=append makes pytest add it last; `python -m pytest` put it first.
_ROOT = Path(__file__).resolve().parent.parent
_at_root = [p for p in sys.path if Path(p or ".").resolve() == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _at_root] + [str(_ROOT)]


def pytest_runtest_makereport(item, call):
    """An engine that ended before it was ready: its log's last lines in the report, where the
    exception's own words only say that it ended."""
    from moelab.engine.process.launch import EngineFailed  # after TRITON_INTERPRET is set

    error = call.excinfo.value if call.excinfo is not None else None
    if isinstance(error, EngineFailed) and error.log_tail:
        item.add_report_section(call.when, "engine log", error.log_tail)
