// The decode planner: one offloaded decode layer step's host decisions without Python.
// Included by cpu_experts.cpp only (one translation unit): internal linkage, like the rest.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "expert_job.h"
#include "pool.h"
#include "slot_order.h"

namespace py = pybind11;

namespace {

// The same decisions as plan_layer (engine/experts/miss_plan.py) over ExpertCache (engine/experts/cache.py), on the
// same numpy arrays, which this object only holds the addresses of: count the picks, look the
// routed experts up (hits become most recently used), fetch q of the m misses (fetch_count below;
// the most picked first; ties: more tokens now, then the lower id) into free or least recently
// used unprotected slots, run the rest on the CPU, write each route's slot (-1: on the CPU), and
// queue the CPU job. With the device's copy functions set (`set_device`), one call also waits for
// the routing (polling the compute stream, and meanwhile pulling this planner's state for the
// layer back into the CPU's caches, which the CPU job before streamed cold) and queues the fills
// on the fill stream, marking the routes they serve (-2 - slot) so that the device runs the
// cached experts' routes during them: the whole serial host path of an offloaded layer step,
// which in Python costs several times as much, most when the CPU job before has just streamed
// the caches cold (docs/cpu-experts.md). An expert is the tensors the bank holds it as
// (`ExpertTensor`: bf16 weights, FP8 values and their block factors, MXFP4 blocks and their
// scales or NVFP4 values, their scales and per-tensor scales, and gpt-oss's biases), each copied
// alike.

// The CUDA driver's functions, handed over as addresses (this module does not link CUDA).
using CuMemcpyHtoDAsync = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);
using CuStreamQuery = int (*)(void* stream);
// cuStreamQuery's answer while the stream still has work queued (CUDA_ERROR_NOT_READY)
constexpr int kStreamNotReady = 600;
// While it polls a routing signal, the wait asks the stream every this many polls whether it has
// failed, or ended without setting the signal (each poll warms the layer's state, a fraction of a
// microsecond; a query costs several polls).
constexpr int64_t kPollsPerQuery = 128;
// wait_signal's answer when the stream went idle with the signal still clear (no driver code)
constexpr int kNoSignal = -1;
// CUDA_MEMCPY2D, as cuda.h lays it out (memory types: 1 host, 2 device)
struct Memcpy2D {
  size_t src_x_bytes = 0, src_y = 0;
  int src_memory_type = 0;
  const void* src_host = nullptr;
  uint64_t src_device = 0;
  void* src_array = nullptr;
  size_t src_pitch = 0;
  size_t dst_x_bytes = 0, dst_y = 0;
  int dst_memory_type = 0;
  void* dst_host = nullptr;
  uint64_t dst_device = 0;
  void* dst_array = nullptr;
  size_t dst_pitch = 0;
  size_t width_bytes = 0, height = 0;
};
using CuMemcpy2DAsync = int (*)(const Memcpy2D* copy, void* stream);
using CuMemsetD2D8Async = int (*)(uint64_t dst, size_t pitch, unsigned char value, size_t width,
                                  size_t height, void* stream);
// cuGraphLaunch, cuEventRecord and cuStreamWaitEvent: the next piece's launches (`set_launch`)
using CuGraphLaunch = int (*)(void* exec, void* stream);
using CuEventRecord = int (*)(void* event, void* stream);
using CuStreamWaitEvent = int (*)(void* stream, void* event, unsigned flags);

// The fixed parts of the two sides of a layer step's misses, in the unit of `sides` (one
// expert's copy time plus its CPU time; misses.py's COPY_FIXED, CPU_FIXED and SPLIT_FIXED).
constexpr double kCopyFixed = 0.15, kCpuFixed = 0.09, kSplitFixed = 0.1;

// The two sides of a layer step's misses, in proportion to their time at copy share f: the copies
// of q whole experts and, split at u > 0, u of one more (u of each of its matrices),
// (q + u) * (1 - f); the CPU's experts, on_cpu * f (a split expert counts 1 - u of one). Each side
// that has work adds its fixed part, and a split the copies' extra part. lead: the share of the
// rows of the device's first miss whose gate and up were copied ahead of the routing
// (`DecodePlanner::copy_ahead`): the copies no longer take those bytes, kAheadShare of theirs.
constexpr double kAheadShare = 2.0 / 3.0;  // misses.py's AHEAD_SHARE: gate and up of a row
struct Sides {
  double copies, cpu;
  double end() const { return std::max(copies, cpu); }
};
inline Sides sides(double q, double u, double on_cpu, double f, double lead = 0.0) {
  double copies = std::max(0.0, q + u - lead * kAheadShare) * (1.0 - f), cpu = on_cpu * f;
  if (q + u > 0) copies += kCopyFixed + (u > 0 ? kSplitFixed : 0.0);
  if (on_cpu > 0) cpu += kCpuFixed;
  return {copies, cpu};
}

// How many of m misses to fetch: MissPolicy.fetch_count (engine/experts/misses.py), in the same double
// arithmetic. Of the two whole numbers around m * f, the one whose later side ends sooner; a tie
// fetches.
inline int64_t fetch_count(int64_t m, double f) {
  const int64_t low =
      std::min<int64_t>(m, std::max<int64_t>(0, int64_t(std::floor(double(m) * f))));
  const int64_t high = std::min<int64_t>(m, low + 1);
  auto ends = [&](int64_t q) { return sides(double(q), 0.0, double(m - q), f).end(); };
  return ends(high) <= ends(low) ? high : low;
}

// How to divide m misses with one of them split (MissPolicy.fetch_plan, engine/experts/misses.py, in the
// same double arithmetic): q whole experts copied, and of one more the first j / chunks of its
// intermediate rows copied (those gate and up rows and those columns of its down projection)
// while the CPU runs its other rows and the remaining misses. The split replaces
// fetch_count's whole split only where it ends the step sooner. Returns {q, j}; j = 0: no split.
inline std::pair<int64_t, int64_t> fetch_plan(int64_t m, double f, int64_t chunks) {
  int64_t best_q = fetch_count(m, f), best_j = 0;
  if (chunks < 2) return {best_q, best_j};
  double best = sides(double(best_q), 0.0, double(m - best_q), f).end();
  for (int64_t q = 0; q < m; ++q) {
    for (int64_t j = 1; j < chunks; ++j) {
      const double u = double(j) / double(chunks);
      const double end = sides(double(q), u, double(m - q) - u, f).end();
      if (end < best) best = end, best_q = q, best_j = j;
    }
  }
  return {best_q, best_j};
}

// The division of m misses that takes a lead (MissPolicy.lead_plan, in the same double
// arithmetic): the gate and up of the share `lead` of the device's first miss's rows were copied
// ahead of the routing, so the device takes at least those rows (q >= 1, or a split at
// j / chunks >= lead), their copied bytes counted as copied. Of those divisions the one that
// ends soonest (whole ones first, then splits, fewer copies first: the first of equal ends),
// where it ends no later than fetch_plan's; else {-1, 0} (the copy ahead is left unused). Needs
// m > 0, chunks >= 2 and lead > 0.
inline std::pair<int64_t, int64_t> lead_plan(int64_t m, double f, int64_t chunks, double lead) {
  double best = std::numeric_limits<double>::infinity();
  int64_t best_q = 0, best_j = 0;
  for (int64_t q = 1; q <= m; ++q) {
    const double end = sides(double(q), 0.0, double(m - q), f, lead).end();
    if (end < best) best = end, best_q = q;
  }
  for (int64_t q = 0; q < m; ++q) {
    for (int64_t j = 1; j < chunks; ++j) {
      const double u = double(j) / double(chunks);
      if (q == 0 && u < lead) continue;
      const double end = sides(double(q), u, double(m - q) - u, f, lead).end();
      if (end < best) best = end, best_q = q, best_j = j;
    }
  }
  const auto [q0, j0] = fetch_plan(m, f, chunks);
  const double u0 = double(j0) / double(chunks);
  if (sides(double(q0), u0, double(m - q0) - u0, f).end() < best) return {-1, 0};
  return {best_q, best_j};
}

