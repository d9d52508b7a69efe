"""Plain-language advice for one engine, read from its numbers; each claim carries its evidence.

The rules look at what the engine measured (hit rate and the decode-step breakdown over the last
minute, what one more miss adds to a step as fitted over its steps, memory in use, the KV reserve
against its peak use, the what-if curve) and at the machine (physical cores). A claim says what to
do in English with `{placeholders}` (translated by the page), and lists the numbers it stands on
with their kind, so every page shows them formatted and the JSON alternate carries them raw.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from .i18n import _

MISS_RATE_HIGH = 0.10  # above this share of reads missing, misses are worth attacking
MISS_TIME_HIGH = 0.25  # share of a decode step spent on copies and CPU-run experts
CPU_TIME_HIGH = 0.40
COPY_TIME_HIGH = 0.40
HIT_RATE_ENOUGH = 0.95
KV_PEAK_LOW = 0.5  # peak KV use below this share of the reserve: the reserve is oversized
KV_MIN_REQUESTS = 5  # fewer completed requests than this say little about the context in use
KV_ROUND_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Number:
    """A number behind a claim: its English label, value, and kind (how to format it)."""

    label: str
    value: float | int | str | None
    kind: str  # percent, bytes, seconds, count, ratio

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "value": self.value, "kind": self.kind}


@dataclass(frozen=True, slots=True)
class Claim:
    """One piece of advice: an English message with placeholders filled from `values`."""

    id: str
    message: str
    values: dict[str, Number] = field(default_factory=dict)
    evidence: tuple[Number, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "message": self.message,
            "values": {k: v.to_json() for k, v in self.values.items()},
            "evidence": [n.to_json() for n in self.evidence],
        }


def whatif_hit_rate(curve: list[dict[str, Any]], slots: float) -> float | None:
    """The what-if curve's hit rate at `slots`, interpolated between its points."""
    points = sorted((p["slots"], p["hit_rate"]) for p in curve if p.get("hit_rate") is not None)
    if not points:
        return None
    if slots <= points[0][0]:
        return points[0][1]
    for (s0, h0), (s1, h1) in itertools.pairwise(points):
        if s0 <= slots <= s1:
            return h0 + (h1 - h0) * (slots - s0) / (s1 - s0) if s1 > s0 else h1
    return points[-1][1]


def device_unplanned_bytes(stats: dict[str, Any]) -> int | None:
    """Device memory neither used nor kept as the plan's headroom (what more slots could use)."""
    memory = stats.get("memory") or {}
    devices = memory.get("device") or []
    if not devices:
        return None
    device = devices[0]
    used = sum(v for k, v in device.items() if k not in ("index", "total") and v)
    headroom = (memory.get("plan") or {}).get("headroom_bytes") or 0
    return max(0, int(device.get("total", 0) - used - headroom))


def advise(stats: dict[str, Any], physical_cores: int | None) -> list[Claim]:
    """The claims one stats body supports, most useful first."""
    experts = stats.get("experts")
    if not experts:
        return [Claim("no_stats", _("This engine runs with --no-stats: it measures no experts."))]
    claims: list[Claim] = []
    hit_rate = experts.get("hit_rate_60s")
    slots = experts.get("slots") or 0
    slot_bytes = experts.get("slot_bytes") or 0
    total_experts = (experts.get("num_layers") or 0) * (experts.get("num_experts") or 0)
    curve = experts.get("whatif") or []
    breakdown = stats.get("breakdown") or {}
    step_s = breakdown.get("step_s") or 0.0
    config = stats.get("config") or {}
    unplanned = device_unplanned_bytes(stats)

    if slots >= total_experts > 0:
        claims.append(
            Claim(
                "all_resident",
                _(
                    "Every expert has a slot ({slots} slots for {experts} experts): a larger "
                    "cache cannot help."
                ),
                {
                    "slots": Number(_("slots"), slots, "count"),
                    "experts": Number(_("experts"), total_experts, "count"),
                },
            )
        )
    if hit_rate is None:
        claims.append(
            Claim(
                "no_traffic",
                _(
                    "No decode traffic in the last minute: send the engine requests, and the "
                    "advice will read what it measures."
                ),
            )
        )
    else:
        claims += _miss_claims(
            hit_rate, slots, slot_bytes, total_experts, curve, _miss_share(experts, breakdown),
            unplanned,
        )  # fmt: skip
        claims += _cpu_claims(breakdown, step_s, config, physical_cores)
    if unplanned is None or unplanned < slot_bytes:  # memory is what limits the cache
        claims += _kv_claims(stats, slots, slot_bytes, total_experts)
    return claims


