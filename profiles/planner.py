"""The context planner: predicted decode tok/s against the context reserved.

Each point is one `--kv-reserve-tokens` value on top of a profile's flags. The engine's VRAM plan
(engine/config/memory.py, the same arithmetic the engine runs) says how many expert slots that
context leaves; a hit-rate model says what share of expert reads those slots serve; a speed model
turns the misses into time per token:

    seconds per token = fixed + reads per token x (1 - hit rate) x seconds per miss

With a real run of the model (a server's stats), a miss costs what that engine's own decode steps
say it added (engine/moe_stats.MissCostFit: copies, CPU work and the host's bookkeeping), the
fixed part is what its measured speed leaves after its own misses, and the hit rates come from
its what-if curve. Where the run's steps did not price a miss clearly, or without a run, seconds
per miss come from the measured bandwidths: with the auto split, q of m misses are copied at Bp
while m - q run on the CPU at Bh, both finishing together, so one miss costs
expert bytes / (Bp + Bh). Without a run, the fixed part is the bandwidth bound of the dense
weights and the hits, and the hit rate is an assumption (uniform routing), said so in `basis`.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any

from ..engine.config.config import EngineConfig
from ..engine.config.memory import (
    MemoryPlanError,
    kv_bytes_per_token,
    state_bytes_per_seq,
    state_reserve,
)
from ..engine.model.spec import ModelSpec
from ..engine.text import Text, text_fields
from .advice import context_tiers
from .flags import FlagChange, apply_changes, engine_config
from .machine import DeviceChoice, Machine, choose_device, plan_for, split_for

MIN_FIT_STEPS = 200  # decode steps before a run's own miss cost is trusted over bandwidth
# a run's fitted price of a miss is used at its lower bound, this many standard errors below the
# slope: fits of runs that miss nearly every read can come out clear by chance at many times the
# bytes' price, and such a slope taken at face value predicts a speed-up the next engine does not
# show
FIT_SIGMAS = 2.0
ASSUMED = Text(
    "assumed: uniform routing, so S slots serve S / all experts of the reads (real models route "
    "unevenly, so real hit rates are higher); start the model once to replace this with its own "
    "what-if curve"
)


@dataclass(frozen=True, slots=True)
class RunObservation:
    """What a real engine run of the model showed (from its /v1/stats body)."""

    slots: int
    experts_total: int
    reads_per_token: float  # expert reads per decoded token (fewer than top-k x layers: batching)
    hit_rate: float  # hits / reads over its decode steps
    whatif: tuple[tuple[int, float], ...]  # (slots, hit rate) of an LRU cache of that size
    popular_shares: tuple[float, ...]  # cumulative pick share of the top 1, 2, ... experts
    decode_tok_s: float | None  # its measured decode speed, None when it never ran under load
    bp_gbps: float | None
    bh_gbps: float | None
    fetch_fraction: float | None
    slot_bytes: int
    server_id: int | None = None
    policy: str | None = None  # its --moe-miss-policy
    miss_cost: tuple[float, float, int] | None = None  # its fit: s per miss, stderr, steps

    @property
    def source(self) -> Text:
        """The run in words: its server, where known."""
        if self.server_id is None:
            return Text("a run")
        return Text("server {id}", id=self.server_id)

    def measured_miss_s(self, policy: str) -> float | None:
        """The least a miss cost this run, as its own decode steps show (the fit's slope less
        FIT_SIGMAS standard errors), when that says something under `policy`: the same miss
        policy, enough steps, and a slope clear of its noise."""
        if self.miss_cost is None or self.policy != policy:
            return None
        slope, stderr, steps = self.miss_cost
        lower = slope - FIT_SIGMAS * stderr
        return lower if steps >= MIN_FIT_STEPS and lower > 0 else None

    @classmethod
    def from_stats(
        cls, stats: dict[str, Any], *, decode_tok_s: float | None, server_id: int | None = None
    ) -> RunObservation | None:
        """Read a /v1/stats body; None when it has no decode counters or what-if curve yet."""
        experts = stats.get("experts") or {}
        layers = experts.get("layers") or []
        tokens = (stats.get("tokens") or {}).get("decode_total") or 0
        reads = sum(int(layer.get("reads") or 0) for layer in layers)
        hits = sum(int(layer.get("hits") or 0) for layer in layers)
        whatif = tuple(
            (int(p["slots"]), float(p["hit_rate"]))
            for p in experts.get("whatif") or []
            if isinstance(p, dict) and "slots" in p and "hit_rate" in p
        )
        if not tokens or not reads or not whatif:
            return None
        picks = sorted((v for row in experts.get("picks") or [] for v in row), reverse=True)
        total_picks = sum(picks)
        shares, running = [], 0
        for v in picks:
            running += v
            shares.append(running / total_picks)
        config = stats.get("config") or {}
        fit = experts.get("miss_cost") or {}
        miss_cost = None
        if fit.get("us_per_miss") is not None and fit.get("stderr_us") is not None:
            miss_cost = (fit["us_per_miss"] / 1e6, fit["stderr_us"] / 1e6, int(fit["steps"]))
        return cls(
            slots=int(experts.get("slots") or 0),
            experts_total=int(experts.get("num_layers") or 0)
            * int(experts.get("num_experts") or 0),
            reads_per_token=reads / tokens,
            hit_rate=hits / reads,
            whatif=tuple(sorted(whatif)),
            popular_shares=tuple(shares) if total_picks else (),
            decode_tok_s=decode_tok_s if decode_tok_s else None,
            bp_gbps=config.get("bp_gbps"),
            bh_gbps=config.get("bh_gbps"),
            fetch_fraction=config.get("fetch_fraction"),
            slot_bytes=int(experts.get("slot_bytes") or 0),
            server_id=server_id,
            policy=config.get("policy"),
            miss_cost=miss_cost,
        )


def _interpolate(points: tuple[tuple[int, float], ...], slots: int) -> float:
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, slots)
    if i < len(xs) and xs[i] == slots:
        return points[i][1]
    if i == 0:
        x1, y1 = points[0]
        return y1 * slots / x1 if x1 else y1
    if i == len(xs):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (slots - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class HitModel:
    """The hit rate a cache of S slots would give.

    From a run: the what-if curve is LRU with every miss fetched, a lower bound, since the engine
    fetches only some misses and keeps the most picked experts; holding the top-S experts by
    popularity is the upper bound. The run's own hit rate at its own size places it between the
    two, and that share holds at every size. Without a run: uniform routing, S / all experts.
    """

    experts_total: int
    lru: tuple[tuple[int, float], ...] = ()
    popular_shares: tuple[float, ...] = ()
    blend: float = 0.0
    basis: Text = ASSUMED

    @classmethod
    def assumed(cls, experts_total: int) -> HitModel:
        return cls(experts_total, basis=ASSUMED)

    @classmethod
    def from_run(cls, run: RunObservation) -> HitModel:
        model = cls(run.experts_total, run.whatif, run.popular_shares)
        low, high = model._bounds(run.slots)
        blend = (run.hit_rate - low) / (high - low) if high > low else 0.0
        blend = min(1.0, max(0.0, blend))
        return cls(
            run.experts_total,
            run.whatif,
            run.popular_shares,
            blend,
            basis=Text(
                "the what-if curve of {source} ({slots} slots, hit rate {hit_rate:.0%}), placed "
                "{blend:.0%} of the way from LRU to holding the most picked experts, as that run "
                "was",
                source=run.source,
                slots=run.slots,
                hit_rate=run.hit_rate,
                blend=blend,
            ),
        )

    def _bounds(self, slots: int) -> tuple[float, float]:
        low = _interpolate(self.lru, slots) if self.lru else 0.0
        if self.popular_shares:
            high = self.popular_shares[min(slots, len(self.popular_shares)) - 1] if slots else 0.0
        else:
            high = low
        return low, max(low, high)

    def hit_rate(self, slots: int) -> float:
        if slots >= self.experts_total:
            return 1.0
        if not self.lru:
            return slots / self.experts_total
        low, high = self._bounds(slots)
        return low + self.blend * (high - low)


@dataclass(frozen=True, slots=True)
class SpeedModel:
    """Seconds per decoded token: a fixed part plus the misses at seconds per miss."""

    fixed_s: float
    miss_s: float
    reads_per_token: float
    basis: Text

    def decode_tok_s(self, hit_rate: float) -> float:
        return 1.0 / (self.fixed_s + self.reads_per_token * (1.0 - hit_rate) * self.miss_s)


def miss_seconds(expert_bytes: int, policy: str, bp_gbps: float, bh_gbps: float) -> float:
    """Time one missing expert costs under a miss policy, copies and CPU work overlapping."""
    bp, bh = bp_gbps * 1e9, bh_gbps * 1e9
    if policy == "gpu":
        return expert_bytes / bp
    if policy == "cpu":
        return expert_bytes / bh
    if policy.startswith("split:"):
        f = float(policy.split(":")[1])
        return expert_bytes * max(f / bp, (1 - f) / bh)
    return expert_bytes / (bp + bh)


def _machine_bandwidths(
    machine: Machine, choice: DeviceChoice, config: EngineConfig
) -> tuple[float, float] | None:
    rates = machine.rates
    if rates is None:
        return None
    threads = config.experts.cpu_threads or machine.default_cpu_threads
    cpu = rates.cpu_rate(threads)
    bp = rates.h2d_gbps if choice.cuda else rates.host_gbps
    if cpu is None or bp is None:
        return None
    return bp, cpu[1]


def speed_model(
    spec: ModelSpec,
    machine: Machine,
    choice: DeviceChoice,
    config: EngineConfig,
    run: RunObservation | None,
    hits: HitModel,
) -> SpeedModel | None:
    """From a run's measured speed when there is one, else the bandwidth bound; None without
    either (nothing measured)."""
    bandwidths = _machine_bandwidths(machine, choice, config)
    if run is not None and run.decode_tok_s:
        if run.bp_gbps and run.bh_gbps:
            bandwidths = run.bp_gbps, run.bh_gbps
        if bandwidths is None:
            return None
        return _run_speed(spec, choice, config, run, *bandwidths)
    if bandwidths is None:
        return None
    return _bound_speed(spec, machine, choice, config, hits, *bandwidths)


def _run_speed(
    spec: ModelSpec,
    choice: DeviceChoice,
    config: EngineConfig,
    run: RunObservation,
    bp: float,
    bh: float,
) -> SpeedModel:
    """A run's measured speed: its misses priced (`_miss_price`), the rest of each token's time
    fixed."""
    assert run.decode_tok_s
    slot_bytes = _slot_bytes(spec, choice, config)
    miss_s, priced = _miss_price(run, slot_bytes, config.experts.miss_policy, bp, bh)
    observed_s = 1.0 / run.decode_tok_s
    misses = run.reads_per_token * (1.0 - run.hit_rate)
    fixed = max(observed_s - misses * miss_s, 0.1 * observed_s)
    return SpeedModel(
        fixed,
        miss_s,
        run.reads_per_token,
        Text(
            "{source} decoded {tok_s:.1f} tok/s with {misses:.2f} misses per token; {priced}; "
            "the rest, {fixed_ms:.2f} ms per token, stays",
            source=run.source,
            tok_s=run.decode_tok_s,
            misses=misses,
            priced=priced,
            fixed_ms=fixed * 1e3,
        ),
    )


def _miss_price(
    run: RunObservation, slot_bytes: int, policy: str, bp: float, bh: float
) -> tuple[float, Text]:
    """What one miss of `slot_bytes` costs under `policy`, in seconds and in words: what the
    run's own steps show where that is clear and above the price of its bytes, else the price
    of its bytes."""
    bytes_s = miss_seconds(slot_bytes, policy, bp, bh)
    bytes_priced = Text(
        "expert of {mib:.2f} MiB at Bp {bp:.1f} + Bh {bh:.1f} GB/s",
        mib=slot_bytes / 2**20,
        bp=bp,
        bh=bh,
    )
    measured = run.measured_miss_s(policy)
    fitted = None
    if run.miss_cost is not None:
        slope, stderr, steps = run.miss_cost
        fitted = Text(
            "they fitted {slope_us:.0f} ± {stderr_us:.0f} µs over {steps} steps",
            slope_us=slope * 1e6,
            stderr_us=stderr * 1e6,
            steps=steps,
        )
    if measured is not None and measured > bytes_s:
        assert fitted is not None
        return measured, Text(
            "each miss costs {miss_us:.0f} µs as its own decode steps show ({fitted}, taken "
            "at {sigmas:.0f} standard errors below; the bytes alone, {priced}: "
            "{bytes_us:.0f} µs)",
            miss_us=measured * 1e6,
            fitted=fitted,
            sigmas=FIT_SIGMAS,
            priced=bytes_priced,
            bytes_us=bytes_s * 1e6,
        )
    if fitted is not None:
        return bytes_s, Text(
            "each miss costs {miss_us:.0f} µs ({priced}; its own steps gave no clear price of "
            "a miss above that under this policy: {fitted})",
            miss_us=bytes_s * 1e6,
            priced=bytes_priced,
            fitted=fitted,
        )
    return bytes_s, Text(
        "each miss costs {miss_us:.0f} µs ({priced}; its own steps gave no clear price of "
        "a miss above that under this policy)",
        miss_us=bytes_s * 1e6,
        priced=bytes_priced,
    )


def _bound_speed(
    spec: ModelSpec,
    machine: Machine,
    choice: DeviceChoice,
    config: EngineConfig,
    hits: HitModel,
    bp: float,
    bh: float,
) -> SpeedModel | None:
    """The bandwidth bound of one request, where the device's rate was measured."""
    rates = machine.rates
    assert rates is not None
    device_gbps = rates.device_gbps if choice.cuda else rates.host_gbps
    if not device_gbps:
        return None
    slot_bytes = _slot_bytes(spec, choice, config)
    reads = float(spec.num_moe_layers * spec.top_k)
    elem = choice.elem_bytes
    dense = (
        spec.dense_bytes_at(elem, config.model.dense_dtype)
        - spec.vocab_size * spec.hidden_size * elem
    )
    # hits read from device memory: count them into the fixed part at the hit rate of the
    # base flags' own cache, so only the misses move with the context
    base_slots = min(spec.experts_total, _base_slots(spec, choice, config))
    hit_bytes = reads * hits.hit_rate(base_slots) * slot_bytes
    fixed = (dense + hit_bytes) / (device_gbps * 1e9)
    miss_s = miss_seconds(slot_bytes, config.experts.miss_policy, bp, bh)
    return SpeedModel(
        fixed,
        miss_s,
        reads,
        Text(
            "bandwidth bound of one request (no run of this model yet): dense weights and hits "
            "at {device_gbps:.0f} GB/s, each miss {miss_us:.0f} µs at Bp {bp:.1f} + Bh {bh:.1f} "
            "GB/s; real engines reach a share of it",
            device_gbps=device_gbps,
            miss_us=miss_s * 1e6,
            bp=bp,
            bh=bh,
        ),
    )


