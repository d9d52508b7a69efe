"""Retention: telemetry's old rows merged into coarser ones, old rows deleted, a size cap; the audit
table's old rows deleted and its row count capped.

Merging sums counter increases and combines gauges by kind: tok/s, TTFT and hit rate averaged over
time, running and queued requests and peaks maxed, everything else the newest value.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select

from .schema import AuditEvent, TelemetrySample
from .store import Store
from .telemetry import PICKS, STATS, any_nonzero, decode, encode, plus

# how gauges combine when rows are merged: interval-weighted mean, maximum, or the newest value
MEAN_GAUGES = (
    "decode_tok_s_10s",
    "prefill_tok_s_10s",
    "decode_tok_s_60s",
    "prefill_tok_s_60s",
    "ttft_mean_s",
    "hit_rate_60s",
)
MAX_GAUGES = ("running", "queued", "ttft_p95_s", "kv_tokens_peak")
ROW_OVERHEAD_BYTES = 64  # a row's columns and index entries besides the payload, for the size cap


def merge(kind: str, rows: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """One payload for consecutive rows (interval_s, payload), oldest first."""
    if kind == PICKS:
        total: Any = None
        for _interval, payload in rows:
            total = plus(total, payload["picks"])
        return {"picks": total}
    deltas: dict[str, Any] = {}
    for _interval, payload in rows:
        for key, value in (payload.get("d") or {}).items():
            deltas[key] = plus(deltas.get(key), value)
    merged_g = dict(rows[-1][1].get("g") or {})
    weights = [max(interval, 1e-9) for interval, _ in rows]
    for key in MEAN_GAUGES:
        pairs = [
            (w, p["g"][key])
            for w, (_, p) in zip(weights, rows, strict=True)
            if key in p.get("g", {})
        ]
        if pairs:
            merged_g[key] = sum(w * v for w, v in pairs) / sum(w for w, _ in pairs)
    for key in MAX_GAUGES:
        values = [p["g"][key] for _, p in rows if key in p.get("g", {})]
        if values:
            merged_g[key] = max(values)
    breakdowns = [
        (w, p["g"]["breakdown"])
        for w, (_, p) in zip(weights, rows, strict=True)
        if "breakdown" in p.get("g", {})
    ]
    if breakdowns:
        keys = {k for _, b in breakdowns for k in b}
        merged_g["breakdown"] = {
            k: sum(w * b.get(k, 0.0) for w, b in breakdowns) / sum(w for w, _ in breakdowns)
            for k in keys
        }
    out: dict[str, Any] = {"g": merged_g}
    if any_nonzero(deltas):
        out["d"] = deltas
    return out


@dataclass(frozen=True, slots=True)
class Retention:
    """How long telemetry stays at which resolution, how much of it may exist at all, and how
    long and how many audit rows are kept."""

    fine_keep_s: float = 24 * 3600.0  # 2-s stats and 60-s picks are kept this long...
    stats_rollup_s: float = 60.0  # ...then stats are merged into rows of this length
    picks_rollup_s: float = 3600.0  # ...and picks into rows of this length
    max_age_s: float = 30 * 24 * 3600.0
    max_bytes: int = 256 * 1024**2
    audit_max_age_s: float = 90 * 24 * 3600.0
    audit_max_rows: int = 50_000

    def __post_init__(self) -> None:
        assert self.fine_keep_s > 0 and self.max_age_s >= self.fine_keep_s and self.max_bytes > 0
        assert self.audit_max_age_s > 0 and self.audit_max_rows > 0


def rollup(store: Store, kind: str, bucket_s: float, older_than: float, batch: int = 20_000) -> int:
    """Merge rows of `kind` finer than `bucket_s` and older than `older_than` into one per bucket.

    Only whole buckets are merged (the cutoff is rounded down to a bucket boundary), so a bucket
    never ends up split across two merged rows. Returns the number of rows removed.
    """
    cutoff = math.floor(older_than / bucket_s) * bucket_s
    removed = 0
    while True:
        with store.session() as session:
            rows = list(
                session.scalars(
                    select(TelemetrySample)
                    .where(
                        TelemetrySample.kind == kind,
                        TelemetrySample.resolution_s < bucket_s,
                        TelemetrySample.time < cutoff,
                    )
                    .order_by(TelemetrySample.server_id, TelemetrySample.time)
                    .limit(batch)
                )
            )
            if not rows:
                return removed
            groups: dict[tuple[int, int], list[TelemetrySample]] = {}
            for row in rows:
                groups.setdefault((row.server_id, math.floor(row.time / bucket_s)), []).append(row)
            if len(rows) == batch:
                # the last bucket may continue beyond this batch: leave it for the next round
                last = (rows[-1].server_id, math.floor(rows[-1].time / bucket_s))
                if len(groups) > 1:
                    groups.pop(last)
            for (server_id, _bucket), members in groups.items():
                payload = merge(kind, [(m.interval_s, decode(m.payload)) for m in members])
                blob = encode(payload)
                session.add(
                    TelemetrySample(
                        server_id=server_id,
                        kind=kind,
                        resolution_s=bucket_s,
                        time=members[-1].time,
                        interval_s=sum(m.interval_s for m in members),
                        payload=blob,
                        size_bytes=len(blob),
                    )
                )
                for member in members:
                    session.delete(member)
                removed += len(members) - 1


def total_bytes(store: Store) -> int:
    """The telemetry's size as the cap counts it: payloads plus a fixed per-row overhead."""
    with store.session() as session:
        count, payload = session.execute(
            select(
                func.count(TelemetrySample.id),
                func.coalesce(func.sum(TelemetrySample.size_bytes), 0),
            )
        ).one()
    return int(payload) + int(count) * ROW_OVERHEAD_BYTES


