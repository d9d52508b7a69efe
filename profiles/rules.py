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

from ..engine.config.memory import VramPlan, activation_bytes
from ..engine.model.spec import ModelSpec
from ..engine.text import Text
from .advice import (
    Advice,
    bank_bytes,
    context_tiers,
    flags_of,
    gib,
    ram_warnings,
    threads_advice,
    try_plan,
)
from .cpu_rules import cpu_rules
from .flags import catalog
from .machine import Gpu, Machine

CHUNK_TOKENS = (512, 1024, 2048, 4096, 8192)
ACTIVATION_SHARE = 1 / 8  # of the memory left after the weights, at most, for prefill activations
SLOT_FLOOR_SHARE = 0.10  # the expert cache should hold at least this share of all experts
SMALL_CACHE_SHARE = 0.25  # below this, unrelated requests evict each other's experts
TOKENS_PER_REQUEST = 2048  # a typical conversation a running request needs KV for


def rule_advice(
    machine: Machine,
    spec: ModelSpec,
    context_tokens: int | None = None,
    expert_dtype: str = "auto",
) -> tuple[list[Advice], list[Text]]:
    """The advice of every rule, and warnings, for `spec` on `machine`, its experts held as
    --moe-expert-dtype `expert_dtype` says."""
    if machine.gpus:
        return _gpu_rules(machine, spec, context_tokens, expert_dtype)
    return cpu_rules(machine, spec, context_tokens, expert_dtype)


def _gpu_rules(
    machine: Machine, spec: ModelSpec, context_tokens: int | None, expert_dtype: str
) -> tuple[list[Advice], list[Text]]:
    gpu = max(machine.gpus, key=lambda g: (g.usable_bytes, -g.index))
    advice: list[Advice] = []
    if len(machine.gpus) > 1:
        advice.append(
            Advice(
                "--device",
                f"cuda:{gpu.index}",
                Text(
                    "{n} GPUs, and one engine runs on one (layers are not split across GPUs "
                    "yet): GPU {index} ({name}) has the most memory, {size}; the other can serve "
                    "a second model",
                    n=len(machine.gpus),
                    index=gpu.index,
                    name=gpu.name,
                    size=gib(gpu.usable_bytes),
                ),
                numbers={f"gpu{g.index}_bytes": g.usable_bytes for g in machine.gpus},
            )
        )
    advice.append(_chunk_advice(spec, gpu, expert_dtype))
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
    bank = bank_bytes(spec, spec.dtype_bytes, expert_dtype)
    warnings += ram_warnings(machine, bank, Text("pinned, so it never swaps"), 0)
    return advice, warnings


def _chunk_advice(spec: ModelSpec, gpu: Gpu, expert_dtype: str) -> Advice:
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
        Text(
            "each prefill chunk streams every expert of every layer once ({pool} for this "
            "model), so longer chunks amortize it; {chunk} tokens need {activations} of "
            "activations, within 1/8 of the {room} left after the weights",
            pool=gib(bank_bytes(spec, elem, expert_dtype)),
            chunk=chunk,
            activations=gib(act),
            room=gib(room),
        ),
        numbers={"activation_bytes": act, "room_bytes": room, "chunk_tokens": chunk},
    )