def _base_slots(spec: ModelSpec, choice: DeviceChoice, config: EngineConfig) -> int:
    try:
        return plan_for(spec, choice, config).slots
    except MemoryPlanError:
        return 0


@dataclass(frozen=True, slots=True)
class PlanPoint:
    """One context on the chart: what it costs in slots and what speed it predicts."""

    kv_reserve_tokens: int
    fits: bool
    context_tokens: int = 0
    slots: int = 0
    kv_bytes: int = 0
    expert_cache_bytes: int = 0
    hit_rate: float | None = None
    decode_tok_s: float | None = None
    all_resident: bool = False
    error: str | None = None

    def changes(self) -> list[FlagChange]:
        """What a profile needs to get this point."""
        return [FlagChange("--kv-reserve-tokens", str(self.kv_reserve_tokens))]

    def to_json(self) -> dict[str, Any]:
        return {
            "kv_reserve_tokens": self.kv_reserve_tokens,
            "fits": self.fits,
            "context_tokens": self.context_tokens,
            "slots": self.slots,
            "kv_bytes": self.kv_bytes,
            "expert_cache_bytes": self.expert_cache_bytes,
            "hit_rate": self.hit_rate,
            "decode_tok_s": self.decode_tok_s,
            "all_resident": self.all_resident,
            "error": self.error,
            "flags": ["--kv-reserve-tokens", str(self.kv_reserve_tokens)],
        }


