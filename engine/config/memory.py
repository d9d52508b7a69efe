"""The VRAM plan: dense weights, then the KV reserve and the recurrent states, then buffers, then
expert slots from the rest.

KV comes before experts so the context the engine advertises is one it can really hold; so do the
recurrent states of a hybrid model's linear layers, one slot per running sequence, so that every
sequence the scheduler may run has its state, and the state checkpoints its prefix cache keeps;
and in the same way the window's pages of a model's sliding-window layers (gpt-oss), which keep
no pages for the rest of the context: the KV reserve counts the other attention layers only.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from ..model.spec import ModelSpec, flash_chunks_fit
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
    # recurrent states: state_slots sequences, a graphs' padding slot and state_checkpoints
    state_bytes: int
    state_slots: int  # sequences with a state slot (--max-running-requests; 0 without states)
    state_checkpoints: int  # states kept for the prefix cache (--state-checkpoints)
    prefill_buffer_bytes: int
    activation_bytes: int
    graph_bytes: int
    headroom_bytes: int
    slots: int
    slot_bytes: int
    experts_total: int
    max_context: int
    model_max_context: int
    # sliding-window layers: the tokens of each one's window a sequence's slot keeps (the state
    # slots hold them instead of recurrent states); 0 for a model without
    window_tokens: int = 0

    @property
    def expert_cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def unplanned_bytes(self) -> int:
        return self.budget_bytes - (
            self.weights_bytes
            + self.kv_bytes
            + self.state_bytes
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

        held = (f"sliding-window pages ({self.window_tokens} tokens a layer)"
                if self.window_tokens else "recurrent states")  # fmt: skip
        states = (
            f", {held} {g(self.state_bytes)} ({self.state_slots} sequences, "
            f"{self.state_checkpoints} checkpoints)"
            if self.state_slots
            else ""
        )
        return (
            f"VRAM plan of {g(self.budget_bytes)}: weights {g(self.weights_bytes)}, KV "
            f"{g(self.kv_bytes)} ({self.kv_tokens} tokens){states}, prefill buffer "
            f"{g(self.prefill_buffer_bytes)}, activations {g(self.activation_bytes)}, graphs "
            f"{g(self.graph_bytes)}, headroom {g(self.headroom_bytes)}, expert cache "
            f"{g(self.expert_cache_bytes)} ({self.slots} of {self.experts_total} experts, "
            f"{self.slots / max(1, self.experts_total):.0%}); context {self.max_context} tokens"
        )


def kv_bytes_per_token(
    spec: ModelSpec, elem_bytes: int, kv_cache_dtype: str = "auto", layers: range | None = None
) -> int:
    """The keys and values of one token in every paged attention layer (of `layers` where given;
    a hybrid model's linear layers keep a fixed state instead, sliding-window layers their
    window's tokens) as --kv-cache-dtype stores them: in the compute dtype (auto, `elem_bytes`
    each), in bf16, or in FP8 with a factor per KV head."""
    per_layer = _kv_bytes_per_layer_token(spec, elem_bytes, kv_cache_dtype)
    return _among(spec.paged_layers, layers) * per_layer


def _kv_bytes_per_layer_token(spec: ModelSpec, elem_bytes: int, kv_cache_dtype: str) -> int:
    if kv_cache_dtype == "fp8":
        per_head = spec.head_dim + FP8_KV_FACTOR_BYTES
    else:
        per_head = spec.head_dim * (2 if kv_cache_dtype == "bf16" else elem_bytes)
    return 2 * spec.num_kv_heads * per_head


def _among(indices: tuple[int, ...], layers: range | None) -> int:
    """How many of the layer `indices` lie in `layers` (all of them where None)."""
    return len(indices) if layers is None else sum(1 for i in indices if i in layers)


def state_bytes_per_seq(
    spec: ModelSpec,
    elem_bytes: int,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    layers: range | None = None,
) -> int:
    """The fixed bytes one running sequence holds beside its KV pages (in `layers` where
    given): the recurrent states of every linear layer (the convolution state in the compute
    dtype, `elem_bytes`, the DeltaNet state in fp32), or the keys and values of every
    sliding-window layer's window in whole pages of `block_size` tokens
    (engine/model/window.py); 0 for a model with neither."""
    window = spec.window_ring_tokens(block_size)
    if window:
        per_token = _kv_bytes_per_layer_token(spec, elem_bytes, kv_cache_dtype)
        return _among(spec.sliding_layers, layers) * window * per_token
    if spec.linear_attention is None:
        return 0
    rows, channels = spec.linear_attention.conv_state_shape()
    share = _among(spec.linear_layers, layers)
    conv = share * rows * channels * elem_bytes
    return conv + spec.recurrent_state_bytes_per_seq * share // len(spec.linear_layers)


def state_reserve(
    spec: ModelSpec,
    max_running: int,
    elem_bytes: int,
    checkpoints: int = 0,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    layers: range | None = None,
) -> tuple[int, int, int]:
    """(sequences with a state slot, state checkpoints, bytes): a slot for each of
    --max-running-requests, one that takes the padding rows of a CUDA graph's step, and the
    `checkpoints` the prefix cache keeps (engine/model/states.py, window.py), over the linear or
    sliding-window layers (of `layers` where given); (0, 0, 0) for a model without either."""
    per_seq = state_bytes_per_seq(spec, elem_bytes, kv_cache_dtype, block_size, layers)
    if not per_seq:
        return 0, 0, 0
    return max_running, checkpoints, (max_running + 1 + checkpoints) * per_seq


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
    if spec.linear_attention is not None:
        la = spec.linear_attention
        # a linear layer's projections (q, k, v, z, a, b), the convolution's output, and the
        # chunked delta rule's fp32 copies of q, k, v, its output and its in-chunk matrices
        per_token += (la.conv_dim + la.value_dim + 2 * la.num_v_heads) * elem * 2
        per_token += (la.conv_dim + la.value_dim) * 4 * 2 + la.num_v_heads * 64 * 4 * 2
    logits = max_running * spec.vocab_size * 4 * 2
    return int(t * per_token * 1.25) + logits + 64 * 1024**2


def chunk_attention_bytes(
    spec: ModelSpec, chunk_tokens: int, context: int, elem_bytes: int, flash: bool
) -> int:
    """Transient memory of one attention layer's prefill chunk of `chunk_tokens` queries after
    `context` tokens: what grows with the context, on top of activation_bytes' per-token part
    (one layer at a time: each is freed before the next layer's). The keys and values
    gathered from the pages in the compute dtype; where flash attention takes the chunk
    (`flash` and flash_chunks_fit), nothing more. Otherwise the masked path's: the key/value
    heads repeated for every query head, and the causal mask as a bool and as the additive
    bias the fused backends convert it to; with attention sinks (gpt_oss.attention) the keys
    and values also padded by the sink's dimensions and joined to the sink's key, and the
    mask's window and sink columns."""
    e, n = elem_bytes, chunk_tokens
    heads, d = spec.num_heads, spec.head_dim
    flash = flash and flash_chunks_fit(spec, e)

    def masked(length: int) -> int:
        if length <= n:  # a whole prompt attends to its own keys: nothing gathered
            return 0
        gathered = 2 * length * spec.kv_size * e
        if spec.attention_sinks:
            # the repeated keys and values (always: the sink joins each query head), both
            # padded and joined, one padded copy on its way, and the mask's window and sink
            padded = length * heads * (d + 8) * e
            return gathered + 2 * length * heads * d * e + 3 * padded + n * length * (3 + 2 * e)
        repeated = 2 * length * heads * d * e if heads != spec.num_kv_heads else 0
        return gathered + repeated + n * length * (1 + 2 * e)

    if not flash:
        return masked(context)
    gathered = 2 * context * spec.kv_size * e if context > n else 0
    if spec.attention_sinks and spec.sliding_layers:
        # gpt-oss's windowed layers keep the masked path, over their window and the chunk
        return max(gathered, masked(min(context, spec.sliding_window + n)))
    return gathered


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
    state_checkpoints: int = 0,
    layers: range | None = None,
    chunk_attention: str = "none",
) -> VramPlan:
    """Divide `budget_bytes` of device memory; raise MemoryPlanError when the flags cannot fit.

    An expert slot holds one expert in `expert_format`: `elem_bytes` a weight for "bf16", FP8
    values and their block factors for "fp8". `layers`: the device's range of a split
    (engine/config/split.py), whose KV, states and experts alone it holds. On a GPU the
    activations count a prefill chunk's attention at the context the KV holds
    (chunk_attention_bytes), so KV that lengthens the context also costs that transient:
    `chunk_attention` "flash" where the device runs a chunk's attention in flash attention (the
    model permitting), "masked" where it does not; "none" (the CPU, whose budget stands for a
    share of the host memory the bank shares) counts none."""
    slot_bytes = spec.expert_bytes_as(expert_format, elem_bytes)
    kv_per_token = kv_bytes_per_token(spec, elem_bytes, kv_cache_dtype, layers)
    kv_blocks = -(-kv_reserve_tokens // block_size)
    kv_bytes = kv_blocks * block_size * kv_per_token
    state_slots, checkpoints, states = state_reserve(
        spec, max_running, elem_bytes, state_checkpoints, kv_cache_dtype, block_size, layers
    )
    experts_total = _among(spec.moe_layers, layers) * spec.num_experts
    act = activation_bytes(spec, prefill_chunk_tokens, max_running, elem_bytes)
    context_cap = spec.max_position_embeddings
    if max_context is not None:
        context_cap = min(context_cap, max_context)
    paged = _among(spec.paged_layers, layers) > 0
    sliding = _among(spec.sliding_layers, layers) > 0

    def attention_at(kv_tokens: int) -> int:
        """A prefill chunk's attention transient at the context `kv_tokens` of KV give."""
        if chunk_attention == "none":
            return 0
        context = min(kv_tokens, context_cap)
        if not paged:  # a sliding layer attends to its window and the chunk at most
            context = min(context, spec.sliding_window + prefill_chunk_tokens) if sliding else 0
        flash = chunk_attention == "flash"
        return chunk_attention_bytes(spec, prefill_chunk_tokens, context, elem_bytes, flash)

    attention = attention_at(kv_blocks * block_size)
    act += attention
    graphs = graph_pool_bytes(spec, max_running) if cuda_graphs else 0
    need = weights_bytes + kv_bytes + states + act + graphs + headroom_bytes
    if need > budget_bytes and states:
        values = dict(
            budget=budget_bytes / GIB,
            weights=weights_bytes / GIB,
            tokens=kv_reserve_tokens,
            kv=kv_bytes / GIB,
            sequences=state_slots,
            checkpoints=checkpoints,
            states=states / GIB,
            activations=act / GIB,
            headroom=headroom_bytes / GIB,
        )
        if spec.sliding_layers:
            raise MemoryPlanError(
                Text(
                    "device memory of {budget:.2f} GiB cannot hold the dense weights "
                    "({weights:.2f} GiB), a KV reserve of {tokens} tokens ({kv:.2f} GiB), the "
                    "sliding-window pages of {sequences} running sequences and {checkpoints} "
                    "checkpoints ({states:.2f} GiB), activations ({activations:.2f} GiB) and "
                    "headroom ({headroom:.2f} GiB); lower --kv-reserve-tokens, "
                    "--prefill-chunk-tokens, --max-running-requests, --state-checkpoints or "
                    "--memory-headroom",
                    **values,
                )
            )
        raise MemoryPlanError(
            Text(
                "device memory of {budget:.2f} GiB cannot hold the dense weights ({weights:.2f} "
                "GiB), a KV reserve of {tokens} tokens ({kv:.2f} GiB), the recurrent states of "
                "{sequences} running sequences and {checkpoints} state checkpoints ({states:.2f} "
                "GiB), activations ({activations:.2f} GiB) and headroom ({headroom:.2f} GiB); "
                "lower --max-running-requests, --state-checkpoints, --kv-reserve-tokens, "
                "--prefill-chunk-tokens or --memory-headroom",
                **values,
            )
        )
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
    wanted = _wanted_slots(experts_total, cache_size, cache_rate)
    slots, buffer = _expert_slots(
        spec.num_experts, experts_total, left, slot_bytes, wanted, kv_reserve_tokens
    )
    if wanted is None:
        # the remainder after whole slots goes to KV, up to what the running requests can use
        rest = left - buffer - slots * slot_bytes
        useful = -(-max_running * spec.max_position_embeddings // block_size)
        # (a model whose attention layers all slide keeps no pages: as many as it can use)
        more = rest // (block_size * kv_per_token) if kv_per_token else useful
        most = max(0, min(more, useful - kv_blocks))

        def cost(blocks: int) -> int:  # more blocks' KV and the longer context's attention
            extra = attention_at((kv_blocks + blocks) * block_size) - attention
            return blocks * block_size * kv_per_token + extra

        low, high = 0, most  # the most blocks whose cost fits in `rest` (cost grows with them)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if cost(mid) <= rest else (low, mid - 1)
        act += attention_at((kv_blocks + low) * block_size) - attention
        kv_blocks += low
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
        state_bytes=states,
        state_slots=state_slots,
        state_checkpoints=checkpoints,
        prefill_buffer_bytes=buffer,
        activation_bytes=act,
        graph_bytes=graphs,
        headroom_bytes=headroom_bytes,
        slots=int(slots),
        slot_bytes=slot_bytes,
        experts_total=experts_total,
        max_context=context,
        model_max_context=spec.max_position_embeddings,
        window_tokens=spec.window_ring_tokens(block_size),
    )


def _wanted_slots(total: int, cache_size: int | None, cache_rate: float | None) -> int | None:
    """The expert slots asked for (--moe-cache-size or --moe-cache-rate), at most every expert
    (`total`); None: whatever fits."""
    if cache_size is not None:
        return min(cache_size, total)
    if cache_rate is not None:
        return min(round(cache_rate * total), total)
    return None


def _expert_slots(
    num_experts: int,
    total: int,
    left: int,
    slot_bytes: int,
    wanted: int | None,
    kv_reserve_tokens: int,
) -> tuple[int, int]:
    """Expert slots and the prefill buffer's bytes in the `left` bytes: the slots `wanted`
    (MemoryPlanError where they do not fit), else every expert (`total`) where all fit, else as
    many as fit beside the buffer that streams two layers' experts (no buffer where even it does
    not)."""
    buffer = 2 * num_experts * slot_bytes
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
    dense_dtype: str = "auto"  # --dense-dtype
    state_checkpoints: int = 0  # a hybrid model's state checkpoints (--state-checkpoints)
    # how a prefill chunk's attention is planned: "flash", "masked" or "none" (plan_vram)
    chunk_attention: str = "none"

    def plan(
        self, spec: ModelSpec, *, layers: range | None = None, weights_bytes: int | None = None
    ) -> VramPlan:
        """The plan of this request for `spec`'s model (MemoryPlanError where it cannot fit); of
        one device of a split where `layers` and its `weights_bytes` are given."""
        if weights_bytes is None:
            weights_bytes = spec.dense_bytes_at(self.elem_bytes, self.dense_dtype)
        return plan_vram(
            spec,
            budget_bytes=self.budget_bytes,
            weights_bytes=weights_bytes,
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
            state_checkpoints=self.state_checkpoints,
            layers=layers,
            chunk_attention=self.chunk_attention,
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