// A step's division of its m misses: fetch_plan's, or lead_plan's where the gate and up of
// lead_rows of the device's first miss's inter rows were copied ahead (lead_rows > 0, chunks >=
// 2) and that division takes them. {q, j, whether it takes the rows copied ahead}.
struct MissPlan {
  int64_t q, j;
  bool lead;
};
inline MissPlan plan_misses(int64_t m, double f, int64_t chunks, int64_t lead_rows,
                            int64_t inter) {
  if (lead_rows > 0 && m > 0 && chunks >= 2) {
    const auto [q, j] = lead_plan(m, f, chunks, double(lead_rows) / double(inter));
    if (q >= 0) return {q, j, true};
  }
  const auto [q, j] = fetch_plan(m, f, chunks);
  return {q, j, false};
}

// What each of an expert's tensors is to the CPU job: its weights (w13, w2), their block factors
// or scales (FP8: fp32 factors; MXFP4: E8M0 scales; NVFP4: e4m3 scales), NVFP4's per-tensor
// scales (fp32: w13's gate and up ones, w2's one), or gpt-oss's biases. An expert's tensors come
// in this order.
enum class TensorRole : int { kWeights = 0, kScales = 1, kTensorScales = 2, kBias = 3 };

// One of the tensors an expert is held as (ExpertBank.layer_tensors: w13, w2, an FP8 bank's
// block factors or an MXFP4 or NVFP4 bank's scales, NVFP4's per-tensor scales, gpt-oss's biases),
// as the planner copies it into cache slots: per layer the address of the bank's [experts, rows,
// ...] (host), and of the cache's [slots, rows, ...] (device, `set_device`). Its rows follow the
// intermediate rows one of four ways: `gate_up`, its rows are w13's gate rows then its up rows,
// one for every `block` of them (FP8 factors: 128); else, weights and scales, each of its rows
// holds I / block entries along w2's columns (MXFP4: an entry is a 32-column group's 16 bytes of
// blocks, or its scale; NVFP4: a 16-column group's 8 bytes of values, or its scale); else, the
// down projection's bias, it has no intermediate rows; else, NVFP4's per-tensor scales, whole
// (`whole`: each scales every row of its projection, so a split copies them whole). A split or a
// copy ahead cuts each at whole entries; a split miss's down bias is the CPU's, its slot's zeroed.
struct ExpertTensor {
  std::vector<uintptr_t> bank;
  bool gate_up;
  int64_t block, rows, row_bytes;  // intermediate rows an entry covers; one expert's rows
  TensorRole role;
  uint64_t cache = 0;
  int64_t bytes() const { return rows * row_bytes; }
  bool down_bias() const { return role == TensorRole::kBias && !gate_up; }
  bool whole() const { return role == TensorRole::kTensorScales; }
};
// What Python hands over for each: (bank addresses per layer, gate_up (w13's: for the
// per-tensor scales, which have no rows of gate and up, the first of the two), block, rows,
// row_bytes, role).
using ExpertTensorSpec =
    std::tuple<std::vector<uintptr_t>, bool, int64_t, int64_t, int64_t, int>;

// A guess of the routing a step waits for (DecodePlanner::step's guess): the layer router's
// logits [T, experts] and their signal, stored by the piece before the routing; the step's x and
// tokens, the copies' share and split chunks it plans with, and the rounds of gate/up blocks the
// workers fetch.
struct Guess {
  const float* logits;
  int32_t* signal;
  uintptr_t x;
  int64_t T;
  double fraction;
  int64_t chunks, rounds;
};

class DecodePlanner {
 public:
  DecodePlanner(Pool& pool, int simd, int weight_type, uintptr_t slot_of, uintptr_t key_of_slot,
                uintptr_t last_use, int64_t slots, uintptr_t state, uintptr_t picks,
                int64_t layers, int64_t experts, int64_t top_k, int64_t hidden, int64_t inter,
                const std::vector<ExpertTensorSpec>& tensors, float swiglu_limit)
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
        swiglu_limit_(swiglu_limit),
        tokens_(experts, 0),
        where_(experts, kNotRouted),
        protected_(slots, 0),
        order_(slots) {
    // w13 and w2, then their factors or scales (block-scaled weights), then their per-tensor
    // scales (NVFP4), then their biases: each role's w13 tensor (gate_up), then its w2 one
    constexpr const char* kOrder =
        "an expert is w13 and w2, then their two factor tensors, their two per-tensor scale "
        "tensors and their two biases if any";
    int roles[4] = {0, 0, 0, 0};
    int last = 0;
    for (const auto& [bank, gate_up, block, rows, row_bytes, role] : tensors) {
      if (int64_t(bank.size()) != layers || block < 1 || rows < 1 || row_bytes < 1 ||
          role < 0 || role > 3) {
        throw std::invalid_argument(
            "each expert tensor needs one address per layer, a block, its rows' shape and a "
            "role");
      }
      const int order = roles[role]++;
      if (order > 1 || role < last || gate_up != (order == 0)) throw std::invalid_argument(kOrder);
      last = role;
      const auto kind = static_cast<TensorRole>(role);
      const bool rows_of_gate_up = gate_up && kind != TensorRole::kTensorScales;
      tensors_.push_back(ExpertTensor{bank, rows_of_gate_up, block, rows, row_bytes, kind});
      if (!tensors_.back().down_bias() && !tensors_.back().whole()) {
        granule_ = std::lcm(granule_, block);
      }
      if (rows_of_gate_up) gate_up_row_bytes_ += rows * row_bytes;
    }
    if (roles[0] != 2 || roles[1] == 1 || roles[2] == 1 || roles[3] == 1 ||
        (roles[2] == 2 && roles[1] != 2)) {
      throw std::invalid_argument(kOrder);
    }
  }

  // The driver's cuMemcpyHtoDAsync, cuStreamQuery, cuMemsetD2D8Async and cuMemcpy2DAsync,
  // the compute stream (waited for), the fill stream (the copies), and the cache's slot arrays on
  // the device, one for each of the expert's tensors, in their order ([slots, ...] of the bank's
  // [experts, ...]: ExpertCache.tensors).
  void set_device(uintptr_t copy, uintptr_t query, uintptr_t memset2d, uintptr_t copy2d,
                  uintptr_t stream, uintptr_t fill_stream, const std::vector<uintptr_t>& cache) {
    if (cache.size() != tensors_.size()) {
      throw std::invalid_argument("the cache needs one slot array per expert tensor (" +
                                  std::to_string(tensors_.size()) + ")");
    }
    copy_ = reinterpret_cast<CuMemcpyHtoDAsync>(copy);
    query_ = reinterpret_cast<CuStreamQuery>(query);
    memset2d_ = reinterpret_cast<CuMemsetD2D8Async>(memset2d);
    copy2d_ = reinterpret_cast<CuMemcpy2DAsync>(copy2d);
    stream_ = reinterpret_cast<void*>(stream);
    fill_stream_ = reinterpret_cast<void*>(fill_stream);
    for (size_t i = 0; i < cache.size(); ++i) tensors_[i].cache = cache[i];
  }

