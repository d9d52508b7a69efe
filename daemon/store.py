"""The daemon's SQLite database: WAL, a busy timeout and foreign keys on, migrated when opened."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from ..engine.text import Text
from .errors import NotFound, disk_full
from .migrations import SchemaTooNew, migrate
from .private import DIR_MODE, FILE_MODE, create_private_file
from .schema import BenchmarkRun, Model, Profile, Server

DB_NAME = "mgr.sqlite3"
BUSY_TIMEOUT_MS = 10_000
MAX_ROW_ID = 2**63 - 1  # SQLite's largest integer: a larger id names no row (and cannot be bound)
Row = TypeVar("Row")

# what a request that names a row which does not exist is told, by table
MISSING: dict[type, Callable[[int], Text]] = {
    Profile: lambda row_id: Text("no profile {profile_id}", profile_id=row_id),
    Server: lambda row_id: Text("no server {server_id}", server_id=row_id),
    BenchmarkRun: lambda row_id: Text("no benchmark run {run_id}", run_id=row_id),
    Model: lambda row_id: Text("no model {id}", id=row_id),
}


class StoreError(RuntimeError):
    """The database cannot be opened (a newer schema, a damaged file)."""


def row_or_404(session: Session, table: type[Row], row_id: int) -> Row:
    """The row of `table` with this id; NotFound naming it (`MISSING`) when there is none."""
    row = session.get(table, row_id)
    if row is None:
        raise NotFound(MISSING[table](row_id))
    return row


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
        """Create or upgrade the file before SQLAlchemy sees it.

        The file is created 0600 by us, not by SQLite: SQLite gives its -wal and -shm files the
        database file's mode, so those are private from their start too.
        """
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        try:
            create_private_file(path)
            for suffix in ("-wal", "-shm"):
                side = path.with_name(path.name + suffix)
                if side.exists():
                    os.chmod(side, FILE_MODE)
            conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        except (OSError, sqlite3.Error) as err:
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
        """A session that commits when the block ends normally and rolls back otherwise.

        A write that fails for want of space raises DiskFull, naming the database's path.
        """
        try:
            with self._sessions() as session, session.begin():
                yield session
        except SQLAlchemyError as err:
            full = disk_full(err, self.path)
            if full is None:
                raise
            raise full from err

    def get_or_404(self, table: type[Row], row_id: int) -> Row:
        """One row by id, read in a session of its own; NotFound when there is none."""
        with self.session() as session:
            return row_or_404(session, table, row_id)

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
