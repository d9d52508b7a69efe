"""The forward pass: embeddings, attention over the paged KV cache, dense and MoE MLPs, logits.

Routed experts are not held here: each MoE layer hands its routing to an expert executor
(`engine/experts/moe.py`), which decides where every expert runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from ...kernels import shared_expert
from ...kernels.gemv import linear
from ...kernels.host_handoff import routing_to_host, signal_routing
from ...kernels.paged_attention import paged_attention_decode
from ...kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from ...kernels.rope_kv import qk_norm_rope_kv, write_kv
from ...kernels.route import route
from ...kernels.route_guess import guess_scale, guess_to_host
from ...kernels.router import topk_softmax
from . import gpt_oss, hybrid
from .kv import KVCache
from .rope import Rotary
from .spec import ModelSpec, flash_chunks_fit
from .states import StatePool
from .window import WindowPool


def flash_chunk_attention(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a later prefill chunk's attention runs in flash attention on `device` (a CUDA
    device with it, torch's own check on the model's heads in `dtype`) with the lower-right
    causal mask and shared key/value heads: where the model fits it (flash_chunks_fit)."""
    elem = torch.empty((), dtype=dtype).element_size()
    if device.type != "cuda" or not flash_chunks_fit(spec, elem):
        return False
    q = torch.empty(1, spec.num_heads, 2, spec.head_dim, dtype=dtype, device=device)
    kv = torch.empty(1, spec.num_kv_heads, 4, spec.head_dim, dtype=dtype, device=device)
    params = torch.backends.cuda.SDPAParams(q, kv, kv, None, 0.0, False, True)
    return torch.backends.cuda.can_use_flash_attention(params)


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's dense weights, on the compute device."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor  # [q + 2 kv, H]: q, k and v projections stacked
    o: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [E, H] on MoE layers
    shared_gate_up: torch.Tensor | None = None  # qwen2_moe shared expert [2 Is, H]
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None  # [1, H]
    mlp_gate_up: torch.Tensor | None = None  # dense MLP layers [2 I, H]
    mlp_down: torch.Tensor | None = None
    # gpt_oss (engine/model/gpt_oss.py): o_proj's bias, the sinks [Hq], the router's bias [E]
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    # Gated DeltaNet layers (hybrid.py), whose qkv and o are the mixer's in and out projections
    conv: torch.Tensor | None = None  # [C, W]
    a_log: torch.Tensor | None = None  # [HV]
    dt_bias: torch.Tensor | None = None  # [HV]
    gated_norm: torch.Tensor | None = None  # [DV]
    # `--dense-dtype fp8`: the fp32 factors [N/128, K/128] of the projections held in FP8
    # (float8_e4m3fn; ModelSpec.fp8_projections names them), None where one is not
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    shared_gate_up_scale: torch.Tensor | None = None
    shared_down_scale: torch.Tensor | None = None
    mlp_gate_up_scale: torch.Tensor | None = None
    mlp_down_scale: torch.Tensor | None = None


@dataclass(slots=True)
class DenseWeights:
    """Everything but the routed experts."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    layers: list[LayerWeights] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.lm_head, self.final_norm]
        for layer in self.layers:
            tensors.extend(t for t in (getattr(layer, f) for f in layer.__slots__) if t is not None)
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
        return total


class ExpertExecutor(Protocol):
    """Runs the routed experts of one MoE layer for a batch of tokens."""

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        *,
        decode: bool,
    ) -> torch.Tensor:
        """x [T, H], ids/weights [T, K] → fp32 [T, H], the weighted sum of the routed experts, or
        fp32 [T, K, H], each route's weighted output, for the model to sum (in the next residual
        add, which saves the sum's and the cast's launches in a decode step)."""
        ...

    def routing_record(self, moe_layer: int, tokens: int, decode: bool) -> torch.Tensor | None:
        """An int32 [tokens, K] view the router should write this layer's expert ids into (the
        executor's own record of the step), or None."""
        ...


