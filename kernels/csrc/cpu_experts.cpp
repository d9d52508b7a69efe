// MoE experts on the CPU, straight from the host expert bank: bf16, fp16, fp32, FP8 (e4m3, with
// one fp32 factor per 128 x 128 block) or MXFP4 (e2m1, an E8M0 scale per 32 values: mxfp4.h)
// weights as stored.
//
// out[t] = sum over the pairs j of token t of weight_j * w2[e_j] @ (silu(gate[e_j] x[t]) *
// (up[e_j] x[t])). A persistent pool of std::threads runs each call as a job of independent tasks:
// phase 1 splits every expert's gate/up rows into blocks (a block computes h = silu(g) * u for all
// of that expert's tokens); phase 2 splits the output rows into blocks, each summing every expert's
// down projection for its rows only, so the reduction has no races and a fixed order (results do
// not depend on the thread count). Weights are streamed once per call (an expert with one token,
// as in decode at batch 1, one row after another, prefetched about 8 KiB ahead; one with several,
// in tiles of rows times tokens, prefetched a tile ahead), converted to fp32 in registers (bf16 by
// a 16-bit shift, fp16 by vcvtph2ps, e4m3 by vcvtph2ps of its bits moved into an fp16, then its
// block's factor: simd.h) and accumulated with fp32 FMAs; FP8, MXFP4 and NVFP4 rows of a job
// whose x are all bf16 values, one token an expert, are widened to bf16 instead and multiplied
// with vdpbf16ps where the build has AVX-512 BF16 (bf16dot.h). Workers never touch Python; the
// caller blocks only in Job::wait, without the GIL. The pool may keep each worker on a CPU of its
// own (engine/experts/cpu.py chooses them).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "decode_planner.h"
#include "expert_job.h"
#include "pool.h"
#include "simd.h"

namespace py = pybind11;

