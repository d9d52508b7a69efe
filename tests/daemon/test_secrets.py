"""Secrets at rest: a private data dir, and API keys hidden by their position in a command line."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from moelab.daemon.schema import Server
from moelab.daemon.service import Daemon
from moelab.engine.process.redact import hide_secrets, redact_flags

from .conftest import asgi_client, start_mgr

OLD_LOG = (
    "# 2026-11-02 10:00:00 starting: /usr/bin/python -m moelab.engine.cli serve --model-path "
    "/models/a --api-key a --port 8100\n"
    "INFO moelab.bank: a bank of experts, loaded as a memory map\n"
    "# 2026-11-02 11:00:00 starting: /usr/bin/python -m moelab.engine.cli serve --model-path "
    "/models/a --api-key=a --port 8100\n"
)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("serve --api-key a --port 1", "serve --api-key (hidden) --port 1"),
        ("serve --api-key=a --port 1", "serve --api-key=(hidden) --port 1"),
        ("serve --api-key 'a b' --port 1", "serve --api-key (hidden) --port 1"),
        ("a line about a flag called --api-keys", "a line about a flag called --api-keys"),
        ("ends with --api-key\nnext line", "ends with --api-key\nnext line"),
    ],
)
def test_a_key_is_hidden_where_a_command_line_gives_it(text: str, shown: str) -> None:
    assert hide_secrets(text) == shown


def test_a_flag_list_hides_the_value_after_the_flag_or_its_equals_sign() -> None:
    flags = ["--api-key", "a", "--served-model-name", "a", "--api-key=a", "--api-key"]
    assert redact_flags(flags) == [
        "--api-key", "(hidden)", "--served-model-name", "a", "--api-key=(hidden)", "--api-key",
    ]  # fmt: skip


def test_a_one_letter_key_does_not_mask_that_letter_in_a_log(
    session_daemon: Daemon, tmp_path: Path
) -> None:
    log_path = tmp_path / "server.log"
    log_path.write_text(OLD_LOG)  # as an older moelab wrote it, key and all
    with session_daemon.store.session() as session:
        row = Server(
            name="keyed", model="/models/a", flags=["--api-key", "a", "--port", "8100"],
            host="127.0.0.1", port=8100, device="cpu", status="crashed", log_path=str(log_path),
            log_tail=OLD_LOG, created=time.time(),
        )  # fmt: skip
        session.add(row)
        session.flush()
        server_id = row.id
    viewer = asgi_client(session_daemon, "192.168.3.3", "mgr.lan:1901")
    lines = viewer.get(f"/api/servers/{server_id}/logs").json()["lines"]
    expected = [
        "# 2026-11-02 10:00:00 starting: /usr/bin/python -m moelab.engine.cli serve --model-path "
        "/models/a --api-key (hidden) --port 8100",
        "INFO moelab.bank: a bank of experts, loaded as a memory map",
        "# 2026-11-02 11:00:00 starting: /usr/bin/python -m moelab.engine.cli serve --model-path "
        "/models/a --api-key=(hidden) --port 8100",
    ]
    assert lines == expected
    server = viewer.get(f"/api/servers/{server_id}").json()
    assert server["log_tail"].splitlines() == expected
    assert server["flags"] == ["--api-key", "(hidden)", "--port", "8100"]
    page = viewer.get(f"/servers/{server_id}").text
    assert "a bank of experts, loaded as a memory map" in page


def test_the_data_dir_is_private_once_mgr_has_started(tmp_path: Path) -> None:
    data = tmp_path / "data"
    mgr = start_mgr(data)
    try:
        assert mgr.post("/api/models/rescan")  # a write: the WAL and its index exist
        assert mode(data) == 0o700
        for name in ("mgr.sqlite3", "mgr.sqlite3-wal", "mgr.sqlite3-shm", "control-token",
                     "mgr.lock"):  # fmt: skip
            assert mode(data / name) == 0o600, name
    finally:
        mgr.stop()


def test_a_data_dir_left_readable_by_an_older_moelab_is_tightened_at_start(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    mgr = start_mgr(data)
    mgr.stop()
    (data / "logs").mkdir()
    (data / "logs" / "server-1.log").write_text(OLD_LOG)
    (data / "models" / "mine").mkdir(parents=True)
    (data / "models" / "mine" / "config.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not mgr's")
    (data / "link").symlink_to(elsewhere)
    opened = [data, data / "logs", data / "models", data / "models" / "mine"]
    for path in [*opened, *(p for p in data.rglob("*") if p.is_file() and not p.is_symlink())]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.chmod(elsewhere, 0o644)
    mgr = start_mgr(data)
    try:
        for path in opened:
            assert mode(path) == 0o700, path
        files = [p for p in data.rglob("*") if p.is_file() and not p.is_symlink()]
        assert {p.name for p in files} >= {"mgr.sqlite3", "control-token", "mgr.lock",
                                           "server-1.log", "config.json"}  # fmt: skip
        for path in files:
            assert mode(path) == 0o600, path
        assert mode(elsewhere) == 0o644  # a link is not followed out of the data dir
    finally:
        mgr.stop()
