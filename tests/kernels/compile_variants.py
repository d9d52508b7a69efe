"""How many decode attention kernels Triton compiles for sm_90 as the block table's width and the
sequence's length change, without a GPU: one JSON line. Run in its own process with
TRITON_INTERPRET unset (test_compile_variants.py does), as hopper_compile.py is."""

from __future__ import annotations

import json
import sys

import torch
from hopper_compile import as_hopper, compile_only

from moelab.kernels import common, paged_attention

KERNELS = (paged_attention._split_kernel, paged_attention._merge_kernel)


def attend(pages: int, length: int) -> int:
    """Decode attention of one sequence of `length` tokens through a table of `pages` pages of 16
    (the 30B geometry's heads); the attention kernels compiled so far."""
    q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    cache = torch.empty(pages + 1, 16, 4, 128, dtype=torch.bfloat16)
    table = torch.arange(pages, dtype=torch.int32).view(1, pages)
    lens = torch.tensor([length], dtype=torch.int32)
    paged_attention.paged_attention_decode_triton(q, cache, cache, table, lens, 0.1)
    return common.compiled_variants(KERNELS)


def main() -> int:
    if not as_hopper():
        return 2
    compile_only()
    # bench decode's sequences: a 16-token prompt; 32 tokens of warm-up (3 pages), 128 timed
    # (9 pages); the graphs' tables as wide as a 4,096-token context (256 pages)
    counts = {
        "graphs_width": attend(256, 17),
        "graphs_width_longer": attend(256, 140),
        "warmup_width": attend(3, 17),
        "timed_width": attend(9, 140),
        "timed_width_again": attend(9, 100),
    }
    counts["package"] = common.compiled_variants()
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
