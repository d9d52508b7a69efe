"""The rules behind Recommended: each advised flag from the machine's measurements and the
checkpoint's geometry, with its reason in words and the numbers it rests on.

On a GPU: the GPU with the most memory; the prefill chunk from the memory left after the weights;
the KV reserve for the context (the model's own when the expert cache keeps at least 10% of all
experts, else the largest tier that does); running requests from the cache's share and the KV;
the expert cache left to the engine; CPU threads and the miss policy from the measured rates; a
warning when the expert pool does not fit in RAM. Without a GPU: everything in RAM, experts run
by the CPU kernel in place, the device budget sized to what the flags need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..engine.memory import MemoryPlanError, VramPlan, activation_bytes
from ..engine.spec import ModelSpec
from .flags import catalog, validate_flags
from .machine import CPU_DEFAULT_BUDGET_BYTES, GIB, Gpu, Machine, choose_device, plan_for

CHUNK_TOKENS = (512, 1024, 2048, 4096, 8192)
ACTIVATION_SHARE = 1 / 8  # of the memory left after the weights, at most, for prefill activations
SLOT_FLOOR_SHARE = 0.10  # the expert cache should hold at least this share of all experts
FIRST_TIER_TOKENS = 2048
RAM_RESERVE_BYTES = 4 * GIB  # left to the system, the desktop and mgr
SMALL_CACHE_SHARE = 0.25  # below this, unrelated requests evict each other's experts
TOKENS_PER_REQUEST = 2048  # a typical conversation a running request needs KV for
THREADS_NEAR_BEST = 0.95
MIB = 1024**2


@dataclass(frozen=True, slots=True)
class Advice:
    """One advised flag: a value to set (text), True (switch on), False or None (leave unset),
    why, whether a measurement or a rule decided it, and the numbers behind it."""

    flag: str
    value: str | bool | None
    reason: str
    source: str = "rule"  # "rule" or "measured"
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "flag": self.flag,
            "value": self.value,
            "reason": self.reason,
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


def rule_advice(
    machine: Machine, spec: ModelSpec, context_tokens: int | None = None
) -> tuple[list[Advice], list[str]]:
    """The advice of every rule, and warnings, for `spec` on `machine`."""
    if machine.gpus:
        return _gpu_rules(machine, spec, context_tokens)
    return _cpu_rules(machine, spec, context_tokens)


def _flags_of(advice: list[Advice]) -> list[str]:
    out: list[str] = []
    for a in advice:
        if a.value is True:
            out.append(a.flag)
        elif isinstance(a.value, str):
            out += [a.flag, a.value]
    return out


def _try_plan(machine: Machine, spec: ModelSpec, flags: list[str], **kw: int) -> VramPlan | str:
    """The engine's plan under `flags`, or why it does not fit."""
    ns = validate_flags(flags)
    try:
        return plan_for(spec, choose_device(machine, spec, ns), ns, **kw)
    except MemoryPlanError as err:
        return str(err)


# ---- on a GPU --------------------------------------------------------------------------------


def _gpu_rules(
    machine: Machine, spec: ModelSpec, context_tokens: int | None
) -> tuple[list[Advice], list[str]]:
    gpu = max(machine.gpus, key=lambda g: (g.usable_bytes, -g.index))
    advice: list[Advice] = []
    if len(machine.gpus) > 1:
        advice.append(
            Advice(
                "--device",
                f"cuda:{gpu.index}",
                f"{len(machine.gpus)} GPUs, and one engine runs on one (layers are not split "
                f"across GPUs yet): GPU {gpu.index} ({gpu.name}) has the most memory, "
                f"{gib(gpu.usable_bytes)}; the other can serve a second model",
                numbers={f"gpu{g.index}_bytes": g.usable_bytes for g in machine.gpus},
            )
        )
    advice.append(_chunk_advice(spec, gpu))
    context, plan, warnings = _context_advice(machine, spec, _flags_of(advice), context_tokens)
    if plan is None:
        return advice, warnings
    assert context is not None
    advice.append(context)
    advice.append(_running_advice(spec, plan))
    final = _try_plan(machine, spec, _flags_of(advice))
    plan = final if isinstance(final, VramPlan) else plan
    advice.append(_cache_advice(plan, gpu))
    threads = _threads_advice(machine)
    advice.append(threads)
    advice.append(_policy_advice(machine, plan, int(str(threads.value))))
    bank = spec.experts_total * spec.expert_params * spec.dtype_bytes
    warnings += _ram_warnings(machine, bank, "pinned, so it never swaps", 0)
    return advice, warnings


