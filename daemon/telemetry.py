"""Engine telemetry kept compactly: each /v1/stats body as gauges plus counter increases.

Every body the sampler reads becomes at most one "stats" row: the gauges (tok/s, requests, memory,
KV, hit rate, time breakdown) and the increase of each counter (per-layer reads, hits, fills,
CPU-run misses; completed requests) since the previous row. An idle engine writes one row a
minute. The per-(layer, expert) pick counts are large, so they go into "picks" rows at a coarser
interval. retention.py merges old rows and bounds the total.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from .schema import TelemetrySample
from .store import Store

STATS = "stats"
PICKS = "picks"
LAYER_COUNTERS = ("reads", "hits", "fills", "cpu")


def _number(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def gauges(stats: dict[str, Any]) -> dict[str, Any]:
    """The instantaneous values of a /v1/stats body (absent ones are left out)."""
    throughput = stats.get("throughput") or {}
    requests = stats.get("requests") or {}
    memory = stats.get("memory") or {}
    kv = stats.get("kv") or {}
    experts = stats.get("experts") or {}
    out: dict[str, Any] = {
        "uptime_s": _number(stats.get("uptime_s")),
        "decode_tok_s_10s": _number(throughput.get("decode_tok_s_10s")),
        "prefill_tok_s_10s": _number(throughput.get("prefill_tok_s_10s")),
        "decode_tok_s_60s": _number(throughput.get("decode_tok_s_60s")),
        "prefill_tok_s_60s": _number(throughput.get("prefill_tok_s_60s")),
        "running": _number(requests.get("running")),
        "queued": _number(requests.get("queued")),
        "ttft_mean_s": _number(requests.get("ttft_mean_s")),
        "ttft_p95_s": _number(requests.get("ttft_p95_s")),
        "hit_rate_60s": _number(experts.get("hit_rate_60s")),
        "slots": _number(experts.get("slots")),
        "kv_tokens_used": _number(kv.get("tokens_used")),
        "kv_tokens_total": _number(kv.get("tokens_total")),
        "kv_tokens_peak": _number(kv.get("tokens_peak")),
        "max_context": _number(kv.get("max_context")),
        "host_rss": _number(memory.get("host_rss")),
        "expert_bank": _number(memory.get("expert_bank")),
    }
    out = {k: v for k, v in out.items() if v is not None}
    if isinstance(memory.get("device"), list):
        out["device"] = [d for d in memory["device"] if isinstance(d, dict)]
    layers = experts.get("layers")
    if isinstance(layers, list):
        out["resident"] = [int(_number(layer.get("resident")) or 0) for layer in layers]
    breakdown = stats.get("breakdown")
    if isinstance(breakdown, dict):
        out["breakdown"] = {k: v for k, v in breakdown.items() if _number(v) is not None}
    return out


def counters(stats: dict[str, Any]) -> dict[str, Any]:
    """The cumulative counters of a stats body: completed requests and per-layer decode counts."""
    layers = (stats.get("experts") or {}).get("layers") or []
    out: dict[str, Any] = {
        "completed": int(_number((stats.get("requests") or {}).get("completed")) or 0)
    }
    for name in LAYER_COUNTERS:
        out[name] = [int(_number(layer.get(name)) or 0) for layer in layers]
    return out


def picks(stats: dict[str, Any]) -> list[list[int]] | None:
    matrix = (stats.get("experts") or {}).get("picks")
    if not isinstance(matrix, list) or not all(isinstance(row, list) for row in matrix):
        return None
    return [[int(v) for v in row] for row in matrix]


def _minus(now: Any, before: Any) -> Any:
    """now - before for numbers, and elementwise for dicts and (nested) lists; missing is zero."""
    if isinstance(now, dict):
        before = before if isinstance(before, dict) else {}
        return {k: _minus(v, before.get(k)) for k, v in now.items()}
    if isinstance(now, list):
        before = before if isinstance(before, list) else []
        return [_minus(v, before[i] if i < len(before) else None) for i, v in enumerate(now)]
    return now - (before or 0)


def plus(a: Any, b: Any) -> Any:
    """a + b for numbers, and elementwise for dicts and (nested) lists; missing is zero."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a or {}, b or {}
        return {k: plus(a.get(k), b.get(k)) for k in {**a, **b}}
    if isinstance(a, list) or isinstance(b, list):
        a, b = a or [], b or []
        n = max(len(a), len(b))
        return [plus(a[i] if i < len(a) else None, b[i] if i < len(b) else None) for i in range(n)]
    return (a or 0) + (b or 0)


def any_nonzero(value: Any) -> bool:
    if isinstance(value, dict):
        return any(any_nonzero(v) for v in value.values())
    if isinstance(value, list):
        return any(any_nonzero(v) for v in value)
    return bool(value)


def _decreased(now: Any, before: Any) -> bool:
    if isinstance(now, dict):
        return any(_decreased(now[k], before.get(k)) for k in now)
    if isinstance(now, list):
        before = before or []
        return any(_decreased(v, before[i]) for i, v in enumerate(now) if i < len(before))
    return before is not None and now < before


