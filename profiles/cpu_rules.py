"""Recommended without a GPU: everything in RAM, the experts run by the CPU kernel where they lie,
the device budget sized to what the flags plan, and the checkpoint's dtype when float32 would not
fit."""

from __future__ import annotations

from ..engine.memory import VramPlan
from ..engine.spec import ModelSpec
from .advice import (
    RAM_RESERVE_BYTES,
    Advice,
    context_tiers,
    flags_of,
    gib,
    ram_warnings,
    threads_advice,
    try_plan,
)
from .machine import CPU_DEFAULT_BUDGET_BYTES, Machine

MIB = 1024**2


def cpu_rules(
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
        p = try_plan(machine, spec, flags_of(advice), kv_tokens=t, budget_bytes=1 << 50)
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
    advice.append(threads_advice(machine))
    warnings += ram_warnings(machine, bank, "in RAM", device_bytes)
    return advice, warnings
