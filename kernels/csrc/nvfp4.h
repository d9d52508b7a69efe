// NVFP4 weights in the CPU expert kernel (kernels/nvfp4.py, ModelOpt's layout): e2m1 values two a
// byte, the even-indexed one in the low nibble (the bytes of a row as MXFP4's), one e4m3 scale
// byte per 16 values of a row, in a tensor of their own, and one fp32 scale per projection
// (an expert's gate, up and down), which the expert job multiplies its rows' sums by. The loads
// widen two blocks' 32 values at a time as MXFP4's loads widen a block (twice each value: Mx of
// mxfp4.h) and multiply them or their products by half their
// block's scale, exactly (an e2m1 value times an e4m3 one has at most 6 significant bits).
// Included by expert_job.h only (one translation unit): internal linkage, like the rest.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "mxfp4.h"
#include "simd.h"

namespace {

struct nv_e2m1x2 {
  uint8_t bits;
};
constexpr int64_t kNvBlock = 16;

template <>
constexpr int64_t kValuesPerElement<nv_e2m1x2> = 2;
template <>
struct ScaleOf<nv_e2m1x2> {
  using type = uint8_t;
};
// The values one scale byte covers, for the 4-bit types.
template <class WT>
constexpr int64_t kScaleBlock = std::is_same_v<WT, nv_e2m1x2> ? kNvBlock : kMxBlock;

// Half of every e4m3 byte's value, decoded from its bits (exponent e, mantissa m: (8 + m) ·
// 2^(e - 11) for e > 0, m · 2^-10 for e = 0; 0x7F and 0xFF NaN; bit 7 the sign), exact.
struct E4m3Table {
  float half[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      const float v = e > 0 ? std::ldexp(float(8 + m), e - 11) : std::ldexp(float(m), -10);
      half[b] = (b & 0x7F) == 0x7F ? std::numeric_limits<float>::quiet_NaN() : (b & 0x80 ? -v : v);
    }
  }
};
inline const float* e4m3_halves() {
  static const E4m3Table table;
  return table.half;
}

// Two blocks' 16 bytes widened to twice their 32 values (MXFP4's widening: the same bytes), or
// with `whole` false one block's 8 bytes (the row's last block, values 16..31 zero).
template <class B>
void nv_widen(const nv_e2m1x2* p, bool whole, typename B::V* out) {
  if (whole) return Mx<B>::widen(reinterpret_cast<const e2m1x2*>(p), out);
  e2m1x2 last[16] = {};
  std::memcpy(last, p, 8);
  Mx<B>::widen(last, out);
}

// row . x over K values (a multiple of 16: the job checks), fp32 accumulation: each block's
// products summed, then multiplied by its half-scale onto the row's sum (unscaled by the
// tensor's scale, which the job multiplies the row's sum by). `ahead`, when given, is the row this
// thread reads later: its lines are prefetched, one per line read here.
template <class B>
float dot_row(const nv_e2m1x2* row, const uint8_t* scales, const float* x, int64_t K,
              const nv_e2m1x2* ahead) {
  using V = typename B::V;
  constexpr int N = int(kNvBlock / B::W);  // vectors a block
  const float* halves = e4m3_halves();
  V total[2] = {B::zero(), B::zero()};
  auto add_block = [&](const V* w, int64_t at, int u) {
    V block = B::mul(w[0], B::load(x + at));
    for (int v = 1; v < N; ++v) block = B::fma(w[v], B::load(x + at + v * B::W), block);
    total[u] = B::fma(block, B::set1(halves[scales[at / kNvBlock]]), total[u]);
  };
  int64_t k = 0;
  // four blocks a step (MXFP4's widening of two of its blocks), the sums onto the totals in the
  // order of two steps of two blocks
  for (; k + 4 * kNvBlock <= K; k += 4 * kNvBlock) {
    if (ahead != nullptr && k % 128 == 0) prefetch(ahead + k / 2);  // a line: 128 values
    V w[4 * N];
    Mx<B>::widen64(reinterpret_cast<const e2m1x2*>(row + k / 2), w);
    for (int b = 0; b < 4; ++b) add_block(w + b * N, k + b * kNvBlock, b % 2);
  }
  for (; k < K; k += 2 * kNvBlock) {  // the last one to three blocks
    if (ahead != nullptr && k % 128 == 0) prefetch(ahead + k / 2);
    const bool whole = k + 2 * kNvBlock <= K;
    V w[2 * N];
    nv_widen<B>(row + k / 2, whole, w);
    add_block(w, k, 0);
    if (whole) add_block(w + N, k + kNvBlock, 1);
  }
  return B::sum(B::add(total[0], total[1]));
}

