"""The database schema as an ordered list of migrations: a newer daemon upgrades an older file.

Each migration is plain SQLite DDL applied in one transaction together with its row in
`schema_migrations`, so a crash mid-upgrade leaves the previous version intact. Migrations are
append-only: once released, a migration is never edited; a change to the schema is a new entry
at the end. Columns are added with defaults so that every existing row stays valid.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Migration:
    """One step of the schema: the version it produces and the statements that produce it."""

    version: int
    name: str
    sql: str

    @property
    def statements(self) -> list[str]:
        return [s.strip() for s in self.sql.split(";") if s.strip()]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "hardware, models, profiles, servers, audit",
        """
        CREATE TABLE hardware_measurements (
            id INTEGER PRIMARY KEY,
            kind TEXT NOT NULL,
            params TEXT NOT NULL DEFAULT '{}',
            value REAL NOT NULL,
            unit TEXT NOT NULL,
            source TEXT NOT NULL,
            machine_id TEXT NOT NULL,
            hostname TEXT NOT NULL,
            gpu_uuid TEXT,
            gpu_name TEXT,
            engine_version TEXT NOT NULL,
            torch_version TEXT,
            driver_version TEXT,
            cuda_version TEXT,
            created REAL NOT NULL
        );
        CREATE INDEX ix_hardware_kind_created ON hardware_measurements (kind, created);
        CREATE TABLE models (
            id INTEGER PRIMARY KEY,
            path TEXT NOT NULL UNIQUE,
            name TEXT NOT NULL,
            source TEXT NOT NULL,
            architecture TEXT,
            model_type TEXT,
            num_layers INTEGER,
            num_experts INTEGER,
            top_k INTEGER,
            dense_bytes INTEGER,
            expert_bytes INTEGER,
            max_context INTEGER,
            is_demo INTEGER NOT NULL DEFAULT 0,
            present INTEGER NOT NULL DEFAULT 1,
            error TEXT,
            config TEXT NOT NULL DEFAULT '{}',
            discovered REAL NOT NULL,
            updated REAL NOT NULL
        );
        CREATE TABLE profiles (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            model TEXT NOT NULL,
            flags TEXT NOT NULL DEFAULT '[]',
            notes TEXT NOT NULL DEFAULT '',
            origin TEXT NOT NULL DEFAULT 'by hand',
            created REAL NOT NULL,
            updated REAL NOT NULL
        );
        CREATE TABLE servers (
            id INTEGER PRIMARY KEY,
            profile_id INTEGER REFERENCES profiles (id) ON DELETE SET NULL,
            name TEXT NOT NULL,
            model TEXT NOT NULL,
            flags TEXT NOT NULL DEFAULT '[]',
            host TEXT NOT NULL,
            port INTEGER NOT NULL,
            device TEXT NOT NULL,
            status TEXT NOT NULL,
            pid INTEGER,
            process_started REAL,
            log_path TEXT NOT NULL,
            exit_code INTEGER,
            error TEXT,
            log_tail TEXT,
            created REAL NOT NULL,
            started REAL,
            ready REAL,
            stopped REAL
        );
        CREATE INDEX ix_servers_status ON servers (status);
        CREATE TABLE audit_events (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            address TEXT NOT NULL,
            via TEXT NOT NULL,
            method TEXT NOT NULL,
            path TEXT NOT NULL,
            status INTEGER NOT NULL,
            action TEXT NOT NULL,
            target TEXT,
            detail TEXT NOT NULL DEFAULT '{}'
        );
        CREATE INDEX ix_audit_time ON audit_events (time)
        """,
    ),
    Migration(
        2,
        "telemetry samples and each server's last stats",
        """
        CREATE TABLE telemetry_samples (
            id INTEGER PRIMARY KEY,
            server_id INTEGER NOT NULL REFERENCES servers (id) ON DELETE CASCADE,
            kind TEXT NOT NULL,
            resolution_s REAL NOT NULL,
            time REAL NOT NULL,
            interval_s REAL NOT NULL,
            payload BLOB NOT NULL,
            size_bytes INTEGER NOT NULL
        );
        CREATE INDEX ix_samples_server_kind_time ON telemetry_samples (server_id, kind, time);
        CREATE INDEX ix_samples_time ON telemetry_samples (time);
        ALTER TABLE servers ADD COLUMN last_stats TEXT;
        ALTER TABLE servers ADD COLUMN last_stats_time REAL
        """,
    ),
    Migration(
        3,
        "benchmark runs, trials and their events",
        """
        CREATE TABLE benchmark_runs (
            id INTEGER PRIMARY KEY,
            model TEXT NOT NULL,
            mode TEXT NOT NULL,
            objective TEXT NOT NULL,
            status TEXT NOT NULL,
            phase TEXT NOT NULL DEFAULT '',
            eta_s REAL,
            base_flags TEXT NOT NULL DEFAULT '[]',
            options TEXT NOT NULL DEFAULT '{}',
            result TEXT,
            error TEXT,
            engine_version TEXT,
            machine_id TEXT,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            finished REAL
        );
        CREATE TABLE trials (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES benchmark_runs (id) ON DELETE CASCADE,
            n INTEGER NOT NULL,
            change TEXT,
            flags TEXT NOT NULL DEFAULT '[]',
            engine_pid INTEGER,
            started REAL,
            duration_s REAL,
            startup_s REAL,
            prefill_tok_s REAL,
            decode_tok_s REAL,
            aggregate_tok_s REAL,
            ttft_s REAL,
            hit_rate REAL,
            verdict TEXT NOT NULL,
            error TEXT,
            log_tail TEXT,
            stats TEXT,
            UNIQUE (run_id, n)
        );
        CREATE TABLE benchmark_events (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES benchmark_runs (id) ON DELETE CASCADE,
            time REAL NOT NULL,
            kind TEXT NOT NULL,
            message TEXT NOT NULL,
            data TEXT NOT NULL DEFAULT '{}'
        );
        CREATE INDEX ix_benchmark_events_run ON benchmark_events (run_id, time)
        """,
    ),
    Migration(
        4,
        "refusals in the audit table counted per address, reason and minute; long fields cut",
        """
        ALTER TABLE audit_events ADD COLUMN count INTEGER NOT NULL DEFAULT 1;
        ALTER TABLE audit_events ADD COLUMN minute INTEGER;
        CREATE UNIQUE INDEX ix_audit_refusals ON audit_events (minute, address, action, status);
        UPDATE audit_events SET
            path = substr(path, 1, 200),
            method = substr(method, 1, 16),
            action = substr(action, 1, 200),
            target = substr(target, 1, 200),
            address = substr(address, 1, 64)
        WHERE length(path) > 200 OR length(method) > 16 OR length(action) > 200
            OR length(target) > 200 OR length(address) > 64
        """,
    ),
    Migration(
        5,
        "sentences in the viewer's language: stored forms beside the English",
        """
        ALTER TABLE benchmark_events ADD COLUMN text TEXT;
        ALTER TABLE benchmark_runs ADD COLUMN error_text TEXT;
        ALTER TABLE servers ADD COLUMN error_text TEXT;
        ALTER TABLE models ADD COLUMN error_text TEXT
        """,
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version


class SchemaTooNew(RuntimeError):
    """The database was written by a newer moelab than this one."""


def current_version(conn: sqlite3.Connection) -> int:
    """The schema version of an open database (0 for an empty file)."""
    row = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
    ).fetchone()
    if row is None:
        return 0
    return conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0]


def migrate(conn: sqlite3.Connection, target: int = LATEST_VERSION) -> list[int]:
    """Bring the database up to `target`; returns the versions applied.

    `conn` must be in autocommit mode (isolation_level=None): each migration opens its own
    transaction so that DDL and the version row commit together.
    """
    assert conn.isolation_level is None, "migrate() manages its own transactions"
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied REAL NOT NULL)"
    )
    have = current_version(conn)
    known = MIGRATIONS[-1].version
    if have > known:
        raise SchemaTooNew(
            f"the database has schema version {have}, newer than this moelab knows ({known}); "
            "upgrade moelab, or start mgr with a different --data-dir"
        )
    applied = []
    for migration in MIGRATIONS:
        if migration.version <= have or migration.version > target:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in migration.statements:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_migrations (version, name, applied) VALUES (?, ?, ?)",
                (migration.version, migration.name, time.time()),
            )
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        applied.append(migration.version)
    return applied
