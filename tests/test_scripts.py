"""The measurement scripts the docs quote still run and print what the docs read from them."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_decode_timeline_measures_each_layer_step(tmp_path):
    """A made-up trace of two layer steps, one with a fill and one without, in the shape
    torch's profiler writes: each figure is what the events say. A layer's routing ends with
    either kernel that stores it to the host. A step's kernels count the next routing's, and
    their busy time is the union of their runs (the sum's 60 µs and the cached routes' 14 in
    the last step: 83 µs of its 220)."""
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
        "kind": "1 copies", "layer_steps": 2, "period_us": 255, "kernels": 7,
        "kernel_busy_us": 60, "routing_to_cached_head_us": 23,
        "sum_us": 32.5, "sum_to_next_routing_us": 39, "epoch_wait_us": 2,
        "routing_to_fill_us": 23, "fill_span_us": 150, "fill_end_to_sum_end_us": 43,
        "cached_moe_during_fills": 2,
    }  # fmt: skip
    assert without == {
        "kind": "0 copies", "layer_steps": 1, "period_us": 130, "kernels": 4,
        "kernel_busy_us": 50, "routing_to_cached_head_us": 8,
        "sum_us": 5, "sum_to_next_routing_us": 46, "epoch_wait_us": 40,
    }  # fmt: skip
    # the same trace gzipped, as gpu_suite.sh's timeline part keeps it
    packed = tmp_path / "trace.json.gz"
    packed.write_bytes(gzip.compress(trace.read_bytes()))
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_timeline.py"), str(packed)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert again.stdout == run.stdout


def _step(launch: int, at: float, moe_us: float) -> list[dict]:
    """A made-up resident step of 8 kernels from `at`, all from graph launch `launch`: the o
    projection placed early (PDL) while the qkv one runs, and `moe_us` of MoE."""
    kernels = [
        ("norm", 0, 2), ("gemv", 3, 7), ("gemv", 9, 6), ("attention", 15, 5), ("gemv", 22, 8),
        ("moe", 30, moe_us), ("norm", 31 + moe_us, 1), ("_pick_kernel", 40 + moe_us, 2),
    ]  # fmt: skip
    return [
        _kernel(name, at + ts, dur) | {"args": {"correlation": launch}} for name, ts, dur in kernels
    ]


def test_decode_timeline_breaks_whole_steps_down_by_kernel(tmp_path):
    """--steps: three graph launches of 8 kernels make two measured steps (the first only ends
    the idle time before the second), each from the last kernel's end of the step before, with
    the copies and memsets that start between the two (one, then two of 3 µs in all); a
    launch of 2 kernels and kernels without a launch are not steps; kernels launched one by one
    are cut into steps at each token pick. Each kernel's own time is
    its run after every kernel before it ended, so the overlapped o projection adds 5 µs, not 6;
    own times add up to the busy time and the idle times before kernels to the rest."""
    events = [
        *_step(11, 0, 30),  # ends at 72
        *_step(12, 100, 30),  # ends at 172: a period of 100, 40 of it idle
        _kernel("Memcpy DtoH (Device -> Pinned)", 80, 1, "gpu_memcpy"),  # between steps 11, 12
        _kernel("Memcpy HtoD (Pinned -> Device)", 175, 2, "gpu_memcpy"),  # and two between
        _kernel("Memset (Device)", 190, 1, "gpu_memset"),  # 12 and 13
        _kernel("Memcpy HtoD (Pinned -> Device)", 210, 1, "gpu_memcpy"),  # inside step 13
        _kernel("copy", 180, 1) | {"args": {"correlation": 99}},
        _kernel("copy", 182, 1) | {"args": {"correlation": 99}},
        _kernel("eager", 185, 1),
        *_step(13, 200, 50),  # ends at 292: a period of 120
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_timeline.py"), "--steps", str(trace)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    steps = {"steps": 2, "period_us": 110, "kernels": 8, "kernel_busy_us": 70, "idle_us": 40}
    assert rows == [
        steps | {"copies_between": 1.5, "copies_between_us": 2},
        {"kernel": "moe", "launches": 1, "own_us": 40, "idle_before_us": 0},
        {"kernel": "gemv", "launches": 3, "own_us": 20, "idle_before_us": 3},
        {"kernel": "attention", "launches": 1, "own_us": 5, "idle_before_us": 0},
        {"kernel": "norm", "launches": 2, "own_us": 3, "idle_before_us": 29},
        {"kernel": "_pick_kernel", "launches": 1, "own_us": 2, "idle_before_us": 8},
    ]
    # the same steps launched kernel by kernel (no shared correlation): cut at each token pick
    eager = [{k: v for k, v in e.items() if k != "args"} for e in events if e["name"] != "copy"]
    eager = [e for e in eager if e["name"] != "eager"]
    trace.write_text(json.dumps({"traceEvents": eager}))
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_timeline.py"), "--steps", str(trace)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert [json.loads(line) for line in again.stdout.splitlines()] == rows
    # kernels outside any graph launch of a step's size: no steps, and the error says so
    flat = tmp_path / "eager.json"
    flat.write_text(json.dumps({"traceEvents": [_kernel("eager", t, 1) for t in range(20)]}))
    none = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_timeline.py"), "--steps", str(flat)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert none.returncode == 1 and "no two decode steps" in none.stderr


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


def test_host_step_times_overlapped_steps_whose_tokens_land():
    """The host's work a step: the steps overlap (one stays in flight) and each step the loop
    times hands out the token of the step before it."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "host_step.py"), "--layers", "2", "--steps",
         "30"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    timed, landed = run.stdout.splitlines()[-2:]
    assert timed.startswith("host work a step: ") and float(timed.split()[4]) > 0
    # 80 steps: the prompt's hands out a token, the first decode step only launches, and each
    # later one lands the step before it
    assert landed == "tokens handed out: 79"