class Placement(Protocol):
    """Layers split across devices, as the forward pass reads them (placement.py)."""

    @property
    def devices(self) -> tuple[torch.device, ...]: ...

    @property
    def crossings(self) -> frozenset[int]:
        """The layers where a step moves to the next device."""
        ...

    def part_of(self, layer: int) -> int:
        """The index of the device that holds `layer`."""
        ...

    def cross(self, layer: int, state: StepState) -> None:
        """Move a step's state to the device of `layer`."""
        ...

    def to_first(self, t: torch.Tensor) -> torch.Tensor: ...

    def begin(self) -> None:
        """A step starts on the first device."""
        ...


@dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a step: `q_len` new tokens on top of `kv_len - q_len` cached ones."""

    q_start: int
    q_len: int
    kv_len: int
    # a prefill's: the pages of its kv_len tokens as a device index (KVCache.gather), copied to the
    # device with the step's other inputs, so that no layer waits for a copy
    pages: torch.Tensor | None = None
    state_slot: int = -1  # hybrid models: the sequence's slot in the state pool (states.py)


@dataclass(slots=True)
class Scoring:
    """Tokens of a step whose next token's log probability is wanted (a prompt's, scored): the
    rows of those tokens [M], the next tokens [M], and how many of the likeliest tokens' to give
    with each. The model sets the results."""

    rows: torch.Tensor  # [M] long
    targets: torch.Tensor  # [M] long
    top: int
    logprobs: torch.Tensor | None = None  # fp32 [M]: each target's log probability
    top_values: torch.Tensor | None = None  # fp32 [M, top]
    top_ids: torch.Tensor | None = None  # long [M, top]


@dataclass(slots=True)
class StepBatch:
    """The tokens of one forward step, flattened across sequences."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long: flat KV slot of each token
    seqs: list[SeqSlice]
    logits_index: torch.Tensor  # [N] long: tokens whose next-token logits are wanted
    # decode steps: every sequence's pages [B, max_blocks] and cached tokens [B] (int32, device)
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    scoring: Scoring | None = None  # prefill steps: tokens whose next token is scored
    # hybrid and sliding-window models' decode steps: each sequence's state slot [B] (long,
    # device)
    state_slots: torch.Tensor | None = None
    # sliding-window models' decode steps: where each token goes in its ring [B] and each ring's
    # block table [B, max_blocks] (WindowPool.decode_pages, made by the step's first piece)
    ring_slots: torch.Tensor | None = None
    ring_tables: torch.Tensor | None = None

    @property
    def decode(self) -> bool:
        return self.block_tables is not None


@dataclass(slots=True)
class StepState:
    """The tensors one piece of a forward step hands to the next (see Model.run_piece)."""

    batch: StepBatch
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    hidden: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    x: torch.Tensor | None = None  # the MoE layer's input
    ids: torch.Tensor | None = None  # its routing [T, K]
    weights: torch.Tensor | None = None
    routed: torch.Tensor | None = None  # fp32 [T, H] or per route [T, K, H]: the routed experts
    # or, where the routed output was added to the residual and normalized with it
    # (`norm_after_experts`): the next norm's output and the new residual
    normed: tuple[torch.Tensor, torch.Tensor] | None = None
    # the MoE layer's shared expert (its gate's logit [T, 1], its output [T, H]), where the piece
    # that routes the layer computes it after the router (`run_piece`)
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    logits: torch.Tensor | None = None
    # host buffers (ids, weights, x) the router also stores its routing into: an offloaded decode
    # piece's, which the host reads between pieces (engine/runtime/graphs.py)
    routing_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # with routing_host: the signal set once the routing is there (kernels/host_handoff.py)
    routing_signal: torch.Tensor | None = None
    # a piece after an MoE layer: host buffers (logits, signal) its first attention input sends
    # a guess of the piece's MoE routing to, ahead of it (kernels/route_guess.py)
    routing_guess: tuple[torch.Tensor, torch.Tensor] | None = None
    # on a GPU, the guess's side stream and its input, until the join before the router (`_guess`)
    guess_pending: tuple[torch.cuda.Stream, torch.Tensor] | None = None


