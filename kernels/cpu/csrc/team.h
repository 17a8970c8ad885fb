// A one-stream step's layers in one OpenMP region: the other threads wait
// for work inside it, so each linear and each attention hands them a share
// without a region of its own.
//
// Why: at one token a SmolLM2 layer made five parallel regions (four
// linears, the attention), and on the 2-vCPU Zen 4 EPYC each cost ~2.9 us
// beyond its work: the second thread started ~1.3 us after the first (it
// reads the team's state from the other core before it runs) and the join
// took ~1.5 us more, ~0.4 ms of a ~3.8 ms token (docs/performance.md,
// 2026-12-04).  Inside one region a share is handed over by one counter the
// waiting threads spin on, and handed back by one flag each.
//
// Only callers that route their parallel loops here use the team
// (parallel_for and work_items.h's with_counter); any other at::parallel_for
// inside the region runs on the calling thread, as ATen runs nested loops.
// So the layer ops enter it only for steps whose other loops are a few rows
// (llama_layers: a few decode tokens, quantized weights, no adapters).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagedserve {

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

class Team {
 public:
  static constexpr int kMaxThreads = 64;

  int threads() const { return threads_; }
  bool busy() const { return busy_; }

  // f(tid) on every thread of the team, the caller as tid 0; returns when
  // all have run it, rethrowing the first exception any of them threw.
  template <typename F>
  void all(const F& f) {
    busy_ = true;
    fn_ = &f;
    call_ = [](const void* p, int tid) { (*static_cast<const F*>(p))(tid); };
    const uint64_t ticket = ++ticket_;
    posted_.store(ticket, std::memory_order_release);
    std::exception_ptr mine;
    try {
      f(0);
    } catch (...) {
      mine = std::current_exception();
    }
    for (int t = 1; t < threads_; ++t)
      while (done_[t].ticket.load(std::memory_order_acquire) != ticket) spin_pause();
    busy_ = false;
    if (mine) std::rethrow_exception(mine);
    if (failed_.load(std::memory_order_acquire)) {
      failed_.store(false, std::memory_order_relaxed);
      claimed_.store(false, std::memory_order_relaxed);
      std::rethrow_exception(std::exchange(error_, nullptr));
    }
  }

  // Where thread 1's and thread 0's shares of the next job start, `bytes`
  // of each: thread 1, waiting, fetches them into its L2 while thread 0 runs
  // the serial part before that job (a norm, RoPE and the cache's stores,
  // SiLU, the token's rounding).  Why: at one stream those parts are ~7 us
  // before each linear with the memory idle, and the worker spun through
  // ~19 % of a SmolLM2 token (docs/performance.md).  Thread 0's share is
  // read from thread 1's L2 then, sooner than from memory.  Only addresses:
  // a prefetch never faults, so a stale hint costs a wasted fetch at most.
  void hint(const void* worker_share, const void* caller_share, size_t bytes) {
    hint_[0].store(static_cast<const char*>(worker_share), std::memory_order_relaxed);
    hint_[1].store(static_cast<const char*>(caller_share), std::memory_order_relaxed);
    hint_bytes_.store(bytes, std::memory_order_relaxed);
    hinted_.fetch_add(1, std::memory_order_release);
  }

  // Thread tid (>= 1) of the region: runs every job posted until stop(),
  // fetching what hint() names while it waits.
  void serve(int tid) {
    uint64_t seen = 0, seen_hint = hinted_.load(std::memory_order_acquire);
    for (;;) {
      uint64_t ticket;
      while ((ticket = posted_.load(std::memory_order_acquire)) == seen) {
        const uint64_t hinted = hinted_.load(std::memory_order_acquire);
        if (tid == 1 && hinted != seen_hint) {
          seen_hint = hinted;
          fetch_hinted(seen);
        }
        spin_pause();
      }
      seen = ticket;
      if (stopping_) return;
      try {
        call_(fn_, tid);
      } catch (...) {
        if (!claimed_.exchange(true)) {  // the first failure is kept; all() rethrows it
          error_ = std::current_exception();
          failed_.store(true, std::memory_order_release);
        }
      }
      done_[tid].ticket.store(ticket, std::memory_order_release);
    }
  }

