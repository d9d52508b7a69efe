"""The MoE kernels with FP8 expert banks against a reference on the dequantized weights
(interpreter on CPU, fp32 activations, small ragged shapes; natively on a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelab.kernels import common, fp8, fp8_moe, fused_moe, grouped_moe
from moelab.kernels.common import tl, triton
from moelab.kernels.fused_moe import DecodeMoEConfig
from moelab.kernels.fused_moe_one_token import OneTokenMoEConfig
from moelab.kernels.grouped_moe import GroupedMoEConfig

from .kernel_inputs import DEVICE, assert_matches, randn, route_table, route_weights
from .test_fused_moe_one_token import one_token_routes

pytestmark = pytest.mark.usefixtures("triton_runs")

# Neither multiple of 128 nor of the tiles: blocks and reduction steps end inside a tile.
HIDDEN, INTER = 200, 140
# One-token tiles: gate/up steps of 256 columns (two spans, one per 128-column block, the second
# partly past H), down steps of 64 (two spans per block); several row blocks per route.
ONE_TOKEN = OneTokenMoEConfig(
    gate_up_block_n=8, gate_up_block_k=256, down_block_n=16, down_block_k=64
)


@dataclasses.dataclass(frozen=True)
class Bank:
    """An FP8 expert bank and the fp32 weights it dequantizes to (the reference's)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale_inv: torch.Tensor
    w2_scale_inv: torch.Tensor

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        return {"w13_scale_inv": self.w13_scale_inv, "w2_scale_inv": self.w2_scale_inv}

    @property
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            fp8.dequantize(self.w13, self.w13_scale_inv),
            fp8.dequantize(self.w2, self.w2_scale_inv),
        )


def fp8_bank(
    gen: torch.Generator,
    experts: int,
    hidden: int = HIDDEN,
    inter: int = INTER,
    magnitude: float = 1.0,
    as_bits: bool = False,
) -> Bank:
    """Random experts quantized block by block (fp8.quantize); as_bits: their uint8 bits.
    Blocks differ in scale by up to 64x, so that a factor taken from the wrong block shows."""
    w13 = _spread_blocks(gen, randn(gen, experts, 2 * inter, hidden, scale=hidden**-0.5))
    w2 = _spread_blocks(gen, randn(gen, experts, hidden, inter, scale=inter**-0.5))
    w13, w2 = w13 * magnitude, w2 * magnitude
    q13, s13 = fp8.quantize(w13)
    q2, s2 = fp8.quantize(w2)
    if as_bits:
        q13, q2 = q13.view(torch.uint8), q2.view(torch.uint8)
    return Bank(q13, q2, s13, s2)


def _spread_blocks(gen: torch.Generator, w: torch.Tensor) -> torch.Tensor:
    """w with each 128x128 block scaled by its own power of two in [1/8, 8]."""
    experts, n, k = w.shape
    spread = 2.0 ** torch.randint(-3, 4, (experts, fp8.blocks(n), fp8.blocks(k)), generator=gen)
    factors = spread.repeat_interleave(fp8.BLOCK, 1).repeat_interleave(fp8.BLOCK, 2)
    return w * factors[:, :n, :k].to(w.device)


@triton.jit
def _widen_kernel(bits_ptr, factor_ptr, x_ptr, values_ptr, products_ptr, N: tl.constexpr):
    """Both of fp8_moe's widenings of N codes: the exact values (the tl.dot kernels'), and the
    one-token kernels' product of a code, a block factor and an activation."""
    i = tl.arange(0, N)
    b = tl.load(bits_ptr + i)
    tl.store(values_ptr + i, fp8_moe.values(b))
    factor = fp8_moe.weight_factor(tl.load(factor_ptr))
    x = fp8_moe.activation(tl.load(x_ptr))
    tl.store(products_ptr + i, fp8_moe.widened(b) * factor * x)


