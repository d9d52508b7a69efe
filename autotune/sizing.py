"""A run's workload sized to a duration: measured by the calibration trial, then fixed.

A mode's workload (modes.py) is the least a trial sends, and how long it lasts depends on the
machine: a few seconds on a small CPU with the demo model, about one on a GPU. Scaling that one
reading by target / measured undershoots several times over: the minimum runs cold (its first
requests compile kernels, so its prefill reads several times slower than warm) and much of it is
per-request costs (HTTP, the first token) that do not grow with the tokens. So the calibration
trial sizes in stages, in its one engine (calibrate):

(a) the mode's minimum workload, which absorbs the cold start; a first estimate is sized from it
    for the target (at the minimum's cold speeds, so warm it runs shorter);
(b) that estimate, run warm and timed;
(c) the run's workload, sized again from (b)'s readings, for every later trial.

When (b) lasted less than REPEAT_BELOW_SHARE of the target, the sizing would stretch its readings
too far: (b) runs once more at the estimate sized from it, and (c) sizes from that. A run sized
from a first estimate of a quarter of the target came out well short of what the sizing expected;
hence half. A minimum that already took the target or longer is kept without a second stage.
The sizing is a function of the stored stages' readings alone, so a resumed run that replays the
trial gets the same spec.

Sizing from a stage models each part by that stage's own readings (Speeds): a long prompt takes
the same time per request (it is the same prompt), a generation a fixed time (its prompt, the
request) plus its tokens at the measured rate, a round of concurrent streams the same time per
round. The mode's minimum at those speeds gives each part's share, and each part grows to keep
its share of the target (none shrinks below the minimum):
- prefill: more requests of the same long prompt (its length stays the mode's: the plan judges
  prefill chunks against it);
- decode: longer generations first, up to MAX_GENERATION_TOKENS and never longer than the long
  prompt (so no request needs more context than the minimum workload did), then more of them;
- aggregate: more rounds of the same concurrent streams;
- agent: more sessions of the same shape, one after the other.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..engine.text import Text, text_fields
from .trial_record import FAILURES, TrialResult
from .workload import WorkloadResult, WorkloadSpec, chars_for_tokens

MAX_GENERATION_TOKENS = 1024
# a warm stage shorter than this share of the target is run again at the estimate sized from it
REPEAT_BELOW_SHARE = 0.5
# the kinds of a trial's failure (trial.py classifies them) as words in sentences
STAGES = (Text("the mode's minimum"), Text("the first estimate"), Text("the second estimate"))


@dataclass(frozen=True, slots=True)
class Sizing:
    """The workload a run settled on at its calibration trial, and the times behind it."""

    spec: WorkloadSpec
    target_s: float
    stages_s: tuple[float, ...] = ()  # each calibration stage's workload, the minimum's first
    expected_s: float | None = None  # the sized workload at the last stage's speeds
    failure: str | None = None  # why the calibration trial measured nothing

    @property
    def measured_s(self) -> float | None:
        """Seconds the mode's minimum workload took (cold: the engine's first requests)."""
        return self.stages_s[0] if self.stages_s else None

    @property
    def reason(self) -> Text:
        """The calibration trial's verdict in words."""
        if self.failure is not None:
            return Text(
                "calibration failed ({failure}): every trial runs the mode's minimum workload",
                failure=FAILURES.get(self.failure, self.failure),
            )
        assert self.measured_s is not None and self.expected_s is not None
        if len(self.stages_s) == 1 and self.measured_s >= self.target_s:
            return Text(
                "calibration: the mode's minimum workload took {measured_s:.1f} s, not less than "
                "the {target_s:.0f} s target: kept as it is ({workload})",
                measured_s=self.measured_s,
                target_s=self.target_s,
                workload=describe(self.spec),
            )
        if len(self.stages_s) == 1:  # a trial stored before calibration took two stages
            return Text(
                "calibration: workload sized to {expected_s:.1f} s (target {target_s:.0f} s; the "
                "mode's minimum took {measured_s:.1f} s): {workload}",
                expected_s=self.expected_s,
                target_s=self.target_s,
                measured_s=self.measured_s,
                workload=describe(self.spec),
            )
        stages = [Text("the mode's minimum took {time_s:.1f} s cold", time_s=self.measured_s)]
        stages += [
            Text("{stage} {time_s:.1f} s warm", stage=STAGES[i], time_s=s)
            for i, s in enumerate(self.stages_s[1:], 1)
        ]
        return Text(
            "calibration: {stages}; workload sized to {expected_s:.1f} s (target {target_s:.0f} "
            "s): {workload}",
            stages=stages,
            expected_s=self.expected_s,
            target_s=self.target_s,
            workload=describe(self.spec),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_json(),
            "target_s": self.target_s,
            "measured_s": self.measured_s,
            "stages_s": list(self.stages_s),
            "expected_s": self.expected_s,
            "failure": self.failure,
            **text_fields("reason", self.reason),
        }


