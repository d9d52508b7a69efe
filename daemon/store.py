"""The daemon's SQLite database: WAL, a busy timeout and foreign keys on, migrated when opened."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from .migrations import SchemaTooNew, migrate

DB_NAME = "mgr.sqlite3"
BUSY_TIMEOUT_MS = 10_000


class StoreError(RuntimeError):
    """The database cannot be opened (a newer schema, a damaged file)."""


def iso_time(epoch_s: float | None) -> str | None:
    """Seconds since the epoch as an ISO 8601 UTC string (the API's time format)."""
    if epoch_s is None:
        return None
    return datetime.fromtimestamp(epoch_s, timezone.utc).isoformat(timespec="seconds")


class Store:
    """The open database: sessions for the services, plus the raw engine for maintenance."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._prepare(path)
        self.engine: Engine = create_engine(
            f"sqlite:///{path}",
            connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
            pool_size=8,
            max_overflow=32,
        )
        event.listen(self.engine, "connect", _on_connect)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def open(cls, data_dir: Path) -> Store:
        return cls(data_dir / DB_NAME)

    @staticmethod
    def _prepare(path: Path) -> None:
        """Create or upgrade the file before SQLAlchemy sees it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as err:
            raise StoreError(f"cannot open the database {path}: {err}") from None
        try:
            if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
                # only settable before the first table; lets telemetry retention give pages back
                conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA foreign_keys = ON")
            migrate(conn)
        except SchemaTooNew as err:
            raise StoreError(f"{path}: {err}") from None
        except sqlite3.DatabaseError as err:
            raise StoreError(f"cannot use the database {path}: {err}") from None
        finally:
            conn.close()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits when the block ends normally and rolls back otherwise."""
        with self._sessions() as session, session.begin():
            yield session

    def reclaim_space(self) -> None:
        """Give freed pages back to the file system (after retention deleted rows)."""
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            # each step of the pragma frees one page; executescript steps it to the end
            conn.executescript("PRAGMA incremental_vacuum;")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            conn.close()

    def close(self) -> None:
        self.engine.dispose()


def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA synchronous = NORMAL")
    cursor.close()
