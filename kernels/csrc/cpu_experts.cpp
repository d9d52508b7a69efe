// MoE experts on the CPU, straight from the host expert bank: bf16, fp16 or fp32 weights as stored.
//
// out[t] = sum over the pairs j of token t of weight_j * w2[e_j] @ (silu(gate[e_j] x[t]) *
// (up[e_j] x[t])). A persistent pool of std::threads runs each call as a job of independent tasks:
// phase 1 splits every expert's gate/up rows into blocks (a block computes h = silu(g) * u for all
// of that expert's tokens); phase 2 splits the output rows into blocks, each summing every expert's
// down projection for its rows only, so the reduction has no races and a fixed order (results do
// not depend on the thread count). Weights are streamed once per call, prefetched a tile ahead,
// converted to fp32 in registers (bf16 by a 16-bit shift, fp16 by vcvtph2ps) and accumulated with
// fp32 FMAs. Workers never touch Python; the caller blocks only in Job::wait, without the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOELAB_X86 1
#endif

namespace py = pybind11;

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

inline void cpu_relax() {
#ifdef MOELAB_X86
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Waits for ready() without sleeping: short bursts of pause instructions between yields of the
// core, so that on an oversubscribed machine (CI, a busy desktop) the thread being waited for gets
// to run; gives up after `limit` (the caller then sleeps on a condition variable).
template <class Ready>
bool spin_until(Ready ready, std::chrono::nanoseconds limit = std::chrono::nanoseconds::max()) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    for (int i = 0; i < 32; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() - start > limit) return false;
    std::this_thread::yield();
  }
}

// How long workers spin for the next job before sleeping, by default: longer than the gap
// between two MoE layers of a decode step, so that a step's jobs never pay the wake-up of every
// worker. Spinning workers slow the thread that feeds the GPU where they share its core, so the
// engine makes it a flag (--moe-cpu-spin-us).
constexpr int kDefaultWorkerSpinUs = 1000;
// How long wait() spins before sleeping; the caller's core is not one the workers use.
constexpr std::chrono::microseconds kWaiterSpin{2000};

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

// A counter alone on its cache line, so that threads updating or spinning on it do not slow down
// those using its neighbours.
struct alignas(64) Counter {
  std::atomic<int64_t> value{0};
};

// -------------------------------------------------------------------------------------------------
// Jobs and the persistent pool.

class Job {
 public:
  virtual ~Job() = default;

  // Claims and runs tasks until none is left; returns when this job has nothing more to hand out.
  void work() {
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < num_tasks_;) {
      if (i == 0) started_ = Clock::now();
      run_task(i);
      if (finished_.fetch_add(1, std::memory_order_acq_rel) + 1 == num_tasks_) signal_done();
    }
  }
  bool done() const { return done_.load(std::memory_order_acquire); }

  void mark_queued() { queued_at_ = Clock::now(); }

  // Once done, also store `value` at `flag` (an int64 that a GPU kernel may be polling in pinned
  // memory): after every output write, so a reader that sees the value sees the output.
  void set_done_flag(int64_t* flag, int64_t value) {
    done_flag_ = flag;
    done_value_ = value;
    if (flag != nullptr && done()) __atomic_store_n(flag, value, __ATOMIC_RELEASE);
  }

  // Seconds from queueing to the first task being claimed (the workers' reaction time) and from
  // then to the last task finishing; both 0 until the job is done.
  std::pair<double, double> seconds() const {
    if (!done() || num_tasks_ == 0) return {0.0, 0.0};
    const std::chrono::duration<double> start = started_ - queued_at_;
    const std::chrono::duration<double> run = finished_at_ - started_;
    return {start.count(), run.count()};
  }

  void wait() {
    // The caller usually waits for well under a millisecond: spin a little before sleeping.
    if (spin_until([this] { return done(); }, kWaiterSpin)) return;
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return done(); });
  }

 protected:
  void set_num_tasks(int64_t n) {
    num_tasks_ = n;
    if (n == 0) done_.store(true, std::memory_order_release);
  }
  virtual void run_task(int64_t i) = 0;

 private:
  void signal_done() {
    finished_at_ = Clock::now();
    // the last task's acq_rel increment ordered every worker's output writes before this store
    if (done_flag_ != nullptr) __atomic_store_n(done_flag_, done_value_, __ATOMIC_RELEASE);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }

  using Clock = std::chrono::steady_clock;
  // Written before the job is queued, by the thread that claims task 0, and by the one that
  // finishes the last task; read only once done_ is set (release/acquire orders them).
  Clock::time_point queued_at_{}, started_{}, finished_at_{};
  // Each counter on a cache line of its own: every worker updates them, the caller spins on done_.
  int64_t num_tasks_ = 0;
  int64_t* done_flag_ = nullptr;  // set before the job is queued
  int64_t done_value_ = 0;
  alignas(64) std::atomic<int64_t> next_{0};
  alignas(64) std::atomic<int64_t> finished_{0};
  alignas(64) std::atomic<bool> done_{false};
  std::mutex mutex_;
  std::condition_variable cv_;
};

