"""The `moelab` command line: synth, generate, flag errors, the loading state."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from moelab.autotune.__main__ import main as autotune_main
from moelab.console.main import main as mgr_main
from moelab.engine import cli
from moelab.engine.bench.alternate import ab_side, alternation
from moelab.engine.bench.bound import against_the_bound, rates_around
from moelab.engine.bench.decode import preset_config
from moelab.engine.bench.host_watch import GcPauses, host_disturbance, step_times
from moelab.engine.bench.report import alternation_lines, staged_lines, stall_words
from moelab.engine.bench.runner import TIMED_FIELDS
from moelab.engine.config.config import EngineConfig
from moelab.engine.experts.cpu import worker_cpus
from moelab.engine.experts.moe_stats import StagedStepTimes
from moelab.engine.model.kv import KVCache
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.runtime.loading import LoadProgress
from moelab.engine.serving.server import Server
from moelab.kernels.cpu_experts import load_native


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every command path of a parser: (), ("serve",), ("bench", "bw"), ..."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, (*path, name))


def test_every_commands_help_renders(capsys):
    paths = list(subcommands(cli.build_parser()))
    assert {
        ("serve",),
        ("generate",),
        ("bench", "bw"),
        ("bench", "decode"),
        ("bench", "prefill"),
    } <= set(paths)
    commands = [(cli.main, list(p)) for p in paths]
    commands += [(mgr_main, []), (autotune_main, [])]
    for main, path in commands:
        with pytest.raises(SystemExit) as exit:
            main([*path, "--help"])
        assert exit.value.code == 0, path
        assert capsys.readouterr().out.startswith("usage:"), path


def moelab(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moelab.engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=check,
    )


# `moelab` command lines (a JSON list on stdin) run one after another in one interpreter, each as
# `python -m moelab.engine.cli` runs it: with its own stdout, stderr and log lines, a traceback
# and exit code 1 where it raises; [exit code, stdout, stderr] each, into the file argv[1] names
EACH_COMMAND = r"""
import contextlib, io, json, logging, sys, traceback
from moelab.engine import cli

