"""The audit table: refusals counted per address, reason and minute; cut fields; a row bound."""

from __future__ import annotations

import http.client
import json
import socket
import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select

from moelab.daemon.audit import MAX_TEXT, AuditEntry, AuditLog
from moelab.daemon.retention import Retention, maintain
from moelab.daemon.schema import AuditEvent
from moelab.daemon.service import Daemon
from moelab.daemon.store import Store

from .conftest import MgrProcess, asgi_client, start_mgr, wait_for


def _lan_address() -> str | None:
    """An IPv4 address of this machine that is not loopback: a client bound to it is a LAN peer."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


@pytest.fixture(scope="module")
def lan_address() -> str:
    address = _lan_address()
    if address is None:
        pytest.skip("this machine has no address besides loopback to send LAN requests from")
    return address


@pytest.fixture
def wide_mgr(tmp_path: Path) -> Iterator[MgrProcess]:
    mgr = start_mgr(tmp_path / "data", host="0.0.0.0")
    yield mgr
    mgr.stop()


def _database_bytes(mgr: MgrProcess) -> int:
    """The database's size on disk with its WAL checkpointed into the main file."""
    path = mgr.data_dir / "mgr.sqlite3"

    def checkpointed() -> bool:
        conn = sqlite3.connect(path, timeout=10)
        try:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            conn.close()
        return busy == 0

    wait_for(checkpointed, 30, "a checkpoint of the WAL")
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def test_a_flood_of_refusals_from_a_lan_address_grows_the_database_by_a_bounded_amount(
    wide_mgr: MgrProcess, lan_address: str
) -> None:
    # the inventory thread writes its rows once after start: let it, so the baseline is settled
    wait_for(lambda: wide_mgr.get("/api/hardware")["latest"], 30, "the start-up inventory")
    before = _database_bytes(wide_mgr)
    host = f"{lan_address}:{wide_mgr.port}"
    long_path = "/api/profiles/" + "x" * 12_000  # each refusal of old wrote its whole path

    def send(method: str, path: str, headers: dict[str, str], body: object = None) -> int:
        # from the LAN address: the daemon sees a peer that is not this machine's loopback
        conn = http.client.HTTPConnection(
            lan_address, wide_mgr.port, timeout=30, source_address=(lan_address, 0)
        )
        data = json.dumps(body).encode() if body is not None else None
        kind = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, path, body=data, headers={"Host": host, **kind, **headers})
            response = conn.getresponse()
            reply = json.loads(response.read())
        finally:
            conn.close()
        assert response.status == 200 or {"message", "code"} <= set(reply["error"]), reply
        return response.status

    statuses: Counter[int] = Counter()
    for i in range(100):
        statuses[send("POST", f"{long_path}{i}", {})] += 1
    for i in range(50):
        statuses[send("DELETE", f"{long_path}{i}", {"Origin": "http://evil.example"})] += 1
    for i in range(50):
        statuses[send("PUT", f"{long_path}{i}", {"Host": "evil.example"})] += 1
    for _ in range(50):
        statuses[send("POST", "/api/auth/logout", {})] += 1
    for _ in range(50):
        statuses[send("POST", "/api/auth/login", {}, {"token": "guess"})] += 1
    for i in range(50):
        statuses[send("POST", f"{long_path}{i}", {"Authorization": "Bearer " + "w" * 43})] += 1
    assert statuses == {401: 105, 403: 50, 400: 50, 200: 50, 429: 95}

    expected = {
        ("refused: token_required", 401): 100,
        ("refused: foreign_origin", 403): 50,
        ("refused: unknown_host", 400): 50,
        ("logout", 200): 50,
        ("login failed", 401): 5,
        ("login refused: too many attempts", 429): 45,
        ("refused: too_many_attempts", 429): 50,
    }

    def counted() -> Counter[tuple[str, int]]:
        events = [e for e in wide_mgr.get("/api/audit")["events"] if e["address"] == lan_address]
        out: Counter[tuple[str, int]] = Counter()
        for event in events:
            out[event["action"], event["status"]] += event["count"]
            assert len(event["path"]) <= MAX_TEXT
        return out

    # a handler's request is written down once its answer has gone out: wait for the last ones
    wait_for(lambda: counted() == expected, 10, f"the audit to count every request: {expected}")
    # 350 requests, 250 of them with 12 kB paths: kilobytes, where a row each took megabytes
    grown = _database_bytes(wide_mgr) - before
    assert grown < 128 * 1024, f"the database grew by {grown} bytes"


