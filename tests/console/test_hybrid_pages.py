"""A hybrid model (Gated DeltaNet and attention layers) in the manager and the console: discovery
shows its layer kinds, the dashboard's memory split its recurrent states, the heatmaps each layer's
kind, Recommended and the context planner its states beside the attention layers' KV."""

from __future__ import annotations

import copy
import html
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moelab.console import engines
from moelab.console.i18n import Translator
from moelab.console.pages.dashboard import _vram_figure
from moelab.console.pages.experts import _layer_names
from moelab.daemon.service import Daemon
from tests.daemon.conftest import make_daemon, synth

from . import conftest
from .conftest import local_client, record_engine
from .test_pages import get_page

STATE_BYTES = 3 * 1024**2  # what the recorded engine's states take on its device
RECORDED = conftest.recorded_stats


def figure(page: str, name: str) -> dict[str, Any]:
    """The Plotly figure a page draws in its chart of that name."""
    found = re.search(rf'data-chart="{name}" data-figure="([^"]*)"', page)
    assert found is not None, name
    return json.loads(html.unescape(found.group(1)))


def hybrid_stats() -> list[dict[str, Any]]:
    """The recorded demo engine's bodies as a hybrid model's engine reports them: its MoE layers
    1 and 2 Gated DeltaNet, layer 3 attention, and its recurrent states on the device."""
    bodies = copy.deepcopy(RECORDED())
    for body in bodies:
        body["experts"]["layer_types"] = ["linear_attention", "linear_attention", "full_attention"]
        body["memory"]["device"][0]["states"] = STATE_BYTES
        body["kv"]["states"] = {"linear_layers": 3, "bytes_per_seq": STATE_BYTES // 3,
                                "slots_total": 2, "slots_used": 1,
                                "bytes": STATE_BYTES}  # fmt: skip
    return bodies


