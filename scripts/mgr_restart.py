"""How long `mgr` takes to answer after a `kill -9` in the middle of a benchmark trial.

Builds a data dir whose database holds SIZE_MB of telemetry (a 48-layer engine sampled every
2 s) and audit rows (refused requests with 30 kB paths) and starts `mgr` on it. While it runs,
a benchmark's rows say that its trial engine, a real `moelab serve` of MODEL, is loading, and
four clients send requests that each write an audit row; after LOADING_S seconds `mgr` gets
SIGKILL. Then a second `mgr` starts on the data dir, and one JSON line says the database's size
(with its WAL) and the seconds from the second start to its first answer (the second mgr also
stops the trial engine the first one left loading).

Usage: python scripts/mgr_restart.py MODEL [SIZE_MB] [LOADING_S] [-- ENGINE FLAGS]
(docs/daemon.md)
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from moelab.daemon.benchmark_store import add_event
from moelab.daemon.schema import AuditEvent, BenchmarkRun, Server
from moelab.daemon.store import Store
from moelab.daemon.telemetry import Compactor, write_rows
from moelab.engine.process import launch

LAYERS, EXPERTS = 48, 128


def stats_body(uptime_s: float, counts: dict[str, list[int]], picks: list[list[int]]) -> dict:
    return {
        "uptime_s": uptime_s,
        "throughput": {"decode_tok_s_10s": 30.0, "prefill_tok_s_10s": 900.0},
        "requests": {"running": 2, "queued": 0, "completed": int(uptime_s // 10)},
        "kv": {"tokens_total": 65536, "tokens_used": 4000, "tokens_peak": 9000},
        "experts": {
            "slots": 2000,
            "hit_rate_60s": 0.7,
            "layers": [
                {"layer": i, "resident": 40, **{k: v[i] for k, v in counts.items()}}
                for i in range(LAYERS)
            ],
            "picks": [list(row) for row in picks],
        },
    }


def fill(store: Store, size_mb: float) -> None:
    """Telemetry up to 60% of the size (its oldest rows past the day a roll-up waits for), then
    audit rows of refused requests up to the size."""
    now = time.time()
    rng = random.Random(0)
    with store.session() as session:
        session.add(
            Server(id=1, name="kept", model="/m", flags=[], host="127.0.0.1", port=8100,
                   device="cpu", status="stopped", log_path="", created=now - 2 * 86400)
        )  # fmt: skip
    counts = {k: [0] * LAYERS for k in ("reads", "hits", "fills", "cpu")}
    picks = [[0] * EXPERTS for _ in range(LAYERS)]
    compactor = Compactor(fresh=True)
    t, rows = now - 1.2 * 86400, []
    while store.path.stat().st_size < size_mb * 0.6e6 and t < now:
        t += 2.0
        for layer in range(LAYERS):
            n = rng.randint(50, 200)
            for name, share in (("reads", 1.0), ("hits", 0.7), ("fills", 0.2), ("cpu", 0.1)):
                counts[name][layer] += int(n * share)
            picks[layer][rng.randrange(EXPERTS)] += n
        rows += compactor.ingest(stats_body(t - now + 1.2 * 86400, counts, picks), t)
        if len(rows) >= 2000:
            write_rows(store, 1, rows)
            rows = []
    write_rows(store, 1, rows)
    refused = {"time": now, "address": "192.168.1.50", "via": "none", "method": "POST",
               "path": "/api/" + "x" * 30_000, "status": 401,
               "action": "refused: token_required", "detail": {}}  # fmt: skip
    while store.path.stat().st_size < size_mb * 1e6:
        with store.session() as session:
            session.add_all(AuditEvent(**refused) for _ in range(100))


def main() -> None:
    args, engine_flags = sys.argv[1:], []
    if "--" in args:
        args, engine_flags = args[: args.index("--")], args[args.index("--") + 1 :]
    model = Path(args[0]).resolve()
    size_mb = float(args[1]) if len(args) > 1 else 50.0
    loading_s = float(args[2]) if len(args) > 2 else 3.0
    with tempfile.TemporaryDirectory(prefix="mgr-restart-") as tmp:
        print(json.dumps(measure(Path(tmp), model, size_mb, loading_s, engine_flags)))


def start_mgr(data: Path, models: Path) -> tuple[subprocess.Popen, str]:
    """`mgr` on `data` and its URL, once it answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    mgr = subprocess.Popen(
        [sys.executable, "-m", "moelab.console.main", "--port", url.rsplit(":", 1)[1],
         "--data-dir", str(data), "--models-dir", str(models)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    while True:
        try:
            with urllib.request.urlopen(url + "/api/status", timeout=60):
                return mgr, url
        except OSError:
            time.sleep(0.01)


def write_until_killed(url: str, mgr: subprocess.Popen, seconds: float) -> None:
    """Requests that write an audit row each, from four clients, then SIGKILL to mgr."""

    def client() -> None:
        request = urllib.request.Request(url + "/api/" + "x" * 30_000, data=b"{}", method="POST")
        while mgr.poll() is None:
            try:
                urllib.request.urlopen(request, timeout=10).close()
            except OSError:
                pass

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    time.sleep(seconds)
    mgr.kill()
    mgr.wait()
    for thread in clients:
        thread.join()


def measure(
    data: Path, model: Path, size_mb: float, loading_s: float, engine_flags: list[str]
) -> dict:
    store = Store.open(data)
    fill(store, size_mb)
    first, url = start_mgr(data, model.parent)
    # what the first mgr's benchmark has written when its trial engine is loading
    trial = launch.start_engine(
        ["--model-path", str(model), "--port", "8299", *engine_flags], data / "trial.log"
    )
    now = time.time()
    with store.session() as session:
        run = BenchmarkRun(model=str(model), mode="quick", objective="decode", status="running",
                           base_flags=[], options={}, created=now, updated=now)  # fmt: skip
        session.add(run)
        session.flush()
        run_id = run.id
    add_event(store, run_id, "engine", "trial 1", {
        "n": 1, "pid": trial.pid, "process_started": launch.process_start_time(trial.pid),
        "port": 8299, "log": trial.log_path})  # fmt: skip
    store.close()
    write_until_killed(url, first, loading_s)
    size = sum(p.stat().st_size for p in data.glob("mgr.sqlite3*"))
    began = time.monotonic()
    second, _url = start_mgr(data, model.parent)
    answered_s = time.monotonic() - began
    second.send_signal(signal.SIGTERM)
    second.wait()
    launch.stop_engine(trial)
    return {"database_mb": round(size / 1e6, 1), "answered_after_s": round(answered_s, 2)}


if __name__ == "__main__":
    main()
