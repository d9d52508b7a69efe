"""e2m1 codes and their block scales widened in registers, with integer ops only: no FP4 or FP8
instruction, so that the same code runs on Turing, Ampere and later GPUs and under the Triton
interpreter. The MXFP4 and NVFP4 MoE kernels (mxfp4_moe, fp4_one_token) read their banks with
these: `values` and `scales` / `e4m3_scales` build each code's fp32 bits, `halves` a word's eight
codes as fp16 (each value times 2^-14)."""

from __future__ import annotations

from .common import tl, triton


@triton.jit
def values(codes):
    """fp32 of e2m1 `codes` (int32, 0-15), built from the bits: exponent e and mantissa m give
    fp32 exponent e + 126 (e > 0), m/2 = 0.5 or 0 for e = 0; bit 3 is the sign."""
    e = (codes >> 1) & 3
    m = codes & 1
    magnitude = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * 0x3F000000)
    return (magnitude | ((codes & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def scales(codes):
    """fp32 of E8M0 `codes` (int32, 0-255): 2^(code − 127), code 0 the subnormal 2^-127, 0xFF
    NaN."""
    bits = tl.where(codes == 0, 0x00400000, codes << 23)
    return tl.where(codes == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_scales(codes):
    """fp32 of e4m3 `codes` (int32, 0-255; NVFP4's block scales), built from the bits: exponent
    e > 0 and mantissa m give fp32 exponent e + 120 and mantissa m << 20; e = 0 is m · 2^-9;
    0x7F and 0xFF are NaN; bit 7 is the sign."""
    e = (codes >> 3) & 15
    m = codes & 7
    subnormal = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    bits = tl.where(e > 0, ((e + 120) << 23) | (m << 20), subnormal)
    bits = tl.where((codes & 127) == 127, 0x7FC00000, bits)
    return (bits | ((codes & 128) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _fp16_pair(pair, OUT: tl.constexpr):
    """The two fp16 of a uint32's halves, in OUT, joined: [..., 2], the low half first."""
    low = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(OUT)
    high = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(OUT)
    return tl.join(low, high)


@triton.jit
def _code_pairs(words):
    """The e2m1 codes of `words` (int32, eight codes each) as four uint32 of two fp16 each:
    codes (0, 4), (1, 5), (2, 6) and (3, 7), each its value times 2^-14. A code's magnitude
    bits (e1 e0 m) at fp16 bit 9 and its sign at bit 15 make that fp16 exactly: exponent field e
    gives 2^(e − 15) · (1 + m/2) = 2^(e − 1) · (1 + m/2) · 2^-14 for e > 0, and for e = 0 the
    fp16 subnormal m/2 · 2^-14. Codes 16 bits apart go to their places in one uint32 at once, two
    shifts and two ands-ors for two codes."""
    w = words.to(tl.uint32, bitcast=True)
    magnitude = 0x0E000E00
    sign = 0x80008000
    c0_c4 = ((w << 9) & magnitude) | ((w << 12) & sign)
    c1_c5 = ((w << 5) & magnitude) | ((w << 8) & sign)
    c2_c6 = ((w << 1) & magnitude) | ((w << 4) & sign)
    c3_c7 = ((w >> 3) & magnitude) | (w & sign)
    return c0_c4, c1_c5, c2_c6, c3_c7


@triton.jit
def halves(words, OUT: tl.constexpr):
    """The e2m1 codes of `words` [N, W] (int32, four bytes, eight codes each: byte j's low nibble
    is column 2j, its high nibble 2j + 1) as [N, 8W] in column order, each its value times 2^-14
    (`_code_pairs`), in OUT (fp16 for tl.dot; fp32 is exact too)."""
    c0_c4, c1_c5, c2_c6, c3_c7 = _code_pairs(words)
    # joined [N, W, 2, 2, 2], each join's halves last: code c of a word lands at
    # 4 · (c >= 4) + 2 · (c mod 4 >= 2) + (c odd) = c, its column
    even = tl.join(_fp16_pair(c0_c4, OUT), _fp16_pair(c2_c6, OUT))
    odd = tl.join(_fp16_pair(c1_c5, OUT), _fp16_pair(c3_c7, OUT))
    return tl.reshape(tl.join(even, odd), (words.shape[0], 8 * words.shape[1]))


@triton.jit
def fp32_pair(pair, PTX: tl.constexpr):
    """The two fp16 of a uint32's halves as fp32 (the low half first). PTX: converted from the
    word's halves in place; without, the halves are taken apart first, which the compiler
    packs into new words (a byte permute for every two values) before it converts them."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=r,=r,r",
            [pair],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    return tl.split(_fp16_pair(pair, tl.float32))


@triton.jit
def _word_columns(xs):
    """xs [N, 8W] in column order as the eight columns of each word: [N, W] each, the c-th
    holding columns 8j + c."""
    v = tl.reshape(xs, (xs.shape[0], xs.shape[1] // 8, 2, 2, 2))  # c = 4a + 2b + d
    low, high = tl.split(tl.permute(v, (0, 1, 3, 4, 2)))  # by a: [N, W, b, d]
    c01, c23 = tl.split(tl.permute(low, (0, 1, 3, 2)))  # by b: [N, W, d]
    c45, c67 = tl.split(tl.permute(high, (0, 1, 3, 2)))
    c0, c1 = tl.split(c01)
    c2, c3 = tl.split(c23)
    c4, c5 = tl.split(c45)
    c6, c7 = tl.split(c67)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def word_dots(words, xs, PTX: tl.constexpr):
    """fp32 [N, W]: each word's eight codes (`_code_pairs`: times 2^-14) times the activations of
    their columns, `xs` fp32 [N or 1, 8W] in column order, as one chain of fused multiply-adds a
    word (a sum over a reshape adds the products in a tree of plain adds after plain
    multiplies). PTX: the fp16 converted in place (`fp32_pair`)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _word_columns(xs)
    c0_c4, c1_c5, c2_c6, c3_c7 = _code_pairs(words)
    c0, c4 = fp32_pair(c0_c4, PTX)
    c1, c5 = fp32_pair(c1_c5, PTX)
    c2, c6 = fp32_pair(c2_c6, PTX)
    c3, c7 = fp32_pair(c3_c7, PTX)
    dots = c0 * x0
    dots = tl.fma(c1, x1, dots)
    dots = tl.fma(c2, x2, dots)
    dots = tl.fma(c3, x3, dots)
    dots = tl.fma(c4, x4, dots)
    dots = tl.fma(c5, x5, dots)
    dots = tl.fma(c6, x6, dots)
    return tl.fma(c7, x7, dots)
