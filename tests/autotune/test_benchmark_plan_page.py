"""The plan a first-time user sees: the mode a run takes by default, how long each mode would take
on this PC, and the engines of this mgr that would share the machine with the trials."""

from __future__ import annotations

import html
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from moelab.autotune.eta import planned_trials
from moelab.autotune.modes import MODES
from moelab.autotune.plan import MachineFacts, Plan
from moelab.daemon import benchmark_setup
from moelab.daemon.schema import Model, Profile, Server

from .conftest import record_fresh_rates, running_app
from .fake import FakeEngine
from .test_benchmark_api import POOR, use_fake, wait_status

LAN = ("192.168.1.50", 50123)


def plan(client: TestClient, model: Path, **query: str) -> dict:
    reply = client.get("/api/benchmarks/plan", params={"model": str(model), **query})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_default_mode_is_quick_on_the_demo_model_and_without_a_gpu() -> None:
    default_mode = benchmark_setup.default_mode
    assert default_mode(is_demo=True, on_cpu=False) == "quick"
    assert default_mode(is_demo=False, on_cpu=True) == "quick"
    assert default_mode(is_demo=False, on_cpu=False) == "standard"


def test_a_run_without_a_mode_takes_the_default_one(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        # this machine has no GPU: quick, in the plan and in the run it starts
        assert plan(client, demo_model)["mode"] == "quick"
        assert plan(client, demo_model, mode="thorough")["mode"] == "thorough"
        use_fake(client.app, FakeEngine(seed=41))
        body = {"model": str(demo_model), "base_flags": POOR, "only_flags": ["--moe-miss-policy"]}
        reply = client.post("/api/benchmarks", json=body)
        assert reply.status_code == 202, reply.text
        assert reply.json()["mode"] == "quick"
        wait_status(client, reply.json()["id"], ("done",))
        # a PC with a GPU, flags that use it: standard for a real model, quick for the demo one
        monkeypatch.setattr(
            benchmark_setup, "machine_facts", lambda _d: MachineFacts(physical_cores=4, gpus=1)
        )
        with daemon.store.session() as session:
            session.add(Profile(name="gpu", model=str(demo_model), flags=[], created=0.0,
                                updated=0.0))  # fmt: skip
        on_gpu = {"profile_id": "1"}
        assert plan(client, demo_model, **on_gpu)["mode"] == "standard"
        assert plan(client, demo_model, profile_id="1")["base_flags"] == []
        with daemon.store.session() as session:
            row = session.query(Model).filter_by(path=str(demo_model)).one()
            row.is_demo = True
        assert plan(client, demo_model, **on_gpu)["mode"] == "quick"
        # the start form suggests rather than picks standard
        form = client.get("/benchmark").text
        assert '<option value="" selected>Suggested: quick on the demo model' in form
        assert '<option value="standard" selected' not in form
        page = client.get("/benchmark/plan", params={"model": str(demo_model), "mode": ""}).text
        assert '<input type="hidden" name="mode" value="quick">' in page


def expected(plan_json: dict, mode: str, restart_s: float, model_max: int | None) -> float:
    """The seconds the plan should say for `mode` with a restart of `restart_s`."""
    each = MODES[mode]
    candidates = Plan.from_json({"candidates": plan_json["candidates"]})
    trials = planned_trials(candidates, plan_json["base_flags"], each, model_max)
    assert plan_json["durations"]["modes"][mode]["trials"] == trials
    return trials * (restart_s + each.target_s) + each.target_s


def test_the_plan_shows_each_mode_s_duration_from_measured_trials(
    tmp_path: Path, demo_model: Path
) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        model_max = daemon.catalog.by_path(str(demo_model)).max_context
        query = {"mode": "quick", "objective": "decode"}
        first = plan(client, demo_model, **query)
        durations = first["durations"]
        assert durations["restart"]["source"] == "guess"
        seconds = {m: d["expected_s"] for m, d in durations["modes"].items()}
        assert seconds["quick"] < seconds["standard"] < seconds["thorough"]
        guess = durations["restart"]["seconds"]
        assert seconds["quick"] == pytest.approx(expected(first, "quick", guess, model_max))
        # a run measures the restart (the fake's trials restart in 2 s besides their workload)
        use_fake(client.app, FakeEngine(seed=42))
        body = {"model": str(demo_model), **query, "base_flags": POOR}
        run = client.post("/api/benchmarks", json=body)
        assert run.status_code == 202, run.text
        wait_status(client, run.json()["id"], ("done",))
        after = plan(client, demo_model, **query)
        restart = after["durations"]["restart"]
        assert restart["source"] == "trials" and restart["readings"] >= 5
        assert restart["seconds"] == pytest.approx(2.0)
        quick = after["durations"]["modes"]["quick"]["expected_s"]
        assert quick == pytest.approx(expected(after, "quick", 2.0, model_max))
        # the page: a row per mode, the others a link to their own plan
        page = html.unescape(client.get("/benchmark/plan", params={"model": str(demo_model),
                                                                   **query}).text)  # fmt: skip
        assert 'id="durations"' in page and "How long each mode takes" in page
        for mode in MODES:
            assert f'id="mode-{mode}"' in page
        assert "mode=standard" in page and "mode=thorough" in page
        assert "the median of" in page and "trials of this model on this PC" in page
        ja = client.get("/benchmark/plan", params={"model": str(demo_model), **query},
                        headers={"accept-language": "ja"}).text  # fmt: skip
        assert "各モードの所要時間" in ja


def test_a_server_start_stands_for_the_restart_before_any_trial(
    tmp_path: Path, demo_model: Path
) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        with daemon.store.session() as session:
            session.add(
                Server(name="demo", model=str(demo_model), flags=[], host="127.0.0.1", port=8100,
                       device="cpu", status="stopped", log_path="x.log", created=0.0,
                       started=100.0, ready=103.5, stopped=200.0)
            )  # fmt: skip
        restart = plan(client, demo_model)["durations"]["restart"]
        assert restart == {"seconds": 3.5, "source": "servers", "readings": 1}


def test_the_plan_warns_of_running_engines_and_stops_them(tmp_path: Path, demo_model: Path) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        started = client.post("/api/servers", json={"model": str(demo_model), "name": "chat",
                                                    "flags": ["--device", "cpu"]})  # fmt: skip
        assert started.status_code in (201, 202), started.text
        server_id = started.json()["id"]
        engines = plan(client, demo_model)["engines"]
        assert [(e["id"], e["name"], e["device"]) for e in engines] == [(server_id, "chat", "cpu")]
        assert engines[0]["pid"] and engines[0]["takes_the_gpu"] is False
        query = {"model": str(demo_model)}
        page = client.get("/benchmark/plan", params=query).text
        assert 'id="running-engines"' in page and "skew the figures" in page
        assert 'data-api-post="/api/benchmarks/stop-engines"' in page
        # a viewer without the token sees the warning but no button, and cannot stop them
        lan = TestClient(client.app, base_url="http://127.0.0.1", client=LAN)
        shown = lan.get("/benchmark/plan", params=query).text
        assert 'id="running-engines"' in shown and "stop-engines" not in shown
        refused = lan.post("/api/benchmarks/stop-engines")
        assert refused.status_code in (401, 403), refused.text
        assert daemon.supervisor.handle(server_id) is not None
        # with control, one request stops them all
        stopped = client.post("/api/benchmarks/stop-engines")
        assert stopped.status_code == 200 and stopped.json() == {"stopped": [server_id]}
        assert daemon.supervisor.handles() == []
        deadline = time.monotonic() + 30
        while client.get(f"/api/servers/{server_id}").json()["status"] != "stopped":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert plan(client, demo_model)["engines"] == []
        assert 'id="running-engines"' not in client.get("/benchmark/plan", params=query).text
