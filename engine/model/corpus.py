"""The text corpus shipped with the engine (prose, Japanese, code), cut into excerpts: the
prompts of the benchmark's workloads and of the agent sessions it replays (torch-free)."""

from __future__ import annotations

import random
from functools import cache
from importlib import resources


@cache
def corpus_paragraphs() -> tuple[str, ...]:
    """The paragraphs of the corpus shipped in moelab.engine.model (read once)."""
    root = resources.files("moelab.engine.model") / "data" / "corpus"
    paragraphs: list[str] = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".txt"):
            text = entry.read_text(encoding="utf-8")
            paragraphs += [p.strip() for p in text.split("\n\n") if p.strip()]
    assert paragraphs, "the engine's corpus is empty"
    return tuple(paragraphs)


def excerpt(rng: random.Random, chars: int) -> str:
    """Consecutive corpus paragraphs from a seeded start, wrapping around, about `chars` long."""
    paragraphs = corpus_paragraphs()
    i = rng.randrange(len(paragraphs))
    out: list[str] = []
    size = 0
    while size < chars:
        piece = paragraphs[i % len(paragraphs)]
        out.append(piece)
        size += len(piece) + 2
        i += 1
    return "\n\n".join(out)[:chars]