@dataclass(frozen=True, slots=True)
class ContextPlan:
    """The planner's answer for one set of base flags."""

    base_flags: list[str]
    device: str
    budget_bytes: int
    budget_source: str
    kv_bytes_per_token: int
    experts_total: int
    points: tuple[PlanPoint, ...]
    # a model's layers by kind (attention layers with pages for the whole context, linear and
    # sliding-window ones), the tokens a sliding layer keeps per sequence (its window in whole
    # pages), and the fixed memory every point reserves (a slot per running sequence, the graphs'
    # padding one and the state checkpoints: recurrent states or windows' pages) beside the KV of
    # its paged attention layers
    attention_layers: int
    linear_layers: int
    sliding_layers: int
    window_tokens: int
    state_bytes_per_seq: int
    state_sequences: int
    state_checkpoints: int
    state_bytes: int
    current_kv_tokens: int
    hit_basis: Text
    speed_basis: Text | None
    # a split (--devices) at the base flags: each card's layers, link and memory rates, its
    # estimated share of a decode step and whether it limits the step (empty: one device)
    cards: tuple[dict[str, Any], ...] = ()

    def point(self, kv_tokens: int) -> PlanPoint | None:
        return next((p for p in self.points if p.kv_reserve_tokens == kv_tokens), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "base_flags": self.base_flags,
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "experts_total": self.experts_total,
            "attention_layers": self.attention_layers,
            "linear_layers": self.linear_layers,
            "sliding_layers": self.sliding_layers,
            "window_tokens": self.window_tokens,
            "state_bytes_per_seq": self.state_bytes_per_seq,
            "state_sequences": self.state_sequences,
            "state_checkpoints": self.state_checkpoints,
            "state_bytes": self.state_bytes,
            "current_kv_tokens": self.current_kv_tokens,
            "basis": {
                **text_fields("hit_rate", self.hit_basis),
                **text_fields("speed", self.speed_basis),
            },
            "points": [p.to_json() for p in self.points],
            "cards": list(self.cards),
        }