def _share(breakdown: dict[str, Any], parts: tuple[str, ...], step_s: float) -> float | None:
    if step_s <= 0:
        return None
    return sum(breakdown.get(p) or 0.0 for p in parts) / step_s


def _miss_share(experts: dict[str, Any], breakdown: dict[str, Any]) -> Number:
    """The share of a decode step that misses take: from the engine's fit over all its untimed
    steps (one more miss's cost x misses per step / mean step) once it has one, else from the
    copies and CPU experts of the one step it timed by phase (which runs the phases one after
    another, so copies and CPU work that overlap in a real step both count in full)."""
    fit = experts.get("miss_cost") or {}
    cost, misses, step_us = (fit.get(k) for k in ("us_per_miss", "misses_per_step", "step_us"))
    if cost is not None and misses is not None and step_us:
        share = max(0.0, cost * misses / step_us)
        return Number(_("misses, share of a decode step (fitted over its steps)"), share, "percent")
    share = _share(breakdown, ("copy", "cpu_experts"), breakdown.get("step_s") or 0.0)
    return Number(_("copies and CPU experts, share of a decode step"), share, "percent")


def _miss_claims(
    hit_rate: float,
    slots: int,
    slot_bytes: int,
    total_experts: int,
    curve: list[dict[str, Any]],
    share: Number,
    unplanned: int | None,
) -> list[Claim]:
    miss_rate = 1.0 - hit_rate
    miss_share = share.value
    evidence = (
        Number(_("misses (last 60 s)"), miss_rate, "percent"),
        share,
        Number(_("device memory not planned for anything"), unplanned, "bytes"),
    )
    if slots >= total_experts:
        return []
    room = unplanned is not None and slot_bytes > 0 and unplanned >= slot_bytes
    if miss_rate >= MISS_RATE_HIGH and room:
        assert unplanned is not None
        extra = min(unplanned // slot_bytes, total_experts - slots)
        values = {
            "free": Number(_("free"), unplanned, "bytes"),
            "extra": Number(_("more slots"), extra, "count"),
            "new_slots": Number(_("slots"), slots + extra, "count"),
            "predicted": Number(
                _("predicted hit rate"), whatif_hit_rate(curve, slots + extra), "percent"
            ),
            "now": Number(_("hit rate"), hit_rate, "percent"),
            "share": Number(_("share"), miss_share, "percent"),
        }
        if miss_share is not None and miss_share >= MISS_TIME_HIGH:
            message = _(
                "Misses dominate and memory is free: {free} would hold {extra} more expert "
                "slots (--moe-cache-size {new_slots}); the what-if curve puts the hit rate at "
                "{predicted} instead of {now}."
            )
            return [Claim("more_slots", message, values, evidence)]
        message = _(
            "{free} of device memory is unplanned: it would hold {extra} more expert slots "
            "(--moe-cache-size {new_slots}) and raise the hit rate from {now} to {predicted}. "
            "Misses take only {share} of a decode step here, so expect a small gain in speed."
        )
        return [Claim("free_memory", message, values, evidence)]
    if hit_rate >= HIT_RATE_ENOUGH:
        at_double = whatif_hit_rate(curve, min(total_experts, 2 * slots))
        return [
            Claim(
                "cache_enough",
                _(
                    "The cache already serves {now} of expert reads; twice the slots would reach "
                    "{at_double}. Memory is better spent elsewhere."
                ),
                {
                    "now": Number(_("hit rate"), hit_rate, "percent"),
                    "at_double": Number(_("hit rate at 2x slots"), at_double, "percent"),
                },
                evidence[:1],
            )
        ]
    return []


def _cpu_claims(
    breakdown: dict[str, Any], step_s: float, config: dict[str, Any], physical_cores: int | None
) -> list[Claim]:
    claims = []
    cpu_share = _share(breakdown, ("cpu_experts",), step_s)
    copy_share = _share(breakdown, ("copy",), step_s)
    threads = config.get("cpu_threads")
    if cpu_share is not None and cpu_share >= CPU_TIME_HIGH:
        evidence = (
            Number(_("CPU experts, share of a decode step"), cpu_share, "percent"),
            Number(_("CPU experts per step"), breakdown.get("cpu_experts"), "seconds"),
            Number(_("CPU expert threads"), threads, "count"),
            Number(_("physical cores"), physical_cores, "count"),
        )
        if threads is not None and physical_cores is not None and threads < physical_cores - 1:
            claims.append(
                Claim(
                    "more_threads",
                    _(
                        "Experts run on the CPU take {share} of a decode step with {threads} "
                        "threads on {cores} cores: try --moe-cpu-threads {suggested}."
                    ),
                    {
                        "share": Number(_("share"), cpu_share, "percent"),
                        "threads": Number(_("threads"), threads, "count"),
                        "cores": Number(_("cores"), physical_cores, "count"),
                        "suggested": Number(_("threads"), physical_cores - 1, "count"),
                    },
                    evidence,
                )
            )
        else:
            claims.append(
                Claim(
                    "fewer_cpu_misses",
                    _(
                        "Experts run on the CPU take {share} of a decode step and the CPU has no "
                        "threads to spare: fetch more misses to the GPU (--moe-miss-policy gpu, or "
                        "split:F with F above {fetch}) or give the cache more slots."
                    ),
                    {
                        "share": Number(_("share"), cpu_share, "percent"),
                        "fetch": Number(_("fetched share"), config.get("fetch_fraction"), "ratio"),
                    },
                    evidence,
                )
            )
    if copy_share is not None and copy_share >= COPY_TIME_HIGH:
        claims.append(
            Claim(
                "copy_bound",
                _(
                    "Copying experts to the GPU takes {share} of a decode step: more slots mean "
                    "fewer copies; where memory is short, run more misses on the CPU "
                    "(--moe-miss-policy split:F with F below {fetch})."
                ),
                {
                    "share": Number(_("share"), copy_share, "percent"),
                    "fetch": Number(_("fetched share"), config.get("fetch_fraction"), "ratio"),
                },
                (Number(_("copies per step"), breakdown.get("copy"), "seconds"),),
            )
        )
    return claims


def _kv_claims(
    stats: dict[str, Any], slots: int, slot_bytes: int, total_experts: int
) -> list[Claim]:
    kv = stats.get("kv") or {}
    reserved = kv.get("tokens_total") or 0
    peak = kv.get("tokens_peak") or 0
    per_token = kv.get("bytes_per_token") or 0
    completed = (stats.get("requests") or {}).get("completed") or 0
    if completed < KV_MIN_REQUESTS or not reserved or not per_token or slots >= total_experts:
        return []
    if peak >= KV_PEAK_LOW * reserved:
        return []
    suggested = max(KV_ROUND_TOKENS, -(-2 * peak // KV_ROUND_TOKENS) * KV_ROUND_TOKENS)
    if suggested >= reserved:
        return []
    freed = (reserved - suggested) * per_token
    extra = min(freed // slot_bytes, total_experts - slots) if slot_bytes else 0
    if extra < 1:
        return []
    return [
        Claim(
            "kv_oversized",
            _(
                "The KV reserve holds {reserved} tokens but at most {peak} were in use at once: "
                "--kv-reserve-tokens {suggested} would free {freed}, room for {extra} more expert "
                "slots (the longest request would then be {suggested} tokens)."
            ),
            {
                "reserved": Number(_("tokens reserved"), reserved, "count"),
                "peak": Number(_("peak tokens in use"), peak, "count"),
                "suggested": Number(_("tokens"), suggested, "count"),
                "freed": Number(_("freed"), freed, "bytes"),
                "extra": Number(_("more slots"), extra, "count"),
            },
            (Number(_("requests completed"), completed, "count"),),
        )
    ]
