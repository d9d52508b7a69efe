// MXFP4 weights in the CPU expert kernel (kernels/mxfp4.py): e2m1 values two a byte, the
// even-indexed one in the low nibble, and one E8M0 scale byte (2^(s-127), 0xFF NaN) per 32
// values of a row, in a tensor of their own (gpt-oss's `_blocks` and `_scales`). A row of K
// values is K/2 bytes; the expert job counts its rows' elements (e2m1x2, two values each) with
// kValuesPerElement and finds their scales with ScaleOf. The loads widen a block's 32 values in
// registers to twice each value (AVX-512: one vpermps of a 16-float table for 16 nibbles; AVX2:
// a lookup of each nibble's fp16, then fp16 to fp32, or for one token's rows the two bytes of its
// bf16, made fp32 by a shift or a mask: dot_row_slots), multiply them or their products by half
// the block's scale and accumulate in fp32.
// Included by expert_job.h only (one translation unit): internal linkage, like the rest.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "simd.h"

namespace {

struct e2m1x2 {
  uint8_t bits;
};
constexpr int64_t kMxBlock = 32;

// How many weight values one element of a row's storage holds, and the type of its scales.
template <class WT>
constexpr int64_t kValuesPerElement = 1;
template <>
constexpr int64_t kValuesPerElement<e2m1x2> = 2;
template <class WT>
struct ScaleOf {
  using type = float;
};
template <>
struct ScaleOf<e2m1x2> {
  using type = uint8_t;
};

// Twice each e2m1 code's value: integers, which every widening below holds exactly (the scalar's
// floats, AVX2's fp16, AVX-512's fp32 table, the bf16 dots' bf16); the scales below are halved
// to match (both exact).
constexpr int8_t kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Half of every E8M0 byte's value: 2^(s - 128) (exact for every byte, subnormals included),
// 0xFF NaN.
struct E8m0Table {
  float half[256];
  E8m0Table() {
    half[0] = bits_to_float(0x00200000u);
    half[1] = bits_to_float(0x00400000u);
    for (uint32_t s = 2; s < 255; ++s) half[s] = bits_to_float((s - 1) << 23);
    half[255] = std::numeric_limits<float>::quiet_NaN();
  }
};
inline const float* e8m0_halves() {
  static const E8m0Table table;
  return table.half;
}

// Whether one token's 4-bit rows of K values take AVX2's dot_row_slots: whole 64-value steps.
inline bool fp4_slots_fit(int64_t K) { return K % 64 == 0; }

// Where value v of a row lies in the activations dot_row_slots reads (its "slots"): of each 64
// values (32 bytes: two blocks, one a 128-bit lane), vector q = 0..7 of 8 lanes holds, in lane
// 4L + i, value 32L + 4i + (0, 2, 16, 18, 1, 3, 17, 19)[q] (the even values' bytes 0-7 of each lane
// as bf16 pairs, then bytes 8-15, then the odd values' likewise).
inline int64_t fp4_slot_of(int64_t v) {
  const int64_t base = v / 64 * 64, t = v - base;
  const int64_t lane = t / 32, byte = t % 32 / 2;
  const int64_t q = (t & 1 ? 4 : 0) + (byte >= 8 ? 2 : 0) + byte % 2;
  return base + 8 * q + 4 * lane + byte % 8 / 2;
}

// x's K values (fp4_slots_fit) in fp4_slot_of's order, a 64-value step at a time.
inline void fp4_to_slots(const float* x, int64_t K, float* out) {
  constexpr int kOffset[8] = {0, 2, 16, 18, 1, 3, 17, 19};
  for (int64_t base = 0; base < K; base += 64) {
    for (int q = 0; q < 8; ++q) {
      for (int lane = 0; lane < 2; ++lane) {
        for (int i = 0; i < 4; ++i) {
          out[base + 8 * q + 4 * lane + i] = x[base + 32 * lane + 4 * i + kOffset[q]];
        }
      }
    }
  }
}

// A block's 32 values widened to twice their fp32 value (unscaled), in order: out[0] holds
// values 0..W-1; widen64 the same for two blocks (64 values, 32 bytes).
template <class B>
struct Mx;

template <>
struct Mx<Scalar> {
  static void widen(const e2m1x2* p, float* out) {
    for (int i = 0; i < 16; ++i) {
      out[2 * i] = float(kE2m1Twice[p[i].bits & 0xF]);
      out[2 * i + 1] = float(kE2m1Twice[p[i].bits >> 4]);
    }
  }
  static void widen64(const e2m1x2* p, float* out) {
    widen(p, out);
    widen(p + 16, out + 32);
  }
};

#ifdef MOELAB_HAVE_AVX2
// Twice each e2m1 code's value as fp16, whose low byte is 0 for every one: the high bytes alone
// (code 8, -0, as +0 like kE2m1Twice).
alignas(16) constexpr uint8_t kE2m1TwiceF16High[16] = {0x00, 0x3C, 0x40, 0x42, 0x44, 0x46,
                                                       0x48, 0x4A, 0x00, 0xBC, 0xC0, 0xC2,
                                                       0xC4, 0xC6, 0xC8, 0xCA};

// The AVX2 loads: each nibble's fp16 high byte looked up (pshufb), the low and the high nibbles'
// interleaved into the values' order, each byte put above a zero byte (an fp16 in a 16-bit lane),
// and 8 fp16 at a time made fp32 by vcvtph2ps (F16C): 9.1-9.4 G values/s from the first-level
// cache against 7.7-8.2 for an int8 lookup made int32 and then fp32 (one core of an AVX2-only
// EPYC, docs/cpu-experts.md); the same fp32 values, so the same sums.
template <>
struct Mx<Avx2> {
  static void widen(const e2m1x2* p, __m256* out) {
    const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1TwiceF16High));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(packed, nibble));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
    const __m128i zero = _mm_setzero_si128();
    out[0] = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, first));
    out[1] = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, first));
    out[2] = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, second));
    out[3] = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, second));
  }
  // Two blocks' 32 bytes by 256-bit lookups and interleaves, which stay within 128-bit lanes:
  // the low lane of each result holds the first block's values, the high lane the second's.
  static void widen64(const e2m1x2* p, __m256* out) {
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1TwiceF16High)));
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(packed, nibble));
    const __m256i hi =
        _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble));
    const __m256i first = _mm256_unpacklo_epi8(lo, hi), second = _mm256_unpackhi_epi8(lo, hi);
    const __m256i zero = _mm256_setzero_si256();
    // halves[q]: values 8q..8q+7 of each block, the first block's in the low lane
    const __m256i halves[4] = {
        _mm256_unpacklo_epi8(zero, first), _mm256_unpackhi_epi8(zero, first),
        _mm256_unpacklo_epi8(zero, second), _mm256_unpackhi_epi8(zero, second)};
    for (int q = 0; q < 4; ++q) {
      out[q] = _mm256_cvtph_ps(_mm256_castsi256_si128(halves[q]));
      out[4 + q] = _mm256_cvtph_ps(_mm256_extracti128_si256(halves[q], 1));
    }
  }
};
#endif

