// Multi-LoRA: every row of a batch goes through its own adapter's low-rank
// pair, picked by row_lora_ids (-1: none), in two ops around the base linear
// (the contract of kernels/lora.py's references):
//
//   shrink   h[t] = scale * A[id[t]] @ x[t]     h [T, R] fp32, A [S, R, in]
//   expand   y[t] += B[id[t]] @ h[t]            y [T, out] in place, B [S, out, R]
//
// A fused projection (qkv_proj's q | k | v rows) may pass its slices' row
// boundaries to expand: output rows of slice i then read h's rank block i
// (h [T, n * R]), so B holds each slice's own block and no zeros.
//
// Why compiled: torch needs a gather and two matmuls per distinct id, and a
// decode batch has an id per row, so its cost is dispatch, not arithmetic.
//
// Rows of one id come in runs (a prefill chunk is one sequence): a run is a
// small GEMM that reuses its adapter's weights for all its rows while they
// are in cache; a decode row is a run of one, a GEMV (BGMV).  Work items are
// (piece of a run of at most kRunRows rows, block of weight rows: A's rank
// rows, or B's outputs within one slice).  Every (row, output) dot product
// takes the same FMAs in the same order whatever tile, item or batch it
// lands in, so a row's numbers never depend on its neighbours.
//
// At a few tokens over a quantized weight, quant_linear runs the same work
// inside its own region instead (lora_folded.h).
//
// Any width: whole pairs go through vec::load_pair (fp32, bf16, fp16 to
// fp32), then one vector of W if that many remain, the rest in scalar code.
// Products are of fp32 values, sums fp32, as the contract asks; y is
// rounded once, to its dtype.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "linear.h"  // linear::reduce_all
#include "types.h"
#include "vec.h"

namespace pagedserve {
namespace lora {

constexpr int kPair = 2 * vec::W;
// A tile's accumulators, its rows' pairs and one weight pair fit the
// register file (AVX2: 8 + 4 + 2 of 16; AVX-512: 16 + 8 + 2 of 32).
constexpr int kTileRows = vec::W == 16 ? 4 : 2;
constexpr int kTileCols = 4;
constexpr int kOneRowCols = 8;          // a lone row: more outputs, more FMAs in flight
constexpr int64_t kRunRows = 32;        // rows of a run per work item
constexpr int64_t kShrinkCols = 16;     // rank rows of A per shrink item
constexpr int64_t kExpandCols = 128;    // outputs (rows of B) per expand item
constexpr int64_t kMaxCols = std::max(kShrinkCols, kExpandCols);
// Multiply-adds worth waking a thread for (~10 us): a decode step's expand
// of one row (1,536 outputs at rank 48: 74K) stays on the calling thread.
constexpr int64_t kMinItemWork = 1 << 18;

// Rows [row0, row0 + rows) all take adapter slot `slot`.
struct Run {
  int64_t row0, rows, slot;
};

// dot[r * C + c] = x row r . w row c over K elements (x rows xs apart, w rows
// ws apart): whole pairs, then one vector if W elements remain (a rank of 16
// or 48 on AVX-512, whose pair is 32), then the rest in scalar code.
template <int R, int C, typename X, typename Wt>
inline void tile(const X* x, int64_t xs, const Wt* w, int64_t ws, int64_t K, float* dot) {
  vec::F acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vec::zero();
  const int64_t whole = K - K % kPair;
  for (int64_t k = 0; k < whole; k += kPair) {
    vec::F xa[R], xb[R];
    for (int r = 0; r < R; ++r) vec::load_pair(x + r * xs + k, xa[r], xb[r]);
    for (int c = 0; c < C; ++c) {
      vec::F wa, wb;
      vec::load_pair(w + c * ws + k, wa, wb);
      for (int r = 0; r < R; ++r) acc[r][c] = vec::fma(xb[r], wb, vec::fma(xa[r], wa, acc[r][c]));
    }
  }
  int64_t k = whole;
  if (K - k >= vec::W) {
    vec::F xa[R];
    for (int r = 0; r < R; ++r) xa[r] = vec::load_one(x + r * xs + k);
    for (int c = 0; c < C; ++c) {
      const vec::F wa = vec::load_one(w + c * ws + k);
      for (int r = 0; r < R; ++r) acc[r][c] = vec::fma(xa[r], wa, acc[r][c]);
    }
    k += vec::W;
  }
  linear::reduce_all<R * C>(&acc[0][0], dot);
  for (; k < K; ++k)  // fewer than W elements left
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r * C + c] += to_float(x[r * xs + k]) * to_float(w[c * ws + k]);
}

// R rows of x against `cols` (<= kMaxCols) weight rows: sink(r0 + r, dots)
// for each row, its `cols` dot products staged in a row: written element by
// element from the tiles, they cost more than the products at small ranks.
template <int R, int C, typename X, typename Wt, typename Sink>
void sweep(const X* x, int64_t xs, const Wt* w, int64_t ws, int64_t cols, int64_t K, int64_t r0,
           const Sink& sink) {
  float dot[R * C];
  float stage[R][kMaxCols];
  int64_t c = 0;
  for (; c + C <= cols; c += C) {
    tile<R, C>(x, xs, w + c * ws, ws, K, dot);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) stage[r][c + j] = dot[r * C + j];
  }
  for (; c < cols; ++c) {
    tile<R, 1>(x, xs, w + c * ws, ws, K, dot);
    for (int r = 0; r < R; ++r) stage[r][c] = dot[r];
  }
  for (int r = 0; r < R; ++r) sink(r0 + r, stage[r]);
}

