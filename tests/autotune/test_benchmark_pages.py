"""The benchmark's console pages: both languages, read-only and with control, JSON alternates,
and the live part while a run goes on."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from .conftest import record_fresh_rates, running_app
from .fake import FakeEngine
from .test_benchmark_api import POOR, start, use_fake, wait_status

CONTROLS = re.compile(r"data-api(-post)?=")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory, demo_model: Path):
    with running_app(tmp_path_factory.mktemp("mgr"), demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        use_fake(client.app, FakeEngine(seed=31))
        first = wait_status(client, start(client, demo_model)["id"], ("done",))
        use_fake(client.app, FakeEngine(seed=32))
        second = wait_status(client, start(client, demo_model, mode="quick")["id"], ("done",))
        client.post(f"/api/benchmarks/{first['id']}/save-profile", json={"name": "tuned"})
        lan = TestClient(client.app, base_url="http://127.0.0.1", client=("192.168.1.50", 50123))
        yield client, lan, first, second, demo_model


def pages(first: dict, second: dict, model: Path) -> list[str]:
    plan = f"/benchmark/plan?model={model}&mode=quick&objective=aggregate&clients=16"
    return [
        "/benchmark",
        f"/benchmark/{first['id']}",
        plan,
        plan + "&pick_up=1",
        f"/benchmark/compare?a={first['id']}&b={second['id']}",
    ]


@pytest.mark.parametrize("lang", ["en", "ja"])
@pytest.mark.parametrize("who", ["control", "read-only"])
def test_every_benchmark_page_renders(two_runs, lang: str, who: str) -> None:
    control, lan, first, second, model = two_runs
    client = control if who == "control" else lan
    for path in pages(first, second, model):
        reply = client.get(path, headers={"accept-language": lang})
        assert reply.status_code == 200, (path, reply.text[-500:])
        assert "ベンチマーク" in reply.text if lang == "ja" else "Benchmark" in reply.text
        offered = CONTROLS.findall(reply.text)
        if who == "read-only":
            assert not offered, f"{path} offers controls to a read-only viewer"
        data = client.get(path + ("&" if "?" in path else "?") + "format=json").json()
        assert data["access"]["mode"] == who


def test_the_result_page_shows_the_result_and_its_evidence(two_runs) -> None:
    control, lan, first, _second, _model = two_runs
    page = control.get(f"/benchmark/{first['id']}").text
    assert " ".join(first["result"]["flags"]) in page
    for change in first["result"]["changes"]:
        assert change["label"] in page
    assert 'id="save-profile"' in page and "tuned" in page
    assert page.count('id="trial-') == len(first["trials"])
    # each trial's measured workload, beside its start-up
    assert "Workload" in page
    measured = [t for t in first["trials"] if t["verdict"] != "failed"]
    assert measured and all(t["workload_s"] > 0 for t in measured)
    assert 'data-chart="aggregate"' in page and 'data-chart="decode"' in page
    # the restart cost, over all trials and per trial after the calibration one
    overhead = first["result"]["overhead"]
    assert f"took {100 * overhead['share']:.1f}% of the trial time" in page
    per_trial = f"{overhead['per_trial_s']:,.1f} s per trial"
    assert f"{per_trial}, {100 * overhead['share_per_trial']:.1f}% of its time" in page
    shown = lan.get(f"/benchmark/{first['id']}").text
    assert 'id="save-profile"' not in shown and " ".join(first["result"]["flags"]) in shown


def test_the_history_and_the_comparison(two_runs) -> None:
    control, _lan, first, second, _model = two_runs
    history = control.get("/benchmark").text
    assert f'id="run-{first["id"]}"' in history and f'id="run-{second["id"]}"' in history
    compared = control.get(f"/benchmark/compare?a={first['id']}&b={second['id']}")
    data = control.get(f"/benchmark/compare?a={first['id']}&b={second['id']}&format=json").json()
    assert {row["flag"] for row in data["flags"]} >= {"--max-running-requests"}
    assert 'data-chart="figures"' in compared.text
    bad = control.get("/benchmark/compare?a=1")
    assert bad.status_code == 400 and "choose two runs" in bad.text


def test_a_running_run_shows_its_trial_and_keeps_polling(tmp_path: Path, demo_model: Path) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        runners = use_fake(client.app, FakeEngine(seed=33), block_at=5)
        run = start(client, demo_model, base_flags=POOR)
        deadline = time.monotonic() + 30
        while not (runners and runners[0].blocked.is_set()) and time.monotonic() < deadline:
            time.sleep(0.02)
        live = client.get(f"/benchmark/{run['id']}?part=benchmark_live").text
        assert 'hx-trigger="every 3s' in live and 'id="current-trial"' in live
        assert "Trial 5 (candidate)" in live and "/cancel" in live
        client.post(f"/api/benchmarks/{run['id']}/cancel")
        ended = client.get(f"/benchmark/{run['id']}?part=benchmark_live").text
        assert "hx-trigger" not in ended.split(">", 1)[0] and "/resume" in ended
