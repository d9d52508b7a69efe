"""The plan of a run: which single-flag changes to try, in what order, and which to skip and why.

Candidates come from the engine's own list of tunable flags (`engine/config/args.py` TUNABLE: the
flag, how its values are chosen, the values it suggests), read against this machine and this model:
thread counts from the physical cores, nothing that needs a GPU where the engine runs on the CPU
(CUDA graphs, split misses, fetching misses, overlapped copies), no prefill chunk longer than the
workload's prompt can tell apart, no more running requests than the workload's clients. Ordered
values (chunk sizes, running requests, threads, cache shares) are walked outwards from the value
in force, one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.config.args import TUNABLE, Tunable
from ..engine.text import Text, text_fields, text_of
from .flagset import Change, effective_value, flag_info, has_flag, value_of
from .modes import MODE_NAMES, Mode
from .noise import FIGURE_NAMES, Objective

CACHE_SHARES = ("1.0", "0.75", "0.5", "0.25")
# the figure a flag can move, where that is narrower than all of them
FIGURE_OF_FLAG = {
    "--prefill-chunk-tokens": "prefill",
    "--no-prefill-overlap": "prefill",
    "--max-running-requests": "aggregate",
    "--moe-cpu-prefetch-rounds": "decode",
    "--moe-cpu-redo-us": "decode",  # the decode planner's CPU jobs only
    "--moe-copy-ahead": "decode",
    "--moe-early-cached": "decode",  # the decode pieces' heads only
    "--moe-cache-admission": "decode",  # the decode planners' fills only
}
# flags that do nothing where the engine runs on the CPU, and why
GPU_ONLY = {
    "--no-cuda-graph": Text("CUDA graphs do not apply"),
    "--cuda-graph-max-bs": Text("CUDA graphs do not apply"),
    "--no-overlap-decode": Text("CUDA graphs do not apply (overlapped decode replays whole steps)"),
    # the guesses the prefetch and the copy ahead work from come from one-token pieces' graphs
    "--moe-cpu-prefetch-rounds": Text("CUDA graphs do not apply (it works from their guesses)"),
    "--moe-copy-ahead": Text("CUDA graphs do not apply (it works from their guesses)"),
    "--moe-early-cached": Text("CUDA graphs do not apply (it moves their pieces' heads)"),
    "--devices": Text("a split runs across GPUs"),
    "--no-split-misses": Text(
        "a miss is split between a copy to the GPU and the CPU: there is no GPU"
    ),
    "--no-prefill-overlap": Text("the next layer's copy can run beside the compute only on a GPU"),
    "--moe-cache-admission": Text(
        "the expert cache's slots lie in the same RAM as the bank: a hit saves no copy"
    ),
    "--dense-dtype": Text(
        "no FP8 kernel runs on the CPU: each projection would be widened for every call"
    ),
}
# values that do nothing where the engine runs on the CPU: a fetched miss is only copied within RAM
GPU_ONLY_VALUES = {"--moe-miss-policy": ("gpu", "split:")}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the plan needs of a checkpoint (from the daemon's model catalog)."""

    path: str
    num_moe_layers: int | None = None
    num_experts: int | None = None
    max_context: int | None = None


