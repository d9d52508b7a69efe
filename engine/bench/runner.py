"""The decode and prefill benchmarks' timed runs: what is run, what is counted around it, and the
profilers `--profile` and `--kernel-profile` put around it."""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ...kernels.common import compiled_variants
from ..experts.moe_stats import CpuJobTimes, MissCostFit, StagedStepTimes
from ..runtime.sampling import SamplingParams
from .alternate import Sides, ab_side, alternation
from .bound import against_the_bound, concurrent_rates, rates_around
from .host_watch import GcPauses, allocator_counts, host_disturbance, host_snapshot, step_times

# What `--repeats` keeps of each run besides the median's whole result
RUN_FIELDS = (
    "decode_tok_s", "bound_tok_s", "achieved_of_bound", "hit_rate", "hbm_gbps", "bp_gbps",
    "host_gbps", "rates_before", "rates_after", "host_disturbance", "step_ms", "gc", "allocations",
    "compiled", "timed_steps", "cpu_jobs",
)  # fmt: skip

# What a timed run measured besides its time and counts
TIMED_FIELDS = (
    "host_disturbance", "step_ms", "gc", "allocations", "compiled", "timed_steps", "breakdown",
    "cpu_jobs", "staged_layer_us", "miss_cost",
)  # fmt: skip


def sampling_params(args, max_tokens: int) -> SamplingParams:
    """The decode runs' sampling: greedy, or drawn at --temperature, --top-p and --top-k (each
    sequence seeded apart by the engine's --seed)."""
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k,
    )  # fmt: skip


