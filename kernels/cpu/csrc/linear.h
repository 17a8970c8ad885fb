// Linear layers with bf16 weights: y = x W^T (+ bias), accumulated in fp32.
//
// Why: a decode step of a small batch reads every weight once per token, so
// on the CPU its time is the weights' bytes over memory bandwidth.  bf16 halves
// fp32's bytes, but without AVX512-BF16 torch's bf16 matmul is slow (about 5x
// fp32 at 32 rows on an AVX2 machine).  A bf16 weight becomes an fp32 with one
// shift or one and (vec::load_pair), so this op reads bf16 and multiplies
// with fp32 FMAs: bf16's bytes at fp32's speed.
//
// x (fp32 or bf16) is rearranged once per call into the order in which
// load_pair delivers the weights, so lane i of a weight vector always meets
// the x element it multiplies (AVX2 shown; pair_order() asks the build):
//
//   16 weights   w0 w1 w2 ... w15   --load_pair-->  [w0 w2 ... w14] [w1 w3 ... w15]
//   16 of x      x0 x1 x2 ... x15   --once------->  [x0 x2 ... x14] [x1 x3 ... x15]
//
// Blocking (rows of x are tokens, rows of W output features):
//
//   for each chunk of kChunkRows tokens            the chunk's x stays in L2
//     threads split the weight rows in strips      a strip (kStripCols rows) stays in L2
//       for each panel of kRows tokens             the panel's x stays in L1
//         for each tile of kCols weight rows       kRows x kCols fp32 accumulators
//           walk K a pair at a time: 2 kCols weight vectors, 2 FMAs per (row, col)
//
// A tile's accumulators, one half-pair of weight vectors and one x vector
// fit the register file (AVX2: 12 + 2 + 1 of 16; AVX-512: 24 + 3 + 1 of 32),
// so every weight vector loaded serves kRows tokens and every x vector kCols
// features.  Each accumulator takes two dependent FMAs per pair, so a tile
// needs more accumulators than the FMA latency x issue width (5 x 2 on
// recent x86) to keep both FMA units busy: 4 x 2 ran at 61 GFLOP/s per core
// here, latency-bound; 6 x 2 is not.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "vec.h"
#include "work_items.h"

namespace pagedserve {
namespace linear {

constexpr int kPairLen = 2 * vec::W;        // in_features must be a multiple of this
constexpr int kRows = vec::W == 16 ? 8 : 6;  // tokens per tile
constexpr int kCols = vec::W == 16 ? 3 : 2;  // weight rows per tile
constexpr int kOneRowCols = 6;              // one token: more features, more FMAs in flight
// Every (token, feature) sum runs the same FMAs in the same order whatever
// tile it lands in, so a sequence's numbers never depend on its batch.
constexpr int64_t kStripCols = 16 * kCols;  // weight rows per work item: whole tiles
constexpr int64_t kChunkRows = 120;         // tokens per pass over the weights (kRows divides it)

// Which element of a 2W-element pair each lane of load_pair(bf16) holds.
inline std::array<int, kPairLen> pair_order() {
  bf16_t probe[kPairLen];
  for (int i = 0; i < kPairLen; ++i) store_scalar(probe + i, float(i));  // exact in bf16
  vec::F a, b;
  vec::load_pair(probe, a, b);
  float lanes[kPairLen];
  vec::store(lanes, a);
  vec::store(lanes + vec::W, b);
  std::array<int, kPairLen> order;
  for (int i = 0; i < kPairLen; ++i) order[i] = int(lanes[i]);
  return order;
}

// Rows [r0, r1) of x as fp32, each pair in load_pair's order.
template <typename T>
void permute_rows(const T* x, float* xp, int64_t K, int64_t r0, int64_t r1,
                  const std::array<int, kPairLen>& order) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t k = 0; k < K; k += kPairLen)
      for (int i = 0; i < kPairLen; ++i) xp[r * K + k + i] = to_float(x[r * K + k + order[i]]);
}

