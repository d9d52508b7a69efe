"""The advice rules on a recorded stats body of the demo engine, changed one number at a time."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from moelab.console.advice import advise, device_unplanned_bytes, whatif_hit_rate

from .conftest import recorded_stats

GIB = 1024**3


@pytest.fixture
def stats() -> dict[str, Any]:
    """The demo engine's body: 24 of 48 slots, hit rate 81%, 1.4 GiB of its 2 GiB budget unplanned,
    CPU experts barely used, 8192 KV tokens reserved of which 80 were ever in use."""
    return copy.deepcopy(recorded_stats()[1])


def ids(stats: dict[str, Any], cores: int | None = 8) -> list[str]:
    return [claim.id for claim in advise(stats, cores)]


def claim(stats: dict[str, Any], claim_id: str, cores: int | None = 8) -> dict[str, Any]:
    found = [c for c in advise(stats, cores) if c.id == claim_id]
    assert found, f"no {claim_id} claim in {ids(stats, cores)}"
    return {k: v.value for k, v in found[0].values.items()}


def step(stats: dict[str, Any], **parts_s: float) -> None:
    """Give the body a decode step made of these parts (seconds), the rest zero."""
    breakdown = {p: 0.0 for p in ("route", "copy", "gpu_experts", "cpu_experts", "other")}
    breakdown.update(parts_s)
    breakdown["step_s"] = sum(breakdown.values())
    stats["breakdown"] = breakdown


def fill_device(stats: dict[str, Any], free_bytes: int) -> None:
    """Use up the device so that only `free_bytes` beyond the plan's headroom are left."""
    device = stats["memory"]["device"][0]
    headroom = stats["memory"]["plan"]["headroom_bytes"]
    used = sum(v for k, v in device.items() if k not in ("index", "total", "other"))
    device["other"] = device["total"] - used - headroom - free_bytes


def test_the_recorded_engine_has_idle_memory_but_misses_cost_little(
    stats: dict[str, Any],
) -> None:
    assert device_unplanned_bytes(stats) == 2 * GIB - 91_159_296 - 512 * 1024**2
    values = claim(stats, "free_memory")
    assert values["extra"] == 24 and values["new_slots"] == 48  # every expert fits
    assert values["now"] == pytest.approx(0.8074, abs=1e-4)
    assert values["predicted"] > 0.99
    assert values["share"] < 0.01
    assert ids(stats) == ["free_memory"]  # free memory: no reason to shrink the KV reserve


def test_misses_that_dominate_with_free_memory_ask_for_more_slots(stats: dict[str, Any]) -> None:
    step(stats, copy=0.004, cpu_experts=0.003, other=0.003)
    stats["experts"]["hit_rate_60s"] = 0.6
    fill_device(stats, 10 * 24576 + 100)
    values = claim(stats, "more_slots")
    assert values["extra"] == 10 and values["new_slots"] == 34
    assert values["predicted"] == pytest.approx(whatif_hit_rate(stats["experts"]["whatif"], 34))


def test_the_engines_miss_fit_outweighs_the_one_timed_step(stats: dict[str, Any]) -> None:
    """The timed step runs copies and CPU work one after the other; the fit prices misses as
    the untimed steps paid them, so the share it gives decides."""
    stats["experts"]["hit_rate_60s"] = 0.6
    fill_device(stats, 10 * 24576 + 100)
    step(stats, copy=0.004, cpu_experts=0.003, other=0.003)  # the timed step: misses 70%
    fit = {"steps": 5000, "us_per_miss": 30.0, "stderr_us": 3.0, "misses_per_step": 4.0,
           "step_us": 2000.0}  # fmt: skip
    stats["experts"]["miss_cost"] = fit  # 4 misses x 30 µs of a 2 ms step: 6%
    assert "free_memory" in ids(stats) and "more_slots" not in ids(stats)
    found = next(c for c in advise(stats, 8) if c.id == "free_memory")
    assert found.values["share"].value == pytest.approx(0.06)
    assert found.evidence[1].label == "misses, share of a decode step (fitted over its steps)"
    stats["experts"]["miss_cost"] = {**fit, "us_per_miss": 300.0}  # 60%
    step(stats, copy=0.0001, other=0.01)  # the timed step: misses 1%
    assert ids(stats) == ["more_slots"]
    # a fit the engine could not make (or an older engine's body): the timed step decides
    stats["experts"]["miss_cost"] = {**fit, "us_per_miss": None}
    assert ids(stats) == ["free_memory"]
    assert claim(stats, "free_memory")["share"] == pytest.approx(0.0001 / 0.0101)


