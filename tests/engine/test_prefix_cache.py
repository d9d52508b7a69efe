"""The prefix cache (engine/model/kv.py, engine/runtime/scheduler.py): whole KV pages named by
their tokens, matched from a prompt's start, held while used, kept idle after, and taken back least
recently released first; the engine's counts of it; and a real server's usage and stats."""

from __future__ import annotations

import pytest
import torch

from moelab.engine.model.kv import KVCache, block_names
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize

from .reference import make_engine


def _kv(blocks: int, prefix_cache: bool = True) -> KVCache:
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    return KVCache(spec, blocks, 4, torch.device("cpu"), torch.float32, prefix_cache)


def _named(kv: KVCache, blocks: list[int], tokens: list[int]) -> None:
    """Name `blocks` as a sequence of `tokens` would (the scheduler's chain)."""
    for block, (name, _) in zip(blocks, block_names(tokens, 4, 0, len(blocks), 0), strict=True):
        kv.name(block, name)


def test_a_prompt_matches_whole_named_pages_from_its_start_leaving_its_last_token():
    kv = _kv(8)
    tokens = list(range(100, 112))
    blocks = kv.allocate(3)
    _named(kv, blocks, tokens)
    assert kv.match([*tokens, 7])[0] == blocks  # all three, one token left to compute
    assert kv.match(tokens)[0] == blocks[:2]  # its last token must be computed: two
    assert kv.match(tokens[:6] + [0] * 7)[0] == blocks[:1]  # differs in the second page
    # the same tokens after another first page: the chain of names differs, no match
    assert kv.match([1, 2, 3, 4, *tokens[4:], 7])[0] == []
    assert _kv(8, prefix_cache=False).match([*tokens, 7]) == ([], 0)


def test_released_named_pages_stay_until_an_allocation_needs_them_oldest_first():
    kv = _kv(4)
    a_tokens, b_tokens = list(range(8)), list(range(50, 58))
    a, b = kv.allocate(2), kv.allocate(2)
    _named(kv, a, a_tokens)
    _named(kv, b, b_tokens)
    assert kv.free_blocks == 0 and kv.cached_blocks == 4
    kv.release(list(a))
    kv.release(list(b))
    assert kv.free_blocks == 4 and kv.used_blocks == 0  # idle named pages count as free
    # a held page leaves the free count; a second holder does not count it again
    held, _ = kv.match([*a_tokens, 9])
    assert kv.idle_among(held) == 2
    kv.hold(held)
    kv.hold(held)
    assert kv.free_blocks == 2 and kv.idle_among(held) == 0
    # a new allocation takes the idle pages released first, the tail of a prompt before its head
    assert kv.allocate(1) == [b[1]] and kv.allocate(1) == [b[0]]
    assert kv.match([*b_tokens, 9])[0] == [] and kv.cached_blocks == 2
    kv.release(list(held))
    kv.release(list(held))
    assert kv.free_blocks == 2 and kv.match([*a_tokens, 9])[0] == a


def test_a_name_given_twice_keeps_the_first_page():
    kv = _kv(4)
    tokens = list(range(4))
    first, second = kv.allocate(1), kv.allocate(1)
    _named(kv, first, tokens)
    _named(kv, second, tokens)  # computed again by a sequence admitted meanwhile
    assert kv.match([*tokens, 1])[0] == first and kv.cached_blocks == 1
    kv.release(list(second))
    assert kv.free_blocks == 3  # the unnamed copy is free at once, not idle


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("prefix"), preset="tiny", seed=31)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_engine_counts_what_the_cache_saved_and_gives_the_same_tokens(checkpoint):
    system = _prompt(1, 70)  # a shared system prompt: four whole pages of 16
    prompts = [system + _prompt(2 + i, 9) for i in range(3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = make_engine(checkpoint, "--no-prefix-cache")
    try:
        expected = [plain.generate([p], params)[0] for p in prompts]
        assert plain.scheduler.cached_tokens == 0
    finally:
        plain.close()
    engine = make_engine(checkpoint)
    try:
        outputs = [engine.generate([p], params)[0] for p in prompts]
        stats = engine.telemetry.stats(running=0, queued=0, model_name="m")
    finally:
        engine.close()
    assert outputs == expected
    # the second and third prompts took the system prompt's four pages
    assert engine.scheduler.cached_tokens == 2 * 64
    prefix = stats["kv"]["prefix_cache"]
    assert prefix == {"enabled": True, "prompt_tokens": 3 * 79, "cached_tokens": 128,
                      "tokens_held": prefix["tokens_held"]}  # fmt: skip
    assert prefix["tokens_held"] >= 64 and stats["tokens"]["prefill_total"] == 3 * 79 - 128


def test_a_full_cache_gives_its_idle_pages_to_new_prompts(checkpoint):
    """With room for about two requests, many distinct prompts run one after another: each
    takes pages the earlier ones left named, and a repeat of the last one still matches."""
    engine = make_engine(checkpoint, "--kv-reserve-tokens", "256", "--max-context", "128")
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        for seed in range(12):
            engine.generate([_prompt(40 + seed, 60)], params)
        assert engine.kv.used_blocks == 0 and engine.kv.cached_blocks <= engine.kv.num_blocks
        before = engine.scheduler.cached_tokens
        engine.generate([_prompt(51, 60)], params)
        assert engine.scheduler.cached_tokens - before == 48
    finally:
        engine.close()


def test_a_long_prompts_pages_are_named_chunk_by_chunk(checkpoint):
    """A request sent while a long prompt is still being prefilled takes the pages its chunks
    compute: it waits while the prefill computes the next page it would match."""
    engine = make_engine(checkpoint, "--prefill-chunk-tokens", "32")
    try:
        system = _prompt(60, 100)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        first = engine.add(system + _prompt(61, 5), params)
        engine.step()  # the first 32 tokens
        engine.step()  # 64
        second = engine.add(system + _prompt(62, 5), params)
        engine.run_until_idle()
    finally:
        engine.close()
    # all six whole pages of the shared 100 tokens, the last two named after it was sent
    assert first.cached_tokens == 0 and second.cached_tokens == 96


def test_requests_sent_at_once_with_one_prefix_compute_it_once(checkpoint):
    """Four requests with one few-shot prefix (and the same prompt twice) sent at once: the
    first computes the prefix's pages, the others wait for them and take them from the cache,
    and every request gets the tokens it gets alone without the cache."""
    shots = _prompt(70, 90)  # five whole pages of 16 and 10 tokens
    prompts = [shots + _prompt(71 + i, 7) for i in range(3)]
    prompts.append(prompts[0])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = make_engine(checkpoint, "--no-prefix-cache")
    try:
        expected = [plain.generate([p], params)[0] for p in prompts]
        together = plain.generate(prompts, params)
        assert plain.scheduler.prompt_tokens == 8 * 97 and together == expected
    finally:
        plain.close()
    engine = make_engine(checkpoint)
    try:
        outputs = engine.generate(prompts, params)
        seqs = engine.scheduler
        computed = seqs.prompt_tokens - seqs.cached_tokens
    finally:
        engine.close()
    assert outputs == expected
    # the first computed its 97 tokens, the next two the 17 after the five shared pages, and
    # the repeat its last token alone (it waited for the sixth page as well)
    assert seqs.cached_tokens == 2 * 80 + 96 and computed == 97 + 2 * 17 + 1
