// Weight element types, their exact conversion to fp32, the SIMD backends and the dot-product
// core of the CPU expert kernel.
// Included by cpu_experts.cpp only (one translation unit): internal linkage, like the rest.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
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
  template <class T>
  static V load(const T* p) {
    return to_float(*p);
  }
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

#if defined(__AVX512F__)
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
enum class WeightType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

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
// The core: NR weight rows times NT activation vectors of length K, fp32 accumulation.
// res[r * NT + t] = rows[r] . xs[t]. Each weight vector is loaded and converted once for all NT
// tokens, each activation vector once for all NR rows. `next`, when given, holds the rows the
// caller reads after these: they are prefetched, one 64-byte line per line read here.

template <class B, class WT, int NR, int NT>
void dot_tile(const WT* const* rows, const WT* const* next, const float* const* xs, int64_t K,
              float* res) {
  // One token leaves only NR accumulator chains; unrolling doubles them to cover the FMA latency.
  constexpr int U = NT == 1 ? 2 : 1;
  constexpr int W = B::W;
  constexpr int64_t kLine = 64 / int64_t(sizeof(WT));
  typename B::V acc[U][NR][NT];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) acc[u][r][t] = B::zero();
  int64_t k = 0;
  for (; k + U * W <= K; k += U * W) {
    for (int u = 0; u < U; ++u) {
      typename B::V w[NR];
      for (int r = 0; r < NR; ++r) w[r] = B::load(rows[r] + k + u * W);
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
      const typename B::V w = B::load(rows[r] + k);
      for (int t = 0; t < NT; ++t) acc[0][r][t] = B::fma(w, B::load(xs[t] + k), acc[0][r][t]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      float s = 0.0f;
      for (int u = 0; u < U; ++u) s += B::sum(acc[u][r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += to_float(rows[r][kk]) * xs[t][kk];
      res[r * NT + t] = s;
    }
  }
}

// Runtime NT (1..4) to the template.
template <class B, class WT, int NR>
void dot_tile_n(const WT* const* rows, const WT* const* next, const float* const* xs, int nt,
                int64_t K, float* res) {
  switch (nt) {
    case 1: return dot_tile<B, WT, NR, 1>(rows, next, xs, K, res);
    case 2: return dot_tile<B, WT, NR, 2>(rows, next, xs, K, res);
    case 3: return dot_tile<B, WT, NR, 3>(rows, next, xs, K, res);
    default: return dot_tile<B, WT, NR, 4>(rows, next, xs, K, res);
  }
}

constexpr int kMaxTokensPerTile = 4;

}  // namespace
