"""Continuous batching: which sequences run, which prompt chunk or decode batch goes next.

A request is admitted when the KV cache can hold its prompt and still leave a few blocks free
(`WATERMARK` of the cache) for the running sequences to grow into; a running sequence takes a
block more each time its decode reaches a new one. When a decode step cannot get the blocks it
needs, the most recently admitted running sequence is preempted by recompute: its KV blocks go
back (the full ones stay named in the prefix cache), so do its state slot and its window's ring,
and it goes back to the head of the queue. Admitted again, it prefills its prompt and the tokens
it had generated (`Sequence.prefill_length`; the prefix cache and the state checkpoints apply as
to any prompt) and decodes on: its client sees one stream. A decode step in flight (overlapped
decode) may still write into the blocks and the slot of a sequence preempted meanwhile, as into
those of a sequence that finished: the device runs its steps in order, so whatever takes them
next writes after it, and the token it draws is the sequence's next (`Stepper._land`).

A hybrid model's sequence also takes a slot of the state pool (states.py) at admission and gives
it back when it ends, and so does a sliding-window model's, whose slot holds its sliding layers'
window (window.py). A prompt that begins with blocks an earlier request computed takes them from
the prefix cache (kv.py) and is prefilled from there. Long prompts are prefilled in chunks,
alternating with decode steps of the running sequences.

A hybrid or sliding-window model's prompt resumes only where its state (the recurrent states, or
the windows' tokens) is known: at the longest of its matched blocks that ends at a state
checkpoint of the same prefix. Its own checkpoints are taken at the token counts its request
names (`Sequence.boundaries`: where a chat's messages end) and every `checkpoint_interval`
tokens, each rounded down to a whole KV block so that the pages before it are named, and a
prefill chunk ends at each of them.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..model.kv import KVCache, block_names
from ..model.states import SlotPool
from .sampling import SamplingParams, TokenLogprobs

_ids = itertools.count()
log = logging.getLogger(__name__)

WATERMARK = 0.01  # of the KV blocks, left free at admission for running sequences to grow into


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and state."""

    prompt_ids: list[int]
    params: SamplingParams
    on_token: Callable[[Sequence, int], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    # each output token's log probabilities, where params.logprobs asks for them
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # each prompt token's after the first, where params.prompt_logprobs asks for them
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache (or being written by a step in flight)
    cached_tokens: int = 0  # of the prompt, taken from the prefix cache at admission
    named_blocks: int = 0  # leading blocks named in the prefix cache (`Scheduler.name_blocks`)
    chain: int = 0  # the last named block's name hashed
    pending: int = 0  # tokens sampled on the device by a step in flight, not yet in output_ids
    state_slot: int = -1  # hybrid and sliding-window models: its slot while it runs
    # and prompt token counts the request names as places to keep the state at (the end of a
    # chat's system prompt and of its last message), and those still to be kept
    boundaries: tuple[int, ...] = ()
    checkpoints: list[int] = field(default_factory=list)
    recomputed: int = 0  # output tokens its prefill computes again after a preemption
    preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: ContextTooLong | None = None  # why it ended with "error", where its client is told
    first_token_time: float | None = None
    arrival_time: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_length(self) -> int:
        """The tokens its prefill computes: the prompt, and after a preemption the output the
        sequence had when it was admitted again."""
        return len(self.prompt_ids) + self.recomputed

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_length

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Chunk:
    """Part of a step: `count` tokens of `seq` starting at token `start`."""

    seq: Sequence
    start: int
    count: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.count >= self.seq.prefill_length


class ContextTooLong(ValueError):
    """A request whose prompt and max_tokens exceed the usable context: it can never run."""


class Scheduler:
    """Holds the waiting and running sequences and forms each step's batch."""

    def __init__(
        self,
        kv: KVCache,
        max_running: int,
        chunk_tokens: int,
        states: SlotPool | None = None,
        checkpoint_interval: int = 0,
    ) -> None:
        self.kv = kv
        self.states = states  # recurrent states or windows' rings, a slot per running sequence
        self.checkpoint_interval = checkpoint_interval  # 0: checkpoints at boundaries only
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        # prompt tokens admitted, and those of them the prefix cache held
        self.prompt_tokens = self.cached_tokens = 0
        self.preemptions = 0  # sequences preempted since the start
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False
        self.paused = False  # set from the server while the caches are resized: admit nothing

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def snapshot(self) -> dict:
        """The prefix cache as telemetry reports it (`Reports`): prompt tokens admitted, those
        of them the cache held, and what it holds now."""
        kv, states = self.kv, self.states
        out = {
            "enabled": kv.prefix_cache,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "tokens_held": kv.cached_blocks * kv.block_size,
        }
        if states is not None:
            out["state_checkpoints"] = {
                "capacity": states.checkpoint_capacity,
                "held": states.checkpoints_held,
                "kept": states.checkpoints_kept,
                "resumed": states.checkpoints_resumed,
            }
        return out

    @property
    def checkpointing(self) -> bool:
        """Whether a hybrid or sliding-window model keeps checkpoints (and so matches cached
        pages)."""
        states = self.states
        return states is not None and bool(states.checkpoint_capacity) and self.kv.prefix_cache

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def watermark(self) -> int:
        """Blocks an admission leaves free while sequences run, for them to grow into."""
        return max(1, int(self.kv.num_blocks * WATERMARK))

    def _admit(self) -> None:
        while not self.paused and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            # (a preempted sequence's step in flight lands in the step that preempted it)
            assert not seq.pending, "a sequence admitted while its token is in flight"
            kv = self.kv
            if self.states is not None and not self.states.free_slots:
                break
            seq.recomputed = len(seq.output_ids)
            tokens = seq.tokens
            need = kv.blocks_for(len(tokens))
            free = kv.free_blocks - (self.watermark if self.running else 0)
            # what the cache could save at most: while even that leaves too few blocks, a
            # waiting prompt is not matched again at every step
            at_most = min(kv.cached_blocks, (len(tokens) - 1) // kv.block_size)
            if need - at_most > free:
                break  # it waits until running sequences free their blocks
            # a scored prompt computes every token: its logits are wanted
            scored = seq.params.prompt_logprobs is not None
            cached, chain = kv.match(tokens) if not scored else ([], 0)
            if self.states is not None:
                cached, chain = self._resumable(tokens, cached)
            if not scored and self._prefill_computes(seq, len(cached)):
                break  # it matches the page once that prefill names it
            need -= len(cached)
            if need > free - kv.idle_among(cached):
                break
            self.waiting.popleft()
            kv.hold(cached)
            seq.blocks = cached + kv.allocate(need)
            seq.named_blocks, seq.chain = len(cached), chain
            seq.computed = len(cached) * kv.block_size
            if self.states is not None:
                seq.state_slot = self.states.allocate()
                if cached:
                    self.states.resume((chain, seq.computed), seq.state_slot)
                seq.checkpoints = self._checkpoints(seq)
            if not seq.preemptions:  # (a recompute is not a new prompt)
                seq.cached_tokens = seq.computed
                self.prompt_tokens += len(seq.prompt_ids)
                self.cached_tokens += seq.cached_tokens
            self.running.append(seq)

    def _resumable(self, prompt: list[int], cached: list[int]) -> tuple[list[int], int]:
        """Of a hybrid or sliding-window model's matched blocks, those up to the last one that
        ends at a state checkpoint of the same prefix (none where no checkpoint is kept there),
        and that block's name hashed (0 for none)."""
        states, size = self.states, self.kv.block_size
        assert states is not None
        chains = [hashed for _, hashed in block_names(prompt, size, 0, len(cached), 0)]
        for n in range(len(cached), 0, -1):
            if states.has_checkpoint((chains[n - 1], n * size)):
                return cached[:n], chains[n - 1]
        return [], 0

    def _checkpoints(self, seq: Sequence) -> list[int]:
        """The token counts at which to keep `seq`'s state, after those it resumed from: its
        boundaries and every `checkpoint_interval` tokens, each rounded down to a whole block,
        and short of its prompt's last block (a later prompt matches no further)."""
        if not self.checkpointing:
            return []
        size, every = self.kv.block_size, self.checkpoint_interval
        last = (seq.prefill_length - 1) // size * size
        marks = set(seq.boundaries)
        if every:
            marks.update(range(every, last + 1, every))
        kept = {m // size * size for m in marks}
        return sorted(m for m in kept if seq.computed < m <= last)

    def _prefill_computes(self, seq: Sequence, matched: int) -> bool:
        """Whether a running prefill is computing the page of `seq`'s prompt after its `matched`
        cached ones and has not named it yet. The prompt then waits to take the page from the
        cache rather than compute it again, as n requests with one prompt, or with one few-shot
        prefix, sent at once would."""
        size = self.kv.block_size
        if not self.kv.prefix_cache or matched >= (len(seq.tokens) - 1) // size:
            return False
        end = (matched + 1) * size
        page = seq.tokens[:end]
        return any(
            s.prefilling and s.named_blocks <= matched and s.tokens[:end] == page
            for s in self.running
        )

    def next_step(self) -> list[Chunk]:
        """The chunks of the next forward step ([] when there is nothing to run)."""
        self._admit()
        prefilling = [s for s in self.running if s.prefilling]
        decoding = [s for s in self.running if not s.prefilling]
        do_prefill = bool(prefilling) and (not decoding or not self._last_was_prefill)
        if do_prefill:
            self._last_was_prefill = True
            chunks, budget = [], self.chunk_tokens
            for seq in prefilling:
                if budget <= 0:
                    break
                count = min(budget, seq.prefill_length - seq.computed)
                if seq.checkpoints:  # the chunk ends where the state is to be kept
                    count = min(count, seq.checkpoints[0] - seq.computed)
                chunks.append(Chunk(seq, seq.computed, count))
                budget -= count
            return chunks
        self._last_was_prefill = False
        # A token still in flight is the next step's input (read on the device); a sequence whose
        # token in flight is its last one has nothing more to run.
        return self._grow(
            [s for s in decoding if len(s.output_ids) + s.pending < s.params.max_tokens]
        )

    def _grow(self, decoding: list[Sequence]) -> list[Chunk]:
        """The decode chunks of `decoding` (in the order they were admitted), each sequence
        given the block its token goes to where it has none yet; where the cache has no block
        left, the most recently admitted running sequences are preempted for it (the sequence
        itself where it is the most recent)."""
        kv, chunks = self.kv, []
        for seq in decoding:
            if seq not in self.running:
                continue  # preempted for an older one
            start = seq.length - 1 + seq.pending
            need = kv.blocks_for(start + 1) - len(seq.blocks)
            while need > kv.free_blocks and self.running[-1] is not seq:
                self.preempt(self.running[-1])
            if need > kv.free_blocks:
                self.preempt(seq)
                continue
            seq.blocks += kv.allocate(need)
            chunks.append(Chunk(seq, start, 1))
        return chunks

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence by recompute: give its blocks (the full ones named in
        the prefix cache), its state slot and its checkpoints to come back and queue it first,
        to prefill its prompt and its output again when it is admitted."""
        self.running.remove(seq)
        self.kv.release(seq.blocks)
        if seq.state_slot >= 0 and self.states is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = -1
        seq.computed = seq.named_blocks = seq.chain = 0
        seq.checkpoints = []
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        log.info(
            "preempted request %d at %d tokens (%d running, %d KV blocks free); it is "
            "recomputed when blocks free up",
            seq.id, seq.length, len(self.running), self.kv.free_blocks,
        )  # fmt: skip

    def name_blocks(self, seq: Sequence) -> None:
        """Name the sequence's blocks that are full, computed and whose tokens the host knows
        (a token a step in flight drew is not known yet), for later prompts to match."""
        size = self.kv.block_size
        full = min(seq.computed, seq.length) // size
        if seq.named_blocks >= full or not self.kv.prefix_cache:
            return
        names = block_names(seq.tokens, size, seq.named_blocks, full, seq.chain)
        for block, (name, chain) in zip(seq.blocks[seq.named_blocks : full], names, strict=True):
            self.kv.name(block, name)
            seq.chain = chain
        seq.named_blocks = full

    def keep_state(self, seq: Sequence) -> None:
        """Keep a hybrid or sliding-window model's checkpoint where the sequence's computed
        tokens reached its next one (after `name_blocks` named the pages before it)."""
        if not seq.checkpoints or seq.computed != seq.checkpoints[0]:
            return
        assert self.states is not None and seq.named_blocks * self.kv.block_size == seq.computed
        self.states.keep((seq.chain, seq.computed), seq.state_slot)
        seq.checkpoints.pop(0)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (finished, cancelled or failed) and free its KV at once."""
        if seq.finish_reason is None:
            seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.release(seq.blocks)
        if seq.state_slot >= 0 and self.states is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = -1