class Pool {
 public:
  explicit Pool(int num_threads, int spin_us = kDefaultWorkerSpinUs)
      : num_threads_(num_threads), spin_(spin_us) {
    if (num_threads < 1) throw std::invalid_argument("num_threads must be at least 1");
    if (spin_us < 0) throw std::invalid_argument("spin_us must be 0 or more");
    workers_.reserve(num_threads);
    for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }
  ~Pool() { close(); }

  int num_threads() const { return num_threads_; }

  void push(std::shared_ptr<Job> job) {
    if (job->done()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) throw std::runtime_error("this CpuExpertRunner is closed");
      job->mark_queued();
      queue_.push_back(std::move(job));
    }
    // announced after the unlock: spinning workers that see it find the mutex free, rather than
    // sleeping on it and costing this thread their wake-up
    queued_.fetch_add(1, std::memory_order_release);
    cv_.notify_all();
  }

  // Finishes the queued jobs, then ends the workers.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_ && workers_.empty()) return;
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

 private:
  std::shared_ptr<Job> next_job() {
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    // with a job announced, every spinning worker wants the mutex at once, each for a moment:
    // take turns spinning on it rather than sleeping in the kernel one after another
    if (spin_until([this] { return queued_.load(std::memory_order_acquire) > 0; }, spin_)) {
      spin_until([&lock] { return lock.try_lock(); }, kWaiterSpin);
    }
    if (!lock.owns_lock()) lock.lock();
    cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return nullptr;
    return queue_.front();
  }

  void worker_loop() {
    while (std::shared_ptr<Job> job = next_job()) {
      job->work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (!queue_.empty() && queue_.front() == job) {
        queue_.pop_front();
        queued_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  const int num_threads_;
  const std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::atomic<int64_t> queued_{0};
  bool stopping_ = false;
  std::mutex mutex_;
  std::condition_variable cv_;
};

// -------------------------------------------------------------------------------------------------
// The expert job.

struct ExpertProblem {
  const float* x;   // [T, H]
  float* out;       // [T, H]
  const void* w13;  // [E, 2I, H]
  const void* w2;   // [E, H, I]
  int64_t T, H, I, E;
  // One expert may be split with the GPU (the decode planner's split miss): for it, only the
  // intermediate rows from split_row on (gate/up rows, down projection columns) are computed here.
  int32_t split_expert = -1;
  int64_t split_row = 0;
};

// Tasks aim at this many weight bytes each: small enough to balance 16 threads over one expert,
// large enough that claiming a task costs nothing next to streaming it.
constexpr int64_t kTaskBytes = 96 * 1024;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

template <class B, class WT>
class ExpertJob final : public Job {
 public:
  ExpertJob(const ExpertProblem& p, std::vector<int32_t> group_expert,
            std::vector<int32_t> group_start, std::vector<int32_t> token,
            std::vector<float> weight, int num_threads)
      : p_(p),
        group_expert_(std::move(group_expert)),
        group_start_(std::move(group_start)),
        token_(std::move(token)),
        weight_(std::move(weight)),
        x_row_(token_.size()),
        h_(token_.size() * p.I),
        group_done_(new Counter[group_expert_.size()]) {
    const int64_t groups = int64_t(group_expert_.size());
    for (size_t k = 0; k < token_.size(); ++k) x_row_[k] = p.x + token_[k] * p.H;
    // Phase 1: blocks of gate/up row pairs, even so that tiles of two pairs fill them.
    const int64_t row_bytes = std::max<int64_t>(1, p.H * int64_t(sizeof(WT)));
    rows1_ = std::max<int64_t>(2, round_up(kTaskBytes / (2 * row_bytes), 2));
    blocks1_ = (p.I + rows1_ - 1) / rows1_;
    phase1_tasks_ = groups * blocks1_;
    // Phase 2: blocks of output rows, each over all experts; at least 4 blocks per thread.
    const int64_t down_bytes_per_row = std::max<int64_t>(1, groups * p.I * int64_t(sizeof(WT)));
    rows2_ = std::max<int64_t>(4, round_up(kTaskBytes / down_bytes_per_row, 4));
    rows2_ = std::min(rows2_, std::max<int64_t>(4, round_up(p.H / (4 * num_threads), 4)));
    const int64_t blocks2 = (p.H + rows2_ - 1) / rows2_;
    set_num_tasks(groups == 0 ? 0 : phase1_tasks_ + blocks2);
  }

 protected:
  // Tasks are handed out in order: phase 1 in group order, then phase 2; a task waits only for
  // tasks handed out before it, so the waits always end.
  void run_task(int64_t i) override {
    if (i < phase1_tasks_) {
      gate_up(i / blocks1_, (i % blocks1_) * rows1_);
      group_done_[i / blocks1_].value.fetch_add(1, std::memory_order_release);
      return;
    }
    down((i - phase1_tasks_) * rows2_);
  }

 private:
  // h[j, r0:r0+rows1] = silu(gate[r] . x[t_j]) * (up[r] . x[t_j]) for every pair j of group g.
  void gate_up(int64_t g, int64_t r0) {
    const int64_t H = p_.H, I = p_.I;
    const WT* gate = static_cast<const WT*>(p_.w13) + int64_t(group_expert_[g]) * 2 * I * H;
    const WT* up = gate + I * H;
    const int32_t j0 = group_start_[g], j1 = group_start_[g + 1];
    const int64_t r_end = std::min(I, r0 + rows1_);
    for (int64_t r = std::max(r0, first_row(g)); r < r_end;) {
      const int nr = r + 2 <= r_end ? 2 : 1;
      const WT* rows[4] = {gate + r * H, gate + (r + 1) * H, up + r * H, up + (r + 1) * H};
      if (nr == 1) rows[1] = up + r * H;
      // The next tile's rows, fetched while this one computes: a thread's demand misses alone
      // cannot keep enough reads in flight to reach its share of the memory bandwidth.
      const WT* next[4] = {rows[0] + 2 * H, rows[1] + 2 * H, rows[2] + 2 * H, rows[3] + 2 * H};
      const bool ahead = nr == 2 && r + 4 <= r_end;
      for (int32_t jt = j0; jt < j1; jt += kMaxTokensPerTile) {
        const int nt = std::min<int>(kMaxTokensPerTile, j1 - jt);
        const WT* const* pf = ahead && jt == j0 ? next : nullptr;
        float res[4 * kMaxTokensPerTile];
        if (nr == 2) {
          dot_tile_n<B, WT, 4>(rows, pf, x_row_.data() + jt, nt, H, res);
        } else {
          dot_tile_n<B, WT, 2>(rows, nullptr, x_row_.data() + jt, nt, H, res);
        }
        for (int a = 0; a < nr; ++a) {
          for (int q = 0; q < nt; ++q) {
            const float gv = res[a * nt + q], uv = res[(nr + a) * nt + q];
            h_[int64_t(jt + q) * I + r + a] = gv / (1.0f + std::exp(-gv)) * uv;
          }
        }
      }
      r += nr;
    }
  }

  // out[t, r0:r0+rows2] = sum over groups and pairs of weight_j * (w2[e] rows . h[j]).
  void down(int64_t r0) {
    const int64_t H = p_.H, I = p_.I;
    const int64_t r_end = std::min(H, r0 + rows2_);
    for (int64_t t = 0; t < p_.T; ++t) {
      std::fill(p_.out + t * H + r0, p_.out + t * H + r_end, 0.0f);
    }
    const int64_t groups = int64_t(group_expert_.size());
    auto down_rows = [&](int64_t g, int64_t r) {
      return static_cast<const WT*>(p_.w2) + (int64_t(group_expert_[g]) * H + r) * I;
    };
    for (int64_t g = 0; g < groups; ++g) {
      // Phase 1 hands out its blocks in group order, so this wait is short and mostly on the last.
      spin_until([&] { return group_done_[g].value.load(std::memory_order_acquire) == blocks1_; });
      const int32_t j0 = group_start_[g], j1 = group_start_[g + 1];
      const int64_t first = first_row(g), K = I - first;  // the down projection's columns here
      for (int64_t r = r0; r < r_end;) {
        const int nr = r + 4 <= r_end ? 4 : 1;
        const WT* rows[4] = {down_rows(g, r) + first};
        for (int a = 1; a < nr; ++a) rows[a] = rows[0] + a * I;
        // Prefetch the next tile: further down this expert, else the next expert's first rows.
        const WT* next[4] = {nullptr};
        if (r + 8 <= r_end) {
          next[0] = rows[0] + 4 * I;
        } else if (g + 1 < groups && r0 + 4 <= r_end) {
          next[0] = down_rows(g + 1, r0) + first_row(g + 1);
        }
        for (int a = 1; a < 4; ++a) next[a] = next[0] + a * I;
        for (int32_t jt = j0; jt < j1; jt += kMaxTokensPerTile) {
          const int nt = std::min<int>(kMaxTokensPerTile, j1 - jt);
          const float* hs[kMaxTokensPerTile];
          for (int q = 0; q < nt; ++q) hs[q] = h_.data() + int64_t(jt + q) * I + first;
          float res[4 * kMaxTokensPerTile];
          if (nr == 4) {
            dot_tile_n<B, WT, 4>(rows, next[0] != nullptr && jt == j0 ? next : nullptr, hs, nt, K,
                                 res);
          } else {
            dot_tile_n<B, WT, 1>(rows, nullptr, hs, nt, K, res);
          }
          for (int a = 0; a < nr; ++a) {
            for (int q = 0; q < nt; ++q) {
              p_.out[int64_t(token_[jt + q]) * H + r + a] += weight_[jt + q] * res[a * nt + q];
            }
          }
        }
        r += nr;
      }
    }
  }

  // The first intermediate row computed for group g (all but the split expert: 0).
  int64_t first_row(int64_t g) const {
    return group_expert_[g] == p_.split_expert ? p_.split_row : 0;
  }

  const ExpertProblem p_;
  const std::vector<int32_t> group_expert_;  // expert of each group
  const std::vector<int32_t> group_start_;   // pairs of group g: [group_start[g], group_start[g+1])
  const std::vector<int32_t> token_;         // per pair, sorted by expert
  const std::vector<float> weight_;          // per pair, sorted by expert
  std::vector<const float*> x_row_;          // per pair: its row of x
  std::vector<float> h_;                     // [pairs, I]
  int64_t phase1_tasks_ = 0, rows1_ = 0, blocks1_ = 0, rows2_ = 0;
  std::unique_ptr<Counter[]> group_done_;  // phase-1 blocks done, per group
};

template <class B>
std::shared_ptr<Job> make_expert_job(WeightType wt, const ExpertProblem& p,
                                     std::vector<int32_t> ge, std::vector<int32_t> gs,
                                     std::vector<int32_t> tok, std::vector<float> w, int threads) {
  switch (wt) {
    case WeightType::kF32:
      return std::make_shared<ExpertJob<B, float>>(p, ge, gs, tok, w, threads);
    case WeightType::kF16:
      return std::make_shared<ExpertJob<B, f16>>(p, ge, gs, tok, w, threads);
    case WeightType::kBF16:
      return std::make_shared<ExpertJob<B, bf16>>(p, ge, gs, tok, w, threads);
  }
  throw std::invalid_argument("unknown weight type");
}

// Checks every pair's expert and token, groups the pairs by expert and makes the job (not queued).
std::shared_ptr<Job> make_job(const Pool& pool, int simd, int weight_type, const ExpertProblem& p,
                              const int32_t* pe, const int32_t* pt, const float* pw, int64_t J) {
  for (int64_t j = 0; j < J; ++j) {
    const std::string at = "[" + std::to_string(j) + "] = ";
    if (pe[j] < 0 || pe[j] >= p.E) {
      throw std::invalid_argument("pair_expert" + at + std::to_string(pe[j]) +
                                  " is outside 0.." + std::to_string(p.E - 1));
    }
    if (pt[j] < 0 || pt[j] >= p.T) {
      throw std::invalid_argument("pair_token" + at + std::to_string(pt[j]) + " is outside 0.." +
                                  std::to_string(p.T - 1));
    }
  }
  std::vector<int32_t> order(J);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [pe](int32_t a, int32_t b) { return pe[a] < pe[b]; });
  std::vector<int32_t> group_expert, group_start, token(J);
  std::vector<float> weight(J);
  for (int64_t k = 0; k < J; ++k) {
    const int32_t j = order[k];
    if (k == 0 || pe[j] != group_expert.back()) {
      group_expert.push_back(pe[j]);
      group_start.push_back(int32_t(k));
    }
    token[k] = pt[j];
    weight[k] = pw[j];
  }
  group_start.push_back(int32_t(J));
  const auto wt = static_cast<WeightType>(weight_type);
  const int threads = pool.num_threads();
  std::shared_ptr<Job> job;
  switch (static_cast<Simd>(simd)) {
#ifdef MOELAB_HAVE_AVX512
    case Simd::kAvx512:
      job = make_expert_job<Avx512>(wt, p, group_expert, group_start, token, weight, threads);
      break;
#endif
#ifdef MOELAB_HAVE_AVX2
    case Simd::kAvx2:
      job = make_expert_job<Avx2>(wt, p, group_expert, group_start, token, weight, threads);
      break;
#endif
    case Simd::kScalar:
      job = make_expert_job<Scalar>(wt, p, group_expert, group_start, token, weight, threads);
      break;
    default:
      throw std::invalid_argument("this build has no such SIMD level");
  }
  if (J == 0) std::fill(p.out, p.out + p.T * p.H, 0.0f);  // no pairs: a job with no tasks, done
  return job;
}

// Queues one call; the pair arrays are copied (grouped by expert) before this returns, the tensors
// behind x, out, w13 and w2 must stay alive and unchanged until the job is done. done_flag: 0, or
// the address of an int64 that receives done_value once out is written.
std::shared_ptr<Job> submit_experts(Pool& pool, int simd, int weight_type, uintptr_t x,
                                    uintptr_t out, uintptr_t w13, uintptr_t w2, int64_t T,
                                    int64_t H, int64_t I, int64_t E, uintptr_t pair_expert,
                                    uintptr_t pair_token, uintptr_t pair_weight, int64_t J,
                                    uintptr_t done_flag, int64_t done_value) {
  const ExpertProblem p{reinterpret_cast<const float*>(x), reinterpret_cast<float*>(out),
                        reinterpret_cast<const void*>(w13), reinterpret_cast<const void*>(w2),
                        T, H, I, E};
  auto job = make_job(pool, simd, weight_type, p, reinterpret_cast<const int32_t*>(pair_expert),
                      reinterpret_cast<const int32_t*>(pair_token),
                      reinterpret_cast<const float*>(pair_weight), J);
  job->set_done_flag(reinterpret_cast<int64_t*>(done_flag), done_value);
  if (J != 0) pool.push(job);
  return job;
}

// -------------------------------------------------------------------------------------------------
// The decode planner: one offloaded decode layer step's host decisions without Python.
//
// The same decisions as MoERunner._plan (engine/moe.py) over ExpertCache (engine/cache.py), on the
// same numpy arrays, which this object only holds the addresses of: count the picks, look the
// routed experts up (hits become most recently used), fetch q of the m misses (fetch_count below;
// the most picked first; ties: more tokens now, then the lower id) into free or least recently
// used unprotected slots, run the rest on the CPU, write each route's slot (-1: on the CPU), and
// queue the CPU job. With the device's copy functions set (`set_device`), one call also waits for
// the routing (the stream's sync) and queues the routes' slots and the fills on that stream: the
// whole serial host path of an offloaded layer step, where Python took ~100 µs, and several times
// that when the CPU job before had just streamed the caches cold.

// The CUDA driver's functions, handed over as addresses (this module does not link CUDA).
using CuMemcpyHtoDAsync = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);
using CuStreamSynchronize = int (*)(void* stream);
using CuMemsetD8Async = int (*)(uint64_t dst, unsigned char value, size_t bytes, void* stream);

