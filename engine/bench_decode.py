"""`moelab bench decode` and `moelab bench prefill`: tok/s beside the machine's bound.

Decode bound per step: t_min = resident_bytes / HBM + miss_bytes / (Bp + B_host), resident_bytes
the dense weights, the KV cache the step's attention reads and the cached experts, with the device
copy rate (HBM), the pinned host-to-device rate (Bp) and the host memory read rate (B_host) measured
here, Bp and B_host while running at the same time. A slow kernel shows as a gap to this bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from ..kernels.common import compiled_variants
from ..kernels.cpu_experts import process_thread_ids
from .args import (
    _non_negative_int,
    _positive_int,
    add_engine_flags,
    parse_prefetch_rounds,
    parse_share,
)
from .moe_stats import CpuJobTimes, MissCostFit, StagedStepTimes


def add_decode_parsers(kinds: argparse._SubParsersAction) -> None:
    for name, helptext in (
        ("decode", "decode tok/s at a batch size, beside the bound"),
        ("prefill", "prefill tok/s for a prompt length, beside the bound"),
    ):
        p = kinds.add_parser(name, help=helptext)
        p.add_argument(
            "--preset",
            help="a synthetic geometry (with --dummy-weights implied) "
            "instead of --model-path: tiny, small, qwen3-30b-a3b",
        )
        p.add_argument("--arch", default="qwen3_moe")
        p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
        p.add_argument("--routing-skew", type=float, default=0.0)
        p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        p.add_argument(
            "--profile",
            action="store_true",
            help="print where the host spends its time (cProfile) to stderr",
        )
        p.add_argument(
            "--kernel-profile",
            action="store_true",
            help="print the device kernels of a few steps (torch.profiler) to stderr",
        )
        p.add_argument(
            "--trace",
            type=Path,
            default=None,
            metavar="FILE",
            help="with --kernel-profile: also write its timeline (host calls and device "
            "kernels) to FILE as a Chrome trace (Perfetto, chrome://tracing)",
        )
        if name == "decode":
            p.add_argument("--batch", type=int, default=1)
            p.add_argument("--tokens", type=int, default=64, help="timed tokens per sequence")
            p.add_argument("--warmup", type=int, default=32, help="untimed tokens first")
            p.add_argument("--prompt-tokens", type=int, default=16)
            p.add_argument(
                "--temperature",
                type=float,
                default=0.0,
                help="draw each token at this temperature, seeded per sequence (0: greedy); with "
                "CUDA graphs the draws run on the GPU (engine/graphs.py)",
            )
            p.add_argument(
                "--top-p", type=float, default=1.0, help="with --temperature: the draws' top-p"
            )
            p.add_argument(
                "--top-k",
                type=int,
                default=0,
                help="with --temperature: the draws' top-k (0: off; Qwen3 recommends 20)",
            )
            p.add_argument(
                "--repeats",
                type=_positive_int,
                default=1,
                help="timed runs in this process, each against the rates measured before and "
                "after it; the median run's figures are printed, and each run's tok/s "
                "(--profile profiles the first run)",
            )
            p.add_argument(
                "--alternate-prefetch-rounds",
                type=parse_prefetch_rounds,
                default=None,
                metavar="N",
                help="compare two settings in one process: the timed runs alternate between "
                "--moe-cpu-prefetch-rounds (A) and N (B) in the order A B B A, repeated (the "
                "pieces send their guesses in both; with 0 the wait ignores them); each pair's "
                "tok/s ratio and each side's periods by plan are printed",
            )
            p.add_argument(
                "--alternate-cpu-pin",
                choices=("cores", "isolate"),
                default=None,
                metavar="MODE",
                help="as --alternate-prefetch-rounds, between --moe-cpu-pin (A, cores or isolate) "
                "and MODE (B): the rest of the engine's threads are moved off the CPU expert "
                "workers' cores, or back, between runs",
            )
            p.add_argument(
                "--alternate-copy-ahead",
                type=parse_share,
                default=None,
                metavar="SHARE",
                help="as --alternate-prefetch-rounds, between --moe-copy-ahead (A) and SHARE (B): "
                "the share of the guesses' lead in which the guessed first device miss is copied "
                "ahead of the routing",
            )
            p.add_argument(
                "--alternate-cpu-redo-us",
                type=_non_negative_int,
                default=None,
                metavar="US",
                help="as --alternate-prefetch-rounds, between --moe-cpu-redo-us (A) and US (B): "
                "how long a CPU task may be in flight before an idle worker runs it again",
            )
        else:
            p.add_argument("--prompt-tokens", type=int, default=2048)
            p.add_argument("--repeats", type=int, default=3)
            p.add_argument(
                "--crossover",
                action="store_true",
                help="time short prompts both ways (route then fetch, or stream whole layers), "
                "and write the crossover into the bandwidth profile the engine reads",
            )
        add_engine_flags(p)
        for action in p._actions:
            if action.dest == "model_path":
                action.required = False
        p.set_defaults(run=_run)


def _engine(args: argparse.Namespace, workdir: Path):
    from .engine import Engine
    from .spec import ModelSpec
    from .synth import make_config, parse_overrides

    if args.preset:
        config = make_config(args.arch, args.preset, parse_overrides(args.set))
        config["moelab_synth"] = {
            "preset": args.preset,
            "seed": args.seed,
            "routing_skew": args.routing_skew,
        }
        (workdir / "config.json").write_text(json.dumps(config))
        args.model_path = str(workdir)
        args.dummy_weights = True
        return Engine(args, spec=ModelSpec.from_config(config))
    if not args.model_path:
        raise ValueError("give --model-path DIR or --preset NAME")
    return Engine(args)


def concurrent_rates(engine, seconds: float = 0.6) -> dict:
    """HBM copy rate alone; pinned H2D and host read rates measured running at the same time."""
    dev = engine.device
    if dev.type != "cuda":
        read = engine.cpu.read_gbps(256 * 1024**2)
        return {"hbm_gbps": read, "bp_gbps": read, "host_gbps": read}
    big = torch.empty(512 * 1024**2, dtype=torch.uint8, device=dev)
    out = torch.empty_like(big)
    out.copy_(big)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        out.copy_(big)
    torch.cuda.synchronize()
    hbm = 2 * 10 * big.nbytes / (time.perf_counter() - t0) / 1e9
    del big, out
    bank = engine.bank
    dst13 = torch.empty_like(bank.w13[0][0], device=dev)
    dst2 = torch.empty_like(bank.w2[0][0], device=dev)
    stop = threading.Event()
    copied = [0]
    # written before the copies start: this thread fills it on one core, where (with
    # --moe-cpu-pin isolate) the copying thread runs too
    buf = torch.ones((1 << 30) // 4, dtype=torch.float32)

    def copies(in_flight: int = 4) -> None:
        """Experts copied `in_flight` at a time, so that the copy engine stays busy while this
        thread waits for a CPU (the feeding thread queues the engine's fills the same way)."""
        stream = torch.cuda.Stream(dev)
        i = 0
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(in_flight):
                    layer, expert = i % bank.num_layers, (i // bank.num_layers) % bank.num_experts
                    dst13.copy_(bank.w13[layer][expert], non_blocking=True)
                    dst2.copy_(bank.w2[layer][expert], non_blocking=True)
                    i += 1
                stream.synchronize()
                copied[0] += in_flight * bank.expert_bytes

    thread = threading.Thread(target=copies)
    t0 = time.perf_counter()
    thread.start()
    host = engine.cpu.read_gbps(repeats=3, buf=buf)
    while time.perf_counter() - t0 < seconds:
        time.sleep(0.01)
    stop.set()
    thread.join()
    bp = copied[0] / (time.perf_counter() - t0) / 1e9
    return {"hbm_gbps": hbm, "bp_gbps": bp, "host_gbps": host}


def cpu_jobs_line(jobs: dict) -> str:
    """The timed steps' CPU jobs in one line ("" without any): their rate, and how together and
    how busy the pool's workers were."""
    if not jobs.get("jobs"):
        return ""
    line = f"\nCPU jobs: {jobs['jobs']}, {jobs['gbps']:.1f} GB/s"
    if jobs.get("marginal_gbps"):
        line += f" (marginal {jobs['marginal_gbps']:.1f})"
    line += f"; the first worker began {jobs['start_us_mean']:.1f} µs after the queueing"
    if jobs.get("last_worker_start_us_mean") is not None:
        line += (
            f", the last {jobs['last_worker_start_us_mean']:.1f} µs; the workers were in tasks "
            f"{jobs['workers_busy_share']:.0%} of the runs"
        )
    if jobs.get("phase1_us_mean") is not None:
        line += (
            f"; a job ran {jobs['run_us_mean']:.1f} µs, its gate/up rows "
            f"{jobs['phase1_us_mean']:.1f}, each worker waited {jobs['wait_us_mean']:.1f} for them"
        )
    if jobs.get("redone_tasks"):
        line += f"; {jobs['redone_tasks']} tasks of stalled workers run again"
    return line


def rates_around(before: dict, after: dict) -> dict:
    """The rates a decode run is bounded by: the mean of each, measured before and after it (a
    shared host's read rate drifts by a tenth or more between two measurements a minute apart),
    with both measurements kept."""
    mean = {k: (before[k] + after[k]) / 2 for k in ("hbm_gbps", "bp_gbps", "host_gbps")}
    return {**mean, "rates_before": before, "rates_after": after}


def _cpu_ticks() -> dict[str, dict[str, float]]:
    """Each CPU's seconds by kind (user, idle, irq, steal, ... as the OS has them); guest time is
    left out, Linux counts it in user time already."""
    return {
        f"cpu{i}": {k: v for k, v in t._asdict().items() if not k.startswith("guest")}
        for i, t in enumerate(psutil.cpu_times(percpu=True))
    }


def _thread_switches() -> tuple[int, int] | None:
    """This thread's voluntary and involuntary context switches so far (None where unknown)."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (ImportError, AttributeError, OSError):
        return None
    return usage.ru_nvcsw, usage.ru_nivcsw


def _thread_times() -> dict[int, tuple[str, int, int]]:
    """Each thread of this process: its name, and its ns on a CPU and runnable but waiting for one
    so far (Linux's schedstat; {} elsewhere)."""
    out = {}
    for tid in process_thread_ids():
        task = Path(f"/proc/self/task/{tid}")
        try:
            run_ns, wait_ns = (int(v) for v in (task / "schedstat").read_text().split()[:2])
            out[tid] = ((task / "comm").read_text().strip(), run_ns, wait_ns)
        except (OSError, ValueError):  # ended meanwhile, or no schedstat on this kernel
            continue
    return out


def _process_times() -> dict[int, tuple[str, float]]:
    """Every other process this user can see: its name and CPU seconds so far."""
    me, out = os.getpid(), {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info["cpu_times"]
        if proc.pid != me and times is not None:
            out[proc.pid] = (proc.info["name"], times.user + times.system)
    return out


def host_snapshot() -> dict:
    """What host_disturbance compares: the CPUs' ticks, the feeding thread's switches, this
    process's threads' CPU and wait times, the other processes' CPU times."""
    return {
        "ticks": _cpu_ticks(),
        "switches": _thread_switches(),
        "threads": _thread_times(),
        "procs": _process_times(),
    }


def _busiest(deltas: dict[str, float], n: int = 3, floor: float = 0.1) -> list[list]:
    """The n largest of name -> ms (those of at least `floor`), largest first."""
    top = sorted(deltas.items(), key=lambda kv: -kv[1])[:n]
    return [[name, round(ms, 2)] for name, ms in top if ms >= floor]


def host_disturbance(
    before: dict, after: dict, feeder: int | None = None, workers: Sequence[int] = ()
) -> dict | None:
    """What else the host did during a timed run, from two host_snapshot()s taken around it: the
    share of the CPUs' time the hypervisor took (steal), the busiest CPU's share spent on
    interrupts, the switches of the thread that feeds the GPU (`feeder`, this thread), how long it
    and the slowest CPU expert worker (`workers`: thread ids) waited for a CPU while runnable,
    and which other threads of this process and which other processes ran the most. A run whose
    host stages are slow for no reason of its own shows it here."""
    ticks0, ticks1 = before.get("ticks"), after.get("ticks")
    if not ticks0 or not ticks1:
        return None
    steal = total = 0
    irq_share = {}
    for cpu, t1 in ticks1.items():
        delta = {k: t1[k] - ticks0.get(cpu, t1).get(k, 0) for k in t1}
        cpu_total = sum(delta.values())
        steal += delta.get("steal", 0)
        total += cpu_total
        if cpu_total:
            irq_share[cpu] = (delta.get("irq", 0) + delta.get("softirq", 0)) / cpu_total
    busiest = max(irq_share, key=irq_share.get, default=None)
    out = {
        "steal_share": steal / total if total else 0.0,
        "irq_busiest_cpu": busiest,
        "irq_busiest_share": irq_share.get(busiest, 0.0),
    }
    switches0, switches1 = before.get("switches"), after.get("switches")
    if switches0 is not None and switches1 is not None:
        out["feeder_switches"] = switches1[0] - switches0[0]
        out["feeder_preemptions"] = switches1[1] - switches0[1]
    threads0, threads1 = before.get("threads") or {}, after.get("threads") or {}
    both = threads0.keys() & threads1.keys()
    if any(threads1[tid][1] != threads0[tid][1] for tid in both):  # a kernel that keeps schedstat
        waited = {tid: (threads1[tid][2] - threads0[tid][2]) / 1e6 for tid in both}
        if feeder in both:
            out["feeder_wait_ms"] = waited[feeder]
        worker_waits = [waited[tid] for tid in workers if tid in both]
        if worker_waits:
            out["worker_wait_ms_max"] = max(worker_waits)
        others: dict[str, float] = {}
        for tid in both - {feeder, *workers}:
            name = f"{threads1[tid][0]}/{tid}"
            others[name] = (threads1[tid][1] - threads0[tid][1]) / 1e6
        out["busiest_threads"] = _busiest(others)
    procs0, procs1 = before.get("procs") or {}, after.get("procs") or {}
    if procs1:
        out["busiest_processes"] = _busiest(
            {
                f"{procs1[pid][0]}/{pid}": 1e3 * (procs1[pid][1] - procs0[pid][1])
                for pid in procs0.keys() & procs1.keys()
            }
        )
    return out


class GcPauses:
    """The cycle collector's runs while entered (through gc.callbacks): how many, their ms in all
    and the longest, and how many were full (generation 2) collections."""

    def __init__(self) -> None:
        self.runs = self.full = 0
        self.ms = self.max_ms = 0.0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            ms = 1e3 * (time.perf_counter() - self._start)
            self._start = None
            self.runs += 1
            self.full += info["generation"] == 2
            self.ms += ms
            self.max_ms = max(self.max_ms, ms)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def to_dict(self) -> dict:
        return {"runs": self.runs, "full": self.full, "ms": self.ms, "max_ms": self.max_ms}


def step_times(seconds: Sequence[float]) -> dict:
    """A timed run's step durations: median, 99th percentile and longest, in ms, and the steps
    that took over three times the median with the time they took beyond it (a stall)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    if ms.size == 0:
        return {"steps": 0}
    median = float(np.median(ms))
    slow = ms > 3 * median
    return {
        "steps": int(ms.size),
        "median_ms": median,
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "slow_steps": int(slow.sum()),
        "slow_excess_ms": float((ms[slow] - median).sum()),
        "slow_at": np.flatnonzero(slow)[:8].tolist(),  # the first eight, counted from 0
    }


def allocator_counts(device: torch.device) -> dict[str, int]:
    """How often torch's caching allocators went to the driver so far: device memory
    (cudaMalloc), and pinned host memory where this torch counts it; {} off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    out = {"device_allocs": stats.get("num_device_alloc", 0)}
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        out["host_allocs"] = host_stats().get("num_host_alloc", 0)
    return out


def stall_words(run: dict) -> str:
    """A run's steps in words: its longest and the time its stalls (steps over 3x the median)
    took beyond the median; with what the feeding thread and the workers waited for a CPU."""
    steps = run.get("step_ms") or {}
    if not steps.get("steps"):
        return ""
    words = f"; steps {steps['median_ms']:.2f} ms median, {steps['max_ms']:.1f} longest"
    if steps["slow_steps"]:
        at = ",".join(str(i) for i in steps["slow_at"])
        words += (
            f", {steps['slow_steps']} over 3x (at {at}): {steps['slow_excess_ms']:.1f} ms beyond"
        )
    if allocations := {k: v for k, v in (run.get("allocations") or {}).items() if v}:
        words += "; " + ", ".join(f"{k} {v}" for k, v in allocations.items())
    if run.get("compiled"):
        words += f"; {run['compiled']} Triton kernels compiled"
    if run.get("timed_steps"):
        words += f"; {run['timed_steps']} phase-timed (eager) steps"
    collections = run.get("gc") or {}
    if collections.get("runs"):
        words += (
            f"; {collections['runs']} collections ({collections['full']} full) "
            f"{collections['ms']:.1f} ms, the longest {collections['max_ms']:.1f}"
        )
    d = run.get("host_disturbance") or {}
    if "feeder_wait_ms" in d:
        words += f"; waited for a CPU: the feeding thread {d['feeder_wait_ms']:.1f} ms"
    if "worker_wait_ms_max" in d:
        words += f", the longest-waiting worker {d['worker_wait_ms_max']:.1f} ms"
    return words


def _evenness(picks: np.ndarray) -> float:
    """Mean normalized entropy of the per-layer pick distributions (1 = perfectly even)."""
    out = []
    for row in picks:
        total = row.sum()
        if total == 0:
            continue
        p = row[row > 0] / total
        out.append(float(-(p * np.log(p)).sum() / math.log(row.size)))
    return float(np.mean(out)) if out else float("nan")


@dataclass(frozen=True)
class Sides:
    """Two settings of one flag that the timed runs alternate between (`ab_side`'s order): A,
    the flag's own value, and B; `apply` sets one on the engine between runs."""

    flag: str
    values: tuple[object, object]
    apply: Callable[[object, object], None]


def alternated_sides(args: argparse.Namespace) -> Sides | str | None:
    """The --alternate-... flag's two sides, None without one, or why they cannot compare."""
    flags = {
        "--alternate-prefetch-rounds": "alternate_prefetch_rounds",
        "--alternate-cpu-pin": "alternate_cpu_pin",
        "--alternate-cpu-redo-us": "alternate_cpu_redo_us",
        "--alternate-copy-ahead": "alternate_copy_ahead",
    }
    asked = [
        (flag, value)
        for flag, dest in flags.items()
        if (value := getattr(args, dest, None)) is not None
    ]
    if not asked:
        return None
    if len(asked) > 1:
        return "one --alternate-... flag at a time"
    flag, b = asked[0]
    if flag == "--alternate-prefetch-rounds":
        sides = Sides(
            "--moe-cpu-prefetch-rounds",
            (args.moe_cpu_prefetch_rounds, b),
            lambda engine, rounds: engine.moe.set_prefetch_rounds(rounds),
        )
    elif flag == "--alternate-cpu-pin":
        sides = Sides(
            "--moe-cpu-pin", (args.moe_cpu_pin, b), lambda engine, mode: engine.set_cpu_pin(mode)
        )
    elif flag == "--alternate-copy-ahead":
        sides = Sides(
            "--moe-copy-ahead",
            (args.moe_copy_ahead, b),
            lambda engine, share: engine.moe.set_copy_ahead(share),
        )
    else:
        sides = Sides(
            "--moe-cpu-redo-us",
            (args.moe_cpu_redo_us, b),
            lambda engine, us: setattr(engine.cpu, "redo_us", us),
        )
    if sides.values[0] == sides.values[1] or args.repeats < 2:
        return f"{flag} needs a value other than {sides.flag}'s and --repeats 2 or more"
    return sides


def _decode(engine, args, sides: Sides | None = None) -> dict:
    """`args.repeats` timed decode runs (after one warm-up) against the rates measured between
    them: the median run's figures (by its share of the bound), with each run's in "runs".
    sides: the two settings the runs alternate between, A and B (`ab_side`, `alternation`)."""
    from .engine import settle_heap

    spec = engine.spec
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, spec.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
        for _ in range(args.batch)
    ]
    engine.generate(prompts, _params(args, args.warmup))
    heap = {"full_collect_ms": settle_heap()}  # as serve does once its engine is ready
    t0 = time.perf_counter()
    gc.collect()
    heap["full_collect_frozen_ms"] = 1e3 * (time.perf_counter() - t0)
    runs = []
    rates_before = concurrent_rates(engine)
    for i in range(args.repeats):
        if sides is not None:
            sides.apply(engine, sides.values[ab_side(i)])
        timed = _timed_decode(engine, args, prompts, profile=args.profile and i == 0)
        rates_after = concurrent_rates(engine)
        rates = rates_around(rates_before, rates_after)
        runs.append(_against_the_bound(engine, args, timed, rates))
        if sides is not None:
            runs[-1]["side"] = ab_side(i)
            runs[-1]["setting"] = sides.values[ab_side(i)]
            runs[-1]["period_by_plan"] = timed["staged_layer_us"]["period_by_plan"]
        rates_before = rates_after
    if args.kernel_profile:  # more steps, after the timed ones (their counts are taken)
        _kernel_profile(engine, prompts, trace=args.trace)
    median = sorted(runs, key=lambda run: run["achieved_of_bound"])[(len(runs) - 1) // 2]
    config = engine.config_in_force()
    fields = _RUN_FIELDS + (("side", "setting", "period_by_plan") if sides else ())
    return {
        **median,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "draw_top_k": args.top_k,  # top_k: the experts each token routes to
        "cuda_graphs": config["cuda_graph_mode"],
        "pdl": config["pdl"],
        "runs": [{k: run[k] for k in fields} for run in runs],
        "heap": heap,
        **({"alternated": alternation(runs, sides.flag)} if sides else {}),
    }


def ab_side(run: int) -> int:
    """The side (0: A, 1: B) of timed run `run` when two settings alternate: A B B A, repeated,
    so that each pair of runs (0 and 1, 2 and 3, ...) holds both, and a disturbance of the host
    that comes every other run (seen on the H200's host) falls on both sides alike."""
    return int(run % 4 in (1, 2))


def alternation(runs: list[dict], flag: str) -> dict:
    """An A/B comparison of runs alternating between two settings of `flag` (`ab_side`'s order,
    each run's `side` and `setting`): each pair's B/A tok/s and their mean, and each side's layer
    step periods by plan over all its runs (the steps' mean, weighted by their counts)."""
    a = [r for r in runs if r["side"] == 0]
    b = [r for r in runs if r["side"] == 1]
    # each pair's A and B are the same pair's (`ab_side`); an odd number of runs leaves the last
    # one unpaired
    ratios = [y["decode_tok_s"] / x["decode_tok_s"] for x, y in zip(a, b, strict=False)]

    def periods(side: list[dict]) -> dict[str, dict[str, float]]:
        merged: dict[str, list[float]] = {}
        for run in side:
            for plan, p in run["period_by_plan"].items():
                total = merged.setdefault(plan, [0.0, 0.0])
                total[0] += p["us"] * p["steps"]
                total[1] += p["steps"]
        return {plan: {"us": t / n, "steps": n} for plan, (t, n) in merged.items() if n}

    return {
        "flag": flag,
        "sides": [a[0]["setting"] if a else None, b[0]["setting"] if b else None],
        "ratios": ratios,
        "mean_ratio": float(np.mean(ratios)) if ratios else None,
        "tok_s": [[r["decode_tok_s"] for r in a], [r["decode_tok_s"] for r in b]],
        "period_by_plan": [periods(a), periods(b)],
    }


def alternation_lines(alt: dict) -> str:
    """What `bench decode` prints of an --alternate-... flag: the pairs' B/A, their mean and
    range, and each side's commonest plans' periods."""
    (a, b), ratios = alt["sides"], alt["ratios"]
    sides = f"\nalternated {alt['flag']} {a} (A) and {b} (B)"
    if not ratios:
        return f"{sides}: no pair ran"
    out = (
        f"{sides}, {len(ratios)} pairs: B/A tok/s "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f"; mean {alt['mean_ratio']:.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
    )
    for side, periods in zip("AB", alt["period_by_plan"], strict=True):
        common = sorted(periods.items(), key=lambda kv: -kv[1]["steps"])[:10]
        shown = ", ".join(f"{plan} {p['us']:.0f} ({p['steps']:.0f})" for plan, p in common)
        out += f"\n{side}'s layer step periods by plan, µs (steps): {shown or 'none'}"
    return out


# What `--repeats` keeps of each run besides the median's whole result
_RUN_FIELDS = (
    "decode_tok_s", "bound_tok_s", "achieved_of_bound", "hit_rate", "hbm_gbps", "bp_gbps",
    "host_gbps", "rates_before", "rates_after", "host_disturbance", "step_ms", "gc", "allocations",
    "compiled", "timed_steps", "cpu_jobs",
)  # fmt: skip


# What a timed run measured besides its time and counts
_TIMED_FIELDS = (
    "host_disturbance", "step_ms", "gc", "allocations", "compiled", "timed_steps", "breakdown",
    "cpu_jobs", "staged_layer_us", "miss_cost",
)  # fmt: skip


def _params(args, max_tokens: int):
    """The decode runs' sampling: greedy, or drawn at --temperature, --top-p and --top-k (each
    sequence seeded apart by the engine's --seed)."""
    from .sampling import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k,
    )  # fmt: skip


def _drawn_words(args) -> str:
    """How the runs' tokens were drawn, where they were not greedy."""
    if not args.temperature:
        return ""
    top_p = f", top-p {args.top_p:g}" if args.top_p < 1 else ""
    top_k = f", top-k {args.top_k}" if args.top_k else ""
    return f", drawn at temperature {args.temperature:g}{top_p}{top_k}"


def _timed_decode(engine, args, prompts: list[list[int]], profile: bool) -> dict:
    """One timed run: `args.tokens` decode steps of a fresh batch of `prompts` (their prefill and
    first token untimed), with the engine's counts and stage times of those steps alone."""
    params = _params(args, args.tokens + 1)
    seqs = [engine.add(p, params) for p in prompts]
    while any(not s.output_ids for s in seqs):
        engine.step()
    c = engine.moe.counters
    before = [a.copy() for a in (c.reads, c.hits, c.fills, c.cpu, c.picks)]
    engine.moe.cpu_times = CpuJobTimes()
    engine.moe.staged_times = StagedStepTimes()
    engine.telemetry.miss_cost = MissCostFit()
    profiler = _host_profile_start(profile)
    around, allocs = host_snapshot(), allocator_counts(engine.device)
    compiled, timed_steps = compiled_variants(), engine.telemetry.timed_steps
    stamps = [time.perf_counter()]  # the start, then the end of each step
    t0 = stamps[0]
    with GcPauses() as collections:
        while not engine.idle:
            engine.step()
            stamps.append(time.perf_counter())
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    disturbance = host_disturbance(
        around, host_snapshot(), threading.get_native_id(), engine.cpu.thread_ids
    )
    _host_profile_print(profiler)
    counts = (
        a - b for a, b in zip((c.reads, c.hits, c.fills, c.cpu, c.picks), before, strict=True)
    )
    return {
        "elapsed": elapsed,
        "counts": dict(zip(("reads", "hits", "fills", "cpu", "picks"), counts, strict=True)),
        "host_disturbance": disturbance,
        "step_ms": step_times(np.diff(stamps)),
        "gc": collections.to_dict(),
        "allocations": {k: v - allocs[k] for k, v in allocator_counts(engine.device).items()},
        "compiled": compiled_variants() - compiled,
        "timed_steps": engine.telemetry.timed_steps - timed_steps,
        "breakdown": dict(engine.telemetry.breakdown),
        "cpu_jobs": engine.moe.cpu_times.to_dict(),
        "staged_layer_us": {
            **engine.moe.staged_times.to_dict(),
            "guess_lead_us": 1e6 * engine.moe.guess_lead_seconds(),
        },
        "miss_cost": engine.telemetry.miss_cost.to_dict(),
    }


def mean_context(prompt_tokens: int, steps: int) -> float:
    """The mean number of tokens a sequence's attention reads over a timed run's `steps` decode
    steps: the first output token (untimed) makes the context prompt + 1, each timed step reads
    the context including the token it writes."""
    return prompt_tokens + (steps + 1) / 2


def _against_the_bound(engine, args, timed: dict, rates: dict) -> dict:
    """A timed run's tok/s beside its bound t_min, from its counts and the rates around it."""
    spec = engine.spec
    counts = timed["counts"]
    reads, hits, fills, cpu = (counts[k] for k in ("reads", "hits", "fills", "cpu"))
    steps = args.tokens
    elapsed = timed["elapsed"]
    tok_s = args.batch * steps / elapsed
    eb = spec.expert_bytes * engine.dtype.itemsize // spec.dtype_bytes
    elem = engine.dtype.itemsize
    dense_step = (spec.dense_params - spec.vocab_size * spec.hidden_size) * elem
    hits_step, misses_step = hits.sum() / steps, (fills.sum() + cpu.sum()) / steps
    kv_token = spec.kv_bytes_per_token * elem // spec.dtype_bytes  # every layer's K and V
    kv_step = args.batch * mean_context(args.prompt_tokens, steps) * kv_token
    resident_bytes = dense_step + kv_step + hits_step * eb
    miss_bytes = misses_step * eb
    t_min = resident_bytes / (rates["hbm_gbps"] * 1e9) + miss_bytes / (
        (rates["bp_gbps"] + rates["host_gbps"]) * 1e9
    )
    bound = args.batch / t_min
    active = dense_step + kv_step / args.batch + spec.num_moe_layers * spec.top_k * eb
    return {
        "batch": args.batch,
        "tokens": steps,
        "decode_tok_s": tok_s,
        "ms_per_step": 1e3 * elapsed / steps,
        "hit_rate": float(hits.sum() / reads.sum()) if reads.sum() else None,
        "fills_per_step": float(fills.sum() / steps),
        "cpu_per_step": float(cpu.sum() / steps),
        "pick_evenness": _evenness(counts["picks"]),
        "bound_tok_s": bound,
        "achieved_of_bound": tok_s / bound,
        "hbm_bound_tok_s": args.batch * rates["hbm_gbps"] * 1e9 / active,
        "active_bytes_per_token": active,
        "kv_bytes_per_step": kv_step,
        **{k: timed[k] for k in _TIMED_FIELDS},
        **rates,
    }


def _host_profile_start(wanted: bool):
    """A running cProfile profiler where --profile asked for one, else None."""
    if not wanted:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _host_profile_print(profiler) -> None:
    """Stop a --profile profiler and print where the host spent its time, to stderr."""
    if profiler is None:
        return
    import pstats

    profiler.disable()
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)


def _kernel_profile(
    engine, prompts: list[list[int]], steps: int = 16, trace: Path | None = None
) -> None:
    """Device time per kernel over `steps` decode steps, to stderr; their timeline to `trace`."""
    from .sampling import SamplingParams

    seqs = [engine.add(p, SamplingParams(max_tokens=steps + 1, ignore_eos=True)) for p in prompts]
    while any(not s.output_ids for s in seqs):
        engine.step()
    _profile_until_idle(engine, trace)


def _prefill_kernel_profile(
    engine, tokens: int, gen: torch.Generator, trace: Path | None = None
) -> None:
    """Device time per kernel over one prefill of a fresh `tokens`-token prompt, to stderr; its
    timeline to `trace`."""
    from .sampling import SamplingParams

    prompt = torch.randint(0, engine.spec.vocab_size, (tokens,), generator=gen).tolist()
    engine.add(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    _profile_until_idle(engine, trace)


def _profile_until_idle(engine, trace: Path | None) -> None:
    """Run the engine's queued work under torch.profiler: its kernels' table to stderr."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        engine.run_until_idle()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    print(
        prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60),
        file=sys.stderr,
    )
    if trace is not None:
        prof.export_chrome_trace(str(trace))
        print(f"timeline written to {trace}", file=sys.stderr)


def _prefill_times(engine, tokens: int, repeats: int, gen: torch.Generator) -> list[float]:
    """Seconds to prefill each of `repeats` fresh prompts of `tokens` tokens (one warm-up first)."""
    from .sampling import SamplingParams

    times = []
    for _ in range(repeats + 1):
        prompt = torch.randint(0, engine.spec.vocab_size, (tokens,), generator=gen).tolist()
        seq = engine.add(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        engine.run_until_idle()
        times.append(time.perf_counter() - t0)
        assert seq.finished
    return times[1:]


def _prefill_seconds(engine, tokens: int, repeats: int, gen: torch.Generator) -> float:
    """Median seconds to prefill a fresh prompt of `tokens` tokens (one warm-up first)."""
    return float(np.median(_prefill_times(engine, tokens, repeats, gen)))


def find_crossover(engine, repeats: int = 2) -> dict:
    """Prefill chunk length from which streaming whole layers beats fetching what is routed to."""
    moe = engine.moe
    if engine.cache.holds_everything or not moe.stage_bytes:
        raise ValueError("the crossover needs offloaded experts: use --moe-cache-rate below 1")
    gen = torch.Generator().manual_seed(3)
    keep = moe.prefill_stream_min_tokens
    rows = []
    try:
        for tokens in (4, 8, 16, 32, 64, 128, 256, 512):
            if tokens > engine.args.prefill_chunk_tokens:
                break
            moe.prefill_stream_min_tokens = 10**9
            routed = _prefill_seconds(engine, tokens, repeats, gen)
            moe.prefill_stream_min_tokens = 1
            streamed = _prefill_seconds(engine, tokens, repeats, gen)
            rows.append({"tokens": tokens, "routed_s": routed, "streamed_s": streamed})
    finally:
        moe.prefill_stream_min_tokens = keep
    faster = [r["tokens"] for r in rows if r["streamed_s"] < r["routed_s"]]
    return {"rows": rows, "stream_min_tokens": faster[0] if faster else None}


def _prefill(engine, args) -> dict:
    spec = engine.spec
    gen = torch.Generator().manual_seed(2)
    profiler = _host_profile_start(args.profile)
    times = _prefill_times(engine, args.prompt_tokens, args.repeats, gen)
    _host_profile_print(profiler)
    elapsed = float(np.median(times))
    if args.kernel_profile:
        _prefill_kernel_profile(engine, args.prompt_tokens, gen, trace=args.trace)
    rates = concurrent_rates(engine)
    eb = spec.expert_bytes * engine.dtype.itemsize // spec.dtype_bytes
    chunks = math.ceil(args.prompt_tokens / engine.args.prefill_chunk_tokens)
    stream_s = (
        0.0
        if engine.cache.holds_everything
        else (chunks * spec.experts_total * eb / (rates["bp_gbps"] * 1e9))
    )
    crossover = None
    if args.crossover:
        from .bench import save_crossover

        crossover = find_crossover(engine)
        if crossover["stream_min_tokens"] is not None:
            save_crossover(engine, crossover["stream_min_tokens"], engine.args.bw_profile)
    return {"prompt_tokens": args.prompt_tokens, "prefill_tok_s": args.prompt_tokens / elapsed,
            "crossover": crossover, "seconds": elapsed, "seconds_each": times,
            "pcie_bound_tok_s": args.prompt_tokens / stream_s if stream_s else None,
            **rates}  # fmt: skip


def policy_words(policy) -> str:
    """The miss policy a run ended with: for auto, the share of misses it fetched and the CPU
    rate that share came from (it follows the CPU jobs' measured rate)."""
    words = f"miss policy {policy.mode}: fetches {policy.fetch_fraction:.0%} of the misses"
    if policy.mode == "auto" and policy.bh_gbps is not None:
        words += f" at the end (the CPU rate it planned with: {policy.bh_gbps:.1f} GB/s)"
    return words


def staged_lines(staged: dict) -> str:
    """What `bench decode` prints of its staged layer steps (`StagedStepTimes.to_dict`): the host's
    time by stage, and the commonest plans' periods; empty where no step was staged."""
    if not staged["layer_steps"]:
        return ""
    stages = ", ".join(f"{name} {staged[f'{name}_us']:.0f}" for name in StagedStepTimes.STAGES)
    out = f"\nhost per staged layer step, µs: {stages}; {staged['total_us']:.0f} in all"
    periods = staged["period_by_plan"]
    if periods:
        common = sorted(periods.items(), key=lambda kv: -kv[1]["steps"])[:8]
        shown = ", ".join(f"{plan} {p['us']:.0f} ({p['steps']})" for plan, p in common)
        out += f"\nlayer step period by plan (copied+on the CPU), µs (steps): {shown}"
    if staged.get("guesses"):
        out += (
            f"\nrouting guesses naming CPU work: {staged['guesses']}; CPU jobs whose workers had "
            f"fetched their first blocks (plans marked p): {staged['prefetched_jobs']} of "
            f"{staged['cpu_jobs']}; other layer steps with a guess: plans marked w"
        )
    if staged.get("copied_ahead") or staged.get("ahead_missed"):
        out += (
            f"\ncopies ahead of the routing (plans marked a): {staged['copied_ahead']} steps took "
            f"one, {staged['ahead_missed']} copied an expert the step did not miss; the guesses' "
            f"lead over the routing {staged.get('guess_lead_us', 0.0):.1f} µs"
        )
    if staged.get("guess_plans"):
        out += (
            f"\nguesses planned in the wait: {staged['guess_plans']}, "
            f"{staged['guess_plan_us']:.1f} µs each (their copies ahead queued too); the routing "
            f"came during {staged['guess_late']} of them"
        )
    if staged["boundary_us"] is not None:
        boundary = staged["boundary_us"]
        out += f"; between steps (the last layer's routing to the next step's first) {boundary:.0f}"
        if staged.get("boundary_host_us") is not None:
            out += f", {staged['boundary_host_us']:.0f} of it before the next step's launch"
    return out


# the flags whose runs need pieces that send routing guesses: the --alternate-... flag of each,
# and its own dest (the engine starts with the larger of the two sides)
_GUESSING = {
    "--moe-cpu-prefetch-rounds": ("--alternate-prefetch-rounds", "moe_cpu_prefetch_rounds"),
    "--moe-copy-ahead": ("--alternate-copy-ahead", "moe_copy_ahead"),
}


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "trace", None) is not None and not args.kernel_profile:
        print("moelab bench decode: --trace needs --kernel-profile", file=sys.stderr)
        return 2
    if args.bench == "decode":
        try:  # a wrong --temperature, --top-p or --top-k, before the model loads
            _params(args, 1)
        except ValueError as err:
            print(f"moelab bench decode: {err}", file=sys.stderr)
            return 2
    sides = alternated_sides(args) if args.bench == "decode" else None
    if isinstance(sides, str):
        print(f"moelab bench decode: {sides}", file=sys.stderr)
        return 2
    guessing = sides is not None and sides.flag in _GUESSING
    if guessing:  # the pieces are captured sending guesses
        setattr(args, _GUESSING[sides.flag][1], max(sides.values))
    with tempfile.TemporaryDirectory() as workdir:
        engine = _engine(args, Path(workdir))
        try:
            if guessing and (engine.graphs is None or engine.graphs.routing_guess is None):
                print(
                    f"moelab bench decode: {_GUESSING[sides.flag][0]} needs pieces that send "
                    "routing guesses: offloaded decode on CUDA with its graphs and the native "
                    "planner",
                    file=sys.stderr,
                )
                return 2
            if sides is not None:
                try:  # each side once, so that one the engine cannot take is refused now
                    for value in reversed(sides.values):
                        sides.apply(engine, value)
                except ValueError as err:
                    print(f"moelab bench decode: {sides.flag} {value}: {err}", file=sys.stderr)
                    return 2
            if args.bench == "decode":
                result = _decode(engine, args, sides)
            else:
                result = _prefill(engine, args)
        finally:
            engine.close()
    spec = engine.spec
    plan = engine.plan
    result.update(
        model=spec.arch,
        layers=spec.num_layers,
        experts=spec.num_experts,
        top_k=spec.top_k,
        slots=plan.slots,
        experts_total=plan.experts_total,
        device=str(engine.device),
        dtype=str(engine.dtype)[6:],
        gpu=torch.cuda.get_device_name(0) if engine.device.type == "cuda" else None,
        policy=engine.policy.mode,
        fetch_fraction=engine.policy.fetch_fraction,  # at the end: auto follows the CPU rate
        policy_bh_gbps=engine.policy.bh_gbps,
    )
    if args.bench == "decode":
        line = (
            f"decode {result['decode_tok_s']:.1f} tok/s at batch {result['batch']}"
            f"{_drawn_words(args)} ({result['ms_per_step']:.2f} ms/step); bound "
            f"{result['bound_tok_s']:.1f} tok/s, "
            f"achieved {result['achieved_of_bound']:.0%}; hit rate "
            f"{result['hit_rate'] if result['hit_rate'] is not None else float('nan'):.3f}, "
            f"pick evenness {result['pick_evenness']:.3f}; slots {plan.slots}/"
            f"{plan.experts_total}; HBM {result['hbm_gbps']:.0f} GB/s, Bp "
            f"{result['bp_gbps']:.1f}, B_host {result['host_gbps']:.1f} GB/s"
        )
        if result["experts_total"] > result["slots"]:
            line += f"\n{policy_words(engine.policy)}"
        if len(result["runs"]) > 1:
            line += "\nruns (this line's figures are the median's): " + ", ".join(
                f"{run['decode_tok_s']:.1f} tok/s {run['achieved_of_bound']:.0%} "
                f"(B_host {run['host_gbps']:.1f}{stall_words(run)})"
                for run in result["runs"]
            )
        line += staged_lines(result["staged_layer_us"])
        if "alternated" in result:
            line += alternation_lines(result["alternated"])
        line += cpu_jobs_line(result["cpu_jobs"])
        if d := result.get("host_disturbance"):
            line += (
                f"\nhost during the run: {d['steal_share']:.1%} of CPU time stolen by the "
                f"hypervisor, interrupts {d['irq_busiest_share']:.1%} of {d['irq_busiest_cpu']}"
            )
            if "feeder_preemptions" in d:
                line += f", the feeding thread preempted {d['feeder_preemptions']} times"
            for key, what in (("busiest_threads", "threads"), ("busiest_processes", "processes")):
                if d.get(key):
                    busy = ", ".join(f"{name} {ms:.1f} ms" for name, ms in d[key])
                    line += f"; busiest other {what}: {busy}"
        if words := stall_words(result):
            line += "\nsteps" + words.removeprefix("; steps")
        heap = result["heap"]
        line += (
            f"\nheap settled before the timed runs: a full collection took "
            f"{heap['full_collect_ms']:.0f} ms, {heap['full_collect_frozen_ms']:.1f} ms after it"
        )
    else:
        bound = result["pcie_bound_tok_s"]
        rates = [result["prompt_tokens"] / t for t in result["seconds_each"]]
        line = (
            f"prefill {result['prefill_tok_s']:.1f} tok/s for {result['prompt_tokens']} "
            f"tokens (median of {len(rates)}, {min(rates):.0f}–{max(rates):.0f}); "
            f"PCIe streaming estimate "
            f"{f'{bound:.1f} tok/s' if bound else 'none (all experts resident)'}"
        )
    print(line, file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0
