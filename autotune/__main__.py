"""`python -m moelab.autotune`: one benchmark run without mgr, printing each trial as it lands.

For measuring the benchmark itself on a machine (the trial overhead on a GPU, say) without a
daemon; the console's runs go through mgr, which stores and resumes them. Nothing is stored here:
the result is printed (and written as JSON with --out).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..engine.config.args import physical_cores
from ..engine.model.spec import CheckpointError, ModelSpec
from ..engine.text import Text
from .flagset import Change, apply_change, effective_value
from .journal import Journal, StoredTrial
from .modes import MODES
from .noise import OBJECTIVES, NoiseRule, Objective
from .plan import MachineFacts, ModelFacts, make_plan
from .search import Search, SearchFailed
from .search_records import SearchSettings
from .trial import EngineTrialRunner
from .trial_record import TrialRequest, TrialResult
from .workload import Workload


class PrintJournal(Journal):
    """Keeps the run in memory and prints a line per trial and per event."""

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.trials: dict[int, StoredTrial] = {}

    def trial_starting(self, n: int, request: TrialRequest) -> None:
        label = request.change.label if request.change else "the flags as they are"
        print(f"trial {n} ({request.role}): {label}", flush=True)

    def save_trial(self, trial: StoredTrial) -> None:
        self.trials[trial.n] = trial
        r = trial.result
        if r.ok:
            print(
                f"  prefill {r.prefill_tok_s:,.1f}  decode {r.decode_tok_s:,.1f}"
                + (f"  aggregate {r.aggregate_tok_s:,.1f}" if r.aggregate_tok_s else "")
                + (f"  agent session {r.agent_tok_s:,.1f}" if r.agent_tok_s else "")
                + f" tok/s; start-up {r.startup_s:.1f} s, warm-up {r.warmup_s:.1f} s, "
                f"workload {r.workload_s:.1f} s of {r.duration_s:.1f} s",
                flush=True,
            )
            for stage in r.details.get("stages") or [r.details]:
                print(f"    {parts_line(stage)}", flush=True)
        else:
            print(f"  failed ({r.failure}): {r.error}", flush=True)

    def set_verdict(self, n: int, verdict: str, reason: Text) -> None:
        old = self.trials[n]
        self.trials[n] = StoredTrial(n, old.request, old.result, verdict, reason)
        print(f"  trial {n}: {verdict}: {reason}", flush=True)

    def save_event(self, kind: str, message: Text, data: dict[str, Any]) -> None:
        print(f"{kind}: {message}", flush=True)

    def forget_from(self, n: int) -> None:
        self.trials = {k: v for k, v in self.trials.items() if k < n}

    def progress(self, phase: str, eta_s: float | None) -> None:
        pass


def parts_line(details: dict[str, Any]) -> str:
    """Where one workload's seconds went: each part's requests, the median and slowest one."""
    spec = details.get("workload") or {}
    walls = {"prefill": details.get("prefill_wall_s"), "decode": details.get("decode_wall_s")}
    out = []
    for part, seconds in (details.get("parts_s") or {}).items():
        text = f"{part} {seconds:.1f} s"
        each = walls.get(part)
        if each:
            text += (
                f" ({len(each)} requests, median {statistics.median(each):.3f} s, "
                f"slowest {max(each):.3f} s)"
            )
        out.append(text)
    total = details.get("workload_s")
    return (
        "; ".join(out)
        + (f"; {total:.1f} s in all" if total is not None else "")
        + (f" [{spec.get('decode_tokens')} tokens per generation]" if spec else "")
    )


def gpu_count() -> int:
    """GPUs NVML sees (0 without a driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver or no NVML: a machine without GPUs here
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moelab.autotune",
        description="Run one benchmark of a checkpoint without mgr and print every trial.",
    )
    parser.add_argument("--model-path", required=True, help="checkpoint directory")
    parser.add_argument("--mode", default="quick", choices=list(MODES))
    parser.add_argument("--objective", default="decode", choices=list(OBJECTIVES))
    parser.add_argument("--clients", type=int, default=8, help="for the aggregate objective")
    parser.add_argument(
        "--base-flags", default="", help='starting engine flags, e.g. "--moe-cache-rate 0.5"'
    )
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="FLAG",
        help="tune only this flag, named without its dashes (moe-cache-rate); repeatable",
    )
    parser.add_argument(
        "--target-s",
        type=float,
        default=None,
        help="seconds the measured workload of a trial should last (default: the mode's)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)
    if args.target_s is not None and args.target_s <= 0:
        parser.error("--target-s must be a number of seconds above 0")
    try:
        spec = ModelSpec.from_dir(args.model_path)
    except (CheckpointError, OSError) as err:
        print(f"cannot read {args.model_path}: {err}", file=sys.stderr)
        return 2
    machine = MachineFacts(physical_cores=physical_cores(), gpus=gpu_count())
    base = shlex.split(args.base_flags)
    if not machine.gpus and effective_value(base, "--device") == "auto":
        base = apply_change(base, Change("--device", "cpu"))
    objective = Objective(args.objective, args.clients if args.objective == "aggregate" else 0)
    mode = MODES[args.mode]
    if args.target_s is not None:
        mode = replace(mode, target_s=args.target_s)
    model = ModelFacts(
        args.model_path, spec.num_moe_layers, spec.num_experts, spec.max_position_embeddings
    )
    plan = make_plan(
        base,
        model,
        machine,
        mode,
        objective,
        only_flags=frozenset("--" + f.lstrip("-") for f in args.only) if args.only else None,
    )
    logs = Path(tempfile.mkdtemp(prefix="moelab-bench-"))
    print(f"{len(plan.candidates)} candidates; engine logs in {logs}", flush=True)
    runner = EngineTrialRunner(
        args.model_path,
        Workload(mode.workload_for(objective.clients, objective.agent)),
        logs,
        threading.Event(),
    )

    def run(request: TrialRequest, n: int) -> TrialResult:
        return runner.run(request, f"trial-{n}")

    settings = SearchSettings(mode, objective, NoiseRule(), spec.max_position_embeddings)
    try:
        result = Search(plan, base, settings, PrintJournal(run)).run()
    except SearchFailed as err:
        print(f"the run failed: {err}", file=sys.stderr)
        return 1
    overhead = result["overhead"]
    per_trial = overhead["workload_s_per_trial"]
    print(f"result: {' '.join(result['flags'])}")
    print(
        f"gain {result['gain']:+.1%}; restart + warm-up {overhead['overhead_s']:.1f} s of "
        f"{overhead['trial_s']:.1f} s of trials ({overhead['share']:.1%}); workload "
        + (f"{per_trial:.1f} s per trial" if per_trial is not None else "not measured")
        + f" (target {mode.target_s:.0f} s)"
    )
    if overhead["share_per_trial"] is not None:
        print(
            f"per trial after the calibration one: restart + warm-up "
            f"{overhead['per_trial_s']:.1f} s, {overhead['share_per_trial']:.1%} of its time; "
            f"the first engine's start (kernels compiled on a fresh machine) "
            f"{overhead['first_start_s']:.1f} s"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
