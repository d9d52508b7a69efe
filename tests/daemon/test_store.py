"""The store: a newer daemon opens an older database without losing a row; pragmas; schema drift."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from moelab.daemon.migrations import LATEST_VERSION, MIGRATIONS, current_version, migrate
from moelab.daemon.schema import AuditEvent, Base, Profile, Server, TelemetrySample
from moelab.daemon.store import Store, StoreError
from moelab.daemon.telemetry import encode

FILLER = {"INTEGER": 7, "REAL": 1.5, "TEXT": '{"from": "old"}', "BLOB": b"\x01\x02"}


def _old_database(path: Path, version: int) -> dict[str, tuple]:
    """A database at schema `version` with one row in every table; returns table -> row."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    migrate(conn, target=version)
    assert current_version(conn) == version
    tables = [
        name
        for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'schema_migrations' "
            "ORDER BY rowid"
        )
    ]
    rows = {}
    for table in tables:
        columns = conn.execute(f"PRAGMA table_info({table})").fetchall()
        names, values = [], []
        for _cid, name, ctype, _notnull, _default, _pk in columns:
            names.append(name)
            # foreign keys point at id 1, which every parent table gets first (creation order)
            is_key = ctype == "INTEGER" and (name == "id" or name.endswith("_id"))
            values.append(1 if is_key else FILLER[ctype])
        placeholders = ", ".join("?" for _ in names)
        conn.execute(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({placeholders})", values)
        rows[table] = tuple(values)
    conn.close()
    return rows


@pytest.mark.parametrize("version", [m.version for m in MIGRATIONS[:-1]])
def test_upgrade_from_each_older_version_keeps_every_row(tmp_path: Path, version: int) -> None:
    path = tmp_path / "mgr.sqlite3"
    before = _old_database(path, version)
    store = Store(path)
    conn = sqlite3.connect(path)
    assert current_version(conn) == LATEST_VERSION
    for table, values in before.items():
        rows = conn.execute(f"SELECT * FROM {table}").fetchall()
        assert len(rows) == 1, table
        assert rows[0][: len(values)] == values, f"{table} changed in the upgrade"
    conn.close()
    store.close()


def test_profile_written_by_version_1_reads_through_todays_orm(tmp_path: Path) -> None:
    path = tmp_path / "mgr.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, target=1)
    conn.execute(
        "INSERT INTO profiles (name, model, flags, notes, origin, created, updated) "
        "VALUES ('fast', '/models/q', '[\"--moe-cache-rate\", \"0.5\"]', 'n', 'by hand', 1, 2)"
    )
    conn.execute(
        "INSERT INTO servers (profile_id, name, model, flags, host, port, device, status, "
        "log_path, created) VALUES (1, 'fast', '/models/q', '[]', '127.0.0.1', 8100, 'cpu', "
        "'stopped', '/tmp/x.log', 3)"
    )
    conn.close()
    store = Store(path)
    with store.session() as session:
        profile = session.scalars(select(Profile)).one()
        server = session.scalars(select(Server)).one()
        # a column that version 2 added reads as empty on a version-1 row
        assert server.last_stats is None
        session.add(
            TelemetrySample(
                server_id=server.id, kind="stats", resolution_s=2, time=4, interval_s=2,
                payload=encode({"g": {}}), size_bytes=10,
            )
        )  # fmt: skip
    assert profile.flags == ["--moe-cache-rate", "0.5"]
    assert (profile.name, profile.model, profile.notes) == ("fast", "/models/q", "n")
    store.close()


def test_audit_rows_of_version_3_get_their_long_fields_cut(tmp_path: Path) -> None:
    path = tmp_path / "mgr.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, target=3)
    conn.execute(
        "INSERT INTO audit_events (time, address, via, method, path, status, action) "
        "VALUES (1, '10.0.0.9', 'none', 'POST', ?, 401, 'refused: token_required')",
        ("/api/" + "x" * 30_000,),
    )
    conn.close()
    store = Store(path)
    with store.session() as session:
        row = session.scalars(select(AuditEvent)).one()
    assert len(row.path) == 200 and row.path.startswith("/api/xxx")
    assert (row.count, row.minute, row.action) == (1, None, "refused: token_required")
    store.close()


def test_a_database_from_a_newer_moelab_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "mgr.sqlite3"
    Store(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "INSERT INTO schema_migrations VALUES (?, 'from the future', ?)",
        (LATEST_VERSION + 1, time.time()),
    )
    conn.close()
    with pytest.raises(StoreError, match="newer than this moelab"):
        Store(path)
    conn = sqlite3.connect(path)
    assert current_version(conn) == LATEST_VERSION + 1
    conn.close()


def test_orm_columns_match_what_the_migrations_create(tmp_path: Path) -> None:
    """An ORM column without a migration would only fail on a user's machine: catch it here."""
    store = Store(tmp_path / "mgr.sqlite3")
    conn = sqlite3.connect(tmp_path / "mgr.sqlite3")
    for table in Base.metadata.sorted_tables:
        db_columns = {row[1] for row in conn.execute(f"PRAGMA table_info({table.name})")}
        assert db_columns == {c.name for c in table.columns}, table.name
    conn.close()
    store.close()


def test_connections_use_wal_foreign_keys_and_a_busy_timeout(tmp_path: Path) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    with store.session() as session:
        conn = session.connection()
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 5000
    store.close()


def test_deleting_a_server_deletes_its_telemetry(tmp_path: Path) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    with store.session() as session:
        server = Server(
            name="s", model="/m", flags=[], host="127.0.0.1", port=8100, device="cpu",
            status="stopped", log_path="/tmp/s.log", created=1.0,
        )  # fmt: skip
        session.add(server)
        session.flush()
        session.add(
            TelemetrySample(
                server_id=server.id, kind="stats", resolution_s=2, time=1, interval_s=2,
                payload=b"x", size_bytes=1,
            )
        )  # fmt: skip
    with store.session() as session:
        session.delete(session.scalars(select(Server)).one())
    with store.session() as session:
        assert session.scalars(select(TelemetrySample)).all() == []
    store.close()


def test_an_unreadable_file_is_reported_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "mgr.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot use the database"):
        Store(path)
