"""Stored telemetry rows into chart series: miss rates per layer, summed picks, step breakdown."""

from __future__ import annotations

from moelab.console.series import (
    breakdown_mean,
    gauge_series,
    miss_rates,
    pick_shares,
    summed_picks,
    top_experts,
)


def test_miss_rates_skip_idle_rows_and_layers_without_reads() -> None:
    rows = [
        {"t": 1.0, "g": {}, "d": {"reads": [10, 4], "hits": [9, 1]}},
        {"t": 2.0, "g": {"running": 0}},  # idle: no increases
        {"t": 3.0, "g": {}, "d": {"reads": [0, 8], "hits": [0, 8]}},
    ]
    series = miss_rates(rows, num_layers=2)
    assert series["t"] == [1.0, 3.0]
    assert series["z"][0][0] == 0.1 and series["z"][0][1] is None
    assert series["z"][1] == [0.75, 0.0]


def test_a_long_window_is_merged_into_at_most_max_columns_weighted_by_reads() -> None:
    rows = [{"t": float(i), "d": {"reads": [10, 0], "hits": [10 - i % 2 * 10, 0]}}
            for i in range(10)]  # fmt: skip
    series = miss_rates(rows, num_layers=2, max_columns=4)
    assert series["t"] == [2.0, 5.0, 8.0, 9.0]  # columns of 3, 3, 3 and 1 rows
    assert series["z"][0] == [10 / 30, 20 / 30, 10 / 30, 1.0]
    assert series["z"][1] == [None, None, None, None]


def test_picks_rows_add_up_and_become_shares_per_layer() -> None:
    rows = [
        {"t": 1.0, "picks": [[1, 2, 0], [0, 0, 0]]},
        {"t": 2.0, "picks": [[3, 0, 1], [1, 1, 2]]},
    ]
    total = summed_picks(rows)
    assert total == [[4, 2, 1], [1, 1, 2]]
    assert pick_shares([[4, 2, 2], [0, 0, 0]]) == [[0.5, 0.25, 0.25], [None, None, None]]
    assert summed_picks([]) is None
    assert top_experts([4, 9, 1, 9], 2) == [1, 3]
    assert top_experts([4, 9, 1, 9], 0) == []


def test_gauges_and_breakdown_mean() -> None:
    rows = [
        {"t": 1.0, "g": {"decode_tok_s_10s": 5.0, "breakdown": {"copy": 0.002, "step_s": 0.004}}},
        {"t": 2.0, "g": {"breakdown": {"copy": 0.004, "step_s": 0.006}}},
    ]
    series = gauge_series(rows)
    assert series["t"] == [1.0, 2.0] and series["decode_tok_s_10s"] == [5.0, None]
    mean = breakdown_mean(rows)
    assert mean is not None
    assert abs(mean["copy"] - 0.003) < 1e-12 and abs(mean["step_s"] - 0.005) < 1e-12
    assert mean["cpu_experts"] == 0.0
    assert breakdown_mean([{"t": 1.0, "g": {}}]) is None
