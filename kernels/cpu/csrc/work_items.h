// A parallel region's work handed out one item at a time: the attention
// kernels' items and the linears' strips.
//
// Why not at::parallel_for's split into equal parts up front: on two cores a
// region ends when its slower thread does, and the threads are seldom equal:
// the second starts a few microseconds late, a core shared with another
// tenant runs slower for a while, and a linear split part by part (q, k and
// v of one blob) paid that at every part.  Serving 32 streams of a
// Qwen3-0.6B Q4_K_M file, 3 % of the engine thread's samples and 9 % of the
// worker's were libgomp's barrier spin on a quiet minute, 17-19 % of each
// with another process running; with the strips of every part taken from one
// counter the 32-stream workload gave 1.15-1.41x the output tokens/s
// (docs/performance.md).  No output moves: an item writes its own rows with
// the same arithmetic whichever thread runs it.
//
// Not the one-token rows (quant_linear.h): there a thread's rows are one
// stream through memory, and cut into chunks they took 1.02-1.09x the time
// of equal halves (each chunk restarts the prefetch streams).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "team.h"

namespace pagedserve {

// Each of min(threads, count) threads makes its own scratch once and runs
// take(scratch, next) with the counter the threads share.
template <typename Make, typename Take>
void with_counter(int64_t count, const Make& make, const Take& take) {
  if (count == 0) return;
  std::atomic<int64_t> next{0};
  if (Team* team = free_team(); team != nullptr && count > 1) {  // a layer stack's region (team.h)
    const int64_t threads = std::min<int64_t>(team->threads(), count);
    team->all([&](int tid) {
      if (tid >= threads) return;
      auto scratch = make();
      take(scratch, next);
    });
    return;
  }
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto scratch = make();
    take(scratch, next);
  });
}

// Items 0 .. count - 1 taken one at a time from a shared counter (callers
// put the longest first).
template <typename Make, typename Run>
void run_items(int64_t count, const Make& make, const Run& run) {
  with_counter(count, make, [&](auto& scratch, std::atomic<int64_t>& next) {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) run(scratch, i);
  });
}

// The same, but a thread claims its next item before it runs the one in
// hand, and run(scratch, i, next) is told it (-1: none), so an item can
// prefetch the next one's bytes while it computes (quant_vnni.h).  The
// price: a thread may hold the last item while another has run out of work
// (up to one item's imbalance at the end), so only the int8 strips, whose
// prefetch measured worth it, take this form.
template <typename Make, typename Run>
void run_items_ahead(int64_t count, const Make& make, const Run& run) {
  with_counter(count, make, [&](auto& scratch, std::atomic<int64_t>& next) {
    for (int64_t i = next.fetch_add(1); i < count;) {
      const int64_t after = next.fetch_add(1);
      run(scratch, i, after < count ? after : -1);
      i = after;
    }
  });
}

}  // namespace pagedserve
