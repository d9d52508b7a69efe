// Weight element types, their exact conversion to fp32 (FP8 with its block factors), the SIMD
// backends and the dot-product core of the CPU expert kernel.
// Included by cpu_experts.cpp only (one translation unit): internal linkage, like the rest.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOELAB_X86 1
#endif

namespace {

// -------------------------------------------------------------------------------------------------
// Weight element types and their exact conversion to fp32.

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
// FP8 e4m3fn (kernels/fp8.py): 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities,
// 0x7F and 0xFF NaN; a weight is its value times the fp32 factor of its 128 x 128 block.
struct e4m3 {
  uint8_t bits;
};
constexpr int64_t kFp8Block = 128;
template <class WT>
constexpr bool kBlockScaled = std::is_same_v<WT, e4m3>;

inline float to_float(float v) { return v; }

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_float(bf16 v) { return bits_to_float(uint32_t(v.bits) << 16); }

inline float to_float(f16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1f;
  const uint32_t man = v.bits & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000 | (man << 13));  // inf, nan
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32
  const float mag = float(man) * 5.9604644775390625e-08f;
  return sign ? -mag : mag;
}

// e4m3 as the fp16 of 2^-8 its value: the sign to bit 15, the exponent and mantissa to bits
// 13..7. fp16's exponent bias (15) is e4m3's (7) plus 8 and its subnormals (exponent 0) are e4m3's
// 8 binades down, so the fp16 is exact for every byte but the NaNs, and one product by 2^8 (folded
// into the block's factor) restores the value. The NaN bytes land on a finite fp16 (1.875): the
// dot products look for them apart (any_nan), once per 64 bytes rather than in every conversion.
inline uint16_t e4m3_as_f16(uint8_t b) { return uint16_t(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }

inline bool is_nan(e4m3 v) { return (v.bits & 0x7f) == 0x7f; }

// The value of an e4m3 weight times its block's factor, rounded once to fp32: the dequantized
// weight, bit for bit as kernels/fp8.dequantize computes it (the NaN bytes: NaN).
inline float to_float(e4m3 v, float factor) {
  if (is_nan(v)) return std::numeric_limits<float>::quiet_NaN();
  return to_float(f16{e4m3_as_f16(v.bits)}) * (factor * 256.0f);
}

inline void prefetch(const void* p) {
#ifdef MOELAB_X86
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p);
#endif
}

// -------------------------------------------------------------------------------------------------
// SIMD backends: W fp32 lanes; load converts W weights of any element type to fp32.