#ifdef MOELAB_HAVE_AVX2
// One token's rows on AVX2 (dot_row_slots): each code's twice-value looked up as the two bytes of
// its bf16 (exact: integers up to 12), the bytes joined into 16-bit lanes, and each 32-bit lane's
// two bf16 made fp32 by a shift and a mask, with no conversion instruction; the activations come
// in the order that leaves the weights (fp4_slot_of), so no weight is moved to its column.
// Low and high bytes of twice each code's value as bf16 (code 8, -0, as +0 like kE2m1Twice).
alignas(16) constexpr uint8_t kE2m1TwiceBf16Lo[16] = {0x00, 0x80, 0x00, 0x40, 0x80, 0xC0,
                                                      0x00, 0x40, 0x00, 0x80, 0x00, 0x40,
                                                      0x80, 0xC0, 0x00, 0x40};
alignas(16) constexpr uint8_t kE2m1TwiceBf16Hi[16] = {0x00, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                                      0x41, 0x41, 0x00, 0xBF, 0xC0, 0xC0,
                                                      0xC0, 0xC0, 0xC1, 0xC1};

// row . x over K values (fp4_slots_fit), x in fp4_slot_of's order, for a row of 4-bit bytes: 64
// values a step, each vector's low 128-bit lane from the step's first 32 values and its high lane
// from the last 32; four chains, vectors q and q + 4 in chain q % 4. `scales(k)` gives the half-scales of
// the step from value k as two vectors: the chains of q = 0, 1 (values 0-15 of each lane) take
// the first, those of q = 2, 3 (values 16-31) the second. `ahead` as dot_row's.
template <class Scales>
float dot_row_slots_with(const uint8_t* row, Scales scales, const float* xs, int64_t K,
                         const uint8_t* ahead) {
  const __m256i lo_table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1TwiceBf16Lo)));
  const __m256i hi_table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1TwiceBf16Hi)));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
  // a 32-bit lane's two bf16 as fp32: the low one shifted up, the high one masked
  auto low = [](__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); };
  auto top = [&](__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, high)); };
  __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
  for (int64_t k = 0; k < K; k += 64) {
    if (ahead != nullptr && k % 128 == 0) prefetch(ahead + k / 2);  // a line: 128 values
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 2));
    const __m256i even = _mm256_and_si256(packed, nibble);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    const __m256i even_lo = _mm256_shuffle_epi8(lo_table, even);
    const __m256i even_hi = _mm256_shuffle_epi8(hi_table, even);
    const __m256i odd_lo = _mm256_shuffle_epi8(lo_table, odd);
    const __m256i odd_hi = _mm256_shuffle_epi8(hi_table, odd);
    const __m256i e0 = _mm256_unpacklo_epi8(even_lo, even_hi);
    const __m256i e1 = _mm256_unpackhi_epi8(even_lo, even_hi);
    const __m256i o0 = _mm256_unpacklo_epi8(odd_lo, odd_hi);
    const __m256i o1 = _mm256_unpackhi_epi8(odd_lo, odd_hi);
    const float* x = xs + k;
    __m256 a = _mm256_mul_ps(low(e0), _mm256_loadu_ps(x));
    __m256 b = _mm256_mul_ps(top(e0), _mm256_loadu_ps(x + 8));
    __m256 c = _mm256_mul_ps(low(e1), _mm256_loadu_ps(x + 16));
    __m256 d = _mm256_mul_ps(top(e1), _mm256_loadu_ps(x + 24));
    a = _mm256_fmadd_ps(low(o0), _mm256_loadu_ps(x + 32), a);
    b = _mm256_fmadd_ps(top(o0), _mm256_loadu_ps(x + 40), b);
    c = _mm256_fmadd_ps(low(o1), _mm256_loadu_ps(x + 48), c);
    d = _mm256_fmadd_ps(top(o1), _mm256_loadu_ps(x + 56), d);
    const auto [first, second] = scales(k);
    t0 = _mm256_fmadd_ps(a, first, t0);
    t1 = _mm256_fmadd_ps(b, first, t1);
    t2 = _mm256_fmadd_ps(c, second, t2);
    t3 = _mm256_fmadd_ps(d, second, t3);
  }
  return Avx2::sum(_mm256_add_ps(_mm256_add_ps(t0, t1), _mm256_add_ps(t2, t3)));
}

