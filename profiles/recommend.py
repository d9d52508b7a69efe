"""Recommended settings: the flags for this PC and this checkpoint, each with its reason and the
numbers behind it, or a benchmark's result with rules only for what it did not cover.

`recommend(machine, spec, benchmark=None)` is the one entry point; `rules.py` and `cpu_rules.py`
hold the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.config.memory import MemoryPlanError, VramPlan
from ..engine.model.spec import ModelSpec
from ..engine.text import Text, error_text, text_of, texts_fields
from .advice import Advice
from .flags import FlagChange, catalog, engine_config, settings_of, split_flags
from .machine import GIB, Machine, choose_device, plan_for
from .rules import rule_advice


@dataclass(frozen=True, slots=True)
class BenchmarkResult:
    """A finished benchmark's choice for one model: what Recommended becomes after it.

    `flags`: the chosen command-line flags. `notes`: the measured reason per flag, also for
    flags it tried and left at the default (those count as covered). `gpu_uuids`: the GPUs it
    ran on, when recorded; with `engine_version` and `machine_id` they decide staleness.
    """

    run_id: int
    flags: list[str]
    notes: dict[str, Text | str] = field(default_factory=dict)
    general_notes: list[Text | str] = field(default_factory=list)
    engine_version: str | None = None
    machine_id: str | None = None
    gpu_uuids: tuple[str, ...] | None = None
    finished: str | None = None

    @classmethod
    def from_result(
        cls,
        run_id: int,
        result: dict[str, Any],
        *,
        engine_version: str | None,
        machine_id: str | None,
        finished: str | None = None,
    ) -> BenchmarkResult:
        """Read a `benchmark_runs.result` object: `{"flags": [...], "notes": [...],
        "hardware": {"gpu_uuids": [...]}}`, where a note is `{"flag", "reason"}` (its stored form
        beside it, engine/text.py), `{"flag", "note"}` or plain text."""
        flags = [str(f) for f in result.get("flags") or []]
        notes: dict[str, Text | str] = {}
        general: list[Text | str] = []
        for note in result.get("notes") or []:
            if isinstance(note, dict) and isinstance(note.get("flag"), str):
                notes[note["flag"]] = text_of(note, "reason") or str(note.get("note") or "")
            elif isinstance(note, str):
                general.append(note)
        uuids = (result.get("hardware") or {}).get("gpu_uuids")
        return cls(
            run_id=run_id,
            flags=flags,
            notes=notes,
            general_notes=general,
            engine_version=engine_version,
            machine_id=machine_id,
            gpu_uuids=tuple(uuids) if isinstance(uuids, list) else None,
            finished=finished,
        )


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The advised flags for one model on this machine, the VRAM split they imply, warnings,
    and whether what it rests on (measurements or a benchmark) predates the engine or hardware."""

    model: str
    advice: tuple[Advice, ...]
    plan: VramPlan | None
    warnings: tuple[Text | str, ...]
    basis: str  # "rules" or "benchmark"
    benchmark_run: int | None = None
    notes: tuple[Text | str, ...] = ()
    stale_reasons: tuple[Text, ...] = ()

    @property
    def stale(self) -> bool:
        return bool(self.stale_reasons)

    @property
    def flags(self) -> list[str]:
        """The advised command-line flags (advice that leaves a flag unset is not among them)."""
        out: list[str] = []
        for a in self.advice:
            if a.value is True:
                out.append(a.flag)
            elif isinstance(a.value, str):
                out += [a.flag, a.value]
        return out

    def changes(self) -> list[FlagChange]:
        """The changes that give a profile these settings (unset advice drops the flag)."""
        return [FlagChange(a.flag, a.value) for a in self.advice]

    def vram_split(self) -> dict[str, Any] | None:
        """Where the device memory goes under these flags, in GiB (bytes under "bytes")."""
        if self.plan is None:
            return None
        p = self.plan
        parts = {
            "budget": p.budget_bytes,
            "weights": p.weights_bytes,
            "kv": p.kv_bytes,
            "states": p.state_bytes,
            "expert_cache": p.expert_cache_bytes,
            "buffers": p.prefill_buffer_bytes + p.activation_bytes + p.graph_bytes,
            "headroom": p.headroom_bytes,
            "free": p.unplanned_bytes,
        }
        out: dict[str, Any] = {k: round(v / GIB, 3) for k, v in parts.items()}
        out.update(
            bytes=parts,
            slots=p.slots,
            experts_total=p.experts_total,
            kv_tokens=p.kv_tokens,
            context_tokens=p.max_context,
            state_sequences=p.state_slots,
            state_checkpoints=p.state_checkpoints,
            window_tokens=p.window_tokens,
        )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "flags": [a.to_json() for a in self.advice],
            "command_flags": self.flags,
            "vram_split": self.vram_split(),
            **texts_fields("warnings", self.warnings),
            **texts_fields("notes", self.notes),
            "basis": self.basis,
            "benchmark_run": self.benchmark_run,
            "stale": self.stale,
            **texts_fields("stale_reasons", self.stale_reasons),
        }


