// Multi-LoRA folded into the quantized linear at a few tokens: lora.h's
// shrink and expand run inside the region of the linear (quant_linear.h)
// that writes the base rows, instead of as two ops after it.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "lora.h"
#include "prefetch.h"

namespace pagedserve {
namespace lora {

// A's rank rows per share of a folded shrink: a lone row's smallest A (rank
// 16) still splits across two threads.
constexpr int64_t kFoldCols = 8;

// lora_shrink, then lora_expand, folded into the linear that writes y's base
// rows (quant_linear.h's run at a few tokens): every thread of its region
// writes its base rows while its share of the adapter's bytes is fetched
// (ahead), takes its share of the shrink (before), waits at a barrier until
// h is whole, then adds the update to the output rows it wrote (after).
//
// Why: at one stream the two ops were two short passes on the calling thread
// after the base linear's region, ~15 us a projection of cold adapter reads
// on one core (docs/performance.md, "Where a one-stream step goes"), ~2 ms of
// a SmolLM2 step under an adapter.  Folded, both threads read the adapter's
// bytes inside the region the base weights already pay for, fetched while
// those stream (docs/performance.md, "Multi-LoRA folded").  The work is the
// two ops' own (shrink_cols, expand_cols over strips of the same slices), so
// the numbers are theirs to the bit (tests/kernels/test_lora_folded.py).
template <typename Elem>
class Folded {
 public:
  Folded(const at::Tensor& x, const at::Tensor& a_stack, const at::Tensor& b_stack, const at::Tensor& ids,
         at::OptionalIntArrayRef slices, double scale)
      : x_(reinterpret_cast<const Elem*>(x.data_ptr())),
        a_(reinterpret_cast<const Elem*>(a_stack.data_ptr())),
        b_(reinterpret_cast<const Elem*>(b_stack.data_ptr())),
        K_(x.size(1)), H_(a_stack.size(1)), N_(b_stack.size(1)), R_(b_stack.size(2)), scale_(float(scale)),
        bounds_(slice_bounds(slices, N_, H_, R_)),
        work_(runs_of(ids, x.size(0), a_stack.size(0))),
        h_(size_t(x.size(0) * H_), 0.f) {
    TORCH_CHECK_VALUE(b_stack.size(0) == a_stack.size(0), "lora: ", a_stack.size(0), " A and ", b_stack.size(0),
                      " B adapters");
  }

  // This thread's share of the shrink, items as lora_shrink's but smaller.
  void before(int64_t tid, int64_t threads) {
    share(tid, threads, [&](const Run& run, int64_t c0, int64_t cols) {
      shrink_cols(x_, K_, a_, H_, run, c0, cols, scale_, h_.data());
    });
  }

  // A thread's share of the adapter's bytes (its shrink's A rows, then B's
  // rows for its outputs `mine`), asked for into L2 a few lines per base
  // weight row as step() is called: they arrive while the weights stream,
  // instead of being waited for after them.
  class Fetch {
   public:
    Fetch(std::vector<std::pair<const char*, int64_t>> spans, int64_t rows) : spans_(std::move(spans)) {
      int64_t lines = 0;
      for (const auto& span : spans_) lines += (span.second + 63) / 64;
      per_ = (lines + std::max<int64_t>(1, rows) - 1) / std::max<int64_t>(1, rows);
    }
    void step() {
      for (int64_t i = 0; i < per_ && span_ < spans_.size(); ++i) {
        prefetch_l2(spans_[span_].first + at_);
        at_ += 64;
        if (at_ >= spans_[span_].second) ++span_, at_ = 0;
      }
    }

   private:
    std::vector<std::pair<const char*, int64_t>> spans_;
    size_t span_ = 0;
    int64_t at_ = 0, per_ = 0;
  };

  Fetch ahead(int64_t tid, int64_t threads, const std::vector<std::pair<int64_t, int64_t>>& mine) const {
    std::vector<std::pair<const char*, int64_t>> spans;
    const int64_t size = int64_t(sizeof(Elem));
    share(tid, threads, [&](const Run& run, int64_t c0, int64_t cols) {
      spans.push_back({reinterpret_cast<const char*>(a_ + (run.slot * H_ + c0) * K_), cols * K_ * size});
    });
    int64_t rows = 0;
    for (const auto& [n0, n1] : mine) {
      rows += n1 - n0;
      for (const Run& run : work_)
        spans.push_back({reinterpret_cast<const char*>(b_ + (run.slot * N_ + n0) * R_), (n1 - n0) * R_ * size});
    }
    return Fetch(std::move(spans), rows);
  }

  // The update of y's outputs in `mine` (ranges [n0, n1); y [T, N], its
  // base rows written).
  void after(Elem* y, const std::vector<std::pair<int64_t, int64_t>>& mine) const {
    if (work_.empty() || R_ == 0) return;  // rank 0 adds nothing
    std::vector<float> loader;
    const float* h = h_.data();
    if constexpr (std::is_same_v<Elem, bf16_t>) {
      loader.resize(h_.size());
      to_bf16_loader_layout(h_.data(), loader.data(), int64_t(h_.size()) / R_, R_);
      h = loader.data();
    }
    for (const auto& [n0, n1] : mine) {
      const std::vector<Strip> strips = strips_in(bounds_, R_, n0, n1);
      for (const Run& run : work_)
        for (const Strip& strip : strips) expand_cols(y, N_, h, H_, b_, R_, run, strip);
    }
  }

 private:
  // visit(run, c0, cols) for this thread's items of the shrink: rank rows
  // [c0, c0 + cols) of a run's adapter, kFoldCols at a time.
  template <typename Visit>
  void share(int64_t tid, int64_t threads, const Visit& visit) const {
    const int64_t blocks = (H_ + kFoldCols - 1) / kFoldCols, items = int64_t(work_.size()) * blocks;
    const int64_t chunk = (items + threads - 1) / threads;
    for (int64_t i = tid * chunk; i < std::min(items, (tid + 1) * chunk); ++i) {
      const int64_t c0 = (i % blocks) * kFoldCols;
      visit(work_[i / blocks], c0, std::min(kFoldCols, H_ - c0));
    }
  }

  const Elem *x_, *a_, *b_;
  int64_t K_, H_, N_, R_;
  float scale_;
  std::vector<int64_t> bounds_;
  std::vector<Run> work_;
  std::vector<float> h_;  // [T, H]: the rows without an adapter stay 0
};

}  // namespace lora
}  // namespace pagedserve
