"""The VRAM plan: dense weights, then the KV reserve, then buffers, then expert slots from the rest.

KV comes before experts so the context the engine advertises is one it can really hold.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from ..model.spec import ModelSpec
from ..text import Text

log = logging.getLogger("moelab.memory")

GIB = 1024**3
# an FP8 KV cache's fp32 factor per token and KV head (kernels/fp8_kv.py SCALE_BYTES)
FP8_KV_FACTOR_BYTES = 4


class MemoryPlanError(ValueError):
    """The device memory cannot hold what the flags ask for."""


@dataclass(frozen=True, slots=True)
class VramPlan:
    """Bytes of device memory given to each use, and what they buy."""

    budget_bytes: int
    weights_bytes: int
    kv_bytes: int
    kv_tokens: int
    kv_blocks: int
    prefill_buffer_bytes: int
    activation_bytes: int
    graph_bytes: int
    headroom_bytes: int
    slots: int
    slot_bytes: int
    experts_total: int
    max_context: int
    model_max_context: int

    @property
    def expert_cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def unplanned_bytes(self) -> int:
        return self.budget_bytes - (
            self.weights_bytes
            + self.kv_bytes
            + self.prefill_buffer_bytes
            + self.activation_bytes
            + self.graph_bytes
            + self.headroom_bytes
            + self.expert_cache_bytes
        )

    @property
    def all_resident(self) -> bool:
        return self.slots >= self.experts_total

    def to_dict(self) -> dict:
        out = asdict(self)
        out["expert_cache_bytes"] = self.expert_cache_bytes
        return out

    def describe(self) -> str:
        def g(n: int) -> str:
            return f"{n / GIB:.2f} GiB"

        return (
            f"VRAM plan of {g(self.budget_bytes)}: weights {g(self.weights_bytes)}, KV "
            f"{g(self.kv_bytes)} ({self.kv_tokens} tokens), prefill buffer "
            f"{g(self.prefill_buffer_bytes)}, activations {g(self.activation_bytes)}, graphs "
            f"{g(self.graph_bytes)}, headroom {g(self.headroom_bytes)}, expert cache "
            f"{g(self.expert_cache_bytes)} ({self.slots} of {self.experts_total} experts, "
            f"{self.slots / max(1, self.experts_total):.0%}); context {self.max_context} tokens"
        )


def kv_bytes_per_token(spec: ModelSpec, elem_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Every layer's keys and values of one token as --kv-cache-dtype stores them: in the compute
    dtype (auto, `elem_bytes` each), in bf16, or in FP8 with a factor per KV head."""
    if kv_cache_dtype == "fp8":
        per_head = spec.head_dim + FP8_KV_FACTOR_BYTES
    else:
        per_head = spec.head_dim * (2 if kv_cache_dtype == "bf16" else elem_bytes)
    return 2 * spec.num_layers * spec.num_kv_heads * per_head


def activation_bytes(spec: ModelSpec, chunk_tokens: int, max_running: int, elem: int) -> int:
    """Transient memory of one step at the largest prefill chunk (an estimate with margin)."""
    t = chunk_tokens
    per_token = (
        6 * spec.hidden_size * elem  # residual, normed input, attention and MLP outputs
        + (spec.q_size + 2 * spec.kv_size) * elem * 2  # qkv and rotated copies
        + spec.num_experts * 4 * 2  # router logits and probabilities
        + spec.top_k * (3 * spec.moe_intermediate_size) * 4  # grouped MoE intermediates (fp32)
        + spec.hidden_size * 4 * 2  # fp32 MoE output
        + 2 * max(spec.intermediate_size, spec.shared_expert_intermediate_size) * elem
    )
    logits = max_running * spec.vocab_size * 4 * 2
    return int(t * per_token * 1.25) + logits + 64 * 1024**2


def graph_pool_bytes(spec: ModelSpec, max_running: int) -> int:
    """The CUDA graphs' pool: the steps' own, and the device draws' (engine/runtime/graphs.py): a
    sort, its indices, the noise's hashes and a few fp32 rows of the vocabulary per batch row."""
    draws = max_running * spec.vocab_size * 64
    return 32 * 1024**2 + max_running * 4 * 1024**2 + draws


