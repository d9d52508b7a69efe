"""The measurement scripts the docs quote still run and print what the docs read from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_miss_split_sim_prints_one_line_per_rule():
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "miss_split_sim.py"), "--steps", "4", "--skew",
         "1", "--fraction", "0.39"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["rule"] for r in rows] == ["round", "whole", "split"]
    assert all(r["layer_steps"] == 48 and r["fraction"] == 0.39 for r in rows)
    assert rows[0]["split_share"] == rows[1]["split_share"] == 0 < rows[2]["split_share"]
    assert all(r["miss_us_per_layer_step"] > 0 for r in rows)


def test_telemetry_cost_counts_every_step_it_times(tmp_path):
    model = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, "-m", "moelab.engine.cli", "synth", "--preset", "tiny", "--out",
         str(model)],
        capture_output=True, timeout=300, check=True,
    )  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "telemetry_cost.py"), str(model), "300"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    line = run.stdout.strip().splitlines()[-1]  # the script asserts the counters saw every step
    assert line.startswith("telemetry host cost per decode step (3 MoE layers, batch 1): ")
    assert float(line.rsplit(" ", 2)[-2]) > 0