// An MXFP4 row: a step's two blocks, one a lane, so both vectors are the two blocks'
// half-scales.
inline float dot_row_slots(const e2m1x2* row, const uint8_t* scales, const float* xs, int64_t K,
                           const e2m1x2* ahead) {
  const float* halves = e8m0_halves();
  auto step_scales = [&](int64_t k) {
    const __m256 both = _mm256_set_m128(_mm_set1_ps(halves[scales[k / kMxBlock + 1]]),
                                        _mm_set1_ps(halves[scales[k / kMxBlock]]));
    return std::pair<__m256, __m256>(both, both);
  };
  return dot_row_slots_with(reinterpret_cast<const uint8_t*>(row), step_scales, xs, K,
                            reinterpret_cast<const uint8_t*>(ahead));
}
#endif

#ifdef MOELAB_HAVE_AVX512
// Twice each e2m1 code's value as fp32, for the AVX-512 loads' one-instruction lookup
// (kE2m1Twice's values; code 8, -0, as +0 like them).
alignas(64) constexpr float kE2m1TwiceF[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <>
struct Mx<Avx512> {
  // A block's 16 bytes as its 32 twice-values, in order, each looked up by one vpermps of the
  // 16-float table (which reads an index's low 4 bits alone) from its nibble in the low bits of a
  // 32-bit lane.
  static void widen(const e2m1x2* p, __m512* out) {
    const __m512 table = _mm512_load_ps(kE2m1TwiceF);
#ifdef __AVX512VBMI__
    // 16 values at a time: their 8 bytes broadcast to every 64-bit lane and value i's nibble
    // shifted to 32-bit lane i by one vpmultishiftqb (lane i, of 64-bit lane i / 2, takes the 8
    // bits from bit 4i)
    const __m512i at = _mm512_set_epi64(0x3c00000038ll, 0x3400000030ll, 0x2c00000028ll,
                                        0x2400000020ll, 0x1c00000018ll, 0x1400000010ll,
                                        0x0c00000008ll, 0x0400000000ll);
    for (int half = 0; half < 2; ++half) {
      int64_t bytes;
      std::memcpy(&bytes, p + 8 * half, sizeof bytes);
      const __m512i nibbles = _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64(bytes));
      out[half] = _mm512_permutexvar_ps(nibbles, table);
    }
#else
    // each byte in a 32-bit lane: the low nibbles' values, the high nibbles' after a shift, and
    // the two interleaved (lanes 0..15 of the pair are lo's, 16..31 hi's)
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512 lo = _mm512_permutexvar_ps(bytes, table);
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    out[0] = _mm512_permutex2var_ps(lo, first, hi);
    out[1] = _mm512_permutex2var_ps(lo, second, hi);
#endif
  }
  static void widen64(const e2m1x2* p, __m512* out) {
    widen(p, out);
    widen(p + 16, out + 2);
  }
};
#endif