// How many of m misses to fetch: MissPolicy.fetch_count (engine/misses.py), in the same double
// arithmetic. Of the two whole numbers around m * f, the one whose later side (the copies, in
// proportion q * (1 - f); the CPU, (m - q) * f) ends sooner; a tie fetches.
inline int64_t fetch_count(int64_t m, double f) {
  const int64_t low =
      std::min<int64_t>(m, std::max<int64_t>(0, int64_t(std::floor(double(m) * f))));
  const int64_t high = std::min<int64_t>(m, low + 1);
  auto ends = [&](int64_t q) { return std::max(double(q) * (1.0 - f), double(m - q) * f); };
  return ends(high) <= ends(low) ? high : low;
}

// How to divide m misses with one of them split (MissPolicy.fetch_plan, engine/misses.py, in the
// same double arithmetic): q whole experts copied, and of one more the first j / chunks of its
// intermediate rows copied (its gate/up rows; its whole down projection is copied, a third of an
// expert) while the CPU runs its other rows and the remaining misses. The split replaces
// fetch_count's whole split only where it ends the step sooner. Returns {q, j}; j = 0: no split.
inline std::pair<int64_t, int64_t> fetch_plan(int64_t m, double f, int64_t chunks) {
  int64_t best_q = fetch_count(m, f), best_j = 0;
  if (chunks < 2) return {best_q, best_j};
  double best = std::max(double(best_q) * (1.0 - f), double(m - best_q) * f);
  for (int64_t q = 0; q < m; ++q) {
    for (int64_t j = 1; j < chunks; ++j) {
      const double u = double(j) / double(chunks);
      const double copied = double(q) + (1.0 + 2.0 * u) / 3.0;
      const double end = std::max(copied * (1.0 - f), (double(m - q) - u) * f);
      if (end < best) best = end, best_q = q, best_j = j;
    }
  }
  return {best_q, best_j};
}

