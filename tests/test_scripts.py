"""The measurement scripts the docs quote still run and print what the docs read from them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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


def test_split_recovery_sees_the_auto_split_come_back_to_the_cpu():
    """A real (tiny, CPU) engine: after the collapse the policy plans with 5% of the start-up
    CPU rate until the engine logs a return, which plans with more."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "split_recovery.py"), "--segments", "6",
         "--segment-tokens", "24", "--", "--preset", "tiny", "--moe-cache-rate", "0.5",
         "--warmup", "4"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["segment"] for r in rows] == ["before", 0, 1, 2, 3, 4, 5]
    assert all(r["tok_s"] > 0 and r["fetched"] + r["on_cpu"] > 0 for r in rows)
    collapsed = 0.05 * rows[0]["cpu_gbps_start"]
    came_back = next(i for i, r in enumerate(rows) if r["returns"] > 0)
    assert came_back >= 1 and "auto miss split: 96 layer steps with misses ran none" in run.stderr
    assert all(r["cpu_gbps_planned"] == pytest.approx(collapsed) for r in rows[1:came_back])
    assert rows[came_back]["cpu_gbps_planned"] > collapsed


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_decode_timeline_measures_each_layer_step(tmp_path):
    """A made-up trace of two layer steps, one with a fill and one without, in the shape
    torch's profiler writes: each figure is what the events say. A layer's routing ends with
    either kernel that stores it to the host."""
    events = [
        _kernel("_routing_to_host_kernel", 0, 2),  # step 1 starts at 2
        _kernel("Memcpy HtoD (Pinned -> Device)", 30, 200, "gpu_memcpy"),  # the fill: 30..230
        _kernel("_route_slots_from_host_kernel", 40, 3),
        _kernel("_one_token_gate_up_kernel", 45, 10),
        _kernel("_one_token_down_kernel", 56, 8),
        _kernel("_one_token_gate_up_kernel", 232, 4),  # the filled routes
        _kernel("_one_token_down_kernel", 237, 3),
        _kernel("_wait_epoch_kernel", 241, 2),
        _kernel("_sum_parts_kernel", 244, 5),  # ends at 249
        _kernel("Memcpy HtoD (Pinned -> Device)", 250, 1, "gpu_memcpy"),  # small: not a fill
        _kernel("_route_kernel", 290, 2),  # step 2 starts at 292 (the router in one launch)
        _kernel("_route_slots_from_host_kernel", 300, 3),
        _kernel("_wait_epoch_kernel", 330, 40),
        _kernel("_sum_parts_kernel", 371, 5),  # ends at 376
        _kernel("_routing_to_host_kernel", 420, 2),  # ends at 422
        # one token with nothing added to the routed output: the sum polls the epoch itself
        _kernel("Memcpy HtoD (Pinned -> Device)", 440, 100, "gpu_memcpy"),  # 440..540
        _kernel("_route_slots_from_host_kernel", 430, 3),
        _kernel("_one_token_gate_up_kernel", 435, 10),  # the cached routes, during the fill
        _kernel("_one_token_down_kernel", 446, 4),
        _kernel("_one_token_gate_up_kernel", 542, 4),  # the filled routes
        _kernel("_sum_norm_kernel", 547, 60),  # ends at 607
        _kernel("_route_kernel", 640, 2),  # ends at 642
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 10, "dur": 1},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_timeline.py"), str(trace)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    without, with_fill = (json.loads(line) for line in run.stdout.splitlines())
    # the fill kind's two steps: medians of two, and of one where only one has the field
    assert with_fill == {
        "kind": "1 copies", "layer_steps": 2, "period_us": 255, "routing_to_cached_head_us": 23,
        "sum_us": 32.5, "sum_to_next_routing_us": 39, "epoch_wait_us": 2,
        "routing_to_fill_us": 23, "fill_span_us": 150, "fill_end_to_sum_end_us": 43,
        "cached_moe_during_fills": 2,
    }  # fmt: skip
    assert without == {
        "kind": "0 copies", "layer_steps": 1, "period_us": 130, "routing_to_cached_head_us": 8,
        "sum_us": 5, "sum_to_next_routing_us": 46, "epoch_wait_us": 40,
    }  # fmt: skip