// `rows` rows of x against `cols` weight rows: whole tiles, then a row at a time.
template <typename X, typename Wt, typename Sink>
void product(const X* x, int64_t xs, int64_t rows, const Wt* w, int64_t ws, int64_t cols, int64_t K,
             const Sink& sink) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    sweep<kTileRows, kTileCols>(x + r * xs, xs, w, ws, cols, K, r, sink);
  for (; r < rows; ++r) sweep<1, kOneRowCols>(x + r * xs, xs, w, ws, cols, K, r, sink);
}

inline void store_out(float* p, float v) { *p = v; }
inline void store_out(bf16_t* p, float v) { store_scalar(p, v); }
inline void store_out(fp16_t* p, float v) { p->bits = c10::detail::fp16_ieee_from_fp32_value(v); }

// y[i] <- dtype(y[i] + add[i]), i < n: whole pairs in vectors (add's pair
// brought into y's loader layout), the rest in scalar code; same rounding.
template <typename T>
void add_row(T* y, const float* add, int64_t n) {
  int64_t i = 0;
  for (; i + kPair <= n; i += kPair) {
    vec::F y0, y1, a0, a1;
    vec::load_pair(y + i, y0, y1);
    vec::load_pair(add + i, a0, a1);
    if constexpr (std::is_same_v<T, bf16_t>) vec::to_bf16_layout(a0, a1);
    vec::store_pair(y + i, vec::add(y0, a0), vec::add(y1, a1));
  }
  for (; i < n; ++i) store_out(y + i, to_float(y[i]) + add[i]);
}

// Runs of equal ids >= 0, cut every kRunRows rows; each id checked against the stack.
template <typename I>
std::vector<Run> runs(const I* ids, int64_t T, int64_t slots) {
  std::vector<Run> out;
  for (int64_t t = 0; t < T;) {
    const int64_t id = int64_t(ids[t]);
    TORCH_CHECK_VALUE(id >= -1 && id < slots, "lora: row ", t, " has adapter slot ", id,
                      "; expected -1 or [0, ", slots, ")");
    int64_t end = t + 1;
    while (end < T && end - t < kRunRows && int64_t(ids[end]) == id) ++end;
    if (id >= 0) out.push_back({t, end - t, id});
    t = end;
  }
  return out;
}

inline std::vector<Run> runs_of(const at::Tensor& ids, int64_t T, int64_t slots) {
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && ids.size(0) == T &&
                  (ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong),
              "lora: row_lora_ids must be a CPU int32 or int64 [T] tensor, T = ", T);
  const at::Tensor c = ids.contiguous();
  if (ids.scalar_type() == at::kInt) return runs(c.data_ptr<int32_t>(), T, slots);
  return runs(c.data_ptr<int64_t>(), T, slots);
}

// `items` work items, each about `work` multiply-adds: small calls (a decode
// step of one sequence) stay on the calling thread.
template <typename Body>
void for_items(int64_t items, int64_t work, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, kMinItemWork / std::max<int64_t>(1, work));
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) body(i);
  });
}

