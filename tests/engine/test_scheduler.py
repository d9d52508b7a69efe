"""The scheduler over a real KV cache and a state pool, driven by a stand-in step loop: requests
whose prompts and outputs outgrow the cache are preempted and recomputed, and every one still
gets the tokens it gets alone, from pages and states that hold exactly its own tokens."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.engine.model.kv import KVCache
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.states import SlotPool
from moelab.engine.model.synth import make_config
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.runtime.scheduler import Chunk, Scheduler, Sequence
from moelab.engine.runtime.worker import EngineWorker

SIZE = 4  # tokens per block


def next_token(tokens: list[int]) -> int:
    """The stand-in model: the next token depends on every token before it."""
    return hash(tuple(tokens)) % 5


def alone(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class Prefixes(SlotPool):
    """A state pool whose slot holds the tokens its sequence's state has taken in."""

    def __init__(self, num_slots: int, checkpoints: int) -> None:
        super().__init__(num_slots, checkpoints)
        self.rows: dict[int, tuple[int, ...]] = {}

    def _clear(self, slot: int) -> None:
        self.rows[slot] = ()

    def _copy(self, src: int, dst: int) -> None:
        self.rows[dst] = self.rows[src]


class Loop:
    """The engine's step loop (stepping.py) over the stand-in model: a prefill or an eager
    decode step runs at once; with `overlap`, a decode step is launched before the previous
    one's tokens land, its input read 'on the device' (the truth) where still in flight."""

    def __init__(self, scheduler: Scheduler, overlap: bool) -> None:
        self.s, self.overlap = scheduler, overlap
        self.pages: dict[int, int] = {}  # KV slot -> the token whose keys it holds
        self.truth: dict[int, list[int]] = {}  # each sequence's tokens, drawn ones in flight too
        self.flight: list[tuple[Sequence, int]] | None = None

    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.truth[seq.id] = list(prompt)
        self.s.add(seq)
        return seq

    def compute(self, c: Chunk) -> None:
        """Write the chunk's keys, after checking that every earlier position's page and the
        sequence's state hold its own tokens."""
        seq, kv, truth = c.seq, self.s.kv, self.truth[c.seq.id]
        assert len(seq.blocks) >= kv.blocks_for(c.start + c.count)
        for pos in range(c.start):
            assert self.pages[kv.slot(seq.blocks, pos)] == truth[pos], (seq.id, pos)
        for pos in range(c.start, c.start + c.count):
            self.pages[kv.slot(seq.blocks, pos)] = truth[pos]
        if self.s.states is not None:
            rows = self.s.states.rows
            assert rows[seq.state_slot] == tuple(truth[: c.start]), seq.id
            rows[seq.state_slot] = tuple(truth[: c.start + c.count])
        seq.computed = c.start + c.count

    def deliver(self, seq: Sequence, token: int) -> None:
        if seq.finished:
            return  # (a step in flight for a sequence that stopped: its token is dropped)
        seq.output_ids.append(token)
        self.s.name_blocks(seq)
        if len(seq.output_ids) >= seq.params.max_tokens:
            self.s.finish(seq, "length")

    def land(self) -> None:
        flight, self.flight = self.flight, None
        for seq, token in flight or []:
            seq.pending -= 1
            self.deliver(seq, token)

    def draw(self, seq: Sequence) -> int:
        truth = self.truth[seq.id]
        del truth[seq.length + seq.pending :]  # (a stopped sequence's dropped token)
        truth.append(next_token(truth))
        return truth[-1]

    def step(self) -> None:
        chunks = self.s.next_step()
        self.check()
        decode = bool(chunks) and all(not c.seq.prefilling and c.count == 1 for c in chunks)
        if self.overlap and decode:
            previous, self.flight = self.flight, []
            for c in chunks:
                self.compute(c)
                self.flight.append((c.seq, self.draw(c.seq)))
                c.seq.pending += 1
            self.flight, launched = previous, self.flight
            self.land()
            self.flight = launched
            return
        self.land()
        for c in [c for c in chunks if not c.seq.finished]:
            self.compute(c)
            if not decode:
                self.s.name_blocks(c.seq)
                self.s.keep_state(c.seq)
            if c.completes_prompt:
                self.deliver(c.seq, self.draw(c.seq))

    def check(self) -> None:
        """No block is written by two sequences (only named pages are shared), and the cache's
        free blocks and the running sequences' make up the whole cache."""
        kv, running = self.s.kv, self.s.running
        held = [b for s in running for b in s.blocks]
        own = [b for s in running for b in s.blocks[s.named_blocks :]]
        assert len(own) == len(set(own)) and not set(own) & {
            b for s in running for b in s.blocks[: s.named_blocks]
        }
        assert kv.used_blocks == len(set(held))
        assert kv.free_blocks + len(set(held)) == kv.num_blocks
        if self.s.states is not None:
            assert self.s.states.used_slots == len(running)

    def run(self, limit: int = 5000) -> None:
        for _ in range(limit):
            if self.s.idle and self.flight is None:
                return
            self.step()
        raise AssertionError("the requests did not finish")


