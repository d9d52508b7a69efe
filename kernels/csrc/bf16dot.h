// The bf16 dot products of the CPU expert kernel: FP8 (e4m3), MXFP4 and NVFP4 rows of a job whose
// activations are all bf16 values (a bf16 model's, made fp32 for the handoff) are widened to bf16,
// not fp32, and multiplied by a bf16 copy of the activations with vdpbf16ps (AVX-512 BF16: 32
// products summed into 16 fp32 lanes by one instruction). The product of two bf16 is exact in
// fp32, so only the order of the sums differs from the fp32 path (and vdpbf16ps reads denormal
// bf16 inputs, below 2^-126, as zero). The block's factor or scale multiplies each block's sum,
// once a block. The down projection's input h is rounded to bf16 for these jobs, as a bf16 model
// rounds it on the GPU. Built where the compiler targets AVX-512 BF16 and VBMI (the widenings'
// byte permutes); elsewhere, and for activations that are not all bf16, the fp32 path.
// Included by expert_job.h only (one translation unit): internal linkage, like the rest.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "mxfp4.h"
#include "nvfp4.h"
#include "simd.h"

#if defined(MOELAB_HAVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define MOELAB_HAVE_BF16DOT 1
#endif

namespace {

// The weight types with a bf16 dot product.
template <class WT>
constexpr bool kBf16Dot =
    std::is_same_v<WT, e4m3> || std::is_same_v<WT, e2m1x2> || std::is_same_v<WT, nv_e2m1x2>;

// Whether rows of K values of type WT take it: FP8 rows of whole 64-column steps (a last block
// of 64 columns: gpt-oss's 2880), 4-bit rows of whole 32-value steps.
template <class WT>
bool bf16_dot_fits(int64_t K) {
  return K % (std::is_same_v<WT, e4m3> ? 64 : 32) == 0;
}

// Whether each of n floats is a bf16 value (its low 16 bits zero).
inline bool all_bf16(const float* x, int64_t n) {
  uint32_t low = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    low |= u;
  }
  return (low & 0xFFFFu) == 0;
}

// The bf16 nearest to v (ties to even; a NaN stays NaN).
inline uint16_t round_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

// Where value v of a K-value vector lies in its bf16 copy for rows of type WT: the order in which
// the widening below gives a row's weights. FP8: of each 64 values, the first 8 of each 16, then
// the last 8 of each 16 (the in-lane byte interleaves). 4-bit: of each whole 128 values, every
// fourth from the first, then from the second, third and fourth (the four nibbles of each
// 16-bit word); of the last K % 128 values, each 64's even ones, then their odd ones (a last 32:
// its 16 even, then its 16 odd), as the low and the high nibbles of the bytes come.
template <class WT>
int64_t bf16_slot(int64_t v, int64_t K) {
  if constexpr (std::is_same_v<WT, e4m3>) {
    const int64_t base = v / 64 * 64, i = v - base, lane = i / 16, w = i % 16;
    return base + (w < 8 ? 0 : 32) + 8 * lane + w % 8;
  } else {
    if (v < K / 128 * 128) {
      const int64_t base = v / 128 * 128, i = v - base;
      return base + 32 * (i % 4) + i / 4;
    }
    const int64_t base = v / 64 * 64, i = v - base;
    const int64_t half = base + 64 <= K ? 32 : 16;
    return base + (i & 1 ? half : 0) + i / 2;
  }
}

