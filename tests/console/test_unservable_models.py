"""A checkpoint moelab cannot serve: the Start form, the profile forms and the editor say why,
before anything starts, in English and in Japanese."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from html import unescape
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from moelab.daemon.service import Daemon
from tests.daemon.conftest import asgi_client, make_daemon

LOTS = 'config.json: num_experts must be a whole number, not "lots"'
LOTS_JA = 'config.json: num_experts は "lots" ではなく整数にしてください'


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Daemon]:
    models = tmp_path_factory.mktemp("models")
    shutil.copytree(demo_model, models / "a-good-one")
    bad = models / "Qwen3-lots"  # sorts before the good one: the form must not offer it first
    shutil.copytree(demo_model, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_experts": "lots"}))
    daemon = make_daemon(tmp_path_factory.mktemp("data"), models)
    daemon.start()
    yield daemon
    daemon.close()


def page(client: TestClient, path: str, language: str = "en") -> str:
    reply = client.get(path, headers={"Accept-Language": language})
    assert reply.status_code == 200, reply.text
    return reply.text


def problems(html: str) -> list[str]:
    """The reasons the page gives, as a reader sees them (tags out)."""
    found = re.findall(r'<span class="model-problem">(.*?)</span></li>', html)
    return [unescape(re.sub(r"<[^>]+>", "", reason)) for reason in found]


def options(html: str, form_id: str) -> list[str]:
    form = html[html.index(f'id="{form_id}"') :]
    select = form[form.index('<select name="model">') : form.index("</select>")]
    return [text.strip() for text in re.findall(r"<option[^>]*>([^<]*)</option>", select)]


def test_the_start_form_marks_the_model_and_says_why(daemon: Daemon) -> None:
    client = asgi_client(daemon, "127.0.0.1", "127.0.0.1:1901")
    html = page(client, "/servers")
    assert options(html, "start-model") == ["a-good-one", "Qwen3-lots (cannot be served)"]
    assert "<strong>Qwen3-lots</strong>" in html
    assert problems(html) == [LOTS]
    ja = page(client, "/servers", "ja")
    assert "Qwen3-lots (配信できません)" in ja and "配信できません:" in ja
    assert problems(ja) == [LOTS_JA]


def test_the_new_profile_form_says_why(daemon: Daemon) -> None:
    client = asgi_client(daemon, "127.0.0.1", "127.0.0.1:1901")
    html = page(client, "/profiles")
    assert options(html, "new-profile") == ["a-good-one", "Qwen3-lots (cannot be served)"]
    assert problems(html) == [LOTS]
    assert problems(page(client, "/profiles", "ja")) == [LOTS_JA]


def test_the_editor_of_a_profile_for_it_says_why_and_the_start_is_refused(
    daemon: Daemon,
) -> None:
    client = asgi_client(daemon, "127.0.0.1", "127.0.0.1:1901")
    bad = next(m for m in client.get("/api/models").json()["models"] if m["error"])
    created = client.post("/api/profiles", json={"name": "lots", "model": bad["path"]})
    assert created.status_code == 201, created.text
    profile = created.json()
    said = {
        "en": f"Qwen3-lots cannot be served, so this profile cannot start: {LOTS}",
        "ja": f"Qwen3-lots は配信できないため、このプロファイルは起動できません: {LOTS_JA}",
    }
    for language, text in said.items():
        html = page(client, f"/profiles/{profile['id']}", language)
        problem = re.search(r'<p class="form-error" id="model-problem">(.*?)</p>', html)
        assert problem is not None
        assert unescape(re.sub(r"<[^>]+>", "", problem.group(1))) == text
    refused = client.post("/api/servers", json={"profile_id": profile["id"]})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "unsupported_model"
    assert LOTS in refused.json()["error"]["message"]
    assert client.get("/api/servers").json()["servers"] == []