@dataclass(frozen=True, slots=True)
class Speeds:
    """What each part of a workload costs, read from one run of it: the sizing's model."""

    prefill_request_s: float  # one request of the long prompt
    decode_fixed_s: float  # a generation's prompt, request and first token
    decode_token_s: float  # each generated token after the first
    aggregate_round_s: float  # one round of concurrent streams
    agent_session_s: float  # one agent session
    other_s: float  # outside any request: prompt building, thread start-up

    @classmethod
    def of(cls, details: dict[str, Any]) -> Speeds:
        """The model of a workload's readings (`WorkloadResult.details`)."""
        spec = WorkloadSpec.from_json(details["workload"])
        parts: dict[str, float] = details["parts_s"]
        token_s = 1.0 / statistics.median(details["decode_tok_s"])
        per_request_s = parts["decode"] / spec.decode_requests
        return cls(
            prefill_request_s=parts["prefill"] / spec.prefill_requests,
            decode_fixed_s=max(0.0, per_request_s - (spec.decode_tokens - 1) * token_s),
            decode_token_s=token_s,
            aggregate_round_s=parts.get("aggregate", 0.0) / spec.aggregate_rounds,
            agent_session_s=parts.get("agent", 0.0) / spec.agent_sessions,
            other_s=max(0.0, float(details["workload_s"]) - sum(parts.values())),
        )

    def generation_s(self, tokens: int) -> float:
        return self.decode_fixed_s + (tokens - 1) * self.decode_token_s

    def parts_s(self, spec: WorkloadSpec) -> dict[str, float]:
        """Seconds each part of `spec` takes at these speeds."""
        return {
            "prefill": spec.prefill_requests * self.prefill_request_s,
            "decode": spec.decode_requests * self.generation_s(spec.decode_tokens),
            "aggregate": spec.aggregate_rounds * self.aggregate_round_s if spec.clients else 0.0,
            "agent": spec.agent_sessions * self.agent_session_s if spec.agent_turns else 0.0,
        }

    def workload_s(self, spec: WorkloadSpec) -> float:
        return self.other_s + sum(self.parts_s(spec).values())


def describe(spec: WorkloadSpec) -> Text:
    """A spec in a line: how many requests of how many tokens each part sends."""
    parts = Text(
        "prefill {prefill_requests} x {prefill_tokens} tokens, decode {decode_requests} x "
        "{decode_tokens} tokens",
        prefill_requests=spec.prefill_requests,
        prefill_tokens=spec.prefill_tokens,
        decode_requests=spec.decode_requests,
        decode_tokens=spec.decode_tokens,
    )
    if spec.clients > 0:
        parts = Text(
            "{parts}, aggregate {rounds} rounds of {clients} x {tokens} tokens",
            parts=parts,
            rounds=spec.aggregate_rounds,
            clients=spec.clients,
            tokens=spec.aggregate_tokens,
        )
    if spec.agent_turns > 0:
        parts = Text(
            "{parts}, agent {sessions} sessions of {turns} turns",
            parts=parts,
            sessions=spec.agent_sessions,
            turns=spec.agent_turns,
        )
    return parts


