"""How long `moelab serve` takes to answer /health, and where the engine's part of it went.

Usage: python scripts/serve_start.py CHECKPOINT_DIR [RUNS] [-- ENGINE FLAGS...]
Starts the engine RUNS times (default 3), one after the other, as the benchmark's trials do, and
prints per run: seconds from the process start to /health ok, to the server's first log line, and
the engine's own "engine ready" line (its phases). For docs/performance.md (the benchmark's restart
cost).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from moelab.engine.process import launch


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    model, runs = argv[0], int(argv[1]) if len(argv) > 1 else 3
    logs = Path(tempfile.mkdtemp(prefix="serve-start-"))
    for run in range(runs):
        log = logs / f"run-{run}.log"
        flags = ["--model-path", model, "--port", str(8400 + run), *extra]
        t0 = time.time()
        engine = launch.start_engine(flags, log)
        try:
            launch.wait_ready(engine, timeout_s=300)
            ready_s = time.time() - t0
        finally:
            launch.stop_engine(engine)
        stop_s = time.time() - t0 - ready_s
        lines = log.read_text().splitlines()
        ready = next((line for line in lines if "engine ready" in line), "(no ready line)")
        print(f"run {run}: /health ok after {ready_s:.2f} s, stopped in {stop_s:.2f} s")
        print(f"  {ready.split('] ', 1)[-1]}")
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
