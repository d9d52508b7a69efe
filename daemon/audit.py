"""The audit table's writer: every state-changing request and every refusal, in bounded space.

Anyone who can reach the port can send refused requests as fast as the network carries them, so
what such requests leave behind is bounded three ways:

- a refusal, or any request from a caller without control (login, logout), is counted in one row
  per client address, action, status and minute instead of a row each;
- every stored text is cut to a fixed length (a path, a method, the handler's details);
- the table keeps at most `Retention.audit_max_rows` rows, the oldest going first (checked every
  `TRIM_EVERY` writes, not only at the sampler's maintenance), and none older than
  `Retention.audit_max_age_s` (retention.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.sqlite import insert

from .retention import Retention, expire_audit
from .schema import AuditEvent
from .store import Store, iso_time

MAX_TEXT = 200  # a path, an action, a target, a string in the details
MAX_ADDRESS = 64  # an IPv6 address with a zone fits
MAX_METHOD = 16
MAX_ITEMS = 50  # items of a list, keys of a mapping in the details
ELLIPSIS = "…"


def cut(text: str, limit: int = MAX_TEXT) -> str:
    """`text`, or its first characters and an ellipsis when it is longer than `limit`."""
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def cut_detail(value: Any) -> Any:
    """A handler's details with each string cut and each list and mapping shortened."""
    if isinstance(value, str):
        return cut(value)
    if isinstance(value, list | tuple):
        return [cut_detail(v) for v in value[:MAX_ITEMS]]
    if isinstance(value, dict):
        return {cut(str(k)): cut_detail(v) for k, v in list(value.items())[:MAX_ITEMS]}
    return value


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One request to write down; `counted` ones are merged per address, action and minute."""

    time: float
    address: str
    via: str
    method: str
    path: str
    status: int
    action: str
    target: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    counted: bool = False


def audit_json(row: AuditEvent) -> dict[str, Any]:
    """An audit row as the API shows it."""
    return {
        "id": row.id,
        "time": iso_time(row.time),
        "address": row.address,
        "via": row.via,
        "method": row.method,
        "path": row.path,
        "status": row.status,
        "action": row.action,
        "target": row.target,
        "detail": row.detail,
        "count": row.count,
    }


class AuditLog:
    """Writes audit entries; keeps the table within the retention's age and row count."""

    TRIM_EVERY = 500

    def __init__(self, store: Store, retention: Retention) -> None:
        self.store = store
        self.retention = retention
        self._writes = 0
        self._lock = threading.Lock()

    def record(self, entry: AuditEntry) -> None:
        values = {
            "time": entry.time,
            "address": cut(entry.address, MAX_ADDRESS),
            "via": entry.via,
            "method": cut(entry.method, MAX_METHOD),
            "path": cut(entry.path),
            "status": entry.status,
            "action": cut(entry.action),
            "target": cut(entry.target) if entry.target is not None else None,
            "detail": cut_detail(entry.detail),
        }
        with self.store.session() as session:
            if entry.counted:
                statement = insert(AuditEvent).values(
                    **values, count=1, minute=int(entry.time // 60)
                )
                session.execute(
                    statement.on_conflict_do_update(
                        index_elements=["minute", "address", "action", "status"],
                        set_={"count": AuditEvent.count + 1},
                    )
                )
            else:
                session.add(AuditEvent(**values))
        with self._lock:
            self._writes += 1
            trim = self._writes >= self.TRIM_EVERY
            if trim:
                self._writes = 0
        if trim:
            expire_audit(self.store, self.retention, entry.time)

    def recent(self, limit: int) -> list[AuditEvent]:
        """The newest `limit` rows, newest first."""
        with self.store.session() as session:
            query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
            return list(session.scalars(query))