  // The driver's cuGraphLaunch, cuEventRecord and cuStreamWaitEvent, and an event of this
  // planner's own (`join`, recorded on the fill stream and waited for by the compute stream): with
  // them a step may also launch the next captured piece (`step`'s head and piece).
  void set_launch(uintptr_t graph_launch, uintptr_t event_record, uintptr_t stream_wait_event,
                  uintptr_t join) {
    launch_ = reinterpret_cast<CuGraphLaunch>(graph_launch);
    record_ = reinterpret_cast<CuEventRecord>(event_record);
    wait_event_ = reinterpret_cast<CuStreamWaitEvent>(stream_wait_event);
    join_ = reinterpret_cast<void*>(join);
  }

  // Copies ahead of the routing (with the device set and a guess with the step): once a guess
  // of the routing comes, the device's first miss of the step it plans (`plan_guess`) starts
  // copying into a slot (the gate and up of its first rows, as many as `bytes_per_second` moves
  // in `share` of the guess's usual lead over the routing); the step, where that expert is a
  // miss and that ends it no later, takes it on the device and copies only the rest
  // (`lead_plan`). share 0: never.
  // The lead is measured from step to step (`guess_lead_seconds`), so the first guesses copy
  // nothing ahead.
  void set_copy_ahead(double share, double bytes_per_second) {
    if (!(share >= 0.0 && share <= 1.0) || !(bytes_per_second >= 0.0)) {
      throw std::invalid_argument("copy_ahead needs a share in [0, 1] and a rate >= 0");
    }
    ahead_share_ = share;
    ahead_rate_ = bytes_per_second;
  }

  // Where a fill goes in the recency order: the most recently used end, or (on) there unless
  // the expert it evicts was picked more often, as ExpertCache.admit with its picks.
  void set_frequency_admission(bool on) { frequency_admission_ = on; }

  // The cached routes at the routing (`--moe-early-cached`): `map` an int32 [layers, experts]
  // array in pinned host memory, each row the slot map (slot_of) a layer's head reads on the
  // device as soon as the layer's routing is made, before this planner has planned the step
  // (host_handoff.route_slots_from_map); 0: off. A step's `head` is then the next layer's: it is
  // launched after the step's `piece` (which makes that layer's routing), once this call has
  // copied that layer's row of slot_of into `map` (no step changes it before the head has read
  // it: the next step plans after the routing the head comes after, and its copy ahead takes no
  // slot of its own layer). Without a launch the caller copies the row before it runs the head.
  void set_cached_map(uintptr_t map) { cached_map_ = reinterpret_cast<int32_t*>(map); }

  // The guess's usual lead over the routing (seconds; 0 before one was measured): a running mean
  // of the time from seeing a guess's signal to seeing the routing's.
  double guess_lead_seconds() const { return lead_seconds_; }

  // The clock the wait times a guess by (its lead over the routing, its planning): the steady
  // clock, or a function that returns seconds (0: the steady clock again). Tests set their own,
  // so that a lead is theirs and not the machine's.
  void set_clock(uintptr_t seconds) { clock_ = reinterpret_cast<double (*)()>(seconds); }

