// Weights a job still to come will read, for the pool's idle workers to fetch into their caches.
// Included by cpu_experts.cpp only (one translation unit): internal linkage, like the rest.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

// Per-worker (address, bytes) ranges: worker w's are [w * per_worker, (w + 1) * per_worker). A
// worker that spins for a job fetches its own into its L2, kStep bytes between two polls
// (fetch_some), and stops at the next job (Cursor::stop): the blocks it owns in that job
// (Job::set_owned) are then in its own cache. Only prefetches are issued, so a hint that names
// the wrong memory costs bandwidth, never a result. Written by one thread, read by the workers.
class PrefetchHint {
 public:
  // 4 ranges a worker a round (ExpertJob::own_gate_up): 4 rounds for up to 64 workers; more
  // workers are told of the rounds that fit
  static constexpr int kMaxRanges = 1024;
  static constexpr int64_t kStep = 1024;

  // A worker's place in the hint: the version it works on, its next range and the offset in it.
  struct Cursor {
    uint64_t version = 0;
    int range = 0, end = 0;  // its ranges still to fetch: [range, end)
    int64_t at = 0;
    void stop() { end = 0; }
  };

  // Replaces the hint (at most kMaxRanges ranges are kept).
  void set(const std::pair<const void*, int64_t>* ranges, int n, int per_worker) {
    n = std::clamp(n, 0, kMaxRanges);
    // a seqlock: odd while written, so that a worker never starts on a half-written hint
    const uint64_t v = version_.load(std::memory_order_relaxed);
    version_.store(v + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    for (int i = 0; i < n; ++i) {
      ranges_[i].address.store(reinterpret_cast<uintptr_t>(ranges[i].first),
                               std::memory_order_relaxed);
      ranges_[i].bytes.store(ranges[i].second, std::memory_order_relaxed);
    }
    count_.store(n, std::memory_order_relaxed);
    per_worker_.store(std::max(0, per_worker), std::memory_order_relaxed);
    version_.store(v + 2, std::memory_order_release);
  }

  // The hint as it stands (for tests): its ranges, and how many of them are each worker's.
  std::pair<std::vector<std::pair<uintptr_t, int64_t>>, int> read() const {
    std::vector<std::pair<uintptr_t, int64_t>> ranges(size_t(count_.load()));
    for (size_t i = 0; i < ranges.size(); ++i) {
      ranges[i] = {ranges_[i].address.load(), ranges_[i].bytes.load()};
    }
    return {ranges, per_worker_.load()};
  }

  // One step of worker `index`'s share (kStep bytes into L2); says whether it fetched anything.
  // A new hint restarts the share.
  bool fetch_some(int index, Cursor& c) {
    const uint64_t v = version_.load(std::memory_order_acquire);
    if (v != c.version) {
      if (v & 1) return false;  // being written
      const int per = per_worker_.load(std::memory_order_relaxed);
      c.version = v;
      c.range = index * per;
      c.end = std::min(count_.load(std::memory_order_relaxed), c.range + per);
      c.at = 0;
    }
    if (c.range >= c.end) return false;
    // a hint rewritten meanwhile may be read torn here: a wrong address is only a wasted
    // prefetch, and the next call starts on the new version
    const int64_t bytes = ranges_[c.range].bytes.load(std::memory_order_relaxed);
    const uintptr_t address = ranges_[c.range].address.load(std::memory_order_relaxed);
    const auto* base = reinterpret_cast<const char*>(address);
    const int64_t to = std::min(bytes, c.at + kStep);
    for (int64_t o = c.at; o < to; o += 64) prefetch(base + o);
    c.at = to;
    if (c.at >= bytes) {
      ++c.range;
      c.at = 0;
    }
    return true;
  }

 private:
  struct Range {
    std::atomic<uintptr_t> address{0};
    std::atomic<int64_t> bytes{0};
  };
  alignas(64) std::atomic<uint64_t> version_{0};
  std::atomic<int> count_{0}, per_worker_{0};
  Range ranges_[kMaxRanges];
};

}  // namespace