class DecodePlanner {
 public:
  DecodePlanner(Pool& pool, int simd, int weight_type, uintptr_t slot_of, uintptr_t key_of_slot,
                uintptr_t last_use, int64_t slots, uintptr_t state, uintptr_t picks,
                int64_t layers, int64_t experts, int64_t top_k, int64_t hidden, int64_t inter,
                std::vector<uintptr_t> w13, std::vector<uintptr_t> w2)
      : pool_(pool),
        simd_(simd),
        weight_type_(weight_type),
        slot_of_(reinterpret_cast<int32_t*>(slot_of)),
        key_of_slot_(reinterpret_cast<int64_t*>(key_of_slot)),
        last_use_(reinterpret_cast<int64_t*>(last_use)),
        slots_(slots),
        state_(reinterpret_cast<int64_t*>(state)),
        picks_(reinterpret_cast<int64_t*>(picks)),
        layers_(layers),
        experts_(experts),
        top_k_(top_k),
        hidden_(hidden),
        inter_(inter),
        w13_(std::move(w13)),
        w2_(std::move(w2)),
        tokens_(experts, 0),
        where_(experts, kNotRouted),
        protected_(slots, 0) {
    if (int64_t(w13_.size()) != layers || int64_t(w2_.size()) != layers) {
      throw std::invalid_argument("one w13 and one w2 address per layer are needed");
    }
  }

