"""What a run optimises, and when a measured gain is real rather than noise.

Objectives: single-request decode tok/s, prefill tok/s, both (their geometric mean), aggregate
tok/s with N concurrent clients, or a coding agent's session (its generated tokens over its whole
time, each turn's wait for its first token included: engine/bench/agent_session.py). A change counts
only when it beats the incumbent by more than the larger of 3% and twice the run-to-run spread
measured on the baseline, and it may not cost any other figure more than 5% (both adjustable).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.text import Text
from .trial_record import TrialResult

OBJECTIVES = ("decode", "prefill", "both", "aggregate", "agent")
FIGURES = ("prefill", "decode", "aggregate", "agent")
FIGURE_NAMES = {
    "prefill": Text("prefill"),
    "decode": Text("decode"),
    "aggregate": Text("aggregate"),
    "agent": Text("agent session"),
}


@dataclass(frozen=True, slots=True)
class Figures:
    """The tok/s figures of one configuration (a trial, or the median of several)."""

    prefill: float | None
    decode: float | None
    aggregate: float | None = None
    agent: float | None = None

    @classmethod
    def of(cls, trial: TrialResult) -> Figures:
        return cls(trial.prefill_tok_s, trial.decode_tok_s, trial.aggregate_tok_s,
                   trial.agent_tok_s)  # fmt: skip

    @classmethod
    def median(cls, trials: Sequence[TrialResult]) -> Figures:
        """Each figure's median over trials (the middle one of three is not moved by one fluke)."""
        return cls(*(_median([t.figure(name) for t in trials]) for name in FIGURES))

    @classmethod
    def mean(cls, trials: Sequence[TrialResult]) -> Figures:
        return cls(*(_mean([t.figure(name) for t in trials]) for name in FIGURES))

    def get(self, name: str) -> float | None:
        return getattr(self, name)

    def to_json(self) -> dict[str, float | None]:
        return {f"{name}_tok_s": self.get(name) for name in FIGURES}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


@dataclass(frozen=True, slots=True)
class Objective:
    """The figure a run maximises; `clients` concurrent streams for the aggregate one. The agent
    session's replays the mode's sessions (`Mode.workload_for`)."""

    name: str
    clients: int = 0

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(
                Text(
                    "objective must be one of {choices}, not {name!r}",
                    choices=", ".join(OBJECTIVES),
                    name=self.name,
                )
            )
        if self.name == "aggregate" and self.clients < 2:
            raise ValueError(Text("the aggregate objective needs at least 2 concurrent clients"))

    @property
    def agent(self) -> bool:
        """Whether the workload replays agent sessions (the agent objective)."""
        return self.name == "agent"

    @property
    def label(self) -> Text:
        if self.name == "aggregate":
            return Text("aggregate tok/s with {clients} clients", clients=self.clients)
        return {
            "decode": Text("decode tok/s"),
            "prefill": Text("prefill tok/s"),
            "both": Text("prefill x decode (geometric mean)"),
            "agent": Text("agent session tok/s"),
        }[self.name]

    def score(self, figures: Figures) -> float | None:
        if self.name == "both":
            if not figures.prefill or not figures.decode:
                return None
            return math.sqrt(figures.prefill * figures.decode)
        return figures.get(self.name)

    @property
    def side_figures(self) -> tuple[str, ...]:
        """The measured figures that are not the objective and must not get much worse."""
        if self.name in ("aggregate", "agent"):
            return ("prefill", "decode")
        if self.name == "both":
            return ()
        return ("decode",) if self.name == "prefill" else ("prefill",)


def spread(values: Sequence[float]) -> float:
    """Run-to-run spread of repeated measurements: their standard deviation over their mean.

    A deviation from the median would ignore one outlier, but with three runs it is the smaller
    of two distances and reads a noisy machine as a quiet one; the plain standard deviation
    does not.
    """
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Spreads:
    """Run-to-run spread of the objective and of each figure, measured on the baseline runs."""

    objective: float
    figures: dict[str, float]

    @classmethod
    def measure(cls, objective: Objective, trials: Sequence[TrialResult]) -> Spreads:
        scores = [objective.score(Figures.of(t)) for t in trials]
        per_figure = {}
        for name in FIGURES:
            values = [v for v in (t.figure(name) for t in trials) if v is not None]
            per_figure[name] = spread(values)
        return cls(spread([s for s in scores if s is not None]), per_figure)

    def to_json(self) -> dict[str, object]:
        return {"objective": self.objective, "figures": self.figures}