def maintain(store: Store, policy: Retention, now: float | None = None) -> dict[str, int]:
    """Roll up, expire by age, enforce the size cap; returns how many rows each step removed."""
    now = time.time() if now is None else now
    report = {
        "rolled_stats": rollup(store, STATS, policy.stats_rollup_s, now - policy.fine_keep_s),
        "rolled_picks": rollup(store, PICKS, policy.picks_rollup_s, now - policy.fine_keep_s),
    }
    with store.session() as session:
        result = session.execute(
            delete(TelemetrySample).where(TelemetrySample.time < now - policy.max_age_s)
        )
        report["expired"] = result.rowcount or 0
    report["over_cap"] = _enforce_cap(store, policy.max_bytes)
    report["audit_expired"] = expire_audit(store, policy, now)
    if any(report.values()):
        store.reclaim_space()
    return report


def expire_audit(store: Store, policy: Retention, now: float | None = None) -> int:
    """Delete audit rows older than the policy's age, then the oldest beyond its row count;
    returns how many went."""
    now = time.time() if now is None else now
    with store.session() as session:
        expired = session.execute(
            delete(AuditEvent).where(AuditEvent.time < now - policy.audit_max_age_s)
        ).rowcount
        # ids grow with time: the newest rows are the highest ids
        newest_kept = select(AuditEvent.id).order_by(AuditEvent.id.desc())
        boundary = session.scalar(newest_kept.offset(policy.audit_max_rows - 1).limit(1))
        over = 0
        if boundary is not None:
            over = session.execute(delete(AuditEvent).where(AuditEvent.id < boundary)).rowcount
    return (expired or 0) + (over or 0)


def _enforce_cap(store: Store, max_bytes: int) -> int:
    excess = total_bytes(store) - max_bytes
    if excess <= 0:
        return 0
    removed = 0
    with store.session() as session:
        doomed: list[int] = []
        freed = 0
        query = select(TelemetrySample.id, TelemetrySample.size_bytes).order_by(
            TelemetrySample.time
        )
        for sample_id, size in session.execute(query):
            doomed.append(sample_id)
            freed += size + ROW_OVERHEAD_BYTES
            if freed >= excess:
                break
        for start in range(0, len(doomed), 900):
            chunk = doomed[start : start + 900]
            session.execute(delete(TelemetrySample).where(TelemetrySample.id.in_(chunk)))
            removed += len(chunk)
    return removed