@pytest.mark.parametrize("factor", [1.0, 2.0**-20, 0.0123, 300.0, 5e6])
def test_widening_decodes_every_code_exactly(factor):
    # subnormals included (codes 1..7 and 129..135), and factors past 2^8, where one multiply
    # by factor * 2^120 would overflow
    bits = fp8_moe.bits(torch.arange(256, dtype=torch.int32).to(torch.uint8)).to(DEVICE)
    values = torch.empty(256, device=DEVICE)
    products = torch.empty(256, device=DEVICE)
    x = torch.tensor([1.5], device=DEVICE)
    _widen_kernel[(1,)](bits, torch.tensor([factor], device=DEVICE), x, values, products, N=256)
    expected = fp8.widen(bits.cpu())
    finite = ~expected.isnan()
    assert torch.equal(values.cpu()[finite], expected[finite])
    assert torch.equal(products.cpu()[finite], (expected[finite] * factor) * 1.5)
    assert values[1].item() == 2.0**-9 and values[0x86].item() == -6 * 2.0**-9
    # the NaN codes widen to ±480 (a checkpoint holds none: quantizers clamp to ±448)
    assert values[0x7F].item() == 480.0 and values[0xFF].item() == -480.0


@triton.jit
def _word_dots_kernel(words_ptr, xs_ptr, out_ptr, W: tl.constexpr, PTX: tl.constexpr):
    words = tl.load(words_ptr + tl.arange(0, W))[None, :]
    xs = tl.load(xs_ptr + tl.arange(0, 4 * W))[None, :]
    tl.store(out_ptr + tl.arange(0, W), tl.reshape(fp8_moe.word_dots(words, xs, PTX), (W,)))


@pytest.mark.parametrize("column", range(4))
def test_word_dots_decode_every_code_exactly(gen, column):
    # word j holds code j at byte `column` beside random bytes that multiply a zero activation:
    # each dot is code j's value times 2^-8 times the activation, exactly
    grid = torch.randint(0, 256, (256, 4), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    grid[:, column] = codes
    words = grid.reshape(-1).view(torch.int32).to(DEVICE)
    xs = torch.zeros(1024, device=DEVICE)
    xs[column::4] = 1.5
    out = torch.empty(256, device=DEVICE)
    _word_dots_kernel[(1,)](words, xs, out, W=256, PTX=common.inline_ptx(out.device))
    expected = fp8.widen(codes) * 2.0**-8 * 1.5
    finite = ~expected.isnan()
    assert torch.equal(out.cpu()[finite], expected[finite])
    assert out[1].item() == 2.0**-17 * 1.5 and out[0x86].item() == -6 * 2.0**-17 * 1.5
    # the NaN codes widen to ±480, as `widened` does
    assert out[0x7F].item() == 480 * 2.0**-8 * 1.5 and out[0xFF].item() == -480 * 2.0**-8 * 1.5


def test_one_token_fp8_needs_rows_of_whole_words(gen):
    # H and I not multiples of 4: the rows do not split into the words the one-token launches
    # read; without a config one token takes the tl.dot launches, with one it is refused
    x = randn(gen, 1, 70)
    slot_ids = route_table(gen, 1, 2, 3)
    weights = route_weights(gen, 1, 2)
    bank = fp8_bank(gen, 3, hidden=70, inter=42)
    out = fused_moe.fused_moe_decode_triton(x, slot_ids, weights, bank.w13, bank.w2, **bank.scales)
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, *bank.dequantized)
    assert_matches(out, ref, tol=1e-5)
    with pytest.raises(ValueError, match=r"words of 4 bytes: H \(70\) and I \(42\)"):
        fused_moe.fused_moe_decode_triton(
            x, slot_ids, weights, bank.w13, bank.w2, config=ONE_TOKEN, **bank.scales
        )


@pytest.mark.parametrize("loop", [False, True], ids=["route-grid", "loop-routes"])
@pytest.mark.parametrize("case", ["some_masked", "duplicate"])
# ragged: the tiles end past the rows (masked loads); even: ONE_TOKEN's tiles divide H and I,
# and the loops load without masks
@pytest.mark.parametrize("shape", [(HIDDEN, INTER), (256, 128)], ids=["ragged", "even"])
def test_one_token_matches_the_dequantized_reference(gen, case, loop, shape):
    """The engine's form (reduce=False): each route's own weighted output."""
    hidden, inter = shape
    x = randn(gen, 1, hidden)
    slot_ids = one_token_routes(case, gen, 4, 6)
    weights = route_weights(gen, 1, 4)
    bank = fp8_bank(gen, 6, hidden=hidden, inter=inter)
    config = dataclasses.replace(ONE_TOKEN, loop_routes=loop)
    out = fused_moe.fused_moe_decode_triton(
        x, slot_ids, weights, bank.w13, bank.w2, config=config, reduce=False, **bank.scales
    )
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, *bank.dequantized, reduce=False)
    assert ref.abs().max().item() > 0
    assert_matches(out, ref, tol=1e-5)
    assert (out[slot_ids < 0] == 0).all()