def test_prefix_cache_ttft_resumes_a_hybrid_chat_where_its_messages_end(tmp_path):
    """A hybrid model keeps its state where the server says a chat's messages end: the script
    names the system prompt's end, from which a second turn resumes (its last whole page)."""
    from tests.engine.test_hybrid import build_hybrid

    build_hybrid("qwen3_5_moe_text", tmp_path / "model")
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prefix_cache_ttft.py"), "--model-path",
         str(tmp_path / "model"), "--system", "300", "--question", "20", "--reply", "8",
         "--turns", "2", "--device", "cpu", "--log-level", "warning"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    first, second = (line.split() for line in run.stdout.splitlines()[-2:])
    assert first[:3] == ["1", "320", "0"]
    assert second[:3] == ["2", "348", "288"]  # the 300-token system prompt: 18 pages of 16


def test_the_cache_admission_model_keeps_hot_experts_where_lru_thrashes():
    """scripts/cache_admission_sim.py: a cache a quarter of one layer's experts over four layers,
    eight tokens a step, churns under LRU (every fill goes in at the recent end); keeping back a
    fill rarer than what it evicts holds the hot experts. One token a step fills rarely, so the
    two rules are close there."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cache_admission_sim.py"), "--layers", "4",
         "--experts", "32", "--slots", "32", "--steps", "120"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    rates = {}
    for line in run.stdout.splitlines():
        batch, rest = line.split(": ")
        rates[batch] = {r: float(h) for r, h in (part.split() for part in rest.split(", "))}
    assert set(rates) == {"batch 1", "batch 8"}
    assert rates["batch 8"]["frequency"] > rates["batch 8"]["lru"] + 0.05
    assert abs(rates["batch 1"]["frequency"] - rates["batch 1"]["lru"]) < 0.1


def test_plan_time_times_the_native_plan_of_each_layer_step():
    """The native planner's time a layer step over a small cache: the steps after the cache's
    fill, each timed, and the hit rate of their lookups."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan_time.py"), "--layers", "4", "--experts",
         "16", "--top-k", "4", "--slots", "24", "--rounds", "8"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    line = run.stdout.splitlines()[-1]
    assert line.startswith("24 layer steps over 24 slots, hits 0."), line
    median = float(line.split("plan ")[1].split()[0])
    assert median > 0
    bad = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan_time.py"), "--slots", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "--slots must be in 1..10240" in bad.stderr


def test_moe_kernel_ncu_reads_its_tiles_and_refuses_unknown_formats():
    """The profiler's driver: the 4-bit tiles from their short form, and a clear refusal of a
    format it does not have (the launches themselves need the GPU: gpu_suite.sh's ncu_moe)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import moe_kernel_ncu
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    tiles = moe_kernel_ncu.parse_tiles("8x1024,16x256,8w,2s")
    assert (tiles.gate_up_block_n, tiles.gate_up_block_k) == (8, 1024)
    assert (tiles.down_block_n, tiles.down_block_k, tiles.num_warps, tiles.num_stages) == (
        16, 256, 8, 2,
    )  # fmt: skip
    assert tiles.down_stages == 1, "down's loads straight to registers unless told"
    assert moe_kernel_ncu.parse_tiles("8x1024,16x256,8w,2s,3ds").down_stages == 3
    bad = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "moe_kernel_ncu.py"), "--formats", "fp8,int3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "--formats: unknown int3" in bad.stderr