def test_a_refusal_for_too_many_attempts_is_audited(session_daemon: Daemon) -> None:
    address = "192.168.9.77"
    lan = asgi_client(session_daemon, address, "mgr.lan:1901")
    wrong = {"Authorization": "Bearer " + "w" * 43}
    for _ in range(session_daemon.policy.limiter.max_failures + 3):
        lan.post("/api/models/rescan", headers=wrong)
    local = asgi_client(session_daemon, "127.0.0.1", "127.0.0.1:1901")
    events = [e for e in local.get("/api/audit").json()["events"] if e["address"] == address]
    counted: Counter[tuple[str, int]] = Counter()
    for event in events:
        counted[event["action"], event["status"]] += event["count"]
    assert counted == {("refused: token_invalid", 401): 5, ("refused: too_many_attempts", 429): 3}


def _entry(time_s: float, address: str = "10.0.0.9", **fields: object) -> AuditEntry:
    base = {"via": "none", "method": "POST", "path": "/api/models/rescan", "status": 401,
            "action": "refused: token_required", "counted": True}  # fmt: skip
    return AuditEntry(time=time_s, address=address, **{**base, **fields})


def _rows(store: Store) -> list[AuditEvent]:
    with store.session() as session:
        return list(session.scalars(select(AuditEvent).order_by(AuditEvent.id)))


def test_refusals_are_one_row_per_address_reason_and_minute(tmp_path: Path) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    log = AuditLog(store, Retention())
    for t in (600.0, 630.0, 659.9, 660.0):  # minute 10 three times, then minute 11
        log.record(_entry(t))
    log.record(_entry(640.0, address="10.0.0.10"))
    log.record(_entry(645.0, status=403, action="refused: foreign_origin"))
    # a request with control is a row of its own, even when it repeats
    for _ in range(2):
        log.record(_entry(650.0, address="127.0.0.1", via="loopback", status=200,
                          action="rescan models", counted=False))  # fmt: skip
    rows = [(r.address, r.action, r.time, r.count) for r in _rows(store)]
    assert rows == [
        ("10.0.0.9", "refused: token_required", 600.0, 3),
        ("10.0.0.9", "refused: token_required", 660.0, 1),
        ("10.0.0.10", "refused: token_required", 640.0, 1),
        ("10.0.0.9", "refused: foreign_origin", 645.0, 1),
        ("127.0.0.1", "rescan models", 650.0, 1),
        ("127.0.0.1", "rescan models", 650.0, 1),
    ]
    store.close()


def test_stored_fields_are_cut_to_their_limits(tmp_path: Path) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    AuditLog(store, Retention()).record(
        _entry(
            1.0,
            method="M" * 5000,
            path="/api/" + "p" * 30_000,
            target="t" * 5000,
            detail={"flags": ["--x"] * 5000, "k" * 999: "v" * 30_000},
            counted=False,
        )
    )
    (row,) = _rows(store)
    assert len(row.method) <= 16 and len(row.path) == MAX_TEXT and len(row.target) == MAX_TEXT
    assert row.path.startswith("/api/ppp") and row.path.endswith("…")
    assert len(json.dumps(row.detail)) < 20 * MAX_TEXT
    store.close()


def test_audit_rows_are_kept_under_a_row_count_and_an_age(tmp_path: Path) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    policy = Retention(audit_max_rows=100, audit_max_age_s=3600.0)
    log = AuditLog(store, policy)
    # requests with control from ever new addresses: no counting merges them
    for i in range(2 * AuditLog.TRIM_EVERY):
        log.record(_entry(float(i), address=f"10.1.{i // 250}.{i % 250}", counted=False))
    rows = _rows(store)
    # the bound holds while requests come, not only when maintenance runs: the newest stay
    assert len(rows) == 100 and rows[-1].time == 2 * AuditLog.TRIM_EVERY - 1
    assert rows[0].time == 2 * AuditLog.TRIM_EVERY - 100
    report = maintain(store, policy, now=3600.0 + 950.0)
    assert report["audit_expired"] == 50
    with store.session() as session:
        assert session.scalar(select(func.min(AuditEvent.time))) == 950.0
    store.close()