def plan_vram(
    spec: ModelSpec,
    *,
    budget_bytes: int,
    weights_bytes: int,
    elem_bytes: int,
    kv_reserve_tokens: int,
    block_size: int,
    prefill_chunk_tokens: int,
    max_running: int,
    headroom_bytes: int,
    kv_cache_dtype: str = "auto",
    cache_size: int | None = None,
    cache_rate: float | None = None,
    cuda_graphs: bool = False,
    max_context: int | None = None,
    expert_format: str = "bf16",
) -> VramPlan:
    """Divide `budget_bytes` of device memory; raise MemoryPlanError when the flags cannot fit.

    An expert slot holds one expert in `expert_format`: `elem_bytes` a weight for "bf16", FP8
    values and their block factors for "fp8"."""
    slot_bytes = spec.expert_bytes_as(expert_format, elem_bytes)
    kv_per_token = kv_bytes_per_token(spec, elem_bytes, kv_cache_dtype)
    kv_blocks = -(-kv_reserve_tokens // block_size)
    kv_bytes = kv_blocks * block_size * kv_per_token
    act = activation_bytes(spec, prefill_chunk_tokens, max_running, elem_bytes)
    graphs = graph_pool_bytes(spec, max_running) if cuda_graphs else 0
    need = weights_bytes + kv_bytes + act + graphs + headroom_bytes
    if need > budget_bytes:
        raise MemoryPlanError(
            Text(
                "device memory of {budget:.2f} GiB cannot hold the dense weights ({weights:.2f} "
                "GiB), a KV reserve of {tokens} tokens ({kv:.2f} GiB), activations "
                "({activations:.2f} GiB) and headroom ({headroom:.2f} GiB); lower "
                "--kv-reserve-tokens, --prefill-chunk-tokens or --memory-headroom",
                budget=budget_bytes / GIB,
                weights=weights_bytes / GIB,
                tokens=kv_reserve_tokens,
                kv=kv_bytes / GIB,
                activations=act / GIB,
                headroom=headroom_bytes / GIB,
            )
        )
    left = budget_bytes - need
    wanted = _wanted_slots(spec, cache_size, cache_rate)
    slots, buffer = _expert_slots(spec, left, slot_bytes, wanted, kv_reserve_tokens)
    if wanted is None:
        # the remainder after whole slots goes to KV, up to what the running requests can use
        rest = left - buffer - slots * slot_bytes
        useful = -(-max_running * spec.max_position_embeddings // block_size)
        kv_blocks = max(kv_blocks, min(kv_blocks + rest // (block_size * kv_per_token), useful))
        kv_bytes = kv_blocks * block_size * kv_per_token
    kv_tokens = kv_blocks * block_size
    context = min(kv_tokens, spec.max_position_embeddings)
    if max_context is not None:
        context = min(context, max_context)
    return VramPlan(
        budget_bytes=budget_bytes,
        weights_bytes=weights_bytes,
        kv_bytes=kv_bytes,
        kv_tokens=kv_tokens,
        kv_blocks=kv_blocks,
        prefill_buffer_bytes=buffer,
        activation_bytes=act,
        graph_bytes=graphs,
        headroom_bytes=headroom_bytes,
        slots=int(slots),
        slot_bytes=slot_bytes,
        experts_total=spec.experts_total,
        max_context=context,
        model_max_context=spec.max_position_embeddings,
    )


def _wanted_slots(spec: ModelSpec, cache_size: int | None, cache_rate: float | None) -> int | None:
    """The expert slots asked for (--moe-cache-size or --moe-cache-rate), at most every expert;
    None: whatever fits."""
    if cache_size is not None:
        return min(cache_size, spec.experts_total)
    if cache_rate is not None:
        return min(round(cache_rate * spec.experts_total), spec.experts_total)
    return None


def _expert_slots(
    spec: ModelSpec, left: int, slot_bytes: int, wanted: int | None, kv_reserve_tokens: int
) -> tuple[int, int]:
    """Expert slots and the prefill buffer's bytes in the `left` bytes: the slots `wanted`
    (MemoryPlanError where they do not fit), else every expert where all fit, else as many as
    fit beside the buffer that streams two layers' experts (no buffer where even it does not)."""
    total = spec.experts_total
    buffer = 2 * spec.num_experts * slot_bytes
    if wanted is not None:
        buffer = 0 if wanted >= total else buffer
        if wanted * slot_bytes + buffer > left:
            raise MemoryPlanError(
                Text(
                    "{wanted} expert slots ({slots:.2f} GiB) and the prefill buffer ({buffer:.2f} "
                    "GiB) do not fit in the {left:.2f} GiB left after weights and {tokens} KV "
                    "tokens; at most {most} slots fit",
                    wanted=wanted,
                    slots=wanted * slot_bytes / GIB,
                    buffer=buffer / GIB,
                    left=left / GIB,
                    tokens=kv_reserve_tokens,
                    most=max(0, (left - buffer) // slot_bytes),
                )
            )
        return wanted, buffer
    if left >= total * slot_bytes:
        return total, 0
    if buffer > left:
        buffer = 0  # no room to stream whole layers: prefill fetches what it routes to
    return max(0, (left - buffer) // slot_bytes), buffer


@dataclass(frozen=True, slots=True)
class MemoryRequest:
    """What an engine's settings ask of its device's memory (engine/config/config.py makes it): the
    inputs of plan_vram but the model's geometry."""

    budget_bytes: int
    elem_bytes: int  # bytes per weight at the compute dtype
    kv_reserve_tokens: int
    block_size: int
    kv_cache_dtype: str
    prefill_chunk_tokens: int
    max_running: int
    headroom_bytes: int
    cache_size: int | None
    cache_rate: float | None
    cuda_graphs: bool
    max_context: int | None
    expert_dtype: str = "auto"  # --moe-expert-dtype

    def plan(self, spec: ModelSpec) -> VramPlan:
        """The plan of this request for `spec`'s model (MemoryPlanError where it cannot fit)."""
        return plan_vram(
            spec,
            budget_bytes=self.budget_bytes,
            weights_bytes=spec.dense_params * self.elem_bytes,
            elem_bytes=self.elem_bytes,
            kv_reserve_tokens=self.kv_reserve_tokens,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            max_running=self.max_running,
            headroom_bytes=self.headroom_bytes,
            cache_size=self.cache_size,
            cache_rate=self.cache_rate,
            cuda_graphs=self.cuda_graphs,
            max_context=self.max_context,
            expert_format=spec.expert_format(self.expert_dtype),
        )


def log_plan(plan: VramPlan) -> None:
    log.info(plan.describe())
    if plan.max_context < plan.model_max_context:
        log.warning(
            "usable context is %d tokens but the model supports %d: the KV cache holds only %d "
            "tokens. To serve more, raise --kv-reserve-tokens (e.g. --kv-reserve-tokens %d costs "
            "%.2f GiB more VRAM, taken from the expert cache)%s",
            plan.max_context,
            plan.model_max_context,
            plan.kv_tokens,
            plan.model_max_context,
            (plan.model_max_context - plan.kv_tokens)
            * plan.kv_bytes
            / max(1, plan.kv_tokens)
            / GIB,
            "" if plan.max_context == plan.kv_tokens else " or lift --max-context",
        )