// x's K values, each a bf16 value (all_bf16), as bf16 in bf16_slot's order for rows of type WT
// (K a multiple of 64 for FP8, of 32 for the 4-bit types): round_bf16 of such a value is its top
// 16 bits (a NaN quieted, as round_bf16 does). The runs that the order keeps whole are copied by
// loops of their own, where a value at a time through bf16_slot took 3.4-5.5 µs of a job's assign
// at 2048-2880 values, in the serial part of an offloaded decode layer step (docs/cpu-experts.md).
template <class WT>
void bf16_slots(const float* x, int64_t K, uint16_t* out) {
  auto top = [](const float* p) {
    uint32_t u;
    std::memcpy(&u, p, sizeof u);
    return uint16_t((u >> 16) | (uint32_t((u & 0x7FFFFFFFu) > 0x7F800000u) << 6));
  };
  if constexpr (std::is_same_v<WT, e4m3>) {
    // of each 64 values, the first 8 of each 16, then their last 8
    for (int64_t base = 0; base + 64 <= K; base += 64) {
      for (int lane = 0; lane < 4; ++lane) {
        for (int half = 0; half < 2; ++half) {
          const float* from = x + base + 16 * lane + 8 * half;
          uint16_t* to = out + base + 32 * half + 8 * lane;
          for (int w = 0; w < 8; ++w) to[w] = top(from + w);
        }
      }
    }
  } else {
    // of each whole 128 values, every fourth from the first, then from the second, third, fourth
    // (read in order, each four to their four runs: twice as fast as a run at a time)
    const int64_t whole = K / 128 * 128;
    for (int64_t base = 0; base < whole; base += 128) {
      for (int j = 0; j < 32; ++j) {
        for (int q = 0; q < 4; ++q) out[base + 32 * q + j] = top(x + base + 4 * j + q);
      }
    }
    // of the rest, each 64's even values, then its odd ones (a last 32's 16 and 16)
    for (int64_t base = whole; base < K; base += 64) {
      const int64_t half = base + 64 <= K ? 32 : 16;
      for (int64_t i = 0; i < half; ++i) {
        out[base + i] = top(x + base + 2 * i);
        out[base + half + i] = top(x + base + 2 * i + 1);
      }
    }
  }
}

#ifdef MOELAB_HAVE_BF16DOT
inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
inline __m512 dot_bf16(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, as_bh(w), as_bh(_mm512_loadu_si512(x)));
}

// The bf16 of every e4m3 magnitude (the low 7 bits of a byte), as its low and its high bytes:
// exact, subnormals included (m * 2^-9 is a bf16 normal); 0x7F NaN.
struct E4m3Bf16Table {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  E4m3Bf16Table() {
    for (int b = 0; b < 128; ++b) {
      const float v = to_float(e4m3{uint8_t(b)}, 1.0f);
      const uint16_t bits = b == 0x7F ? uint16_t(0x7FC0) : round_bf16(v);
      lo[b] = uint8_t(bits & 0xFF);
      hi[b] = uint8_t(bits >> 8);
    }
  }
};
inline const E4m3Bf16Table& e4m3_bf16() {
  static const E4m3Bf16Table table;
  return table;
}

// 64 e4m3 bytes to their 64 bf16 in bf16_slot's order (out[0]: values 0..7 of each 16,
// out[1]: values 8..15 of each): each byte's low and high result bytes looked up by its 7 low
// bits in two 128-byte tables (vpermi2b), the sign put into the high byte, and the two
// interleaved into 16-bit lanes within each 128-bit lane (vpunpcklbw, vpunpckhbw: cheaper than
// interleaving across lanes, 5% more FP8 GB/s on one core of the CI machine).
struct E4m3Widen {
  __m512i lo0, lo1, hi0, hi1;
  E4m3Widen() {
    const E4m3Bf16Table& t = e4m3_bf16();
    lo0 = _mm512_load_si512(t.lo);
    lo1 = _mm512_load_si512(t.lo + 64);
    hi0 = _mm512_load_si512(t.hi);
    hi1 = _mm512_load_si512(t.hi + 64);
  }
  void operator()(const e4m3* p, __m512i* out) const {
    const __m512i bytes = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, bytes, lo1);
    // hi | (bytes & 0x80)
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, bytes, hi1), bytes,
                                                 _mm512_set1_epi8(char(0x80)), 0xF8);
    out[0] = _mm512_unpacklo_epi8(lo, hi);
    out[1] = _mm512_unpackhi_epi8(lo, hi);
  }
};