def planner_tiers(max_context: int, extra: tuple[int, ...] = ()) -> list[int]:
    """Contexts on the chart: 1024, the context tiers and the halfway points between them."""
    tiers = [1024, *context_tiers(max_context)]
    between = [(a + b) // 2 for a, b in itertools.pairwise(tiers)]
    return sorted({t for t in (*tiers, *between, *extra) if 0 < t <= max_context})


def plan_context(
    spec: ModelSpec,
    machine: Machine,
    base_flags: list[str],
    *,
    run: RunObservation | None = None,
    tiers: list[int] | None = None,
) -> ContextPlan:
    """Predicted slots, hit rate and decode tok/s for each context on top of `base_flags`
    (FlagError when they are invalid; MemoryPlanError when the device cannot be used)."""
    config = engine_config(base_flags)
    choice = choose_device(machine, spec, config)
    hits = HitModel.from_run(run) if run is not None else HitModel.assumed(spec.experts_total)
    speed = speed_model(spec, machine, choice, config, run, hits)
    current = config.memory.kv_reserve_tokens
    wanted = tiers or planner_tiers(spec.max_position_embeddings, (current,))
    points = []
    for t in wanted:
        point = engine_config(
            apply_changes(base_flags, [FlagChange("--kv-reserve-tokens", str(t))])
        )
        try:
            plan = plan_for(spec, choice, point)
        except MemoryPlanError as err:
            points.append(PlanPoint(t, fits=False, error=str(err)))
            continue
        h = hits.hit_rate(plan.slots)
        points.append(
            PlanPoint(
                t,
                fits=True,
                context_tokens=plan.max_context,
                slots=plan.slots,
                kv_bytes=plan.kv_bytes,
                expert_cache_bytes=plan.expert_cache_bytes,
                hit_rate=round(h, 4),
                decode_tok_s=round(speed.decode_tok_s(h), 2) if speed else None,
                all_resident=plan.all_resident,
            )
        )
    request = config.memory_request(
        budget_bytes=choice.budget_bytes, elem_bytes=choice.elem_bytes, cuda=choice.cuda
    )
    memory = config.memory
    sequences, checkpoints, states = state_reserve(
        spec, request.max_running, request.elem_bytes, request.state_checkpoints,
        memory.kv_cache_dtype, memory.kv_block_size,
    )  # fmt: skip
    return ContextPlan(
        base_flags=list(base_flags),
        device=choice.device,
        budget_bytes=choice.budget_bytes,
        budget_source=choice.budget_source,
        kv_bytes_per_token=kv_bytes_per_token(spec, choice.elem_bytes, memory.kv_cache_dtype),
        experts_total=spec.experts_total,
        points=tuple(points),
        attention_layers=len(spec.paged_layers),
        linear_layers=len(spec.linear_layers),
        sliding_layers=len(spec.sliding_layers),
        window_tokens=spec.window_ring_tokens(memory.kv_block_size),
        state_bytes_per_seq=state_bytes_per_seq(
            spec, choice.elem_bytes, memory.kv_cache_dtype, memory.kv_block_size
        ),
        state_sequences=sequences,
        state_checkpoints=checkpoints,
        state_bytes=states,
        current_kv_tokens=current,
        hit_basis=hits.basis,
        speed_basis=speed.basis if speed else None,
        cards=_cards(spec, choice, config),
    )


def _cards(spec: ModelSpec, choice: DeviceChoice, config: EngineConfig) -> tuple[dict, ...]:
    """Each card of a split at the base flags (none where it is one device or does not fit)."""
    if not choice.split:
        return ()
    try:
        split = split_for(spec, choice, config)
    except MemoryPlanError:
        return ()
    limit = split.limit
    return tuple(
        {
            "device": step.device.name,
            "layers": [span.start, span.stop - 1],
            "link_gbps": round(step.device.link_gbps, 2),
            "memory_gbps": step.device.memory_gbps,
            "step_ms": round(step.seconds * 1e3, 3),
            "limits": step is limit,
            **text_fields("limit", step.limit_text() if step is limit else None),
        }
        for step, span in zip(split.steps, split.ranges, strict=True)
    )


def _slot_bytes(spec: ModelSpec, choice: DeviceChoice, config: EngineConfig) -> int:
    """One expert's bytes as the engine holds it (--moe-expert-dtype): a miss moves them."""
    return spec.expert_bytes_as(spec.expert_format(config.model.expert_dtype), choice.elem_bytes)
