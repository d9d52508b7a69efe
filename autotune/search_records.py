"""The search's records: what a run optimises and how, the best flags so far, the changes kept.
The search (autotune/search.py) writes them; its result (autotune/result.py) reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.text import Text, text_fields
from .flagset import Change
from .modes import Mode
from .noise import Figures, NoiseRule, Objective
from .trial_record import TrialResult

STARTING_FLAGS = Text("the starting flags")


@dataclass(frozen=True, slots=True)
class SearchSettings:
    """What a run optimises and how: mode, objective, noise rule, and what it starts from."""

    mode: Mode
    objective: Objective
    rule: NoiseRule = field(default_factory=NoiseRule)
    model_max_context: int | None = None
    pick_up: bool = False  # the base is an earlier run's result: context only if a change is kept
    base_origin: Text | str = STARTING_FLAGS


@dataclass(slots=True)
class Incumbent:
    """The best flags so far and the runs that measured them (their median is the reference)."""

    flags: list[str]
    runs: list[TrialResult]
    trials: list[int]

    @property
    def figures(self) -> Figures:
        return Figures.median(self.runs)

    @property
    def usable_context(self) -> int | None:
        return self.runs[-1].usable_context


@dataclass(frozen=True, slots=True)
class Kept:
    """A change that was kept, the trials behind it and the measured reason."""

    change: Change
    reason: Text
    trials: tuple[int, ...]
    gain: float

    def to_json(self) -> dict[str, Any]:
        return {
            **self.change.to_json(),
            **text_fields("label", self.change.label),
            **text_fields("reason", self.reason),
            "trials": list(self.trials),
            "gain": self.gain,
        }
