"""The engine's forward-step loop: run a step now, or queue it on the device and read the one
before it while it runs (overlapped decode), then hand out the tokens and check the stops.

`Stepper` owns the loop's state (the step in flight, which host buffer its tokens land in, when
the last step landed, the decode graphs it replays) and is built from the parts it drives: the
model and its experts, the scheduler, the sampler, the KV cache and the telemetry. `Engine`
(engine.py) builds one and hands it new graphs or a new KV cache when it resizes its caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..experts.moe import MoERunner
from ..model.kv import KVCache
from ..model.model import Model, Scoring, SeqSlice, StepBatch
from .graphs import DecodeGraphs, DecodeRow
from .microbatch import Pipelining
from .sampling import Sampler, TokenLogprobs
from .scheduler import Chunk, Scheduler, Sequence
from .telemetry import StepTimer, Telemetry


@dataclass(slots=True)
class Flight:
    """A decode step queued on the device whose tokens the host has not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # pinned host [n]: the step's tokens, once `done` has returned
    routing: tuple[torch.Tensor, int] | None  # the resident routing copy (telemetry)
    done: Callable[[], None] | None  # waits for the step; None on the CPU (it ran synchronously)
    launched: float


class Stepper:
    """The step loop of one engine."""

    def __init__(
        self,
        model: Model,
        moe: MoERunner,
        scheduler: Scheduler,
        sampler: Sampler,
        kv: KVCache,
        telemetry: Telemetry,
        *,
        device: torch.device,
        eos_ids: frozenset[int],
        max_context: int,
        overlap_decode: bool,
    ) -> None:
        self.model = model
        self.moe = moe
        self.scheduler = scheduler
        self.sampler = sampler
        self.telemetry = telemetry
        self.eos_ids = eos_ids
        self.overlap_decode = overlap_decode
        self.device = device
        self.kv = kv
        self.max_context = max_context
        self.graphs: DecodeGraphs | None = None  # the decode steps' graphs; None: eager steps
        # a split's eager decode steps in micro-batches (microbatch.py); None: one device
        self.pipelining: Pipelining | None = None
        self._flight: Flight | None = None  # an overlapped decode step queued on the device
        self._flip = 0  # which of the two host buffers the next flight's tokens land in
        self._last_landed = 0.0

    def use_kv(self, kv: KVCache, max_context: int) -> None:
        """Run later steps on `kv`, whose plan gives `max_context` (no step in flight)."""
        assert self._flight is None, "the KV cache changed under a step in flight"
        self.kv, self.max_context = kv, max_context

    @property
    def idle(self) -> bool:
        """Nothing to run and no step in flight."""
        return self.scheduler.idle and self._flight is None

    @property
    def in_flight(self) -> bool:
        """Whether a decode step is queued on the device, its tokens not read yet."""
        return self._flight is not None

    def step(self) -> list[Sequence]:
        """Run one forward step; returns the sequences that got a token.

        Overlapped decode (CUDA graphs; requests whose tokens the device can take: greedy or
        drawn, with no penalty, bias or log probabilities): the step is queued on the device and
        the previous step's tokens are read while it runs, so the host's work between steps
        (scheduling, stop checks, streaming) hides behind the GPU's. With piecewise graphs
        (offloaded experts) the host stages every layer of the queued step; it reads the previous
        step's tokens in its wait for the second layer's routing, so that what is left between
        two steps (scheduling, the next step's inputs) hides behind the step's last CPU job and
        the logits. A step in flight consumes its predecessor's tokens on the device; a sequence
        that stopped on the predecessor's token wastes one step of compute, whose token is
        dropped.
        """
        flight, self._flight = self._flight, None
        chunks = self.scheduler.next_step()
        if flight is not None and self._overlaps(chunks):
            return self._launch_and_land(chunks, flight)
        done = self._land(flight) if flight is not None else []
        chunks = [c for c in chunks if not c.seq.finished]
        if not chunks:
            return done
        if flight is None and self._overlaps(chunks):
            self._flight = self._launch(chunks, None)
            return done
        return done + self._step_now(chunks)

    def drain(self) -> list[Sequence]:
        """Finish the step in flight, if any (before the caches change or stats are read)."""
        flight, self._flight = self._flight, None
        return self._land(flight) if flight is not None else []

    def _overlaps(self, chunks: list[Chunk]) -> bool:
        """Whether this step can be queued before the previous one's tokens are read."""
        graphs = self.graphs
        return (
            self.overlap_decode
            and graphs is not None
            and 0 < len(chunks) <= graphs.max_bs
            and all(c.count == 1 and not c.seq.prefilling for c in chunks)
            and all(c.seq.params.on_device for c in chunks)
            and self.model.on_router is None
            and not self.telemetry.want_timing()
        )

    def _launch_and_land(self, chunks: list[Chunk], previous: Flight) -> list[Sequence]:
        """Queue the next step and read `previous` meanwhile: in the host's wait of a staged
        layer step (landed after the last layer instead, it would hold the host while the device
        waits for the next step), or after the launch where no layer is staged. An error in the
        landing is raised once the step is queued."""
        landed: list[Sequence] = []
        errors: list[BaseException] = []

        def land() -> None:
            try:
                landed.extend(self._land(previous, settled=False))
            except BaseException as e:
                errors.append(e)

        self.moe.defer_host_work(land)
        try:
            self._flight = self._launch(chunks, previous)
        finally:
            self.moe.run_host_work()
        if errors:
            raise errors[0]
        return landed

    def _launch(self, chunks: list[Chunk], previous: Flight | None) -> Flight:
        """Queue one decode step of whole-step graphs; its tokens stay on the device."""
        graphs = self.graphs
        assert graphs is not None
        t0 = time.perf_counter()
        row_of = {s.id: i for i, s in enumerate(previous.seqs)} if previous is not None else {}
        rows = []
        for c in chunks:
            source = row_of.get(c.seq.id, -1)
            token = 0 if source >= 0 else c.seq.tokens[c.start]
            draw = self.sampler.row_draw(c.seq)
            rows.append(DecodeRow(token, c.start, c.seq.blocks, source, draw, c.seq.state_slot))
        graphs.run(rows)
        self._flip ^= 1
        tokens = graphs.sampled_to_host(len(rows), self._flip)
        routing = self.moe.snapshot_decode_ids(len(rows))
        done = graphs.step_done()
        for c in chunks:
            c.seq.computed = c.start + 1
            c.seq.pending += 1
        return Flight([c.seq for c in chunks], tokens, routing, done, t0)

    def _land(self, flight: Flight, settled: bool | None = None) -> list[Sequence]:
        """Wait for a queued step and hand out its tokens. settled: no later step is queued
        (by default, none is in flight)."""
        if flight.done is not None:
            flight.done()
        tokens = flight.tokens.tolist()
        settled = self._flight is None if settled is None else settled
        self.moe.after_decode_step(flight.routing, settled=settled)
        for seq in flight.seqs:
            seq.pending -= 1
        now = time.perf_counter()
        # a step in flight overlaps the previous one: count its time from whichever began later
        self.telemetry.on_step(
            decode_tokens=len(flight.seqs),
            prefill_tokens=0,
            step_s=now - max(flight.launched, self._last_landed),
        )
        self._last_landed = now
        live = [(s, t) for s, t in zip(flight.seqs, tokens, strict=True) if not s.finished]
        self._deliver([s for s, _ in live], [t for _, t in live])
        return [s for s, _ in live]

    def _step_now(self, chunks: list[Chunk]) -> list[Sequence]:
        """Run one step and wait for its tokens."""
        t0 = time.perf_counter()
        decode = all(c.count == 1 and not c.seq.prefilling for c in chunks)
        timer = StepTimer(self.device) if decode and self.telemetry.want_timing() else None
        graphs = self.graphs
        replay = (
            decode
            and timer is None
            and graphs is not None
            and self.model.on_router is None
            and len(chunks) <= graphs.max_bs
        )
        self.model.timer = self.moe.timer = timer
        batch = None
        try:
            if replay:
                assert graphs is not None
                logits = graphs.run([DecodeRow(c.seq.tokens[c.start], c.start, c.seq.blocks,
                                               state_slot=c.seq.state_slot)
                                     for c in chunks])  # fmt: skip
            else:
                batch = self._batch(chunks)
                pipelining = self.pipelining
                if pipelining is None:
                    logits = self.model.forward(batch)
                else:
                    logits = pipelining.forward(self.model, batch)
        except BaseException:
            self.moe.reset_prefill()
            raise
        finally:
            self.model.timer = self.moe.timer = None
        routing = self.moe.snapshot_decode_ids(len(chunks)) if decode else None
        sampled_chunks = [c for c in chunks if c.completes_prompt]
        if batch is not None and batch.scoring is not None:  # (a prefill's)
            _hand_out_scores(chunks, batch.scoring)
        for c in chunks:
            c.seq.computed = c.start + c.count
            if not decode:  # a long prompt's pages, named chunk by chunk as they are computed
                self.scheduler.name_blocks(c.seq)
                self.scheduler.keep_state(c.seq)  # a hybrid model's state, where due
        seqs = [c.seq for c in sampled_chunks]
        tokens, logprobs = self.sampler.sample(logits, seqs)
        if decode:
            self.moe.after_decode_step(routing)
        now = time.perf_counter()
        self.telemetry.on_step(
            decode_tokens=len(chunks) if decode else 0,
            prefill_tokens=0 if decode else sum(c.count for c in chunks),
            step_s=now - t0,
            timer=timer,
        )
        self._last_landed = now
        self._deliver(seqs, tokens, logprobs)
        return seqs

    def _deliver(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> None:
        """Append each sequence's new token (and its log probabilities, where the sampler took
        them), check its stop conditions and stream it."""
        now = time.monotonic()
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.output_ids.append(token)
            self.scheduler.name_blocks(seq)  # its computed blocks, for later prompts to match
            if logprobs is not None and logprobs[i] is not None:
                seq.output_logprobs.append(logprobs[i])
            self._check_stop(seq, token)
            if seq.on_token is not None:
                seq.on_token(seq, token)
            if seq.finished:
                self.scheduler.finish(seq, seq.finish_reason)
                self.sampler.forget(seq.id)
                self.telemetry.on_finish(seq)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens:
            seq.finish_reason = "length"

    def _batch(self, chunks: list[Chunk]) -> StepBatch:
        ids, positions, slots, seqs, logits_index = [], [], [], [], []
        for c in chunks:
            tokens = c.seq.tokens[c.start : c.start + c.count]
            q_start = len(ids)
            ids.extend(tokens)
            for pos in range(c.start, c.start + c.count):
                positions.append(pos)
                slots.append(self.kv.slot(c.seq.blocks, pos))
            seqs.append(SeqSlice(q_start, c.count, c.start + c.count, state_slot=c.seq.state_slot))
            if c.completes_prompt:
                logits_index.append(len(ids) - 1)
        dev = self.device

        def as_tensor(values: list[int], dtype=torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = StepBatch(
            as_tensor(ids), as_tensor(positions), as_tensor(slots), seqs, as_tensor(logits_index)
        )
        if all(c.count == 1 and not c.seq.prefilling for c in chunks):
            width = max(len(c.seq.blocks) for c in chunks)
            if dev.type == "cuda":
                # as wide as the decode graphs' tables: the attention kernels' launch (its
                # context slices, the table's stride) is then one the graphs compiled at
                # capture, whatever the sequences' lengths. Tables as wide as the longest
                # sequence would compile a variant for each new width an eager step meets (the
                # phase-timed step every 30 s)
                width = max(width, self.kv.blocks_for(self.max_context))
            tables = [c.seq.blocks + [0] * (width - len(c.seq.blocks)) for c in chunks]
            batch.block_tables = as_tensor(tables, torch.int32)
            batch.seq_lens = as_tensor([c.start + 1 for c in chunks], torch.int32)
            if self.model.states is not None:
                batch.state_slots = as_tensor([c.seq.state_slot for c in chunks])
        else:  # a prefill's attention reads cached keys through each sequence's pages
            blocks_and_lengths = [(c.seq.blocks, c.start + c.count) for c in chunks]
            pages = self.kv.page_indices(blocks_and_lengths)
            for seq, seq_pages in zip(seqs, pages, strict=True):
                seq.pages = seq_pages
            batch.scoring = _scoring(chunks, dev)
        return batch

    def run_until_idle(self) -> None:
        while not self.idle:
            self.step()


def _scored_positions(chunks: list[Chunk]) -> list[tuple[Chunk, int, int]]:
    """(chunk, row in the step, position) of each prompt token whose next prompt token a
    scored sequence (params.prompt_logprobs) wants the log probability of and has not got yet
    (a preempted one's prefill computes them again), in step order."""
    out, row = [], 0
    for c in chunks:
        prompt, first = c.seq.prompt_ids, max(c.start, len(c.seq.prompt_logprobs))
        if c.seq.params.prompt_logprobs is not None:
            out += [(c, row + p - c.start, p)
                    for p in range(first, min(c.start + c.count, len(prompt) - 1))]  # fmt: skip
        row += c.count
    return out


def _scoring(chunks: list[Chunk], dev: torch.device) -> Scoring | None:
    """What a prefill step scores: each scored prompt token's next one (None: nothing)."""
    scored = _scored_positions(chunks)
    if not scored:
        return None
    rows = [row for _, row, _ in scored]
    targets = [c.seq.prompt_ids[p + 1] for c, _, p in scored]
    top = max(c.seq.params.prompt_logprobs or 0 for c, _, _ in scored)
    return Scoring(
        torch.tensor(rows, dtype=torch.long, device=dev),
        torch.tensor(targets, dtype=torch.long, device=dev),
        top,
    )


def _hand_out_scores(chunks: list[Chunk], scoring: Scoring) -> None:
    """Append each scored prompt token's log probabilities to its sequence."""
    assert scoring.logprobs is not None
    logprobs = scoring.logprobs.tolist()
    values = scoring.top_values.tolist() if scoring.top_values is not None else None
    ids = scoring.top_ids.tolist() if scoring.top_ids is not None else None
    for i, (c, _, p) in enumerate(_scored_positions(chunks)):
        seq = c.seq
        wanted = seq.params.prompt_logprobs or 0
        top = (
            ()
            if values is None or ids is None
            else tuple(zip(ids[i][:wanted], values[i][:wanted], strict=True))
        )
        seq.prompt_logprobs.append(TokenLogprobs(seq.prompt_ids[p + 1], logprobs[i], top))