results_path, results = sys.argv[1], []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    logging.root.handlers.clear()  # cli.main's logging.basicConfig then logs to this stderr
    sys.argv = [cli.__file__, *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit:  # argparse's refusals, as the interpreter ends with them
            code = exit.code
            if isinstance(code, str):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append([code or 0, out.getvalue(), err.getvalue()])
with open(results_path, "w") as f:
    json.dump(results, f)
"""


def moelab_each(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Each command line's `moelab` run, all in one process (EACH_COMMAND): the interpreter's
    start and imports, most of a short command's time, are paid once."""
    with tempfile.TemporaryDirectory() as folder:
        results = Path(folder) / "results.json"
        done = subprocess.run(
            [sys.executable, "-c", EACH_COMMAND, str(results)],
            input=json.dumps(commands),
            capture_output=True,
            text=True,
            timeout=300 + 60 * len(commands),
        )
        assert done.returncode == 0 and results.is_file(), done.stderr[-3000:]
        return [
            subprocess.CompletedProcess(["moelab", *argv], code, out, err)
            for argv, (code, out, err) in zip(
                commands, json.loads(results.read_text()), strict=True
            )
        ]


def output(run: subprocess.CompletedProcess) -> str:
    """A command's stdout, where it exited 0."""
    assert run.returncode == 0, (run.args, run.stderr[-3000:])
    return run.stdout


def test_synth_then_generate_json(tmp_path):
    out = tmp_path / "demo"
    synth = ["synth", "--out", str(out), "--arch", "olmoe", "--routing-skew", "0.5",
             "--set", "num_experts=8"]  # fmt: skip
    flags = ["--model-path", str(out), "--bank-dir", str(tmp_path / "bank"), "--max-tokens", "6"]
    ids = ["--prompt-ids", "5,6,7", "--json"]
    # the sampling flags reach the sampler: drawing at temperature 1 leaves the greedy
    # continuation, top-k 1 brings it back; a wrong value is refused in one line
    longer = ["generate", *flags[:-1], "16", *ids]
    made, first, again, text, greedy, drawn, top_1, refused = moelab_each(
        synth,
        ["generate", *flags, *ids],
        ["generate", *flags, *ids],
        ["generate", *flags, "--prompt", "The harbour town", "--json"],
        longer,
        [*longer, "--temperature", "1", "--seed", "3"],
        [*longer, "--temperature", "1", "--seed", "3", "--top-k", "1"],
        ["generate", *flags, *ids, "--min-p", "2"],
    )
    output(made)
    assert json.loads((out / "config.json").read_text())["num_experts"] == 8
    result = json.loads(output(first))
    assert result["prompt_ids"] == [5, 6, 7] and len(result["output_ids"]) == 6
    assert isinstance(result["text"], str)
    assert json.loads(output(again)) == result  # greedy by default
    assert len(json.loads(output(text))["prompt_ids"]) > 1

    def ids_of(run: subprocess.CompletedProcess) -> list[int]:
        return json.loads(output(run))["output_ids"]

    assert ids_of(drawn) != ids_of(greedy)
    assert ids_of(top_1) == ids_of(greedy)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == "moelab generate: min_p must be in [0, 1]"


def test_errors_are_messages_not_tracebacks(tmp_path):
    no_config, huge, both_sizes, sometimes = moelab_each(
        ["generate", "--model-path", str(tmp_path), "--prompt", "x"],
        ["synth", "--out", str(tmp_path / "x"), "--preset", "huge"],
        ["serve", "--model-path", "x", "--moe-cache-size", "3", "--moe-cache-rate", "0.5"],
        ["serve", "--model-path", "x", "--moe-miss-policy", "sometimes"],
    )
    for r in (no_config, huge, both_sizes, sometimes):
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "has no config.json" in no_config.stderr
    assert "invalid choice: 'huge'" in huge.stderr
    assert "not allowed with argument" in both_sizes.stderr
    assert "use auto, gpu, cpu or split:F" in sometimes.stderr


# `moelab` in an interpreter where Triton cannot be imported, as on a CPU-only install
WITHOUT_TRITON = (
    "import sys; sys.modules['triton'] = None; "
    "from moelab.engine.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_a_cpu_only_install_without_triton_generates_the_same_tokens(tmp_path):
    """Triton comes with PyTorch's CUDA builds, not its CPU build, and moelab does not require
    it: on the CPU the engine runs each kernel's torch reference, so it generates without Triton,
    and the same tokens."""
    out = tmp_path / "demo"
    moelab("synth", "--out", str(out), "--preset", "tiny", "--routing-skew", "1.0")
    flags = ["--model-path", str(out), "--bank-dir", str(tmp_path / "bank"), "--device", "cpu",
             "--prompt", "The harbour town", "--max-tokens", "8", "--json"]  # fmt: skip
    without = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON, "generate", *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert without.returncode == 0, without.stderr
    assert "Traceback" not in without.stderr
    assert json.loads(without.stdout) == json.loads(moelab("generate", *flags).stdout)


def test_cuda_without_triton_says_what_to_install(monkeypatch):
    """On a CUDA machine whose torch brought no Triton, the engine refuses the CUDA device with
    what to install, or to use the CPU; a GPU kernel launched all the same says the same."""
    from moelab.engine.runtime import engine as engine_module
    from moelab.kernels import no_triton

    monkeypatch.setattr(engine_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module.common, "HAVE_TRITON", False)
    for device in ("cuda", "auto"):
        with pytest.raises(ValueError, match="Triton is not installed") as refused:
            engine_module.resolve_device(device)
        assert "PyTorch's CUDA build" in str(refused.value) and "--device cpu" in str(refused.value)
    assert engine_module.resolve_device("cpu").type == "cpu"

    @no_triton.jit
    def _kernel(x_ptr):
        pass

    with pytest.raises(no_triton.TritonMissing, match="_kernel: Triton is not installed"):
        _kernel[(1,)](0)


def test_while_loading_the_api_answers_503_and_health_reports_progress():
    config = EngineConfig.from_flags(["--model-path", "/nowhere/tiny"])
    loading = LoadProgress()
    loading.begin("expert bank")
    loading.bytes(10, 100)
    worker = SimpleNamespace(status="loading", loading=loading, error=None)
    client = TestClient(Server(config, worker).app, base_url="http://127.0.0.1:8000")
    health = client.get("/health").json()
    assert health == {"status": "loading", "model": "tiny", "phase": "expert bank",
                      "loaded_bytes": 10, "total_bytes": 100}  # fmt: skip
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
    assert r.headers["retry-after"]
    worker.status, worker.error = "error", "CheckpointError: no tensor lm_head.weight"
    assert client.get("/health").json()["error"].endswith("lm_head.weight")
    assert client.get("/v1/models").status_code == 503
    # control endpoints answer this machine only (the test client is not a loopback address)
    r = client.post("/v1/cache/resize", json={"moe_cache_size": 4})
    assert r.status_code == 403 and "this machine only" in r.json()["error"]["message"]


def test_bench_decode_reports_against_the_bound_and_writes_a_timeline(tmp_path):
    trace = tmp_path / "trace.json"
    # a fixed split: the auto one follows rates measured at start, and with a fetch share of 0 (a
    # busy machine measuring a slow copy) no expert is ever cached and no read hits
    flags = ["bench", "decode", "--preset", "tiny", "--tokens", "4", "--warmup", "2",
             "--moe-cache-rate", "0.5", "--moe-miss-policy", "split:0.5", "--json"]  # fmt: skip
    r = moelab(*flags, "--kernel-profile", "--trace", str(trace))
    result = json.loads(r.stdout)
    assert result["decode_tok_s"] > 0 and result["bound_tok_s"] > 0
    assert 0 < result["hit_rate"] < 1
    # the engine's miss cost fit over the timed steps alone, not the 16 profiled after them (one
    # may be timed by phase: left out)
    assert 3 <= result["miss_cost"]["steps"] <= 4 and result["miss_cost"]["misses_per_step"] > 0
    # so are the per-step counts the bound is made of: misses of the timed reads alone
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    reads = spec.num_moe_layers * spec.top_k
    misses = result["fills_per_step"] + result["cpu_per_step"]
    assert misses == pytest.approx((1 - result["hit_rate"]) * reads)
    # the bound counts the KV cache the attention reads: the default 16-token prompt's keys and
    # values over every layer, at the mean context of the 4 timed steps (16 + 1 + 1.5)
    elem = torch.empty(0, dtype=getattr(torch, result["dtype"])).element_size()
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem
    assert result["kv_bytes_per_step"] == pytest.approx(18.5 * per_token)
    # the bound's rates: measured before and after the timed steps, the mean of the two
    before, after = result["rates_before"], result["rates_after"]
    assert result["host_gbps"] == pytest.approx((before["host_gbps"] + after["host_gbps"]) / 2)
    assert result["pdl"] is False  # no such launch on the CPU
    # the CPU expert kernel's code path on this CPU, as its pool reports it
    levels = list(load_native().simd_levels())
    assert result["cpu_simd"] == levels[0] and result["cpu_bf16_dot"] == (
        levels[0] == "avx512" and load_native().bf16_dot_built()
    )
    assert f"native kernel ({levels[0]}" in r.stderr
    assert "\nmiss policy split: fetches 50% of the misses\n" in r.stderr
    jobs = result["cpu_jobs"]  # the native workers' times, and their line
    assert jobs["jobs"] > 0 and 0 < jobs["workers_busy_share"] <= 1.01
    assert f"CPU jobs: {jobs['jobs']}, " in r.stderr and "were in tasks" in r.stderr
    # where a job's run went: its gate/up phase within it, the workers' wait for that phase
    assert 0 < jobs["phase1_us_mean"] <= jobs["run_us_mean"] and jobs["wait_us_mean"] >= 0
    assert f"its gate/up rows {jobs['phase1_us_mean']:.1f}, each worker waited" in r.stderr
    steps = result["step_ms"]  # each timed step's time: 4 tokens (one more to drain the flight)
    assert steps["steps"] in (4, 5) and 0 < steps["median_ms"] <= steps["max_ms"]
    assert f"steps {steps['median_ms']:.2f} ms median" in r.stderr
    # the heap settled as serve settles it, then the timed runs' collections (cheap ones now)
    heap = result["heap"]
    assert heap["full_collect_frozen_ms"] >= 0 and "heap settled before the timed runs" in r.stderr
    assert result["gc"]["runs"] >= result["gc"]["full"] >= 0
    if sys.platform == "linux":  # the host's own activity during the run, from /proc/stat
        disturbance = result["host_disturbance"]
        assert 0 <= disturbance["steal_share"] <= 1 and disturbance["feeder_preemptions"] >= 0
        assert "of CPU time stolen by the hypervisor" in r.stderr
    assert f"timeline written to {trace}" in r.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("ph") == "X" for e in events) > 10  # timed calls of the profiled steps
    refused = moelab(*flags, "--trace", str(trace), check=False)
    assert refused.returncode == 2 and "--trace needs --kernel-profile" in refused.stderr


def test_bench_decode_with_fp8_and_mxfp4_experts_bounds_with_their_bytes():
    """--moe-expert-dtype fp8 and mxfp4 on the tiny preset (float32 on the CPU): experts of 1
    byte a weight and their block factors, or half a byte and a scale per 32, in the slots and
    in the bound's bytes."""
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    flags = ["bench", "decode", "--preset", "tiny", "--tokens", "3", "--warmup", "2",
             "--moe-cache-rate", "0.5", "--moe-miss-policy", "split:0.5", "--json"]  # fmt: skip
    plain = json.loads(moelab(*flags).stdout)
    r = moelab(*flags, "--moe-expert-dtype", "fp8")
    fp8 = json.loads(r.stdout)
    assert plain["expert_dtype"] == "bf16" and plain["expert_bytes"] == spec.expert_params * 4
    assert fp8["expert_dtype"] == "fp8" and fp8["expert_bytes"] == spec.expert_bytes_as("fp8")
    assert fp8["decode_tok_s"] > 0 and fp8["bound_tok_s"] > 0 and fp8["slots"] == plain["slots"]
    # a token's bytes: the same dense weights and KV, its top-k experts in each format
    reads = spec.num_moe_layers * spec.top_k
    less = reads * (plain["expert_bytes"] - fp8["expert_bytes"])
    assert plain["active_bytes_per_token"] - fp8["active_bytes_per_token"] == less
    assert f"(fp8 experts of {fp8['expert_bytes'] / 2**20:.2f} MiB)" in r.stderr
    r = moelab(*flags, "--moe-expert-dtype", "mxfp4")
    fp4 = json.loads(r.stdout)
    assert fp4["expert_dtype"] == "mxfp4" and fp4["expert_bytes"] == spec.expert_bytes_as("mxfp4")
    assert fp4["decode_tok_s"] > 0 and fp4["bound_tok_s"] > 0
    less = reads * (plain["expert_bytes"] - fp4["expert_bytes"])
    assert plain["active_bytes_per_token"] - fp4["active_bytes_per_token"] == less
    assert f"(mxfp4 experts of {fp4['expert_bytes'] / 2**20:.2f} MiB)" in r.stderr


def test_bench_decode_says_what_the_auto_split_ended_with():
    from moelab.engine.bench.report import policy_words
    from moelab.engine.experts.misses import MissPolicy

    assert policy_words(MissPolicy.auto(50.0, 100.0)) == (
        "miss policy auto: fetches 33% of the misses at the end (the CPU rate it planned with: "
        "100.0 GB/s)"
    )
    assert policy_words(MissPolicy("gpu", 1.0)) == "miss policy gpu: fetches 100% of the misses"


def test_bench_decode_repeats_report_each_run_and_the_median_runs_figures():
    flags = ["bench", "decode", "--preset", "tiny", "--tokens", "3", "--warmup", "2",
             "--moe-cache-rate", "0.5", "--moe-miss-policy", "split:0.5", "--json"]  # fmt: skip
    r = moelab(*flags, "--repeats", "3")
    result = json.loads(r.stdout)
    runs = result["runs"]
    assert len(runs) == 3
    for run in runs:
        assert run["achieved_of_bound"] == pytest.approx(run["decode_tok_s"] / run["bound_tok_s"])
    # the figures are the median run's, by its share of the bound
    median = sorted(runs, key=lambda run: run["achieved_of_bound"])[1]
    assert {k: result[k] for k in median} == median
    # each run's bound takes the rates measured right before and after it: one measurement
    # between two runs serves both
    assert all(run["step_ms"]["steps"] >= 3 and run["cpu_jobs"]["jobs"] > 0 for run in runs)
    # the warm-up took the telemetry's phase-timed step, the next is 30 s later: none in a run;
    # no Triton kernel on the CPU
    assert all(run["timed_steps"] == 0 and run["compiled"] == 0 for run in runs)
    assert runs[0]["rates_after"] == runs[1]["rates_before"]
    assert runs[1]["rates_after"] == runs[2]["rates_before"]
    shares = sorted(run["achieved_of_bound"] for run in runs)
    assert shares[0] <= result["achieved_of_bound"] <= shares[2]
    line = r.stderr.split("runs (this line's figures are the median's): ")[1].splitlines()[0]
    assert line.count("tok/s") == 3 and f"{runs[2]['decode_tok_s']:.1f} tok/s" in line
    # one run (the default) prints no such line
    single = moelab(*flags)
    assert len(json.loads(single.stdout)["runs"]) == 1 and "runs (" not in single.stderr
    refused = moelab(*flags, "--repeats", "0", check=False)
    assert refused.returncode == 2 and "--repeats" in refused.stderr


def test_bench_decode_draws_its_tokens_at_a_temperature():
    flags = ["bench", "decode", "--preset", "tiny", "--tokens", "3", "--warmup", "2"]
    wrongs = ((["--temperature", "-1"], "temperature must be 0 or more"),
              (["--top-p", "0"], "top_p must be in (0, 1]"),
              (["--top-k", "-1"], "top_k must be 0 (off) or more"))  # fmt: skip
    r, greedy, *refusals = moelab_each(
        [*flags, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--json"],
        [*flags, "--json"],
        *([*flags, *wrong] for wrong, _ in wrongs),
    )
    result = json.loads(output(r))
    assert result["temperature"] == 0.8 and result["top_p"] == 0.9 and result["draw_top_k"] == 20
    assert "at batch 1, drawn at temperature 0.8, top-p 0.9, top-k 20 (" in r.stderr
    assert json.loads(output(greedy))["temperature"] == 0 and "drawn" not in greedy.stderr
    for refused, (_, said) in zip(refusals, wrongs, strict=True):
        assert refused.returncode == 2 and said in refused.stderr
        assert "Traceback" not in refused.stderr and "VRAM plan" not in refused.stderr


def test_alternating_runs_compare_each_pair_and_each_sides_plans():
    """An --alternate-... flag: runs A, B, B, A, A (the last A unpaired); each pair's B/A, and
    each side's periods by plan merged over its runs, weighted by their steps."""
    assert [ab_side(i) for i in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]
    rng = np.random.default_rng()
    tok_s = rng.uniform(200.0, 400.0, size=5)
    runs = [
        {
            "side": ab_side(i),
            "setting": (0, 2)[ab_side(i)],
            "decode_tok_s": float(t),
            "period_by_plan": {"0+1s": {"us": 100.0 + i, "steps": 10 * (i + 1)}}
            | ({"0+1sp": {"us": 90.0, "steps": 5}} if ab_side(i) else {}),
        }
        for i, t in enumerate(tok_s)
    ]
    alt = alternation(runs, "--moe-cpu-prefetch-rounds")
    assert alt["flag"] == "--moe-cpu-prefetch-rounds" and alt["sides"] == [0, 2]
    assert alt["ratios"] == pytest.approx([tok_s[1] / tok_s[0], tok_s[2] / tok_s[3]])
    assert alt["mean_ratio"] == pytest.approx(np.mean(alt["ratios"]))
    a, b = alt["period_by_plan"]
    assert a == {
        "0+1s": {"us": pytest.approx((100 * 10 + 103 * 40 + 104 * 50) / 100), "steps": 100}
    }
    assert b["0+1s"] == {"us": pytest.approx((101 * 20 + 102 * 30) / 50), "steps": 50}
    assert b["0+1sp"] == {"us": pytest.approx(90.0), "steps": 10}
    text = alternation_lines(alt)
    assert "alternated --moe-cpu-prefetch-rounds 0 (A) and 2 (B), 2 pairs" in text
    lo, hi = min(alt["ratios"]), max(alt["ratios"])
    assert f"2 pairs: B/A tok/s {alt['ratios'][0]:.3f}, {alt['ratios'][1]:.3f}; mean " in text
    assert f"({lo:.3f}–{hi:.3f})" in text
    assert text.splitlines()[-1] == (
        f"B's layer step periods by plan, µs (steps): 0+1s {b['0+1s']['us']:.0f} (50), "
        "0+1sp 90 (10)"
    )
    assert "no pair ran" in alternation_lines(alternation(runs[:1], "--moe-cpu-prefetch-rounds"))


def test_bench_decode_alternation_is_refused_where_it_cannot_compare():
    """Without guessing pieces (the CPU: no native planner's copies), with the same value on
    both sides, with one run, with two --alternate-... flags, or with a side the engine cannot
    take (isolate needs pinned workers), an alternation is a clear error."""
    flags = ["bench", "decode", "--preset", "tiny", "--tokens", "3", "--warmup", "2",
             "--moe-cache-rate", "0.5", "--repeats", "2"]  # fmt: skip
    # each refused flag set, and what its refusal says
    refusals = []
    if not torch.cuda.is_available():
        refusals += [
            ([alternate, value], f"{alternate} needs pieces that send routing guesses")
            for alternate, value in (("--alternate-prefetch-rounds", "2"),
                                     ("--alternate-copy-ahead", "0"))
        ]  # fmt: skip
    refusals += [
        (["--moe-cpu-prefetch-rounds", "2", "--alternate-prefetch-rounds", "2"],
         "needs a value other than"),
        (["--repeats", "1", "--alternate-prefetch-rounds", "2"], "needs a value other than"),
        (["--alternate-prefetch-rounds", "5"], "--alternate-prefetch-rounds"),
        (["--alternate-copy-ahead", "2"], "2.0 must be from 0 to 1"),
        (["--moe-cpu-pin", "isolate", "--alternate-cpu-pin", "isolate"],
         "needs a value other than --moe-cpu-pin's"),
        (["--alternate-cpu-pin", "isolate", "--alternate-prefetch-rounds", "2"],
         "one --alternate-... flag at a time"),
        (["--moe-cpu-pin", "off", "--alternate-cpu-pin", "isolate"],
         "--moe-cpu-pin isolate: needs CPU expert workers pinned"),
        (["--moe-cpu-kernel", "torch", "--alternate-cpu-redo-us", "0"],
         "--moe-cpu-redo-us 150: redo_us applies to the native kernel's tasks only"),
    ]  # fmt: skip
    runs = moelab_each(*([*flags, *wrong] for wrong, _ in refusals))
    for r, (wrong, refused) in zip(runs, refusals, strict=True):
        assert r.returncode == 2 and refused in r.stderr, (wrong, r.stderr[-2000:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("own", "alternate", "a", "b", "others", "marks"),
    [
        ("--moe-cpu-prefetch-rounds", "--alternate-prefetch-rounds", 0, 2, [], ("p", "w")),
        # with no prefetch rounds the pieces still send guesses for the copies ahead
        ("--moe-copy-ahead", "--alternate-copy-ahead", 0.0, 0.75,
         ["--moe-cpu-prefetch-rounds", "0"], ("a",)),
    ],
)  # fmt: skip
def test_bench_decode_alternates_a_guessing_flag_on_cuda(own, alternate, a, b, others, marks):
    """--alternate-prefetch-rounds and --alternate-copy-ahead: the engine starts with guessing
    pieces (the larger side), the runs alternate A B B A, and the A runs' waits ignore the guesses
    (none of their plans is marked)."""
    flags = ["bench", "decode", "--preset", "tiny", "--tokens", "8", "--warmup", "2",
             "--moe-cache-rate", "0.5", "--repeats", "4", "--json", *others]  # fmt: skip
    r = moelab(*flags, own, str(a), alternate, str(b))
    result = json.loads(r.stdout)
    assert [run["setting"] for run in result["runs"]] == [a, b, b, a]
    alt = result["alternated"]
    assert alt["sides"] == [a, b] and len(alt["ratios"]) == 2
    assert f"alternated {own} {a} (A) and {b} (B), 2 pairs" in r.stderr
    assert alt["period_by_plan"][0]
    assert not any(plan.endswith(marks) for plan in alt["period_by_plan"][0])


@pytest.mark.parametrize(
    ("flag", "a", "b"),
    [
        pytest.param(
            "--moe-cpu-pin", "cores", "isolate",
            marks=pytest.mark.skipif(
                len(worker_cpus(1)) != 1,
                reason="needs two cores: a pinned worker and one left over",
            ),
        ),
        ("--moe-cpu-redo-us", 0, 1),
        ("--moe-cache-admission", "recent", "frequency"),
    ],
)  # fmt: skip
def test_bench_decode_alternates_a_cpu_flag(flag, a, b):
    """--alternate-cpu-pin (the workers' cores alone, then the rest of the engine kept off them),
    --alternate-cpu-redo-us (never running a stalled CPU task again, then after 1 µs) and
    --alternate-cache-admission (recent, then frequency): the runs alternate A B B A, and the
    pairs are compared. The misses run on the CPU, so that every
    run has CPU jobs for the flags to act on."""
    flags = ["bench", "decode", "--preset", "tiny", "--tokens", "3", "--warmup", "2",
             "--moe-cache-rate", "0.5", "--moe-miss-policy", "cpu", "--repeats", "4",
             "--json"]  # fmt: skip
    alternate = flag.replace("--moe-", "--alternate-")
    r = moelab(*flags, flag, str(a), alternate, str(b))
    result = json.loads(r.stdout)
    assert [run["setting"] for run in result["runs"]] == [a, b, b, a]
    assert [run["side"] for run in result["runs"]] == [0, 1, 1, 0]
    alt = result["alternated"]
    assert alt["flag"] == flag and alt["sides"] == [a, b]
    assert len(alt["ratios"]) == 2
    assert f"alternated {flag} {a} (A) and {b} (B), 2 pairs" in r.stderr
    assert result["cpu_jobs"]["jobs"] > 0 and "redone_tasks" in result["cpu_jobs"]


def test_bench_prefill_reports_each_repeat_and_profiles_host_and_kernels(tmp_path):
    trace = tmp_path / "prefill.json"
    r = moelab("bench", "prefill", "--preset", "tiny", "--prompt-tokens", "24", "--repeats", "3",
               "--json", "--profile", "--kernel-profile", "--trace", str(trace))  # fmt: skip
    result = json.loads(r.stdout)
    each = result["seconds_each"]
    assert len(each) == 3 and min(each) <= result["seconds"] <= max(each)
    assert result["prefill_tok_s"] == pytest.approx(24 / result["seconds"])
    # the budget planned; the device memory held at most is known on CUDA only
    assert result["budget_bytes"] > 0 and result["peak_device_bytes"] is None
    assert "device memory:" not in r.stderr
    fastest, slowest = 24 / min(each), 24 / max(each)
    assert f"(median of 3, {slowest:.0f}–{fastest:.0f})" in r.stderr
    assert "function calls" in r.stderr and "tottime" in r.stderr  # --profile: cProfile's table
    assert "Self CPU time total" in r.stderr  # --kernel-profile: torch.profiler's
    assert f"timeline written to {trace}" in r.stderr
    assert sum(e.get("ph") == "X" for e in json.loads(trace.read_text())["traceEvents"]) > 10


def test_bench_prefill_warms_up_on_warmup_tokens_then_times_the_prompt_length():
    """--warmup-tokens: the untimed first prompt has that many tokens (a long prompt's proof
    need not prefill it twice), the timed ones --prompt-tokens; without it, the warm-up is as
    long as they are."""
    from moelab.engine.bench import runner

    class Engine:
        spec = SimpleNamespace(vocab_size=50)

        def __init__(self):
            self.lengths = []

        def add(self, prompt, params):
            self.lengths.append(len(prompt))
            return SimpleNamespace(finished=True)

        def run_until_idle(self):
            pass

    engine = Engine()
    times = runner._prefill_times(engine, 40, 2, torch.Generator().manual_seed(0), warmup=8)
    assert engine.lengths == [8, 40, 40] and len(times) == 2
    engine = Engine()
    runner._prefill_times(engine, 40, 1, torch.Generator().manual_seed(0))
    assert engine.lengths == [40, 40]
    args = cli.build_parser().parse_args(["bench", "prefill", "--warmup-tokens", "8"])
    assert args.warmup_tokens == 8


def test_bench_prefill_and_decode_fill_the_advertised_context_less_n_tokens():
    """--prompt-tokens context-N: the prompt is the context the engine advertises less N
    tokens, in the same process; `context` the longest prompt that leaves room for what each
    sequence generates (prefill: one token; decode: its warm-up, or its timed tokens and one).
    A context-N that leaves nothing, or too little for them, is refused."""
    flags = ["--preset", "tiny", "--kv-reserve-tokens", "96", "--json"]
    prefill = ["bench", "prefill", *flags, "--repeats", "1", "--warmup-tokens", "8"]
    decode = ["bench", "decode", *flags, "--tokens", "3", "--warmup", "2"]
    short_5, whole, none_left, decoded, too_little = moelab_each(
        [*prefill, "--prompt-tokens", "context-5"],
        [*prefill, "--prompt-tokens", "context"],
        [*prefill, "--prompt-tokens", "context-100000"],
        [*decode, "--prompt-tokens", "context"],
        [*decode, "--prompt-tokens", "context-3"],
    )
    result = json.loads(output(short_5))
    assert result["max_context"] >= 96
    assert result["prompt_tokens"] == result["max_context"] - 5
    result = json.loads(output(whole))
    assert result["prompt_tokens"] == result["max_context"] - 1
    assert none_left.returncode == 2
    assert "--prompt-tokens context-100000 leaves no prompt" in none_left.stderr
    result = json.loads(output(decoded))
    assert result["prompt_tokens"] == result["max_context"] - 4  # 3 timed tokens and the first
    assert too_little.returncode == 2
    assert "context-3 leaves room for 3 tokens, and each sequence generates 4" in too_little.stderr
    parse = cli.build_parser().parse_args
    assert parse(["bench", "prefill", "--prompt-tokens", "context"]).prompt_tokens.tokens is None
    assert parse(["bench", "decode", "--prompt-tokens", "12"]).prompt_tokens == 12
    for bad in ("context-", "context-0", "context-x", "0", "contexts"):
        with pytest.raises(SystemExit):
            parse(["bench", "prefill", "--prompt-tokens", bad])


def test_the_bound_takes_each_rate_as_the_mean_of_before_and_after():
    before = {"hbm_gbps": 4000.0, "bp_gbps": 50.0, "host_gbps": 90.0}
    after = {"hbm_gbps": 4200.0, "bp_gbps": 46.0, "host_gbps": 110.0}
    rates = rates_around(before, after)
    assert (rates["hbm_gbps"], rates["bp_gbps"], rates["host_gbps"]) == (4100.0, 48.0, 100.0)
    assert rates["rates_before"] == before and rates["rates_after"] == after


def test_the_decode_bound_reads_the_dense_weights_the_kv_cache_and_the_cached_experts_from_hbm():
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    kv = KVCache(spec, 1, 16, torch.device("cpu"), torch.bfloat16)
    bank = SimpleNamespace(expert_bytes=spec.expert_params * 2)  # a bf16 bank's experts
    config = SimpleNamespace(model=SimpleNamespace(dense_dtype="auto"))
    engine = SimpleNamespace(spec=spec, dtype=torch.bfloat16, kv=kv, bank=bank, config=config)
    layers, experts = spec.num_moe_layers, spec.num_experts
    per_layer = np.zeros((layers, experts), dtype=np.int64)
    counts = {k: per_layer.copy() for k in ("reads", "hits", "fills", "cpu", "picks")}
    counts["reads"][:, 0], counts["hits"][:, 0] = 12, 8  # 4 steps: 2 hits, 1 miss a layer each
    counts["fills"][:, 0], counts["cpu"][:, 0] = 2, 2
    timed = {"elapsed": 0.5, "counts": counts, **dict.fromkeys(TIMED_FIELDS)}
    rates = {"hbm_gbps": 1000.0, "bp_gbps": 40.0, "host_gbps": 60.0}

    def bound(prompt_tokens: int) -> dict:
        args = SimpleNamespace(batch=2, tokens=4, prompt_tokens=prompt_tokens)
        return against_the_bound(engine, args, timed, rates)

    short, long = bound(16), bound(4096)
    eb = bank.expert_bytes
    dense = (spec.dense_params - spec.vocab_size * spec.hidden_size) * 2
    kv_token = spec.kv_bytes_per_token * 2 // spec.dtype_bytes
    kv = 2 * (4096 + 2.5) * kv_token  # two sequences at the mean context of 4 steps
    assert long["kv_bytes_per_step"] == pytest.approx(kv)
    t_min = (dense + kv + 2 * layers * eb) / 1e12 + layers * eb / 100e9
    assert long["bound_tok_s"] == pytest.approx(2 / t_min)
    assert long["decode_tok_s"] == pytest.approx(2 * 4 / 0.5)
    assert long["achieved_of_bound"] == pytest.approx(16 / long["bound_tok_s"])
    # a longer context reads more: a lower bound, a higher share for the same time
    assert long["bound_tok_s"] < short["bound_tok_s"]
    assert long["achieved_of_bound"] > short["achieved_of_bound"]
    # FP8 KV pages: a byte a value and a factor per KV head, as the cache holds them
    engine.kv = KVCache(spec, 1, 16, torch.device("cpu"), torch.bfloat16, cache_dtype="fp8")
    fp8_token = 2 * spec.num_layers * spec.num_kv_heads * (spec.head_dim + 4)
    assert bound(4096)["kv_bytes_per_step"] == pytest.approx(2 * (4096 + 2.5) * fp8_token)
    # FP8 projections (--dense-dtype fp8): a byte a weight and their factors, as held
    before = bound(4096)["active_bytes_per_token"]
    config.model.dense_dtype = "fp8"
    held = spec.dense_bytes_at(2, "fp8")
    assert 0 < held < spec.dense_params * 2
    fp8_dense = bound(4096)["active_bytes_per_token"] - before
    assert fp8_dense == pytest.approx(held - spec.dense_params * 2)


def test_host_disturbance_is_the_steal_and_interrupt_share_between_two_readings():
    def cpu(user, irq, steal):
        return {"user": user, "idle": 0, "irq": irq, "softirq": 0, "steal": steal}

    # threads: name, ns on a CPU, ns waiting for one; processes: name, CPU seconds
    before = {
        "ticks": {"cpu0": cpu(100, 0, 0), "cpu1": cpu(100, 0, 0)},
        "switches": (10, 1),
        "threads": {1: ("python", 0, 0), 2: ("w", 0, 0), 3: ("w", 0, 0), 4: ("cuda", 5, 0)},
        "procs": {50: ("agent", 1.0), 51: ("sshd", 2.0)},
    }
    after = {
        "ticks": {"cpu0": cpu(160, 20, 20), "cpu1": cpu(200, 0, 0)},
        "switches": (14, 4),
        "threads": {
            1: ("python", 9_000_000, 2_000_000),
            2: ("w", 9_000_000, 500_000),
            3: ("w", 9_000_000, 7_000_000),
            4: ("cuda", 3_000_005, 0),
            5: ("new", 8_000_000, 0),  # started during the run: not compared
        },
        "procs": {50: ("agent", 1.25), 51: ("sshd", 2.0), 52: ("new", 9.0)},
    }
    d = host_disturbance(before, after, feeder=1, workers=[2, 3])
    assert d["steal_share"] == pytest.approx(20 / 200)  # 20 of the 200 ticks both CPUs ran
    assert (d["irq_busiest_cpu"], d["irq_busiest_share"]) == ("cpu0", pytest.approx(0.2))
    assert (d["feeder_switches"], d["feeder_preemptions"]) == (4, 3)
    assert d["feeder_wait_ms"] == pytest.approx(2.0)
    assert d["worker_wait_ms_max"] == pytest.approx(7.0)
    assert d["busiest_threads"] == [["cuda/4", 3.0]]
    assert d["busiest_processes"] == [["agent/50", 250.0]]  # sshd ran 0 ms, "new" began later
    assert host_disturbance({"ticks": None}, after) is None
    partial = host_disturbance({"ticks": before["ticks"]}, after)
    assert "feeder_switches" not in partial and "feeder_wait_ms" not in partial
    # a kernel without schedstat reads every thread as 0 ns: no waits are reported from it
    flat = {tid: (name, 0, 0) for tid, (name, _, _) in after["threads"].items()}
    zeros = host_disturbance({**before, "threads": flat}, {**after, "threads": flat}, 1, [2, 3])
    assert "feeder_wait_ms" not in zeros and "busiest_threads" not in zeros


def test_step_times_find_the_stalls_of_a_run():
    steps = step_times([0.002] * 9 + [0.020])
    assert steps["steps"] == 10 and steps["median_ms"] == pytest.approx(2.0)
    assert steps["max_ms"] == pytest.approx(20.0)
    assert (steps["slow_steps"], steps["slow_excess_ms"]) == (1, pytest.approx(18.0))
    assert steps["slow_at"] == [9]
    assert step_times([0.002, 0.003, 0.004])["slow_steps"] == 0
    assert step_times([]) == {"steps": 0}
    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect()
    assert (pauses.runs, pauses.full) == (2, 1) and 0 < pauses.max_ms <= pauses.ms
    assert pauses not in gc.callbacks
    words = stall_words({"step_ms": steps, "host_disturbance": {"feeder_wait_ms": 1.5},
                         "compiled": 2, "timed_steps": 1})  # fmt: skip
    assert (
        "20.0 longest, 1 over 3x (at 9): 18.0 ms beyond" in words
        and "feeding thread 1.5 ms" in words
        and "2 Triton kernels compiled; 1 phase-timed (eager) steps" in words
    )
    assert "compiled" not in stall_words({"step_ms": steps, "compiled": 0, "timed_steps": 0})


def test_bench_decode_prints_the_staged_stages_and_the_commonest_plans_periods():
    times = StagedStepTimes(layer_steps=4, replay_s=4e-5, sync_s=8e-4, plan_s=4e-5, fill_s=2e-5,
                            count_s=4e-5)  # fmt: skip
    for plan, seconds in [("1+1", 260e-6), ("1+1", 270e-6), ("0+1", 160e-6)] + [
        (f"{q}+9", 1e-3) for q in range(8)
    ]:
        times.add_period(plan, seconds)
    text = staged_lines(times.to_dict())
    assert "host per staged layer step, µs: replay 10, sync 200, plan 10, fill 5, count 10" in text
    periods = text.splitlines()[-1]
    assert periods.startswith(
        "layer step period by plan (copied+on the CPU), µs (steps): 1+1 265 (2)"
    )
    assert len(periods.split(": ")[1].split(", ")) == 8  # the eight commonest steps' plans
    assert "between steps" not in text  # none measured
    times.boundaries, times.boundary_s, times.boundary_host_s = 2, 1.1e-3, 0.3e-3
    assert staged_lines(times.to_dict()).endswith(
        "; between steps (the last layer's routing to the next step's first) 550, 150 of it "
        "before the next step's launch"
    )
    assert staged_lines(StagedStepTimes().to_dict()) == ""


def test_bench_takes_a_real_geometry_s_architecture_from_its_preset():
    """`bench decode --preset qwen3.6-35b-a3b` benchmarks Qwen3.5/3.6 MoE without --arch, as
    `moelab synth` writes it; --arch still chooses (its text-only layout), and the other presets
    stay qwen3_moe."""
    parser = cli.build_parser()

    def config(*flags: str) -> dict:
        return preset_config(parser.parse_args(["bench", "decode", *flags]))

    assert config("--preset", "qwen3.6-35b-a3b")["model_type"] == "qwen3_5_moe"
    assert config("--preset", "qwen3-next-80b-a3b")["model_type"] == "qwen3_next"
    text_only = config("--preset", "qwen3.6-35b-a3b", "--arch", "qwen3_5_moe_text")
    assert text_only["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert config("--preset", "tiny")["model_type"] == "qwen3_moe"


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_a_gpt_oss_preset_is_gpt_oss_for_bench_and_synth(tmp_path, preset):
    """`bench decode` and `moelab synth` with a gpt-oss preset and no --arch build gpt-oss (its
    sliding-window layers, its sinks), not a qwen3_moe model of gpt-oss's sizes."""
    bench = preset_config(cli.build_parser().parse_args(["bench", "decode", "--preset", preset]))
    assert bench["model_type"] == "gpt_oss"
    assert (
        cli.main(["synth", "--out", str(tmp_path / "m"), "--preset", preset, "--no-weights"]) == 0
    )
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "gpt_oss"


@pytest.mark.parametrize(
    ("command", "preset", "arch", "use"),
    [
        (["bench", "decode"], "gpt-oss-120b", "qwen3_moe", "gpt_oss"),
        (["synth"], "gpt-oss-20b", "qwen3_5_moe", "gpt_oss"),
        (["bench", "decode"], "qwen3-next-80b-a3b", "qwen3_5_moe", "qwen3_next"),
        (["synth"], "qwen3.6-35b-a3b", "qwen3_next", "qwen3_5_moe or qwen3_5_moe_text"),
        (["bench", "prefill"], "qwen3-30b-a3b", "gpt_oss", "qwen3_moe"),
    ],
)
def test_an_arch_that_contradicts_a_real_geometry_s_preset_is_refused(
    tmp_path, capsys, command, preset, arch, use
):
    flags = ["--out", str(tmp_path / "m")] if command == ["synth"] else []
    assert cli.main([*command, *flags, "--preset", preset, "--arch", arch]) == 2
    err = capsys.readouterr().err
    assert f"preset {preset!r} is a " in err and f"not a {arch} one's; use --arch {use}," in err
    assert not (tmp_path / "m").exists()
