// Jobs of independent tasks and the persistent pool of worker threads that runs them.
// Included by cpu_experts.cpp only (one translation unit): internal linkage, like the rest.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include "prefetch_hint.h"
#include "simd.h"

namespace {

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
// `idle`, where given, is called between polls instead of a pause and says whether it did some
// work (a worker fetching its share of a hint, a task running an owned task nobody has taken).
struct NoIdleWork {
  bool operator()() const { return false; }
};
template <class Ready, class Idle = NoIdleWork>
bool spin_until(Ready ready, std::chrono::nanoseconds limit = std::chrono::nanoseconds::max(),
                Idle idle = {}) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    for (int i = 0; i < 32; ++i) {
      if (ready()) return true;
      if (!idle()) cpu_relax();
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


// How long a task may be in flight before a worker with nothing else to do runs it again, by
// default (Job::redo_stalled): a task streams about 96 KiB in tens of microseconds, while a worker
// whose core the OS or the hypervisor took holds its task for milliseconds. Several times a
// task's run is long enough that a task running normally is not run twice, and short enough to
// win back most of a stall under steal or another busy program; a shorter limit was no faster
// (docs/performance.md).
constexpr int kDefaultRedoUs = 150;

// A counter alone on its cache line, so that threads updating or spinning on it do not slow down
// those using its neighbours.
struct alignas(64) Counter {
  std::atomic<int64_t> value{0};
};

// -------------------------------------------------------------------------------------------------
// Jobs and the persistent pool.

class Job {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~Job() = default;

  // Claims and runs tasks until none is left; returns when this job has nothing more to hand out.
  // Pool worker `worker` of `workers` first runs its own tasks (set_owned), then claims the
  // others in order, then any owned task that no owner has taken. A pool worker's tasks are timed
  // (worker_seconds).
  void work(int worker = -1, int workers = 1) {
    bool first = true;
    auto run = [&](int64_t i) {
      const Clock::time_point t0 = Clock::now();
      if (first) {
        const int64_t since = ns(t0 - queued_at_);
        int64_t seen = last_start_ns_.load(std::memory_order_relaxed);
        while (since > seen && !last_start_ns_.compare_exchange_weak(seen, since)) {
        }
        first = false;
      }
      run_claimed(i, t0, true, false);
    };
    if (worker >= 0) {
      for (int64_t t = worker; t < owned_; t += workers) {
        if (claim_owned(t)) run(t);
      }
    }
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < num_tasks_;) run(i);
    for (int64_t t = 0; t < owned_; ++t) {
      if (claim_owned(t)) run(t);
    }
  }
  // Tasks [0, n) belong to the pool's workers, task t to worker t % workers, before the job is
  // queued: a worker that fetched its tasks' weights into its own cache while it waited for the
  // job (Pool::hint) reads them from there. The others claim tasks from n on; an owned task that
  // no owner has taken once they are all handed out goes to whoever comes first.
  void set_owned(int64_t n) {
    n = std::clamp<int64_t>(n, 0, num_tasks_);
    owned_claims_.reset(new std::atomic<bool>[size_t(std::max<int64_t>(1, n))]);
    for (int64_t t = 0; t < n; ++t) owned_claims_[t].store(false, std::memory_order_relaxed);
    owned_ = n;
    next_.store(n, std::memory_order_relaxed);
  }
  // Claims and runs tasks while more than `keep` are left to hand out: a thread that is not one
  // of the pool's helps with a job, leaving its last tasks to the workers (it may have other work
  // to get back to, and it should not be the one that ends the job late).
  void help(int64_t keep) {
    for (int64_t i = next_.load(std::memory_order_relaxed); num_tasks_ - i > keep;) {
      if (!next_.compare_exchange_weak(i, i + 1, std::memory_order_relaxed)) continue;
      run_claimed(i, Clock::now(), false, false);
      i = next_.load(std::memory_order_relaxed);
    }
  }
  bool done() const { return done_.load(std::memory_order_acquire); }

  // Whether a task of this job may be run again by another thread (redo_stalled): only where
  // everything its tasks read outlives the job, since the thread that began a task runs it to
  // the end even once the job is done, and where the pool that queued it redoes tasks.
  bool redoable() const { return redoable_ && redo_after_.count() > 0; }
  // The tasks that a thread other than the one that began them finished first (redo_stalled).
  int64_t redone() const { return redone_.load(std::memory_order_relaxed); }

  // Runs again the earliest task that a thread began longer than the pool's redo time ago
  // (Pool::redo_us) and has not finished (the OS took that thread's core; a thread kept on one
  // CPU waits for that CPU), so that the job ends without it; says whether it ran one. For a
  // thread with nothing else of this job to do: its pool's worker that has handed out all of
  // it, or one of its tasks waiting for earlier ones (timed = false: that task counts the time;
  // only tasks below `below`, which wait for nothing that task could). The first of the two runs
  // to finish writes the results (commit); the other writes nothing. Only the tasks that wait
  // for no other (ready_tasks) are run again. Scans at most every redo time / 4.
  bool redo_stalled(bool timed = true, int64_t below = INT64_MAX) {
    if (!redoable() || done()) return false;
    const Clock::time_point t0 = Clock::now();
    const int64_t now = stamp(t0), after = redo_after_.count();
    int64_t next_scan = next_scan_ns_.load(std::memory_order_relaxed);
    if (now < next_scan ||
        !next_scan_ns_.compare_exchange_strong(next_scan, now + after / 4,
                                               std::memory_order_relaxed)) {
      return false;
    }
    const int64_t limit = std::min(below, ready_tasks());
    int64_t i = oldest_.load(std::memory_order_relaxed);
    while (i < limit && began_[i].load(std::memory_order_relaxed) == kFinished) ++i;
    oldest_.store(i, std::memory_order_relaxed);  // only ever behind the finished tasks
    for (; i < limit; ++i) {
      int64_t began = began_[i].load(std::memory_order_relaxed);
      if (began <= 0 || now - began < after) continue;  // finished, not begun, or recent
      if (!began_[i].compare_exchange_strong(began, now, std::memory_order_relaxed)) continue;
      run_claimed(i, t0, timed, true);
      return true;
    }
    return false;
  }
  // Tasks not handed out yet.
  int64_t unclaimed() const {
    int64_t owned_left = 0;
    for (int64_t t = 0; t < owned_; ++t) {
      owned_left += owned_claims_[t].load(std::memory_order_relaxed) ? 0 : 1;
    }
    return std::max<int64_t>(0, num_tasks_ - next_.load(std::memory_order_relaxed)) + owned_left;
  }

  // By the pool that queues the job: when, and how long a task may be in flight before it is
  // run again (0: never).
  void mark_queued(std::chrono::nanoseconds redo_after) {
    queued_at_ = Clock::now();
    redo_after_ = redo_after;
  }

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

  // The pool's workers in this job: seconds from queueing to the last one's first task (how
  // together they began), and the seconds they spent in tasks, all together (divided by the
  // workers times the run, the share of their time the job kept busy; a task's wait for the
  // gate/up rows it needs counts as in it). Both 0 until the job is done.
  std::pair<double, double> worker_seconds() const {
    if (!done() || num_tasks_ == 0) return {0.0, 0.0};
    return {1e-9 * double(last_start_ns_.load(std::memory_order_relaxed)),
            1e-9 * double(busy_ns_.load(std::memory_order_relaxed))};
  }

  // Where a job of two phases spent its run: seconds from its first task to the end of its first
  // phase, and the seconds its tasks waited for the first phase, all threads together (an expert
  // job's down projection for the gate/up rows). Both 0 for a job of one phase, and until done.
  virtual std::pair<double, double> phase_seconds() const { return {0.0, 0.0}; }
  // Whether the job's dot products were vdpbf16ps's (bf16dot.h).
  virtual bool bf16_dot() const { return false; }

  void wait() {
    // The caller usually waits for well under a millisecond: spin a little before sleeping.
    if (spin_until([this] { return done(); }, kWaiterSpin)) return;
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return done(); });
  }

 protected:
  // Runs one owned task that no owner has taken yet, if there is one, and says whether it did: a
  // task that waits for earlier ones calls it, so that an owner late to the job (still in the
  // job before, or asleep) never holds the job up. Untimed: the caller's task counts it.
  bool run_unowned() {
    for (int64_t t = 0; t < owned_; ++t) {
      if (claim_owned(t)) {
        run_claimed(t, Clock::now(), false, false);
        return true;
      }
    }
    return false;
  }
  void set_num_tasks(int64_t n) {
    num_tasks_ = n;
    if (n > began_room_) {
      began_.reset(new std::atomic<int64_t>[size_t(n)]);
      began_room_ = n;
    }
    for (int64_t i = 0; i < n; ++i) began_[i].store(0, std::memory_order_relaxed);
    oldest_.store(0, std::memory_order_relaxed);
    if (n == 0) done_.store(true, std::memory_order_release);
  }
  // Before the job is queued (redoable).
  void set_redoable(bool redoable) { redoable_ = redoable; }
  // Runs task i: computes its results where no other thread reads them, then, if commit(i) says
  // this is the first run of it to finish, writes them where the job's readers (its later
  // tasks, its caller) find them and returns true; otherwise writes nothing and returns false (a
  // run of a stalled task, redo_stalled, finished first).
  virtual bool run_task(int64_t i) = 0;
  // Whether this run of task i is the first to finish it (see run_task); once per run.
  bool commit(int64_t i) {
    int64_t began = began_[i].load(std::memory_order_relaxed);
    while (began != kFinished) {
      if (began_[i].compare_exchange_weak(began, kFinished, std::memory_order_acq_rel)) return true;
    }
    return false;
  }
  // Task i, in flight, waited for other tasks until t: its run counts as begun at t for
  // redo_stalled (unless it has finished, or another run of it began since).
  void restart(int64_t i, Clock::time_point t) {
    int64_t began = began_[i].load(std::memory_order_relaxed);
    if (began > 0 && began < stamp(t)) {
      began_[i].compare_exchange_strong(began, stamp(t), std::memory_order_relaxed);
    }
  }
  // The tasks [0, n) that wait for no task not finished yet: redo_stalled runs only these again.
  virtual int64_t ready_tasks() const { return num_tasks_; }
  // When task 0 was claimed; read only once the job is done.
  Clock::time_point started_at() const { return started_; }

 private:
  // Takes owned task t unless someone has; says whether this caller did.
  bool claim_owned(int64_t t) {
    return !owned_claims_[t].load(std::memory_order_relaxed) &&
           !owned_claims_[t].exchange(true, std::memory_order_acq_rel);
  }
  // Runs task i, claimed at t0 (redo: again, redo_stalled); timed: a pool worker's, added to
  // busy_ns_ (before the task counts as finished, so that a finished job's sum is whole). Only
  // the run that finishes it first counts.
  void run_claimed(int64_t i, Clock::time_point t0, bool timed, bool redo) {
    if (!redo) began_[i].store(stamp(t0), std::memory_order_relaxed);
    // the first task to start times the run (with owned tasks, task 0 need not be it)
    if (!started_once_.load(std::memory_order_relaxed) &&
        !started_once_.exchange(true, std::memory_order_relaxed)) {
      started_ = t0;
    }
    if (!run_task(i)) return;
    if (redo) redone_.fetch_add(1, std::memory_order_relaxed);
    if (timed) busy_ns_.fetch_add(ns(Clock::now() - t0), std::memory_order_relaxed);
    if (finished_.fetch_add(1, std::memory_order_acq_rel) + 1 == num_tasks_) signal_done();
  }
  static int64_t ns(Clock::duration d) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
  }
  // A time as began_ holds it: nanoseconds of the steady clock, never 0 or kFinished.
  static int64_t stamp(Clock::time_point t) { return std::max<int64_t>(1, ns(t.time_since_epoch())); }
  static constexpr int64_t kFinished = -1;

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

  // Written before the job is queued, by the thread that claims task 0, and by the one that
  // finishes the last task; read only once done_ is set (release/acquire orders them).
  Clock::time_point queued_at_{}, started_{}, finished_at_{};
  // Each counter on a cache line of its own: every worker updates them, the caller spins on done_.
  int64_t num_tasks_ = 0;
  int64_t* done_flag_ = nullptr;  // set before the job is queued
  int64_t done_value_ = 0;
  int64_t owned_ = 0;  // tasks [0, owned_) belong to the workers (set_owned)
  std::unique_ptr<std::atomic<bool>[]> owned_claims_;
  bool redoable_ = false;  // set before the job is queued
  std::chrono::nanoseconds redo_after_{0};  // set as it is queued
  // per task: 0 until begun, then when its latest run began (stamp), kFinished once committed
  std::unique_ptr<std::atomic<int64_t>[]> began_;
  int64_t began_room_ = 0;
  std::atomic<bool> started_once_{false};
  // redo_stalled's: the tasks before oldest_ are finished; no scan before next_scan_ns_
  alignas(64) std::atomic<int64_t> oldest_{0};
  std::atomic<int64_t> next_scan_ns_{0};
  std::atomic<int64_t> redone_{0};
  alignas(64) std::atomic<int64_t> next_{0};
  alignas(64) std::atomic<int64_t> finished_{0};
  alignas(64) std::atomic<bool> done_{false};
  // each worker adds to these once per task (busy) or once per job (the last start)
  alignas(64) std::atomic<int64_t> busy_ns_{0};
  std::atomic<int64_t> last_start_ns_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
};