@dataclass(slots=True)
class SampleRow:
    """A row about to be stored: kind, end time, the time it covers, and its payload."""

    kind: str
    time: float
    interval_s: float
    resolution_s: float
    payload: dict[str, Any]


@dataclass(slots=True)
class Compactor:
    """Turns the successive stats bodies of one engine process into compact rows.

    `fresh`: the engine was started by this daemon, so its counters started at zero and the
    first body's counters are all new. An adopted engine's first body only sets the baseline
    (its earlier counts were stored by the previous daemon, or are lost with it).
    """

    fresh: bool
    resolution_s: float = 2.0
    picks_every_s: float = 60.0
    heartbeat_s: float = 60.0
    _prev: dict[str, Any] | None = None
    _prev_uptime_s: float = -1.0
    _last_written: float | None = None
    _last_active: bool = False
    _picks_base: list[list[int]] | None = None
    _picks_time: float | None = None

    def ingest(self, stats: dict[str, Any], now: float) -> list[SampleRow]:
        rows = []
        uptime_s = _number(stats.get("uptime_s")) or 0.0
        current = counters(stats)
        restarted = self._prev is not None and (
            uptime_s < self._prev_uptime_s or _decreased(current, self._prev)
        )
        if self._prev is None and not self.fresh:
            delta = _minus(current, current)
        elif self._prev is None or restarted:
            delta = current
        else:
            delta = _minus(current, self._prev)
        self._prev, self._prev_uptime_s = current, uptime_s
        g = gauges(stats)
        active = any_nonzero(delta) or any(
            g.get(k) for k in ("running", "queued", "decode_tok_s_10s", "prefill_tok_s_10s")
        )
        due = self._last_written is None or now - self._last_written >= self.heartbeat_s
        if active or self._last_active or due:
            if self._last_written is None:
                interval = uptime_s if self.fresh and uptime_s > 0 else self.resolution_s
            else:
                interval = now - self._last_written
            payload: dict[str, Any] = {"g": g}
            if any_nonzero(delta):
                payload["d"] = {k: v for k, v in delta.items() if any_nonzero(v)}
            rows.append(SampleRow(STATS, now, interval, self.resolution_s, payload))
            self._last_written = now
        self._last_active = active
        rows += self._ingest_picks(stats, now, restarted)
        return rows

    def _ingest_picks(self, stats: dict[str, Any], now: float, restarted: bool) -> list[SampleRow]:
        matrix = picks(stats)
        if matrix is None:
            return []
        if self._picks_base is None and not self.fresh:
            self._picks_base, self._picks_time = matrix, now  # adopted: a baseline only
            return []
        if self._picks_base is None or restarted:
            self._picks_base = _minus(matrix, matrix)
            self._picks_time = now - (_number(stats.get("uptime_s")) or 0.0)
        assert self._picks_time is not None
        if now - self._picks_time < self.picks_every_s:
            return []
        delta = _minus(matrix, self._picks_base)
        interval_s = now - self._picks_time
        self._picks_base, self._picks_time = matrix, now
        if not any_nonzero(delta):
            return []
        return [SampleRow(PICKS, now, interval_s, self.picks_every_s, {"picks": delta})]


def encode(payload: dict[str, Any]) -> bytes:
    return zlib.compress(json.dumps(payload, separators=(",", ":")).encode(), 6)


def decode(blob: bytes) -> dict[str, Any]:
    return json.loads(zlib.decompress(blob))


def write_rows(store: Store, server_id: int, rows: Iterable[SampleRow]) -> int:
    """Store rows for a server; returns the payload bytes written."""
    written = 0
    with store.session() as session:
        for row in rows:
            blob = encode(row.payload)
            written += len(blob)
            session.add(
                TelemetrySample(
                    server_id=server_id,
                    kind=row.kind,
                    resolution_s=row.resolution_s,
                    time=row.time,
                    interval_s=row.interval_s,
                    payload=blob,
                    size_bytes=len(blob),
                )
            )
    return written


def read_samples(
    store: Store,
    server_id: int,
    kind: str = STATS,
    since: float | None = None,
    until: float | None = None,
    limit: int = 5000,
) -> list[dict[str, Any]]:
    """Decoded rows of one server, oldest first: {"t", "interval_s", "resolution_s", ...payload}."""
    query = select(TelemetrySample).where(
        TelemetrySample.server_id == server_id, TelemetrySample.kind == kind
    )
    if since is not None:
        query = query.where(TelemetrySample.time > since)
    if until is not None:
        query = query.where(TelemetrySample.time <= until)
    query = query.order_by(TelemetrySample.time.desc()).limit(limit)
    with store.session() as session:
        rows = list(session.scalars(query))
    return [
        {
            "t": r.time,
            "interval_s": r.interval_s,
            "resolution_s": r.resolution_s,
            **decode(r.payload),
        }
        for r in reversed(rows)
    ]