#ifdef MOELAB_HAVE_AVX2
// One token's NVFP4 row on AVX2 against x in its slots (mxfp4.h dot_row_slots_with: the same
// bytes): a step's four blocks, two a lane, so the first vector holds blocks 0 and 2's
// half-scales (each lane's first 16 values) and the second blocks 1 and 3's.
inline float dot_row_slots(const nv_e2m1x2* row, const uint8_t* scales, const float* xs,
                           int64_t K, const nv_e2m1x2* ahead) {
  const float* halves = e4m3_halves();
  auto step_scales = [&](int64_t k) {
    const uint8_t* s = scales + k / kNvBlock;
    return std::pair<__m256, __m256>(
        _mm256_set_m128(_mm_set1_ps(halves[s[2]]), _mm_set1_ps(halves[s[0]])),
        _mm256_set_m128(_mm_set1_ps(halves[s[3]]), _mm_set1_ps(halves[s[1]])));
  };
  return dot_row_slots_with(reinterpret_cast<const uint8_t*>(row), step_scales, xs, K,
                            reinterpret_cast<const uint8_t*>(ahead));
}
#endif

// NR rows times NT activation vectors over K values (dot_tile of simd.h for NVFP4 rows):
// res[r * NT + t] = rows[r] . xs[t] (unscaled by the tensor's scale); each block of a row is
// widened and scaled once for all NT tokens (twice-values times half-scales). `next`, when given,
// holds the rows read after these: prefetched a line for each read.
template <class B, int NR, int NT>
void nv_dot_tile(const nv_e2m1x2* const* rows, const uint8_t* const* scales,
                 const nv_e2m1x2* const* next, const float* const* xs, int64_t K, float* res) {
  using V = typename B::V;
  constexpr int N = int(2 * kNvBlock / B::W);  // vectors a step of two blocks
  constexpr int U = NT == 1 ? 2 : 1;
  static_assert(N % 2 == 0, "a block must hold whole vectors");
  const float* halves = e4m3_halves();
  V acc[U][NR][NT];
  for (auto& a : acc)
    for (auto& b : a)
      for (auto& v : b) v = B::zero();
  for (int64_t k = 0; k < K; k += 2 * kNvBlock) {
    const bool whole = k + 2 * kNvBlock <= K;
    const int n = whole ? N : N / 2;  // the vectors of this step
    V w[NR][N];
    for (int r = 0; r < NR; ++r) {
      nv_widen<B>(rows[r] + k / 2, whole, w[r]);
      for (int half = 0; half * (N / 2) < n; ++half) {
        const V scale = B::set1(halves[scales[r][k / kNvBlock + half]]);
        for (int v = half * (N / 2); v < (half + 1) * (N / 2); ++v) w[r][v] = B::mul(w[r][v], scale);
      }
      if (next != nullptr && k % 128 == 0) prefetch(next[r] + k / 2);
    }
    for (int t = 0; t < NT; ++t) {
      for (int v = 0; v < n; ++v) {
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
void dot_tile_n(const nv_e2m1x2* const* rows, const uint8_t* const* scales,
                const nv_e2m1x2* const* next, const float* const* xs, int nt, int64_t K,
                float* res) {
  switch (nt) {
    case 1: return nv_dot_tile<B, NR, 1>(rows, scales, next, xs, K, res);
    case 2: return nv_dot_tile<B, NR, 2>(rows, scales, next, xs, K, res);
    case 3: return nv_dot_tile<B, NR, 3>(rows, scales, next, xs, K, res);
    default: return nv_dot_tile<B, NR, 4>(rows, scales, next, xs, K, res);
  }
}

}  // namespace