@dataclass(frozen=True, slots=True)
class MachineFacts:
    """What the plan needs of this machine (from the daemon's hardware measurements)."""

    physical_cores: int
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One change to try against the best flags so far; `walk` marks a step of an ordered walk."""

    change: Change
    why: Text | str
    walk: str | None = None  # "up" or "down"

    def to_json(self) -> dict[str, Any]:
        return {
            **self.change.to_json(),
            "key": self.change.key,
            **text_fields("why", self.why),
            "walk": self.walk,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Candidate:
        return cls(Change.from_json(data), text_of(data, "why"), data.get("walk"))


@dataclass(frozen=True, slots=True)
class Skipped:
    """A flag or a value the run does not try, and why."""

    flag: str
    value: str | bool | None
    why: Text | str

    def to_json(self) -> dict[str, Any]:
        return {"flag": self.flag, "value": self.value, **text_fields("why", self.why)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Skipped:
        return cls(str(data["flag"]), data.get("value"), text_of(data, "why"))


@dataclass(frozen=True, slots=True)
class Plan:
    """The candidates in the order they are tried, what was left out, and the starting values.

    `starting` holds the change keys of the values in force at the start: the baseline measures
    them, so a later run that picks up from this one need not try them again.
    """

    candidates: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...]
    starting: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "candidates": [c.to_json() for c in self.candidates],
            "skipped": [s.to_json() for s in self.skipped],
            "starting": list(self.starting),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        return cls(
            tuple(Candidate.from_json(c) for c in data.get("candidates", [])),
            tuple(Skipped.from_json(s) for s in data.get("skipped", [])),
            tuple(data.get("starting", [])),
        )


def _number(text: str | bool | None) -> float | None:
    try:
        return float(str(text))
    except ValueError:
        return None


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class _Planner:
    """Builds one plan; one method per kind of tunable flag."""

    def __init__(
        self,
        base_flags: list[str],
        model: ModelFacts,
        machine: MachineFacts,
        mode: Mode,
        objective: Objective,
    ) -> None:
        self.base = base_flags
        self.model = model
        self.machine = machine
        self.mode = mode
        self.objective = objective
        self.candidates: list[Candidate] = []
        self.skipped: list[Skipped] = []
        self.starting: list[str] = []

    @property
    def on_cpu(self) -> bool:
        device = effective_value(self.base, "--device")
        return self.machine.gpus == 0 or device == "cpu"

    def skip(self, flag: str, value: str | bool | None, why: Text) -> None:
        self.skipped.append(Skipped(flag, value, why))

    def add(
        self, flag: str, value: str | bool | None, why: Text | str, walk: str | None = None
    ) -> None:
        self.candidates.append(Candidate(Change(flag, value), why, walk))

    def objective_figures(self) -> set[str]:
        return {
            "decode": {"decode"},
            "prefill": {"prefill"},
            "both": {"prefill", "decode"},
            "aggregate": {"aggregate", "decode"},
            # an agent's turns read long prompts and decode replies
            "agent": {"agent", "prefill", "decode"},
        }[self.objective.name]

    def plan(self, tunable: tuple[Tunable, ...], only: frozenset[str] | None) -> None:
        for t in tunable:
            if only is not None and t.flag not in only:
                self.skip(t.flag, None, Text("not among the flags this run was asked to tune"))
                continue
            if flag_info(t.flag) is None:
                self.skip(t.flag, None, Text("the engine's parser does not know this flag"))
                continue
            if t.flag in GPU_ONLY and self.on_cpu:
                self.skip(
                    t.flag,
                    None,
                    Text("the engine runs on the CPU here: {why}", why=GPU_ONLY[t.flag]),
                )
                continue
            if t.kind == "devices" and self.machine.gpus < 2:
                self.skip(
                    t.flag,
                    None,
                    Text("{gpus} GPU here: a split needs two or more", gpus=self.machine.gpus),
                )
                continue
            if t.flag == "--moe-cpu-pin" and self.machine.physical_cores < 2:
                self.skip(
                    t.flag,
                    None,
                    Text("one physical core: the workers cannot have cores of their own"),
                )
                continue
            figure = FIGURE_OF_FLAG.get(t.flag)
            if t.flag == "--max-running-requests" and self.objective.name != "aggregate":
                self.skip(
                    t.flag, None, Text("only the aggregate objective runs requests side by side")
                )
                continue
            if (
                figure is not None
                and self.mode.skip_off_objective
                and figure not in self.objective_figures()
            ):
                self.skip(
                    t.flag,
                    None,
                    Text(
                        "{mode} mode: it moves {figure} tok/s, not {objective}",
                        mode=MODE_NAMES[self.mode.name],
                        figure=FIGURE_NAMES[figure],
                        objective=self.objective.label,
                    ),
                )
                continue
            if t.kind != "devices":  # setting --devices drops --device itself (apply_change)
                self._drop_excluded(t)
            method = getattr(self, f"_{t.kind}", None)
            if method is None:
                self.skip(
                    t.flag,
                    None,
                    Text("the benchmark cannot vary flags of kind {kind!r}", kind=t.kind),
                )
                continue
            method(t)

    def _drop_excluded(self, t: Tunable) -> None:
        """A flag in the base that excludes this one: going back to its default comes first."""
        for other in flag_info(t.flag)["exclusive_with"]:
            if has_flag(self.base, other):
                self.add(other, None, Text("back to the engine's default ({why})", why=t.why))

    def _choice(self, t: Tunable) -> None:
        current = effective_value(self.base, t.flag)
        if current is not None:
            self.starting.append(Change(t.flag, current).key)
        numbers = [_number(v) for v in t.values]
        if all(n is not None for n in numbers) and _number(current) is not None:
            self._walk(t, [v for v in t.values], str(current))
            return
        values = []
        for value in t.values:
            reason = self._inapplicable(t.flag, value)
            if value == current:
                continue
            if reason:
                self.skip(t.flag, value, reason)
            else:
                values.append(value)
        keep = values if self.mode.values_per_flag is None else values[: self.mode.values_per_flag]
        for value in values:
            if value in keep:
                self.add(t.flag, value, t.why)
            else:
                self.skip(t.flag, value, self._values_only(len(keep)))

    def _walk(self, t: Tunable, values: list[str], current: str) -> None:
        """Ordered values: upwards from the one in force, then downwards, one step at a time."""
        here = float(current)
        self.starting.append(Change(t.flag, _fmt(here)).key)
        ordered = sorted({float(v) for v in values} | {here})
        up = [v for v in ordered if v > here]
        down = [v for v in reversed(ordered) if v < here]
        limit = self.mode.walk_steps
        for direction, steps in (("up", up), ("down", down)):
            for i, value in enumerate(steps):
                text = _fmt(value)
                reason = self._unusable(t.flag, value)
                if reason:
                    self.skip(t.flag, text, reason)
                elif limit is not None and i >= limit:
                    self.skip(
                        t.flag,
                        text,
                        Text(
                            "{mode} mode walks {steps} steps each way",
                            mode=MODE_NAMES[self.mode.name],
                            steps=limit,
                        ),
                    )
                else:
                    self.add(t.flag, text, t.why, walk=direction)

    def _values_only(self, count: int) -> Text:
        return Text(
            "{mode} mode tries {count} values", mode=MODE_NAMES[self.mode.name], count=count
        )

    def _inapplicable(self, flag: str, value: str) -> Text | None:
        """Why a value of an unordered choice cannot apply on this machine, else None."""
        if self.on_cpu and value.startswith(GPU_ONLY_VALUES.get(flag, ())):
            return Text(
                "the engine runs on the CPU here: there is no GPU to fetch misses to (a fetch "
                "would only copy the expert within RAM)"
            )
        return None

    def _unusable(self, flag: str, value: float) -> Text | None:
        """Why a value of an ordered flag cannot be told apart or cannot run, else None."""
        if flag == "--prefill-chunk-tokens":
            prompt = self.mode.workload.prefill_tokens
            if self.model.max_context and value > self.model.max_context:
                return Text(
                    "longer than the model's context ({tokens} tokens)",
                    tokens=self.model.max_context,
                )
            if value >= prompt and _number(effective_value(self.base, flag) or 0) >= prompt:
                return Text(
                    "the workload's long prompt is {tokens} tokens: chunks of {tokens} or more "
                    "read it in one piece either way",
                    tokens=prompt,
                )
        if flag == "--moe-cpu-threads" and value > self.machine.physical_cores:
            return Text("more than the {cores} physical cores", cores=self.machine.physical_cores)
        clients = self.objective.clients
        if flag == "--max-running-requests" and value > clients > 0:
            return Text(
                "more than the workload's {clients} concurrent clients: the room is never used",
                clients=clients,
            )
        return None

    def _switch(self, t: Tunable) -> None:
        on = has_flag(self.base, t.flag)
        self.starting.append(Change(t.flag, on).key)
        self.add(t.flag, not on, t.why)

    def _devices(self, t: Tunable) -> None:
        """Every GPU of the machine, the split planned by the engine; where the start already
        splits, one device (the engine's default)."""
        if has_flag(self.base, t.flag):
            self.starting.append(Change(t.flag, effective_value(self.base, t.flag)).key)
            self.add(t.flag, None, t.why)
            return
        self.add(t.flag, ",".join(f"cuda:{i}" for i in range(self.machine.gpus)), t.why)

    def _threads(self, t: Tunable) -> None:
        cores = self.machine.physical_cores
        ladder = {1, max(1, cores - 1), cores}
        n = 2
        while n < cores:
            ladder.add(n)
            n *= 2
        current = _number(effective_value(self.base, t.flag)) or max(1, cores - 1)
        self._walk(t, [str(v) for v in sorted(ladder)], _fmt(current))

    def _slots(self, t: Tunable) -> None:
        current = self._cache_share()
        if current is None:
            # the engine's default takes whatever fits: try named shares from the top down
            values = list(CACHE_SHARES)
            limit = self.mode.values_per_flag
            for i, value in enumerate(values):
                if limit is not None and i >= limit:
                    self.skip(t.flag, value, self._values_only(limit))
                else:
                    self.add(t.flag, value, t.why)
            return
        self._walk(t, list(CACHE_SHARES), _fmt(current))

    def _cache_share(self) -> float | None:
        """The expert cache in force as a share of all experts, when the flags say it."""
        return _number(value_of(self.base, "--moe-cache-rate"))

    def _tokens(self, t: Tunable) -> None:
        current = _number(effective_value(self.base, t.flag))
        if current is None:
            self.skip(t.flag, None, Text("no value in force to walk from"))
            return
        values = [current / 4, current / 2, current * 2, current * 4]
        self._walk(t, [_fmt(v) for v in values if v >= 1], _fmt(current))


def make_plan(
    base_flags: list[str],
    model: ModelFacts,
    machine: MachineFacts,
    mode: Mode,
    objective: Objective,
    *,
    only_flags: frozenset[str] | None = None,
    tried: dict[str, int] | None = None,
    tunable: tuple[Tunable, ...] = TUNABLE,
) -> Plan:
    """The candidates for a run from `base_flags`; `tried` maps change keys to the run that tried
    them, and those are left out ("pick up from the last result")."""
    planner = _Planner(base_flags, model, machine, mode, objective)
    planner.plan(tunable, only_flags)
    candidates: list[Candidate] = []
    seen: set[str] = set()
    for candidate in planner.candidates:
        key = candidate.change.key
        if key in seen:
            continue
        seen.add(key)
        if tried and key in tried:
            planner.skip(
                candidate.change.flag,
                candidate.change.value,
                Text("tried in run {run}", run=tried[key]),
            )
            continue
        candidates.append(candidate)
    return Plan(tuple(candidates), tuple(planner.skipped), tuple(dict.fromkeys(planner.starting)))