  // The driver's cuMemcpyHtoDAsync, cuStreamSynchronize and cuMemsetD8Async, the stream, and the
  // cache's slot arrays on the device ([slots, 2I, H] and [slots, H, I], the bank's element type).
  void set_device(uintptr_t copy, uintptr_t sync, uintptr_t memset, uintptr_t stream,
                  uintptr_t cache_w13, uintptr_t cache_w2, int64_t element_size) {
    copy_ = reinterpret_cast<CuMemcpyHtoDAsync>(copy);
    sync_ = reinterpret_cast<CuStreamSynchronize>(sync);
    memset_ = reinterpret_cast<CuMemsetD8Async>(memset);
    stream_ = reinterpret_cast<void*>(stream);
    cache_w13_ = cache_w13;
    cache_w2_ = cache_w2;
    bytes13_ = 2 * inter_ * hidden_ * element_size;
    bytes2_ = hidden_ * inter_ * element_size;
  }

  // Plans layer `layer` for routes ids/weights [T, top_k] (int32, fp32) of rows x [T, H] (fp32);
  // writes route_slots [T, top_k]. CPU routes' weighted sum goes to out [T, H] (fp32), then
  // done_value to done_flag if that is not 0. With the device set: first waits for the stream
  // (sync, without the GIL), and after starting the CPU job queues the copy of route_slots to
  // route_slots_device and the fills. split_chunks >= 2 (with route_slots_device only): one miss
  // may be split, its first rows in chunks of I / split_chunks copied into the least recently used
  // slot, which is freed again (its content is no expert), and the rest run on the CPU
  // (fetch_plan). Returns (experts ascending, their slots before the step, admitted (expert, slot)
  // pairs, experts run on the CPU (the split one first), the split (expert, slot, first CPU row)
  // or None, the CPU job or None, and the seconds spent waiting, planning and queueing copies).
  py::tuple step(int64_t layer, uintptr_t ids_addr, uintptr_t weights_addr, uintptr_t x,
                 int64_t T, double fetch_fraction, uintptr_t route_slots_addr, uintptr_t out,
                 uintptr_t done_flag, int64_t done_value, bool sync,
                 uintptr_t route_slots_device, int64_t split_chunks) {
    using Clock = std::chrono::steady_clock;
    if (layer < 0 || layer >= layers_) throw std::invalid_argument("no such MoE layer");
    if ((sync || route_slots_device) && copy_ == nullptr) {
      throw std::invalid_argument("sync and device copies need set_device first");
    }
    if (split_chunks >= 2 &&
        (!route_slots_device || memset_ == nullptr || inter_ % split_chunks != 0)) {
      throw std::invalid_argument("a split needs the device copies, a memset and chunks of I");
    }
    const auto t0 = Clock::now();
    if (sync) {
      int err;
      {
        py::gil_scoped_release release;
        err = sync_(stream_);
      }
      check_driver(err, "cuStreamSynchronize");
    }
    const auto t1 = Clock::now();
    const auto* ids = reinterpret_cast<const int32_t*>(ids_addr);
    const auto* weights = reinterpret_cast<const float*>(weights_addr);
    auto* route_slots = reinterpret_cast<int32_t*>(route_slots_addr);
    const int64_t R = T * top_k_;
    for (int64_t r = 0; r < R; ++r) {
      if (ids[r] < 0 || ids[r] >= experts_) {
        throw std::invalid_argument("routed expert " + std::to_string(ids[r]) +
                                    " is outside 0.." + std::to_string(experts_ - 1));
      }
    }
    int64_t* picks = picks_ + layer * experts_;
    int32_t* slot_of = slot_of_ + layer * experts_;
    std::vector<int32_t> routed;  // the layer's experts, ascending
    for (int64_t r = 0; r < R; ++r) {
      const int32_t e = ids[r];
      picks[e] += 1;
      if (tokens_[e]++ == 0) routed.push_back(e);
    }
    std::sort(routed.begin(), routed.end());
    std::vector<int32_t> before(routed.size()), missing;
    for (size_t i = 0; i < routed.size(); ++i) {
      const int32_t e = routed[i], slot = slot_of[e];
      before[i] = slot;
      if (slot >= 0) {
        last_use_[slot] = ++state_[kTick];
        ++state_[kHits];
        protected_[slot] = 1;
      } else {
        missing.push_back(e);
      }
    }
    const int64_t m = int64_t(missing.size());
    const auto [q, split_j] = fetch_plan(m, fetch_fraction, split_chunks);
    if (q < m) {
      std::stable_sort(missing.begin(), missing.end(), [&](int32_t a, int32_t b) {
        if (picks[a] != picks[b]) return picks[a] > picks[b];
        if (tokens_[a] != tokens_[b]) return tokens_[a] > tokens_[b];
        return a < b;
      });
    }
    std::vector<std::pair<int32_t, int64_t>> admitted;  // (expert, slot)
    std::vector<int32_t> on_cpu(missing.begin() + q, missing.end());
    for (int64_t i = 0; i < q; ++i) {
      const int32_t e = missing[i];
      const int64_t slot = victim();
      if (slot < 0) {  // every slot is in use by this step: the rest go to the CPU
        on_cpu.insert(on_cpu.end(), missing.begin() + i, missing.begin() + q);
        break;
      }
      const int64_t old = key_of_slot_[slot];
      if (old >= 0) {
        slot_of_[old] = -1;
        ++state_[kEvictions];
      }
      key_of_slot_[slot] = layer * experts_ + e;
      last_use_[slot] = ++state_[kTick];
      slot_of[e] = int32_t(slot);
      ++state_[kFills];
      protected_[slot] = 1;
      admitted.emplace_back(e, slot);
    }
    // the split miss (the next in line after the whole ones) borrows the least recently used slot
    // for this step; it stays free after, its old expert evicted
    int32_t split_expert = -1;
    int64_t split_slot = -1, split_row = 0;
    if (split_j > 0 && int64_t(admitted.size()) == q) {
      split_slot = victim();
      if (split_slot >= 0) {
        split_expert = missing[q];
        split_row = split_j * (inter_ / split_chunks);
        const int64_t old = key_of_slot_[split_slot];
        if (old >= 0) {
          slot_of_[old] = -1;
          ++state_[kEvictions];
        }
        key_of_slot_[split_slot] = -1;
        last_use_[split_slot] = -1;
        protected_[split_slot] = 1;
      }
    }
    for (int32_t e : on_cpu) where_[e] = kOnCpu;
    if (split_expert >= 0) where_[split_expert] = kSplit;
    std::vector<int32_t> pair_expert, pair_token;
    std::vector<float> pair_weight;
    for (int64_t r = 0; r < R; ++r) {
      const int32_t e = ids[r];
      if (where_[e] != kNotRouted) {  // on the CPU, or split: its other rows on the CPU
        route_slots[r] = where_[e] == kSplit ? int32_t(split_slot) : -1;
        pair_expert.push_back(e);
        pair_token.push_back(int32_t(r / top_k_));
        pair_weight.push_back(weights[r]);
      } else {
        route_slots[r] = slot_of[e];
      }
    }
    // back to the idle marks for the next step (a slot is protected only during its step)
    for (int32_t e : routed) {
      tokens_[e] = 0;
      where_[e] = kNotRouted;
      if (slot_of[e] >= 0) protected_[slot_of[e]] = 0;
    }
    if (split_slot >= 0) protected_[split_slot] = 0;
    py::object job = py::none();
    if (!on_cpu.empty()) {
      const ExpertProblem p{reinterpret_cast<const float*>(x), reinterpret_cast<float*>(out),
                            reinterpret_cast<const void*>(w13_[layer]),
                            reinterpret_cast<const void*>(w2_[layer]),
                            T, hidden_, inter_, experts_, split_expert, split_row};
      auto j = make_job(pool_, simd_, weight_type_, p, pair_expert.data(), pair_token.data(),
                        pair_weight.data(), int64_t(pair_expert.size()));
      j->set_done_flag(reinterpret_cast<int64_t*>(done_flag), done_value);
      pool_.push(j);
      job = py::cast(j);
    }
    const auto t2 = Clock::now();
    if (route_slots_device) {
      int err = copy_(route_slots_device, route_slots, R * sizeof(int32_t), stream_);
      for (size_t i = 0; i < admitted.size() && err == 0; ++i) {
        const auto [e, slot] = admitted[i];
        const auto* bank13 = reinterpret_cast<const char*>(w13_[layer]) + e * bytes13_;
        const auto* bank2 = reinterpret_cast<const char*>(w2_[layer]) + e * bytes2_;
        err = copy_(cache_w13_ + slot * bytes13_, bank13, bytes13_, stream_);
        if (err == 0) err = copy_(cache_w2_ + slot * bytes2_, bank2, bytes2_, stream_);
      }
      const char* failed = "cuMemcpyHtoDAsync";
      if (split_expert >= 0 && err == 0) {
        err = copy_split(layer, split_expert, split_slot, split_row, &failed);
      }
      if (err != 0) {
        // the admitted slots may never be filled: free them, so no later step reads them
        for (const auto& [e, slot] : admitted) {
          slot_of[e] = -1;
          key_of_slot_[slot] = -1;
          last_use_[slot] = -1;
        }
        check_driver(err, failed);
      }
    }
    const auto t3 = Clock::now();
    const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    py::object split = py::none();
    if (split_expert >= 0) split = py::make_tuple(split_expert, split_slot, split_row);
    return py::make_tuple(routed, before, admitted, on_cpu, split, job,
                          py::make_tuple(seconds(t1 - t0), seconds(t2 - t1), seconds(t3 - t2)));
  }