class Model:
    """A decoder-only MoE transformer of one of the supported architectures."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: DenseWeights,
        experts: ExpertExecutor,
        kv: KVCache,
        max_positions: int,
        states: StatePool | WindowPool | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.experts = experts
        # the linear layers' recurrent states (hybrid models), or the sliding-window layers'
        # rings (window.py; a split's on each layer's device, split_states.py)
        self.states = states
        self._rings = states if isinstance(states, WindowPool) else None
        # layers split across devices (placement.py): each device's KV cache (kv is the first
        # device's, whose pages the scheduler hands out), its rotary tables, the layers where
        # the activations cross to the next device
        self.placement = placement
        self.kv_parts: list[KVCache] = [kv]
        # each layer's device (the index of its KV part and rotary tables), and each paged
        # attention layer's row in its device's cache, which holds only those layers
        self._part = [
            placement.part_of(i) if placement is not None else 0 for i in range(spec.num_layers)
        ]
        self._kv_row: dict[int, int] = {}
        for layer in spec.paged_layers:
            part = self._part[layer]
            self._kv_row[layer] = sum(1 for other in self._kv_row if self._part[other] == part)
        self._crossings = placement.crossings if placement is not None else frozenset()
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.rotaries = [Rotary(spec, max_positions, self.device, self.dtype)]
        if placement is not None:
            self.rotaries += [Rotary(spec, max_positions, d, self.dtype)
                              for d in placement.devices[1:]]  # fmt: skip
        self.scale = spec.head_dim**-0.5
        # the fused decode kernel covers per-head or no q/k norm, unclipped and ungated
        # projections, rotary over whole heads and the head sizes of real models (powers of two
        # from 16)
        d = spec.head_dim
        self._fused_qk = (
            spec.qk_norm in ("none", "head")
            and spec.clip_qkv is None
            and not spec.attn_output_gate
            and spec.rotary_dim == d
            and d & (d - 1) == 0
            and 16 <= d <= 512
        )
        # a later prefill chunk's attention through flash attention's lower-right causal mask,
        # the key/value heads shared: no mask and no repeated heads, whose memory grows with the
        # context (engine/config/memory.py chunk_attention_bytes counts either path)
        # (each device of a split decides for its own layers: a mixed pair of cards may differ)
        devices = placement.devices if placement is not None else (self.device,)
        self._flash_chunks = {d: flash_chunk_attention(spec, d, self.dtype) for d in devices}
        # tokens each layer's attention sees back (its own included; 0: all of them)
        self.windows = [
            spec.sliding_window if i in spec.sliding_layers else 0 for i in range(spec.num_layers)
        ]
        self.timer = None  # a telemetry StepTimer while one step is being timed by phase
        # called with (layer, router input, routed expert ids) on every MoE layer, when set
        self.on_router: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # per piece that ends in a router: what turns the piece's first attention input (after
        # the MoE layer before; piece 0's, after the embedding) into its MoE layer's router input
        # as if no attention came between (`_guess`)
        moe, layers = spec.moe_layers, weights.layers
        self._guess_scales = [
            guess_scale(
                layers[moe[p - 1] + 1 if p else 0].input_norm.to(layers[moe[p]].post_norm.device),
                layers[moe[p]].post_norm,
            )
            for p in range(len(moe))
        ]
        # the stream the guesses run on beside the piece's chain (`_guess`), one per device by
        # its index, made here: never during a graph's capture
        devices = placement.devices if placement is not None else (self.device,)
        self._guess_streams = {d.index: torch.cuda.Stream(d) for d in devices if d.type == "cuda"}

    @property
    def kv(self) -> KVCache:
        """The KV cache whose pages the scheduler hands out (the first device's of a split)."""
        return self.kv_parts[0]

    @kv.setter
    def kv(self, kv: KVCache) -> None:
        self.kv_parts[0] = kv

    @property
    def rotary(self) -> Rotary:
        """The rotary tables (the first device's of a split)."""
        return self.rotaries[0]

    @rotary.setter
    def rotary(self, rotary: Rotary) -> None:
        self.rotaries[0] = rotary

    @property
    def num_pieces(self) -> int:
        """Pieces of a forward step: the dense work before, between and after the MoE layers."""
        return len(self.spec.moe_layers) + 1

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (fp32) [N, vocab] for the tokens in `batch.logits_index`."""
        state = StepState(batch)
        for piece in range(self.num_pieces):
            self.run_piece(piece, state)
            if piece < self.num_pieces - 1:
                self.run_experts(piece, state)
        assert state.logits is not None
        return state.logits

    @torch.inference_mode()
    def run_piece(self, piece: int, state: StepState, span: range | None = None) -> None:
        """The dense work of one piece of a step: no host sync, so a CUDA graph can hold it.

        Piece 0 starts at the embedding, piece p > 0 at the shared expert and residual of MoE
        layer p - 1 (whose routed output is in state.routed); each runs to the router of the next
        MoE layer (state.x, ids, weights), the last one to the logits.

        span: one device's range of layers of a split (engine/runtime/split_graphs.py), on the
        current device, with no crossing: its first piece starts at the range's first layer (at
        the residual stream in state.hidden and state.residual, after layer 0), its last piece
        ends at the range's end (the residual stream, or the logits on the last device).
        """
        w, batch = self.weights, state.batch
        moe_layers = self.spec.moe_layers
        start = 0 if span is None else span.start
        stop = len(w.layers) if span is None else span.stop
        crossings = self._crossings if span is None else frozenset()
        after = moe_layers[piece - 1] + 1 if piece else 0
        if after <= start:
            if self.placement is not None and span is None:
                self.placement.begin()
            if start == 0:
                state.hidden = w.embed.index_select(0, batch.input_ids)
                state.residual = None
            self._step_tables(self._part[start], state)
            first = start
        else:
            if state.normed is None:
                state.hidden = self._after_experts(w.layers[after - 1], state)
            first = after
        last = moe_layers[piece] if piece < len(moe_layers) else len(w.layers)
        routed = last < stop
        last = min(last, stop)
        # a guess of this piece's MoE routing from its first attention input (state.routing_guess)
        guess = piece if routed else None
        for index in range(first, last):
            if index in crossings:
                self._cross(index, state)
            layer = w.layers[index]
            x = self._attention_block(index, layer, state, guess if index == first else None)
            state.hidden = _swiglu(
                x, layer.mlp_gate_up, layer.mlp_down, layer.mlp_gate_up_scale, layer.mlp_down_scale
            )
        if routed:
            if last in crossings:
                self._cross(last, state)
            state.x = self._attention_block(
                last, w.layers[last], state, guess if last == first else None
            )
            # joined before the router: the guess's signal comes before the routing's, whose wait
            # clears both (kernels/csrc/decode_planner.h)
            self._join_guess(state)
            self._route(last, piece, w.layers[last], state)
            if span is None and w.layers[last].shared_gate_up is not None:
                # after the routing's signal: in an offloaded decode step the device runs the
                # shared expert while the host plans the routed experts' step
                state.shared = self._shared_expert(w.layers[last], state.x)
            return
        if stop < len(w.layers):  # (a span's) the residual stream, for the next device
            return
        self._logits(state)
        if self.placement is not None and span is None:
            state.logits = self.placement.to_first(state.logits)

    @torch.inference_mode()
    def run_layers(self, span: range, state: StepState) -> None:
        """Layers `span` of a decode step whose experts all run on the device, on the device
        that holds them: one device's share of a split's step, which the split's decode graphs
        capture as a graph of its own (engine/runtime/split_graphs.py). A span from layer 0
        starts at the embedding, a later one at the residual stream in state.hidden and
        state.residual (on its device); a span to the last layer ends at the logits (on its
        device), a shorter one at the residual stream after its last layer."""
        w, moe = self.weights, self.spec.moe_layers
        if span.start == 0:
            state.hidden = w.embed.index_select(0, state.batch.input_ids)
            state.residual = None
        self._step_tables(self._part[span.start], state)
        for index in span:
            layer = w.layers[index]
            x = self._attention_block(index, layer, state)
            if index in moe:
                state.x = x
                self._route(index, moe.index(index), layer, state)
                self.run_experts(moe.index(index), state)
                state.hidden = self._after_experts(layer, state)
            else:
                state.hidden = _swiglu(
                    x,
                    layer.mlp_gate_up,
                    layer.mlp_down,
                    layer.mlp_gate_up_scale,
                    layer.mlp_down_scale,
                )
        if span.stop == len(w.layers):
            self._logits(state)

    def _step_tables(self, part: int, state: StepState) -> None:
        """The rotary tables of the step's positions on device `part` (none where the fused
        q/k norm and rotary reads the full tables itself) and a decode step's ring tables."""
        batch = state.batch
        state.rope = None if self._fused_qk else self.rotaries[part].tables(batch.positions)
        if batch.decode and self._rings is not None:
            assert batch.state_slots is not None and batch.block_tables is not None
            batch.ring_slots, batch.ring_tables = self._rings.decode_pages(
                batch.state_slots, batch.positions, batch.block_tables.shape[1]
            )

    def _logits(self, state: StepState) -> None:
        """The final norm and the LM head: state.logits (fp32), and a prompt's scores."""
        w, batch = self.weights, state.batch
        x = self._next_norm(w.final_norm, state)
        if batch.scoring is not None:
            _score(x, w.lm_head, batch.scoring)
        x = x.index_select(0, batch.logits_index)
        state.logits = linear(x, w.lm_head).float()

    def _cross(self, index: int, state: StepState) -> None:
        """Hand the step's activations to the device of layer `index`, the first of its range
        (placement.py)."""
        assert self.placement is not None
        self.placement.cross(index, state)

    def norm_after_experts(self, moe_layer: int) -> torch.Tensor | None:
        """The weight of the RMSNorm that follows MoE layer `moe_layer`'s residual add (the next
        layer's input norm, or the final norm), where the routed output can be added and
        normalized in the same pass (state.normed); None where a shared expert is added first."""
        index = self.spec.moe_layers[moe_layer]
        layers = self.weights.layers
        if layers[index].shared_gate_up is not None or index + 1 in self._crossings:
            return None
        return layers[index + 1].input_norm if index + 1 < len(layers) else self.weights.final_norm

    def routed_dtype(self, moe_layer: int) -> torch.dtype:
        """The dtype an MoE layer's routed output may come in (state.routed): the model's where
        nothing is added to it in fp32 first (no shared expert), so that no conversion follows."""
        layer = self.weights.layers[self.spec.moe_layers[moe_layer]]
        return torch.float32 if layer.shared_gate_up is not None else self.dtype

    def run_experts(self, piece: int, state: StepState) -> None:
        """The routed experts of the MoE layer that ends `piece`: state.routed (fp32)."""
        assert state.x is not None and state.ids is not None and state.weights is not None
        state.routed = self.experts.forward(
            piece, state.x, state.ids, state.weights, decode=state.batch.decode
        )

    def _attention_block(
        self, index: int, layer: LayerWeights, state: StepState, guess: int | None = None
    ) -> torch.Tensor:
        """Input norm (with the residual add), attention, post-attention norm: the MLP's input.
        guess: where state.routing_guess is set, the piece whose MoE routing the attention's
        input guesses first (`_guess`)."""
        eps = self.spec.rms_norm_eps
        if state.residual is None:
            state.residual = state.hidden
            x = rmsnorm(state.hidden, layer.input_norm, eps)
        else:
            x = self._next_norm(layer.input_norm, state)
        if guess is not None and state.routing_guess is not None:
            self._guess(guess, x, state)
        hidden = self._attention(index, layer, x, state.batch, state.rope)
        x, state.residual = fused_add_rmsnorm(hidden, state.residual, layer.post_norm, eps)
        return x

    def _attention(
        self,
        index: int,
        layer: LayerWeights,
        x: torch.Tensor,
        batch: StepBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        spec = self.spec
        tokens = x.shape[0]
        if layer.conv is not None:
            return self._linear_attention(index, layer, x, batch)
        window = self.windows[index]
        part = self._part[index]
        kv, rotary = self.kv_parts[part], self.rotaries[part]
        # a sliding-window layer's rings (on its device) and its row there; None for paged KV
        found = self._rings.ring_of(index) if self._rings is not None else None
        rings, ring = found if found is not None else (None, None)
        qkv = linear(x, layer.qkv, layer.qkv_bias, layer.qkv_scale)
        gate = None
        if spec.attn_output_gate:
            qkv, gate = qkv.split([spec.q_size + 2 * spec.kv_size, spec.q_size], dim=-1)
        decode = batch.block_tables is not None
        # where the step's keys and values go: the paged cache, a decode step's rings, or a
        # prefill's own pages, from which their last tokens go into the rings (window.py)
        if ring is None:
            row = self._kv_row[index]
            kv_pages = kv.k[row], kv.v[row], kv.scales(row)
            slots, tables = batch.slots, batch.block_tables
        elif decode:
            assert rings is not None
            kv_pages = rings.k[ring], rings.v[ring], rings.scales(ring)
            slots, tables = batch.ring_slots, batch.ring_tables
        else:
            assert rings is not None
            kv_pages = rings.chunk_pages(tokens)
            slots, tables = torch.arange(tokens, device=x.device), None
        k_pages, v_pages, scales = kv_pages
        assert slots is not None
        if self._fused_qk:
            # q/k norm, rotary and the KV write in one launch (the same arithmetic); a prefill's
            # attention then reads its keys and values back from the cache
            q = qk_norm_rope_kv(
                qkv, batch.positions, rotary.cos, rotary.sin, layer.q_norm,
                layer.k_norm, spec.rms_norm_eps, k_pages, v_pages, slots,
                spec.num_heads, spec.num_kv_heads, spec.head_dim, scales,
            )  # fmt: skip
        else:
            assert rope is not None
            q, k, v = self._heads(layer, qkv, rope, rotary)
            write_kv(k_pages, v_pages, scales, slots, k, v)
        if decode:
            assert tables is not None
            out = paged_attention_decode(
                q, k_pages, v_pages, tables, batch.seq_lens, self.scale, kv_scales=scales,
                sinks=layer.sinks, window=window,
            )  # fmt: skip
            return self._o(layer, _gated(out.reshape(tokens, spec.q_size), gate))
        out = torch.empty_like(q)
        for seq in batch.seqs:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            first = 0  # the position of the first key
            if seq.kv_len == seq.q_len and not self._fused_qk:
                keys, values = k[rows], v[rows]
            elif ring is not None:
                assert rings is not None
                start = seq.kv_len - seq.q_len
                first, keys, values = rings.window_keys(ring, seq.state_slot, start, kv_pages,
                                                        rows)  # fmt: skip
            else:
                assert seq.pages is not None, "a prefill's SeqSlice needs its pages"
                keys, values = kv.gather(self._kv_row[index], seq.pages, seq.kv_len)
            if layer.sinks is not None:
                out[rows] = gpt_oss.attention(q[rows], keys, values, self.scale, layer.sinks,
                                              window, first,
                                              self._flash_chunks.get(q.device, False))  # fmt: skip
            else:
                out[rows] = self._sdpa(q[rows], keys, values)
            if ring is not None:
                assert rings is not None
                rings.keep_tail(ring, seq.state_slot, seq.kv_len - seq.q_len, kv_pages, rows)
        return self._o(layer, _gated(out.reshape(tokens, spec.q_size), gate))

    def _linear_attention(
        self, index: int, layer: LayerWeights, x: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        """A Gated DeltaNet layer (hybrid.py) over the sequences' state slots."""
        assert self.states is not None, "a model with linear layers needs its state pool"
        seq_slots = [(slice(s.q_start, s.q_start + s.q_len), s.state_slot) for s in batch.seqs]
        decode_slots = batch.state_slots if batch.decode else None
        return hybrid.linear_attention(
            self.spec, layer, x, self.states.layer(index), seq_slots, decode_slots
        )

    def _heads(
        self,
        layer: LayerWeights,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: Rotary,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] from the projection: clipped, normed and rotated
        as the checkpoint's architecture does."""
        spec = self.spec
        tokens = qkv.shape[0]
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        if spec.clip_qkv is not None:
            q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
        if spec.qk_norm == "full":
            q = rmsnorm(q, layer.q_norm, spec.rms_norm_eps)
            k = rmsnorm(k, layer.k_norm, spec.rms_norm_eps)
        q = q.reshape(tokens, spec.num_heads, spec.head_dim)
        k = k.reshape(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(tokens, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":
            q = rmsnorm(q, layer.q_norm, spec.rms_norm_eps)
            k = rmsnorm(k, layer.k_norm, spec.rms_norm_eps)
        q, k = rotary.apply(q, k, *rope)
        return q, k, v

    @staticmethod
    def _o(layer: LayerWeights, out: torch.Tensor) -> torch.Tensor:
        """The attention's output projection of `out` [T, q_size]."""
        return linear(out, layer.o, layer.o_bias, layer.o_scale)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q [n, Hq, D] (the last n positions) over k, v [L, Hkv, D].

        The heads go in as one batch of 4-D tensors: torch's fused backends (flash, cuDNN,
        memory-efficient) take only those, and 3-D input falls back to the math backend, which
        materializes the [Hq, n, L] scores in fp32. A whole prompt shares the key/value heads
        (enable_gqa). A later chunk's lower-right causal mask goes to flash attention as torch's
        causal bias where q's device runs it (`_flash_chunks`), the heads still shared; else,
        as a mask, to a backend that takes masks, with the key/value heads repeated for it."""
        n, length = q.shape[0], k.shape[0]
        groups = self.spec.num_heads // self.spec.num_kv_heads
        mask = None
        if n not in (1, length) and self._flash_chunks.get(q.device, False):
            # imported here: the module imports torch._dynamo (1.5 s of every engine's start)
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(n, length)
        elif n not in (1, length):
            mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, is_causal=n == length > 1, scale=self.scale,
            enable_gqa=kt.shape[1] != qt.shape[1],
        )  # fmt: skip
        return out.squeeze(0).transpose(0, 1)

    def _route(self, index: int, moe_layer: int, layer: LayerWeights, state: StepState) -> None:
        x = state.x
        assert x is not None
        # where the executor keeps this layer's routing (the resident decode record), if anywhere
        record = self.experts.routing_record(moe_layer, x.shape[0], state.batch.decode)
        k, renormalize, host = self.spec.top_k, self.spec.norm_topk_prob, state.routing_host
        signal = state.routing_signal if host is not None else None
        with self.timer.phase("route") if self.timer is not None else _NO_TIMER:
            if (
                host is not None
                and x.is_cuda
                and x.shape[0] == 1
                and x.dtype == layer.router.dtype
                and layer.router_bias is None
            ):
                # logits, top-k and the host's copy in one launch (kernels/route.py): faster
                # only where the host's copy is a third launch saved, for one token
                state.weights, state.ids = route(
                    x, layer.router, k, renormalize, ids_out=record, host=host, signal=signal
                )
            else:
                logits = linear(x, layer.router, layer.router_bias)
                state.weights, state.ids = topk_softmax(logits, k, renormalize, ids_out=record)
                if host is not None:
                    routing_to_host(state.ids, state.weights, x, *host)
                    if signal is not None:
                        signal_routing(signal, x.device)
        if self.on_router is not None:
            self.on_router(index, state.x, state.ids)

    def _guess(self, piece: int, x: torch.Tensor, state: StepState) -> None:
        """A guess of piece `piece`'s MoE routing, sent to the host ahead of it: the layer's
        router (with its bias, where it has one) on x (rmsnorm of the residual just after the
        MoE layer before, or in piece 0 of the embedding, times the input norm's weight)
        rescaled to the router's own norm, as if attention added nothing.

        On a GPU it runs on a side stream, off the piece's chain (which would otherwise wait for
        its launch before the attention), joined before the piece's router (`_join_guess`); x
        is held until then, so that no kernel of the chain reuses its memory while it is read."""
        layer = self.weights.layers[self.spec.moe_layers[piece]]
        assert state.routing_guess is not None
        args = (self._guess_scales[piece], layer.router, *state.routing_guess, layer.router_bias)
        if not x.is_cuda:
            guess_to_host(x, *args)
            return
        side = self._guess_streams[x.device.index]
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            guess_to_host(x, *args)
        state.guess_pending = (side, x)

    @staticmethod
    def _join_guess(state: StepState) -> None:
        """The piece's stream waits for its guess's side stream (a graph's capture must end
        joined, and the routing's signal must come after the guess's), and the guess's input is
        let go."""
        if state.guess_pending is not None:
            side, x = state.guess_pending
            torch.cuda.current_stream(x.device).wait_stream(side)
            state.guess_pending = None

    def _next_norm(self, weight: torch.Tensor, state: StepState) -> torch.Tensor:
        """The residual add and the RMSNorm of `weight` on state.hidden; or their output already
        made with the MoE layer's sum (state.normed, taken once)."""
        if state.normed is not None:
            x, state.residual = state.normed
            state.normed = None
            return x
        assert state.hidden is not None and state.residual is not None
        x, state.residual = fused_add_rmsnorm(
            state.hidden, state.residual, weight, self.spec.rms_norm_eps
        )
        return x

    def _after_experts(self, layer: LayerWeights, state: StepState) -> torch.Tensor:
        """The MoE layer's output: routed experts plus the shared expert, in the model dtype; or
        the routes' fp32 outputs [T, K, H] as they came, which the next residual add sums. The
        routed output is fp32, or already the model's dtype (`routed_dtype`)."""
        out, x = state.routed, state.x
        assert out is not None and x is not None
        if layer.shared_gate_up is None:
            return out if out.dim() == 3 else out.to(x.dtype)
        shared, state.shared = state.shared or self._shared_expert(layer, x), None
        return shared_expert.combine(out, *shared)

    @staticmethod
    def _shared_expert(layer: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert of an MoE layer on its input x: its gate's logit [T, 1] and its
        output [T, H], which `_after_experts` adds to the routed experts' sum."""
        assert layer.shared_gate is not None and layer.shared_down is not None
        shared = _swiglu(
            x, layer.shared_gate_up, layer.shared_down,
            layer.shared_gate_up_scale, layer.shared_down_scale,
        )  # fmt: skip
        return linear(x, layer.shared_gate), shared


_NO_TIMER = contextlib.nullcontext()


# rows of the vocabulary's log-softmax a scoring step holds at once (as many as the memory plan
# gives a step's logits: engine/config/memory.py, activation_bytes)
SCORE_ROWS = 8


def _score(x: torch.Tensor, lm_head: torch.Tensor, scoring: Scoring) -> None:
    """Each scored row's log-softmax over the vocabulary, a few rows at a time, reduced to its
    target's log probability and its likeliest tokens' (into `scoring`)."""
    picked, values, ids = [], [], []
    for start in range(0, scoring.rows.numel(), SCORE_ROWS):
        rows = scoring.rows[start : start + SCORE_ROWS]
        logp = torch.log_softmax(linear(x.index_select(0, rows), lm_head).float(), dim=-1)
        targets = scoring.targets[start : start + SCORE_ROWS]
        picked.append(logp.gather(1, targets[:, None])[:, 0])
        if scoring.top:
            top = logp.topk(scoring.top, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    scoring.logprobs = torch.cat(picked)
    if scoring.top:
        scoring.top_values, scoring.top_ids = torch.cat(values), torch.cat(ids)


def _gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """Attention's output times the sigmoid of its gate (gated attention), where there is one."""
    return out if gate is None else out * torch.sigmoid(gate)


def _swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    gate, up = linear(x, gate_up, None, gate_up_scale).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down, None, down_scale)
