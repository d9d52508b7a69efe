// The expert job: the routed experts of one MoE layer step on the pool, and submit_experts.
// Included by cpu_experts.cpp only (one translation unit): internal linkage, like the rest.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "bf16dot.h"
#include "mxfp4.h"
#include "nvfp4.h"
#include "pool.h"
#include "simd.h"

namespace {

struct ExpertProblem {
  const float* x;   // [T, H]
  float* out;       // [T, H]
  const void* w13;  // [E, 2I, H]
  const void* w2;   // [E, H, I]
  int64_t T, H, I, E;
  // One expert may be split with the GPU (the decode planner's split miss): for it, only the
  // intermediate rows from split_row on (gate/up rows, down projection columns) are computed here,
  // and its down bias, if any, is added here.
  int32_t split_expert = -1;
  int64_t split_row = 0;
  // The weights outlive the pool's workers (the engine's bank, which the pool is closed before):
  // the job keeps its own copy of x (where x is at most kMaxOwnedX floats) and may then be
  // redone (Job::redo_stalled), its late runs reading only the weights and that copy.
  bool weights_outlive_pool = false;
  // e4m3 weights' block factors (kernels/fp8.py): [E, ceil(2I/128), ceil(H/128)] and
  // [E, ceil(H/128), ceil(I/128)] fp32; unused for the other weight types.
  const float* w13_factors = nullptr;
  const float* w2_factors = nullptr;
  // gpt-oss's experts (kernels/swiglu.py): biases [E, 2I] (gate's, then up's) and [E, H] fp32,
  // or nullptr; the clamped SwiGLU's limit, or 0 for silu(gate) * up.
  const float* w13_bias = nullptr;
  const float* w2_bias = nullptr;
  float swiglu_limit = 0.0f;
  // MXFP4 weights' E8M0 scales (kernels/mxfp4.py): [E, 2I, H/32] and [E, H, I/32] bytes; NVFP4
  // weights' e4m3 scales (kernels/nvfp4.py): [E, 2I, H/16] and [E, H, I/16] bytes.
  const uint8_t* w13_scales = nullptr;
  const uint8_t* w2_scales = nullptr;
  // NVFP4 weights' per-tensor scales: [E, 2] (gate's, up's) and [E, 1] fp32.
  const float* w13_tensor_scales = nullptr;
  const float* w2_tensor_scales = nullptr;
};

// h from one gate/up row pair's sums: silu(gate) * up, or gpt-oss's clamped form where limit > 0.
inline float activate(float gate, float up, float limit) {
  if (limit > 0.0f) {
    gate = std::min(gate, limit);
    up = std::clamp(up, -limit, limit);
    return (up + 1.0f) * (gate / (1.0f + std::exp(-1.702f * gate)));
  }
  return gate / (1.0f + std::exp(-gate)) * up;
}

// The most floats of x a job copies to be redoable (T = 32 tokens of 2048).
constexpr int64_t kMaxOwnedX = 64 * 1024;

// Per thread, where a task of an expert job computes its results before it commits them
// (Job::run_task): one for the gate/up blocks, one for the down projection's (which may run a
// gate/up block inside, ExpertJob::wait_group).
std::vector<float>& task_scratch(bool down) {
  static thread_local std::vector<float> gate_up, out;
  return down ? out : gate_up;
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// n rows cut into about n / per_block blocks, as many as a multiple of `threads` where that leaves
// at least `quantum` rows a block, each a multiple of `quantum` rows but the last: block b is rows
// [at(b), at(b + 1)), at(0) = 0 < at(1) < ... < at(count) = n (no block for n = 0).
struct EvenBlocks {
  EvenBlocks() = default;
  EvenBlocks(int64_t n, int64_t per_block, int64_t threads, int64_t quantum)
      : n(n), units((n + quantum - 1) / quantum), quantum(quantum) {
    const int64_t wanted = (n + per_block - 1) / per_block;
    count = std::max<int64_t>(1, (wanted + threads / 2) / threads) * threads;
    count = std::min(count, units >= threads ? units / threads * threads : units);
  }
  int64_t at(int64_t b) const { return b >= count ? n : std::min(n, units * b / count * quantum); }
  int64_t n = 0, units = 0, quantum = 1, count = 0;
};

// EvenBlocks whose last round (the last `threads` blocks) is cut again into blocks of about half
// the size, as many as a multiple of the threads: a phase's blocks are handed out in order, so
// the workers that end their earlier blocks first take more of the small ones, and the phase's
// last blocks end closer together (with equal blocks, the first workers to end waited for the
// last for about half a block's time). Where EvenBlocks gives one round, the same blocks.
struct TaperedBlocks {
  TaperedBlocks() = default;
  TaperedBlocks(int64_t n, int64_t per_block, int64_t threads, int64_t quantum)
      : even(n, per_block, threads, quantum), head_count(even.count) {
    if (even.count >= 2 * threads) head_count = even.count - threads;
    n_head = even.at(head_count);
    if (n_head < n) {
      tail = EvenBlocks(n - n_head, std::max<int64_t>(1, per_block / 2), threads, quantum);
    }
    count = head_count + tail.count;
  }
  int64_t at(int64_t b) const {
    return b < head_count ? even.at(b) : n_head + tail.at(b - head_count);
  }
  EvenBlocks even, tail;  // the rounds but the last are even's first head_count blocks
  int64_t head_count = 0, n_head = 0, count = 0;
};

// Every bound of a cut of n rows (EvenBlocks, TaperedBlocks), for tests.
template <class Blocks>
std::vector<int64_t> block_bounds(int64_t n, int64_t per_block, int64_t threads, int64_t quantum) {
  const Blocks blocks(n, per_block, threads, quantum);
  std::vector<int64_t> bounds(size_t(blocks.count) + 1);
  for (int64_t b = 0; b <= blocks.count; ++b) bounds[b] = blocks.at(b);
  return bounds;
}

// How far ahead of its reads a thread prefetches the rows of a one-token expert, in bytes: two
// of Qwen3-30B-A3B's gate/up rows (4 KiB each), which ran jobs of one to four experts faster than
// one row ahead, or than tiles of four rows with the next tile prefetched (docs/cpu-experts.md).
// Shorter rows look as many bytes ahead, in more rows (its 1.5 KiB down rows: 6).
constexpr int64_t kAheadBytes = 8192;
int64_t rows_ahead(int64_t row_bytes) {
  return std::max<int64_t>(2, (kAheadBytes + row_bytes - 1) / std::max<int64_t>(1, row_bytes));
}

// row . x over K elements, fp32 accumulation. `ahead`, when given, is the row this thread reads
// rows_ahead() rows after this one: its lines are prefetched, one per line read here (a thread's
// demand misses alone cannot keep enough reads in flight for its share of the memory bandwidth,
// and the hardware's prefetchers stop at every 4 KiB page). `factors`: e4m3 rows' (below).
template <class B, class WT>
float dot_row(const WT* row, const float* /*factors*/, const float* x, int64_t K,
              const WT* ahead) {
  constexpr int U = 4;
  constexpr int W = B::W;
  constexpr int64_t kLine = 64 / int64_t(sizeof(WT));
  typename B::V acc[U];
  for (int u = 0; u < U; ++u) acc[u] = B::zero();
  int64_t k = 0;
  for (; k + U * W <= K; k += U * W) {
    if (ahead != nullptr) {
      for (int64_t l = 0; l < U * W; l += kLine) prefetch(ahead + k + l);
    }
    for (int u = 0; u < U; ++u) {
      acc[u] = B::fma(B::load(row + k + u * W), B::load(x + k + u * W), acc[u]);
    }
  }
  for (; k + W <= K; k += W) acc[0] = B::fma(B::load(row + k), B::load(x + k), acc[0]);
  float s = B::sum(B::add(B::add(acc[0], acc[1]), B::add(acc[2], acc[3])));
  for (; k < K; ++k) s += to_float(row[k]) * x[k];
  return s;
}

// The same for an e4m3 row, its block factors at `factors` (one per 128 columns). The products of
// each whole block are summed as the loads give them (2^-8 of the weights' values) and the sums
// multiplied by 2^8 times the block's factor: one product a block and chain rather than one a
// weight, which the conversion leaves little room for. The NaN bytes are looked for on the way
// (a NaN weight makes the product NaN, as with the dequantized weights); a last block of fewer
// than 128 columns takes the dequantized weights, as dot_tile does.
template <class B>
float dot_row(const e4m3* row, const float* factors, const float* x, int64_t K,
              const e4m3* ahead) {
  constexpr int U = 4;
  constexpr int W = B::W;
  constexpr int kSteps = int(kFp8Block / (U * W));
  static_assert(kSteps * U * W == kFp8Block, "a block must be whole steps of the loop");
  using V = typename B::V;
  V total[U];
  for (int u = 0; u < U; ++u) total[u] = B::zero();
  typename B::Seen seen = B::none_seen();
  int64_t k = 0;
  for (; k + kFp8Block <= K; k += kFp8Block) {
    V acc[U];
    for (int u = 0; u < U; ++u) acc[u] = B::zero();
    for (int step = 0; step < kSteps; ++step) {
      const int64_t at = k + step * U * W;
      if (ahead != nullptr && at % 64 == 0) prefetch(ahead + at);
      seen = B::note_nan(seen, row + at);
      for (int u = 0; u < U; ++u) {
        acc[u] = B::fma(B::load(row + at + u * W), B::load(x + at + u * W), acc[u]);
      }
    }
    const V factor256 = B::set1(factors[k / kFp8Block] * 256.0f);
    for (int u = 0; u < U; ++u) total[u] = B::fma(acc[u], factor256, total[u]);
  }
  float s = B::sum(B::add(B::add(total[0], total[1]), B::add(total[2], total[3])));
  bool nan = B::saw_nan(seen);
  if (k < K) {
    const float factor = factors[k / kFp8Block];
    nan |= any_nan<B>(row + k, K - k);
    const V factor256 = B::set1(factor * 256.0f);
    V acc = B::zero();
    for (; k + W <= K; k += W) {
      acc = B::fma(B::mul(B::load(row + k), factor256), B::load(x + k), acc);
    }
    s += B::sum(acc);
    for (; k < K; ++k) s += to_float(row[k], factor) * x[k];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : s;
}

// An expert job made before its pairs are known, with room for `capacity()` pairs: `assign` gives
// it its problem and pairs without allocating (the decode planner makes the next step's job while
// it waits for the routing, and only assigns it once the routing is there).
class ExpertJobShell : public Job {
 public:
  // Pairs (expert pe[j], token pt[j], weight pw[j]), J <= capacity(), each in range (unchecked);
  // p.I must be the shell's intermediate size. Before the job is queued; a shell that is never
  // queued (the decode planner's guess of a step, for its layout) may be assigned again.
  virtual void assign(const ExpertProblem& p, const int32_t* pe, const int32_t* pt,
                      const float* pw, int64_t J) = 0;
  virtual int64_t capacity() const = 0;
  // After assign, before the job is queued: its first `rounds` rounds of gate/up blocks belong to
  // the pool's workers (Job::set_owned: block w + r * threads to worker w), and, with `fetch`, the
  // pool is told which weights each worker's blocks read (Pool::hint), for its idle workers to
  // fetch into their caches while they wait for the job. Returns the blocks owned.
  virtual int64_t own_gate_up(Pool& pool, int64_t rounds, bool fetch) = 0;
};

template <class B, class WT>
class ExpertJob final : public ExpertJobShell {
  // values an element of a row holds (MXFP4: two), and the type of the rows' scales
  static constexpr int64_t kPer = kValuesPerElement<WT>;
  using Scale = typename ScaleOf<WT>::type;
#ifdef MOELAB_HAVE_BF16DOT
  // whether this level and type have the bf16 dot products (bf16dot.h)
  static constexpr bool kCanBf16 = kBf16Dot<WT> && std::is_same_v<B, Avx512>;
#else
  static constexpr bool kCanBf16 = false;
#endif
#ifdef MOELAB_HAVE_AVX2
  // whether this level and type read one token's rows against activations in their slots
  // (dot_row_slots of mxfp4.h and nvfp4.h)
  static constexpr bool kCanSlots =
      (std::is_same_v<WT, e2m1x2> || std::is_same_v<WT, nv_e2m1x2>) && std::is_same_v<B, Avx2>;
#else
  static constexpr bool kCanSlots = false;
#endif

 public:
  ExpertJob(int num_threads, int64_t task_bytes, int64_t capacity, int64_t inter)
      : threads_(num_threads),
        task_bytes_(task_bytes),
        capacity_(capacity),
        inter_(inter),
        order_(size_t(capacity)),
        h_(size_t(capacity * inter)),
        h16_(kCanBf16 ? size_t(capacity * inter) : 0),
        hs_(kCanSlots ? size_t(capacity * inter) : 0),
        group_done_(new Counter[size_t(std::max<int64_t>(1, capacity))]) {
    for (auto* v : {&group_expert_, &group_start_, &token_}) v->reserve(size_t(capacity) + 1);
    weight_.reserve(size_t(capacity));
    x_row_.reserve(size_t(capacity));
    group_rows_.reserve(size_t(capacity) + 1);
  }

  int64_t capacity() const override { return capacity_; }

  int64_t own_gate_up(Pool& pool, int64_t rounds, bool fetch) override {
    const int64_t owned = std::min(std::max<int64_t>(0, rounds) * threads_, blocks1_.count);
    set_owned(owned);
    if (!fetch || owned == 0) return owned;
    // a block spans at most kGroupsPerBlock groups' rows here (more only where experts have
    // fewer rows than a block: their first ones are fetched)
    constexpr int kGroupsPerBlock = 2;
    constexpr int kPerRound = 2 * kGroupsPerBlock;
    // the rounds the hint holds for this many workers: their blocks are fetched, the rest of the
    // owned ones are only owned
    const int64_t hinted_rounds =
        std::min<int64_t>(rounds, PrefetchHint::kMaxRanges / (kPerRound * threads_));
    if (hinted_rounds < 1) return owned;
    const int per = int(kPerRound * hinted_rounds);
    const int64_t hinted = std::min(owned, hinted_rounds * threads_);
    std::vector<std::pair<const void*, int64_t>> ranges(size_t(per * threads_), {nullptr, 0});
    const int64_t row = p_.H / kPer * int64_t(sizeof(WT));
    for (int64_t b = 0; b < hinted; ++b) {
      auto* out = ranges.data() + (b % threads_) * per + (b / threads_) * kPerRound;
      int n = 0;
      for_each_part(b, [&](int64_t g, int64_t r_begin, int64_t r_end) {
        if (n == kPerRound) return;
        const auto* gate = static_cast<const char*>(p_.w13) +
                           (int64_t(group_expert_[g]) * 2 * p_.I + r_begin) * row;
        out[n++] = {gate, (r_end - r_begin) * row};
        out[n++] = {gate + p_.I * row, (r_end - r_begin) * row};
      });
    }
    pool.hint(ranges.data(), int(ranges.size()), per);
    return owned;
  }

  void assign(const ExpertProblem& p, const int32_t* pe, const int32_t* pt, const float* pw,
              int64_t J) override {
    if (J > capacity_ || p.I != inter_) {
      throw std::logic_error("an expert job was given more pairs than its room, or another I");
    }
    if constexpr (kBlockScaled<WT>) {
      if (p.w13_factors == nullptr || p.w2_factors == nullptr) {
        throw std::invalid_argument("FP8 (e4m3) weights need their block factors");
      }
      // each step of the dot products lies in one block from a row's first column on
      if (p.split_expert >= 0 && p.split_row % kFp8Block != 0) {
        throw std::invalid_argument("an expert of FP8 weights splits at a multiple of 128 rows");
      }
    }
    if ((p.w13_bias == nullptr) != (p.w2_bias == nullptr)) {
      throw std::invalid_argument("w13_bias and w2_bias come together");
    }
    if constexpr (kPer > 1) check_fp4(p);
    p_ = p;
    for (auto* v : {&group_expert_, &group_start_, &token_}) v->clear();
    weight_.clear();
    x_row_.clear();
    group_rows_.clear();
    one_token_each_ = true;
    // the rows of x the tasks read: the job's own copy where it may be redone
    const bool own_x = p.weights_outlive_pool && p.T * p.H <= kMaxOwnedX;
    if (own_x) x_copy_.assign(p.x, p.x + p.T * p.H);
    set_redoable(own_x);
    const float* x = own_x ? x_copy_.data() : p.x;
    // the pairs grouped by expert, in their order within a group
    std::iota(order_.begin(), order_.begin() + J, 0);
    std::stable_sort(order_.begin(), order_.begin() + J,
                     [pe](int32_t a, int32_t b) { return pe[a] < pe[b]; });
    for (int64_t k = 0; k < J; ++k) {
      const int32_t j = order_[k];
      if (k == 0 || pe[j] != group_expert_.back()) {
        group_expert_.push_back(pe[j]);
        group_start_.push_back(int32_t(k));
      }
      token_.push_back(pt[j]);
      weight_.push_back(pw[j]);
      x_row_.push_back(x + pt[j] * p.H);
    }
    group_start_.push_back(int32_t(J));
    const int64_t groups = int64_t(group_expert_.size());
    for (int64_t g = 0; g < groups; ++g) {
      one_token_each_ &= group_start_[g + 1] - group_start_[g] == 1;
    }
    bf16_ = false;
    if constexpr (kCanBf16) {
      // one token an expert, rows the bf16 dot products take and x all bf16: those products
      bf16_ = one_token_each_ && bf16_dot_fits<WT>(p.H) && bf16_dot_fits<WT>(p.I) &&
              (p.split_expert < 0 || bf16_dot_fits<WT>(p.I - p.split_row)) &&
              all_bf16(x, p.T * p.H);
      if (bf16_) {
        x16_.resize(size_t(p.T * p.H));
        for (int64_t t = 0; t < p.T; ++t) bf16_slots<WT>(x + t * p.H, p.H, x16_.data() + t * p.H);
      }
    }
    slots_ = false;
    if constexpr (kCanSlots) {
      // one token an expert and rows of whole 64-value steps: x and h in their slots
      slots_ = one_token_each_ && fp4_slots_fit(p.H) && fp4_slots_fit(p.I) &&
               (p.split_expert < 0 || fp4_slots_fit(p.I - p.split_row));
      if (slots_) {
        xs_.resize(size_t(p.T * p.H));
        for (int64_t t = 0; t < p.T; ++t) fp4_to_slots(x + t * p.H, p.H, xs_.data() + t * p.H);
      }
    }
    // Phase 1: the groups' gate/up row pairs, one after the other (the split expert's from its
    // first CPU row), cut into blocks of about task_bytes; phase 2: the output rows, at least 4
    // blocks per thread. Each phase has a multiple of num_threads blocks of equal size (to the
    // row, or to the tile: two pairs, four rows), so that at the workers' speeds the last blocks
    // end together: with 64 blocks on 15 workers, 4 ran a fifth block while 11 waited for them;
    // the last round's blocks are cut in half again (TaperedBlocks), for the spread of the
    // workers' speeds.
    const int64_t row_bytes = std::max<int64_t>(1, p.H / kPer * int64_t(sizeof(WT)));
    const int64_t pairs_per_task =
        std::max<int64_t>(2, round_up(task_bytes_ / (2 * row_bytes), 2));
    group_rows_.push_back(0);
    for (int64_t g = 0; g < groups; ++g) {
      group_rows_.push_back(group_rows_[g] + p.I - first_row(g));
    }
    blocks1_ =
        TaperedBlocks(group_rows_[groups], pairs_per_task, threads_, one_token_each_ ? 1 : 2);
    const int64_t down_bytes_per_row =
        std::max<int64_t>(1, groups * p.I / kPer * int64_t(sizeof(WT)));
    int64_t rows2 = std::max<int64_t>(4, round_up(task_bytes_ / down_bytes_per_row, 4));
    rows2 = std::min(rows2, std::max<int64_t>(4, round_up(p.H / (4 * threads_), 4)));
    blocks2_ = TaperedBlocks(p.H, rows2, threads_, one_token_each_ ? 1 : 4);
    phase1_left_.store(blocks1_.count, std::memory_order_relaxed);
    set_num_tasks(groups == 0 ? 0 : blocks1_.count + blocks2_.count);
  }

  bool bf16_dot() const override { return bf16_; }

  std::pair<double, double> phase_seconds() const override {
    if (!done() || blocks1_.count == 0) return {0.0, 0.0};
    const std::chrono::duration<double> phase1 = phase1_end_ - started_at();
    return {phase1.count(), 1e-9 * double(wait_ns_.load(std::memory_order_relaxed))};
  }

 protected:
  // Tasks are handed out in order: phase 1 in group order, then phase 2; a task waits only for
  // tasks handed out before it, so the waits always end. Each computes into its thread's
  // scratch and, once it commits, copies that to h (gate/up) or out (down).
  bool run_task(int64_t i) override {
    if (i >= blocks1_.count) {
      const int64_t r0 = blocks2_.at(i - blocks1_.count);
      const int64_t r1 = blocks2_.at(i - blocks1_.count + 1), n = r1 - r0;
      std::vector<float>& rows = task_scratch(true);
      rows.assign(size_t(p_.T * n), 0.0f);  // [T, n]
      down(i, r0, r1, rows.data());
      if (!commit(i)) return false;
      for (int64_t t = 0; t < p_.T; ++t) {
        std::copy_n(rows.data() + t * n, n, p_.out + t * p_.H + r0);
      }
      return true;
    }
    // each part's [pairs of its group, its rows], one after the other
    auto part_size = [&](int64_t g, int64_t r_begin, int64_t r_end) {
      return int64_t(group_start_[g + 1] - group_start_[g]) * (r_end - r_begin);
    };
    std::vector<float>& h = task_scratch(false);
    int64_t at = 0;
    for_each_part(i, [&](int64_t g, int64_t r_begin, int64_t r_end) {
      at += part_size(g, r_begin, r_end);
    });
    h.resize(size_t(at));
    at = 0;
    for_each_part(i, [&](int64_t g, int64_t r_begin, int64_t r_end) {
      gate_up(g, r_begin, r_end, h.data() + at);
      at += part_size(g, r_begin, r_end);
    });
    if (!commit(i)) return false;
    at = 0;
    for_each_part(i, [&](int64_t g, int64_t r_begin, int64_t r_end) {
      const int64_t n = r_end - r_begin;
      for (int32_t j = group_start_[g]; j < group_start_[g + 1]; ++j, at += n) {
        if (bf16_) {
          store_h16(g, j, r_begin, r_end, h.data() + at);
        } else if (slots_) {
          store_hs(g, j, r_begin, r_end, h.data() + at);
        } else {
          std::copy_n(h.data() + at, n, h_.data() + int64_t(j) * p_.I + r_begin);
        }
      }
      group_done_[g].value.fetch_add(n, std::memory_order_release);
    });
    // the last phase-1 block to end times the phase (read once the job is done: the job's
    // finishing count orders this write before it)
    if (phase1_left_.fetch_sub(1, std::memory_order_relaxed) == 1) phase1_end_ = Clock::now();
    return true;
  }
  // While phase 1 runs, its blocks only: a down projection's block waits for them.
  int64_t ready_tasks() const override {
    return phase1_left_.load(std::memory_order_relaxed) > 0 ? blocks1_.count
                                                            : blocks1_.count + blocks2_.count;
  }

 private:
  // Pair j's h of rows [r_begin, r_end) (of group g), rounded to bf16, into h16_ in the order the
  // bf16 dot products of its down projection read (bf16dot.h), from the group's first row.
  void store_h16(int64_t g, int32_t j, int64_t r_begin, int64_t r_end, const float* h) {
    const int64_t first = first_row(g), K = p_.I - first;
    uint16_t* out = h16_.data() + int64_t(j) * p_.I + first;
    for (int64_t r = r_begin; r < r_end; ++r) {
      out[bf16_slot<WT>(r - first, K)] = round_bf16(h[r - r_begin]);
    }
  }

  // Pair j's h of rows [r_begin, r_end) (of group g) into hs_ in the order dot_row_slots reads
  // (mxfp4.h fp4_slot_of), from the group's first row.
  void store_hs(int64_t g, int32_t j, int64_t r_begin, int64_t r_end, const float* h) {
    if constexpr (kCanSlots) {
      const int64_t first = first_row(g);
      float* out = hs_.data() + int64_t(j) * p_.I + first;
      for (int64_t r = r_begin; r < r_end; ++r) out[fp4_slot_of(r - first)] = h[r - r_begin];
    }
  }

  // fn(g, r_begin, r_end) for each group g whose gate/up rows [r_begin, r_end) of its expert lie
  // in gate/up block b (the block's rows of the groups' rows one after the other).
  template <class Fn>
  void for_each_part(int64_t b, Fn fn) const {
    const int64_t b0 = blocks1_.at(b), b1 = blocks1_.at(b + 1);
    auto g = int64_t(std::upper_bound(group_rows_.begin(), group_rows_.end(), b0) -
                     group_rows_.begin()) - 1;
    for (; g + 1 < int64_t(group_rows_.size()) && group_rows_[g] < b1; ++g) {
      const int64_t from = std::max(b0, group_rows_[g]), to = std::min(b1, group_rows_[g + 1]);
      if (from >= to) continue;
      const int64_t first = first_row(g) - group_rows_[g];
      fn(g, first + from, first + to);
    }
  }

  // h[j - j0, r - r_begin] = silu(gate[r] . x[t_j]) * (up[r] . x[t_j]) for every pair j of group
  // g (j0 its first) and row r in [r_begin, r_end).
  void gate_up(int64_t g, int64_t r_begin, int64_t r_end, float* h) {
    const int64_t H = p_.H, I = p_.I, e = group_expert_[g];
    const int64_t Hp = H / kPer;  // a row's elements
    const WT* gate = static_cast<const WT*>(p_.w13) + e * 2 * I * Hp;
    const WT* up = gate + I * Hp;
    const int32_t j0 = group_start_[g], j1 = group_start_[g + 1];
    if (j1 - j0 == 1) {
      // One token (decode at batch 1): the block's gate rows, then its up rows, one row at a
      // time, each read straight through.
      const float* x = x_row_[j0];
      const int64_t n = std::max<int64_t>(0, r_end - r_begin);
      const int64_t ahead = rows_ahead(Hp * int64_t(sizeof(WT)));
      auto row = [&](int64_t i) -> const WT* {
        if (i < n) return gate + (r_begin + i) * Hp;
        return i < 2 * n ? up + (r_begin + i - n) * Hp : nullptr;
      };
      const float gate_scale = tensor13(e, 0), up_scale = tensor13(e, 1);
      // row i . x, with the bf16 products where the job takes them
      auto dot = [&](int64_t i, const Scale* factors) {
        if constexpr (kCanBf16) {
          if (bf16_) {
            const uint16_t* x16 = x16_.data() + int64_t(token_[j0]) * H;
            return dot_row_bf16(row(i), factors, x16, H, row(i + ahead));
          }
        }
        if constexpr (kCanSlots) {
          if (slots_) {
            const float* xs = xs_.data() + int64_t(token_[j0]) * H;
            return dot_row_slots(row(i), factors, xs, H, row(i + ahead));
          }
        }
        return dot_row<B>(row(i), factors, x, H, row(i + ahead));
      };
      for (int64_t i = 0; i < n; ++i) h[i] = dot(i, factors13(e, r_begin + i)) * gate_scale;
      for (int64_t i = 0; i < n; ++i) {
        const float gv = h[i] + bias13(e, r_begin + i);
        const float uv = dot(n + i, factors13(e, I + r_begin + i)) * up_scale +
                         bias13(e, I + r_begin + i);
        h[i] = activate(gv, uv, p_.swiglu_limit);
      }
      return;
    }
    for (int64_t r = r_begin; r < r_end;) {
      const int nr = r + 2 <= r_end ? 2 : 1;
      const WT* rows[4] = {gate + r * Hp, gate + (r + 1) * Hp, up + r * Hp, up + (r + 1) * Hp};
      const Scale* factors[4] = {factors13(e, r), nullptr, factors13(e, I + r), nullptr};
      if (nr == 2) {
        factors[1] = factors13(e, r + 1);
        factors[3] = factors13(e, I + r + 1);
      } else {
        rows[1] = up + r * Hp;
        factors[1] = factors[2];
      }
      // The next tile's rows, fetched while this one computes: a thread's demand misses alone
      // cannot keep enough reads in flight to reach its share of the memory bandwidth.
      const WT* next[4] = {rows[0] + 2 * Hp, rows[1] + 2 * Hp, rows[2] + 2 * Hp, rows[3] + 2 * Hp};
      const bool ahead = nr == 2 && r + 4 <= r_end;
      for (int32_t jt = j0; jt < j1; jt += kMaxTokensPerTile) {
        const int nt = std::min<int>(kMaxTokensPerTile, j1 - jt);
        const WT* const* pf = ahead && jt == j0 ? next : nullptr;
        float res[4 * kMaxTokensPerTile];
        if (nr == 2) {
          dot_tile_n<B, WT, 4>(rows, factors, pf, x_row_.data() + jt, nt, H, res);
        } else {
          dot_tile_n<B, WT, 2>(rows, factors, nullptr, x_row_.data() + jt, nt, H, res);
        }
        for (int a = 0; a < nr; ++a) {
          for (int q = 0; q < nt; ++q) {
            const float gv = res[a * nt + q] * tensor13(e, 0) + bias13(e, r + a);
            const float uv = res[(nr + a) * nt + q] * tensor13(e, 1) + bias13(e, I + r + a);
            h[(jt + q - j0) * (r_end - r_begin) + r - r_begin + a] =
                activate(gv, uv, p_.swiglu_limit);
          }
        }
      }
      r += nr;
    }
  }

  // out[t, r - r0] += sum over groups and pairs of weight_j * (w2[e] row r . h[j]), for the
  // rows r in [r0, r_end) (out: [T, r_end - r0]); of task `task`.
  void down(int64_t task, int64_t r0, int64_t r_end, float* out) {
    const int64_t H = p_.H, I = p_.I, n = r_end - r0;
    const int64_t groups = int64_t(group_expert_.size());
    // each pair's weighted bias of these rows (a split expert's too: its slot's is zeroed)
    if (p_.w2_bias != nullptr) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* bias = p_.w2_bias + int64_t(group_expert_[g]) * H + r0;
        for (int32_t j = group_start_[g]; j < group_start_[g + 1]; ++j) {
          float* token_out = out + int64_t(token_[j]) * n;
          for (int64_t r = 0; r < n; ++r) token_out[r] += weight_[j] * bias[r];
        }
      }
    }
    auto down_rows = [&](int64_t g, int64_t r) {
      return static_cast<const WT*>(p_.w2) + (int64_t(group_expert_[g]) * H + r) * (I / kPer);
    };
    if (one_token_each_) {
      // One token an expert (decode at batch 1): each expert's rows of this block read straight
      // through, one row at a time, expert after expert.
      auto row = [&](int64_t i) -> const WT* {
        return i < groups * n ? down_rows(i / n, r0 + i % n) + first_row(i / n) / kPer : nullptr;
      };
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = first_row(g);
        wait_group(task, g, row(g * n), n, I - first);
        const int32_t j = group_start_[g];
        const float* h = h_.data() + int64_t(j) * I + first;
        float* token_out = out + int64_t(token_[j]) * n;
        const int64_t ahead = rows_ahead((I - first) / kPer * int64_t(sizeof(WT)));
        const float scaled = weight_[j] * tensor2(group_expert_[g]);
        for (int64_t i = g * n; i < (g + 1) * n; ++i) {
          const Scale* factors = factors2(group_expert_[g], r0 + i % n, first);
          const float dot = [&] {
            if constexpr (kCanBf16) {
              if (bf16_) {
                const uint16_t* h16 = h16_.data() + int64_t(j) * I + first;
                return dot_row_bf16(row(i), factors, h16, I - first, row(i + ahead));
              }
            }
            if constexpr (kCanSlots) {
              if (slots_) {
                const float* hs = hs_.data() + int64_t(j) * I + first;
                return dot_row_slots(row(i), factors, hs, I - first, row(i + ahead));
              }
            }
            return dot_row<B>(row(i), factors, h, I - first, row(i + ahead));
          }();
          token_out[i % n] += scaled * dot;
        }
      }
      return;
    }
    for (int64_t g = 0; g < groups; ++g) {
      wait_group(task, g);
      const int32_t j0 = group_start_[g], j1 = group_start_[g + 1];
      const int64_t first = first_row(g), K = I - first;  // the down projection's columns here
      for (int64_t r = r0; r < r_end;) {
        const int nr = r + 4 <= r_end ? 4 : 1;
        const WT* rows[4] = {down_rows(g, r) + first / kPer};
        const Scale* factors[4] = {factors2(group_expert_[g], r, first)};
        for (int a = 1; a < nr; ++a) {
          rows[a] = rows[0] + a * (I / kPer);
          factors[a] = factors2(group_expert_[g], r + a, first);
        }
        // Prefetch the next tile: further down this expert, else the next expert's first rows.
        const WT* next[4] = {nullptr};
        if (r + 8 <= r_end) {
          next[0] = rows[0] + 4 * (I / kPer);
        } else if (g + 1 < groups && r0 + 4 <= r_end) {
          next[0] = down_rows(g + 1, r0) + first_row(g + 1) / kPer;
        }
        for (int a = 1; a < 4; ++a) next[a] = next[0] + a * (I / kPer);
        for (int32_t jt = j0; jt < j1; jt += kMaxTokensPerTile) {
          const int nt = std::min<int>(kMaxTokensPerTile, j1 - jt);
          const float* hs[kMaxTokensPerTile];
          for (int q = 0; q < nt; ++q) hs[q] = h_.data() + int64_t(jt + q) * I + first;
          float res[4 * kMaxTokensPerTile];
          if (nr == 4) {
            dot_tile_n<B, WT, 4>(rows, factors, next[0] != nullptr && jt == j0 ? next : nullptr,
                                 hs, nt, K, res);
          } else {
            dot_tile_n<B, WT, 1>(rows, factors, nullptr, hs, nt, K, res);
          }
          const float tensor = tensor2(group_expert_[g]);
          for (int a = 0; a < nr; ++a) {
            for (int q = 0; q < nt; ++q) {
              out[int64_t(token_[jt + q]) * n + r - r0 + a] +=
                  weight_[jt + q] * (res[a * nt + q] * tensor);
            }
          }
        }
        r += nr;
      }
    }
  }