namespace {

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
  bool run_task(int64_t i) override {
    const float* p = data_ + i * kBlock;
    const int64_t n = std::min(kBlock, n_ - i * kBlock);
    typename B::V acc[4] = {B::zero(), B::zero(), B::zero(), B::zero()};
    int64_t k = 0;
    for (; k + 4 * B::W <= n; k += 4 * B::W) {
      for (int u = 0; u < 4; ++u) acc[u] = B::add(acc[u], B::load(p + k + u * B::W));
    }
    float s = B::sum(B::add(B::add(acc[0], acc[1]), B::add(acc[2], acc[3])));
    for (; k < n; ++k) s += p[k];
    if (!commit(i)) return false;
    sums_[i] = s;
    return true;
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

// -------------------------------------------------------------------------------------------------
// A gate: a job of one task that holds the worker taking it until the int64 at `gate` is not 0.

class GateJob final : public Job {
 public:
  GateJob(int64_t* gate, std::chrono::nanoseconds limit, bool redoable)
      : gate_(gate), limit_(limit) {
    set_num_tasks(1);
    set_redoable(redoable);
  }

 protected:
  // The run that began first waits at the gate; a run of it again (redoable: another worker
  // took it for stalled) passes.
  bool run_task(int64_t i) override {
    if (runs_.fetch_add(1, std::memory_order_relaxed) == 0) {
      const bool opened =
          spin_until([this] { return __atomic_load_n(gate_, __ATOMIC_ACQUIRE) != 0; }, limit_);
      if (!opened) __atomic_store_n(gate_, -1, __ATOMIC_RELEASE);
    }
    return commit(i);
  }

 private:
  int64_t* gate_;
  const std::chrono::nanoseconds limit_;
  std::atomic<int> runs_{0};
};

// Queues a gate on the pool: the jobs queued behind it start only once the caller writes a
// value other than 0 at `gate`, so that a test decides when they run instead of racing them.
// After limit_s the gate gives up and writes -1 there (what the test waited for never came).
// redoable: an idle worker may run the held task again (Pool::redo_us), which passes, so that
// the job ends while its first run is still held: a stalled task, made by the test.
std::shared_ptr<Job> submit_gate(Pool& pool, uintptr_t gate, double limit_s, bool redoable) {
  if (!(limit_s > 0)) throw std::invalid_argument("a gate needs a limit of more than 0 s");
  const auto limit = std::chrono::nanoseconds(int64_t(limit_s * 1e9));
  auto job = std::make_shared<GateJob>(reinterpret_cast<int64_t*>(gate), limit, redoable);
  pool.push(job);
  return job;
}

// `iterations` one-token jobs of k experts each, queued one after another on the pool as decode
// queues them, taking the bank's E experts in a scattered turn so that the weights come from
// memory: (seconds in all; the jobs' runs, their first phases and their waits for them
// (Job::phase_seconds), each summed over the jobs). With gap_us the caller spins that long
// before queueing each job (offloaded decode leaves the workers idle between two layers' jobs);
// with own_rounds each job's first rounds of gate/up blocks belong to the workers, and with
// fetch_own each worker is told of its blocks' weights when the gap begins (ExpertJobShell::
// own_gate_up). x: bf16 values with bf16_x (a bf16 model's activations, which take the bf16 dot
// products where the build has them: bf16dot.h), else values with more bits than bf16 holds.
// Also returns whether the jobs took the bf16 dot products. Blocks with the GIL released.
std::tuple<double, double, double, double, bool> time_expert_jobs(
    Pool& pool, int simd, int weight_type, uintptr_t w13, uintptr_t w2, uintptr_t w13_factors,
    uintptr_t w2_factors, int64_t E, int64_t H, int64_t I, int64_t k, int64_t iterations,
    double gap_us, int64_t own_rounds, bool fetch_own, uintptr_t w13_tensor_scales,
    uintptr_t w2_tensor_scales, bool bf16_x) {
  if (k < 1 || k > E || iterations < 1) {
    throw std::invalid_argument("need 1 <= k <= experts and at least one iteration");
  }
  if (gap_us < 0 || own_rounds < 0) {
    throw std::invalid_argument("gap_us and own_rounds must be 0 or more");
  }
  std::vector<float> x(H), out(H);
  for (int64_t i = 0; i < H; ++i) {
    const float v = 0.01f * float(1 + i % 7) * (i % 2 ? -1.0f : 1.0f);
    x[i] = bf16_x ? bits_to_float(uint32_t(round_bf16(v)) << 16) : v;
  }
  std::vector<int32_t> pair_expert(k), pair_token(k, 0);
  std::vector<float> pair_weight(k, 1.0f / float(k));
  ExpertProblem p{x.data(), out.data(), reinterpret_cast<const void*>(w13),
                  reinterpret_cast<const void*>(w2), 1, H, I, E};
  p.w13_factors = reinterpret_cast<const float*>(w13_factors);
  p.w2_factors = reinterpret_cast<const float*>(w2_factors);
  p.w13_scales = reinterpret_cast<const uint8_t*>(w13_factors);  // MXFP4's, where it is
  p.w2_scales = reinterpret_cast<const uint8_t*>(w2_factors);
  p.w13_tensor_scales = reinterpret_cast<const float*>(w13_tensor_scales);  // NVFP4's
  p.w2_tensor_scales = reinterpret_cast<const float*>(w2_tensor_scales);
  // a stride with no factor in common with E visits every expert before it comes back to one
  int64_t stride = 37;
  while (std::gcd(stride, E) != 1) ++stride;
  py::gil_scoped_release release;
  double run_s = 0.0, phase1_s = 0.0, wait_s = 0.0;
  bool bf16_dot = false;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    for (int64_t j = 0; j < k; ++j) pair_expert[j] = int32_t((it * k + j) * stride % E);
    auto job = make_job(pool, simd, weight_type, p, pair_expert.data(), pair_token.data(),
                        pair_weight.data(), k);
    if (own_rounds > 0) job->own_gate_up(pool, own_rounds, fetch_own);
    if (gap_us > 0) {
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::nanoseconds(int64_t(gap_us * 1e3));
      spin_until([&] { return std::chrono::steady_clock::now() >= until; });
    }
    pool.push(job);
    job->wait();
    run_s += job->seconds().second;
    const auto [phase1, waits] = job->phase_seconds();
    phase1_s += phase1;
    wait_s += waits;
    bf16_dot = job->bf16_dot();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {seconds, run_s, phase1_s, wait_s, bf16_dot};
}

// -------------------------------------------------------------------------------------------------
// FP8 widening as the expert jobs' loads do it, for tests: n e4m3 bytes at src (n a multiple of
// 16) to fp32 at dst, each times `factor`, with this SIMD level (the NaN bytes come out finite:
// the dot products look for them apart).

template <class B>
void widen_with(const e4m3* src, float* dst, int64_t n, float factor) {
  const typename B::V factor256 = B::set1(factor * 256.0f);
  for (int64_t i = 0; i + B::W <= n; i += B::W) {
    const typename B::V v = B::mul(B::load(src + i), factor256);
    std::memcpy(dst + i, &v, sizeof v);
  }
}

void widen_e4m3(int simd, uintptr_t src, uintptr_t dst, int64_t n, float factor) {
  if (n % 16 != 0) throw std::invalid_argument("widen_e4m3 takes a multiple of 16 bytes");
  const auto* in = reinterpret_cast<const e4m3*>(src);
  auto* out = reinterpret_cast<float*>(dst);
  switch (static_cast<Simd>(simd)) {
#ifdef MOELAB_HAVE_AVX512
    case Simd::kAvx512: return widen_with<Avx512>(in, out, n, factor);
#endif
#ifdef MOELAB_HAVE_AVX2
    case Simd::kAvx2: return widen_with<Avx2>(in, out, n, factor);
#endif
    case Simd::kScalar: return widen_with<Scalar>(in, out, n, factor);
    default: throw std::invalid_argument("this build has no such SIMD level");
  }
}

// MXFP4/NVFP4 widening as the expert jobs' loads do it, for tests: n bytes of e2m1 pairs at src
// (n a multiple of 32) to twice their 2n values, fp32, at dst, with this SIMD level, a block (16
// bytes) at a time or, with `by64`, two.

template <class B>
void widen_e2m1_with(const e2m1x2* src, float* dst, int64_t n, bool by64) {
  const int64_t step = by64 ? 32 : 16;
  for (int64_t i = 0; i < n; i += step) {
    typename B::V v[64 / B::W];
    if (by64) {
      Mx<B>::widen64(src + i, v);
    } else {
      Mx<B>::widen(src + i, v);
    }
    std::memcpy(dst + 2 * i, v, size_t(2 * step) * sizeof(float));
  }
}

void widen_e2m1(int simd, uintptr_t src, uintptr_t dst, int64_t n, bool by64) {
  if (n % 32 != 0) throw std::invalid_argument("widen_e2m1 takes a multiple of 32 bytes");
  const auto* in = reinterpret_cast<const e2m1x2*>(src);
  auto* out = reinterpret_cast<float*>(dst);
  switch (static_cast<Simd>(simd)) {
#ifdef MOELAB_HAVE_AVX512
    case Simd::kAvx512: return widen_e2m1_with<Avx512>(in, out, n, by64);
#endif
#ifdef MOELAB_HAVE_AVX2
    case Simd::kAvx2: return widen_e2m1_with<Avx2>(in, out, n, by64);
#endif
    case Simd::kScalar: return widen_e2m1_with<Scalar>(in, out, n, by64);
    default: throw std::invalid_argument("this build has no such SIMD level");
  }
}

// The bf16 dot products' widening (bf16dot.h), for tests: n bytes at src (n a multiple of 64) to
// the bf16 of their values, in value order, at dst (uint16). form 0: e4m3 bytes, 64 at a time;
// 1: e2m1 pairs (twice their values), 32 bytes at a time; 2: the same, 16 bytes at a time (a
// row's last 32 values); 3: the same, 64 bytes at a time (a row's whole 128 values). Without the
// bf16 dot products in this build: false, dst untouched.
bool widen_bf16(uintptr_t src, uintptr_t dst, int64_t n, int form) {
  if (n % 64 != 0) throw std::invalid_argument("widen_bf16 takes a multiple of 64 bytes");
  if (form < 0 || form > 3) throw std::invalid_argument("widen_bf16's form is 0, 1, 2 or 3");
#ifdef MOELAB_HAVE_BF16DOT
  const auto* in = reinterpret_cast<const uint8_t*>(src);
  auto* out = reinterpret_cast<uint16_t*>(dst);
  if (form == 0) {
    const E4m3Widen widen;
    for (int64_t i = 0; i < n; i += 64) {
      alignas(64) uint16_t slots[64];
      widen(reinterpret_cast<const e4m3*>(in + i), reinterpret_cast<__m512i*>(slots));
      for (int64_t v = 0; v < 64; ++v) out[i + v] = slots[bf16_slot<e4m3>(v, 64)];
    }
    return true;
  }
  const __m512i table = e2m1_bf16_table();
  const int64_t step = form == 3 ? 64 : form == 1 ? 32 : 16;  // bytes
  for (int64_t i = 0; i < n; i += step) {
    alignas(64) uint16_t slots[128];
    if (form == 3) {
      e2m1_widen128(in + i, table, reinterpret_cast<__m512i*>(slots));
    } else if (form == 1) {
      e2m1_widen64(in + i, table, reinterpret_cast<__m512i*>(slots));
    } else {
      _mm512_store_si512(slots, e2m1_widen32(in + i, table));
    }
    for (int64_t v = 0; v < 2 * step; ++v) {
      out[2 * i + v] = slots[bf16_slot<e2m1x2>(v, 2 * step)];
    }
  }
  return true;
#else
  (void)src;
  (void)dst;
  return false;
#endif
}

// x's K values (each a bf16 value) as the bf16 dot products read them (bf16dot.h's bf16_slots),
// for tests, on any CPU: fp32 at src to uint16 at dst, for rows of FP8 (fp8 true; K a multiple of
// 64) or of a 4-bit type (K a multiple of 32).
void bf16_slots_of(uintptr_t src, uintptr_t dst, int64_t K, bool fp8) {
  if (K < 0 || K % (fp8 ? 64 : 32) != 0) {
    throw std::invalid_argument("bf16_slots_of takes K a multiple of 64 (FP8) or 32 (4-bit)");
  }
  const auto* x = reinterpret_cast<const float*>(src);
  auto* out = reinterpret_cast<uint16_t*>(dst);
  if (fp8) return bf16_slots<e4m3>(x, K, out);
  bf16_slots<e2m1x2>(x, K, out);
}

// The bf16 dot products' half-scales of blocks of whole 128 values (bf16dot.h's block_halves),
// for tests: n scale bytes at src (E8M0 for MXFP4, e4m3 for NVFP4), 16 at a time and the last
// n % 16, to the fp32 half of each block's scale at dst. Without the bf16 dot products in this
// build: false, dst untouched.
bool block_halves_bf16(uintptr_t src, uintptr_t dst, int64_t n, bool nvfp4) {
#ifdef MOELAB_HAVE_BF16DOT
  const auto* in = reinterpret_cast<const uint8_t*>(src);
  auto* out = reinterpret_cast<float*>(dst);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, nvfp4 ? block_halves<true>(in + i, count, e4m3_halves())
                                 : block_halves<false>(in + i, count, e8m0_halves()));
    std::copy_n(lanes, count, out + i);
  }
  return true;
#else
  (void)src;
  (void)dst;
  (void)n;
  (void)nvfp4;
  return false;
#endif
}

