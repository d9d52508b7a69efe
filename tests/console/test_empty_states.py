"""What the pages say before anything runs: what to do next, in both languages."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from moelab.daemon.hardware import GpuInfo
from moelab.daemon.measure import Reading
from moelab.daemon.service import Daemon
from tests.daemon.conftest import make_daemon

from .conftest import lan_client, local_client


@pytest.fixture
def idle_daemon(tmp_path: Path, demo_model: Path) -> Iterator[Daemon]:
    daemon = make_daemon(tmp_path / "data", demo_model.parent, host="0.0.0.0",
                         allow_hosts=("mgr.lan",))  # fmt: skip
    daemon.start()
    yield daemon
    daemon.close()


@pytest.fixture
def empty_daemon(tmp_path: Path) -> Iterator[Daemon]:
    daemon = make_daemon(tmp_path / "data", None)
    daemon.start()
    yield daemon
    daemon.close()


def test_nothing_running_points_to_the_servers_page(idle_daemon: Daemon) -> None:
    client = local_client(idle_daemon)
    dashboard = client.get("/").text
    assert "Nothing is running yet" in dashboard and "mgr knows one checkpoint." in dashboard
    assert 'href="/servers"' in dashboard
    assert "ダッシュボード" in client.get("/", headers={"Accept-Language": "ja"}).text
    assert "まだ何も動いていません" in client.get("/", headers={"Accept-Language": "ja"}).text
    servers = client.get("/servers").text
    assert "No engine has been started yet" in servers and 'id="start-model"' in servers
    assert "No profiles yet" in servers
    experts = client.get("/experts").text
    assert "No engine is running" in experts and "Start one on the Servers page" in experts
    hardware = client.get("/hardware?format=json").json()
    assert hardware["job"] is None and hardware["inventory"]["cpu"]["logical_cores"] >= 1


def test_a_viewer_is_told_to_log_in_to_start_engines(idle_daemon: Daemon) -> None:
    dashboard = lan_client(idle_daemon).get("/").text
    assert "log in with the control token to start engines" in dashboard
    assert "Start the demo model" not in dashboard


def test_no_checkpoint_anywhere_says_where_to_put_one(empty_daemon: Daemon) -> None:
    client = local_client(empty_daemon)
    assert "mgr found no checkpoint." in client.get("/").text
    servers = client.get("/servers").text
    assert "mgr found no checkpoint yet" in servers and "No models found." in servers


def test_a_pc_without_a_gpu_says_so_instead_of_an_empty_memory_chart(
    idle_daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    probed = idle_daemon.hardware.inventory()
    monkeypatch.setattr(
        idle_daemon.hardware, "inventory", lambda **_: dataclasses.replace(probed, gpus=())
    )
    client = local_client(idle_daemon)
    dashboard = client.get("/").text
    assert 'data-chart="vram"' not in dashboard and 'data-chart="host_ram"' in dashboard
    assert "<strong>No GPU</strong>: engines on this PC run on the CPU." in dashboard
    japanese = client.get("/", headers={"Accept-Language": "ja"}).text
    assert "<strong>GPU なし</strong>" in japanese
    # with a GPU, its memory is charted even before any engine runs
    gpu = GpuInfo(0, "Test GPU", "GPU-0", None, 8 << 30, 7 << 30, None, None, None, None)
    monkeypatch.setattr(
        idle_daemon.hardware, "inventory", lambda **_: dataclasses.replace(probed, gpus=(gpu,))
    )
    dashboard = client.get("/").text
    assert 'data-chart="vram"' in dashboard and "No GPU" not in dashboard


def test_the_hardware_page_lists_each_gpu_with_its_link_and_memory(
    idle_daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two cards: each row names its PCIe link's peak, the host-to-GPU copy measured on it and
    its memory's peak rate."""
    probed = idle_daemon.hardware.inventory()
    cards = (
        GpuInfo(0, "RTX 4090", "GPU-a", None, 24 << 30, 20 << 30, 4, 16, 4, 16, 1008.1),
        GpuInfo(1, "RTX 3060", "GPU-b", None, 12 << 30, 11 << 30, 3, 8, 1, 8, 360.0),
    )
    two = dataclasses.replace(probed, gpus=cards)
    monkeypatch.setattr(idle_daemon.hardware, "inventory", lambda **_: two)
    idle_daemon.hardware.record(
        [
            Reading("h2d_pinned", 24.6, "GB/s", {"gpu_index": 0}),
            Reading("h2d_pinned", 6.1, "GB/s", {"gpu_index": 1}),
        ],
        "moelab bench bw",
        two,
    )
    client = local_client(idle_daemon)
    page = client.get("/hardware").text
    assert "(max 4×16, 31.5 GB/s peak) · host to GPU 24.6 GB/s measured · memory 1008 GB/s" in page
    assert "(max 3×8, 7.9 GB/s peak) · host to GPU 6.1 GB/s measured · memory 360 GB/s" in page
    japanese = client.get("/hardware", headers={"Accept-Language": "ja"}).text
    assert "ホストから GPU へ 6.1 GB/s（実測）" in japanese
