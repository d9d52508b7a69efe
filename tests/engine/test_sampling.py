"""Sampling: greedy picks the top logit; top-k and top-p limit the choices; seeds repeat."""

from __future__ import annotations

import math

import torch

from moelab.engine.sampling import Sampler, SamplingParams


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 300) -> set[int]:
    sampler = Sampler()
    return {sampler.sample(logits[None], [params], [i])[0] for i in range(n)}


def test_greedy_takes_the_largest_logit():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert Sampler().sample(logits, [SamplingParams()] * 2, [1, 2]) == [1, 0]


def test_top_k_and_top_p_limit_the_choices():
    logits = torch.tensor([math.log(p) for p in (0.5, 0.3, 0.15, 0.05)])
    assert _draws(SamplingParams(temperature=1.0), logits) == {0, 1, 2, 3}
    assert _draws(SamplingParams(temperature=1.0, top_k=2), logits) == {0, 1}
    # keep the smallest set whose probability before the last one is within top_p
    assert _draws(SamplingParams(temperature=1.0, top_p=0.6), logits) == {0, 1}


def test_a_seed_repeats_its_tokens_and_others_differ():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))

    def run(seed: int) -> list[int]:
        sampler = Sampler()
        params = SamplingParams(temperature=1.0, seed=seed)
        return [sampler.sample(row[None], [params], [7])[0] for row in logits]

    assert run(11) == run(11)
    assert run(11) != run(12)