def _chunk_advice(spec: ModelSpec, gpu: Gpu) -> Advice:
    elem = spec.dtype_bytes
    room = gpu.usable_bytes - spec.dense_params * elem
    limit = room * ACTIVATION_SHARE
    running = catalog()["--max-running-requests"].default
    sizes = [c for c in CHUNK_TOKENS if c <= max(CHUNK_TOKENS[0], spec.max_position_embeddings)]
    chunk = sizes[0]
    for c in sizes:
        if activation_bytes(spec, c, running, elem) <= limit:
            chunk = c
    act = activation_bytes(spec, chunk, running, elem)
    return Advice(
        "--prefill-chunk-tokens",
        str(chunk),
        f"each prefill chunk streams every expert of every layer once "
        f"({gib(spec.expert_pool_bytes)} for this model), so longer chunks amortize it; "
        f"{chunk} tokens need {gib(act)} of activations, within 1/8 of the "
        f"{gib(room)} left after the weights",
        numbers={"activation_bytes": act, "room_bytes": room, "chunk_tokens": chunk},
    )


def _context_advice(
    machine: Machine, spec: ModelSpec, flags: list[str], asked: int | None
) -> tuple[Advice | None, VramPlan | None, list[str]]:
    """The KV reserve: the context asked, else the model's own when it leaves 10% of the experts
    as slots, else the largest tier that does, else the engine's default with a warning."""
    total = spec.experts_total
    need = math.ceil(SLOT_FLOOR_SHARE * total)
    longest = spec.max_position_embeddings
    warnings: list[str] = []

    def numbers(t: int, p: VramPlan) -> dict[str, Any]:
        return {
            "kv_tokens": t,
            "kv_bytes": p.kv_bytes,
            "slots": p.slots,
            "experts_total": total,
            "slot_share": round(p.slots / total, 4),
            "context_tokens": p.max_context,
        }

    def slots_text(p: VramPlan) -> str:
        return f"{p.slots} expert slots ({p.slots / total:.0%} of {total} experts)"

    if asked is not None:
        if asked > longest:
            warnings.append(f"the model supports at most {longest} tokens; planned for that")
        t = min(asked, longest)
        p = _try_plan(machine, spec, flags, kv_tokens=t)
        if isinstance(p, VramPlan):
            if p.slots < need and not p.all_resident:
                warnings.append(
                    f"a {t}-token context leaves only {slots_text(p)}, under 10%: decoding will "
                    "wait on expert copies; a shorter context gives the cache more room"
                )
            reason = f"the {t}-token context asked for: {gib(p.kv_bytes)} of KV, leaving " + (
                slots_text(p)
            )
            return Advice("--kv-reserve-tokens", str(t), reason, numbers=numbers(t, p)), p, warnings
        warnings.append(f"a {t}-token context does not fit ({p}); chose one by the rule instead")

    plans = {t: _try_plan(machine, spec, flags, kv_tokens=t) for t in context_tiers(longest)}
    fitting = {t: p for t, p in plans.items() if isinstance(p, VramPlan)}
    if not fitting:
        smallest = plans[min(plans)]
        warnings.append(f"this model does not fit on this device at any context: {smallest}")
        return None, None, warnings
    chosen = next((t for t in sorted(fitting, reverse=True) if fitting[t].slots >= need), None)
    if chosen == longest:
        p = fitting[chosen]
        reason = (
            f"the model's whole context ({longest} tokens, {gib(p.kv_bytes)} of KV) still "
            f"leaves {slots_text(p)}, at least 10%"
        )
    elif chosen is not None:
        p = fitting[chosen]
        full = plans[longest]
        cost = (
            f"would leave only {slots_text(full)}" if isinstance(full, VramPlan) else "does not fit"
        )
        reason = (
            f"the model's whole context ({longest} tokens) {cost}; {chosen} tokens is the "
            f"largest tier that leaves at least 10%: {slots_text(p)}"
        )
    else:
        default = catalog()["--kv-reserve-tokens"].default
        chosen = max((t for t in fitting if t <= default), default=min(fitting))
        p = fitting[chosen]
        reason = (
            f"no context leaves 10% of the experts ({need} slots) beside the weights; "
            f"{chosen} tokens keeps the most usable context without giving up more slots: "
            f"{slots_text(p)}"
        )
        warnings.append(
            f"fewer than 10% of the experts fit in the GPU cache at any context ({slots_text(p)} "
            f"at {chosen} tokens): most of every decode step waits on host RAM; a GPU with more "
            "memory or a smaller checkpoint decodes much faster"
        )
    return (
        Advice("--kv-reserve-tokens", str(chosen), reason, numbers=numbers(chosen, p)),
        p,
        warnings,
    )


