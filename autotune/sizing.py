"""A run's workload sized to a duration: measured once, by the calibration trial, then fixed.

A mode's workload (modes.py) is the least a trial sends, and how long it lasts depends on the
machine: a few seconds on a 2-core CPU with the demo model, about one on an H200. The first trial
of a run sends that minimum and records how long each part took; from those times the run's
workload is scaled so its measured part lasts about the mode's target, and every later trial
sends exactly that spec. The sizing is a function of the calibration trial's readings alone, so a
resumed run that replays the stored trial gets the same spec back.

How each part grows (each keeps its share of the minimum's time; none shrinks below the minimum):
- prefill: more requests of the same long prompt (its length stays the mode's: the plan judges
  prefill chunks against it);
- decode: longer generations first, up to MAX_GENERATION_TOKENS and never longer than the long
  prompt (so no request needs more context than the minimum workload did), then more of them;
- aggregate: more rounds of the same concurrent streams.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .trial import TrialResult
from .workload import WorkloadSpec, chars_for_tokens

MAX_GENERATION_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Sizing:
    """The workload a run settled on at its calibration trial, and the times behind it."""

    spec: WorkloadSpec
    target_s: float
    measured_s: float | None = None  # the calibration trial's workload (the mode's minimum)
    expected_s: float | None = None  # the sized workload at the calibration's measured speeds
    failure: str | None = None  # why the calibration trial measured nothing

    @property
    def reason(self) -> str:
        """The calibration trial's verdict in words."""
        if self.failure is not None:
            return (
                f"calibration failed ({self.failure}): every trial runs the mode's minimum workload"
            )
        assert self.measured_s is not None and self.expected_s is not None
        if self.measured_s >= self.target_s:
            return (
                f"calibration: the mode's minimum workload took {self.measured_s:.1f} s, not "
                f"less than the {self.target_s:.0f} s target: kept as it is ({describe(self.spec)})"
            )
        return (
            f"calibration: workload sized to {self.expected_s:.1f} s (target "
            f"{self.target_s:.0f} s; the mode's minimum took {self.measured_s:.1f} s): "
            f"{describe(self.spec)}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_json(),
            "target_s": self.target_s,
            "measured_s": self.measured_s,
            "expected_s": self.expected_s,
            "failure": self.failure,
            "reason": self.reason,
        }


def describe(spec: WorkloadSpec) -> str:
    """A spec in a line: how many requests of how many tokens each part sends."""
    parts = [
        f"prefill {spec.prefill_requests} x {spec.prefill_tokens} tokens",
        f"decode {spec.decode_requests} x {spec.decode_tokens} tokens",
    ]
    if spec.clients > 0:
        parts.append(
            f"aggregate {spec.aggregate_rounds} rounds of {spec.clients} x "
            f"{spec.aggregate_tokens} tokens"
        )
    return ", ".join(parts)


def size_workload(minimum: WorkloadSpec, calibration: TrialResult, target_s: float) -> Sizing:
    """The spec every trial after `calibration` runs, for a measured part of about `target_s`."""
    if not calibration.ok:
        return Sizing(minimum, target_s, failure=calibration.failure or "error")
    details = calibration.details
    parts: dict[str, float] = details["parts_s"]
    measured_s = calibration.workload_s
    assert measured_s is not None and calibration.decode_tok_s, "an ok trial ran its workload"
    scale = max(1.0, target_s / measured_s)
    # the long prompt's text as the engine counted it: the same prompt in every later trial
    tokens = int(details["prefill_target_tokens"])
    cuts = [(int(chars), int(counted)) for chars, counted in details["prefill_cuts"]]
    spec = replace(minimum, prefill_tokens=tokens, prefill_chars=chars_for_tokens(tokens, cuts))
    gaps_s = max(0.0, measured_s - sum(parts.values()))  # prompt building, thread start-up
    prefill_requests = max(spec.prefill_requests, round(spec.prefill_requests * scale))
    expected_s = gaps_s + parts["prefill"] * prefill_requests / spec.prefill_requests
    decode_tokens, decode_requests, decode_s = _decode(
        spec,
        parts["decode"],
        calibration.decode_tok_s,
        cap_tokens=min(
            MAX_GENERATION_TOKENS,
            max(spec.decode_tokens, spec.prefill_tokens - max(details["decode_prompt_tokens"])),
        ),
        scale=scale,
    )
    expected_s += decode_s
    rounds = spec.aggregate_rounds
    if spec.clients > 0:
        rounds = max(rounds, round(rounds * scale))
        expected_s += parts["aggregate"] * rounds / spec.aggregate_rounds
    spec = replace(
        spec,
        prefill_requests=prefill_requests,
        decode_tokens=decode_tokens,
        decode_requests=decode_requests,
        aggregate_rounds=rounds,
    )
    return Sizing(spec, target_s, measured_s, expected_s)


def _decode(
    spec: WorkloadSpec, part_s: float, decode_tok_s: float, cap_tokens: int, scale: float
) -> tuple[int, int, float]:
    """(tokens per generation, generations, expected seconds) for a decode part `scale` times
    as long: a generation takes a fixed time (its prompt, the request) plus its tokens at the
    measured rate."""
    per_token_s = 1.0 / decode_tok_s
    per_request_s = part_s / spec.decode_requests
    fixed_s = max(0.0, per_request_s - (spec.decode_tokens - 1) * per_token_s)
    want_s = per_request_s * scale
    tokens = round((want_s - fixed_s) / per_token_s) + 1
    tokens = max(spec.decode_tokens, min(cap_tokens, tokens))
    one_s = fixed_s + (tokens - 1) * per_token_s
    requests = spec.decode_requests
    if tokens == cap_tokens:
        requests = max(requests, round(part_s * scale / one_s))
    return tokens, requests, requests * one_s