def _context_advice(
    machine: Machine, spec: ModelSpec, flags: list[str], asked: int | None
) -> tuple[Advice | None, VramPlan | None, list[Text]]:
    """The KV reserve: the context asked, else the model's own when it leaves 10% of the experts
    as slots, else the largest tier that does, else the engine's default with a warning."""
    total = spec.experts_total
    need = math.ceil(SLOT_FLOOR_SHARE * total)
    longest = spec.max_position_embeddings
    warnings: list[Text] = []

    def numbers(t: int, p: VramPlan) -> dict[str, Any]:
        return {
            "kv_tokens": t,
            "kv_bytes": p.kv_bytes,
            "slots": p.slots,
            "experts_total": total,
            "slot_share": round(p.slots / total, 4),
            "context_tokens": p.max_context,
        }

    def slots_text(p: VramPlan) -> Text:
        return Text(
            "{slots} expert slots ({share:.0%} of {total} experts)",
            slots=p.slots,
            share=p.slots / total,
            total=total,
        )

    if asked is not None:
        if asked > longest:
            warnings.append(
                Text("the model supports at most {tokens} tokens; planned for that", tokens=longest)
            )
        t = min(asked, longest)
        p = try_plan(machine, spec, flags, kv_tokens=t)
        if isinstance(p, VramPlan):
            if p.slots < need and not p.all_resident:
                warnings.append(
                    Text(
                        "a {tokens}-token context leaves only {slots}, under 10%: decoding will "
                        "wait on expert copies; a shorter context gives the cache more room",
                        tokens=t,
                        slots=slots_text(p),
                    )
                )
            reason = Text(
                "the {tokens}-token context asked for: {kv} of KV, leaving {slots}",
                tokens=t,
                kv=gib(p.kv_bytes),
                slots=slots_text(p),
            )
            return Advice("--kv-reserve-tokens", str(t), reason, numbers=numbers(t, p)), p, warnings
        warnings.append(
            Text(
                "a {tokens}-token context does not fit ({error}); chose one by the rule instead",
                tokens=t,
                error=p,
            )
        )

    plans = {t: try_plan(machine, spec, flags, kv_tokens=t) for t in context_tiers(longest)}
    fitting = {t: p for t, p in plans.items() if isinstance(p, VramPlan)}
    if not fitting:
        smallest = plans[min(plans)]
        assert not isinstance(smallest, VramPlan)
        warnings.append(
            Text("this model does not fit on this device at any context: {error}", error=smallest)
        )
        return None, None, warnings
    chosen = next((t for t in sorted(fitting, reverse=True) if fitting[t].slots >= need), None)
    if chosen == longest:
        p = fitting[chosen]
        reason = Text(
            "the model's whole context ({tokens} tokens, {kv} of KV) still leaves {slots}, at "
            "least 10%",
            tokens=longest,
            kv=gib(p.kv_bytes),
            slots=slots_text(p),
        )
    elif chosen is not None:
        p = fitting[chosen]
        full = plans[longest]
        cost = (
            Text("would leave only {slots}", slots=slots_text(full))
            if isinstance(full, VramPlan)
            else Text("does not fit")
        )
        reason = Text(
            "the model's whole context ({tokens} tokens) {cost}; {chosen} tokens is the largest "
            "tier that leaves at least 10%: {slots}",
            tokens=longest,
            cost=cost,
            chosen=chosen,
            slots=slots_text(p),
        )
    else:
        default = catalog()["--kv-reserve-tokens"].default
        chosen = max((t for t in fitting if t <= default), default=min(fitting))
        p = fitting[chosen]
        reason = Text(
            "no context leaves 10% of the experts ({need} slots) beside the weights; {chosen} "
            "tokens keeps the most usable context without giving up more slots: {slots}",
            need=need,
            chosen=chosen,
            slots=slots_text(p),
        )
        warnings.append(
            Text(
                "fewer than 10% of the experts fit in the GPU cache at any context ({slots} at "
                "{tokens} tokens): most of every decode step waits on host RAM; a GPU with more "
                "memory or a smaller checkpoint decodes much faster",
                slots=slots_text(p),
                tokens=chosen,
            )
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
            Text(
                "the cache holds {share:.0%} of the experts: unrelated requests route to "
                "different experts and evict each other's, so fewer run together",
                share=share,
            )
        )
    fits = max(1, plan.kv_tokens // TOKENS_PER_REQUEST)
    if fits < running:
        running = fits
        reasons.append(
            Text(
                "the KV reserve of {kv_tokens} tokens holds {fits} request(s) of {tokens} tokens "
                "at once",
                kv_tokens=plan.kv_tokens,
                fits=fits,
                tokens=TOKENS_PER_REQUEST,
            )
        )
    if not reasons:
        default = Text(
            "the engine's default: the KV reserve of {kv_tokens} tokens holds {running} requests "
            "of {tokens} tokens",
            kv_tokens=plan.kv_tokens,
            running=running,
            tokens=TOKENS_PER_REQUEST,
        )
        if plan.all_resident:
            default = Text("{default}, and every expert is resident", default=default)
        reasons.append(default)
    return Advice(
        "--max-running-requests",
        str(running),
        Text("{reasons}", reasons=reasons),  # one after another
        numbers={"kv_tokens": plan.kv_tokens, "slot_share": round(share, 4)},
    )


def _cache_advice(plan: VramPlan, gpu: Gpu) -> Advice:
    numbers = {
        "slots": plan.slots,
        "experts_total": plan.experts_total,
        "expert_cache_bytes": plan.expert_cache_bytes,
    }
    if plan.all_resident:
        reason = Text(
            "every expert fits: {slots} slots, {size}; nothing is copied while decoding",
            slots=plan.experts_total,
            size=gib(plan.expert_cache_bytes),
        )
    else:
        reason = Text(
            "left to the engine, which gives the expert cache what remains after the weights, "
            "KV and buffers: about {slots} slots ({share:.0%} of {total} experts, {size}) on "
            "{memory}; a fixed number would stop the engine from starting when a little less "
            "memory is free",
            slots=plan.slots,
            share=plan.slots / plan.experts_total,
            total=plan.experts_total,
            size=gib(plan.expert_cache_bytes),
            memory=gib(gpu.usable_bytes),
        )
    return Advice("--moe-cache-size", None, reason, numbers=numbers)


def _policy_advice(machine: Machine, plan: VramPlan, threads: int) -> Advice:
    if plan.all_resident:
        return Advice(
            "--moe-miss-policy", "auto", Text("every expert fits in VRAM: no misses to place")
        )
    rates = machine.rates
    cpu = rates.cpu_rate(threads) if rates else None
    if rates is None or rates.h2d_gbps is None or cpu is None:
        return Advice(
            "--moe-miss-policy",
            "auto",
            Text(
                "not measured yet: the engine measures both rates for a few seconds at start and "
                "splits misses by them; measure the hardware for a lasting choice"
            ),
        )
    bp, (t, bh) = rates.h2d_gbps, cpu
    numbers: dict[str, Any] = {"h2d_gbps": round(bp, 3), "cpu_experts_gbps": round(bh, 3)}
    together = (rates.h2d_concurrent_gbps, rates.cpu_concurrent_gbps)
    if together[0] is not None and together[1] is not None and sum(together) <= bp:
        numbers.update(h2d_concurrent_gbps=together[0], cpu_concurrent_gbps=together[1])
        return Advice(
            "--moe-miss-policy",
            "gpu",
            Text(
                "running experts on the CPU slows the copies more than it adds: together "
                "{copies:.1f} + {cpu:.1f} GB/s, no more than {bp:.1f} GB/s copying alone",
                copies=together[0],
                cpu=together[1],
                bp=bp,
            ),
            "measured",
            numbers,
        )
    fetch = bp / (bp + bh)
    numbers["fetch_fraction"] = round(fetch, 4)
    return Advice(
        "--moe-miss-policy",
        "auto",
        Text(
            "misses split by the measured rates: copies {bp:.1f} GB/s, CPU experts {bh:.1f} "
            "GB/s at {threads} threads, so {fetch:.0%} of misses are fetched and the rest run on "
            "the CPU at the same time",
            bp=bp,
            bh=bh,
            threads=t,
            fetch=fetch,
        ),
        "measured",
        numbers,
    )
