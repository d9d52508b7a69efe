"""gpt-oss in the console's Recommended and context planner: the sliding-window layers' pages,
a fixed amount per running sequence, shown as such beside the full layers' KV (not as recurrent
states)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from moelab.daemon.service import Daemon
from tests.daemon.conftest import make_daemon, synth

from .conftest import local_client
from .test_pages import get_page


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    """A daemon whose models folder holds a tiny gpt_oss checkpoint written by `moelab synth`
    (a window of 128 on two of its four layers)."""
    models = tmp_path_factory.mktemp("models")
    model = synth(models / "oss-tiny", "--arch", "gpt_oss")
    daemon = make_daemon(tmp_path_factory.mktemp("data"), models)
    daemon.start()
    yield daemon, model
    daemon.close()


def test_recommended_and_the_planner_show_the_windows_pages_beside_the_kv(gpt_oss) -> None:
    daemon, model = gpt_oss
    client = local_client(daemon)
    reply = client.post("/api/profiles", json={"name": "oss", "model": str(model), "flags": []})
    assert reply.status_code == 201, reply.text
    profile = reply.json()["id"]
    recommended = client.get(f"/api/recommend?model={model}&profile={profile}").json()
    planner = recommended["planner"]
    assert (planner["attention_layers"], planner["sliding_layers"]) == (2, 2)
    assert planner["window_tokens"] == 128 and planner["linear_layers"] == 0
    rows = planner["state_sequences"] + 1 + planner["state_checkpoints"]
    assert planner["state_bytes"] == rows * planner["state_bytes_per_seq"] > 0
    split = recommended["vram_split"]
    assert split["bytes"]["states"] == planner["state_bytes"]
    assert split["window_tokens"] == 128
    en = get_page(client, f"/profiles/{profile}", "en")
    assert "<th>Sliding-window pages</th>" in en and "<th>Recurrent states</th>" not in en
    assert "128 tokens a layer for 8 running sequences and 8 checkpoints" in en
    assert "the 2 sliding-window layers keep their last 128 tokens" in en
    ja = get_page(client, f"/profiles/{profile}", "ja")
    assert "<th>スライディングウィンドウのページ</th>" in ja and "<th>再帰状態</th>" not in ja
    assert "2 層のスライディングウィンドウ層は直近の 128 トークンだけを持ち" in ja
