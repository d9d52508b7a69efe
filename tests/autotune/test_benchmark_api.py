"""Benchmark runs driven by the daemon's API, with a fake engine: start, watch, cancel, resume
after a daemon restart, pick up, save as profile, and Recommended following the result."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from moelab.autotune.flagset import value_of
from moelab.autotune.trial_record import TrialRequest, TrialResult
from moelab.daemon.benchmark_store import add_event, update_run
from moelab.daemon.schema import BenchmarkRun, Profile
from moelab.engine.process import launch

from .conftest import record_fresh_rates, running_app
from .fake import FakeEngine, FakeRunner

POOR = ["--device", "cpu", "--device-memory", "1GiB", "--max-running-requests", "1",
        "--moe-cache-size", "1"]  # fmt: skip


def use_fake(daemon_app: Any, engine: FakeEngine, block_at: int | None = None) -> list:
    """Make the app's benchmark service run trials on `engine`; returns the runners made."""
    made: list[FakeRunner] = []

    def factory(*args: Any, **kwargs: Any) -> FakeRunner:
        runner = FakeRunner(engine, block_at, *args, **kwargs)
        made.append(runner)
        return runner

    daemon_app.state.benchmarks.make_runner = factory
    return made


def wait_status(client: TestClient, run_id: int, statuses: tuple[str, ...]) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        run = client.get(f"/api/benchmarks/{run_id}").json()
        if run["status"] in statuses:
            return run
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} stayed {run['status']}")


def start(client: TestClient, model: Path, **body: Any) -> dict:
    body = {"model": str(model), "mode": "standard", "objective": "aggregate", "clients": 16,
            "base_flags": POOR, **body}  # fmt: skip
    reply = client.post("/api/benchmarks", json=body)
    assert reply.status_code == 202, reply.text
    return reply.json()


def test_a_run_finds_saves_and_recommends_its_result(tmp_path: Path, demo_model: Path) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        use_fake(client.app, FakeEngine(seed=21))
        run = start(client, demo_model)
        assert run["status"] == "running" and run["plan"]["candidates"]
        done = wait_status(client, run["id"], ("done", "failed"))
        assert done["status"] == "done", done["error"]
        flags = done["result"]["flags"]
        assert value_of(flags, "--max-running-requests") == "8"
        assert value_of(flags, "--moe-miss-policy") == "cpu"
        assert any("not measured again" in e["message"] for e in done["events"])
        # every trial and its full figures can be looked at later
        kept = next(t for t in done["trials"] if t["verdict"] == "kept")
        full = client.get(f"/api/benchmarks/{run['id']}/trials/{kept['n']}").json()
        assert full["flags"] == kept["flags"] and "reason" in full and "details" in full
        # save as profile in one click, then Recommended is the result
        saved = client.post(f"/api/benchmarks/{run['id']}/save-profile", json={})
        assert saved.status_code == 201, saved.text
        profile = saved.json()
        assert profile["flags"] == flags and profile["origin"] == f"benchmark run {run['id']}"
        again = client.post(f"/api/benchmarks/{run['id']}/save-profile", json={})
        assert again.status_code == 409 and again.json()["error"]["code"] == "name_taken"
        recommended = client.get("/api/recommend", params={"model": str(demo_model)}).json()
        assert recommended["basis"] == "benchmark"
        assert recommended["benchmark_run"] == run["id"]
        # the result page shows it, with Save as profile
        page = client.get(f"/benchmark/{run['id']}").text
        assert " ".join(flags) in page and "save-profile" in page
        listed = client.get("/api/benchmarks").json()
        assert listed["runs"][0]["id"] == run["id"] and listed["running"] is None


def test_pick_up_tries_only_new_candidates_and_says_when_there_are_none(
    tmp_path: Path, demo_model: Path
) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        use_fake(client.app, FakeEngine(seed=22))
        first = wait_status(client, start(client, demo_model)["id"], ("done",))
        query = {"model": str(demo_model), "mode": "standard", "objective": "aggregate",
                 "clients": 16, "pick_up": "1"}  # fmt: skip
        plan = client.get("/api/benchmarks/plan", params=query).json()
        assert plan["candidates"] == [] and "nothing new" in plan["message"]
        assert plan["base_flags"] == first["result"]["flags"]
        refused = client.post("/api/benchmarks", json={**query, "clients": 16, "pick_up": True})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "nothing_new"
        page = client.get("/benchmark/plan", params=query).text
        assert 'id="nothing-new"' in page and 'id="durations"' not in page
        # the thorough mode adds values the standard run did not try: those, and only those, run
        engine = FakeEngine(seed=23)
        use_fake(client.app, engine)
        second = client.post("/api/benchmarks", json={**query, "clients": 16, "pick_up": True,
                                                      "mode": "thorough"})  # fmt: skip
        assert second.status_code == 202, second.text
        done = wait_status(client, second.json()["id"], ("done", "failed"))
        assert done["status"] == "done" and done["pick_up_from"] == first["id"]
        tried_before = set(first["result"]["tried"])
        new = [r.change.key for _n, r in engine.calls if r.role == "candidate"]
        assert new and not set(new) & tried_before
        assert any("figures of run" in e["message"] for e in done["events"])


