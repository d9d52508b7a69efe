// The expert cache's slots in the order the decode planner takes them for a fill: the free ones
// (last use -1) by index, then the others by last use, the least recent first. The planner's
// choice (DecodePlanner::victim, ExpertCache.admit in Python) is the first unprotected slot in
// this order. A scan of the last-use array for it cost 2-5 us at thousands of slots, once for
// every fill, split miss and copy ahead, on the host's path from a layer's routing to its
// launch; kept in order here it takes a few steps.
//
// The order follows the shared last-use array through the writes the planner makes: a slot
// freed (its last use -1) or used (its last use the tick's new largest value), each O(1). The
// array's other writer, the Python planner (prefill: ExpertCache's lookup and admit), only ever
// raises a last use to the tick's next value, advancing the tick; where the planner finds the
// tick moved it catches up with one pass over the array (DecodePlanner's sync_order).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace {

class SlotOrder {
 public:
  explicit SlotOrder(int64_t slots)
      : slots_(slots), prev_(slots, -1), next_(slots, -1), free_((slots + 63) / 64, 0) {
    if (slots < 0 || slots > INT32_MAX) throw std::invalid_argument("slots out of range");
  }

  // The order of `last_use` ([slots]): free where -1, ties by index.
  void rebuild(const int64_t* last_use) {
    std::fill(free_.begin(), free_.end(), 0);
    free_count_ = 0;
    head_ = tail_ = -1;
    std::vector<int32_t>& used = scratch_;
    used.clear();
    for (int64_t s = 0; s < slots_; ++s) {
      if (last_use[s] < 0) {
        mark_free(int32_t(s));
      } else {
        used.push_back(int32_t(s));
      }
    }
    std::stable_sort(used.begin(), used.end(),
                     [&](int32_t a, int32_t b) { return last_use[a] < last_use[b]; });
    for (const int32_t s : used) append(s);
  }

  // The order after writes elsewhere that only raised last uses past `since` (the largest this
  // order had seen): those slots go to the back in the order of their new last uses.
  void catch_up(const int64_t* last_use, int64_t since) {
    std::vector<int32_t>& raised = scratch_;
    raised.clear();
    for (int64_t s = 0; s < slots_; ++s) {
      if (last_use[s] > since) raised.push_back(int32_t(s));
    }
    std::stable_sort(raised.begin(), raised.end(),
                     [&](int32_t a, int32_t b) { return last_use[a] < last_use[b]; });
    for (const int32_t s : raised) use(s);
  }

  // `slot`'s last use became the largest of all: it goes to the back.
  void use(int64_t slot) {
    const auto s = int32_t(slot);
    if (is_free(s)) {
      free_[s >> 6] &= ~bit(s);
      --free_count_;
    } else {
      unlink(s);
    }
    append(s);
  }

  // `slot` is free (its last use -1).
  void release(int64_t slot) {
    const auto s = int32_t(slot);
    if (is_free(s)) return;
    unlink(s);
    mark_free(s);
  }

  // The first slot in this order whose `blocked` byte is 0; -1 when there is none.
  int64_t first(const int8_t* blocked) const {
    if (free_count_ > 0) {
      for (size_t w = 0; w < free_.size(); ++w) {
        for (uint64_t bits = free_[w]; bits != 0; bits &= bits - 1) {
          const int64_t s = int64_t(w) * 64 + __builtin_ctzll(bits);
          if (!blocked[s]) return s;
        }
      }
    }
    for (int32_t s = head_; s >= 0; s = next_[s]) {
      if (!blocked[s]) return s;
    }
    return -1;
  }

  // The slots in this order (for tests).
  std::vector<int64_t> slots() const {
    std::vector<int64_t> out;
    for (size_t w = 0; w < free_.size(); ++w) {
      for (uint64_t bits = free_[w]; bits != 0; bits &= bits - 1) {
        out.push_back(int64_t(w) * 64 + __builtin_ctzll(bits));
      }
    }
    for (int32_t s = head_; s >= 0; s = next_[s]) out.push_back(s);
    return out;
  }

  // Prefetches the order's arrays into the CPU's caches.
  void warm() const {
    const auto touch = [](const void* p, size_t bytes) {
      const char* at = static_cast<const char*>(p);
      for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(at + i);
    };
    touch(prev_.data(), prev_.size() * sizeof(int32_t));
    touch(next_.data(), next_.size() * sizeof(int32_t));
    touch(free_.data(), free_.size() * sizeof(uint64_t));
  }

 private:
  static uint64_t bit(int32_t s) { return uint64_t(1) << (s & 63); }
  bool is_free(int32_t s) const { return (free_[s >> 6] & bit(s)) != 0; }

  void mark_free(int32_t s) {
    free_[s >> 6] |= bit(s);
    ++free_count_;
  }

  void unlink(int32_t s) {
    const int32_t p = prev_[s], n = next_[s];
    (p >= 0 ? next_[p] : head_) = n;
    (n >= 0 ? prev_[n] : tail_) = p;
    prev_[s] = next_[s] = -1;
  }

  void append(int32_t s) {
    prev_[s] = tail_;
    next_[s] = -1;
    (tail_ >= 0 ? next_[tail_] : head_) = s;
    tail_ = s;
  }

  const int64_t slots_;
  std::vector<int32_t> prev_, next_;  // the used slots' list, least recent at head_
  int32_t head_ = -1, tail_ = -1;
  std::vector<uint64_t> free_;  // a bit per slot: free
  int64_t free_count_ = 0;
  std::vector<int32_t> scratch_;
};

}  // namespace
