"""What `moelab bench decode` and `moelab bench prefill` print on stderr: the result's line, and
for decode the lines of what was counted around the runs (the JSON on stdout holds every figure)."""

from __future__ import annotations

import argparse

from ..experts.moe_stats import StagedStepTimes


def decode_text(result: dict, args: argparse.Namespace, policy) -> str:
    """A decode result (`bench_runner.decode_runs`, with the engine's fields) as lines: tok/s
    beside the bound, then the policy, each run, the staged steps, the alternation, the CPU
    jobs, the host, the steps and the heap."""
    hit_rate = result["hit_rate"] if result["hit_rate"] is not None else float("nan")
    text = (
        f"decode {result['decode_tok_s']:.1f} tok/s at batch {result['batch']}"
        f"{drawn_words(args)} ({result['ms_per_step']:.2f} ms/step); bound "
        f"{result['bound_tok_s']:.1f} tok/s, achieved {result['achieved_of_bound']:.0%}; hit "
        f"rate {hit_rate:.3f}, pick evenness {result['pick_evenness']:.3f}; slots "
        f"{result['slots']}/{result['experts_total']} ({result['expert_dtype']} experts of "
        f"{result['expert_bytes'] / 2**20:.2f} MiB); HBM {result['hbm_gbps']:.0f} GB/s, Bp "
        f"{result['bp_gbps']:.1f}, B_host {result['host_gbps']:.1f} GB/s"
    )
    if result["experts_total"] > result["slots"]:
        text += f"\n{policy_words(policy)}"
    if len(result["runs"]) > 1:
        text += "\nruns (this line's figures are the median's): " + ", ".join(
            f"{run['decode_tok_s']:.1f} tok/s {run['achieved_of_bound']:.0%} "
            f"(B_host {run['host_gbps']:.1f}{stall_words(run)})"
            for run in result["runs"]
        )
    text += staged_lines(result["staged_layer_us"])
    if "alternated" in result:
        text += alternation_lines(result["alternated"])
    text += cpu_jobs_line(result["cpu_jobs"])
    if d := result.get("host_disturbance"):
        text += (
            f"\nhost during the run: {d['steal_share']:.1%} of CPU time stolen by the "
            f"hypervisor, interrupts {d['irq_busiest_share']:.1%} of {d['irq_busiest_cpu']}"
        )
        if "feeder_preemptions" in d:
            text += f", the feeding thread preempted {d['feeder_preemptions']} times"
        for key, what in (("busiest_threads", "threads"), ("busiest_processes", "processes")):
            if d.get(key):
                busy = ", ".join(f"{name} {ms:.1f} ms" for name, ms in d[key])
                text += f"; busiest other {what}: {busy}"
    if words := stall_words(result):
        text += "\nsteps" + words.removeprefix("; steps")
    heap = result["heap"]
    return text + (
        f"\nheap settled before the timed runs: a full collection took "
        f"{heap['full_collect_ms']:.0f} ms, {heap['full_collect_frozen_ms']:.1f} ms after it"
    )


def prefill_text(result: dict) -> str:
    """A prefill result (`bench_runner.prefill_run`) as one line: the median's tok/s with the
    repeats' range, beside the PCIe streaming estimate."""
    bound = result["pcie_bound_tok_s"]
    rates = [result["prompt_tokens"] / t for t in result["seconds_each"]]
    return (
        f"prefill {result['prefill_tok_s']:.1f} tok/s for {result['prompt_tokens']} "
        f"tokens (median of {len(rates)}, {min(rates):.0f}–{max(rates):.0f}); "
        f"PCIe streaming estimate "
        f"{f'{bound:.1f} tok/s' if bound else 'none (all experts resident)'}"
    )


def drawn_words(args: argparse.Namespace) -> str:
    """How the runs' tokens were drawn, where they were not greedy."""
    if not args.temperature:
        return ""
    top_p = f", top-p {args.top_p:g}" if args.top_p < 1 else ""
    top_k = f", top-k {args.top_k}" if args.top_k else ""
    return f", drawn at temperature {args.temperature:g}{top_p}{top_k}"


def policy_words(policy) -> str:
    """The miss policy a run ended with: for auto, the share of misses it fetched and the CPU
    rate that share came from (it follows the CPU jobs' measured rate)."""
    words = f"miss policy {policy.mode}: fetches {policy.fetch_fraction:.0%} of the misses"
    if policy.mode == "auto" and policy.bh_gbps is not None:
        words += f" at the end (the CPU rate it planned with: {policy.bh_gbps:.1f} GB/s)"
    return words


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