@pytest.fixture(scope="module")
def hybrid(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[tuple[Daemon, int, Path]]:
    """A daemon whose models folder holds the demo model and a tiny Qwen3.5 MoE checkpoint
    (multimodal layout) written by `moelab synth`, with a recorded engine of the hybrid model."""
    models = tmp_path_factory.mktemp("models")
    synth(models / "demo-tiny")
    qwen = synth(models / "qwen35-tiny", "--arch", "qwen3_5_moe")
    daemon = make_daemon(tmp_path_factory.mktemp("data"), models)
    daemon.start()
    monkeypatch_module.setattr(conftest, "recorded_stats", hybrid_stats)
    ids = record_engine(daemon, qwen, name="hybrid-engine")
    yield daemon, ids.running_id, qwen
    daemon.close()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_discovery_counts_the_layers_of_each_kind(hybrid) -> None:
    daemon = hybrid[0]
    models = {m["name"]: m for m in local_client(daemon).get("/api/models").json()["models"]}
    assert models["qwen35-tiny"]["layer_kinds"] == {"full_attention": 1, "linear_attention": 3}
    assert models["qwen35-tiny"]["num_layers"] == 4 and models["qwen35-tiny"]["error"] is None
    assert models["demo-tiny"]["layer_kinds"] == {"full_attention": 4, "linear_attention": 0}
    en = get_page(local_client(daemon), "/servers", "en")
    ja = get_page(local_client(daemon), "/servers", "ja")
    assert "qwen35-tiny (3 DeltaNet + 1 attention layers)</option>" in en
    assert "qwen35-tiny (DeltaNet 3 層 + アテンション 1 層)</option>" in ja
    assert "demo-tiny</option>" in en  # a model of one kind of layer says nothing more


def test_the_dashboard_splits_off_the_recurrent_states(hybrid) -> None:
    daemon, _, _ = hybrid
    for lang, label in (("en", "recurrent states"), ("ja", "再帰状態")):
        page = get_page(local_client(daemon), "/", lang)
        traces = {t["name"]: t for t in figure(page, "vram")["data"]}
        assert traces[label]["x"][0] == pytest.approx(STATE_BYTES / 1024**3)
    # engines of models without linear layers only: no such part in the legend
    card = {"server": {"name": "demo", "device": "cpu"},
            "devices": engines.device_split(RECORDED()[1])}  # fmt: skip
    plain = _vram_figure({"engines": [card], "gpus": []}, Translator("en"))
    assert [trace.name for trace in plain.data] == [
        "weights", "KV cache", "expert cache", "activations", "other", "free"
    ]  # fmt: skip
    body = local_client(daemon).get("/", headers={"Accept": "application/json"}).json()
    [card] = [c for c in body["engines"] if c["server"]["name"] == "hybrid-engine"]
    assert card["devices"][0]["parts"]["states"] == STATE_BYTES


def test_the_heatmaps_label_deltanet_and_attention_layers(hybrid) -> None:
    daemon, server_id, _ = hybrid
    for lang, rows in (("en", ["L1 DeltaNet", "L2 DeltaNet", "L3 attention"]),
                       ("ja", ["L1 DeltaNet", "L2 DeltaNet", "L3 アテンション"])):  # fmt: skip
        page = get_page(local_client(daemon), f"/experts/{server_id}", lang)
        for chart in ("pick_heatmap", "miss_heatmap"):
            assert figure(page, chart)["data"][0]["y"] == rows, (lang, chart)


def test_recommended_and_the_planner_show_the_states_beside_the_kv(hybrid) -> None:
    daemon, _, qwen = hybrid
    client = local_client(daemon)
    reply = client.post("/api/profiles", json={"name": "qwen35", "model": str(qwen), "flags": []})
    assert reply.status_code == 201, reply.text
    profile = reply.json()["id"]
    recommended = client.get(f"/api/recommend?model={qwen}&profile={profile}").json()
    planner = recommended["planner"]
    assert (planner["attention_layers"], planner["linear_layers"]) == (1, 3)
    assert planner["kv_bytes_per_token"] == 2 * 1 * 2 * 16 * 4  # 1 layer, 2 KV heads, float32
    rows = planner["state_sequences"] + 1 + planner["state_checkpoints"]
    assert planner["state_checkpoints"] == 8
    assert planner["state_bytes"] == rows * planner["state_bytes_per_seq"]
    split = recommended["vram_split"]
    assert split["bytes"]["states"] == planner["state_bytes"] > 0
    en = get_page(client, f"/profiles/{profile}", "en")
    assert "Recurrent states" in en and "KV is kept by the 1 attention layers alone" in en
    ja = get_page(client, f"/profiles/{profile}", "ja")
    assert "再帰状態" in ja and "KV を持つのは 1 層のアテンション層だけ" in ja


def test_a_split_engine_shows_each_card_in_the_memory_chart_and_the_heatmaps() -> None:
    """An engine split across two GPUs (--devices): a memory bar per card under its name, and
    each heatmap row names the card its layer runs on."""
    body = copy.deepcopy(RECORDED()[1])
    card0 = body["memory"]["device"][0]
    body["memory"]["device"] = [card0, {**card0, "index": 1, "weights": 2 * card0["weights"]}]
    card = {"server": {"name": "split", "device": "cuda:0,cuda:1"},
            "devices": engines.device_split(body)}  # fmt: skip
    chart = _vram_figure({"engines": [card], "gpus": []}, Translator("en"))
    weights = next(trace for trace in chart.data if trace.name == "weights")
    assert list(weights.y) == ["split<br>cuda:0", "split<br>cuda:1"]
    assert weights.x[1] == pytest.approx(2 * weights.x[0])
    data = {
        "experts": {"layer_ids": [0, 1, 2], "num_layers": 3},
        "devices": [
            {"device": "cuda:0", "layers": [0, 1]},
            {"device": "cuda:1", "layers": [2, 3]},
        ],
    }
    assert _layer_names(data, Translator("en")) == ["L0 cuda:0", "L1 cuda:0", "L2 cuda:1"]
    data["experts"]["layer_types"] = ["linear_attention", "full_attention", "linear_attention"]
    assert _layer_names(data, Translator("en"))[1] == "L1 attention cuda:0"


def split_stats() -> list[dict[str, Any]]:
    """The recorded demo engine's bodies as an engine split across an RTX 4090 and an RTX 3060
    reports them: each card's layers, link, memory rate and slots, the 3060 limiting the step."""
    bodies = copy.deepcopy(RECORDED())
    for body in bodies:
        body["devices"] = [
            {"device": "cuda:0", "layers": [0, 2], "link_gbps": 24.6, "memory_gbps": 921.0,
             "slots": 12, "limits": False, "step_ms": 3.1},
            {"device": "cuda:1", "layers": [3, 3], "link_gbps": 6.1, "memory_gbps": 322.0,
             "slots": 4, "limits": True, "step_ms": 3.4},
        ]  # fmt: skip
    return bodies


def test_the_experts_page_lists_each_card_of_a_split_and_the_one_that_limits(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = make_daemon(tmp_path / "data", demo_model.parent)
    daemon.start()
    try:
        monkeypatch.setattr(conftest, "recorded_stats", split_stats)
        ids = record_engine(daemon, demo_model, name="split-engine",
                            flags=("--devices", "cuda:0,cuda:1"))  # fmt: skip
        en = get_page(local_client(daemon), f"/experts/{ids.running_id}", "en")
        rows = re.findall(r"<tr><td><code>(cuda:\d)</code>.*?</tr>", en, re.S)
        assert rows == ["cuda:0", "cuda:1"]
        table = en[en.index('id="split-cards"') :]
        assert "L3–L3" in table and "6.1 GB/s" in table and "322 GB/s" in table
        last = table[table.index("<code>cuda:1</code>") : table.index("</tbody>")]
        assert "<strong>limits the step</strong>" in last
        assert "limits the step" not in table[: table.index("<code>cuda:1</code>")]
        ja = get_page(local_client(daemon), f"/experts/{ids.running_id}", "ja")
        assert "<strong>ステップを律速</strong>" in ja
        # one device: no table of cards
        monkeypatch.setattr(conftest, "recorded_stats", RECORDED)
        alone = record_engine(daemon, demo_model, name="one-card", port=8197)
        page = get_page(local_client(daemon), f"/experts/{alone.running_id}", "en")
        assert 'id="split-cards"' not in page
    finally:
        daemon.close()