def decode_runs(engine, args, sides: Sides | None = None) -> dict:
    """`args.repeats` timed decode runs (after one warm-up) against the rates measured between
    them: the median run's figures (by its share of the bound), with each run's in "runs".
    sides: the two settings the runs alternate between, A and B (`ab_side`, `alternation`)."""
    from ..runtime.engine import settle_heap

    spec = engine.spec
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, spec.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
        for _ in range(args.batch)
    ]
    engine.generate(prompts, sampling_params(args, args.warmup))
    heap = {"full_collect_ms": settle_heap()}  # as serve does once its engine is ready
    t0 = time.perf_counter()
    gc.collect()
    heap["full_collect_frozen_ms"] = 1e3 * (time.perf_counter() - t0)
    runs = []
    rates_before = concurrent_rates(engine)
    for i in range(args.repeats):
        if sides is not None:
            sides.apply(engine, sides.values[ab_side(i)])
        timed = timed_decode(engine, args, prompts, profile=args.profile and i == 0)
        rates_after = concurrent_rates(engine)
        rates = rates_around(rates_before, rates_after)
        runs.append({**against_the_bound(engine, args, timed, rates),
                     **{k: timed[k] for k in TIMED_FIELDS}})  # fmt: skip
        if sides is not None:
            runs[-1]["side"] = ab_side(i)
            runs[-1]["setting"] = sides.values[ab_side(i)]
            runs[-1]["period_by_plan"] = timed["staged_layer_us"]["period_by_plan"]
        rates_before = rates_after
    if args.kernel_profile:  # more steps, after the timed ones (their counts are taken)
        _decode_kernel_profile(engine, prompts, trace=args.trace)
    median = sorted(runs, key=lambda run: run["achieved_of_bound"])[(len(runs) - 1) // 2]
    config = engine.config_in_force()
    fields = RUN_FIELDS + (("side", "setting", "period_by_plan") if sides else ())
    return {
        **median,
        "prompt_tokens": args.prompt_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "draw_top_k": args.top_k,  # top_k: the experts each token routes to
        "cuda_graphs": config["cuda_graph_mode"],
        "pdl": config["pdl"],
        "cpu_simd": config["cpu_simd"],  # the CPU expert kernel's code path, as in /v1/stats
        "cpu_bf16_dot": config["cpu_bf16_dot"],
        "runs": [{k: run[k] for k in fields} for run in runs],
        "heap": heap,
        **({"alternated": alternation(runs, sides.flag)} if sides else {}),
    }


def timed_decode(engine, args, prompts: list[list[int]], profile: bool) -> dict:
    """One timed run: `args.tokens` decode steps of a fresh batch of `prompts` (their prefill and
    first token untimed), with the engine's counts and stage times of those steps alone."""
    params = sampling_params(args, args.tokens + 1)
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


def prefill_run(engine, args) -> dict:
    """`args.repeats` prefills of a fresh `args.prompt_tokens`-token prompt: their median tok/s
    beside the rate of streaming every expert over PCIe once per chunk; with --crossover, the
    prompt length from which streaming whole layers wins, written into the bandwidth profile."""
    spec = engine.spec
    gen = torch.Generator().manual_seed(2)
    profiler = _host_profile_start(args.profile)
    warmup = getattr(args, "warmup_tokens", None)  # (None: as long as the timed prompts)
    times = _prefill_times(engine, args.prompt_tokens, args.repeats, gen, warmup=warmup)
    _host_profile_print(profiler)
    elapsed = float(np.median(times))
    if args.kernel_profile:
        _prefill_kernel_profile(engine, args.prompt_tokens, gen, trace=args.trace)
    rates = concurrent_rates(engine)
    eb = engine.bank.expert_bytes  # as held: FP8, MXFP4 or NVFP4 with scales, or the dtype's
    chunks = math.ceil(args.prompt_tokens / engine.config.prefill.chunk_tokens)
    stream_s = (
        0.0
        if engine.cache.holds_everything
        else (chunks * spec.experts_total * eb / (rates["bp_gbps"] * 1e9))
    )
    crossover = None
    if args.crossover:
        from ..config.bandwidth import save_crossover

        crossover = find_crossover(engine)
        tokens = crossover["stream_min_tokens"]
        if tokens is not None:
            save_crossover(engine.spec, engine.dtype_name, tokens, engine.config.experts.bw_profile)
    return {"prompt_tokens": args.prompt_tokens, "prefill_tok_s": args.prompt_tokens / elapsed,
            "crossover": crossover, "seconds": elapsed, "seconds_each": times,
            "pcie_bound_tok_s": args.prompt_tokens / stream_s if stream_s else None,
            **rates}  # fmt: skip


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
            if tokens > engine.config.prefill.chunk_tokens:
                break
            moe.prefill_stream_min_tokens = 10**9
            routed = float(np.median(_prefill_times(engine, tokens, repeats, gen)))
            moe.prefill_stream_min_tokens = 1
            streamed = float(np.median(_prefill_times(engine, tokens, repeats, gen)))
            rows.append({"tokens": tokens, "routed_s": routed, "streamed_s": streamed})
    finally:
        moe.prefill_stream_min_tokens = keep
    faster = [r["tokens"] for r in rows if r["streamed_s"] < r["routed_s"]]
    return {"rows": rows, "stream_min_tokens": faster[0] if faster else None}


def _prefill_times(
    engine, tokens: int, repeats: int, gen: torch.Generator, warmup: int | None = None
) -> list[float]:
    """Seconds to prefill each of `repeats` fresh prompts of `tokens` tokens (one warm-up of
    `warmup` tokens first, `tokens` where not given)."""
    times = []
    for i in range(repeats + 1):
        length = (warmup or tokens) if i == 0 else tokens
        prompt = torch.randint(0, engine.spec.vocab_size, (length,), generator=gen).tolist()
        seq = engine.add(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        engine.run_until_idle()
        times.append(time.perf_counter() - t0)
        assert seq.finished
    return times[1:]


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


def _decode_kernel_profile(
    engine, prompts: list[list[int]], steps: int = 16, trace: Path | None = None
) -> None:
    """Device time per kernel over `steps` decode steps, to stderr; their timeline to `trace`."""
    seqs = [engine.add(p, SamplingParams(max_tokens=steps + 1, ignore_eos=True)) for p in prompts]
    while any(not s.output_ids for s in seqs):
        engine.step()
    _profile_until_idle(engine, trace)


def _prefill_kernel_profile(
    engine, tokens: int, gen: torch.Generator, trace: Path | None = None
) -> None:
    """Device time per kernel over one prefill of a fresh `tokens`-token prompt, to stderr; its
    timeline to `trace`."""
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
