"""Two source trees' `moelab bench decode` in interleaved pairs, on one machine.

Usage: python scripts/ab_decode.py A_DIR B_DIR [--pairs 3] [--out DIR] [--a-flags FLAGS]
           [--b-flags FLAGS] -- BENCH_FLAGS...
e.g.   git archive HEAD~1 | tar -x -C /tmp/A
       python scripts/ab_decode.py /tmp/A . --pairs 3 -- --preset qwen3-30b-a3b \\
           --set num_hidden_layers=12 --routing-skew 1 --moe-cache-rate 0.25
or, one tree with and without a flag:
       python scripts/ab_decode.py . . --b-flags "--moe-cpu-prefetch-rounds 2" -- ...

Each run installs its tree (`pip install --no-deps -e`: both trees are the package `moelab`), with
a cache folder of its own so that each tree's native CPU kernel is built once, then runs `bench
decode BENCH_FLAGS --json`: A, B, A, B, ... Prints one JSON line per run (tok/s, the share of the
bound, the CPU experts' GB/s inside decode, B_host, the layer step period of each plan) and a last
line with each tree's means, the pairs' tok/s ratios B / A and, for each plan both trees made, the
mean period of each and B - A. The host's rates move between runs by more than most changes
(docs/performance.md), so only pairs run side by side compare code; the CPU rate beside each run
says which pairs ran on a disturbed host. A run where the hypervisor took more than `--max-steal`
of the CPUs' time (its process's worst timed run: `bench decode`'s `host_disturbance.steal_share`;
default 2%) is left out of the means and the periods, and its pair out of the ratios, counted as
`disturbed_pairs`: such runs decode far below their tree's rate, whatever the tree
(docs/performance.md).

With the auto miss policy each run's fetch share follows the rates it measured, so the runs make
different plans. Pinning the share (`--moe-miss-policy split:0.33`) makes every run plan alike
(the routing is seeded), so that the periods by plan compare the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path


def run_once(tree: Path, cache: Path, flags: list[str], log: Path, install: bool = True) -> dict:
    """Install `tree` (unless it is installed already), run one bench decode; its figures (or the
    failure) as a dict."""
    if install:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
             "-e", str(tree)],
            check=True, capture_output=True,
        )  # fmt: skip
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    cmd = [sys.executable, "-m", "moelab.engine.cli", "bench", "decode", *flags, "--json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"tree": str(tree), "error": f"exit {done.returncode}, see {log}"}
    r = json.loads(lines[-1])
    steals = [
        (run.get("host_disturbance") or {}).get("steal_share") for run in r.get("runs") or [r]
    ]
    steals = [v for v in steals if v is not None]
    return {
        "tree": str(tree),
        "tok_s": r["decode_tok_s"],
        "steal_share": max(steals) if steals else None,
        "of_bound": r["achieved_of_bound"],
        "cpu_gbps": (r.get("cpu_jobs") or {}).get("gbps"),
        "host_gbps": r["host_gbps"],
        "periods_us": {
            plan: p["us"]
            for plan, p in ((r.get("staged_layer_us") or {}).get("period_by_plan") or {}).items()
        },
    }


def summary(runs: list[dict], a: str, b: str, max_steal: float = 0.02) -> dict:
    """Each tree's mean tok/s, share of the bound and periods by plan over its runs, and the
    pairs' B / A tok/s ratios. Runs that failed, or ran on a host that took more than `max_steal`
    of the CPUs' time, are left out of all of them, and the ratios leave out the pairs that hold
    one (those on a disturbed host are counted as disturbed_pairs)."""

    def disturbed(r: dict) -> bool:
        return (r.get("steal_share") or 0.0) > max_steal

    pairs = zip(runs[0::2], runs[1::2], strict=False)
    ran = [(ra, rb) for ra, rb in pairs if "error" not in ra | rb]
    kept = [(ra, rb) for ra, rb in ran if not (disturbed(ra) or disturbed(rb))]
    counted = [r for r in runs if "error" not in r and not disturbed(r)]
    out: dict = {}
    for name, tree in (("a", a), ("b", b)):
        ok = [r for r in counted if r["tree"] == tree]
        out[name] = {
            "tree": tree, "runs": len(ok),
            "tok_s": statistics.mean(r["tok_s"] for r in ok) if ok else None,
            "of_bound": statistics.mean(r["of_bound"] for r in ok) if ok else None,
        }  # fmt: skip
    ratios = [rb["tok_s"] / ra["tok_s"] for ra, rb in kept]
    out["disturbed_pairs"] = len(ran) - len(kept)
    out["b_over_a"] = (
        {
            "mean": statistics.mean(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "pairs": len(ratios),
        }
        if ratios
        else None
    )
    out["periods_us"] = _periods(counted, a, b)
    return out


def _periods(runs: list[dict], a: str, b: str) -> dict:
    """For each plan that runs of both trees made: each tree's mean period (µs) over its runs
    that made it, and B - A."""
    means = []
    for tree in (a, b):
        seen: dict[str, list[float]] = {}
        for r in runs:
            if r["tree"] == tree and "error" not in r:
                for plan, us in (r.get("periods_us") or {}).items():
                    seen.setdefault(plan, []).append(us)
        means.append({plan: statistics.mean(values) for plan, values in seen.items()})
    mean_a, mean_b = means
    return {
        plan: {"a": mean_a[plan], "b": mean_b[plan], "b_minus_a": mean_b[plan] - mean_a[plan]}
        for plan in sorted(mean_a.keys() & mean_b.keys())
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the tree run first in each pair (the baseline)")
    parser.add_argument("b", type=Path, help="the tree compared with it")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs (default 3)")
    parser.add_argument("--out", type=Path, default=Path("ab_decode"), help="logs go here")
    parser.add_argument(
        "--max-steal", type=float, default=0.02,
        help="leave out pairs with a run whose stolen CPU share exceeds this (default 0.02)",
    )  # fmt: skip
    parser.add_argument("--a-flags", default="", help="bench flags of A's runs only")
    parser.add_argument("--b-flags", default="", help="bench flags of B's runs only")
    argv = sys.argv[1:] if argv is None else argv
    # bench decode's flags follow "--": this script's own come before it
    cut = argv.index("--") if "--" in argv else len(argv)
    args, flags = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.pairs < 1:
        parser.error("--pairs must be 1 or more")
    if not 0 <= args.max_steal <= 1:
        parser.error("--max-steal is a share of the CPUs' time, from 0 to 1")
    a, b = args.a.resolve(), args.b.resolve()
    for tree in (a, b):
        if not (tree / "pyproject.toml").is_file():
            parser.error(f"{tree} is not a moelab source tree (no pyproject.toml)")
    args.out.mkdir(parents=True, exist_ok=True)
    # each side by its tree and its own flags (one tree may run on both sides)
    sides = [(name, tree, own, f"{tree} {own}".strip())
             for name, tree, own in (("a", a, args.a_flags), ("b", b, args.b_flags))]  # fmt: skip
    if sides[0][3] == sides[1][3]:
        parser.error("A and B are the same tree with the same flags: nothing to compare")
    runs, installed = [], None
    for i in range(args.pairs):
        for name, tree, own, label in sides:
            cache = args.out / f"cache-{name}"
            log = args.out / f"{name}{i + 1}.log"
            result = run_once(tree, cache, flags + shlex.split(own), log, install=tree != installed)
            installed = tree
            result["tree"] = label
            runs.append(result)
            print(json.dumps({"run": f"{name}{i + 1}", **result}), flush=True)
    print(json.dumps(summary(runs, sides[0][3], sides[1][3], args.max_steal)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