// An e4m3 row . x (x: K bf16 in bf16_slot's order, K a multiple of 64): each block's 128
// products (a last block's 64) summed by vdpbf16ps, then times the block's factor onto the row's
// total. A NaN byte widens to a NaN and makes the sum NaN. `ahead`: prefetched, a line for each
// read (dot_row).
inline float dot_row_bf16(const e4m3* row, const float* factors, const uint16_t* x, int64_t K,
                          const e4m3* ahead) {
  const E4m3Widen widen;
  __m512 total[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + kFp8Block <= K; k += kFp8Block) {
    if (ahead != nullptr) {
      prefetch(ahead + k);
      prefetch(ahead + k + 64);
    }
    __m512i w[4];
    widen(row + k, w);
    widen(row + k + 64, w + 2);
    __m512 a = dot_bf16(_mm512_setzero_ps(), w[0], x + k);
    __m512 b = dot_bf16(_mm512_setzero_ps(), w[1], x + k + 32);
    a = dot_bf16(a, w[2], x + k + 64);
    b = dot_bf16(b, w[3], x + k + 96);
    const __m512 factor = _mm512_set1_ps(factors[k / kFp8Block]);
    total[0] = _mm512_fmadd_ps(a, factor, total[0]);
    total[1] = _mm512_fmadd_ps(b, factor, total[1]);
  }
  if (k < K) {  // a last block of 64 columns
    if (ahead != nullptr) prefetch(ahead + k);
    __m512i w[2];
    widen(row + k, w);
    const __m512 a = dot_bf16(dot_bf16(_mm512_setzero_ps(), w[0], x + k), w[1], x + k + 32);
    total[0] = _mm512_fmadd_ps(a, _mm512_set1_ps(factors[k / kFp8Block]), total[0]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(total[0], total[1]));
}

// Twice each e2m1 code's value as bf16 (kE2m1Twice: integers), twice over: a 16-bit lane's index
// is its low 5 bits, and bit 4 may hold the next nibble's lowest bit.
struct E2m1Bf16Table {
  alignas(64) uint16_t bits[32];
  E2m1Bf16Table() {
    for (int i = 0; i < 32; ++i) bits[i] = round_bf16(float(kE2m1Twice[i & 15]));
  }
};
inline __m512i e2m1_bf16_table() {
  static const E2m1Bf16Table table;
  return _mm512_load_si512(table.bits);
}

// 32 bytes of e2m1 pairs to twice their 64 values as bf16 in bf16_slot's order: out[0] the even
// values (the low nibbles), out[1] the odd ones (the high nibbles); one vpermw each.
inline void e2m1_widen64(const uint8_t* p, __m512i table, __m512i* out) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i bytes = _mm512_cvtepu8_epi16(packed);
  out[0] = _mm512_permutexvar_epi16(bytes, table);
  out[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
}
// 16 bytes to their 32 values' twice, the 16 even then the 16 odd (a row's last 32 values).
inline __m512i e2m1_widen32(const uint8_t* p, __m512i table) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i both =
      _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
  return _mm512_permutexvar_epi16(both, table);
}

// 64 bytes of e2m1 pairs (128 values) to twice their values as bf16 in bf16_slot's order: out[q]
// the values 4j + q (j = 0..31), the q-th nibble of each 16-bit word; a vpermw each (the table's
// lane index is a word's low 5 bits: its nibble and the next one's lowest bit).
inline void e2m1_widen128(const uint8_t* p, __m512i table, __m512i* out) {
  const __m512i words = _mm512_loadu_si512(p);
  out[0] = _mm512_permutexvar_epi16(words, table);
  out[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
  out[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), table);
  out[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), table);
}

// The half-scales of n <= 16 blocks from their scale bytes, a lane each: MXFP4's E8M0 byte e is
// 2^(e - 128) (its exponent bits, e - 1), with the table's value where that is not a normal
// float (e < 2: subnormals; 255: NaN); NVFP4's e4m3 bytes from the table.
template <bool kNv>
__m512 block_halves(const uint8_t* scales, int64_t n, const float* table) {
  const __mmask16 valid = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, scales));
  if constexpr (kNv) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, e, table, 4);
  } else {
    const __m512 half =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23));
    const __mmask16 odd = _mm512_mask_cmpgt_epu32_mask(
        valid, _mm512_sub_epi32(e, _mm512_set1_epi32(2)), _mm512_set1_epi32(252));
    return odd ? _mm512_mask_i32gather_ps(half, odd, e, table, 4) : half;
  }
}