def calibrate(
    minimum: WorkloadSpec,
    target_s: float,
    run: Callable[[WorkloadSpec], WorkloadResult],
    on_stage: Callable[[Text], None] = lambda _stage: None,
) -> WorkloadResult:
    """The calibration trial's workload: the stages, each `run` in the same engine.

    The result's figures are the last (warm) stage's; its details hold every stage's readings
    (`stages`), the spec the trial was asked for (the minimum) and the seconds of all stages.
    """
    on_stage(Text("calibration: {stage}", stage=STAGES[0]))
    results = [run(minimum)]
    while len(results) < len(STAGES):
        last_s = float(results[-1].details["workload_s"])
        if last_s >= (target_s if len(results) == 1 else REPEAT_BELOW_SHARE * target_s):
            break
        spec, expected_s = sized(minimum, [r.details for r in results], target_s)
        on_stage(
            Text(
                "calibration: {stage} ({time_s:.0f} s)",
                stage=STAGES[len(results)],
                time_s=expected_s,
            )
        )
        results.append(run(spec))
    last = results[-1]
    details = {
        **last.details,
        "stages": [r.details for r in results],
        "workload": minimum.to_json(),
        "workload_s": sum(float(r.details["workload_s"]) for r in results),
    }
    return replace(last, details=details)


def size_workload(minimum: WorkloadSpec, calibration: TrialResult, target_s: float) -> Sizing:
    """The spec every trial after `calibration` runs, for a measured part of about `target_s`."""
    if not calibration.ok:
        return Sizing(minimum, target_s, failure=calibration.failure or "error")
    # a trial stored before calibration took stages ran the minimum alone
    stages = calibration.details.get("stages") or [calibration.details]
    spec, expected_s = sized(minimum, stages, target_s)
    return Sizing(spec, target_s, tuple(float(s["workload_s"]) for s in stages), expected_s)


def sized(
    minimum: WorkloadSpec, stages: list[dict[str, Any]], target_s: float
) -> tuple[WorkloadSpec, float]:
    """(spec, expected seconds) for about `target_s`, at the speeds of the last of `stages`.

    The long prompt's text is the one the first stage cut to the engine's count: the same
    prompt in every later stage and trial.
    """
    first = stages[0]
    tokens = int(first["prefill_target_tokens"])
    cuts = [(int(chars), int(counted)) for chars, counted in first["prefill_cuts"]]
    base = replace(minimum, prefill_tokens=tokens, prefill_chars=chars_for_tokens(tokens, cuts))
    speeds = Speeds.of(stages[-1])
    # the time outside requests does not grow with them: the parts fill the rest of the target
    base_parts_s = sum(speeds.parts_s(base).values())
    scale = max(1.0, (target_s - speeds.other_s) / base_parts_s) if base_parts_s > 0 else 1.0
    decode_prompt_tokens = max(max(s["decode_prompt_tokens"]) for s in stages)
    cap_tokens = min(MAX_GENERATION_TOKENS, max(base.decode_tokens, tokens - decode_prompt_tokens))
    decode_tokens, decode_requests = _decode(base, speeds, cap_tokens, scale)
    spec = replace(
        base,
        prefill_requests=max(base.prefill_requests, round(base.prefill_requests * scale)),
        decode_tokens=decode_tokens,
        decode_requests=decode_requests,
        aggregate_rounds=max(base.aggregate_rounds, round(base.aggregate_rounds * scale)),
        agent_sessions=max(base.agent_sessions, round(base.agent_sessions * scale)),
    )
    return spec, speeds.workload_s(spec)


def _decode(base: WorkloadSpec, speeds: Speeds, cap_tokens: int, scale: float) -> tuple[int, int]:
    """(tokens per generation, generations) for a decode part `scale` times the minimum's."""
    per_request_s = speeds.generation_s(base.decode_tokens)
    want_s = per_request_s * scale
    tokens = round((want_s - speeds.decode_fixed_s) / speeds.decode_token_s) + 1
    tokens = max(base.decode_tokens, min(cap_tokens, tokens))
    requests = base.decode_requests
    if tokens == cap_tokens:
        requests = max(requests, round(requests * want_s / speeds.generation_s(tokens)))
    return tokens, requests
