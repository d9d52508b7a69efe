"""A server's page tells how to reach the engine from where the viewer is: the OpenAI base_url by
the host the viewer used for the console, the model name, and when only the PC itself can."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from moelab.daemon.service import Daemon
from tests.daemon.conftest import make_daemon

from .conftest import LAN_HOST, lan_client, local_client, logged_in_client, record_engine


@pytest.fixture(scope="module")
def reach_daemon(
    tmp_path_factory: pytest.TempPathFactory, demo_model: Path
) -> Iterator[tuple[Daemon, dict[str, int]]]:
    daemon = make_daemon(
        tmp_path_factory.mktemp("reach-data"), demo_model.parent, host="0.0.0.0",
        allow_hosts=("mgr.lan",),
    )  # fmt: skip
    daemon.start()
    lan_flags = ("--host", "0.0.0.0", "--served-model-name", "tiny", "--api-key", "s3cret")
    ids = {
        "loopback": record_engine(daemon, demo_model, "on-loopback", 8401).running_id,
        "lan": record_engine(
            daemon, demo_model, "on-the-lan", 8402, host="0.0.0.0", flags=lan_flags
        ).running_id,
    }
    yield daemon, ids
    daemon.close()


def client_of(reply_json: dict) -> dict:
    return reply_json["client"]


def test_a_lan_viewer_gets_the_name_it_used_with_the_engines_port(
    reach_daemon: tuple[Daemon, dict[str, int]],
) -> None:
    daemon, ids = reach_daemon
    page = lan_client(daemon).get(f"/servers/{ids['lan']}").text
    lan_name = LAN_HOST.split(":")[0]
    assert f'<code id="client-base-url">http://{lan_name}:8402/v1</code>' in page
    assert '<code id="client-model">tiny</code>' in page  # --served-model-name
    assert "--api-key as the API key" in page and "s3cret" not in page
    assert "reachable only from the PC itself" not in page
    local = local_client(daemon).get(f"/servers/{ids['lan']}?format=json").json()
    assert client_of(local)["base_url"] == "http://127.0.0.1:8402/v1"


def test_an_engine_on_loopback_is_said_to_be_reachable_only_from_the_pc(
    reach_daemon: tuple[Daemon, dict[str, int]],
) -> None:
    daemon, ids = reach_daemon
    page = lan_client(daemon).get(f"/servers/{ids['loopback']}").text
    assert "This engine listens on 127.0.0.1: it is reachable only from the PC itself." in page
    # the checkpoint folder's name, as the engine serves it without --served-model-name
    assert '<code id="client-model">demo-tiny</code>' in page
    reply = lan_client(daemon).get(f"/servers/{ids['loopback']}?format=json").json()
    assert client_of(reply) == {
        "base_url": "http://127.0.0.1:8401/v1",
        "model": "demo-tiny",
        "only_this_pc": True,
        "reachable_from_viewer": False,
        "needs_api_key": False,
    }
    japanese = lan_client(daemon).get(
        f"/servers/{ids['loopback']}", headers={"Accept-Language": "ja"}
    )
    assert "この PC 自身からしか接続できません" in japanese.text


def test_the_start_form_and_the_profile_editor_offer_the_lan(
    reach_daemon: tuple[Daemon, dict[str, int]],
) -> None:
    daemon, _ids = reach_daemon
    client = logged_in_client(daemon)
    servers = client.get("/servers").text
    assert 'data-adds-flags="--host 0.0.0.0"' in servers
    assert "add --api-key KEY to its flags" in servers
    created = client.post(
        "/api/profiles",
        json={"name": "reach", "model": daemon.catalog.list()[0].path},
        headers={"Origin": f"http://{LAN_HOST}"},
    )
    assert created.status_code == 201, created.text
    editor = client.get(f"/profiles/{created.json()['id']}").text
    assert '<select id="input--host" name="--host">' in editor
    assert '<option value="0.0.0.0">the LAN (0.0.0.0)</option>' in editor
