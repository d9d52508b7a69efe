"""The noise rule: a change counts above max(3%, 2 x spread) and may not cost other figures."""

from __future__ import annotations

import pytest

from moelab.autotune.noise import Figures, NoiseRule, Objective, Spreads, spread
from moelab.autotune.trial_record import TrialResult


def run(prefill: float, decode: float, aggregate: float | None = None) -> TrialResult:
    return TrialResult(True, 0.0, 1.0, prefill_tok_s=prefill, decode_tok_s=decode,
                       aggregate_tok_s=aggregate)  # fmt: skip


def test_spread_is_the_relative_standard_deviation() -> None:
    assert spread([100.0]) == 0.0
    assert spread([100.0, 100.0, 100.0]) == 0.0
    assert spread([90.0, 110.0]) == pytest.approx(0.1414, abs=1e-3)
    # one of three runs far off widens it: a noisy machine is not read as a quiet one
    assert spread([100.0, 101.0, 60.0]) > 0.2


def test_the_threshold_is_the_larger_of_the_floor_and_twice_the_spread() -> None:
    rule = NoiseRule()
    assert rule.threshold(Spreads(0.01, {})) == pytest.approx(0.03)
    assert rule.threshold(Spreads(0.05, {})) == pytest.approx(0.10)
    decode = Objective("decode")
    base = Figures(1000.0, 100.0)
    quiet, noisy = Spreads(0.01, {}), Spreads(0.05, {})
    assert rule.judge(decode, Figures(1000.0, 104.0), base, quiet).beats
    assert not rule.judge(decode, Figures(1000.0, 104.0), base, noisy).beats
    judged = rule.judge(decode, Figures(1000.0, 108.0), base, noisy)
    assert not judged.beats and "within the noise (+8.0%" in str(judged.reason)


def test_a_verdict_says_faster_slower_or_within_the_noise() -> None:
    rule, decode, base = NoiseRule(), Objective("decode"), Figures(1000.0, 100.0)
    spreads = Spreads(0.01, {})
    loss = rule.judge(decode, Figures(1000.0, 74.8), base, spreads)
    assert str(loss.reason) == "decode tok/s 74.8 against 100.0: slower by 25.2%"
    win = rule.judge(decode, Figures(1000.0, 112.0), base, spreads)
    assert win.beats and str(win.reason) == (
        "decode tok/s 112.0 against 100.0: faster by 12.0%, more than the 3.0% noise threshold"
    )
    for within in (101.0, 98.0):  # a small gain and a small loss alike
        judged = rule.judge(decode, Figures(1000.0, within), base, spreads)
        assert not judged.beats and ": within the noise (" in str(judged.reason)
        assert "faster" not in str(judged.reason) and "slower" not in str(judged.reason)


def test_a_gain_that_costs_another_figure_too_much_is_refused() -> None:
    rule = NoiseRule(side_tolerance=0.05)
    spreads = Spreads(0.01, {"prefill": 0.01, "decode": 0.01})
    judged = rule.judge(Objective("decode"), Figures(900.0, 120.0), Figures(1000.0, 100.0), spreads)
    assert not judged.beats and str(judged.reason).endswith(
        "faster by 20.0%, but prefill is slower by 10.0% (900.0 against 1,000.0 tok/s; at most "
        "5.0% is allowed)"
    )
    # within its own measured noise a loss is not a loss
    noisy_prefill = Spreads(0.01, {"prefill": 0.06})
    assert rule.judge(Objective("decode"), Figures(900.0, 120.0), Figures(1000.0, 100.0),
                      noisy_prefill).beats  # fmt: skip
    looser = NoiseRule(side_tolerance=0.15)
    assert looser.judge(Objective("decode"), Figures(900.0, 120.0), Figures(1000.0, 100.0),
                        spreads).beats  # fmt: skip


def test_objectives() -> None:
    both = Objective("both")
    assert both.score(Figures(400.0, 25.0)) == pytest.approx(100.0)
    assert both.side_figures == ()
    assert Objective("aggregate", 8).side_figures == ("prefill", "decode")
    assert Objective("aggregate", 8).score(Figures(1.0, 2.0, 30.0)) == 30.0
    with pytest.raises(ValueError, match="at least 2"):
        Objective("aggregate", 1)
    with pytest.raises(ValueError, match="one of"):
        Objective("latency")
    assert Figures.median([run(1, 10), run(3, 30), run(2, 99)]) == Figures(2, 30, None)
    # an agent session: its own figure, judged with prefill and decode beside it
    agent = Objective("agent")
    assert agent.agent and not both.agent
    assert agent.score(Figures(1.0, 2.0, None, 40.0)) == 40.0
    assert agent.side_figures == ("prefill", "decode")
    assert str(agent.label) == "agent session tok/s"


def test_speed_holds_within_the_tolerance_only() -> None:
    rule = NoiseRule(side_tolerance=0.05)
    spreads = Spreads(0.0, {})
    base = Figures(1000.0, 100.0)
    assert rule.holds(Objective("decode"), Figures(980.0, 97.0), base, spreads).beats
    held = rule.holds(Objective("decode"), Figures(1000.0, 90.0), base, spreads)
    assert not held.beats and "decode is slower by 10.0%" in str(held.reason)
