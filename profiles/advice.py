"""What the rules of Recommended share: one piece of advice, the context tiers, the engine's plan
under a set of advice, the CPU thread count from the measured rates, and the RAM warnings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.config.memory import MemoryPlanError, VramPlan
from ..engine.model.spec import ModelSpec
from ..engine.text import Text, error_text, text_fields
from .flags import engine_config
from .machine import GIB, Machine, choose_device, plan_for

FIRST_TIER_TOKENS = 2048
RAM_RESERVE_BYTES = 4 * GIB  # left to the system, the desktop and mgr
THREADS_NEAR_BEST = 0.95


@dataclass(frozen=True, slots=True)
class Advice:
    """One advised flag: a value to set (text), True (switch on), False or None (leave unset),
    why, whether a measurement or a rule decided it, and the numbers behind it."""

    flag: str
    value: str | bool | None
    reason: Text | str
    source: str = "rule"  # "rule" or "measured"
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "flag": self.flag,
            "value": self.value,
            **text_fields("reason", self.reason),
            "source": self.source,
            "numbers": self.numbers,
        }


def context_tiers(max_context: int) -> list[int]:
    """Context sizes tried for the KV reserve: 2048, 4096, ... below the model's own, then it."""
    tiers = []
    t = FIRST_TIER_TOKENS
    while t < max_context:
        tiers.append(t)
        t *= 2
    return [*tiers, max_context]


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def flags_of(advice: list[Advice]) -> list[str]:
    out: list[str] = []
    for a in advice:
        if a.value is True:
            out.append(a.flag)
        elif isinstance(a.value, str):
            out += [a.flag, a.value]
    return out


def try_plan(
    machine: Machine, spec: ModelSpec, flags: list[str], **kw: int
) -> VramPlan | Text | str:
    """The engine's plan under `flags`, or why it does not fit."""
    config = engine_config(flags)
    try:
        return plan_for(spec, choose_device(machine, spec, config), config, **kw)
    except MemoryPlanError as err:
        return error_text(err)


# ---- on a GPU --------------------------------------------------------------------------------


def threads_advice(machine: Machine) -> Advice:
    cap = machine.default_cpu_threads
    rates = machine.rates.cpu_experts_gbps if machine.rates else {}
    usable = {t: r for t, r in rates.items() if t <= cap}
    if not usable:
        return Advice(
            "--moe-cpu-threads",
            str(cap),
            Text(
                "not measured yet: one thread per physical core ({cores}) less one that keeps "
                "feeding the GPU, the engine's default",
                cores=machine.physical_cores,
            )
            if machine.gpus
            else Text(
                "not measured yet: one thread per physical core ({cores}) less one that runs the "
                "rest of each step (attention, routing), the engine's default",
                cores=machine.physical_cores,
            ),
            numbers={"physical_cores": machine.physical_cores},
        )
    best_t = max(usable, key=lambda t: (usable[t], -t))
    best = usable[best_t]
    chosen = min(t for t, r in usable.items() if r >= THREADS_NEAR_BEST * best)
    if chosen == best_t:
        reason = Text(
            "{threads} threads run experts fastest of those measured ({best:.1f} GB/s), within "
            "the {cores} physical cores less one",
            threads=chosen,
            best=best,
            cores=machine.physical_cores,
        )
    else:
        reason = Text(
            "{threads} threads run experts at {rate:.1f} GB/s, {share:.0%} of the best measured "
            "({best:.1f} GB/s at {best_threads}); more threads add little and take cores from "
            "the rest",
            threads=chosen,
            rate=usable[chosen],
            share=usable[chosen] / best,
            best=best,
            best_threads=best_t,
        )
    return Advice(
        "--moe-cpu-threads",
        str(chosen),
        reason,
        "measured",
        numbers={f"cpu_experts_gbps_{t}": round(r, 3) for t, r in sorted(usable.items())},
    )


def bank_bytes(spec: ModelSpec, elem_bytes: int, expert_dtype: str = "auto") -> int:
    """The host bank of the checkpoint's experts as the engine holds them under
    --moe-expert-dtype `expert_dtype`: FP8 values and their factors, else `elem_bytes` a
    weight."""
    return spec.experts_total * spec.expert_bytes_as(spec.expert_format(expert_dtype), elem_bytes)


def ram_warnings(machine: Machine, bank_bytes: int, how: Text, other_bytes: int) -> list[Text]:
    ram = machine.ram_total_bytes
    need = bank_bytes + other_bytes
    if need > ram and other_bytes:
        return [
            Text(
                "the expert pool ({pool}) does not fit in {ram} of RAM beside {other} of weights "
                "and KV: the engine cannot hold this model; use a machine with more RAM or a "
                "smaller checkpoint",
                pool=gib(bank_bytes),
                ram=gib(ram),
                other=gib(other_bytes),
            )
        ]
    if need > ram:
        return [
            Text(
                "the expert pool ({pool}) does not fit in {ram} of RAM: the engine cannot hold "
                "this model; use a machine with more RAM or a smaller checkpoint",
                pool=gib(bank_bytes),
                ram=gib(ram),
            )
        ]
    if need > ram - RAM_RESERVE_BYTES:
        return [
            Text(
                "the expert pool ({pool}, {how}) leaves less than {reserve} of the {ram} of RAM "
                "for everything else: expect swapping, or the engine being killed",
                pool=gib(bank_bytes),
                how=how,
                reserve=gib(RAM_RESERVE_BYTES),
                ram=gib(ram),
            )
        ]
    return []


# ---- without a GPU ---------------------------------------------------------------------------
