"""The decode attention's compiled kernels follow the block table's width, not the sequence's
length: why the engine's eager decode steps on CUDA pass tables as wide as the graphs'
(engine/runtime/stepping.py, `_batch`). Compiled for sm_90 without a GPU, as test_hopper_compile.py
does; also checks that `common.compiled_variants` counts Triton's compiled kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_attention_compiles_per_table_width_and_never_per_length():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_variants.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout)
    # two launches (the slices, their merge), compiled once at the graphs' width for any length
    assert counts["graphs_width"] == counts["graphs_width_longer"] == 2
    # each new width compiles both again: its slices' count and the table's stride are compiled in
    assert counts["warmup_width"] == 4
    assert counts["timed_width"] == counts["timed_width_again"] == 6
    # the package's count holds these and nothing else was launched
    assert counts["package"] == 6