// dot[i] = the sum of acc[i]'s lanes, for N accumulators: eight at a time
// through one shuffle tree (vec::reduce8; a tile's 24 sums would otherwise
// cost about a third as many instructions as a 576-wide tile's multiplies),
// the last group padded with zeros.  Every sum takes the same tree whatever
// tile it is in, so batching still never changes a token's numbers.
template <int N>
inline void reduce_all(const vec::F* acc, float* dot) {
  for (int i = 0; i < N; i += 8) {
    vec::F group[8];
    float out[8];
    for (int j = 0; j < 8; ++j) group[j] = i + j < N ? acc[i + j] : vec::zero();
    vec::reduce8(group, out);
    for (int j = 0; j < 8 && i + j < N; ++j) dot[i + j] = out[j];
  }
}

// R tokens (rows of xp, stride K) times C weight rows (stride K): dot[r * C + c].
// Each pair is taken in two halves (the even lanes, then the odd ones) so
// only C weight vectors are live at once and R x C accumulators fit.
template <int R, int C>
inline void tile(const float* xp, const bf16_t* w, int64_t K, float* dot) {
  vec::F acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vec::zero();
  for (int64_t k = 0; k < K; k += kPairLen) {
    vec::F half[C], unused;
    for (int c = 0; c < C; ++c) vec::load_pair(w + c * K + k, half[c], unused);
    for (int r = 0; r < R; ++r) {
      const vec::F xa = vec::load(xp + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vec::fma(xa, half[c], acc[r][c]);
    }
    for (int c = 0; c < C; ++c) vec::load_pair(w + c * K + k, unused, half[c]);
    for (int r = 0; r < R; ++r) {
      const vec::F xb = vec::load(xp + r * K + k + vec::W);
      for (int c = 0; c < C; ++c) acc[r][c] = vec::fma(xb, half[c], acc[r][c]);
    }
  }
  reduce_all<R * C>(&acc[0][0], dot);
}

#if defined(PAGEDSERVE_HAS_DPBF16)
// bf16 tokens on a CPU with a bf16 dot-product instruction: x and W are read
// as they are (no permutation, no conversion) and each instruction does
// 2W multiply-adds, twice an fp32 FMA's.  Same tiles, same summation order
// for every (token, feature) whatever tile it lands in.
template <int R, int C>
inline void tile(const bf16_t* x, const bf16_t* w, int64_t K, float* dot) {
  vec::F acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vec::zero();
  for (int64_t k = 0; k < K; k += kPairLen) {
    vec::BH wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vec::load_bf16(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const vec::BH xv = vec::load_bf16(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vec::dot_acc(acc[r][c], xv, wv[c]);
    }
  }
  reduce_all<R * C>(&acc[0][0], dot);
}
#endif

// out[i] = row[i] + bias[i], i < n, rounded to TOut once.
template <typename TOut>
inline void store_row(TOut* out, const float* row, const float* bias, int64_t n) {
  if (bias) {
    for (int64_t i = 0; i < n; ++i) store_scalar(out + i, row[i] + bias[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) store_scalar(out + i, row[i]);
  }
}

// R tokens against weight rows [n0, n1) (at most one strip): out[r, n] =
// dot + bias[n].  The tiles' sums are staged per token row and stored a row
// at a time: stored tile by tile, as scattered single elements, they cost a
// sixth of the op's time at 128 tokens.
template <int R, int C, typename X, typename TOut>
void tokens_times_strip(const X* xp, const bf16_t* w, const float* bias, int64_t K,
                        int64_t n0, int64_t n1, TOut* out, int64_t N) {
  float dot[R * C];
  float stage[R][kStripCols];
  int64_t n = n0;
  for (; n + C <= n1; n += C) {
    tile<R, C>(xp, w + n * K, K, dot);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) stage[r][n - n0 + c] = dot[r * C + c];
  }
  for (; n < n1; ++n) {
    tile<R, 1>(xp, w + n * K, K, dot);
    for (int r = 0; r < R; ++r) stage[r][n - n0] = dot[r];
  }
  for (int r = 0; r < R; ++r) store_row(out + r * N + n0, stage[r], bias ? bias + n0 : nullptr, n1 - n0);
}

// The last r1 - r0 < kRows tokens, as one panel of that height.
template <int R, typename X, typename TOut>
void leftover_rows(const X* xp, const bf16_t* w, const float* bias, int64_t K, int64_t rows,
                   int64_t n0, int64_t n1, TOut* out, int64_t N) {
  if constexpr (R == 1) {
    tokens_times_strip<1, kOneRowCols>(xp, w, bias, K, n0, n1, out, N);
  } else if (rows == R) {
    tokens_times_strip<R, kCols>(xp, w, bias, K, n0, n1, out, N);
  } else {
    leftover_rows<R - 1>(xp, w, bias, K, rows, n0, n1, out, N);
  }
}

// Tokens [r0, r1) against weight rows [n0, n1): full panels, then the rest.
template <typename X, typename TOut>
void rows_times_strip(const X* xp, const bf16_t* w, const float* bias, int64_t K, int64_t r0,
                      int64_t r1, int64_t n0, int64_t n1, TOut* out, int64_t N) {
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows)
    tokens_times_strip<kRows, kCols>(xp + r * K, w, bias, K, n0, n1, out + r * N, N);
  if (r < r1) leftover_rows<kRows - 1>(xp + r * K, w, bias, K, r1 - r, n0, n1, out + r * N, N);
}

// Every chunk of tokens against every strip of weight rows.
template <typename X, typename TOut>
void all_strips(const X* x, const bf16_t* w, const float* bias, int64_t M, int64_t K, int64_t N,
                TOut* out) {
  const int64_t strips = (N + kStripCols - 1) / kStripCols;
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t m1 = std::min(M, m0 + kChunkRows);
    run_items(strips, [] { return 0; }, [&](int, int64_t s) {
      rows_times_strip(x, w, bias, K, m0, m1, s * kStripCols, std::min(N, (s + 1) * kStripCols), out, N);
    });
  }
}