  // Waits for group g's phase-1 blocks. Phase 1 hands out its blocks in group order, so this wait
  // is short and mostly on the last group. While it lasts, the caller's next n rows of the down
  // projection (len elements each, I apart) are fetched into the cache: they do not depend on h,
  // and a worker that only waited here would leave the memory idle (docs/cpu-experts.md).
  // The waiting task's clock restarts after the wait (Job::restart): only its own work counts
  // towards its being stalled.
  void wait_group(int64_t task, int64_t g, const WT* rows = nullptr, int64_t n = 0,
                  int64_t len = 0) {
    const int64_t group_rows = group_rows_[g + 1] - group_rows_[g];
    auto ready = [&] {
      return group_done_[g].value.load(std::memory_order_acquire) == group_rows;
    };
    if (ready()) return;
    const Clock::time_point t0 = Clock::now();
    constexpr int64_t kLine = 64 / int64_t(sizeof(WT));
    for (int64_t i = 0; i < n && !ready(); ++i) {
      for (int64_t l = 0; l < len / kPer; l += kLine) prefetch(rows + i * (p_.I / kPer) + l);
    }
    // an owned block whose owner has not come yet is run here rather than waited for, and so
    // is a block whose thread stalled (its task in the counts)
    spin_until(ready, std::chrono::nanoseconds::max(),
               [this] { return run_unowned() || redo_stalled(false, blocks1_.count); });
    const Clock::time_point t1 = Clock::now();
    wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count(),
                       std::memory_order_relaxed);
    restart(task, t1);
  }

  // The bias of row r of expert e's gate/up ([2I]), 0 without biases.
  float bias13(int64_t e, int64_t r) const {
    return p_.w13_bias != nullptr ? p_.w13_bias[e * 2 * p_.I + r] : 0.0f;
  }

  // Where the block factors of row r of expert e's gate/up ([2I, H]) begin, and of row r of its
  // down projection ([H, I]) from column `first` (a multiple of the block: assign checks the
  // split); nullptr for weights without factors.
  const Scale* factors13(int64_t e, int64_t r) const {
    if constexpr (kPer > 1) {
      return p_.w13_scales + (e * 2 * p_.I + r) * (p_.H / kScaleBlock<WT>);
    } else if constexpr (kBlockScaled<WT>) {
      return p_.w13_factors + (e * blocks(2 * p_.I) + r / kFp8Block) * blocks(p_.H);
    } else {
      return nullptr;
    }
  }
  const Scale* factors2(int64_t e, int64_t r, int64_t first) const {
    if constexpr (kPer > 1) {
      constexpr int64_t kBlock = kScaleBlock<WT>;
      return p_.w2_scales + (e * p_.H + r) * (p_.I / kBlock) + first / kBlock;
    } else if constexpr (kBlockScaled<WT>) {
      return p_.w2_factors + (e * blocks(p_.H) + r / kFp8Block) * blocks(p_.I) +
             first / kFp8Block;
    } else {
      return nullptr;
    }
  }
  static int64_t blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

  // The per-tensor scale of expert e's gate (part 0) or up (part 1) rows, and of its down
  // projection's: NVFP4's, 1 for the other types.
  float tensor13(int64_t e, int part) const {
    if constexpr (std::is_same_v<WT, nv_e2m1x2>) return p_.w13_tensor_scales[e * 2 + part];
    return 1.0f;
  }
  float tensor2(int64_t e) const {
    if constexpr (std::is_same_v<WT, nv_e2m1x2>) return p_.w2_tensor_scales[e];
    return 1.0f;
  }

  // 4-bit rows are whole blocks of their scales (MXFP4: 32 values, NVFP4: 16), and a split
  // expert's CPU part starts at a block.
  static void check_fp4(const ExpertProblem& p) {
    constexpr bool nv = std::is_same_v<WT, nv_e2m1x2>;
    constexpr int64_t kBlock = kScaleBlock<WT>;
    const char* name = nv ? "NVFP4" : "MXFP4";
    if (p.w13_scales == nullptr || p.w2_scales == nullptr ||
        (nv && (p.w13_tensor_scales == nullptr || p.w2_tensor_scales == nullptr))) {
      throw std::invalid_argument(std::string(name) + " weights need their scales");
    }
    if (p.H % kBlock != 0 || p.I % kBlock != 0 || p.split_row % kBlock != 0) {
      throw std::invalid_argument(std::string(name) +
                                  " weights need H, I and a split row that are multiples of " +
                                  std::to_string(kBlock));
    }
  }

  // The first intermediate row computed for group g (all but the split expert: 0).
  int64_t first_row(int64_t g) const {
    return group_expert_[g] == p_.split_expert ? p_.split_row : 0;
  }

  const int threads_;
  const int64_t task_bytes_, capacity_, inter_;
  ExpertProblem p_{};
  std::vector<int32_t> order_;         // scratch of assign
  std::vector<int32_t> group_expert_;  // expert of each group
  std::vector<int32_t> group_start_;   // pairs of group g: [group_start[g], group_start[g+1])
  std::vector<int32_t> token_;         // per pair, sorted by expert
  std::vector<float> weight_;          // per pair, sorted by expert
  std::vector<const float*> x_row_;    // per pair: its row of x
  std::vector<float> h_;               // [pairs, I]
  std::vector<float> x_copy_;          // [T, H]: x, where the job keeps its own (redoable)
  // the bf16 dot products (bf16dot.h): whether this job takes them, x and h as bf16 in their order
  bool bf16_ = false;
  std::vector<uint16_t> x16_;  // [T, H]
  std::vector<uint16_t> h16_;  // [pairs, I]
  // AVX2's one-token 4-bit rows (dot_row_slots of mxfp4.h and nvfp4.h): whether this job reads
  // them so, x and h in their slots
  bool slots_ = false;
  std::vector<float> xs_;  // [T, H]
  std::vector<float> hs_;  // [pairs, I]
  std::vector<int64_t> group_rows_;  // group g's phase-1 rows: [group_rows[g], group_rows[g+1])
  TaperedBlocks blocks1_;  // of the groups' phase-1 rows, one group after the other
  TaperedBlocks blocks2_;  // of the output rows
  std::unique_ptr<Counter[]> group_done_;  // phase-1 rows done, per group
  bool one_token_each_ = true;             // every group (expert) has one pair
  // phase_seconds: phase-1 blocks not ended yet, when the last ended, the waits for them
  alignas(64) std::atomic<int64_t> phase1_left_{0};
  Clock::time_point phase1_end_{};
  alignas(64) mutable std::atomic<int64_t> wait_ns_{0};
};