// h as expand multiplies it with B of type T: h itself, or for bf16 a copy
// whose pairs are in the order load_pair(bf16) delivers B's lanes (AVX
// builds split even and odd elements), so lane i of h meets lane i of B.
// (`rows` rows of R floats, src to dst.)
inline void to_bf16_loader_layout(const float* src, float* dst, int64_t rows, int64_t R) {
  const int64_t whole = R - R % kPair;
  for (int64_t t = 0; t < rows; ++t) {
    int64_t k = 0;
    for (; k < whole; k += kPair) {
      vec::F a, b;
      vec::load_pair(src + t * R + k, a, b);
      vec::to_bf16_layout(a, b);
      vec::store_pair(dst + t * R + k, a, b);
    }
    for (; k < R; ++k) dst[t * R + k] = src[t * R + k];  // the rest is read in natural order
  }
}

template <typename T>
at::Tensor in_loader_layout(const at::Tensor& h) {
  if constexpr (!std::is_same_v<T, bf16_t>) {
    return h;
  } else {
    at::Tensor out = at::empty_like(h);
    to_bf16_loader_layout(h.data_ptr<float>(), out.data_ptr<float>(), h.size(0), h.size(1));
    return out;
  }
}

// Expand's outputs [o0, o0 + cols) (at most kExpandCols), all in one slice,
// whose rank block starts at column h0 of h's rows.
struct Strip {
  int64_t o0, cols, h0;
};

// The slices' row bounds (n + 1 of them, rising from 0 to N), checked
// against h's width: n slices of rank R.  No slices: one slice of every output.
inline std::vector<int64_t> slice_bounds(at::OptionalIntArrayRef slices, int64_t N, int64_t H, int64_t R) {
  std::vector<int64_t> bounds{0, N};
  if (slices.has_value()) bounds.assign(slices->begin(), slices->end());
  const int64_t n = int64_t(bounds.size()) - 1;
  TORCH_CHECK_VALUE(n >= 1 && bounds[0] == 0 && bounds[n] == N, "lora_expand: slices ",
                    c10::IntArrayRef(bounds), " must rise from 0 to out = ", N);
  TORCH_CHECK_VALUE(H == n * R, "lora_expand: h is ", H, " wide; ", n, " slices of rank ", R, " need ",
                    n * R);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(bounds[i] < bounds[i + 1], "lora_expand: slices ", c10::IntArrayRef(bounds),
                      " must rise from 0 to out = ", N);
  return bounds;
}

// The strips of outputs [n0, n1), slice by slice: a strip never straddles two
// slices, so its outputs share one block of h.
inline std::vector<Strip> strips_in(const std::vector<int64_t>& bounds, int64_t R, int64_t n0, int64_t n1) {
  std::vector<Strip> out;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t hi = std::min(n1, bounds[i + 1]);
    for (int64_t o = std::max(n0, bounds[i]); o < hi; o += kExpandCols)
      out.push_back({o, std::min(kExpandCols, hi - o), int64_t(i) * R});
  }
  return out;
}

// Shrink's rank rows [c0, c0 + cols) of `run`'s adapter (A [S, R, K]) for
// the run's rows of x [T, K]: h [T, R] fp32.
template <typename Elem>
inline void shrink_cols(const Elem* x, int64_t K, const Elem* a, int64_t R, const Run& run, int64_t c0,
                        int64_t cols, float scale, float* h) {
  float* out = h + run.row0 * R + c0;
  product(x + run.row0 * K, K, run.rows, a + (run.slot * R + c0) * K, K, cols, K,
          [&](int64_t r, const float* dots) {
            for (int64_t c = 0; c < cols; ++c) out[r * R + c] = scale * dots[c];
          });
}

// Expand's strip of outputs for `run`'s rows: y [T, N] += B [S, N, R] @ the
// strip's rank block of h [T, H] (in B's loader layout).
template <typename Elem>
inline void expand_cols(Elem* y, int64_t N, const float* h, int64_t H, const Elem* b, int64_t R, const Run& run,
                        const Strip& strip) {
  Elem* out = y + run.row0 * N + strip.o0;
  product(h + run.row0 * H + strip.h0, H, run.rows, b + (run.slot * N + strip.o0) * R, R, strip.cols, R,
          [&](int64_t r, const float* dots) { add_row(out + r * N, dots, strip.cols); });
}

template <typename F>
void dispatch(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(bf16_t{}); break;
    case at::kHalf: f(fp16_t{}); break;
    default: TORCH_CHECK_VALUE(false, "lora: unsupported dtype ", dtype, " (float32, bf16, fp16)");
  }
}