def test_no_room_for_a_slot_means_no_slot_advice_but_the_kv_reserve_is_looked_at(
    stats: dict[str, Any],
) -> None:
    step(stats, copy=0.004, cpu_experts=0.003, other=0.003)
    fill_device(stats, 1000)
    assert "more_slots" not in ids(stats) and "free_memory" not in ids(stats)
    values = claim(stats, "kv_oversized")
    assert values["reserved"] == 8192 and values["peak"] == 80
    assert values["suggested"] == 1024  # twice the peak, rounded up to 1024
    assert values["freed"] == (8192 - 1024) * 512
    assert values["extra"] == 24  # capped at the experts without a slot


def test_a_kv_reserve_in_use_or_too_few_requests_gets_no_kv_advice(stats: dict[str, Any]) -> None:
    fill_device(stats, 0)
    stats["kv"]["tokens_peak"] = 5000
    assert "kv_oversized" not in ids(stats)
    stats["kv"]["tokens_peak"] = 80
    stats["requests"]["completed"] = 2
    assert "kv_oversized" not in ids(stats)


def test_cpu_bound_steps_ask_for_threads_while_cores_are_idle(stats: dict[str, Any]) -> None:
    step(stats, cpu_experts=0.006, other=0.004)
    stats["config"]["cpu_threads"] = 2
    assert claim(stats, "more_threads", cores=8)["suggested"] == 7
    stats["config"]["cpu_threads"] = 7
    assert "more_threads" not in ids(stats, cores=8)
    assert claim(stats, "fewer_cpu_misses", cores=8)["fetch"] == pytest.approx(0.4298, abs=1e-3)


def test_copy_bound_steps_are_named(stats: dict[str, Any]) -> None:
    step(stats, copy=0.005, other=0.002)
    assert claim(stats, "copy_bound")["share"] == pytest.approx(5 / 7)


def test_a_cache_that_already_hits_is_left_alone(stats: dict[str, Any]) -> None:
    fill_device(stats, 0)
    stats["experts"]["hit_rate_60s"] = 0.97
    values = claim(stats, "cache_enough")
    assert values["at_double"] == pytest.approx(whatif_hit_rate(stats["experts"]["whatif"], 48))


def test_every_expert_resident_and_no_traffic_and_no_stats(stats: dict[str, Any]) -> None:
    all_in = copy.deepcopy(stats)
    all_in["experts"]["slots"] = 48
    assert ids(all_in) == ["all_resident"]
    idle = copy.deepcopy(stats)
    idle["experts"]["hit_rate_60s"] = None
    assert ids(idle)[0] == "no_traffic"
    assert "free_memory" not in ids(idle)
    stats["experts"] = None
    assert ids(stats) == ["no_stats"]


def test_whatif_is_interpolated_between_points() -> None:
    curve = [{"slots": 10, "hit_rate": 0.5}, {"slots": 20, "hit_rate": 0.7}]
    assert whatif_hit_rate(curve, 15) == pytest.approx(0.6)
    assert whatif_hit_rate(curve, 5) == 0.5
    assert whatif_hit_rate(curve, 40) == 0.7
    assert whatif_hit_rate([], 10) is None