@pytest.mark.parametrize(
    ("tokens", "top_k", "slots", "config"),
    [
        (1, 8, 10, None),  # one token, the chooser's tiles (for a GPU of 4 SMs: 16 rows)
        (3, 4, 6, DecodeMoEConfig(gate_up_block_k=256, down_block_k=64)),  # steps cut to 128
        (5, 2, 3, None),  # every slot shared by several tokens
    ],
)
def test_decode_matches_the_dequantized_reference(gen, monkeypatch, tokens, top_k, slots, config):
    monkeypatch.setattr(common, "sm_count", lambda device: 4)
    x = randn(gen, tokens, HIDDEN)
    slot_ids = route_table(gen, tokens, top_k, slots, masked=0.25)
    if tokens > 1:
        slot_ids[1] = -1  # a token whose routes all run on the CPU
    weights = route_weights(gen, tokens, top_k)
    bank = fp8_bank(gen, slots)
    out = fused_moe.fused_moe_decode_triton(
        x, slot_ids, weights, bank.w13, bank.w2, config=config, **bank.scales
    )
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, *bank.dequantized)
    assert ref.abs().max().item() > 0
    assert_matches(out, ref, tol=1e-5)
    if tokens > 1:
        assert out[1].abs().max().item() == 0.0


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "config", "masked"),
    [
        (37, 3, 5, GroupedMoEConfig(16, 16, 32, 256, num_warps=4, num_stages=2), 0.1),
        (9, 2, 8, None, 0.0),  # some experts get no tokens
    ],
)
def test_grouped_matches_the_dequantized_reference(gen, tokens, top_k, experts, config, masked):
    x = randn(gen, tokens, HIDDEN)
    expert_ids = route_table(gen, tokens, top_k, experts, masked=masked)
    weights = route_weights(gen, tokens, top_k)
    bank = fp8_bank(gen, experts)
    out = grouped_moe.grouped_moe_triton(
        x, expert_ids, weights, bank.w13, bank.w2, config=config, **bank.scales
    )
    ref = grouped_moe.grouped_moe_ref(x, expert_ids, weights, *bank.dequantized)
    assert ref.abs().max().item() > 0
    assert_matches(out, ref, tol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3])
def test_bits_and_float8_banks_agree_at_any_block_factor(gen, tokens):
    # w13's blocks quantized with factors far above 2^8, w2's far below 2^-20
    x = randn(gen, tokens, 72, scale=1e-7)
    slot_ids = route_table(gen, tokens, 3, 4)
    weights = route_weights(gen, tokens, 3)
    big = fp8_bank(gen, 4, hidden=72, inter=44, magnitude=1e7)
    small = fp8_bank(gen, 4, hidden=72, inter=44, magnitude=1e-6)
    bank = Bank(big.w13, small.w2, big.w13_scale_inv, small.w2_scale_inv)
    assert bank.w13_scale_inv.min() > 2.0**8 and bank.w2_scale_inv.max() < 2.0**-20
    as_bits = Bank(bank.w13.view(torch.uint8), bank.w2.view(torch.uint8), *bank.scales.values())
    config = ONE_TOKEN if tokens == 1 else None
    outs = [
        fused_moe.fused_moe_decode_triton(
            x, slot_ids, weights, b.w13, b.w2, config=config, **b.scales
        )
        for b in (bank, as_bits)
    ]
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, *bank.dequantized)
    assert_matches(outs[0], ref, tol=1e-5)
    assert torch.equal(outs[0], outs[1])


def test_bf16_activations_with_fp32_compute(gen):
    x = randn(gen, 2, HIDDEN, dtype=torch.bfloat16)
    slot_ids = route_table(gen, 2, 4, 5)
    weights = route_weights(gen, 2, 4)
    bank = fp8_bank(gen, 5, as_bits=True)
    kwargs = {"compute_dtype": torch.float32}
    out = fused_moe.fused_moe_decode_triton(
        x, slot_ids, weights, bank.w13, bank.w2, **bank.scales, **kwargs
    )
    ref = fused_moe.fused_moe_decode_ref(x, slot_ids, weights, *bank.dequantized, **kwargs)
    assert_matches(out, ref, tol=1e-5)