def recommend(
    machine: Machine,
    spec: ModelSpec,
    *,
    model: str = "",
    context_tokens: int | None = None,
    benchmark: BenchmarkResult | None = None,
) -> Recommendation:
    """The flags for `spec` on `machine`: from the rules, or from `benchmark` with rule advice
    only for the flags it did not cover. `context_tokens` asks for a context (default: the
    model's own when it leaves room for experts; see rules.py)."""
    # the RAM the bank takes: in the format the benchmark chose where it chose one
    chosen = settings_of(benchmark.flags) if benchmark is not None else {}
    expert_dtype = chosen.get("--moe-expert-dtype") or "auto"
    advice, warnings = rule_advice(machine, spec, context_tokens, expert_dtype)
    stale: list[Text] = []
    if benchmark is None:
        rates = machine.rates
        if rates is not None and rates.engine_version not in (None, machine.engine_version):
            stale.append(
                Text(
                    "the rates were measured with moelab {then}; this is {now}: measure again",
                    then=rates.engine_version,
                    now=machine.engine_version,
                )
            )
        uuids = {g.uuid for g in machine.gpus}
        if rates is not None and rates.gpu_uuid is not None and rates.gpu_uuid not in uuids:
            stale.append(Text("the rates were measured on a GPU this machine no longer has"))
        basis, run_id, notes = "rules", None, ()
    else:
        advice = _benchmark_advice(benchmark) + _uncovered(advice, benchmark)
        stale = _benchmark_staleness(benchmark, machine)
        basis, run_id, notes = "benchmark", benchmark.run_id, tuple(benchmark.general_notes)
    recommendation = Recommendation(
        model=model,
        advice=tuple(advice),
        plan=None,
        warnings=tuple(warnings),
        basis=basis,
        benchmark_run=run_id,
        notes=notes,
        stale_reasons=tuple(stale),
    )
    try:
        config = engine_config(recommendation.flags)
        plan = plan_for(spec, choose_device(machine, spec, config), config)
    except MemoryPlanError as err:
        plan = None
        if basis == "benchmark":
            warnings = [
                *warnings,
                Text("the benchmark's flags no longer fit: {error}", error=error_text(err)),
            ]
    return Recommendation(
        model=model,
        advice=recommendation.advice,
        plan=plan,
        warnings=tuple(dict.fromkeys(warnings)),
        basis=basis,
        benchmark_run=run_id,
        notes=notes,
        stale_reasons=tuple(stale),
    )


def _benchmark_advice(benchmark: BenchmarkResult) -> list[Advice]:
    settings, _ = split_flags(benchmark.flags)
    out = []
    for s in settings:
        reason = benchmark.notes.get(s.flag) or Text(
            "chosen by benchmark run {run}", run=benchmark.run_id
        )
        out.append(Advice(s.flag, True if s.value is None else s.value, reason, "measured"))
    chosen = {s.flag for s in settings}
    for flag, note in benchmark.notes.items():
        if flag not in chosen and flag in catalog():
            value = False if catalog()[flag].switch else None
            out.append(Advice(flag, value, note, "measured"))
    return out


def _uncovered(rules: list[Advice], benchmark: BenchmarkResult) -> list[Advice]:
    """Rule advice for flags the benchmark neither set nor tried (nor an exclusive partner)."""
    settings, _ = split_flags(benchmark.flags)
    covered = {s.flag for s in settings} | set(benchmark.notes)
    for flag in list(covered):
        if flag in catalog():
            covered |= set(catalog()[flag].exclusive_with)
    return [a for a in rules if a.flag not in covered]


def _benchmark_staleness(benchmark: BenchmarkResult, machine: Machine) -> list[Text]:
    out = []
    if benchmark.engine_version and benchmark.engine_version != machine.engine_version:
        out.append(
            Text(
                "benchmark run {run} ran moelab {then}; this is {now}: run it again (pick up from "
                "the last result)",
                run=benchmark.run_id,
                then=benchmark.engine_version,
                now=machine.engine_version,
            )
        )
    if benchmark.machine_id and benchmark.machine_id != machine.machine_id:
        out.append(Text("benchmark run {run} ran on another machine", run=benchmark.run_id))
    if benchmark.gpu_uuids is not None and set(benchmark.gpu_uuids) != {
        g.uuid for g in machine.gpus
    }:
        out.append(Text("the GPUs changed since benchmark run {run}", run=benchmark.run_id))
    return out


def compare(advice: tuple[Advice, ...] | list[Advice], profile_flags: list[str]) -> list[dict]:
    """Each advised flag beside a profile's: "not set" (advised, absent), "different" or "same".

    Advice to leave a flag unset is "same" when the profile leaves it out too.
    """
    given, _ = split_flags(profile_flags)
    have = given.as_dict()
    out = []
    for a in advice:
        present = a.flag in have
        shown = "on" if present and have[a.flag] is None else have.get(a.flag)
        if a.value is None or a.value is False:
            state = "different" if present else "same"
        elif not present:
            state = "not set"
        elif a.value is True:
            state = "same" if have[a.flag] is None else "different"
        else:
            state = "same" if have[a.flag] == a.value else "different"
        out.append(
            {
                "flag": a.flag,
                "recommended": a.value,
                "profile": shown if present else None,
                "state": state,
            }
        )
    return out
