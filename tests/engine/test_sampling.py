"""Sampling: greedy picks the top logit; top-k, top-p and min-p limit the choices; seeds repeat;
the logit bias and the repetition, frequency and presence penalties adjust the logits first
(against Hugging Face's logits processors where it has them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from moelab.engine.sampling import Sampler, SamplingParams, adjust_logits


@dataclass
class Seq:
    """The parts of a scheduler Sequence that the sampler reads."""

    params: SamplingParams
    id: int = 0
    prompt_ids: list[int] = field(default_factory=lambda: [0])
    output_ids: list[int] = field(default_factory=list)


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 300) -> set[int]:
    sampler = Sampler()
    return {sampler.sample(logits[None], [Seq(params, i)])[0][0] for i in range(n)}


def test_greedy_takes_the_largest_logit():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens, logprobs = Sampler().sample(
        logits, [Seq(SamplingParams(), 1), Seq(SamplingParams(), 2)]
    )
    assert tokens == [1, 0] and logprobs == [None, None]


def test_top_k_top_p_and_min_p_limit_the_choices():
    logits = torch.tensor([math.log(p) for p in (0.5, 0.3, 0.15, 0.05)])
    assert _draws(SamplingParams(temperature=1.0), logits) == {0, 1, 2, 3}
    assert _draws(SamplingParams(temperature=1.0, top_k=2), logits) == {0, 1}
    # keep the smallest set whose probability before the last one is within top_p
    assert _draws(SamplingParams(temperature=1.0, top_p=0.6), logits) == {0, 1}
    # min_p: the tokens at least that share of the likeliest one's probability, as Hugging
    # Face's warper keeps them
    for min_p in (0.25, 0.5, 0.65):
        kept = MinPLogitsWarper(min_p, min_tokens_to_keep=1)(None, logits[None].clone())[0]
        expected = set(torch.nonzero(kept > -math.inf).flatten().tolist())
        assert _draws(SamplingParams(temperature=1.0, min_p=min_p), logits) == expected
        assert len(expected) == {0.25: 3, 0.5: 2, 0.65: 1}[min_p]


def test_a_seed_repeats_its_tokens_and_others_differ():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))

    def run(seed: int) -> list[int]:
        sampler = Sampler()
        seq = Seq(SamplingParams(temperature=1.0, seed=seed), 7)
        return [sampler.sample(row[None], [seq])[0][0] for row in logits]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_unseeded_requests_differ_and_repeat_from_the_engines_seed():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0)

    def requests(engine_seed: int) -> list[list[int]]:
        sampler = Sampler(engine_seed)  # four requests, ids 0..3, eight tokens each
        return [[sampler.sample(logits, [Seq(params, i)])[0][0] for _ in range(8)]
                for i in range(4)]  # fmt: skip

    first = requests(7)
    assert len({tuple(r) for r in first}) == 4  # no two requests alike
    assert requests(7) == first and requests(8) != first


def test_the_repetition_penalty_is_hugging_faces_over_the_prompt_and_the_output():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, generator=gen) * 3  # positive and negative logits
    prompt, output = [5, 9, 9, 40, 63], [2, 5, 17, 17, 17]
    for penalty in (0.7, 1.3, 2.0):
        seq = Seq(SamplingParams(repetition_penalty=penalty), 0, prompt, output)
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([prompt + output]), logits[None].clone()
        )[0]
        assert torch.equal(adjust_logits(logits, seq), theirs)


def test_frequency_and_presence_penalties_count_the_output_only():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(32, generator=gen)
    prompt, output = [1, 2, 3], [3, 7, 7, 7, 30, 3]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=-0.25)
    adjusted = adjust_logits(logits, Seq(params, 0, prompt, output))
    for token in range(32):
        count = output.count(token)  # the prompt's tokens 1 and 2 are not penalized
        expected = logits[token] - 0.5 * count - (-0.25 if count else 0.0)
        assert adjusted[token].item() == pytest.approx(expected.item(), abs=1e-6)
    # nothing generated yet: nothing to count
    assert torch.equal(adjust_logits(logits, Seq(params, 0, prompt, [])), logits)


def test_the_logit_bias_and_penalties_steer_even_a_greedy_pick():
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0]])
    bias = SamplingParams(logit_bias=((3, 100.0), (0, -100.0)))
    assert bias.adjusts_logits and not bias.greedy and bias.picks_the_top
    assert Sampler().sample(logits, [Seq(bias)])[0] == [3]
    # token 0, in the prompt, divided by 2: token 1 is the top one now
    repeat = SamplingParams(repetition_penalty=2.0)
    assert Sampler().sample(logits, [Seq(repeat, 0, [0], [])])[0] == [1]
    # a batch mixing plain greedy rows and adjusted ones
    both = torch.cat([logits, logits])
    assert Sampler().sample(both, [Seq(SamplingParams()), Seq(bias)])[0] == [0, 3]
    # the adjustments leave the caller's logits as they were
    assert logits.tolist() == [[4.0, 3.0, 1.0, 0.0]]


def test_logprobs_are_the_models_own_before_any_adjustment():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=gen) * 2
    expected = torch.log_softmax(logits, dim=-1)
    seqs = [
        Seq(SamplingParams(logprobs=3), 1),  # greedy, with the top three
        Seq(SamplingParams(temperature=0.7, seed=1, logprobs=0), 2),  # a draw, its own only
        Seq(SamplingParams(logprobs=2, logit_bias=((7, 50.0),)), 3),  # the bias picks 7
    ]
    tokens, logprobs = Sampler().sample(logits, seqs)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == 7
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp.token == token
        assert lp.logprob == pytest.approx(expected[i, token].item(), abs=1e-6)
    top_values, top_ids = expected[0].topk(3)
    assert [t for t, _ in logprobs[0].top] == top_ids.tolist()
    assert [v for _, v in logprobs[0].top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert logprobs[1].top == () and len(logprobs[2].top) == 2
    assert 7 not in [t for t, _ in logprobs[2].top]  # the model's likeliest, not the biased
    # asking for them keeps a request off the device's own argmax
    assert not SamplingParams(logprobs=0).greedy and SamplingParams().greedy


def test_bad_params_are_refused():
    for bad in (dict(min_p=1.5), dict(min_p=-0.1), dict(repetition_penalty=0.0),
                dict(logprobs=21), dict(logprobs=-1)):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**bad)