 private:
  static constexpr int64_t kTick = 0, kHits = 1, kFills = 2, kEvictions = 3;  // cache.py's state
  static constexpr int8_t kNotRouted = 0, kOnCpu = 1, kSplit = 2;

  // The device's part of a split expert into `slot`: its gate and up rows below `row`, all of its
  // down projection, and zero gate and up rows from `row` on (silu(0) * 0 = 0: those rows add
  // nothing; both are zeroed, as a slot never filled may hold NaNs). Returns the first driver
  // error (naming its call in `failed`), or 0.
  int copy_split(int64_t layer, int32_t e, int64_t slot, int64_t row, const char** failed) {
    const int64_t elem = bytes2_ / (hidden_ * inter_), half = inter_ * hidden_ * elem;
    const auto* bank13 = reinterpret_cast<const char*>(w13_[layer]) + e * bytes13_;
    const auto* bank2 = reinterpret_cast<const char*>(w2_[layer]) + e * bytes2_;
    const uint64_t gate = cache_w13_ + slot * bytes13_, up = gate + half;
    const int64_t head = row * hidden_ * elem;
    int err = copy_(gate, bank13, head, stream_);
    if (err == 0) err = copy_(up, bank13 + half, head, stream_);
    for (const uint64_t rows : {gate, up}) {
      if (err == 0) {
        err = memset_(rows + head, 0, half - head, stream_);
        if (err != 0) *failed = "cuMemsetD8Async";
      }
    }
    if (err == 0) err = copy_(cache_w2_ + slot * bytes2_, bank2, bytes2_, stream_);
    return err;
  }