// The weight bytes a task of an expert job aims at, by default: small enough to balance 16 threads
// over one expert, large enough that claiming a task costs nothing next to streaming it.
constexpr int64_t kDefaultTaskBytes = 96 * 1024;

class Pool {
 public:
  // cpus: empty (the OS places the workers), or one logical CPU per worker, which it stays on.
  // redo_us: how long a task of a redoable job may be in flight before an idle worker runs it
  // again (Job::redo_stalled; 0: never).
  explicit Pool(int num_threads, int spin_us = kDefaultWorkerSpinUs,
                int64_t task_bytes = kDefaultTaskBytes, std::vector<int> cpus = {},
                int redo_us = kDefaultRedoUs)
      : num_threads_(num_threads), spin_(spin_us), task_bytes_(task_bytes) {
    if (num_threads < 1) throw std::invalid_argument("num_threads must be at least 1");
    if (spin_us < 0) throw std::invalid_argument("spin_us must be 0 or more");
    set_redo_us(redo_us);
    if (task_bytes < 1024) throw std::invalid_argument("task_bytes must be 1024 or more");
    if (!cpus.empty() && int(cpus.size()) != num_threads) {
      throw std::invalid_argument("cpus must name one CPU per thread (" +
                                  std::to_string(num_threads) + "), got " +
                                  std::to_string(cpus.size()));
    }
    workers_.reserve(num_threads);
    for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
    for (size_t i = 0; i < cpus.size(); ++i) {
      const std::string err = pin(workers_[i], cpus[i]);
      if (!err.empty()) {
        close();
        throw std::invalid_argument("cannot pin a worker to CPU " + std::to_string(cpus[i]) +
                                    ": " + err);
      }
    }
  }
  ~Pool() { close(); }