// bf16 tokens go to the dot-product tiles as they are where the build has them.
#if defined(PAGEDSERVE_HAS_DPBF16)
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif

// xp: M x K fp32 scratch for the permuted tokens (unused, may be null, when
// bf16 tokens take the dot-product tiles).
template <typename TIn, typename TOut>
void run(const TIn* x, const bf16_t* w, const float* bias, int64_t M, int64_t K, int64_t N,
         float* xp, TOut* out) {
  if constexpr (kDotBf16 && std::is_same_v<TIn, bf16_t>) {
    all_strips(x, w, bias, M, K, N, out);
  } else {
    static const auto order = pair_order();  // fixed per build: worked out once
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) { permute_rows(x, xp, K, r0, r1, order); });
    all_strips(static_cast<const float*>(xp), w, bias, M, K, N, out);
  }
}

}  // namespace linear

// y = x W^T + bias: x [tokens, in] fp32 or bf16, W [out, in] bf16, bias [out]
// or None; y [tokens, out] in x's dtype, or fp32 when float_out.
inline at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, bool float_out) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_bf16: tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_bf16: x [tokens, in] and weight [out, in], got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "linear_bf16: weight must be contiguous bf16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_bf16: x must be float32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % linear::kPairLen == 0, "linear_bf16: in_features ", K,
              " is not a multiple of ", linear::kPairLen, " in this build");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear_bf16: bias must be [out]");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  const bool bf16_out = x.scalar_type() == at::kBFloat16 && !float_out;
  at::Tensor out = at::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0 || N == 0) return out;
  const bool permuted = !(linear::kDotBf16 && x.scalar_type() == at::kBFloat16);
  at::Tensor xp = permuted ? at::empty({M, K}, x.options().dtype(at::kFloat)) : at::Tensor();
  float* xp_ptr = permuted ? xp.data_ptr<float>() : nullptr;
  const auto* w = reinterpret_cast<const bf16_t*>(weight.data_ptr());
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    linear::run(xc.data_ptr<float>(), w, bias_ptr, M, K, N, xp_ptr, out.data_ptr<float>());
  } else if (!bf16_out) {
    linear::run(reinterpret_cast<const bf16_t*>(xc.data_ptr()), w, bias_ptr, M, K, N, xp_ptr,
                out.data_ptr<float>());
  } else {
    linear::run(reinterpret_cast<const bf16_t*>(xc.data_ptr()), w, bias_ptr, M, K, N, xp_ptr,
                reinterpret_cast<bf16_t*>(out.data_ptr()));
  }
  return out;
}

}  // namespace pagedserve
