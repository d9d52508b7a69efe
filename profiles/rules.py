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
from typing import Any

from ..engine.memory import VramPlan, activation_bytes
from ..engine.spec import ModelSpec
from .advice import Advice, context_tiers, flags_of, gib, ram_warnings, threads_advice, try_plan
from .cpu_rules import cpu_rules
from .flags import catalog
from .machine import Gpu, Machine

CHUNK_TOKENS = (512, 1024, 2048, 4096, 8192)
ACTIVATION_SHARE = 1 / 8  # of the memory left after the weights, at most, for prefill activations
SLOT_FLOOR_SHARE = 0.10  # the expert cache should hold at least this share of all experts
SMALL_CACHE_SHARE = 0.25  # below this, unrelated requests evict each other's experts
TOKENS_PER_REQUEST = 2048  # a typical conversation a running request needs KV for


def rule_advice(
    machine: Machine, spec: ModelSpec, context_tokens: int | None = None
) -> tuple[list[Advice], list[str]]:
    """The advice of every rule, and warnings, for `spec` on `machine`."""
    if machine.gpus:
        return _gpu_rules(machine, spec, context_tokens)
    return cpu_rules(machine, spec, context_tokens)


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
    context, plan, warnings = _context_advice(machine, spec, flags_of(advice), context_tokens)
    if plan is None:
        return advice, warnings
    assert context is not None
    advice.append(context)
    advice.append(_running_advice(spec, plan))
    final = try_plan(machine, spec, flags_of(advice))
    plan = final if isinstance(final, VramPlan) else plan
    advice.append(_cache_advice(plan, gpu))
    threads = threads_advice(machine)
    advice.append(threads)
    advice.append(_policy_advice(machine, plan, int(str(threads.value))))
    bank = spec.experts_total * spec.expert_params * spec.dtype_bytes
    warnings += ram_warnings(machine, bank, "pinned, so it never swaps", 0)
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
        p = try_plan(machine, spec, flags, kv_tokens=t)
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

    plans = {t: try_plan(machine, spec, flags, kv_tokens=t) for t in context_tiers(longest)}
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