@dataclass(frozen=True, slots=True)
class Judgement:
    """Whether a measured configuration beats the incumbent, and the reason in words."""

    beats: bool
    gain: float  # relative change of the objective
    reason: Text


@dataclass(frozen=True, slots=True)
class NoiseRule:
    """The thresholds a change must clear: min_gain, spread_factor x spread, side_tolerance.

    A cost to another figure counts when it is above side_tolerance and above that figure's own
    measured noise (spread_factor x its spread): a loss the baseline itself shows between two
    identical runs is not a loss.
    """

    min_gain: float = 0.03
    spread_factor: float = 2.0
    side_tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not (
            0 <= self.min_gain < 1 and self.spread_factor >= 0 and 0 <= self.side_tolerance < 1
        ):
            raise ValueError(
                Text("min_gain and side_tolerance are shares in [0, 1); spread_factor is 0 or more")
            )

    def threshold(self, spreads: Spreads) -> float:
        return max(self.min_gain, self.spread_factor * spreads.objective)

    def allowed_cost(self, name: str, spreads: Spreads) -> float:
        return max(self.side_tolerance, self.spread_factor * spreads.figures.get(name, 0.0))

    def judge(
        self,
        objective: Objective,
        candidate: Figures,
        incumbent: Figures,
        spreads: Spreads,
        *,
        sides: bool = True,
    ) -> Judgement:
        """Compare a candidate's figures with the incumbent's under this rule (`sides`: also
        the cost to the other figures)."""
        threshold = self.threshold(spreads)
        new, old = objective.score(candidate), objective.score(incumbent)
        if new is None or not old:
            return Judgement(False, 0.0, Text("no {figure} was measured", figure=objective.label))
        gain = new / old - 1.0
        head = Text(
            "{figure} {new:,.1f} against {old:,.1f}", figure=objective.label, new=new, old=old
        )
        if gain < -threshold:
            return Judgement(
                False, gain, Text("{head}: slower by {loss:.1%}", head=head, loss=-gain)
            )
        if gain <= threshold:
            return Judgement(
                False,
                gain,
                Text(
                    "{head}: within the noise ({gain:+.1%}; a change must gain more than "
                    "{threshold:.1%})",
                    head=head,
                    gain=gain,
                    threshold=threshold,
                ),
            )
        faster = Text("{head}: faster by {gain:.1%}", head=head, gain=gain)
        cost = self._cost(objective.side_figures, candidate, incumbent, spreads) if sides else None
        if cost:
            return Judgement(False, gain, Text("{faster}, but {cost}", faster=faster, cost=cost))
        return Judgement(
            True,
            gain,
            Text(
                "{faster}, more than the {threshold:.1%} noise threshold",
                faster=faster,
                threshold=threshold,
            ),
        )

    def holds(
        self, objective: Objective, candidate: Figures, incumbent: Figures, spreads: Spreads
    ) -> Judgement:
        """Whether speed holds: no figure, the objective's included, costs more than allowed."""
        score_new, score_old = objective.score(candidate), objective.score(incumbent)
        gain = score_new / score_old - 1.0 if score_new and score_old else 0.0
        cost = self._cost(FIGURES, candidate, incumbent, spreads)
        if cost:
            return Judgement(False, gain, cost)
        return Judgement(
            True,
            gain,
            Text(
                "speed holds ({figure} {gain:+.1%}, within the noise)",
                figure=objective.label,
                gain=gain,
            ),
        )

    def _cost(
        self, names: Sequence[str], candidate: Figures, incumbent: Figures, spreads: Spreads
    ) -> Text | None:
        """Words for the first figure that got worse by more than allowed, else None."""
        for name in names:
            new, old = candidate.get(name), incumbent.get(name)
            if new is None or not old:
                continue
            cost = 1.0 - new / old
            allowed = self.allowed_cost(name, spreads)
            if cost > allowed:
                return Text(
                    "{figure} is slower by {cost:.1%} ({new:,.1f} against {old:,.1f} tok/s; at "
                    "most {allowed:.1%} is allowed)",
                    figure=FIGURE_NAMES[name],
                    cost=cost,
                    new=new,
                    old=old,
                    allowed=allowed,
                )
        return None