def test_cancel_stops_the_trial_and_ends_the_run(tmp_path: Path, demo_model: Path) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        runners = use_fake(client.app, FakeEngine(seed=24), block_at=5)
        run = start(client, demo_model)
        deadline = time.monotonic() + 30
        while not (runners and runners[0].blocked.is_set()) and time.monotonic() < deadline:
            time.sleep(0.02)
        live = client.get(f"/api/benchmarks/{run['id']}").json()
        assert live["current"]["n"] == 5 and live["phase"] == "candidates"
        reply = client.post(f"/api/benchmarks/{run['id']}/cancel")
        assert reply.status_code == 200 and reply.json()["status"] == "cancelled"
        assert [t["n"] for t in reply.json()["trials"]] == [1, 2, 3, 4]
        again = client.post(f"/api/benchmarks/{run['id']}/cancel")
        assert again.status_code == 409


def test_a_run_resumes_after_the_daemon_restarts(tmp_path: Path, demo_model: Path) -> None:
    data_dir = tmp_path / "mgr"
    whole_engine = FakeEngine(seed=25)
    with running_app(tmp_path / "whole", demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        use_fake(client.app, whole_engine)
        whole = wait_status(client, start(client, demo_model)["id"], ("done",))
    with running_app(data_dir, demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        runners = use_fake(client.app, FakeEngine(seed=25), block_at=9)
        run = start(client, demo_model)
        deadline = time.monotonic() + 30
        while not (runners and runners[0].blocked.is_set()) and time.monotonic() < deadline:
            time.sleep(0.02)
    # the daemon stopped mid-trial: the run is interrupted, not lost
    with running_app(data_dir, demo_model.parent) as (daemon, client):
        stopped = client.get(f"/api/benchmarks/{run['id']}").json()
        assert stopped["status"] == "interrupted" and len(stopped["trials"]) == 8
        engine = FakeEngine(seed=25)
        use_fake(client.app, engine)
        assert client.post(f"/api/benchmarks/{run['id']}/resume").status_code == 202
        done = wait_status(client, run["id"], ("done", "failed"))
        assert done["status"] == "done"
        assert engine.calls[0][0] == 9, "only the trials after the stored ones ran"
        assert done["result"]["flags"] == whole["result"]["flags"]
        verdicts = [(t["n"], t["verdict"]) for t in done["trials"]]
        assert verdicts == [(t["n"], t["verdict"]) for t in whole["trials"]]
        # the workload sized by the stored calibration trial, before and after the restart
        first = done["trials"][0]
        assert (first["role"], first["verdict"]) == ("calibration", "calibration")
        assert first["reason"].startswith("calibration: ")
        spec = done["result"]["workload"]["spec"]
        assert spec == whole["result"]["workload"]["spec"]
        for trial in done["trials"][1:]:
            full = client.get(f"/api/benchmarks/{run['id']}/trials/{trial['n']}").json()
            assert full["details"]["workload"] == spec, trial["n"]


def leave_a_running_trial(data_dir: Path, models: Path, orphan: subprocess.Popen) -> int:
    """The rows a killed mgr leaves mid-trial: a run "running" and its trial engine's pid."""
    with running_app(data_dir, models) as (daemon, _client):
        now = time.time()
        with daemon.store.session() as session:
            row = BenchmarkRun(model=str(models), mode="quick", objective="decode",
                               status="running", base_flags=[], options={}, created=now,
                               updated=now)  # fmt: skip
            session.add(row)
            session.flush()
            run_id = row.id
        add_event(daemon.store, run_id, "engine", "trial 1: engine", {
            "n": 1, "pid": orphan.pid, "process_started": launch.process_start_time(orphan.pid),
            "port": 8200, "log": ""})  # fmt: skip
    return run_id


def wait_event(client: TestClient, run_id: int, text: str) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        events = client.get(f"/api/benchmarks/{run_id}").json()["events"]
        found = [e for e in events if text in e["message"]]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no event of run {run_id} says {text!r}: {events}")


def test_a_killed_daemon_leaves_no_trial_engine_behind(tmp_path: Path, demo_model: Path) -> None:
    data_dir = tmp_path / "mgr"
    # a trial engine that outlived a killed mgr (its own process group, as launch starts them)
    orphan = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        run_id = leave_a_running_trial(data_dir, demo_model.parent, orphan)
        with running_app(data_dir, demo_model.parent) as (_daemon, client):
            run = client.get(f"/api/benchmarks/{run_id}").json()
            assert run["status"] == "interrupted"
            assert "was stopped" in wait_event(client, run_id, f"pid {orphan.pid}")["message"]
        assert orphan.wait(timeout=10) is not None
    finally:
        if orphan.poll() is None:
            orphan.kill()


def test_the_daemon_serves_while_a_left_trial_engine_is_still_stopping(
    tmp_path: Path, demo_model: Path
) -> None:
    """Stopping an engine can take long (a loading one finishes its step first): the daemon
    answers meanwhile, and the resumed run starts no trial before that engine is gone."""
    data_dir = tmp_path / "mgr"
    # an engine that, told to stop, goes only when the test closes its stdin
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: (sys.stdin.read(), sys.exit(0)))\n"
         "print('ready', flush=True)\n"
         "time.sleep(120)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert orphan.stdout is not None and orphan.stdout.readline() == "ready\n"
        with running_app(data_dir, demo_model.parent) as (daemon, client):
            record_fresh_rates(daemon, demo_model)
            runners = use_fake(client.app, FakeEngine(seed=25), block_at=3)
            run_id = start(client, demo_model)["id"]
            deadline = time.monotonic() + 30
            while not (runners and runners[0].blocked.is_set()) and time.monotonic() < deadline:
                time.sleep(0.02)
        # what a killed mgr leaves instead of a clean stop: "running", and trial 3's engine
        update_run(daemon.store, run_id, status="running")
        add_event(daemon.store, run_id, "engine", "trial 3: engine", {
            "n": 3, "pid": orphan.pid, "process_started": launch.process_start_time(orphan.pid),
            "port": 8200, "log": ""})  # fmt: skip
        with running_app(data_dir, demo_model.parent) as (daemon, client):
            assert client.get(f"/api/benchmarks/{run_id}").json()["status"] == "interrupted"
            assert orphan.poll() is None, "the daemon waited for the engine before serving"
            alive_at_trials: list[bool] = []

            class Watched(FakeEngine):
                def __call__(self, request: TrialRequest, n: int) -> TrialResult:
                    alive_at_trials.append(orphan.poll() is None)
                    return super().__call__(request, n)

            use_fake(client.app, Watched(seed=25))
            assert client.post(f"/api/benchmarks/{run_id}/resume").status_code == 202
            assert orphan.stdin is not None
            orphan.stdin.close()
            assert orphan.wait(timeout=30) == 0
            wait_event(client, run_id, f"pid {orphan.pid}) was stopped")
            assert wait_status(client, run_id, ("done", "failed"))["status"] == "done"
            assert alive_at_trials and not any(alive_at_trials)
    finally:
        if orphan.poll() is None:
            orphan.kill()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"mode": "fast"}, "mode must be one of"),
        ({"objective": "speed"}, "objective must be one of"),
        ({"objective": "aggregate", "clients": 1}, "at least 2 concurrent clients"),
        ({"only_flags": ["--port"]}, "not tunable: --port"),
        ({"base_flags": ["--moe-cache-sise", "4"]}, "did you mean --moe-cache-size"),
        ({"colour": "red"}, "unknown field"),
        ({"min_gain": 0.9}, "min_gain must be a share"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(
    tmp_path: Path, demo_model: Path, body: dict, message: str
) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (_daemon, client):
        reply = client.post("/api/benchmarks", json={"model": str(demo_model), **body})
        assert reply.status_code == 400
        assert message in reply.json()["error"]["message"]
        assert client.get("/api/benchmarks").json()["runs"] == []


def test_a_gpu_in_use_by_a_server_is_refused(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Handle:
        server_id, device, stopping = 7, "cuda:0", False

    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        monkeypatch.setattr(daemon.supervisor, "handles", lambda: [Handle()])
        body = {"model": str(demo_model), "base_flags": ["--device", "cuda:0"]}
        reply = client.post("/api/benchmarks", json=body)
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "gpu_taken"


def test_viewers_without_control_never_see_the_engine_api_key(
    tmp_path: Path, demo_model: Path
) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        use_fake(client.app, FakeEngine(seed=26, crash=("--moe-miss-policy=cpu",)))
        run = start(client, demo_model, base_flags=[*POOR, "--api-key", "sekrit"],
                    only_flags=["--moe-miss-policy"])  # fmt: skip
        wait_status(client, run["id"], ("done",))
        lan = TestClient(client.app, base_url="http://127.0.0.1", client=("192.168.1.50", 50123))
        seen = lan.get(f"/api/benchmarks/{run['id']}").text
        crashed = next(t for t in lan.get(f"/api/benchmarks/{run['id']}").json()["trials"]
                       if t["verdict"] == "failed")  # fmt: skip
        seen += lan.get(f"/api/benchmarks/{run['id']}/trials/{crashed['n']}").text
        seen += lan.get(f"/benchmark/{run['id']}").text
        query = {"model": str(demo_model), "profile_id": "1"}
        with daemon.store.session() as session:
            session.add(Profile(name="keyed", model=str(demo_model), flags=["--api-key", "sekrit"],
                                created=0.0, updated=0.0))  # fmt: skip
        for path in ("/api/benchmarks/plan", "/benchmark/plan"):
            reply = lan.get(path, params=query)
            assert reply.status_code == 200, reply.text
            seen += reply.text
        assert "sekrit" not in seen and "(hidden)" in seen
        assert "sekrit" in client.get(f"/api/benchmarks/{run['id']}").text
