"""Stored telemetry rows (`/api/servers/{id}/samples`) turned into the series the pages chart.

Pure functions over the rows' JSON, so the pages, their JSON alternates and the tests share them.
A stats row is `{"t", "interval_s", "g": gauges, "d": counter increases}`; a picks row carries
`"picks"`, a layer x expert matrix of increases.
"""

from __future__ import annotations

from typing import Any

GAUGES = (
    "decode_tok_s_10s",
    "prefill_tok_s_10s",
    "ttft_mean_s",
    "ttft_p95_s",
    "running",
    "queued",
    "hit_rate_60s",
)
BREAKDOWN_PARTS = ("route", "copy", "gpu_experts", "cpu_experts", "other")
MAX_COLUMNS = 240  # time columns of a heatmap


def gauge_series(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """{"t": [...], gauge: [...]} with None where a row lacks the gauge."""
    out: dict[str, list[Any]] = {"t": [row["t"] for row in rows]}
    for name in GAUGES:
        out[name] = [row.get("g", {}).get(name) for row in rows]
    return out


def miss_rates(
    rows: list[dict[str, Any]], num_layers: int, max_columns: int = MAX_COLUMNS
) -> dict[str, Any]:
    """Per-layer decode miss rate over time: {"t": [...], "z": layer x time}.

    A miss is a read that was not a hit (it was fetched or run on the CPU). Rows without reads
    (idle time) are left out rather than shown as zero misses. With more rows than
    `max_columns`, neighbouring rows are merged (their reads and hits added), so a long window
    stays a chart a browser draws quickly; each column is stamped with its last row's time.
    """
    busy = [row for row in rows if any((row.get("d") or {}).get("reads") or [])]
    per_column = max(1, -(-len(busy) // max_columns))
    times: list[float] = []
    columns: list[list[float | None]] = []
    for start in range(0, len(busy), per_column):
        group = busy[start : start + per_column]
        reads, hits = [0] * num_layers, [0] * num_layers
        for row in group:
            increases = row["d"]
            for layer in range(num_layers):
                reads[layer] += _at(increases.get("reads"), layer)
                hits[layer] += _at(increases.get("hits"), layer)
        times.append(group[-1]["t"])
        columns.append([(r - h) / r if r else None for r, h in zip(reads, hits, strict=True)])
    z = [[column[layer] for column in columns] for layer in range(num_layers)]
    return {"t": times, "z": z}


def _at(values: list[int] | None, index: int) -> int:
    return values[index] if values and index < len(values) else 0


def summed_picks(rows: list[dict[str, Any]]) -> list[list[int]] | None:
    """The pick counts of picks rows added up (layer x expert), or None without rows."""
    total: list[list[int]] | None = None
    for row in rows:
        matrix = row.get("picks")
        if not matrix:
            continue
        if total is None:
            total = [list(r) for r in matrix]
            continue
        for layer, counts in enumerate(matrix):
            if layer >= len(total):
                total.append(list(counts))
                continue
            for expert, n in enumerate(counts):
                if expert < len(total[layer]):
                    total[layer][expert] += n
                else:
                    total[layer].append(n)
    return total


def breakdown_mean(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """The mean of the rows' decode-step breakdowns (seconds per part, and step_s), or None."""
    found = [b for row in rows if (b := row.get("g", {}).get("breakdown"))]
    if not found:
        return None
    keys = (*BREAKDOWN_PARTS, "step_s")
    return {k: sum(b.get(k, 0.0) for b in found) / len(found) for k in keys}


def pick_shares(picks: list[list[int]]) -> list[list[float | None]]:
    """Each layer's picks as shares of that layer's total (None for a layer never picked)."""
    out = []
    for counts in picks:
        total = sum(counts)
        out.append([n / total if total else None for n in counts])
    return out


def top_experts(counts: list[int], n: int) -> list[int]:
    """The ids of the n most-picked experts of one layer (ties by lower id)."""
    order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
    return sorted(order[: max(0, n)])
