"""`python -m moelab.autotune` on the demo model: the command the GPU runs of the benchmark use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_one_run_without_mgr_prints_trials_and_the_overhead(
    demo_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "moelab.autotune", "--model-path", str(demo_model), "--mode",
         "quick", "--objective", "decode", "--base-flags", "--device-memory 1GiB",
         "--only", "moe-miss-policy", "--target-s", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["flags"][:2] == ["--device-memory", "1GiB"]
    trials = [line for line in done.stdout.splitlines() if line.startswith("trial ")]
    # calibration, 3 baseline runs, 2 policies, context
    assert len(trials) == result["overhead"]["trials"] >= 6
    assert trials[0] == "trial 1 (calibration): the flags as they are"
    assert "trial 1: calibration: calibration: " in done.stdout
    workload = result["workload"]
    assert workload["target_s"] == 2.0 and workload["calibration_trial"] == 1
    assert "restart + warm-up" in done.stdout and 0 < result["overhead"]["share"] < 1
    per_trial = result["overhead"]["workload_s_per_trial"]
    assert f"workload {per_trial:.1f} s per trial (target 2 s)" in done.stdout


def test_a_missing_checkpoint_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "moelab.autotune", "--model-path", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("cannot read")
    assert "Traceback" not in done.stderr
