"""Next-token sampling: greedy, temperature, top-k, top-p and min-p, seeded per request; the
logits first adjusted by the request's logit bias and its repetition, frequency and presence
penalties; each chosen token's log probability and the likeliest alternatives where asked."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    The adjustments of the logits, applied in this order before the temperature:
    - logit_bias: (token, bias) pairs added to those tokens' logits;
    - repetition_penalty (1: off): each token in the prompt or the output so far has its logit
      divided by it where positive and multiplied by it where not (as Hugging Face's and vLLM's);
    - frequency_penalty and presence_penalty (0: off): subtracted from each token's logit, the
      first times the times it appears in the output so far, the second once if it appears there
      (OpenAI's).
    min_p (0: off) keeps the tokens at least that share of the likeliest one's probability.
    logprobs (None: off): each chosen token's log probability and that many of the likeliest
    tokens' (up to MAX_TOP_LOGPROBS), under the model's own distribution: the softmax of its
    logits before any adjustment or temperature (`TokenLogprobs`)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be 0 or more")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be 0 (off) or more")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be above 0 (1: off)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be None (off) or 0 to {MAX_TOP_LOGPROBS}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the choice (a bias or a penalty)."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )

    @property
    def picks_the_top(self) -> bool:
        """Whether the token is the likeliest one after the adjustments (no draw)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def greedy(self) -> bool:
        """Whether the token is the model's own top logit and nothing else is read of the
        logits: the device may take it itself."""
        return self.picks_the_top and not self.adjusts_logits and self.logprobs is None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A chosen token's log probability and the likeliest tokens' (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Sampled(Protocol):
    """What the sampler reads of a sequence (scheduler.Sequence)."""

    id: int
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(slots=True)
class Sampler:
    """Samples for a batch of sequences, each with its own params and generator. A request
    without a seed takes the next one of a stream seeded with `seed` (the engine's --seed): a
    server's unseeded requests differ from each other, and the same requests in the same order
    after a start with the same seed get the same tokens."""

    seed: int = 0
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    _unseeded: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._unseeded = random.Random(self.seed)

    def sample(
        self, logits: torch.Tensor, seqs: Sequence[Sampled]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of `logits` [N, V] (fp32), row i for seqs[i], and its log
        probabilities where seqs[i] asks for them."""
        if all(s.params.greedy for s in seqs):
            return logits.argmax(dim=-1).tolist(), [None] * len(seqs)
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for raw, seq in zip(logits, seqs, strict=True):
            p = seq.params
            # on the logits' device: a vocabulary-sized sort and softmax there, one small sync
            raw = raw.float()
            row = adjust_logits(raw, seq) if p.adjusts_logits else raw
            token = int(row.argmax()) if p.picks_the_top else self._draw(row, p, seq.id)
            tokens.append(token)
            logprobs.append(None if p.logprobs is None else token_logprobs(raw, token, p.logprobs))
        return tokens, logprobs

    def _draw(self, row: torch.Tensor, p: SamplingParams, seq_id: int) -> int:
        gen = self.generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=row.device)
            gen.manual_seed(p.seed if p.seed is not None else self._unseeded.getrandbits(63))
            self.generators[seq_id] = gen
        row = row / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(0)
            drop = cumulative - sorted_probs > p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=gen))

    def forget(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)


def adjust_logits(row: torch.Tensor, seq: Sampled) -> torch.Tensor:
    """One sequence's logits [V] after its logit bias and penalties (SamplingParams), a new
    tensor on row's device."""
    p = seq.params
    row = row.clone()
    dev, vocab = row.device, row.numel()
    if p.logit_bias:
        tokens, biases = zip(*p.logit_bias, strict=True)
        index = torch.tensor(tokens, dtype=torch.long, device=dev)
        row.index_add_(0, index, torch.tensor(biases, dtype=row.dtype, device=dev))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(seq.prompt_ids + seq.output_ids, dtype=torch.long, device=dev)
        seen = seen.unique()
        values = row[seen]
        row[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if (p.frequency_penalty or p.presence_penalty) and seq.output_ids:
        out = torch.tensor(seq.output_ids, dtype=torch.long, device=dev)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def token_logprobs(raw: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """`token`'s log probability under the softmax of the model's fp32 logits `raw` [V], with the
    `top` likeliest tokens'."""
    logp = torch.log_softmax(raw, dim=-1)
    best = ()
    if top:
        values, ids = logp.topk(min(top, logp.numel()))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token, float(logp[token]), best)