// An MXFP4 or NVFP4 row . x (x: K bf16 in bf16_slot's order, K a multiple of 32). Each whole 128
// values: four vdpbf16ps into 16 lanes, lane j the products of values 8j..8j+7 (from one MXFP4
// block of 4 lanes, one NVFP4 block of 2), times the lane's block's half-scale onto the row's
// total; the half-scales of 16 blocks made at once (`block_halves`) and handed to the lanes by a
// vpermps. The last K % 128 values in steps of 64: lane j holds values 4j..4j+3 (MXFP4's blocks
// lanes 0..7 and 8..15, NVFP4's four of 4 lanes); over a last 32, lane j < 8 values 4j and 4j+2,
// lane 8 + j the odd values between.
template <class WT>
float dot_row_bf16(const WT* row, const uint8_t* scales, const uint16_t* x, int64_t K,
                   const WT* ahead) {
  constexpr bool nv = std::is_same_v<WT, nv_e2m1x2>;
  constexpr int64_t kBlock = nv ? kNvBlock : kMxBlock;
  constexpr int kLanesPerBlock = int(kBlock / 8), kBlocksPerChunk = int(128 / kBlock);
  constexpr int64_t kGroup = 16 * kBlock;  // the values of 16 blocks: a half-scale vector
  const float* halves = nv ? e4m3_halves() : e8m0_halves();
  const auto* bytes = reinterpret_cast<const uint8_t*>(row);
  const __m512i table = e2m1_bf16_table();
  // lane j of a group's chunk c takes block c * kBlocksPerChunk + j / kLanesPerBlock's
  const __m512i lane_block = _mm512_srli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), nv ? 1 : 2);
  static_assert(kLanesPerBlock * kBlocksPerChunk == 16 && kGroup == (nv ? 256 : 512));
  auto half = [&](int64_t at) { return _mm512_set1_ps(halves[scales[at / kBlock]]); };
  // one accumulator, in a register: an array indexed at run time would live on the stack, and
  // a 128 values' work is longer than an FMA's latency
  __m512 total = _mm512_setzero_ps();
  const int64_t whole = K / 128 * 128;
  // the 128 values from `at`, chunk c of their group's 16 blocks' half-scales
  auto chunk = [&](int64_t at, int c, __m512 group) {
    if (ahead != nullptr) prefetch(ahead + at / 2);  // a line: 128 values
    __m512i w[4];
    e2m1_widen128(bytes + at / 2, table, w);
    const __m512 zero = _mm512_setzero_ps();
    const __m512 a = dot_bf16(dot_bf16(zero, w[0], x + at), w[1], x + at + 32);
    const __m512 b = dot_bf16(dot_bf16(zero, w[2], x + at + 64), w[3], x + at + 96);
    const __m512i block = _mm512_add_epi32(lane_block, _mm512_set1_epi32(c * kBlocksPerChunk));
    total = _mm512_fmadd_ps(_mm512_add_ps(a, b), _mm512_permutexvar_ps(block, group), total);
  };
  int64_t g = 0;
  for (; g + kGroup <= whole; g += kGroup) {  // whole groups, their chunks unrolled
    const __m512 group = block_halves<nv>(scales + g / kBlock, 16, halves);
    chunk(g, 0, group);
    chunk(g + 128, 1, group);
    if constexpr (!nv) {
      chunk(g + 256, 2, group);
      chunk(g + 384, 3, group);
    }
  }
  if (g < whole) {  // a last group of fewer chunks
    const __m512 group = block_halves<nv>(scales + g / kBlock, (whole - g) / kBlock, halves);
    for (int c = 0; g + 128 * c < whole; ++c) chunk(g + 128 * c, c, group);
  }
  int64_t k = whole;
  for (; k + 64 <= K; k += 64) {
    if (ahead != nullptr && k % 128 == 0) prefetch(ahead + k / 2);  // a line: 128 values
    __m512i w[2];
    e2m1_widen64(bytes + k / 2, table, w);
    const __m512 sum = dot_bf16(dot_bf16(_mm512_setzero_ps(), w[0], x + k), w[1], x + k + 32);
    __m512 scale;
    if constexpr (nv) {
      // lanes 0..3 and 8..11 of each the even block's, 4..7 and 12..15 the odd one's
      const __m512 first = _mm512_mask_blend_ps(0xF0F0, half(k), half(k + 16));
      const __m512 second = _mm512_mask_blend_ps(0xF0F0, half(k + 32), half(k + 48));
      scale = _mm512_mask_blend_ps(0xFF00, first, second);
    } else {
      scale = _mm512_mask_blend_ps(0xFF00, half(k), half(k + 32));
    }
    total = _mm512_fmadd_ps(sum, scale, total);
  }
  if (k < K) {  // a last 32 values
    if (ahead != nullptr && k % 128 == 0) prefetch(ahead + k / 2);
    const __m512 sum = dot_bf16(_mm512_setzero_ps(), e2m1_widen32(bytes + k / 2, table), x + k);
    const __m512 scale = nv ? _mm512_mask_blend_ps(0xF0F0, half(k), half(k + 16)) : half(k);
    total = _mm512_fmadd_ps(sum, scale, total);
  }
  return _mm512_reduce_add_ps(total);
}
#endif

}  // namespace