  // Plans layer `layer` for routes ids/weights [T, top_k] (int32, fp32) of rows x [T, H] (fp32);
  // writes route_slots [T, top_k] (a cached expert's slot; -1: on the CPU). CPU routes' weighted
  // sum goes to out [T, H] (fp32), then done_value to done_flag if that is not 0. With the device
  // set: sync first waits for the routing (polling without the GIL the int32 at `signal`, which
  // the router sets once the routing is in host memory, or where signal is 0 the compute stream
  // until it is idle; warming this layer's state in the CPU's caches between polls); copies
  // queues the fills on the fill stream and writes -2 - slot for the routes they serve (the
  // caller orders the device's reads of those slots after the fill stream), after starting the
  // CPU job, or before it where the copies are the side that ends later.
  // split_chunks >= 2 (with copies only): one miss may be split, its first rows in chunks of
  // I / split_chunks (whole blocks of every tensor: misses.split_chunks) copied into the least
  // recently used slot, which is freed again (its content is no expert), and the rest run on the
  // CPU (fetch_plan).
  // The next piece (with the device set, copies and `set_launch`): `handoff` (with done_flag)
  // completes the CPU part's handoff to it first: without a CPU job `out` is zeroed and
  // done_value stored at done_flag, then, either way, done_value at `handoff` (the value the
  // piece's sum waits for, host_handoff.EXPECTED); pad_rows rows of route_slots after the T
  // routed ones are set to -1 (a captured batch's padding rows: no experts); then the graph execs
  // `head` (the cached experts' routes) and `piece` are launched on the compute stream, `piece`
  // after the fill stream where this step queued fills (0: no launch); `head` before the fills
  // are queued where they are the shorter side. Nothing Python runs between the routing's
  // arrival and the next piece's launch.
  // A guess of the routing (`guess`: fp32 logits [T, experts] of this layer's router, stored by
  // the piece before the routing with its own signal at `guess_signal`; kernels/route_guess.py):
  // while the wait polls the routing's signal, once the guess's is set, it plans the step that
  // routing would make (without changing anything: `plan_guess`) and tells each of the pool's
  // workers which weights its first guess_rounds rounds of that CPU job's gate/up blocks read
  // (ExpertJobShell::own_gate_up, Pool::hint); the idle workers fetch them into their own caches.
  // Where the real step's CPU job has the guessed layout, its first rounds of blocks are then the
  // workers' own. A wrong guess costs the fetches, never a result. 0: no guess.
  // With a guess and copies (split_chunks >= 2), the device's first miss of the guessed step may
  // be copied ahead (`set_copy_ahead`).
  // Returns (experts ascending, their slots before the step, admitted (expert, slot) pairs,
  // experts run on the CPU (the split one first), the split (expert, slot, first CPU row) or
  // None, the CPU job or None, the seconds spent waiting, planning, queueing copies and
  // launching, and (whether a guess of CPU work came for this step, the gate/up blocks its job's
  // workers own: 0 where it did not match, the rows of the device's first miss (admitted or
  // split) copied ahead of the routing: 0 where none served the step, whether a copy ahead was
  // made for an expert the step did not miss, the seconds the wait spent planning the guess (its
  // copy ahead queued too; 0: no guess came before the routing), whether the routing came
  // during that planning)).
  py::tuple step(int64_t layer, uintptr_t ids_addr, uintptr_t weights_addr, uintptr_t x,
                 int64_t T, double fetch_fraction, uintptr_t route_slots_addr, uintptr_t out,
                 uintptr_t done_flag, int64_t done_value, bool sync, bool copies,
                 int64_t split_chunks, uintptr_t signal, uintptr_t handoff, int64_t pad_rows,
                 uintptr_t head, uintptr_t piece, uintptr_t guess, uintptr_t guess_signal,
                 int64_t guess_rounds) {
    using Clock = std::chrono::steady_clock;
    if (layer < 0 || layer >= layers_) throw std::invalid_argument("no such MoE layer");
    if ((sync || copies) && copy_ == nullptr) {
      throw std::invalid_argument("sync and device copies need set_device first");
    }
    if ((head != 0 || piece != 0) && (launch_ == nullptr || !copies)) {
      throw std::invalid_argument("launching the next piece needs set_launch and the copies");
    }
    if (handoff != 0 && done_flag == 0) {
      throw std::invalid_argument("the handoff's expected value needs its done flag");
    }
    if (pad_rows < 0) throw std::invalid_argument("pad_rows must be 0 or more");
    if (cached_map_ != nullptr && head != 0 && layer + 1 >= layers_) {
      throw std::invalid_argument("the last MoE layer's step has no next layer's head to launch");
    }
    if (guess != 0 && (guess_signal == 0 || !sync || signal == 0 || guess_rounds < 0 ||
                       (guess_rounds == 0 && ahead_share_ == 0.0))) {
      throw std::invalid_argument(
          "a routing guess needs its signal, the wait for the routing's signal and rounds >= 1 "
          "(or 0 with copies ahead)");
    }
    if (split_chunks >= 2 && (!copies || memset2d_ == nullptr || copy2d_ == nullptr ||
                              inter_ % split_chunks != 0 ||
                              (inter_ / split_chunks) % granule_ != 0)) {
      throw std::invalid_argument(
          "a split needs the device copies, their 2D forms and chunks of I of whole blocks (" +
          std::to_string(granule_) + " rows)");
    }
    const auto t0 = Clock::now();
    guess_layer_ = -1;  // a guess serves the step it came with
    ahead_ = Ahead{};   // and so does its copy ahead
    ahead_error_ = 0;
    guess_seconds_ = 0.0;  // this step's guess, planned in the wait (wait_signal)
    guess_late_ = false;
    if (sync) {
      int err = 0;
      {
        py::gil_scoped_release release;
        // First this thread works on the CPU job this planner started last, while it has more
        // tasks left to hand out than the pool has workers: the routing waited for cannot come
        // before that job ends (the device waits for its part first), and the pool's workers
        // leave this core free for this thread, so the job gets one core more for most of the
        // rest of its run. Its last tasks are left to the workers, so that this thread does not
        // end it late, and comes back to its own state sooner (a small job it leaves alone).
        if (last_job_ != nullptr) last_job_->help(pool_.num_threads());
        last_job_.reset();
        // The job this step may start, made now: on the serial path its allocations and first
        // writes would miss the caches the CPU job's weights have just gone through; once the
        // routing is there it only takes its pairs.
        if (spare_job_ == nullptr || spare_job_->capacity() < T * top_k_) {
          spare_job_ = make_shell(pool_, simd_, weight_type_, T * top_k_, inter_);
        }
        // Polled rather than waited for: the CPU job of the layer before streamed its experts
        // through the shared cache, and what this step reads first would be misses on the serial
        // path (docs/cpu-experts.md, "Why native", measures both).
        if (signal != 0) {
          const Guess g{reinterpret_cast<const float*>(guess),
                        reinterpret_cast<int32_t*>(guess_signal), x, T, fetch_fraction,
                        split_chunks, guess_rounds};
          err = wait_signal(reinterpret_cast<int32_t*>(signal), layer, guess != 0 ? &g : nullptr,
                            copies && split_chunks >= 2);
        } else {
          while ((err = query_(stream_)) == kStreamNotReady) warm(layer);
        }
      }
      if (err == kNoSignal) {
        throw std::runtime_error(
            "the compute stream went idle without the routing's signal: the piece launched "
            "before this wait stores no routing");
      }
      check_driver(err, "cuStreamQuery");
      check_driver(ahead_error_, "cuMemcpy2DAsync (the copy ahead)");
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
    // the step's lists: members, so that their room is kept from step to step
    std::vector<int32_t>& routed = routed_;  // the layer's experts, ascending
    std::vector<int32_t>& before = before_;
    std::vector<int32_t>& missing = missing_;
    std::vector<std::pair<int32_t, int64_t>>& admitted = admitted_;  // (expert, slot)
    std::vector<int32_t>& on_cpu = on_cpu_;
    std::vector<int32_t>& pair_expert = pair_expert_;  // the CPU's pairs
    std::vector<int32_t>& pair_token = pair_token_;
    std::vector<float>& pair_weight = pair_weight_;
    for (auto* v : {&routed, &before, &missing, &on_cpu, &pair_expert, &pair_token}) v->clear();
    admitted.clear();
    pair_weight.clear();
    for (int64_t r = 0; r < R; ++r) {
      const int32_t e = ids[r];
      picks[e] += 1;
      if (tokens_[e]++ == 0) routed.push_back(e);
    }
    std::sort(routed.begin(), routed.end());
    before.resize(routed.size());
    for (size_t i = 0; i < routed.size(); ++i) {
      const int32_t e = routed[i], slot = slot_of[e];
      before[i] = slot;
      if (slot >= 0) {
        use(slot);
        ++state_[kHits];
        protected_[slot] = 1;
      } else {
        missing.push_back(e);
      }
    }
    const int64_t m = int64_t(missing.size());
    // the copy ahead serves this step where its expert is a miss (it cannot have become a hit):
    // the device takes that expert first, and at least the rows copied
    const bool ahead_here =
        ahead_.layer == layer && copies && where_missing(missing, ahead_.expert);
    const MissPlan plan =
        plan_misses(m, fetch_fraction, split_chunks, ahead_here ? ahead_.rows : 0, inter_);
    const int64_t q = plan.q, split_j = plan.j;
    const bool ahead_used = plan.lead;
    const int64_t lead_rows = ahead_used ? ahead_.rows : 0;
    if (q < m) {
      order_misses(missing, picks, false);
    }
    if (ahead_used) {  // the device's first, where the guess put it
      const auto at = std::find(missing.begin(), missing.end(), ahead_.expert);
      std::rotate(missing.begin(), at, at + 1);
    }
    on_cpu.assign(missing.begin() + q, missing.end());
    for (int64_t i = 0; i < q; ++i) {
      const int32_t e = missing[i];
      // the slot copied into ahead is free: its expert evicted when the copy began
      const int64_t slot = i == 0 && ahead_used ? ahead_.slot : victim();
      if (slot < 0) {  // every slot is in use by this step: the rest go to the CPU
        on_cpu.insert(on_cpu.end(), missing.begin() + i, missing.begin() + q);
        break;
      }
      // frequency admission: a fill picked less often than the expert it evicts keeps that
      // expert's last use, so that the next fill takes this slot first (ExpertCache.admit)
      const int64_t old_key = key_of_slot_[slot];
      const bool keep_back = frequency_admission_ && old_key >= 0 && picks[e] < picks_[old_key];
      evict(slot);
      key_of_slot_[slot] = layer * experts_ + e;
      if (keep_back) {  // the slot keeps its last use, and its place in the order
        next_tick();
      } else {
        use(slot);
      }
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
      split_slot = q == 0 && ahead_used ? ahead_.slot : victim();
      if (split_slot >= 0) {
        split_expert = missing[q];
        split_row = split_j * (inter_ / split_chunks);
        free_slot(split_slot);
        protected_[split_slot] = 1;
      }
    }
    for (int32_t e : on_cpu) where_[e] = kOnCpu;
    if (split_expert >= 0) where_[split_expert] = kSplit;
    if (copies) {
      for (const auto& [e, slot] : admitted) where_[e] = kFilled;
    }
    for (int64_t r = 0; r < R; ++r) {
      const int32_t e = ids[r];
      if (where_[e] == kOnCpu || where_[e] == kSplit) {  // split: its other rows on the CPU
        route_slots[r] = where_[e] == kSplit ? filled_mark(split_slot) : -1;
        pair_expert.push_back(e);
        pair_token.push_back(int32_t(r / top_k_));
        pair_weight.push_back(weights[r]);
      } else {
        route_slots[r] = where_[e] == kFilled ? filled_mark(slot_of[e]) : slot_of[e];
      }
    }
    // the job's first rounds of gate/up blocks are the workers' own where they fetched them: the
    // guess came with this step and planned the same job layout
    const bool guessed = guess_layer_ == layer;
    const bool owns =
        guessed && layout(pair_expert, split_expert, split_row, layout_) == guess_layout_;
    guess_layer_ = -1;
    // back to the idle marks for the next step (a slot is protected only during its step)
    for (int32_t e : routed) {
      tokens_[e] = 0;
      where_[e] = kNotRouted;
      if (slot_of[e] >= 0) protected_[slot_of[e]] = 0;
    }
    if (split_slot >= 0) protected_[split_slot] = 0;
    // The side that ends later starts first: where the copies take longer than the CPU's part,
    // they are queued before the CPU job is made and started.
    const double u = split_expert >= 0 ? double(split_j) / double(split_chunks) : 0.0;
    const Sides planned = sides(double(admitted.size()), u, double(on_cpu.size()) - u,
                                fetch_fraction, double(lead_rows) / double(inter_));
    const bool copies_first = copies && planned.copies > planned.cpu;
    const auto t2 = Clock::now();
    Clock::duration fill_time{};
    if (copies_first) {
      fill_time = queue_fills(layer, admitted, split_expert, split_slot, split_row, lead_rows);
    }
    const auto t_job = Clock::now();
    std::shared_ptr<ExpertJobShell> job_ptr;
    int64_t owned = 0;
    if (!on_cpu.empty()) {
      ExpertProblem p = problem(layer, x, out, T, split_expert, split_row);
      p.weights_outlive_pool = true;
      const auto pairs = int64_t(pair_expert.size());
      std::shared_ptr<ExpertJobShell> j = std::move(spare_job_);
      if (j == nullptr || j->capacity() < pairs) {
        j = make_shell(pool_, simd_, weight_type_, pairs, inter_);
      }
      // every pair is in range: the experts were checked above, the tokens are r / top_k < T
      j->assign(p, pair_expert.data(), pair_token.data(), pair_weight.data(), pairs);
      j->set_done_flag(reinterpret_cast<int64_t*>(done_flag), done_value);
      if (owns) owned = j->own_gate_up(pool_, guess_rounds, false);
      pool_.push(j);
      last_job_ = j;
      job_ptr = std::move(j);
    }
    const auto t3 = Clock::now();
    if (handoff != 0) {
      if (job_ptr == nullptr) {  // nothing on the CPU: its part is zero, and ready now
        std::memset(reinterpret_cast<void*>(out), 0, size_t(T * hidden_) * sizeof(float));
        __atomic_store_n(reinterpret_cast<int64_t*>(done_flag), done_value, __ATOMIC_RELEASE);
      }
      __atomic_store_n(reinterpret_cast<int64_t*>(handoff), done_value, __ATOMIC_RELEASE);
    }
    std::fill(route_slots + R, route_slots + R + pad_rows * top_k_, -1);
    const bool filled = copies && (!admitted.empty() || split_expert >= 0);
    // Where the copies are the shorter side and still to queue, the next piece's head goes
    // first: it runs the cached experts' routes, whose slots no fill of this step writes (a fill
    // takes a slot this step does not read), so the device starts on them while the host queues
    // the copies instead of after. The piece still waits for the copies.
    const bool head_first = filled && !copies_first && head != 0 && cached_map_ == nullptr;
    if (head_first) launch_next(head, 0, false);
    const auto t4 = Clock::now();
    if (copies && !copies_first) {
      fill_time = queue_fills(layer, admitted, split_expert, split_slot, split_row, lead_rows);
    }
    const auto t_fills = Clock::now();
    if (cached_map_ != nullptr) {  // the piece, then the next layer's head (set_cached_map)
      launch_next(0, piece, filled);
      if (head != 0) {
        std::memcpy(cached_map_ + (layer + 1) * experts_, slot_of_ + (layer + 1) * experts_,
                    size_t(experts_) * sizeof(int32_t));
        launch_next(head, 0, false);
      }
    } else {
      launch_next(head_first ? 0 : head, piece, filled);
    }
    const auto t5 = Clock::now();
    const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    py::object job = job_ptr == nullptr ? py::none() : py::cast(std::shared_ptr<Job>(job_ptr));
    py::object split = py::none();
    if (split_expert >= 0) split = py::make_tuple(split_expert, split_slot, split_row);
    return py::make_tuple(
        routed, before, admitted, on_cpu, split, job,
        py::make_tuple(seconds(t1 - t0), seconds((t2 - t1) + (t3 - t_job)), seconds(fill_time),
                       seconds((t4 - t3) + (t5 - t_fills))),
        py::make_tuple(guessed, owned, lead_rows, ahead_.layer == layer && !ahead_used,
                       guess_seconds_, guess_late_));
  }

 private:
  static constexpr int64_t kTick = 0, kHits = 1, kFills = 2, kEvictions = 3;  // cache.py's state
  static constexpr int8_t kNotRouted = 0, kOnCpu = 1, kSplit = 2, kFilled = 3;

  // Queues the step's fills on the fill stream (whole experts, then the split one); on a driver
  // error frees the admitted slots (they may never be filled, so no later step may read them) and
  // throws. lead_rows > 0: the device's first miss (the first admitted, else the split one) had
  // the gate and up of its first lead_rows rows copied ahead; only the rest are copied. Returns
  // the time it took.
  std::chrono::steady_clock::duration queue_fills(
      int64_t layer, const std::vector<std::pair<int32_t, int64_t>>& admitted,
      int32_t split_expert, int64_t split_slot, int64_t split_row, int64_t lead_rows) {
    const auto t0 = std::chrono::steady_clock::now();
    int err = 0;
    const char* failed = "cuMemcpyHtoDAsync";
    for (size_t i = 0; i < admitted.size() && err == 0; ++i) {
      const auto [e, slot] = admitted[i];
      for (const ExpertTensor& t : tensors_) {
        if (i == 0 && lead_rows > 0 && t.gate_up) {  // the rest of its gate and up rows
          err = copy_rows(t, layer, e, slot, lead_rows, inter_, &failed);
        } else {
          const auto* bank = reinterpret_cast<const char*>(t.bank[layer]) + e * t.bytes();
          err = copy_(t.cache + slot * t.bytes(), bank, size_t(t.bytes()), fill_stream_);
        }
        if (err != 0) break;
      }
    }
    if (split_expert >= 0 && err == 0) {
      err = copy_split(layer, split_expert, split_slot, admitted.empty() ? lead_rows : 0,
                       split_row, &failed);
    }
    if (err != 0) {
      int32_t* slot_of = slot_of_ + layer * experts_;
      for (const auto& [e, slot] : admitted) {
        slot_of[e] = -1;
        key_of_slot_[slot] = -1;
        release(slot);
      }
      check_driver(err, failed);
    }
    return std::chrono::steady_clock::now() - t0;
  }

  // Launches the next piece's graphs on the compute stream: `head`, then, after the fill stream
  // where `filled`, `piece` (0: none). Throws on a driver error.
  void launch_next(uintptr_t head, uintptr_t piece, bool filled) {
    if (head != 0) check_driver(launch_(reinterpret_cast<void*>(head), stream_), "cuGraphLaunch");
    if (piece == 0) return;
    if (filled) {
      check_driver(record_(join_, fill_stream_), "cuEventRecord");
      check_driver(wait_event_(stream_, join_, 0), "cuStreamWaitEvent");
    }
    check_driver(launch_(reinterpret_cast<void*>(piece), stream_), "cuGraphLaunch");
  }

  // A route served by this step's fill of `slot` (host_handoff.FILLED: -2 - slot).
  static int32_t filled_mark(int64_t slot) { return int32_t(-2 - slot); }

  // The device's part of a split expert into `slot`: its gate and up rows below `row` and the
  // same columns of its down projection, with its gate and up rows from `row` on zeroed
  // (silu(0) * 0 = 0: those rows add nothing, whatever the slot's down projection holds in their
  // columns, as long as it is finite: the cache starts zeroed, and holds experts after that), in
  // each of its tensors (factors and scales too: `row` is a multiple of their blocks; gpt-oss's
  // gate and up biases of those rows zeroed with them: clamped or not, the SwiGLU of two zero
  // sums is zero). NVFP4's per-tensor scales are copied whole (they scale the device's rows as
  // the CPU's). Its down bias is zeroed in the slot: the CPU's part adds it. Gate and up rows
  // below `from` are there already (copied ahead). Per tensor one 2D copy and, for gate and up,
  // one 2D memset; one memset for the down bias, one copy for each per-tensor scale tensor.
  // Returns the first driver error (naming its call in `failed`), or 0.
  int copy_split(int64_t layer, int32_t e, int64_t slot, int64_t from, int64_t row,
                 const char** failed) {
    for (const ExpertTensor& t : tensors_) {
      if (!t.gate_up) continue;
      int err = copy_rows(t, layer, e, slot, from, row, failed);
      if (err != 0) return err;
      const size_t half = size_t(t.rows / 2 * t.row_bytes);
      const size_t head = size_t(row / t.block * t.row_bytes);
      err = memset2d_(t.cache + slot * t.bytes() + head, half, 0, half - head, 2, fill_stream_);
      if (err != 0) {
        *failed = "cuMemsetD2D8Async";
        return err;
      }
    }
    for (const ExpertTensor& t : tensors_) {
      if (t.gate_up) continue;
      if (t.whole()) {
        const auto* bank = reinterpret_cast<const char*>(t.bank[layer]) + e * t.bytes();
        const int err = copy_(t.cache + slot * t.bytes(), bank, size_t(t.bytes()), fill_stream_);
        if (err != 0) {
          *failed = "cuMemcpyHtoDAsync";
          return err;
        }
        continue;
      }
      if (t.down_bias()) {  // the CPU's part adds it
        const int err =
            memset2d_(t.cache + slot * t.bytes(), size_t(t.bytes()), 0, size_t(t.bytes()), 1,
                      fill_stream_);
        if (err != 0) {
          *failed = "cuMemsetD2D8Async";
          return err;
        }
        continue;
      }
      Memcpy2D columns;  // the first `row` columns of each of its rows (their entries)
      columns.src_memory_type = 1;
      columns.src_host = reinterpret_cast<const char*>(t.bank[layer]) + e * t.bytes();
      columns.src_pitch = t.row_bytes, columns.dst_memory_type = 2;
      columns.dst_device = t.cache + slot * t.bytes();
      columns.dst_pitch = t.row_bytes;
      columns.width_bytes = size_t(row / t.block * (t.row_bytes * t.block / inter_));
      columns.height = t.rows;
      const int err = copy2d_(&columns, fill_stream_);
      if (err != 0) {
        *failed = "cuMemcpy2DAsync";
        return err;
      }
    }
    return 0;
  }

  // Copies expert e's gate and up rows [from, to) into `slot`, in each of its tensors whose rows
  // are gate and up rows. Returns the first driver error (naming its call in `failed`), or 0.
  int copy_gate_up(int64_t layer, int32_t e, int64_t slot, int64_t from, int64_t to,
                   const char** failed) {
    for (const ExpertTensor& t : tensors_) {
      if (!t.gate_up) continue;
      const int err = copy_rows(t, layer, e, slot, from, to, failed);
      if (err != 0) return err;
    }
    return 0;
  }

  // Copies the gate and up rows [from, to) (multiples of its block, or I) of tensor t of expert
  // e into `slot`: one 2D copy of two runs, gate's and up's (none where from == to). Returns the
  // driver's error (naming its call in `failed`), or 0.
  int copy_rows(const ExpertTensor& t, int64_t layer, int32_t e, int64_t slot, int64_t from,
                int64_t to, const char** failed) {
    if (from >= to) return 0;
    const size_t half = size_t(t.rows / 2 * t.row_bytes);
    const size_t skip = size_t(from / t.block * t.row_bytes);
    Memcpy2D rows;  // gate rows [from, to), then the same up rows
    rows.src_memory_type = 1;
    rows.src_host = reinterpret_cast<const char*>(t.bank[layer]) + e * t.bytes() + skip;
    rows.src_pitch = half, rows.dst_memory_type = 2;
    rows.dst_device = t.cache + slot * t.bytes() + skip;
    rows.dst_pitch = half;
    rows.width_bytes = size_t((to - from) / t.block * t.row_bytes);
    rows.height = 2;
    const int err = copy2d_(&rows, fill_stream_);
    if (err != 0) *failed = "cuMemcpy2DAsync";
    return err;
  }

  // The CPU job's problem for layer `layer`: the bank's weights, their factors or scales,
  // NVFP4's per-tensor scales and its biases where the expert has them, and the SwiGLU's limit.
  ExpertProblem problem(int64_t layer, uintptr_t x, uintptr_t out, int64_t T,
                        int32_t split_expert, int64_t split_row) const {
    ExpertProblem p{reinterpret_cast<const float*>(x), reinterpret_cast<float*>(out),
                    reinterpret_cast<const void*>(tensors_[0].bank[layer]),
                    reinterpret_cast<const void*>(tensors_[1].bank[layer]),
                    T, hidden_, inter_, experts_, split_expert, split_row};
    for (size_t i = 2; i + 1 < tensors_.size(); i += 2) {
      const uintptr_t w13 = tensors_[i].bank[layer], w2 = tensors_[i + 1].bank[layer];
      if (tensors_[i].role == TensorRole::kScales) {  // FP8's factors, MXFP4's or NVFP4's scales
        p.w13_factors = reinterpret_cast<const float*>(w13);
        p.w2_factors = reinterpret_cast<const float*>(w2);
        p.w13_scales = reinterpret_cast<const uint8_t*>(w13);
        p.w2_scales = reinterpret_cast<const uint8_t*>(w2);
      } else if (tensors_[i].role == TensorRole::kTensorScales) {
        p.w13_tensor_scales = reinterpret_cast<const float*>(w13);
        p.w2_tensor_scales = reinterpret_cast<const float*>(w2);
      } else {
        p.w13_bias = reinterpret_cast<const float*>(w13);
        p.w2_bias = reinterpret_cast<const float*>(w2);
      }
    }
    p.swiglu_limit = swiglu_limit_;
    return p;
  }

  // Seconds by the wait's clock (set_clock).
  double now_s() const {
    if (clock_ != nullptr) return clock_();
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Polls the routing's signal (set by the router after the routing: one thread's store after a
  // system-wide fence, host_handoff.signal_host) until it is set, warming the layer's state
  // between polls; every kPollsPerQuery polls it asks the compute stream whether it failed (its
  // error) or went idle with the signal still clear (kNoSignal); 0 once the signal is set. The
  // signal comes before cuStreamQuery says the kernel is done, and a poll of it costs a fraction
  // of a cuStreamQuery call (docs/kernels.md).
  // Once it has seen the signal, it clears it for the next piece's router: the one store that
  // set it has landed, and no other comes before that piece is launched.
  // With a guess: once the guess's signal is set (before the routing's: the piece stores the
  // guess first), plan_guess (with `ahead`, its copy ahead too); the guess's signal is cleared
  // with the routing's, and the time between the two signals seen goes into the guess's lead.
  int wait_signal(int32_t* signal, int64_t layer, const Guess* guess, bool ahead) {
    const auto set = [signal] { return __atomic_load_n(signal, __ATOMIC_ACQUIRE) != 0; };
    bool guessed = guess == nullptr;
    double guess_seen = 0.0;
    for (int64_t polls = 1; !set(); ++polls) {
      // a few polls paced by pause (no core time taken from a sibling thread), then the warming
      bool seen = false;
      for (int i = 0; i < 4 && !(seen = set()); ++i) cpu_relax();
      if (seen) break;
      if (!guessed && __atomic_load_n(guess->signal, __ATOMIC_ACQUIRE) != 0) {
        guessed = true;
        guess_seen = now_s();
        plan_guess(layer, *guess, ahead);
        // the host's time on the guess (its copy ahead queued too), and whether the routing
        // came meanwhile: then the step started that much later
        guess_seconds_ = now_s() - guess_seen;
        guess_late_ = set();
      }
      warm(layer);
      if (polls % kPollsPerQuery != 0) continue;
      const int err = query_(stream_);
      if (err == kStreamNotReady) continue;
      if (err != 0) return err;
      // idle: the signal, stored before the kernel ended, must be visible by now
      if (!set()) return kNoSignal;
    }
    __atomic_store_n(signal, 0, __ATOMIC_RELAXED);
    if (guess != nullptr) __atomic_store_n(guess->signal, 0, __ATOMIC_RELAXED);
    if (guess != nullptr && guessed) {
      const double lead = now_s() - guess_seen;
      lead_seconds_ = lead_seconds_ == 0.0 ? lead : lead_seconds_ + (lead - lead_seconds_) / 16.0;
    }
    return 0;
  }

  // The step a guessed routing would make, planned as `step` plans (the picks, the hits, the
  // split of the misses, the most picked first to the device) on the cache as it is, changing
  // none of it but for the copy ahead; where it runs experts on the CPU, its job's layout is kept
  // (guess_layout_) and each worker is told which weights its first guess.rounds rounds of
  // gate/up blocks read. With `ahead` (copies ahead on, `set_copy_ahead`, and a measured lead),
  // the device's first miss starts copying now (`copy_ahead`), and the plan counts it as the
  // step will where the guess is right. Assumes every fill finds a slot (the real step may not:
  // then the layouts differ).
  void plan_guess(int64_t layer, const Guess& g, bool ahead) {
    const int64_t R = g.T * top_k_;
    guess_ids_.resize(size_t(R));
    for (int64_t t = 0; t < g.T; ++t) {
      top_k(g.logits + t * experts_, guess_ids_.data() + t * top_k_);
    }
    const int64_t* picks = picks_ + layer * experts_;
    const int32_t* slot_of = slot_of_ + layer * experts_;
    // the step's lists, free until the step itself plans after the wait
    std::vector<int32_t>& routed = routed_;
    std::vector<int32_t>& missing = missing_;
    for (auto* v : {&routed, &missing, &pair_expert_, &pair_token_}) v->clear();
    pair_weight_.clear();
    for (const int32_t e : guess_ids_) {
      if (tokens_[e]++ == 0) routed.push_back(e);
    }
    std::sort(routed.begin(), routed.end());
    for (const int32_t e : routed) {
      if (slot_of[e] < 0) missing.push_back(e);
    }
    const int64_t m = int64_t(missing.size());
    // copied ahead only where the step would take it
    const int64_t lead_rows = ahead ? ahead_rows() : 0;
    const MissPlan plan = plan_misses(m, g.fraction, g.chunks, lead_rows, inter_);
    const int64_t q = plan.q, split_j = plan.j;
    if (q < m) {
      order_misses(missing, picks, true);
    }
    // where no slot is free for the copy ahead, the layout is the step's without one; without
    // rounds of blocks to fetch, the copy ahead is all
    if ((plan.lead && !copy_ahead(layer, missing[0], lead_rows, routed)) || g.rounds < 1) {
      for (const int32_t e : routed) tokens_[e] = 0;
      return;
    }
    const int32_t split_expert = split_j > 0 ? missing[q] : -1;
    const int64_t split_row = split_j > 0 ? split_j * (inter_ / g.chunks) : 0;
    for (int64_t i = q; i < m; ++i) where_[missing[i]] = kOnCpu;
    for (int64_t r = 0; r < R; ++r) {
      if (where_[guess_ids_[r]] != kOnCpu) continue;
      pair_expert_.push_back(guess_ids_[r]);
      pair_token_.push_back(int32_t(r / top_k_));
      pair_weight_.push_back(0.0f);
    }
    for (const int32_t e : routed) tokens_[e] = 0, where_[e] = kNotRouted;
    if (pair_expert_.empty()) return;
    const auto pairs = int64_t(pair_expert_.size());
    if (guess_job_ == nullptr || guess_job_->capacity() < pairs) {
      guess_job_ = make_shell(pool_, simd_, weight_type_, std::max(pairs, R), inter_);
    }
    const ExpertProblem p = problem(layer, g.x, 0, g.T, split_expert, split_row);
    guess_job_->assign(p, pair_expert_.data(), pair_token_.data(), pair_weight_.data(), pairs);
    guess_job_->own_gate_up(pool_, g.rounds, true);
    layout(pair_expert_, split_expert, split_row, guess_layout_);
    guess_layer_ = layer;
  }

  // The rows of one expert whose gate and up a copy ahead takes: those the copies move in
  // ahead_share_ of the guess's usual lead (a row's gate and up, with their share of the
  // factors), at most all of them, in whole blocks (granule_ rows: a split's unit).
  int64_t ahead_rows() const {
    const double row_bytes = double(gate_up_row_bytes_) / double(inter_);
    const double rows = ahead_share_ * lead_seconds_ * ahead_rate_ / row_bytes;
    return std::min<int64_t>(inter_, int64_t(std::floor(rows))) / granule_ * granule_;
  }

  // Starts copying the gate and up of expert e's first `rows` rows of layer `layer` (one 2D
  // copy, cheap to queue: the wait is on the serial path) into the least recently used slot no
  // expert in `routed` (the guess's) holds, evicting its expert: the slot is free until the step
  // takes it (ahead_). False where every slot is held by a routed expert. A driver error frees
  // nothing more and is kept for the step (ahead_error_), which fails with it.
  bool copy_ahead(int64_t layer, int32_t e, int64_t rows, const std::vector<int32_t>& routed) {
    const int32_t* slot_of = slot_of_ + layer * experts_;
    // with the cached routes at the routing, no slot of the layer: its head may be reading any
    // routed expert's, and the real routing is not known yet
    const bool whole_layer = cached_map_ != nullptr;
    const auto guard = [&](int8_t on) {
      if (whole_layer) {
        for (int64_t x = 0; x < experts_; ++x) {
          if (slot_of[x] >= 0) protected_[slot_of[x]] = on;
        }
        return;
      }
      for (const int32_t r : routed) {
        if (slot_of[r] >= 0) protected_[slot_of[r]] = on;
      }
    };
    guard(1);
    const int64_t slot = victim();
    guard(0);
    if (slot < 0) return false;
    free_slot(slot);
    const char* failed = "";
    ahead_error_ = copy_gate_up(layer, e, slot, 0, rows, &failed);
    if (ahead_error_ == 0) ahead_ = Ahead{layer, e, slot, rows};
    return true;
  }

  // The expert in `slot`, if any, is no longer cached there (an eviction).
  void evict(int64_t slot) {
    const int64_t old = key_of_slot_[slot];
    if (old >= 0) {
      slot_of_[old] = -1;
      ++state_[kEvictions];
    }
  }

  // `slot` holds no expert and is free (the first victim): its expert evicted.
  void free_slot(int64_t slot) {
    evict(slot);
    key_of_slot_[slot] = -1;
    release(slot);
  }

  static bool where_missing(const std::vector<int32_t>& missing, int32_t e) {
    return std::find(missing.begin(), missing.end(), e) != missing.end();
  }

  // The misses in the order the device takes them: the most picked first (with this step's routes
  // counted: `pending` where picks does not hold them yet, as in a guess), then the ones with more
  // tokens now, then the lower id.
  void order_misses(std::vector<int32_t>& missing, const int64_t* picks, bool pending) const {
    std::stable_sort(missing.begin(), missing.end(), [&](int32_t a, int32_t b) {
      const int64_t pa = picks[a] + (pending ? tokens_[a] : 0);
      const int64_t pb = picks[b] + (pending ? tokens_[b] : 0);
      if (pa != pb) return pa > pb;
      if (tokens_[a] != tokens_[b]) return tokens_[a] > tokens_[b];
      return a < b;
    });
  }

  // The k largest of one token's logits, the lower id first on ties (as the router's top-k).
  void top_k(const float* logits, int32_t* ids) {
    chosen_.assign(size_t(experts_), 0);
    for (int64_t j = 0; j < top_k_; ++j) {
      int32_t best = -1;
      for (int32_t e = 0; e < experts_; ++e) {
        if (!chosen_[e] && (best < 0 || logits[e] > logits[best])) best = e;
      }
      chosen_[best] = 1;
      ids[j] = best;
    }
  }

  // What an expert job's gate/up blocks depend on: its pairs' experts (sorted: how many pairs
  // each group has), the split expert and its first CPU row; into `out`, which it returns.
  static const std::vector<int64_t>& layout(const std::vector<int32_t>& pair_expert,
                                            int32_t split_expert, int64_t split_row,
                                            std::vector<int64_t>& out) {
    out.assign(pair_expert.begin(), pair_expert.end());
    std::sort(out.begin(), out.end());
    out.push_back(split_expert);
    out.push_back(split_row);
    return out;
  }

  // Prefetches what a step of `layer` reads of this planner's state into the CPU's caches: the
  // layer's slots and picks, every slot's clock, key and protection, the per-expert scratch.
  void warm(int64_t layer) const {
    const auto touch = [](const void* p, size_t bytes) {
      const char* bytes_at = static_cast<const char*>(p);
      for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(bytes_at + at);
    };
    touch(slot_of_ + layer * experts_, size_t(experts_) * sizeof(int32_t));
    touch(picks_ + layer * experts_, size_t(experts_) * sizeof(int64_t));
    order_.warm();
    touch(key_of_slot_, size_t(slots_) * sizeof(int64_t));
    touch(protected_.data(), protected_.size());
    touch(tokens_.data(), tokens_.size() * sizeof(int32_t));
    touch(where_.data(), where_.size());
    touch(state_, 4 * sizeof(int64_t));
  }

  static void check_driver(int err, const char* what) {
    if (err != 0) {
      throw std::runtime_error(std::string(what) + " failed with CUDA driver error " +
                               std::to_string(err));
    }
  }

  // A free slot (last use -1), else the least recently used unprotected one; the lowest index on
  // ties; -1 when every slot is protected.
  int64_t victim() {
    sync_order();
    return order_.first(protected_.data());
  }

  // The use clock advanced by one, the slot order first brought up to date: its new value.
  int64_t next_tick() {
    sync_order();
    order_tick_ = ++state_[kTick];
    return order_tick_;
  }

  // `slot` is used now: its last use the tick's next value.
  void use(int64_t slot) {
    last_use_[slot] = next_tick();
    order_.use(slot);
  }

  // `slot` holds nothing now (last use -1).
  void release(int64_t slot) {
    sync_order();
    last_use_[slot] = -1;
    order_.release(slot);
  }

  // The slot order brought up to the last-use array where the tick moved since this planner
  // last wrote it (the Python planner's writes, ExpertCache's lookup and admit, each advance it
  // and give the slot its value); built whole the first time.
  void sync_order() {
    if (state_[kTick] == order_tick_) return;
    if (order_tick_ == kNoTick) {
      order_.rebuild(last_use_);
    } else {
      order_.catch_up(last_use_, order_tick_);
    }
    order_tick_ = state_[kTick];
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
  const float swiglu_limit_;  // gpt-oss's clamped SwiGLU (0: silu(gate) * up)
  std::vector<ExpertTensor> tensors_;  // w13, w2 (and their factors or scales, and biases)
  int64_t granule_ = 1;  // a split's rows: a multiple of every tensor's block
  int64_t gate_up_row_bytes_ = 0;  // one expert's bytes in the tensors of gate and up rows
  CuMemcpyHtoDAsync copy_ = nullptr;
  CuStreamQuery query_ = nullptr;
  CuMemsetD2D8Async memset2d_ = nullptr;
  CuMemcpy2DAsync copy2d_ = nullptr;
  CuGraphLaunch launch_ = nullptr;
  CuEventRecord record_ = nullptr;
  CuStreamWaitEvent wait_event_ = nullptr;
  void* join_ = nullptr;
  void* stream_ = nullptr;
  void* fill_stream_ = nullptr;
  // the CPU job the last step started, which the next step's wait works on (then none)
  std::shared_ptr<Job> last_job_;
  std::shared_ptr<ExpertJobShell> spare_job_;  // the next step's job, not assigned yet
  // the guess of the step waited for (plan_guess): its job, never queued, lays out the blocks;
  // guess_layer_ is the layer it was made for (-1: none with CPU work for this step)
  std::shared_ptr<ExpertJobShell> guess_job_;
  std::vector<int64_t> guess_layout_, layout_;
  std::vector<int32_t> guess_ids_;
  std::vector<int8_t> chosen_;
  int64_t guess_layer_ = -1;
  bool frequency_admission_ = false;  // set_frequency_admission
  int32_t* cached_map_ = nullptr;     // set_cached_map
  // copies ahead (`set_copy_ahead`): the share of the guess's lead they take, the copies' rate
  // (bytes/s), the lead (a running mean, seconds), and the copy ahead of the step waited for:
  // its layer (-1: none), expert, slot and rows; a driver error of it (the step fails with it)
  double ahead_share_ = 0.0, ahead_rate_ = 0.0, lead_seconds_ = 0.0;
  double (*clock_)() = nullptr;  // the wait's clock (set_clock); null: the steady clock
  struct Ahead {
    int64_t layer = -1;
    int32_t expert = -1;
    int64_t slot = -1, rows = 0;
  };
  Ahead ahead_;
  int ahead_error_ = 0;
  // this step's guess in the wait: the host's time planning it, and whether the routing came
  // meanwhile (the last entries of step's last tuple)
  double guess_seconds_ = 0.0;
  bool guess_late_ = false;
  // a step's lists (kept for their room)
  std::vector<int32_t> routed_, before_, missing_, on_cpu_, pair_expert_, pair_token_;
  std::vector<std::pair<int32_t, int64_t>> admitted_;
  std::vector<float> pair_weight_;
  // scratch, all zero between steps
  std::vector<int32_t> tokens_;   // per expert: routes to it this step
  std::vector<int8_t> where_;     // per expert: kOnCpu this step
  std::vector<int8_t> protected_; // per slot: read by this step
  SlotOrder order_;  // the slots in victim's order (slot_order.h), as of tick order_tick_
  static constexpr int64_t kNoTick = std::numeric_limits<int64_t>::min();
  int64_t order_tick_ = kNoTick;
};

}  // namespace