// A stack of S adapters' [rows, width] matrices, of `dtype`, packed.
inline void check_stack(const at::Tensor& s, at::ScalarType dtype, int64_t width, const char* what) {
  TORCH_CHECK(s.device().is_cpu() && s.dim() == 3 && s.is_contiguous() && s.scalar_type() == dtype,
              what, " must be a contiguous CPU [S, rows, width] tensor of the rows' dtype");
  TORCH_CHECK(s.size(2) == width, what, " rows are ", s.size(2), " wide, expected ", width);
}

}  // namespace lora

// x [T, in], A [S, R, in] (same dtype), ids [T]: h [T, R] fp32, h[t] =
// scale * A[ids[t]] @ x[t]; rows with id -1 are 0.
inline at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& ids,
                              double scale) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "lora_shrink: x must be a contiguous CPU [T, in] tensor");
  lora::check_stack(lora_a, x.scalar_type(), x.size(1), "lora_shrink: lora_a_stack");
  const int64_t T = x.size(0), K = x.size(1), R = lora_a.size(1);
  const std::vector<lora::Run> work = lora::runs_of(ids, T, lora_a.size(0));
  at::Tensor h = at::zeros({T, R}, x.options().dtype(at::kFloat));
  const int64_t blocks = (R + lora::kShrinkCols - 1) / lora::kShrinkCols;
  if (work.empty() || blocks == 0) return h;
  float* hp = h.data_ptr<float>();
  const float s = float(scale);
  const int64_t per_item = T * R * K / int64_t(work.size() * blocks);
  lora::dispatch(x.scalar_type(), [&](auto tag) {
    using Elem = decltype(tag);
    const Elem* xp = reinterpret_cast<const Elem*>(x.data_ptr());
    const Elem* ap = reinterpret_cast<const Elem*>(lora_a.data_ptr());
    lora::for_items(int64_t(work.size()) * blocks, per_item, [&](int64_t i) {
      const int64_t c0 = (i % blocks) * lora::kShrinkCols;
      lora::shrink_cols(xp, K, ap, R, work[i / blocks], c0, std::min(lora::kShrinkCols, R - c0), s, hp);
    });
  });
  return h;
}

// y [T, out] (in place), h [T, n * R] fp32, B [S, out, R] (y's dtype), ids
// [T], slices (n + 1 row boundaries; none: n = 1): y[t, rows of slice i] +=
// B[ids[t], those rows] @ h[t, block i], summed in fp32 and rounded once;
// rows with id -1 untouched.  Returns y.
inline at::Tensor lora_expand(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                              const at::Tensor& ids, at::OptionalIntArrayRef slices = std::nullopt) {
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.is_contiguous(),
              "lora_expand: y must be a contiguous CPU [T, out] tensor");
  TORCH_CHECK(h.device().is_cpu() && h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat &&
                  h.size(0) == y.size(0),
              "lora_expand: h must be a contiguous CPU float32 [T, n * R] tensor, T = y's rows");
  TORCH_CHECK(lora_b.dim() == 3, "lora_expand: lora_b_stack must be [S, out, R]");
  lora::check_stack(lora_b, y.scalar_type(), lora_b.size(2), "lora_expand: lora_b_stack");
  TORCH_CHECK(lora_b.size(1) == y.size(1), "lora_expand: lora_b_stack has ", lora_b.size(1),
              " outputs, y ", y.size(1));
  const int64_t T = y.size(0), N = y.size(1), H = h.size(1), R = lora_b.size(2);
  const std::vector<lora::Strip> strips = lora::strips_in(lora::slice_bounds(slices, N, H, R), R, 0, N);
  const std::vector<lora::Run> work = lora::runs_of(ids, T, lora_b.size(0));
  const int64_t count = int64_t(strips.size());
  if (work.empty() || count == 0 || R == 0) return y;  // rank 0 adds nothing
  const int64_t per_item = T * N * R / int64_t(work.size() * count);
  lora::dispatch(y.scalar_type(), [&](auto tag) {
    using Elem = decltype(tag);
    // Reordered block by block (rows of R): product reads each slice's block
    // from its first column, so its pairs must start there, not at h's.
    const at::Tensor hl = lora::in_loader_layout<Elem>(h.view({T * H / R, R}));
    const float* hp = hl.data_ptr<float>();
    Elem* yp = reinterpret_cast<Elem*>(y.data_ptr());
    const Elem* bp = reinterpret_cast<const Elem*>(lora_b.data_ptr());
    lora::for_items(int64_t(work.size()) * count, per_item, [&](int64_t i) {
      const lora::Strip& strip = strips[i % count];
      lora::expand_cols(yp, N, hp, H, bp, R, work[i / count], strip);
    });
  });
  return y;
}

}  // namespace pagedserve