  static void check_driver(int err, const char* what) {
    if (err != 0) {
      throw std::runtime_error(std::string(what) + " failed with CUDA driver error " +
                               std::to_string(err));
    }
  }

  // A free slot (last use -1), else the least recently used unprotected one; the lowest index on
  // ties; -1 when every slot is protected.
  int64_t victim() const {
    int64_t best = -1;
    for (int64_t s = 0; s < slots_; ++s) {
      if (!protected_[s] && (best < 0 || last_use_[s] < last_use_[best])) best = s;
    }
    return best;
  }

  Pool& pool_;
  const int simd_, weight_type_;
  int32_t* const slot_of_;       // [layers, experts]
  int64_t* const key_of_slot_;   // [slots]
  int64_t* const last_use_;      // [slots]
  const int64_t slots_;
  int64_t* const state_;         // tick, hits, fills, evictions
  int64_t* const picks_;         // [layers, experts]
  const int64_t layers_, experts_, top_k_, hidden_, inter_;
  const std::vector<uintptr_t> w13_, w2_;  // per layer: [experts, 2I, H], [experts, H, I]
  CuMemcpyHtoDAsync copy_ = nullptr;
  CuStreamSynchronize sync_ = nullptr;
  CuMemsetD8Async memset_ = nullptr;
  void* stream_ = nullptr;
  uint64_t cache_w13_ = 0, cache_w2_ = 0;
  int64_t bytes13_ = 0, bytes2_ = 0;
  // scratch, all zero between steps
  std::vector<int32_t> tokens_;   // per expert: routes to it this step
  std::vector<int8_t> where_;     // per expert: kOnCpu this step
  std::vector<int8_t> protected_; // per slot: read by this step
};

