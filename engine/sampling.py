"""Next-token sampling: greedy, temperature, top-k and top-p, seeded per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be 0 or more")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be 0 (off) or more")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class Sampler:
    """Samples for a batch of sequences, each with its own params and generator."""

    generators: dict[int, torch.Generator] = field(default_factory=dict)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]
    ) -> list[int]:
        """One token per row of `logits` [N, V] (fp32)."""
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        out = []
        for row, p, seq_id in zip(logits, params, seq_ids, strict=True):
            if p.greedy:
                out.append(int(row.argmax()))
                continue
            # on the logits' device: a vocabulary-sized sort and softmax there, one small sync
            out.append(self._sample_row(row.float(), p, seq_id))
        return out

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, seq_id: int) -> int:
        gen = self.generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=row.device)
            if p.seed is not None:
                gen.manual_seed(p.seed)
            else:
                gen.seed()
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
        return int(torch.multinomial(probs, 1, generator=gen))

    def forget(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
