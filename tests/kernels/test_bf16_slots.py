"""The order in which the CPU kernel's bf16 dot products read x (kernels/csrc/bf16dot.h,
`bf16_slots`), on every CPU: the dot products themselves need AVX-512 BF16
(test_cpu_experts_bf16dot.py), the copy of x into their order is plain C++ in every build.

The order follows the widening of each format's bytes, written here from bf16dot.h's definition
of it: FP8, of each 64 values, the first 8 of each 16, then their last 8; the 4-bit formats, of
each whole 128 values, every fourth from the first, then from the second, third and fourth; of
the last K % 128, each 64's even values, then its odd ones (a last 32: its 16 even, 16 odd).
"""

from __future__ import annotations

import pytest
import torch

from moelab.kernels.cpu_experts import load_native

from .test_cpu_experts import SEED


def slot_order(k: int, fp8: bool) -> list[int]:
    """The value each place of the copy holds, from the order's definition."""
    order: list[int] = []
    if fp8:
        for base in range(0, k, 64):
            for half in (0, 8):
                order += [base + 16 * lane + half + w for lane in range(4) for w in range(8)]
        return order
    whole = k // 128 * 128
    for base in range(0, whole, 128):
        order += [base + 4 * j + q for q in range(4) for j in range(32)]
    for base in range(whole, k, 64):
        n = min(64, k - base)
        order += [base + i for i in range(0, n, 2)] + [base + i for i in range(1, n, 2)]
    return order


def bf16_values(k: int, gen: torch.Generator) -> torch.Tensor:
    """k fp32 values that are bf16 values: random ones of many binades, and the specials
    (signed zeros, infinities, a subnormal, a quiet and a signalling NaN)."""
    x = torch.randn(k, generator=gen) * torch.exp2(torch.randint(-60, 60, (k,), generator=gen))
    x = x.bfloat16().float()
    specials = (
        torch.tensor(
            [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00010000, 0x7FC00000, 0x7F810000],
            dtype=torch.int64,
        )
        .to(torch.int32)
        .view(torch.float32)
    )
    at = torch.randperm(k, generator=gen)[: min(k, len(specials))]
    x[at] = specials[: len(at)]
    return x


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "4-bit"])
def test_x_goes_to_the_order_the_widening_gives_the_weights(fp8: bool) -> None:
    """Every length the formats take up to 384, and the real hidden sizes: each place holds its
    value's bf16 (its top 16 bits, a NaN quieted as rounding to bf16 quiets it)."""
    gen = torch.Generator().manual_seed(SEED)
    step = 64 if fp8 else 32
    for k in [*range(step, 385, step), 2048, 2880]:
        x = bf16_values(k, gen)
        out = torch.zeros(k, dtype=torch.int16)
        load_native().bf16_slots_of(x.data_ptr(), out.data_ptr(), k, fp8)
        bits = x.view(torch.int32).long() & 0xFFFFFFFF
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        want_all = ((bits >> 16) | torch.where(nan, 0x40, 0)).to(torch.int64)
        want = want_all[slot_order(k, fp8)]
        got = out.long() & 0xFFFF
        wrong = (got != want).nonzero().flatten().tolist()
        assert not wrong, f"K={k} (seed {SEED}): places {wrong[:8]} hold the wrong value"


def test_lengths_the_order_does_not_cut_are_refused() -> None:
    x, out = torch.zeros(96), torch.zeros(96, dtype=torch.int16)
    with pytest.raises(ValueError, match="multiple of 64"):
        load_native().bf16_slots_of(x.data_ptr(), out.data_ptr(), 96, True)
    with pytest.raises(ValueError, match="multiple of 64"):
        load_native().bf16_slots_of(x.data_ptr(), out.data_ptr(), 48, False)
