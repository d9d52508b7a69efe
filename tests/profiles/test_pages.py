"""The profile pages through the ASGI app: both languages, read-only and control, JSON alternates,
the editor's inline checks and its save, Recommended beside the profile, the planner's chart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from moelab.daemon.service import Daemon

CONTROL_MARKS = ("data-api", "data-api-post", "hx-put")


@pytest.fixture(scope="module")
def profile_id(local: TestClient, demo_model: Path) -> int:
    body = {"name": "page demo", "model": str(demo_model),
            "flags": ["--kv-reserve-tokens", "2048", "--api-key", "sesame-7"]}  # fmt: skip
    response = local.post("/api/profiles", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.mark.parametrize("lang", ["en", "ja"])
@pytest.mark.parametrize("who", ["local", "viewer"])
@pytest.mark.parametrize("path", ["/profiles", "/profiles/{id}"])
def test_pages_render_in_each_language_and_mode(
    request: pytest.FixtureRequest, profile_id: int, lang: str, who: str, path: str
) -> None:
    client: TestClient = request.getfixturevalue(who)
    reply = client.get(path.format(id=profile_id), headers={"Accept-Language": lang})
    assert reply.status_code == 200, reply.text[:2000]
    html = reply.text
    assert f'<html lang="{lang}">' in html
    assert ("プロファイル" in html) == (lang == "ja")
    controls = [m for m in CONTROL_MARKS if f"{m}=" in html]
    if who == "viewer":
        assert controls == [], controls
        assert "sesame-7" not in html
    else:
        assert "data-api" in controls
    if path == "/profiles/{id}":
        assert 'id="recommended"' in html and 'data-chart="planner"' in html
        assert ('id="profile-editor"' in html) == (who == "local")


def test_json_alternates(local: TestClient, viewer: TestClient, profile_id: int) -> None:
    listing = local.get("/profiles?format=json").json()
    assert any(p["id"] == profile_id for p in listing["profiles"])
    page = viewer.get(f"/profiles/{profile_id}?format=json").json()
    assert page["access"]["mode"] == "read-only"
    assert page["profile"]["flags"] == ["--kv-reserve-tokens", "2048", "--api-key", "(hidden)"]
    assert "sesame-7" not in json.dumps(page)
    rows = {r["flag"]: r for r in page["recommended"]["rows"]}
    assert rows["--kv-reserve-tokens"]["state"] == "different"  # the demo's whole 4096 fits
    assert rows["--kv-reserve-tokens"]["profile_value"] == "2048"
    groups = {g["name"]: g for g in page["editor"]["groups"]}
    assert [f["flag"] for f in groups["experts"]["flags"]][:2] == [
        "--moe-cache-size",
        "--moe-cache-rate",
    ]
    points = page["recommended"]["planner"]["points"]
    assert any(p["kv_reserve_tokens"] == 2048 for p in points)


def test_the_editor_explains_bad_values_inline(local: TestClient, profile_id: int) -> None:
    draft = {"editor": "draft", "name": "page demo", "--port": "abc", "--dtype": "bf16",
             "--moe-cache-size": "3", "--moe-cache-rate": "0.5", "--no-stats": "on"}  # fmt: skip
    reply = local.get(f"/profiles/{profile_id}", params={**draft, "part": "profile_editor"})
    assert reply.status_code == 200
    html = reply.text
    assert html.startswith("{# ") is False and 'id="profile-editor"' in html
    # each problem's text, without the marks around its data (flags and values: translate="no")
    problems = [
        re.sub(r"<[^>]+>", "", problem)
        for problem in re.findall(r'<p class="form-error flag-problem">(.*?)</p>', html)
    ]
    assert (
        "--port abc: &#39;abc&#39; is not a whole number (allowed: a whole number, 1 or more)"
        in problems
    )
    assert any("choose one of auto, bfloat16, float16, float32" in p for p in problems)
    # the two exclusive flags both say why
    assert sum("cannot both be given" in p for p in problems) == 2
    assert "4 flags need fixing before saving." in html
    # the draft is shown as typed, not the stored flags
    assert 'name="--port" value="abc"' in html and 'name="--no-stats" checked' in html


def test_saving_from_the_editor(local: TestClient, viewer: TestClient, demo_model: Path) -> None:
    created = local.post(
        "/api/profiles", json={"name": "edited", "model": str(demo_model), "flags": ["--no-stats"]}
    ).json()
    form = {"name": "edited", "model": created["model"], "notes": "from the editor",
            "--kv-reserve-tokens": "1024", "--dtype": "", "--no-cuda-graph": "on"}  # fmt: skip
    saved = local.put(f"/profiles/{created['id']}/flags", data=form)
    assert saved.status_code == 200 and "Saved." in saved.text
    assert saved.headers["HX-Trigger"] == "profile-saved"
    stored = local.get(f"/api/profiles/{created['id']}").json()
    # --no-stats was unticked (absent from the form): off; the rest in the parser's order
    assert stored["flags"] == ["--kv-reserve-tokens", "1024", "--no-cuda-graph"]
    assert stored["notes"] == "from the editor"
    refused = local.put(f"/profiles/{created['id']}/flags", data={**form, "--port": "0"})
    shown = re.sub(r"<[^>]+>", "", refused.text)  # without the marks around data
    assert "Saved." not in shown and "--port 0: 0 must be at least 1" in shown
    assert local.get(f"/api/profiles/{created['id']}").json()["flags"] == stored["flags"]
    taken = local.put(f"/profiles/{created['id']}/flags", data={**form, "name": "page demo"})
    assert "exists already" in taken.text
    assert viewer.put(f"/profiles/{created['id']}/flags", data=form).status_code == 401


def test_delete_names_the_servers_started_from_the_profile(
    local: TestClient, daemon: Daemon, demo_model: Path
) -> None:
    from moelab.daemon.schema import Server

    created = local.post("/api/profiles", json={"name": "used", "model": str(demo_model)}).json()
    with daemon.store.session() as session:
        session.add(
            Server(profile_id=created["id"], name="used-engine", model=created["model"], flags=[],
                   host="127.0.0.1", port=8150, device="cpu", status="stopped", log_path="",
                   created=0.0)
        )  # fmt: skip
    html = local.get(f"/profiles/{created['id']}").text
    confirm = re.search(r'data-confirm="([^"]*)"', html.split('id="profile-actions"')[1])
    assert confirm is not None
    assert confirm.group(1).startswith("Servers started from used: #")
    assert "used-engine (stopped). They keep running. Delete the profile used?" in confirm.group(1)
    deleted = local.delete(f"/api/profiles/{created['id']}").json()
    assert len(deleted["servers"]) == 1


def test_recommended_part_and_planner_actions(local: TestClient, profile_id: int) -> None:
    part = local.get(f"/profiles/{profile_id}?part=recommended").text
    assert part.startswith("{#") is False and 'id="recommended"' in part
    # each advised flag that differs has its Apply; each fitting context its "Use this context"
    assert 'name="flag" value="--kv-reserve-tokens"' in part
    assert part.count("Use this context") >= 2
    assert "Apply all of Recommended" in part