template <class B>
std::shared_ptr<ExpertJobShell> make_shell_for(WeightType wt, int threads, int64_t task_bytes,
                                               int64_t capacity, int64_t inter) {
  switch (wt) {
    case WeightType::kF32:
      return std::make_shared<ExpertJob<B, float>>(threads, task_bytes, capacity, inter);
    case WeightType::kF16:
      return std::make_shared<ExpertJob<B, f16>>(threads, task_bytes, capacity, inter);
    case WeightType::kBF16:
      return std::make_shared<ExpertJob<B, bf16>>(threads, task_bytes, capacity, inter);
    case WeightType::kE4M3:
      return std::make_shared<ExpertJob<B, e4m3>>(threads, task_bytes, capacity, inter);
    case WeightType::kMxfp4:
      return std::make_shared<ExpertJob<B, e2m1x2>>(threads, task_bytes, capacity, inter);
    case WeightType::kNvfp4:
      return std::make_shared<ExpertJob<B, nv_e2m1x2>>(threads, task_bytes, capacity, inter);
  }
  throw std::invalid_argument("unknown weight type");
}

// An expert job for up to `capacity` pairs of experts with `inter` intermediate rows, on this pool,
// with this SIMD level and weight type, its pairs not yet assigned.
std::shared_ptr<ExpertJobShell> make_shell(const Pool& pool, int simd, int weight_type,
                                           int64_t capacity, int64_t inter) {
  const auto wt = static_cast<WeightType>(weight_type);
  const int threads = pool.num_threads();
  const int64_t task_bytes = pool.task_bytes();
  switch (static_cast<Simd>(simd)) {
#ifdef MOELAB_HAVE_AVX512
    case Simd::kAvx512:
      return make_shell_for<Avx512>(wt, threads, task_bytes, capacity, inter);
#endif
#ifdef MOELAB_HAVE_AVX2
    case Simd::kAvx2:
      return make_shell_for<Avx2>(wt, threads, task_bytes, capacity, inter);
#endif
    case Simd::kScalar:
      return make_shell_for<Scalar>(wt, threads, task_bytes, capacity, inter);
    default:
      throw std::invalid_argument("this build has no such SIMD level");
  }
}