def _running_advice(spec: ModelSpec, plan: VramPlan) -> Advice:
    running = catalog()["--max-running-requests"].default
    share = plan.slots / plan.experts_total
    reasons = []
    if not plan.all_resident and share < SMALL_CACHE_SHARE:
        running = 4
        reasons.append(
            f"the cache holds {share:.0%} of the experts: unrelated requests route to different "
            "experts and evict each other's, so fewer run together"
        )
    fits = max(1, plan.kv_tokens // TOKENS_PER_REQUEST)
    if fits < running:
        running = fits
        reasons.append(
            f"the KV reserve of {plan.kv_tokens} tokens holds {fits} request(s) of "
            f"{TOKENS_PER_REQUEST} tokens at once"
        )
    if not reasons:
        reasons.append(
            f"the engine's default: the KV reserve of {plan.kv_tokens} tokens holds {running} "
            f"requests of {TOKENS_PER_REQUEST} tokens"
            + (", and every expert is resident" if plan.all_resident else "")
        )
    return Advice(
        "--max-running-requests",
        str(running),
        "; ".join(reasons),
        numbers={"kv_tokens": plan.kv_tokens, "slot_share": round(share, 4)},
    )


def _cache_advice(plan: VramPlan, gpu: Gpu) -> Advice:
    numbers = {
        "slots": plan.slots,
        "experts_total": plan.experts_total,
        "expert_cache_bytes": plan.expert_cache_bytes,
    }
    if plan.all_resident:
        reason = (
            f"every expert fits: {plan.experts_total} slots, {gib(plan.expert_cache_bytes)}; "
            "nothing is copied while decoding"
        )
    else:
        reason = (
            "left to the engine, which gives the expert cache what remains after the weights, "
            f"KV and buffers: about {plan.slots} slots ({plan.slots / plan.experts_total:.0%} of "
            f"{plan.experts_total} experts, {gib(plan.expert_cache_bytes)}) on "
            f"{gib(gpu.usable_bytes)}; a fixed number would stop the engine from starting when "
            "a little less memory is free"
        )
    return Advice("--moe-cache-size", None, reason, numbers=numbers)


def _threads_advice(machine: Machine) -> Advice:
    cap = machine.default_cpu_threads
    rates = machine.rates.cpu_experts_gbps if machine.rates else {}
    usable = {t: r for t, r in rates.items() if t <= cap}
    if not usable:
        return Advice(
            "--moe-cpu-threads",
            str(cap),
            f"not measured yet: one thread per physical core ({machine.physical_cores}) less one "
            + (
                "that keeps feeding the GPU"
                if machine.gpus
                else "that runs the rest of each step (attention, routing)"
            )
            + ", the engine's default",
            numbers={"physical_cores": machine.physical_cores},
        )
    best_t = max(usable, key=lambda t: (usable[t], -t))
    best = usable[best_t]
    chosen = min(t for t, r in usable.items() if r >= THREADS_NEAR_BEST * best)
    if chosen == best_t:
        reason = (
            f"{chosen} threads run experts fastest of those measured ({best:.1f} GB/s), within "
            f"the {machine.physical_cores} physical cores less one"
        )
    else:
        reason = (
            f"{chosen} threads run experts at {usable[chosen]:.1f} GB/s, "
            f"{usable[chosen] / best:.0%} of the best measured ({best:.1f} GB/s at {best_t}); "
            "more threads add little and take cores from the rest"
        )
    return Advice(
        "--moe-cpu-threads",
        str(chosen),
        reason,
        "measured",
        numbers={f"cpu_experts_gbps_{t}": round(r, 3) for t, r in sorted(usable.items())},
    )


def _policy_advice(machine: Machine, plan: VramPlan, threads: int) -> Advice:
    if plan.all_resident:
        return Advice("--moe-miss-policy", "auto", "every expert fits in VRAM: no misses to place")
    rates = machine.rates
    cpu = rates.cpu_rate(threads) if rates else None
    if rates is None or rates.h2d_gbps is None or cpu is None:
        return Advice(
            "--moe-miss-policy",
            "auto",
            "not measured yet: the engine measures both rates for a few seconds at start and "
            "splits misses by them; measure the hardware for a lasting choice",
        )
    bp, (t, bh) = rates.h2d_gbps, cpu
    numbers: dict[str, Any] = {"h2d_gbps": round(bp, 3), "cpu_experts_gbps": round(bh, 3)}
    together = (rates.h2d_concurrent_gbps, rates.cpu_concurrent_gbps)
    if together[0] is not None and together[1] is not None and sum(together) <= bp:
        numbers.update(h2d_concurrent_gbps=together[0], cpu_concurrent_gbps=together[1])
        return Advice(
            "--moe-miss-policy",
            "gpu",
            f"running experts on the CPU slows the copies more than it adds: together "
            f"{together[0]:.1f} + {together[1]:.1f} GB/s, no more than {bp:.1f} GB/s copying "
            "alone",
            "measured",
            numbers,
        )
    fetch = bp / (bp + bh)
    numbers["fetch_fraction"] = round(fetch, 4)
    return Advice(
        "--moe-miss-policy",
        "auto",
        f"misses split by the measured rates: copies {bp:.1f} GB/s, CPU experts {bh:.1f} GB/s "
        f"at {t} threads, so {fetch:.0%} of misses are fetched and the rest run on the CPU at "
        "the same time",
        "measured",
        numbers,
    )


def _ram_warnings(machine: Machine, bank_bytes: int, how: str, other_bytes: int) -> list[str]:
    ram = machine.ram_total_bytes
    need = bank_bytes + other_bytes
    if need > ram:
        return [
            f"the expert pool ({gib(bank_bytes)}) does not fit in {gib(ram)} of RAM"
            + (f" beside {gib(other_bytes)} of weights and KV" if other_bytes else "")
            + ": the engine cannot hold this model; use a machine with more RAM or a smaller "
            "checkpoint"
        ]
    if need > ram - RAM_RESERVE_BYTES:
        return [
            f"the expert pool ({gib(bank_bytes)}, {how}) leaves less than "
            f"{gib(RAM_RESERVE_BYTES)} of the {gib(ram)} of RAM for everything else: expect "
            "swapping, or the engine being killed"
        ]
    return []


# ---- without a GPU ---------------------------------------------------------------------------


def _cpu_rules(
    machine: Machine, spec: ModelSpec, asked: int | None
) -> tuple[list[Advice], list[str]]:
    advice = [
        Advice("--device", "cpu", "no GPU found: the engine runs everything on the CPU"),
        Advice(
            "--moe-cache-size",
            "0",
            "on a CPU device a cache would hold a second copy of experts the CPU kernel reads "
            "in place",
        ),
        Advice("--moe-miss-policy", "cpu", "every expert runs where it lies: in RAM, on the CPU"),
    ]
    warnings: list[str] = []
    reserve = RAM_RESERVE_BYTES
    bank32 = spec.experts_total * spec.expert_params * 4
    if spec.dtype_bytes < 4 and bank32 + spec.dense_params * 4 + reserve > machine.ram_total_bytes:
        bank = spec.experts_total * spec.expert_params * spec.dtype_bytes
        if bank + spec.dense_params * spec.dtype_bytes + reserve <= machine.ram_total_bytes:
            advice.append(
                Advice(
                    "--dtype",
                    spec.dtype,
                    f"in float32 (the engine's choice on a CPU) the experts take {gib(bank32)}, "
                    f"more than the {gib(machine.ram_total_bytes)} of RAM allows; the "
                    f"checkpoint's {spec.dtype} halves that to {gib(bank)}",
                    numbers={"bank_float32_bytes": bank32, "bank_bytes": bank},
                )
            )
    elem = spec.dtype_bytes if any(a.flag == "--dtype" for a in advice) else 4
    bank = spec.experts_total * spec.expert_params * elem

    def needed(t: int) -> int:
        """Device bytes the flags plan with a `t`-token KV reserve (nothing left over)."""
        p = _try_plan(machine, spec, _flags_of(advice), kv_tokens=t, budget_bytes=1 << 50)
        assert isinstance(p, VramPlan), p  # an unbounded budget always fits
        return p.budget_bytes - p.unplanned_bytes

    room = machine.ram_total_bytes - RAM_RESERVE_BYTES - bank
    longest = spec.max_position_embeddings
    chosen = None
    if asked is not None:
        t = min(asked, longest)
        if needed(t) <= room:
            chosen, reason = t, f"the {t}-token context asked for"
        else:
            warnings.append(f"a {t}-token context does not fit in RAM beside the experts")
    if chosen is None:
        tiers = context_tiers(longest)
        chosen = max((t for t in tiers if needed(t) <= room), default=tiers[0])
        reason = (
            f"the model's whole context ({longest} tokens)"
            if chosen == longest
            else f"the largest tier whose KV fits in RAM beside the experts ({chosen} tokens)"
        )
    kv = chosen * 2 * spec.num_layers * spec.kv_size * elem
    advice.append(
        Advice(
            "--kv-reserve-tokens",
            str(chosen),
            f"{reason}: {gib(kv)} of KV in RAM",
            numbers={"kv_tokens": chosen, "kv_bytes": kv},
        )
    )
    device_bytes = -(-needed(chosen) // MIB) * MIB
    if device_bytes > CPU_DEFAULT_BUDGET_BYTES:
        advice.append(
            Advice(
                "--device-memory",
                f"{device_bytes // MIB}MiB",
                f"what these flags plan on the CPU device (weights, KV, buffers, headroom), "
                f"{gib(device_bytes)}: the engine's default of "
                f"{gib(CPU_DEFAULT_BUDGET_BYTES)} cannot hold them",
                numbers={"device_bytes": device_bytes},
            )
        )
    advice.append(_threads_advice(machine))
    warnings += _ram_warnings(machine, bank, "in RAM", device_bytes)
    return advice, warnings