def test_references_dequantize_as_fp8_dequantize_does(gen):
    x = torch.randn(5, 72, generator=gen)
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [-1, -1], [0, 1]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    bank = fp8_bank(gen, 3, hidden=72, inter=44)
    bank = Bank(*(t.cpu() for t in (bank.w13, bank.w2, bank.w13_scale_inv, bank.w2_scale_inv)))
    wide = bank.dequantized
    for module, name in ((fused_moe, "fused_moe_decode_ref"), (grouped_moe, "grouped_moe_ref")):
        ref = getattr(module, name)
        assert torch.equal(ref(x, ids, weights, bank.w13, bank.w2, **bank.scales),
                           ref(x, ids, weights, *wide))  # fmt: skip


def test_cpu_tensors_go_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(fused_moe, "fused_moe_decode_triton", refuse)
    monkeypatch.setattr(grouped_moe, "grouped_moe_triton", refuse)
    x = torch.randn(3, 72, generator=gen)
    ids = torch.tensor([[0, 1], [1, -1], [2, 0]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=gen)
    bank = fp8_bank(gen, 3, hidden=72, inter=44)
    bank = Bank(*(t.cpu() for t in (bank.w13, bank.w2, bank.w13_scale_inv, bank.w2_scale_inv)))
    ref = fused_moe.fused_moe_decode_ref(x, ids, weights, *bank.dequantized)
    decode = fused_moe.fused_moe_decode(x, ids, weights, bank.w13, bank.w2, **bank.scales)
    prefill = grouped_moe.grouped_moe(x, ids, weights, bank.w13, bank.w2, **bank.scales)
    assert_matches(decode, ref, tol=1e-6)
    assert_matches(prefill, ref, tol=1e-5)


def _bank_cases(gen: torch.Generator) -> dict[str, tuple[dict[str, object], str]]:
    bank = fp8_bank(gen, 3, hidden=32, inter=16)
    bf16 = (
        torch.ones(3, 32, 32, dtype=torch.bfloat16, device=DEVICE),
        torch.ones(3, 32, 16, dtype=torch.bfloat16, device=DEVICE),
    )
    fp8_w = {"w13": bank.w13, "w2": bank.w2}
    return {
        "no factors": (fp8_w, "w13 is FP8 .* needs its block factors: pass w13_scale_inv"),
        "one factor": ({**fp8_w, "w13_scale_inv": bank.w13_scale_inv}, "pass w2_scale_inv"),
        "factors for bf16": (
            {"w13": bf16[0], "w2": bf16[1], **bank.scales},
            "w13_scale_inv and w2_scale_inv given for torch.bfloat16 weights",
        ),
        "half a bank": (
            {"w13": bank.w13, "w2": bf16[1], **bank.scales},
            "an expert bank is FP8 in both or in neither",
        ),
        "wrong blocks": (
            {**fp8_w, **bank.scales, "w2_scale_inv": bank.w2_scale_inv[:, :, :0]},
            r"w2_scale_inv must be float32 \(3, 1, 1\)",
        ),
        "bf16 factors": (
            {**fp8_w, **bank.scales, "w13_scale_inv": bank.w13_scale_inv.bfloat16()},
            r"w13_scale_inv must be float32 .* got torch.bfloat16",
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["no factors", "one factor", "factors for bf16", "half a bank", "wrong blocks", "bf16 factors"],
)
def test_a_bank_that_does_not_fit_its_factors_is_refused(gen, case):
    kwargs, message = _bank_cases(gen)[case]
    x = randn(gen, 2, 32)
    ids = route_table(gen, 2, 2, 3)
    weights = route_weights(gen, 2, 2)
    for call in (
        fused_moe.fused_moe_decode_triton,
        fused_moe.fused_moe_decode_ref,
        grouped_moe.grouped_moe_triton,
        grouped_moe.grouped_moe_ref,
    ):
        with pytest.raises(ValueError, match=message):
            call(x, ids, weights, **kwargs)
