"""Next-token sampling: greedy, temperature, top-k, top-p and min-p, seeded per request; the
logits first adjusted by the request's logit bias and its repetition, frequency and presence
penalties; each chosen token's log probability and the likeliest alternatives where asked.

A draw is the Gumbel-max trick: the likeliest token after adding to each logit (divided by the
temperature) the noise -log(-log(u)), u uniform, picks tokens in the softmax's proportions. The
noise is a hash of the request's seed, the drawn token's position and the token (`draw_tokens`),
not a generator's state: the same seeded request gets the same tokens whichever path draws them
(the host's sampler, or the decode graphs on the device while the host reads the step before,
engine/runtime/graphs.py), and after a preemption recomputes it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from ...kernels.draw import TOP_K_WIDTH, Cut, draw_tokens

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
    logits before any adjustment or temperature (`TokenLogprobs`).
    prompt_logprobs (None: off): the same for each prompt token after the first, given the
    tokens before it (a prompt's score; its prefill then takes nothing from the prefix cache)."""

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
    prompt_logprobs: int | None = None

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
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError("seed must fit in 64 bits (-2**63 to 2**63 - 1)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be None (off) or 0 to {MAX_TOP_LOGPROBS}")

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
        return self.picks_the_top and self.on_device

    @property
    def on_device(self) -> bool:
        """Whether the decode graphs may draw the token on the device (`draw_tokens`): nothing
        adjusts the logits (the penalties read the host's token lists) and nothing else is
        read of them."""
        return not self.adjusts_logits and self.logprobs is None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A chosen token's log probability and the likeliest tokens' (most likely first). None: a
    prompt's first token, which nothing before it predicts."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


class Sampled(Protocol):
    """What the sampler reads of a sequence (scheduler.Sequence)."""

    id: int
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]


class RowDraw(NamedTuple):
    """What one row's draw reads (`draw_tokens`): temperature 0 takes the top logit."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int

    @property
    def cut(self) -> Cut:
        """What of the sorted logits the draw's filters read."""
        if 0 < self.top_k <= TOP_K_WIDTH:
            return Cut.NARROW
        return Cut.SORT if self.top_k > 0 or self.top_p < 1 else Cut.TOP

    def device_floats(self) -> tuple[float, float, float]:
        """What the device reads as floats: the inverse temperature (0: the top logit), top-p,
        and min-p's offset from the top logit (-inf: off), T * ln(min_p), since
        p_i >= min_p * p_max is logit_i >= logit_max + T * ln(min_p)."""
        if self.temperature <= 0:
            return 0.0, self.top_p, -math.inf
        offset = self.temperature * math.log(self.min_p) if self.min_p > 0 else -math.inf
        return 1.0 / self.temperature, self.top_p, offset


GREEDY_ROW = RowDraw(0.0, 0, 1.0, 0.0, 0)


@dataclass(slots=True)
class Sampler:
    """Samples for a batch of sequences, each with its own params and seed. A request without a
    seed takes the next one of a stream seeded with `seed` (the engine's --seed) at its first
    draw: a server's unseeded requests differ from each other, and the same requests in the same
    order after a start with the same seed get the same tokens."""

    seed: int = 0
    seeds: dict[int, int] = field(default_factory=dict)
    _unseeded: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._unseeded = random.Random(self.seed)

    def row_draw(self, seq: Sampled) -> RowDraw:
        """What `draw_tokens` reads for `seq`'s next token."""
        p = seq.params
        if p.picks_the_top:
            return GREEDY_ROW
        seed = self.seeds.get(seq.id)
        if seed is None:
            seed = p.seed if p.seed is not None else self._unseeded.getrandbits(63)
            self.seeds[seq.id] = seed
        return RowDraw(p.temperature, p.top_k, p.top_p, p.min_p, seed)

    def sample(
        self, logits: torch.Tensor, seqs: Sequence[Sampled]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of `logits` [N, V] (fp32), row i for seqs[i], and its log
        probabilities where seqs[i] asks for them. Row i's token is the one at position
        len(prompt) + len(output) of seqs[i]."""
        if all(s.params.greedy for s in seqs):
            return logits.argmax(dim=-1).tolist(), [None] * len(seqs)
        raw = logits.float()
        rows = raw
        if any(s.params.adjusts_logits for s in seqs):
            rows = torch.stack([adjust_logits(r, s) if s.params.adjusts_logits else r
                                for r, s in zip(raw, seqs, strict=True)])  # fmt: skip
        draws = [self.row_draw(s) for s in seqs]
        positions = [len(s.prompt_ids) + len(s.output_ids) for s in seqs]
        # on the logits' device (a top-k or a vocabulary sort where a row filters), one small sync
        cut = max(d.cut for d in draws)
        tokens = draw_tokens(rows, *draw_tensors(draws, positions, rows.device), cut=cut).tolist()
        logprobs = [None if s.params.logprobs is None else token_logprobs(r, t, s.params.logprobs)
                    for r, t, s in zip(raw, tokens, seqs, strict=True)]  # fmt: skip
        return tokens, logprobs

    def forget(self, seq_id: int) -> None:
        self.seeds.pop(seq_id, None)


def draw_tensors(
    draws: Sequence[RowDraw], positions: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """`draw_tokens`' per-row arguments (after the logits) from each row's draw and position."""
    inv_t, top_p, min_offset = zip(*(d.device_floats() for d in draws), strict=True)

    def as_tensor(items, dtype) -> torch.Tensor:
        return torch.tensor(list(items), dtype=dtype, device=device)

    return (
        as_tensor(inv_t, torch.float32),
        as_tensor((d.top_k for d in draws), torch.long),
        as_tensor(top_p, torch.float32),
        as_tensor(min_offset, torch.float32),
        as_tensor((d.seed for d in draws), torch.long),
        as_tensor(positions, torch.long),
    )


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