// Checks every pair's expert and token, groups the pairs by expert and makes the job (not queued).
std::shared_ptr<ExpertJobShell> make_job(const Pool& pool, int simd, int weight_type,
                                         const ExpertProblem& p, const int32_t* pe,
                                         const int32_t* pt, const float* pw, int64_t J) {
  for (int64_t j = 0; j < J; ++j) {
    if ((pe[j] >= 0 && pe[j] < p.E) && (pt[j] >= 0 && pt[j] < p.T)) continue;
    const std::string at = "[" + std::to_string(j) + "] = ";
    if (pe[j] < 0 || pe[j] >= p.E) {
      throw std::invalid_argument("pair_expert" + at + std::to_string(pe[j]) +
                                  " is outside 0.." + std::to_string(p.E - 1));
    }
    throw std::invalid_argument("pair_token" + at + std::to_string(pt[j]) + " is outside 0.." +
                                std::to_string(p.T - 1));
  }
  auto job = make_shell(pool, simd, weight_type, J, p.I);
  job->assign(p, pe, pt, pw, J);
  if (J == 0) std::fill(p.out, p.out + p.T * p.H, 0.0f);  // no pairs: a job with no tasks, done
  return job;
}

// Queues one call; the pair arrays are copied (grouped by expert) before this returns, the tensors
// behind x, out, w13 and w2 (and their block factors or scales: e4m3, MXFP4, NVFP4 with its
// per-tensor scales w13_tensor_scales and w2_tensor_scales; 0 for the other types) must stay
// alive and unchanged until the job is done (the weights until the pool is closed where
// weights_outlive_pool says they do: ExpertProblem). done_flag: 0, or the address of an int64
// that receives done_value once out is written.
std::shared_ptr<Job> submit_experts(Pool& pool, int simd, int weight_type, uintptr_t x,
                                    uintptr_t out, uintptr_t w13, uintptr_t w2, int64_t T,
                                    int64_t H, int64_t I, int64_t E, uintptr_t pair_expert,
                                    uintptr_t pair_token, uintptr_t pair_weight, int64_t J,
                                    uintptr_t done_flag, int64_t done_value, int64_t own_rounds,
                                    bool weights_outlive_pool, uintptr_t w13_factors,
                                    uintptr_t w2_factors, uintptr_t w13_bias, uintptr_t w2_bias,
                                    float swiglu_limit, uintptr_t w13_tensor_scales,
                                    uintptr_t w2_tensor_scales) {
  ExpertProblem p{reinterpret_cast<const float*>(x), reinterpret_cast<float*>(out),
                  reinterpret_cast<const void*>(w13), reinterpret_cast<const void*>(w2),
                  T, H, I, E};
  p.weights_outlive_pool = weights_outlive_pool;
  p.w13_factors = reinterpret_cast<const float*>(w13_factors);
  p.w2_factors = reinterpret_cast<const float*>(w2_factors);
  p.w13_bias = reinterpret_cast<const float*>(w13_bias);
  p.w2_bias = reinterpret_cast<const float*>(w2_bias);
  p.swiglu_limit = swiglu_limit;
  p.w13_scales = reinterpret_cast<const uint8_t*>(w13_factors);  // MXFP4's, where it is
  p.w2_scales = reinterpret_cast<const uint8_t*>(w2_factors);
  p.w13_tensor_scales = reinterpret_cast<const float*>(w13_tensor_scales);  // NVFP4's
  p.w2_tensor_scales = reinterpret_cast<const float*>(w2_tensor_scales);
  auto job = make_job(pool, simd, weight_type, p, reinterpret_cast<const int32_t*>(pair_expert),
                      reinterpret_cast<const int32_t*>(pair_token),
                      reinterpret_cast<const float*>(pair_weight), J);
  job->set_done_flag(reinterpret_cast<int64_t*>(done_flag), done_value);
  if (own_rounds > 0) job->own_gate_up(pool, own_rounds, false);
  if (J != 0) pool.push(job);
  return job;
}

}  // namespace
