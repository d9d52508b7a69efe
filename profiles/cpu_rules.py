"""Recommended without a GPU: everything in RAM, the experts run by the CPU kernel where they lie,
the device budget sized to what the flags plan, and the checkpoint's dtype when float32 would not
fit."""

from __future__ import annotations

from ..engine.config.args import CPU_DEFAULT_BUDGET_BYTES
from ..engine.config.memory import VramPlan, kv_bytes_per_token
from ..engine.model.spec import ModelSpec
from ..engine.text import Text
from .advice import (
    RAM_RESERVE_BYTES,
    Advice,
    bank_bytes,
    context_tiers,
    flags_of,
    gib,
    ram_warnings,
    threads_advice,
    try_plan,
)
from .machine import Machine

MIB = 1024**2


def cpu_rules(
    machine: Machine, spec: ModelSpec, asked: int | None, expert_dtype: str = "auto"
) -> tuple[list[Advice], list[Text]]:
    advice = [
        Advice("--device", "cpu", Text("no GPU found: the engine runs everything on the CPU")),
        Advice(
            "--moe-cache-size",
            "0",
            Text(
                "on a CPU device a cache would hold a second copy of experts the CPU kernel reads "
                "in place"
            ),
        ),
        Advice(
            "--moe-miss-policy", "cpu", Text("every expert runs where it lies: in RAM, on the CPU")
        ),
    ]
    warnings: list[Text] = []
    reserve = RAM_RESERVE_BYTES
    bank32 = bank_bytes(spec, 4, expert_dtype)
    if spec.dtype_bytes < 4 and bank32 + spec.dense_params * 4 + reserve > machine.ram_total_bytes:
        bank = bank_bytes(spec, spec.dtype_bytes, expert_dtype)
        if bank + spec.dense_params * spec.dtype_bytes + reserve <= machine.ram_total_bytes:
            advice.append(
                Advice(
                    "--dtype",
                    spec.dtype,
                    Text(
                        "in float32 (the engine's choice on a CPU) the experts take {float32}, "
                        "more than the {ram} of RAM allows; the checkpoint's {dtype} halves that "
                        "to {size}",
                        float32=gib(bank32),
                        ram=gib(machine.ram_total_bytes),
                        dtype=spec.dtype,
                        size=gib(bank),
                    ),
                    numbers={"bank_float32_bytes": bank32, "bank_bytes": bank},
                )
            )
    elem = spec.dtype_bytes if any(a.flag == "--dtype" for a in advice) else 4
    bank = bank_bytes(spec, elem, expert_dtype)

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
            chosen, reason = t, Text("the {tokens}-token context asked for", tokens=t)
        else:
            warnings.append(
                Text("a {tokens}-token context does not fit in RAM beside the experts", tokens=t)
            )
    if chosen is None:
        tiers = context_tiers(longest)
        chosen = max((t for t in tiers if needed(t) <= room), default=tiers[0])
        reason = (
            Text("the model's whole context ({tokens} tokens)", tokens=longest)
            if chosen == longest
            else Text(
                "the largest tier whose KV fits in RAM beside the experts ({tokens} tokens)",
                tokens=chosen,
            )
        )
    kv = chosen * kv_bytes_per_token(spec, elem)
    advice.append(
        Advice(
            "--kv-reserve-tokens",
            str(chosen),
            Text("{reason}: {size} of KV in RAM", reason=reason, size=gib(kv)),
            numbers={"kv_tokens": chosen, "kv_bytes": kv},
        )
    )
    device_bytes = -(-needed(chosen) // MIB) * MIB
    if device_bytes > CPU_DEFAULT_BUDGET_BYTES:
        advice.append(
            Advice(
                "--device-memory",
                f"{device_bytes // MIB}MiB",
                Text(
                    "what these flags plan on the CPU device (weights, KV, buffers, headroom), "
                    "{size}: the engine's default of {default} cannot hold them",
                    size=gib(device_bytes),
                    default=gib(CPU_DEFAULT_BUDGET_BYTES),
                ),
                numbers={"device_bytes": device_bytes},
            )
        )
    advice.append(threads_advice(machine))
    warnings += ram_warnings(machine, bank, Text("in RAM"), device_bytes)
    return advice, warnings