bool bf16_dot_built() {
#ifdef MOELAB_HAVE_BF16DOT
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "MoE experts on the CPU from bf16/fp16/fp32/FP8/MXFP4 weights, on a thread pool";
  py::class_<Pool>(m, "Pool")
      .def(py::init<int, int, int64_t, std::vector<int>, int>(), py::arg("num_threads"),
           py::arg("spin_us") = kDefaultWorkerSpinUs, py::arg("task_bytes") = kDefaultTaskBytes,
           py::arg("cpus") = std::vector<int>{}, py::arg("redo_us") = kDefaultRedoUs)
      .def_property_readonly("num_threads", &Pool::num_threads)
      .def_property("redo_us", &Pool::redo_us, &Pool::set_redo_us)
      .def("worker_cpus", &Pool::worker_cpus)
      .def("hinted", &Pool::hinted)
      .def_property_readonly("task_bytes", &Pool::task_bytes)
      .def("close", &Pool::close, py::call_guard<py::gil_scoped_release>());
  py::class_<Job, std::shared_ptr<Job>>(m, "Job")
      .def("done", &Job::done)
      .def("unclaimed", &Job::unclaimed)
      .def("seconds", &Job::seconds)
      .def("worker_seconds", &Job::worker_seconds)
      .def("phase_seconds", &Job::phase_seconds)
      .def("bf16_dot", &Job::bf16_dot)
      .def("redone", &Job::redone)
      .def("redoable", &Job::redoable)
      .def("wait", &Job::wait, py::call_guard<py::gil_scoped_release>());
  m.def("submit_experts", &submit_experts);
  m.def("even_blocks", &block_bounds<EvenBlocks>);
  m.def("tapered_blocks", &block_bounds<TaperedBlocks>);
  py::class_<DecodePlanner>(m, "DecodePlanner")
      .def(py::init<Pool&, int, int, uintptr_t, uintptr_t, uintptr_t, int64_t, uintptr_t,
                    uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    const std::vector<ExpertTensorSpec>&, float>(),
           py::keep_alive<1, 2>())
      .def("set_device", &DecodePlanner::set_device)
      .def("set_launch", &DecodePlanner::set_launch)
      .def("set_copy_ahead", &DecodePlanner::set_copy_ahead)
      .def("set_frequency_admission", &DecodePlanner::set_frequency_admission)
      .def("set_cached_map", &DecodePlanner::set_cached_map)
      .def("guess_lead_seconds", &DecodePlanner::guess_lead_seconds)
      .def("set_clock", &DecodePlanner::set_clock)
      .def("step", &DecodePlanner::step);
  // the planner's slot order (slot_order.h), for tests: last-use and blocked arrays by address
  py::class_<SlotOrder>(m, "SlotOrder")
      .def(py::init<int64_t>())
      .def("rebuild",
           [](SlotOrder& o, uintptr_t last_use) {
             o.rebuild(reinterpret_cast<const int64_t*>(last_use));
           })
      .def("catch_up",
           [](SlotOrder& o, uintptr_t last_use, int64_t since) {
             o.catch_up(reinterpret_cast<const int64_t*>(last_use), since);
           })
      .def("use", &SlotOrder::use)
      .def("release", &SlotOrder::release)
      .def("first",
           [](const SlotOrder& o, uintptr_t blocked) {
             return o.first(reinterpret_cast<const int8_t*>(blocked));
           })
      .def("slots", &SlotOrder::slots);
  m.def("submit_gate", &submit_gate);
  m.def("read_sum", &read_sum);
  m.def("time_expert_jobs", &time_expert_jobs);
  m.def("simd_levels", &simd_levels);
  m.def("widen_e4m3", &widen_e4m3);
  m.def("widen_e2m1", &widen_e2m1);
  m.def("widen_bf16", &widen_bf16);
  m.def("block_halves_bf16", &block_halves_bf16);
  m.def("bf16_slots_of", &bf16_slots_of);
  m.def("bf16_dot_built", &bf16_dot_built);
}