// -------------------------------------------------------------------------------------------------
// The host read rate: sum a buffer in blocks over the same pool.

template <class B>
class ReadJob final : public Job {
 public:
  ReadJob(const float* data, int64_t n) : data_(data), n_(n), sums_((n + kBlock - 1) / kBlock) {
    set_num_tasks(int64_t(sums_.size()));
  }
  double total() const { return std::accumulate(sums_.begin(), sums_.end(), 0.0); }

 protected:
  void run_task(int64_t i) override {
    const float* p = data_ + i * kBlock;
    const int64_t n = std::min(kBlock, n_ - i * kBlock);
    typename B::V acc[4] = {B::zero(), B::zero(), B::zero(), B::zero()};
    int64_t k = 0;
    for (; k + 4 * B::W <= n; k += 4 * B::W) {
      for (int u = 0; u < 4; ++u) acc[u] = B::add(acc[u], B::load(p + k + u * B::W));
    }
    float s = B::sum(B::add(B::add(acc[0], acc[1]), B::add(acc[2], acc[3])));
    for (; k < n; ++k) s += p[k];
    sums_[i] = s;
  }

 private:
  static constexpr int64_t kBlock = 256 * 1024;  // floats: 1 MiB per task
  const float* data_;
  const int64_t n_;
  std::vector<double> sums_;
};

// Sums n floats at data with every worker of the pool; returns the sum (so nothing is optimized
// away). Blocks with the GIL released.
double read_sum(Pool& pool, uintptr_t data, int64_t n) {
  const auto* p = reinterpret_cast<const float*>(data);
#if defined(MOELAB_HAVE_AVX512)
  auto job = std::make_shared<ReadJob<Avx512>>(p, n);
#elif defined(MOELAB_HAVE_AVX2)
  auto job = std::make_shared<ReadJob<Avx2>>(p, n);
#else
  auto job = std::make_shared<ReadJob<Scalar>>(p, n);
#endif
  {
    py::gil_scoped_release release;
    pool.push(job);
    job->wait();
  }
  return job->total();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "MoE experts on the CPU from bf16/fp16/fp32 weights, on a persistent thread pool";
  py::class_<Pool>(m, "Pool")
      .def(py::init<int, int>(), py::arg("num_threads"), py::arg("spin_us") = kDefaultWorkerSpinUs)
      .def_property_readonly("num_threads", &Pool::num_threads)
      .def("close", &Pool::close, py::call_guard<py::gil_scoped_release>());
  py::class_<Job, std::shared_ptr<Job>>(m, "Job")
      .def("done", &Job::done)
      .def("seconds", &Job::seconds)
      .def("wait", &Job::wait, py::call_guard<py::gil_scoped_release>());
  m.def("submit_experts", &submit_experts);
  py::class_<DecodePlanner>(m, "DecodePlanner")
      .def(py::init<Pool&, int, int, uintptr_t, uintptr_t, uintptr_t, int64_t, uintptr_t,
                    uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    std::vector<uintptr_t>, std::vector<uintptr_t>>(),
           py::keep_alive<1, 2>())
      .def("set_device", &DecodePlanner::set_device)
      .def("step", &DecodePlanner::step);
  m.def("read_sum", &read_sum);
  m.def("simd_levels", &simd_levels);
}