  int num_threads() const { return num_threads_; }
  // Each worker's allowed logical CPUs, as the OS has them (empty lists where it cannot tell).
  std::vector<std::vector<int>> worker_cpus() {
    std::vector<std::vector<int>> result;
    for (auto& w : workers_) {
      std::vector<int> allowed;
#ifdef __linux__
      cpu_set_t set;
      CPU_ZERO(&set);
      if (pthread_getaffinity_np(w.native_handle(), sizeof set, &set) == 0) {
        for (int c = 0; c < CPU_SETSIZE; ++c) {
          if (CPU_ISSET(c, &set)) allowed.push_back(c);
        }
      }
#endif
      result.push_back(allowed);
    }
    return result;
  }
  // The weight bytes each task of the expert jobs on this pool aims at.
  int64_t task_bytes() const { return task_bytes_; }

  // How long a task of a redoable job may be in flight before an idle worker runs it again
  // (0: never); may change while jobs run.
  int redo_us() const { return int(redo_ns_.load(std::memory_order_relaxed) / 1000); }
  void set_redo_us(int redo_us) {
    if (redo_us < 0) throw std::invalid_argument("redo_us must be 0 or more");
    redo_ns_.store(int64_t(redo_us) * 1000, std::memory_order_relaxed);
  }

  // What each worker will read in a job still to come, for it to fetch while it waits
  // (PrefetchHint::set: ranges [w * per_worker, (w + 1) * per_worker) are worker w's). One
  // thread at a time may give hints.
  void hint(const std::pair<const void*, int64_t>* ranges, int n, int per_worker) {
    hint_.set(ranges, n, per_worker);
  }