// row . x over K values (a multiple of 32: the job checks), fp32 accumulation: each block's
// products summed, then multiplied by its scale onto the row's sum (one product a block rather
// than one a weight: the widening leaves little room). `ahead`, when given, is the row this
// thread reads later: its lines are prefetched, one per line read here (dot_row of simd.h).
template <class B>
float dot_row(const e2m1x2* row, const uint8_t* scales, const float* x, int64_t K,
              const e2m1x2* ahead) {
  using V = typename B::V;
  constexpr int N = int(kMxBlock / B::W);  // vectors a block
  const float* halves = e8m0_halves();
  V total[2] = {B::zero(), B::zero()};
  // the products of block `at` (its vectors w) onto total[u], times its half-scale
  auto add_block = [&](const V* w, int64_t at, int u) {
    V block = B::mul(w[0], B::load(x + at));
    for (int v = 1; v < N; ++v) block = B::fma(w[v], B::load(x + at + v * B::W), block);
    total[u] = B::fma(block, B::set1(halves[scales[at / kMxBlock]]), total[u]);
  };
  int64_t k = 0;
  for (; k + 2 * kMxBlock <= K; k += 2 * kMxBlock) {
    if (ahead != nullptr && k % 128 == 0) prefetch(ahead + k / 2);  // a line: 128 values
    V w[2 * N];
    Mx<B>::widen64(row + k / 2, w);
    add_block(w, k, 0);
    add_block(w + N, k + kMxBlock, 1);
  }
  if (k < K) {  // an odd last block
    if (ahead != nullptr && k % 128 == 0) prefetch(ahead + k / 2);
    V w[N];
    Mx<B>::widen(row + k / 2, w);
    add_block(w, k, 0);
  }
  return B::sum(B::add(total[0], total[1]));
}

// NR rows times NT activation vectors over K values (dot_tile of simd.h for MXFP4 rows):
// res[r * NT + t] = rows[r] . xs[t]; each block of a row is widened and scaled once for all NT
// tokens (twice-values times half-scales: the dequantized weights, exactly). `next`, when given,
// holds the rows read after these: prefetched a line for each read.
// The products are summed in dot_tile's order (one token: two chains, vectors alternating), so
// that the result is the dequantized fp32 weights', bit for bit.
template <class B, int NR, int NT>
void mx_dot_tile(const e2m1x2* const* rows, const uint8_t* const* scales,
                 const e2m1x2* const* next, const float* const* xs, int64_t K, float* res) {
  using V = typename B::V;
  constexpr int N = int(kMxBlock / B::W);
  constexpr int U = NT == 1 ? 2 : 1;
  static_assert(N % U == 0, "a block must hold whole steps of the chains");
  const float* halves = e8m0_halves();
  V acc[U][NR][NT];
  for (auto& a : acc)
    for (auto& b : a)
      for (auto& v : b) v = B::zero();
  for (int64_t k = 0; k < K; k += kMxBlock) {
    V w[NR][N];
    for (int r = 0; r < NR; ++r) {
      Mx<B>::widen(rows[r] + k / 2, w[r]);
      const V scale = B::set1(halves[scales[r][k / kMxBlock]]);
      for (int v = 0; v < N; ++v) w[r][v] = B::mul(w[r][v], scale);
      if (next != nullptr && k % 128 == 0) prefetch(next[r] + k / 2);
    }
    for (int t = 0; t < NT; ++t) {
      for (int v = 0; v < N; ++v) {
        const V xv = B::keep(B::load(xs[t] + k + v * B::W));
        for (int r = 0; r < NR; ++r) acc[v % U][r][t] = B::fma(w[r][v], xv, acc[v % U][r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      float s = 0.0f;
      for (int u = 0; u < U; ++u) s += B::sum(acc[u][r][t]);
      res[r * NT + t] = s;
    }
  }
}

// Runtime NT (1..4) to the template, as dot_tile_n of simd.h takes it.
template <class B, class WT, int NR>
void dot_tile_n(const e2m1x2* const* rows, const uint8_t* const* scales,
                const e2m1x2* const* next, const float* const* xs, int nt, int64_t K,
                float* res) {
  switch (nt) {
    case 1: return mx_dot_tile<B, NR, 1>(rows, scales, next, xs, K, res);
    case 2: return mx_dot_tile<B, NR, 2>(rows, scales, next, xs, K, res);
    case 3: return mx_dot_tile<B, NR, 3>(rows, scales, next, xs, K, res);
    default: return mx_dot_tile<B, NR, 4>(rows, scales, next, xs, K, res);
  }
}

}  // namespace