  void start(int threads) { threads_ = std::min(threads, kMaxThreads); }
  void stop() {
    stopping_ = true;
    posted_.store(++ticket_, std::memory_order_release);
  }

 private:
  // The hinted bytes into L2, a line at a time; a job posted meanwhile
  // stops it (checked every 1 KiB) so that the job starts on time.
  void fetch_hinted(uint64_t seen) {
    const size_t bytes = hint_bytes_.load(std::memory_order_relaxed);
    for (const auto& start : hint_) {
      const char* p = start.load(std::memory_order_relaxed);
      for (size_t at = 0; p != nullptr && at < bytes; at += 64) {
#if defined(__x86_64__) || defined(__i386__)
        _mm_prefetch(p + at, _MM_HINT_T1);
#endif
        if (at % 1024 == 0 && posted_.load(std::memory_order_relaxed) != seen) return;
      }
    }
  }

  struct alignas(64) Done {
    std::atomic<uint64_t> ticket{0};
  };
  alignas(64) std::atomic<uint64_t> posted_{0};
  uint64_t ticket_ = 0;
  int threads_ = 1;
  bool busy_ = false, stopping_ = false;
  const void* fn_ = nullptr;
  void (*call_)(const void*, int) = nullptr;
  std::atomic<bool> claimed_{false}, failed_{false};
  std::exception_ptr error_;
  Done done_[kMaxThreads];
  alignas(64) std::atomic<uint64_t> hinted_{0};
  std::atomic<const char*> hint_[2] = {};
  std::atomic<size_t> hint_bytes_{0};
};

// The team the calling thread leads, if any (only its thread 0 sees it, so a
// loop run by another thread, or nested in a share, takes ATen's way).
inline Team*& team_of_this_thread() {
  thread_local Team* team = nullptr;
  return team;
}

// The team this thread may hand work to now: none while a share is running.
inline Team* free_team() {
  Team* team = team_of_this_thread();
  return team != nullptr && !team->busy() && team->threads() > 1 ? team : nullptr;
}

// How many threads parallel_for gives n items at `grain` (each a chunk of
// ceil(n / shares) items in thread order).
inline int64_t shares(int64_t n, int64_t grain, int threads) {
  return std::min<int64_t>(threads, (n + grain - 1) / std::max<int64_t>(grain, 1));
}

// at::parallel_for, the range split as it splits it, by the team where this
// thread leads one.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* team = free_team();
  const int64_t n = end - begin;
  if (team == nullptr || n <= grain || n <= 1) return at::parallel_for(begin, end, grain, f);
  const int64_t used = shares(n, grain, team->threads()), chunk = (n + used - 1) / used;
  team->all([&](int tid) {
    const int64_t b = begin + tid * chunk;
    if (tid < used && b < end) f(b, std::min(end, b + chunk));
  });
}

// body() with the threads held in one region for its parallel loops (the
// caller's thread runs body as thread 0).  Without OpenMP, one thread, or
// inside a region already, body() as it is.
template <typename Body>
inline auto with_team(const Body& body) -> decltype(body()) {
#ifdef _OPENMP
  const int threads = at::get_num_threads();
  if (threads < 2 || at::in_parallel_region() || team_of_this_thread() != nullptr) return body();
  Team team;
  std::optional<decltype(body())> result;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      team.start(omp_get_num_threads());
      team_of_this_thread() = &team;
      try {
        result.emplace(body());
      } catch (...) {
        error = std::current_exception();
      }
      team_of_this_thread() = nullptr;
      team.stop();
    } else if (omp_get_thread_num() < Team::kMaxThreads) {
      team.serve(omp_get_thread_num());
    }
  }
  if (error) std::rethrow_exception(error);
  return std::move(*result);
#else
  return body();
#endif
}

}  // namespace pagedserve
