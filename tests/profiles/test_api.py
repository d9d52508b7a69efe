"""The profile routes and /api/recommend through the ASGI app, over a real SQLite store."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from moelab.daemon.hardware import GpuInfo
from moelab.daemon.measure import Reading, inventory_readings
from moelab.daemon.recommend import loaded_decode_tok_s
from moelab.daemon.schema import BenchmarkRun, Server
from moelab.daemon.service import Daemon
from moelab.profiles.machine import GIB
from tests.daemon.conftest import asgi_client, make_daemon

_names = (f"p{i}" for i in itertools.count())


def create(local: TestClient, model: Path, flags: list[str], **extra: str) -> dict:
    response = local.post(
        "/api/profiles", json={"name": next(_names), "model": str(model), "flags": flags, **extra}
    )
    assert response.status_code == 201, response.text
    return response.json()


def error_of(response) -> tuple[int, str, str]:
    body = response.json()["error"]
    return response.status_code, body["code"], body["message"]


def test_flags_are_stored_canonical_and_checked(local: TestClient, demo_model: Path) -> None:
    profile = create(local, demo_model, ["--kv-reserve-tokens=2048", "--no-cuda-graph"])
    assert profile["flags"] == ["--kv-reserve-tokens", "2048", "--no-cuda-graph"]
    assert profile["origin"] == "by hand"
    for flags, words in (
        (["--port", "1", "--port", "2"], "--port is given twice (1 and 2); keep one"),
        (["--moe-cahce-rate", "0.5"], "did you mean --moe-cache-rate?"),
        (["--dtype", "bf16"], "choose one of auto, bfloat16, float16, float32"),
        (["--no-stats", "yes"], "--no-stats is an on/off flag and takes no value"),
    ):
        response = local.post(
            "/api/profiles", json={"name": "bad", "model": str(demo_model), "flags": flags}
        )
        status, code, message = error_of(response)
        assert (status, code) == (400, "invalid_flags") and words in message
    patched = local.patch(f"/api/profiles/{profile['id']}", json={"flags": ["--port", "x"]})
    assert error_of(patched)[:2] == (400, "invalid_flags")


def test_duplicate_names_the_copy(local: TestClient, demo_model: Path) -> None:
    source = create(local, demo_model, ["--max-running-requests", "2"], notes="keep")
    first = local.post(f"/api/profiles/{source['id']}/duplicate").json()
    second = local.post(f"/api/profiles/{source['id']}/duplicate").json()
    assert first["name"] == f"{source['name']} (copy)"
    assert second["name"] == f"{source['name']} (copy 2)"
    assert first["flags"] == source["flags"] and first["notes"] == "keep"
    named = local.post(f"/api/profiles/{source['id']}/duplicate", json={"name": first["name"]})
    assert error_of(named)[:2] == (409, "name_taken")


def test_apply_changes_and_recommended(local: TestClient, demo_model: Path) -> None:
    profile = create(local, demo_model, ["--moe-cache-size", "8", "--port", "9100"])
    changes = [
        {"flag": "--moe-cache-rate", "value": "0.5"},
        {"flag": "--no-cuda-graph", "value": True},
        {"flag": "--port", "value": None},
    ]
    applied = local.post(f"/api/profiles/{profile['id']}/apply", json={"changes": changes})
    assert applied.json()["flags"] == ["--moe-cache-rate", "0.5", "--no-cuda-graph"]
    bad = local.post(
        f"/api/profiles/{profile['id']}/apply",
        json={"changes": [{"flag": "--kv-reserve-tokens", "value": "0"}]},
    )
    assert error_of(bad)[:2] == (400, "invalid_flags")
    # Recommended's flags are changes as they are; applying them records the origin
    rec = local.get(f"/api/recommend?profile={profile['id']}").json()
    applied = local.post(
        f"/api/profiles/{profile['id']}/apply",
        json={"changes": rec["flags"], "origin": "Recommended"},
    ).json()
    assert applied["origin"] == "Recommended"
    # flags Recommended says nothing about stay; --moe-cache-size 0 displaced its partner
    assert "--no-cuda-graph" in applied["flags"] and "--moe-cache-rate" not in applied["flags"]
    after = local.get(f"/api/recommend?profile={profile['id']}").json()
    assert {row["state"] for row in after["profile"]["comparison"]} == {"same"}


def test_command_line_out_and_back(local: TestClient, demo_model: Path) -> None:
    flags = ["--served-model-name", "my demo", "--kv-reserve-tokens", "2048", "--no-stats"]
    profile = create(local, demo_model, flags)
    command = local.get(f"/api/profiles/{profile['id']}/command").json()
    assert command["command"] == (
        f"moelab serve --model-path {profile['model']} --served-model-name 'my demo' "
        "--kv-reserve-tokens 2048 --no-stats"
    )
    parsed = local.post(
        "/api/profiles/parse-command", json={"command": command["command_multiline"]}
    ).json()
    assert parsed == {"model": profile["model"], "flags": flags, "notes": []}
    refused = local.post("/api/profiles/parse-command", json={"command": "rm -rf /"})
    assert error_of(refused)[:2] == (400, "invalid_flags")


def test_toml_export_import(local: TestClient, demo_model: Path) -> None:
    profile = create(
        local, demo_model, ["--moe-cache-rate", "0.5", "--no-cuda-graph"], notes="a\nb"
    )
    exported = local.get(f"/api/profiles/{profile['id']}/toml")
    assert exported.headers["content-type"].startswith("application/toml")
    assert f'filename="{profile["name"]}.toml"' in exported.headers["content-disposition"]
    text = exported.text
    assert "moe-cache-rate = 0.5" in text and "no-cuda-graph = true" in text
    # raw file in the body: the name taken is the file's, already used
    taken = local.post(
        "/api/profiles/import", content=text, headers={"content-type": "application/toml"}
    )
    assert error_of(taken)[:2] == (409, "name_taken")
    imported = local.post("/api/profiles/import", json={"toml": text, "name": "imported copy"})
    assert imported.status_code == 201, imported.text
    body = imported.json()
    assert (body["model"], body["flags"], body["notes"], body["origin"]) == (
        profile["model"], profile["flags"], "a\nb", "by hand",
    )  # fmt: skip
    for toml, code in (
        ('name = "x"\nmodel = "/nowhere"\n', "model_not_found"),
        ('name = "y"\nmodel = "m"\n[flags]\nport = 1\nport = 2\n', "invalid_profile_file"),
        ('model = "m"\n', "bad_request"),
    ):
        assert error_of(local.post("/api/profiles/import", json={"toml": toml}))[1] == code


def test_viewers_see_secrets_hidden_and_change_nothing(
    local: TestClient, viewer: TestClient, demo_model: Path
) -> None:
    profile = create(local, demo_model, ["--api-key", "sesame-42"])
    assert "sesame-42" not in viewer.get(f"/api/profiles/{profile['id']}/toml").text
    assert "sesame-42" not in viewer.get(f"/api/profiles/{profile['id']}/command").text
    assert "sesame-42" in local.get(f"/api/profiles/{profile['id']}/toml").text
    for path in ("apply", "duplicate"):
        response = viewer.post(f"/api/profiles/{profile['id']}/{path}", json={"changes": []})
        assert response.status_code == 401


def test_recommend_on_this_machine(local: TestClient, demo_model: Path, daemon: Daemon) -> None:
    model = local.get("/api/models").json()["models"][0]
    body = local.get(f"/api/recommend?model={model['path']}").json()
    assert body["model"] == model["path"] and body["basis"] == "rules"
    by_flag = {f["flag"]: f for f in body["flags"]}
    # this test machine has no GPU
    assert by_flag["--device"]["value"] == "cpu"
    assert body["vram_split"]["slots"] == 0
    assert set(body["vram_split"]) >= {"weights", "kv", "expert_cache", "budget"}
    planner = body["planner"]
    assert planner["device"] == "cpu" and planner["basis"]["hit_rate"].startswith("assumed")
    assert planner["run"] is None
    assert planner["kv_bytes_per_token"] == 2 * 4 * 2 * 16 * 4  # float32 on a CPU
    # by id, and errors a user can cause
    assert local.get(f"/api/recommend?model={model['id']}").json()["model"] == model["path"]
    assert error_of(local.get("/api/recommend"))[:2] == (400, "bad_request")
    assert error_of(local.get("/api/recommend?model=/nowhere"))[:2] == (404, "model_not_found")
    assert error_of(local.get("/api/recommend?profile=99999"))[:2] == (404, "not_found")
    assert (
        "context must be a number"
        in error_of(local.get(f"/api/recommend?model={model['id']}&context=lots"))[2]
    )
    asked = local.get(f"/api/recommend?model={model['id']}&context=1024").json()
    kv = next(f for f in asked["flags"] if f["flag"] == "--kv-reserve-tokens")
    assert kv["value"] == "1024" and kv["reason"].startswith("the 1024-token context asked for")


@pytest.fixture
def gpu_daemon(tmp_path: Path, demo_model: Path) -> Iterator[Daemon]:
    """A daemon whose stored measurements say this machine has a 24 GB GPU and measured rates."""
    daemon = make_daemon(tmp_path / "data", demo_model.parent)
    daemon.start()
    inventory = daemon.hardware.record_inventory()
    gpu = GpuInfo(0, "Test 24GB", "GPU-test", None, 24 * GIB, 23 * GIB, 4, 16, 4, 16)
    daemon.hardware.record(
        [
            Reading("gpu.vram_total", 24 * GIB, "bytes", {"gpu_index": 0}, gpu),
            Reading("gpu.vram_free", 23 * GIB, "bytes", {"gpu_index": 0}, gpu),
        ],
        "probe",
        inventory,
    )
    time.sleep(0.01)  # the bench rows are newer than the probe's
    rates = [
        Reading("h2d_pinned", 25.0, "GB/s", {"expert_bytes": 12288}, gpu),
        Reading("device_copy", 800.0, "GB/s", {}, gpu),
        *(
            Reading(
                "cpu_experts", rate, "GB/s", {"threads": t, "experts": 4, "kernel": "native"}, gpu
            )
            for t, rate in ((1, 5.0), (2, 9.0))
        ),
        Reading("host_read", 20.0, "GB/s", {"threads": 2}, gpu),
    ]
    daemon.hardware.record(rates, "moelab bench bw", inventory, {"moelab": "0.0.1"})
    yield daemon
    daemon.close()


def test_recommend_reads_measurements_and_benchmarks(gpu_daemon: Daemon, demo_model: Path) -> None:
    local = asgi_client(gpu_daemon, "127.0.0.1", "127.0.0.1:1901")
    path = local.get("/api/models").json()["models"][0]["path"]
    body = local.get(f"/api/recommend?model={path}").json()
    by_flag = {f["flag"]: f for f in body["flags"]}
    assert body["hardware"]["gpus"][0]["vram_free_bytes"] == 23 * GIB
    assert "--device" not in by_flag  # one GPU
    assert by_flag["--moe-cpu-threads"]["source"] == "measured"
    assert body["vram_split"]["budget"] == 23.0
    assert body["vram_split"]["slots"] == 48  # the tiny demo fits whole
    assert body["stale"] is True and "measured with moelab 0.0.1" in body["stale_reasons"][0]
    # the no-run speed is the bandwidth bound, and says so
    assert body["planner"]["basis"]["speed"].startswith("bandwidth bound")
    assert all(p["decode_tok_s"] for p in body["planner"]["points"] if p["fits"])
    # a finished benchmark of this model becomes Recommended
    now = time.time()
    with gpu_daemon.store.session() as session:
        session.add(
            BenchmarkRun(
                model=path, mode="quick", objective="decode", status="done", created=now,
                updated=now, finished=now, engine_version="0.0.1", machine_id="elsewhere",
                result={"flags": ["--max-running-requests", "2"],
                        "notes": [{"flag": "--max-running-requests", "note": "2 beat 4 by 9%"}]},
            )
        )  # fmt: skip
    body = local.get(f"/api/recommend?model={path}").json()
    by_flag = {f["flag"]: f for f in body["flags"]}
    assert body["basis"] == "benchmark" and body["benchmark_run"] == 1
    assert by_flag["--max-running-requests"] == {
        "flag": "--max-running-requests",
        "value": "2",
        "reason": "2 beat 4 by 9%",
        "source": "measured",
        "numbers": {},
    }
    assert by_flag["--kv-reserve-tokens"]["source"] == "rule"
    assert "benchmark run 1 ran on another machine" in body["stale_reasons"]


def test_the_planner_uses_a_real_run(gpu_daemon: Daemon) -> None:
    local = asgi_client(gpu_daemon, "127.0.0.1", "127.0.0.1:1901")
    path = local.get("/api/models").json()["models"][0]["path"]
    # a stats body as an engine on the demo model reports it (3 MoE layers of 16 experts)
    stats = {
        "tokens": {"decode_total": 1000},
        "throughput": {"decode_tok_s_60s": 50.0},
        "config": {"bp_gbps": 2.0, "bh_gbps": 2.0, "fetch_fraction": 0.5},
        "experts": {
            "num_layers": 3, "num_experts": 16, "slots": 24, "slot_bytes": 12288,
            "layers": [{"reads": 1000, "hits": 700, "fills": 150, "cpu": 150}] * 3,
            "whatif": [{"slots": 12, "hit_rate": 0.3}, {"slots": 24, "hit_rate": 0.6},
                       {"slots": 48, "hit_rate": 1.0}],
            "picks": [[100] * 16] * 3,
        },
    }  # fmt: skip
    now = time.time()
    with gpu_daemon.store.session() as session:
        server = Server(
            name="demo", model=path, flags=[], host="127.0.0.1", port=8100, device="cuda:0",
            status="stopped", log_path="", created=now, last_stats=stats, last_stats_time=now,
        )  # fmt: skip
        session.add(server)
        session.flush()
        server_id = server.id
    planner = local.get(f"/api/recommend?model={path}").json()["planner"]
    assert planner["run"] == {
        "server_id": server_id, "slots": 24, "hit_rate": 0.7, "decode_tok_s": 50.0,
        "reads_per_token": 3.0,
    }  # fmt: skip
    assert planner["basis"]["hit_rate"].startswith(f"the what-if curve of server {server_id}")
    # decode speed from the last stats (no samples): 50 tok/s with 0.9 misses per token
    assert planner["basis"]["speed"].startswith(f"server {server_id} decoded 50.0 tok/s")


def test_loaded_speed_ignores_windows_that_were_partly_idle() -> None:
    def sample(t: float, running: int, rate: float) -> dict:
        return {"t": t, "g": {"running": running, "decode_tok_s_10s": rate}}

    idle = [sample(0, 0, 0.0)]
    ramp = [sample(t, 4, 40.0 + t) for t in (2, 4, 6, 8)]  # windows still holding idle time
    loaded = [sample(t, 4, rate) for t, rate in ((10, 100.0), (12, 102.0), (14, 98.0))]
    assert loaded_decode_tok_s(idle + ramp + loaded) == 100.0
    assert loaded_decode_tok_s(idle + ramp) == 48.0  # no full window: the best seen
    assert loaded_decode_tok_s(idle) is None


def test_create_from_a_pasted_command_or_from_recommended(
    local: TestClient, demo_model: Path
) -> None:
    pasted = local.post(
        "/api/profiles",
        json={"name": "pasted", "command": f"moelab serve --model-path {demo_model} "
              "--port 8101 --no-stats --port 8102"},
    )  # fmt: skip
    assert pasted.status_code == 201, pasted.text
    body = pasted.json()
    assert body["model"] == str(demo_model.resolve())
    assert body["flags"] == ["--port", "8102", "--no-stats"]
    assert body["paste_notes"] == ["--port was given 2 times (8101, 8102); kept the last, 8102"]
    no_model = local.post("/api/profiles", json={"name": "x", "command": "moelab serve --no-stats"})
    assert "names no --model-path" in error_of(no_model)[2]
    advised = local.post(
        "/api/profiles", json={"name": "advised", "model": str(demo_model), "recommended": True}
    ).json()
    rec = local.get(f"/api/recommend?profile={advised['id']}").json()
    assert advised["origin"] == "Recommended" and advised["flags"] == rec["command_flags"]


def test_apply_one_flag_or_all_of_recommended(local: TestClient, demo_model: Path) -> None:
    profile = create(local, demo_model, ["--kv-reserve-tokens", "1024"])
    one = local.post(
        f"/api/profiles/{profile['id']}/apply", json={"flag": "--no-stats", "value": "true"}
    )
    assert one.json()["flags"] == ["--kv-reserve-tokens", "1024", "--no-stats"]
    dropped = local.post(
        f"/api/profiles/{profile['id']}/apply", json={"flag": "--kv-reserve-tokens"}
    )
    assert dropped.json()["flags"] == ["--no-stats"]
    advised = local.post(f"/api/profiles/{profile['id']}/apply", json={"recommended": "1"}).json()
    assert advised["origin"] == "Recommended"
    after = local.get(f"/api/recommend?profile={profile['id']}").json()
    assert {row["state"] for row in after["profile"]["comparison"]} == {"same"}
    assert "--no-stats" in advised["flags"]  # Recommended says nothing about it: kept
    empty = local.post(f"/api/profiles/{profile['id']}/apply", json={})
    assert error_of(empty)[:2] == (400, "bad_request")


def test_recommend_hides_secret_flags_from_viewers(
    local: TestClient, viewer: TestClient, demo_model: Path
) -> None:
    profile = create(local, demo_model, ["--api-key", "sesame-43"])
    assert "sesame-43" not in viewer.get(f"/api/recommend?profile={profile['id']}").text
    planner = local.get(f"/api/recommend?profile={profile['id']}").json()["planner"]
    assert planner["base_flags"] == ["--api-key", "sesame-43"]


def test_a_profile_carries_the_devices_the_split_and_each_cards_memory(
    local: TestClient, demo_model: Path
) -> None:
    flags = ["--devices", "cuda:0,cuda:1", "--layer-split", "0.6,0.4", "--device-memory",
             "12GiB,8GiB"]  # fmt: skip
    profile = create(local, demo_model, flags)
    assert profile["flags"] == flags
    text = local.get(f"/api/profiles/{profile['id']}/toml").text
    imported = local.post("/api/profiles/import", json={"toml": text, "name": "split copy"})
    assert imported.status_code == 201, imported.text
    assert imported.json()["flags"] == flags
    command = local.get(f"/api/profiles/{profile['id']}/command").json()
    assert "--device-memory 12GiB,8GiB" in command["command"]
    refused = local.post(
        "/api/profiles",
        json={"name": "three sizes", "model": str(demo_model),
              "flags": ["--devices", "cuda:0,cuda:1", "--device-memory", "12GiB,8GiB,4GiB"]},
    )  # fmt: skip
    status, code, message = error_of(refused)
    assert (status, code) == (400, "invalid_flags")
    assert "--device-memory 12GiB,8GiB,4GiB gives 3 sizes for 2 device(s)" in message


def test_recommended_lists_each_card_of_a_split_profile(tmp_path: Path, demo_model: Path) -> None:
    """Stored measurements of an RTX 4090 (PCIe 4.0 x16) and an RTX 3060 (PCIe 3.0 x8), the copy
    measured on the 4090: a profile split across both lists each card's layers and link in
    Recommended's planner and on its page, and names the card that limits the step."""
    daemon = make_daemon(tmp_path / "data", demo_model.parent)
    daemon.start()
    try:
        inventory = daemon.hardware.record_inventory()
        cards = (
            GpuInfo(0, "RTX 4090", "GPU-a", None, 24 * GIB, 23 * GIB, 4, 16, 4, 16, 1008.0),
            GpuInfo(1, "RTX 3060", "GPU-b", None, 12 * GIB, 11 * GIB, 3, 8, 3, 8, 360.0),
        )
        two = replace(inventory, gpus=cards)
        daemon.hardware.record(inventory_readings(two), "probe", two)
        time.sleep(0.01)  # the bench rows are newer than the probe's
        daemon.hardware.record(
            [Reading("h2d_pinned", 25.0, "GB/s", {"gpu_index": 0})], "moelab bench bw", two
        )
        local = asgi_client(daemon, "127.0.0.1", "127.0.0.1:1901")
        profile = create(local, demo_model, ["--devices", "cuda:0,cuda:1"])
        path = local.get("/api/models").json()["models"][0]["path"]
        body = local.get(f"/api/recommend?model={path}&profile={profile['id']}").json()
        listed = body["planner"]["cards"]
        assert [(c["device"], c["link_gbps"]) for c in listed] == [
            ("cuda:0", 25.0),
            ("cuda:1", 6.25),
        ]
        assert sum(c["limits"] for c in listed) == 1
        page = local.get(f"/profiles/{profile['id']}").text
        line = page[page.index('id="planner-cards"') :].split("</p>")[0]
        assert "<code>cuda:1</code> layers" in line and "link 6.2 GB/s" in line
        assert "limits the step" in line
        ja = local.get(f"/profiles/{profile['id']}", headers={"Accept-Language": "ja"}).text
        assert "リンク 6.2 GB/s" in ja and "がステップを律速しています" in ja
    finally:
        daemon.close()