def _ab_decode():
    spec = importlib.util.spec_from_file_location("ab_decode", ROOT / "scripts" / "ab_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_decode_compares_runs_pair_by_pair():
    def run(tree: str, tok_s: float, share: float = 0.6, periods: dict | None = None) -> dict:
        return {
            "tree": tree,
            "tok_s": tok_s,
            "of_bound": share,
            "cpu_gbps": 90.0,
            "host_gbps": 99.0,
            "periods_us": periods or {},
        }

    runs = [
        run("A", 200.0, periods={"0+2s": 240.0, "0+0": 150.0}),
        run("B", 220.0, periods={"0+2s": 220.0, "1+3s": 370.0}),
        {"tree": "A", "error": "exit 1, see a2.log"}, run("B", 300.0),  # this pair is left out
        run("A", 250.0, 0.7, {"0+2s": 236.0}), run("B", 250.0, 0.5, {"0+2s": 224.0, "0+0": 110.0}),
    ]  # fmt: skip
    out = _ab_decode().summary(runs, "A", "B")
    assert out["a"] == {"tree": "A", "runs": 2, "tok_s": 225.0, "of_bound": pytest.approx(0.65)}
    assert out["b"]["runs"] == 3 and out["b"]["tok_s"] == pytest.approx(770 / 3)
    assert out["b_over_a"] == {"mean": pytest.approx(1.05), "min": 1.0, "max": 1.1, "pairs": 2}
    # the plans both trees made (1+3s only B's), each tree's mean over the runs that made it
    assert out["periods_us"] == {
        "0+0": {"a": 150.0, "b": 110.0, "b_minus_a": -40.0},
        "0+2s": {"a": 238.0, "b": 222.0, "b_minus_a": -16.0},
    }
    assert out["disturbed_pairs"] == 0
    assert _ab_decode().summary([runs[2]], "A", "B")["b_over_a"] is None


def test_ab_decode_leaves_out_runs_on_a_host_that_took_the_cpus():
    def run(tree: str, tok_s: float, steal: float | None, periods: dict) -> dict:
        return {"tree": tree, "tok_s": tok_s, "of_bound": tok_s / 400, "steal_share": steal,
                "periods_us": periods}  # fmt: skip

    runs = [
        run("A", 300.0, 0.004, {"0+2s": 230.0}), run("B", 330.0, 0.002, {"0+2s": 210.0}),
        run("A", 320.0, 0.003, {"0+2s": 220.0}), run("B", 140.0, 0.085, {"0+2s": 400.0}),
        run("A", 95.0, 0.097, {"0+2s": 540.0}), run("B", 340.0, None, {"0+2s": 200.0}),
    ]  # fmt: skip
    out = _ab_decode().summary(runs, "A", "B")
    assert out["disturbed_pairs"] == 2
    assert out["b_over_a"] == {"mean": 1.1, "min": 1.1, "max": 1.1, "pairs": 1}
    # the disturbed runs are out of their trees' means and periods, their partners are in
    assert out["a"] == {"tree": "A", "runs": 2, "tok_s": 310.0, "of_bound": 310.0 / 400}
    assert out["b"]["runs"] == 2 and out["b"]["tok_s"] == 335.0
    assert out["periods_us"] == {"0+2s": {"a": 225.0, "b": 205.0, "b_minus_a": -20.0}}
    # a looser screen keeps them all
    loose = _ab_decode().summary(runs, "A", "B", max_steal=0.1)
    assert loose["disturbed_pairs"] == 0 and loose["b_over_a"]["pairs"] == 3


def test_ab_decode_takes_the_worst_steal_of_a_process_runs(tmp_path, monkeypatch):
    module = _ab_decode()
    result = {
        "decode_tok_s": 300.0, "achieved_of_bound": 0.7, "host_gbps": 99.0,
        "host_disturbance": {"steal_share": 0.001},
        "runs": [{"host_disturbance": {"steal_share": 0.001}},
                 {"host_disturbance": {"steal_share": 0.06}}],
    }  # fmt: skip

    def fake_run(cmd, **kwargs):
        out = json.dumps(result) if "bench" in cmd else ""
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    r = module.run_once(tmp_path, tmp_path / "cache", ["--preset", "tiny"], tmp_path / "a1.log")
    assert r["steal_share"] == 0.06 and r["tok_s"] == 300.0


def test_ab_decode_refuses_a_folder_that_is_no_source_tree(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ab_decode.py"), str(tmp_path), str(ROOT),
         "--pairs", "1", "--", "--preset", "tiny"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "is not a moelab source tree" in run.stderr


def test_ab_decode_runs_one_tree_with_and_without_a_flag(tmp_path, monkeypatch, capsys):
    """--a-flags / --b-flags: each side's runs get their own flags, the tree is installed once,
    and the summary tells the sides apart by their flags; one tree with the same flags twice is
    refused."""
    module = _ab_decode()
    calls = []

    def fake_run_once(tree, cache, flags, log, install=True):
        calls.append((flags, install))
        prefetch = "--moe-cpu-prefetch-rounds" in flags
        return {"tree": str(tree), "tok_s": 330.0 if prefetch else 300.0, "of_bound": 0.7}

    monkeypatch.setattr(module, "run_once", fake_run_once)
    argv = [str(ROOT), str(ROOT), "--pairs", "2", "--out", str(tmp_path), "--b-flags",
            "--moe-cpu-prefetch-rounds 2", "--", "--preset", "tiny"]  # fmt: skip
    assert module.main(argv) == 0
    plain, prefetch = ["--preset", "tiny"], ["--preset", "tiny", "--moe-cpu-prefetch-rounds", "2"]
    assert calls == [(plain, True), (prefetch, False), (plain, False), (prefetch, False)]
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["b"]["tree"] == f"{ROOT} --moe-cpu-prefetch-rounds 2" and out["a"]["runs"] == 2
    assert out["b_over_a"]["mean"] == pytest.approx(1.1)
    with pytest.raises(SystemExit):
        module.main([str(ROOT), str(ROOT), "--out", str(tmp_path), "--", "--preset", "tiny"])
    assert "nothing to compare" in capsys.readouterr().err


def test_guess_accuracy_compares_the_guess_with_the_routing():
    """On the tiny synthetic model the engine's guess names most of the routed experts, where a
    guess at random would name top-k / experts of them (1 in 8): the first MoE layer's from the
    embedding, each later one's from after the sum (beside the router input before)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "guess_accuracy.py"), "--tokens", "48", "--",
         "--preset", "tiny", "--routing-skew", "1", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    froms = ["embedding", "after the sum", "router input before"]
    assert [r["guess_from"] for r in rows[:3]] == froms
    assert len(rows) == 2 * len({r["layer"] for r in rows}) - 1 >= 3
    for r in rows:
        assert all(0 <= r[k] <= 1 for k in ("routed_named", "tail_exact", "tail_named"))
    assert all(r["routed_named"] > 0.5 for r in rows if r["guess_from"] in froms[:2])


def test_mgr_restart_times_mgr_over_a_trial_engine_left_loading(tmp_path):
    model = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, "-m", "moelab.engine.cli", "synth", "--preset", "tiny", "--out",
         str(model)],
        capture_output=True, timeout=300, check=True,
    )  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mgr_restart.py"), str(model), "1", "0.5", "--",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert line["database_mb"] >= 1 and line["answered_after_s"] > 0
