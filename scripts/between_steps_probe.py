"""Where the host's time goes between two offloaded decode steps: `moelab bench decode` with
probes (monkeypatched timers) around the calls on the host's path from one step's last staged
layer to the next step's first launch.

Usage (needs CUDA): python scripts/between_steps_probe.py bench decode --preset qwen3-30b-a3b \\
    --set num_hidden_layers=12 --moe-cache-rate 0.25 --tokens 128 --routing-skew 1 --json

Prints, on stderr, one "PROBE" JSON line: for each timed call, its median and mean µs and its
count (docs/performance.md, eighteenth session). The timers cost the host a little themselves.
"""

import collections
import json
import sys
import time

import torch

from moelab.engine import graphs, moe, scheduler, staged_decode, stepping
from moelab.engine.cli import main

pc = time.perf_counter
T: dict[str, list[float]] = collections.defaultdict(list)
ctx = {"in_run_pre": False, "t_run": 0.0}


def timed(cls: type, name: str, key: str) -> None:
    f = getattr(cls, name)

    def w(*a, **k):
        t0 = pc()
        r = f(*a, **k)
        T[key].append(pc() - t0)
        return r

    setattr(cls, name, w)


def probe() -> None:
    timed(graphs.DecodeGraphs, "sampled_to_host", "sampled_to_host")
    timed(moe.MoERunner, "snapshot_decode_ids", "snapshot_decode_ids")
    timed(torch.cuda.Event, "record", "event_record")
    timed(torch.cuda.Event, "__init__", "event_init")
    timed(staged_decode.StagedDecode, "after_launch", "after_launch")
    timed(staged_decode.StagedDecode, "join_fills", "join_fills")
    timed(staged_decode.StagedDecode, "expect_routing", "expect_routing")
    timed(stepping.Stepping, "_launch", "_launch")
    timed(graphs.DecodeGraphs, "step_done", "step_done")
    timed(stepping.Stepping, "_land", "_land")
    timed(scheduler.Scheduler, "next_step", "next_step")
    copy, run, replay = torch.Tensor.copy_, graphs.DecodeGraphs.run, graphs.Graph.replay

    def timed_copy(self, *a, **k):  # torch copies in a step's inputs, before its first replay
        t0 = pc()
        r = copy(self, *a, **k)
        if ctx["in_run_pre"]:
            T["run_input_copy"].append(pc() - t0)
        return r

    def marked_run(self, rows):
        ctx["in_run_pre"], ctx["t_run"] = True, pc()
        return run(self, rows)

    def timed_replay(self):
        if ctx["in_run_pre"]:
            ctx["in_run_pre"] = False
            T["run_entry_to_first_replay"].append(pc() - ctx["t_run"])
        t0 = pc()
        replay(self)
        T["graph_replay"].append(pc() - t0)

    torch.Tensor.copy_ = timed_copy
    graphs.DecodeGraphs.run = marked_run
    graphs.Graph.replay = timed_replay


if __name__ == "__main__":
    probe()
    rc = main(sys.argv[1:])
    out = {
        k: {"med_us": round(1e6 * sorted(v)[len(v) // 2], 1),
            "mean_us": round(1e6 * sum(v) / len(v), 1), "n": len(v)}
        for k, v in T.items()
    }  # fmt: skip
    print("PROBE " + json.dumps(out), file=sys.stderr)
    sys.exit(rc)