def scheduler(blocks: int, running: int, chunk: int, *, prefix: bool = True,
              hybrid: tuple[int, int] | None = None) -> Scheduler:  # fmt: skip
    """Over a cache of `blocks` blocks; `hybrid`: a state pool with (checkpoints, interval)."""
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    kv = KVCache(spec, blocks, SIZE, torch.device("cpu"), torch.float32, prefix)
    if hybrid is None:
        return Scheduler(kv, running, chunk)
    checkpoints, interval = hybrid
    pool = Prefixes(running, checkpoints)
    return Scheduler(kv, running, chunk, states=pool, checkpoint_interval=interval)


requests = st.lists(
    st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=20), st.integers(1, 20)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(
    requests=requests,
    blocks=st.integers(10, 16),
    running=st.integers(1, 4),
    chunk=st.integers(2, 12),
    overlap=st.booleans(),
    prefix=st.booleans(),
    hybrid=st.sampled_from([None, (0, 0), (2, 0), (3, 4), (2, 8)]),
)
def test_preempted_requests_finish_with_their_own_tokens(
    requests, blocks, running, chunk, overlap, prefix, hybrid
):
    """Prompts of two token kinds (so that they share pages) and outputs that outgrow a cache
    of 10 to 16 blocks of 4: however they run, each request ends with the tokens it gets alone,
    no page is written by two sequences and every block comes back."""
    s = scheduler(blocks, running, chunk, prefix=prefix, hybrid=hybrid)
    loop = Loop(s, overlap)
    seqs = [loop.add(p, n) for p, n in requests if len(p) + n <= blocks * SIZE]
    loop.run()
    for seq in seqs:
        assert seq.output_ids == alone(seq.prompt_ids, seq.params.max_tokens)
    assert s.kv.used_blocks == 0 and not s.running and not s.waiting
    assert s.states is None or s.states.used_slots == 0


def test_a_decode_that_outgrows_the_cache_preempts_the_latest_request():
    """Two prompts of 3 blocks in a cache of 8 both start; when the first needs a block the
    cache no longer has, the second (admitted last) goes back to the head of the queue with its
    blocks given back, is admitted again once the first finishes, prefills its prompt and its
    output, and decodes on to the tokens it gets alone."""
    s = scheduler(8, 4, 64)
    loop = Loop(s, overlap=False)
    first, second = loop.add([1] * 12, 16), loop.add([0] * 12, 8)
    while not second.output_ids:
        loop.step()
    assert s.running == [first, second] and s.kv.free_blocks == 2
    while not second.preemptions:
        loop.step()
    assert s.running == [first] and list(s.waiting) == [second] and s.preemptions == 1
    assert second.blocks == [] and second.computed == 0 and len(second.output_ids) > 1
    done = len(second.output_ids)
    loop.run()
    assert second.recomputed == done and second.cached_tokens == 0
    assert first.output_ids == alone(first.prompt_ids, 16)
    assert second.output_ids == alone(second.prompt_ids, 8)
    assert s.prompt_tokens == 24  # the recompute is no new prompt


def test_admission_leaves_a_watermark_of_free_blocks_while_others_run():
    """Of 100 blocks, a second prompt is admitted only where a block stays free after it; a
    prompt alone may take every block."""
    for second, admitted in ((39, True), (40, False)):
        s = scheduler(100, 4, 1024, prefix=False)
        loop = Loop(s, overlap=False)
        loop.add([1] * SIZE * 60, 1)
        loop.add([2] * SIZE * second, 1)
        s.next_step()
        assert len(s.running) == 1 + admitted, second
    s = scheduler(100, 4, 1024, prefix=False)
    whole = Loop(s, overlap=False).add([1] * SIZE * 100, 1)
    s.next_step()
    assert s.running == [whole]


def test_a_failed_step_ends_the_requests_preempted_with_a_token_in_flight():
    """A step that fails ends its running requests with an error, and a request preempted
    while that step held its token (which will never land); one that waits with nothing in
    flight waits on."""
    s = scheduler(8, 2, 64)
    ended = []
    worker = EngineWorker(None)
    worker.engine = SimpleNamespace(scheduler=s, sampler=SimpleNamespace(forget=lambda i: None))
    loop = Loop(s, overlap=False)
    running, preempted, waiting = (loop.add([i] * 8, 4) for i in range(3))
    s.next_step()  # (two of them run)
    s.preempt(preempted)
    preempted.pending = 1
    for seq in (running, preempted, waiting):
        seq.on_token = lambda seq, token: ended.append((seq, token))
    worker._fail_running(RuntimeError("out of memory"))
    assert ended == [(running, -1), (preempted, -1)]
    assert running.finish_reason == preempted.finish_reason == "error"
    assert list(s.waiting) == [waiting] and not s.running
