"""The o200k vocabulary file openai-harmony loads (o200k_base.tiktoken: each ordinary token's
bytes in base64 and its rank, in rank order), written from a source on this machine, since
openai-harmony would download it and no Python package ships it:

- a gpt-oss checkpoint's tokenizer.json, which holds the same vocabulary byte-level, each
  token's id its rank;
- the npm package js-tiktoken (`npm pack js-tiktoken@1.0.21`), whose ranks/o200k_base.js holds
  it as runs of base64 tokens after their first rank.

The file is written only if its SHA-256 is the one openai-harmony checks. `python -m
tests.engine.o200k SOURCE DIR` writes DIR/o200k_base.tiktoken; TIKTOKEN_ENCODINGS_BASE=DIR then
lets openai-harmony load it offline (tests/engine/test_harmony_reference.py, .ci/run).
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import tarfile
from pathlib import Path

from moelab.engine.model.tokenizer import _BYTE_OF_CHAR

SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
RANKS = 199998  # its ordinary tokens; the special ones follow them
FILE = "o200k_base.tiktoken"
JS_RANKS = "package/dist/ranks/o200k_base.js"


def lines(ranks: dict[int, bytes]) -> bytes:
    return b"".join(base64.b64encode(raw) + b" %d\n" % rank for rank, raw in sorted(ranks.items()))


def from_tokenizer_json(path: Path) -> bytes:
    """The vocabulary of a byte-level tokenizer.json (its ids below RANKS)."""
    vocab = json.loads(path.read_text())["model"]["vocab"]
    return lines(
        {rank: bytes(_BYTE_OF_CHAR[c] for c in piece)
         for piece, rank in vocab.items() if rank < RANKS}
    )  # fmt: skip


def from_js_tiktoken(package: Path) -> bytes:
    """The vocabulary in js-tiktoken's package (its .tgz): lines of `! FIRST_RANK TOKEN...`."""
    with tarfile.open(package) as tar:
        member = tar.extractfile(JS_RANKS)
        assert member is not None, JS_RANKS
        source = member.read().decode()
    data = json.loads(source.removeprefix("export default ").rstrip().rstrip(";"))
    ranks = {}
    for line in data["bpe_ranks"].splitlines():
        _, first, *tokens = line.split(" ")
        for i, token in enumerate(tokens):
            ranks[int(first) + i] = base64.b64decode(token)
    return lines(ranks)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.engine.o200k TOKENIZER_JSON|JS_TIKTOKEN_TGZ DIR")
        return 2
    source, folder = Path(argv[0]), Path(argv[1])
    written = from_js_tiktoken(source) if source.suffix == ".tgz" else from_tokenizer_json(source)
    if hashlib.sha256(written).hexdigest() != SHA256:
        print(f"{source} does not hold the o200k vocabulary (its SHA-256 differs)")
        return 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FILE).write_bytes(written)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