struct Scalar {
  static constexpr int W = 1;
  using V = float;
  static V zero() { return 0.0f; }
  static V set1(float v) { return v; }
  template <class T>
  static V load(const T* p) {
    return to_float(*p);
  }
  // e4m3: 2^-8 of the weight's value (e4m3_as_f16: a NaN byte comes out finite)
  static V load(const e4m3* p) { return to_float(f16{e4m3_as_f16(p->bits)}); }
  // Whether e4m3 bytes were NaN, looked at 4W at a time (a step of dot_row; any_nan below).
  using Seen = bool;
  static Seen none_seen() { return false; }
  static Seen note_nan(Seen seen, const e4m3* p) {
    for (int i = 0; i < 4 * W; ++i) seen |= is_nan(p[i]);
    return seen;
  }
  static bool saw_nan(Seen seen) { return seen; }
  static V mul(V a, V b) { return a * b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static V keep(V v) { return v; }
  static float sum(V v) { return v; }
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Avx2 {
  static constexpr int W = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static V load(const f16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // 8 e4m3 weights as 2^-8 their values (e4m3_as_f16 eight lanes at a time: the bytes
  // sign-extended to 16 bits and shifted left by 7 hold the sign in bits 15 and 14, and bit 14 is
  // cleared)
  static V load(const e4m3* p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i t = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7);
    return _mm256_cvtph_ps(_mm_and_si128(t, _mm_set1_epi16(short(0xbf80))));
  }
  // NaN bytes, 32 at a time: b + b (b's seven low bits shifted up) is 0xfe for them alone, the
  // most it can be, and `seen` keeps the most of each lane.
  using Seen = __m256i;
  static Seen none_seen() { return _mm256_setzero_si256(); }
  static Seen note_nan(Seen seen, const e4m3* p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_max_epu8(seen, _mm256_add_epi8(b, b));
  }
  static bool saw_nan(Seen seen) {
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(seen, _mm256_set1_epi8(char(0xfe)))) != 0;
  }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  // Holds v in a register: without this the compiler folds the load into every FMA that uses it,
  // and the repeated loads, not the arithmetic, become the limit.
  static V keep(V v) {
    asm("" : "+x"(v));
    return v;
  }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#define MOELAB_HAVE_AVX2 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Avx512 {
  static constexpr int W = 16;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V load(const f16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 16 e4m3 weights as 2^-8 their values (as Avx2's)
  static V load(const e4m3* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(t, _mm256_set1_epi16(short(0xbf80))));
  }
  // NaN bytes, 64 at a time (as Avx2's)
  using Seen = __m512i;
  static Seen none_seen() { return _mm512_setzero_si512(); }
  static Seen note_nan(Seen seen, const e4m3* p) {
    const __m512i b = _mm512_loadu_si512(p);
    return _mm512_max_epu8(seen, _mm512_add_epi8(b, b));
  }
  static bool saw_nan(Seen seen) {
    return _mm512_cmpeq_epi8_mask(seen, _mm512_set1_epi8(char(0xfe))) != 0;
  }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V keep(V v) {
    asm("" : "+v"(v));
    return v;
  }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#define MOELAB_HAVE_AVX512 1
#endif

enum class Simd : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
enum class WeightType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kE4M3 = 3, kMxfp4 = 4, kNvfp4 = 5 };

std::vector<std::string> simd_levels() {
  std::vector<std::string> levels;
#ifdef MOELAB_HAVE_AVX512
  levels.push_back("avx512");
#endif
#ifdef MOELAB_HAVE_AVX2
  levels.push_back("avx2");
#endif
  levels.push_back("scalar");
  return levels;
}

// -------------------------------------------------------------------------------------------------
// Weights as fp32, whatever their type: `factors` names, for each of a call's rows, where the block
// factors of its columns start (e4m3 rows only: one float per 128 columns, of the row's 128-row
// block; nullptr for the other types, which ignore it).

// Whether any of n e4m3 bytes is a NaN.
template <class B>
bool any_nan(const e4m3* p, int64_t n) {
  typename B::Seen seen = B::none_seen();
  int64_t i = 0;
  for (; i + 4 * B::W <= n; i += 4 * B::W) seen = B::note_nan(seen, p + i);
  bool found = B::saw_nan(seen);
  for (; i < n; ++i) found |= is_nan(p[i]);
  return found;
}

// W weights from p as fp32; `factor256`: block_factor's (e4m3: the dequantized weights, each
// rounded once; a NaN byte comes out finite).
template <class B, class WT>
typename B::V load_weights(const WT* p, typename B::V factor256) {
  if constexpr (kBlockScaled<WT>) {
    return B::mul(B::load(p), factor256);
  } else {
    return B::load(p);
  }
}

// 2^8 times the factor of row r's block at column k, in every lane (e4m3 rows; unused otherwise).
template <class B, class WT>
typename B::V block_factor(const float* const* factors, int r, int64_t k) {
  if constexpr (kBlockScaled<WT>) {
    return B::set1(factors[r][k / kFp8Block] * 256.0f);
  } else {
    return B::zero();
  }
}

// Element k of row r as fp32.
template <class WT>
float weight_at(const WT* row, const float* const* factors, int r, int64_t k) {
  if constexpr (kBlockScaled<WT>) {
    return to_float(row[k], factors[r][k / kFp8Block]);
  } else {
    return to_float(row[k]);
  }
}

// -------------------------------------------------------------------------------------------------
// The core: NR weight rows times NT activation vectors of length K, fp32 accumulation.
// res[r * NT + t] = rows[r] . xs[t]. Each weight vector is loaded and converted once for all NT
// tokens, each activation vector once for all NR rows. `next`, when given, holds the rows the
// caller reads after these: they are prefetched, one 64-byte line per line read here. The rows
// begin at a block's first column (e4m3): each step of the loop lies in one block; a row with a
// NaN byte gives NaN, as the product with its dequantized weights would.

template <class B, class WT, int NR, int NT>
void dot_tile(const WT* const* rows, const float* const* factors, const WT* const* next,
              const float* const* xs, int64_t K, float* res) {
  // One token leaves only NR accumulator chains; unrolling doubles them to cover the FMA latency.
  constexpr int U = NT == 1 ? 2 : 1;
  constexpr int W = B::W;
  static_assert(kFp8Block % (U * W) == 0, "a step of the loop must lie in one block");
  constexpr int64_t kLine = 64 / int64_t(sizeof(WT));
  typename B::V acc[U][NR][NT];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) acc[u][r][t] = B::zero();
  int64_t k = 0;
  for (; k + U * W <= K; k += U * W) {
    typename B::V f[NR];
    for (int r = 0; r < NR; ++r) f[r] = block_factor<B, WT>(factors, r, k);
    for (int u = 0; u < U; ++u) {
      typename B::V w[NR];
      for (int r = 0; r < NR; ++r) w[r] = load_weights<B>(rows[r] + k + u * W, f[r]);
      if (next != nullptr && (W >= kLine || ((k + u * W) & (kLine - 1)) == 0)) {
        for (int r = 0; r < NR; ++r) prefetch(next[r] + k + u * W);
      }
      for (int t = 0; t < NT; ++t) {
        const typename B::V xv = B::keep(B::load(xs[t] + k + u * W));
        for (int r = 0; r < NR; ++r) acc[u][r][t] = B::fma(w[r], xv, acc[u][r][t]);
      }
    }
  }
  for (; k + W <= K; k += W) {
    for (int r = 0; r < NR; ++r) {
      const typename B::V w = load_weights<B>(rows[r] + k, block_factor<B, WT>(factors, r, k));
      for (int t = 0; t < NT; ++t) acc[0][r][t] = B::fma(w, B::load(xs[t] + k), acc[0][r][t]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      float s = 0.0f;
      for (int u = 0; u < U; ++u) s += B::sum(acc[u][r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += weight_at(rows[r], factors, r, kk) * xs[t][kk];
      res[r * NT + t] = s;
    }
    if constexpr (kBlockScaled<WT>) {
      if (any_nan<B>(rows[r], K)) {
        for (int t = 0; t < NT; ++t) res[r * NT + t] = std::numeric_limits<float>::quiet_NaN();
      }
    }
  }
}

// Runtime NT (1..4) to the template.
template <class B, class WT, int NR>
void dot_tile_n(const WT* const* rows, const float* const* factors, const WT* const* next,
                const float* const* xs, int nt, int64_t K, float* res) {
  switch (nt) {
    case 1: return dot_tile<B, WT, NR, 1>(rows, factors, next, xs, K, res);
    case 2: return dot_tile<B, WT, NR, 2>(rows, factors, next, xs, K, res);
    case 3: return dot_tile<B, WT, NR, 3>(rows, factors, next, xs, K, res);
    default: return dot_tile<B, WT, NR, 4>(rows, factors, next, xs, K, res);
  }
}

constexpr int kMaxTokensPerTile = 4;

}  // namespace
