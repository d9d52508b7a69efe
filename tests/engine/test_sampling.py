"""Sampling: greedy picks the top logit; top-k, top-p and min-p limit the choices; seeds repeat;
the logit bias and the repetition, frequency and presence penalties adjust the logits first
(against Hugging Face's logits processors where it has them); draws come in the softmax's
proportions, each row's from its own seed and position alone (their kernel: tests/kernels/
test_draw.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from moelab.engine.runtime.sampling import (
    GREEDY_ROW,
    TOP_K_WIDTH,
    Cut,
    RowDraw,
    Sampler,
    SamplingParams,
    adjust_logits,
    draw_tensors,
    draw_tokens,
)


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
                dict(logprobs=21), dict(logprobs=-1), dict(seed=2**63)):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def _draw_rows(logits: torch.Tensor, draw: RowDraw, positions: range, **kw) -> torch.Tensor:
    """One draw per position, all from the same logits [V] and draw (a batch of rows)."""
    n = len(positions)
    args = draw_tensors([draw] * n, list(positions), logits.device)
    return draw_tokens(logits.expand(n, -1), *args, **kw)


def _expected_shares(logits: torch.Tensor, temperature: float, kept: list[int]) -> torch.Tensor:
    probs = torch.zeros_like(logits)
    probs[kept] = torch.softmax(logits[kept] / temperature, dim=-1)
    return probs


@pytest.mark.parametrize(
    "draw, kept",
    [
        (RowDraw(1.0, 0, 1.0, 0.0, 3), [0, 1, 2, 3, 4, 5]),
        (RowDraw(0.5, 0, 1.0, 0.0, 4), [0, 1, 2, 3, 4, 5]),
        (RowDraw(1.0, 3, 1.0, 0.0, 5), [0, 1, 2]),
        # within top-p 0.7 before the last: 0.4, then 0.4 + 0.25 (the third token is the last)
        (RowDraw(1.0, 0, 0.7, 0.0, 6), [0, 1, 2]),
        (RowDraw(1.0, 0, 1.0, 0.3, 7), [0, 1, 2]),  # min-p: at least 0.3 * 0.4
        (RowDraw(1.0, 4, 0.5, 0.0, 8), [0, 1]),  # top-k, then top-p of the top four
    ],
    ids=["plain", "cold", "top-k", "top-p", "min-p", "top-k-top-p"],
)
def test_draws_come_in_the_softmaxs_proportions_within_the_filters(draw, kept):
    logits = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]).log()
    n = 40_000
    tokens = _draw_rows(logits, draw, range(1000, 1000 + n))
    counts = torch.bincount(tokens, minlength=6).double()
    shares = _expected_shares(logits, draw.temperature, kept).double()
    assert set(torch.nonzero(counts).flatten().tolist()) == set(kept)
    # each share within 5 standard errors of its probability
    tolerance = 5 * (shares * (1 - shares) / n).sqrt() + 1e-9
    assert ((counts / n - shares).abs() <= tolerance).all(), (counts / n, shares)


def test_a_rows_draw_depends_on_its_seed_and_position_alone():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 500, generator=gen)
    draws = [RowDraw(0.9, 0, 1.0, 0.0, 11), RowDraw(1.2, 40, 0.9, 0.0, 12), GREEDY_ROW,
             RowDraw(0.7, 0, 1.0, 0.05, 2**62 + 5), RowDraw(1.0, 0, 0.95, 0.0, 11),
             RowDraw(1.0, 1, 1.0, 0.0, 13)]  # fmt: skip
    positions = [5, 9, 3, 70_000, 6, 8]
    together = draw_tokens(logits, *draw_tensors(draws, positions, logits.device))
    alone = []
    for i in range(6):
        args = draw_tensors(draws[i : i + 1], positions[i : i + 1], logits.device)
        alone.append(int(draw_tokens(logits[i : i + 1], *args)))
    assert together.tolist() == alone
    assert alone[2] == int(logits[2].argmax()) and alone[5] == int(logits[5].argmax())
    # without top-k or top-p, the draw without the sort is the same
    plain = [0, 2, 3]
    args = draw_tensors([draws[i] for i in plain], [positions[i] for i in plain], logits.device)
    assert draw_tokens(logits[plain], *args, cut=Cut.TOP).tolist() == [alone[i] for i in plain]


def test_a_rows_tokens_do_not_depend_on_the_cut_its_batch_takes():
    """A row draws the same tokens under its own cut and any wider one its neighbours bring:
    a top_k within TOP_K_WIDTH reads that many sorted logits from torch.topk or from the sort.
    A top_k one past the width takes the sort and draws its last token too."""
    gen = torch.Generator().manual_seed(12)
    vocab, n = 400, 3000
    logits = torch.randn(vocab, generator=gen) * 0.05  # nearly flat: every kept token is drawn
    ranks = logits.argsort(descending=True)
    draws = {
        Cut.TOP: [RowDraw(1.0, 0, 1.0, 0.0, 1), RowDraw(0.8, 0, 1.0, 0.5, 2), GREEDY_ROW],
        Cut.NARROW: [RowDraw(1.0, 20, 0.9, 0.0, 3), RowDraw(1.0, TOP_K_WIDTH, 1.0, 0.0, 4)],
        Cut.SORT: [RowDraw(1.0, TOP_K_WIDTH + 1, 1.0, 0.0, 5), RowDraw(1.0, 0, 0.5, 0.0, 6)],
    }
    for own, rows in draws.items():
        for draw in rows:
            assert draw.cut is own
            tokens = {cut: _draw_rows(logits, draw, range(n), cut=cut) for cut in Cut if cut >= own}
            assert all(torch.equal(t, tokens[own]) for t in tokens.values()), draw
            # the last token top_k keeps is drawn, none past it
            if draw.top_k and draw.top_p == 1:
                drawn = set(tokens[own].tolist())
                assert drawn <= set(ranks[: draw.top_k].tolist())
                assert int(ranks[draw.top_k - 1]) in drawn


def test_a_sequence_draws_the_same_tokens_whatever_else_the_sampler_saw():
    """A seeded request's tokens follow from its seed and positions: the same whether it is
    sampled alone or beside others, by a fresh sampler or an old one (its draws have no state
    to lose, so a preempted sequence recomputed draws them again)."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(8, 300, generator=gen)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=21)

    def tokens(sampler: Sampler, neighbour: bool) -> list[int]:
        seq = Seq(params, 5, [1, 2, 3], [])
        other = Seq(SamplingParams(temperature=0.5), 6, [4], [])
        for row in logits:
            batch = [seq, other] if neighbour else [seq]
            picked = sampler.sample(row.expand(len(batch), -1), batch)[0]
            seq.output_ids.append(picked[0])
            other.output_ids.append(picked[-1])
        return seq.output_ids

    used = Sampler(3)
    used.sample(logits[:2], [Seq(SamplingParams(temperature=1.0), 1), Seq(params, 2)])
    first = tokens(Sampler(), False)
    assert tokens(used, True) == first and tokens(Sampler(), True) == first
    assert len(set(first)) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_draw_captured_in_a_cuda_graph_gives_the_eager_draws_tokens():
    gen = torch.Generator(device="cuda").manual_seed(10)
    logits = torch.randn(4, 151_936, device="cuda", generator=gen) * 3
    draws = [RowDraw(0.8, 0, 0.95, 0.0, 1), RowDraw(1.0, 50, 1.0, 0.02, 2), GREEDY_ROW,
             RowDraw(0.6, 0, 1.0, 0.0, 3)]  # fmt: skip
    args = draw_tensors(draws, [10, 20, 30, 40], logits.device)
    out = torch.zeros(4, dtype=torch.long, device="cuda")
    expected = draw_tokens(logits, *args)
    for cut in Cut:
        graph = torch.cuda.CUDAGraph()
        draw_tokens(logits, *args, out=out, cut=cut)  # warm-up
        with torch.cuda.graph(graph):
            draw_tokens(logits, *args, out=out, cut=cut)
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        # row 0 (top-p) needs the sort, row 1 (top-k 50) the top-k: the rows whose cut this is
        # or is narrower than it draw the eager tokens
        rows = {Cut.SORT: [0, 1, 2, 3], Cut.NARROW: [1, 2, 3], Cut.TOP: [2, 3]}[cut]
        assert torch.equal(out[rows], expected[rows])