  // The hint the workers fetch now (PrefetchHint::read; for tests).
  std::pair<std::vector<std::pair<uintptr_t, int64_t>>, int> hinted() const { return hint_.read(); }

  void push(std::shared_ptr<Job> job) {
    if (job->done()) return;
    if ((reinterpret_cast<uintptr_t>(job.get()) >> kVersionShift) != 0) {
      throw std::runtime_error("a job's address does not fit the pool's head word");
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_.load(std::memory_order_relaxed)) {
        throw std::runtime_error("this CpuExpertRunner is closed");
      }
      job->mark_queued(std::chrono::nanoseconds(redo_ns_.load(std::memory_order_relaxed)));
      queue_.push_back(std::move(job));
      if (queue_.size() == 1) publish_head();
    }
    cv_.notify_all();  // for workers that slept; spinning ones see the head word change
  }

  // Finishes the queued jobs, then ends the workers.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_.load(std::memory_order_relaxed) && workers_.empty()) return;
      stopping_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
    retired_.clear();
  }

 private:
  // What a worker's job is while it may still touch it (see worker_loop and retire).
  struct alignas(64) Hazard {
    std::atomic<Job*> job{nullptr};
  };

  // The queue's first job is published in one word, its address under a version that changes
  // with every publication, so that workers find it without the mutex (taking turns on a mutex,
  // a pool's workers would begin a job one after another) and tell a new job from the one they
  // just left even when it has the same address.
  static constexpr int kVersionShift = 48;
  static Job* job_of(uint64_t word) {
    return reinterpret_cast<Job*>(uintptr_t(word & ((uint64_t(1) << kVersionShift) - 1)));
  }
  // Under the mutex: the queue's front (or none) becomes the head.
  void publish_head() {
    ++version_;
    const Job* front = queue_.empty() ? nullptr : queue_.front().get();
    head_.store((version_ << kVersionShift) | uint64_t(reinterpret_cast<uintptr_t>(front)),
                std::memory_order_seq_cst);
  }

  // Keeps thread t on logical CPU `cpu`; returns why not, or "" once done.
  static std::string pin(std::thread& t, int cpu) {
#ifdef __linux__
    if (cpu < 0 || cpu >= CPU_SETSIZE) return "no such CPU";
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    const int err = pthread_setaffinity_np(t.native_handle(), sizeof set, &set);
    return err == 0 ? "" : std::string(std::strerror(err));
#else
    (void)t;
    (void)cpu;
    return "pinning threads is supported on Linux only";
#endif
  }

  // The next head word this worker has not worked on (0 once the pool stops with nothing queued):
  // spins for spin_, then sleeps until a push or close. While it spins it runs the stalled tasks
  // of `watched` (the job it worked on last, which its hazard keeps alive; Job::redo_stalled)
  // until that job is done, and fetches its share of the hint; it lets go of the job (sets it to
  // null, and its hazard) once the job is done or before it sleeps.
  uint64_t next_head(uint64_t seen, int index, PrefetchHint::Cursor& cursor, Hazard& hazard,
                     Job*& watched) {
    uint64_t word = 0;
    auto fresh = [&] {
      word = head_.load(std::memory_order_acquire);
      return (word != seen && job_of(word) != nullptr) ||
             stopping_.load(std::memory_order_acquire);
    };
    auto let_go = [&] {
      watched = nullptr;
      hazard.job.store(nullptr, std::memory_order_release);
    };
    auto idle = [&] {
      if (watched != nullptr) {
        if (watched->done()) {
          let_go();
        } else if (watched->redo_stalled()) {
          return true;
        }
      }
      return hint_.fetch_some(index, cursor);
    };
    if (!spin_until(fresh, spin_, idle)) {
      let_go();
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, fresh);
    }
    return word;
  }

  void worker_loop(int index) {
    Hazard& hazard = hazards_[index];
    PrefetchHint::Cursor cursor;
    Job* watched = nullptr;
    for (uint64_t seen = 0;;) {
      const uint64_t word = next_head(seen, index, cursor, hazard, watched);
      cursor.stop();  // a job came: what was hinted for it is its own to read now
      Job* job = job_of(word);
      if (job == nullptr) return;  // stopping, nothing queued
      // The job stays alive while this worker's hazard names it: whoever retires it frees it
      // only once no hazard does. Announce first, then check it is still the head.
      hazard.job.store(job, std::memory_order_seq_cst);
      watched = nullptr;
      if (head_.load(std::memory_order_seq_cst) != word) {
        hazard.job.store(nullptr, std::memory_order_release);
        continue;
      }
      seen = word;
      job->work(index, num_threads_);
      retire(word);
      // a redoable job stays named by the hazard, for its stalled tasks, until it is done
      if (job->redoable()) {
        watched = job;
      } else {
        hazard.job.store(nullptr, std::memory_order_release);
      }
    }
  }

  // The job of head word `word` has no task left to hand out: the first worker back takes it off
  // the queue, publishes the next, and frees the jobs retired before that no worker still runs.
  void retire(uint64_t word) {
    std::vector<std::shared_ptr<Job>> unused;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (head_.load(std::memory_order_relaxed) != word) return;
      retired_.push_back(std::move(queue_.front()));
      queue_.pop_front();
      publish_head();
      for (auto it = retired_.begin(); it != retired_.end();) {
        const bool held =
            std::any_of(hazards_.get(), hazards_.get() + num_threads_, [&](const Hazard& h) {
              return h.job.load(std::memory_order_seq_cst) == it->get();
            });
        if (held) {
          ++it;
        } else {
          unused.push_back(std::move(*it));
          it = retired_.erase(it);
        }
      }
    }
    // the jobs' last references (if the caller dropped its own) go here, outside the mutex
  }

  const int num_threads_;
  const std::chrono::microseconds spin_;
  const int64_t task_bytes_;
  std::atomic<int64_t> redo_ns_{0};
  std::unique_ptr<Hazard[]> hazards_{new Hazard[size_t(num_threads_)]};
  std::vector<std::thread> workers_;
  std::deque<std::shared_ptr<Job>> queue_;    // under mutex_
  std::vector<std::shared_ptr<Job>> retired_;  // off the queue, maybe still run; under mutex_
  uint64_t version_ = 0;                       // under mutex_
  alignas(64) std::atomic<uint64_t> head_{0};  // version << kVersionShift | the front job
  alignas(64) std::atomic<bool> stopping_{false};
  PrefetchHint hint_;
  // Spinning workers read head_ and stopping_ on every poll: the mutex and the condition variable
  // that push() writes are on lines of their own, so that queueing a job takes their lines from
  // no other core (only head_'s store reaches the spinners).
  alignas(64) std::mutex mutex_;
  alignas(64) std::condition_variable cv_;
};

}  // namespace
