// Linear layers over bf16 weights packed for the bf16 dot-product
// instruction (AVX512-BF16 builds): y = x W^T (+ bias), bf16 x, fp32 sums.
//
// Why: linear.h's dot-product tiles keep one vector accumulator per (token,
// feature) whose lanes hold partial sums over different inputs, so every tile
// ends in horizontal reductions.  At SmolLM2's 576 inputs a tile's loop is
// only 18 instructions deep per accumulator and the reductions cost about a
// fifth of its time (~200 GFLOP/s a core where the instruction peaks near
// 230).  Packed once at load time (kernels.pack_linear), a weight vector
// holds one input pair of 16 features instead of 32 inputs of one:
//
//   W [N, K] (nn.Linear's layout)        packed [N/16][K/2][16][2]
//   W[n][2p], W[n][2p + 1]      --->     packed[n / 16][p][n % 16][0..1]
//
//   one 64-byte vector = block b, pair p:
//     | W[16b][2p] W[16b][2p+1] | W[16b+1][2p] W[16b+1][2p+1] | ... | W[16b+15][..] |
//   the token's pair (x[2p], x[2p+1]) broadcast to all 16 lanes
//   dot_acc:  lane l += x[2p] * W[16b+l][2p] + x[2p+1] * W[16b+l][2p+1]
//
// After the last pair each lane holds a finished sum, stored as it is.  A
// (token, feature) sum always walks the pairs in order in one lane, so a
// token's numbers never depend on its batch or on the tile it lands in.
//
// Blocking (rows of x are tokens; a block is 16 output features):
//
//   for each chunk of tokens (chunk_rows)         the chunk's x stays in L2
//     threads split the blocks in strips          a strip's weights stay in L2
//       for each panel of kRows tokens            the panel's x stays in L1
//         for each tile of kCols blocks           kRows x kCols accumulators
//           walk the pairs: kCols weight loads, kRows broadcasts, kRows x kCols dot_accs
//
// The chunk's first panel also prefetches the next tile's weights into L2,
// a line per line it loads: the weights come from memory once per chunk, and
// the hardware's streams alone left the tied 49152-row LM head at 154
// GFLOP/s a core for 8 tokens (207 with the prefetch).
#pragma once

#if defined(PAGEDSERVE_HAS_DPBF16)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "prefetch.h"
#include "vec.h"

namespace pagedserve {
namespace packed_linear {

constexpr int64_t kLanes = vec::W;        // output features per block
constexpr int kRows = 8;                  // tokens per tile
constexpr int kCols = 3;                  // blocks per tile: 24 accumulators + 3 weights of 32 registers
constexpr int kOneRowCols = 6;            // one token: more blocks, more dot_accs in flight
constexpr int64_t kStripBlocks = 6;       // blocks per work item: whole tiles of either shape
constexpr int64_t kChunkBytes = 320 << 10;  // a chunk's x, at most: L2 keeps it and a strip

// The weights of one layer, packed: blocks of 16 features, K / 2 pairs each.
struct Packed {
  const bf16_t* w;
  int64_t blocks, K;
  int64_t block_elems() const { return K * kLanes; }
  const bf16_t* block(int64_t b) const { return w + b * block_elems(); }
};

inline void store_sums(float* out, vec::F sums) { vec::store(out, sums); }
inline void store_sums(bf16_t* out, vec::F sums) { vec::store_bf16(out, sums); }

// R tokens (rows of x, stride K) against blocks [b, b + C): out[r, (b + c) *
// 16 + l] = the sum + bias, rounded to TOut once.  With `prefetch`, the
// next tile's weights are fetched into L2 a line per line loaded.
template <int R, int C, typename TOut>
inline void tile(const bf16_t* x, const Packed& pw, int64_t b, bool prefetch, const float* bias,
                 TOut* out, int64_t N) {
  const int64_t stride = pw.block_elems(), K = pw.K;
  const bf16_t* w = pw.block(b);
  // The next tile's weights, if it is a whole one (prefetches never fault,
  // but a fetch past the end is a wasted line).
  const bf16_t* next = prefetch && b + 2 * C <= pw.blocks ? pw.block(b + C) : nullptr;
  vec::F acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vec::zero();
  for (int64_t p = 0; p < K / 2; ++p) {
    const int64_t at = p * 2 * kLanes;
    vec::BH wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vec::load_bf16(w + c * stride + at);
    if (next)
      for (int c = 0; c < C; ++c) prefetch_l2(reinterpret_cast<const char*>(next + c * stride + at));
    for (int r = 0; r < R; ++r) {
      const vec::BH xv = vec::broadcast_pair(x + r * K + 2 * p);
      for (int c = 0; c < C; ++c) acc[r][c] = vec::dot_acc(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t n = (b + c) * kLanes;
      const vec::F sums = bias ? vec::add(acc[r][c], vec::load(bias + n)) : acc[r][c];
      store_sums(out + r * N + n, sums);
    }
}

// R tokens against blocks [b0, b1): whole tiles of C blocks, then one at a time.
template <int R, int C, typename TOut>
void panel(const bf16_t* x, const Packed& pw, int64_t b0, int64_t b1, bool prefetch,
           const float* bias, TOut* out, int64_t N) {
  int64_t b = b0;
  for (; b + C <= b1; b += C) tile<R, C>(x, pw, b, prefetch, bias, out, N);
  for (; b < b1; ++b) tile<R, 1>(x, pw, b, prefetch, bias, out, N);
}

// The last rows < kRows tokens, as one panel of that height.
template <int R, typename TOut>
void leftover_rows(const bf16_t* x, const Packed& pw, int64_t rows, int64_t b0, int64_t b1,
                   bool prefetch, const float* bias, TOut* out, int64_t N) {
  if constexpr (R == 1) {
    panel<1, kOneRowCols>(x, pw, b0, b1, prefetch, bias, out, N);
  } else if (rows == R) {
    panel<R, kCols>(x, pw, b0, b1, prefetch, bias, out, N);
  } else {
    leftover_rows<R - 1>(x, pw, rows, b0, b1, prefetch, bias, out, N);
  }
}

// Tokens [r0, r1) against blocks [b0, b1); the first panel prefetches.
template <typename TOut>
void rows_times_strip(const bf16_t* x, const Packed& pw, int64_t r0, int64_t r1, int64_t b0,
                      int64_t b1, const float* bias, TOut* out, int64_t N) {
  const int64_t K = pw.K;
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows)
    panel<kRows, kCols>(x + r * K, pw, b0, b1, r == r0, bias, out + r * N, N);
  if (r < r1)
    leftover_rows<kRows - 1>(x + r * K, pw, r1 - r, b0, b1, r == r0, bias, out + r * N, N);
}

// Tokens per chunk: as few chunks as fit kChunkBytes, of even size in whole
// panels (256 tokens of the LM head in chunks of 120 left a 16-token chunk
// that streamed all 56 MB of weights for two panels).
inline int64_t chunk_rows(int64_t M, int64_t K) {
  const int64_t most = std::max<int64_t>(kRows, kChunkBytes / (2 * K) / kRows * kRows);
  const int64_t chunks = (M + most - 1) / most;
  const int64_t rows = (M + chunks - 1) / chunks;
  return (rows + kRows - 1) / kRows * kRows;
}

// Every chunk of tokens against every strip of blocks.
template <typename TOut>
void run(const bf16_t* x, const Packed& pw, const float* bias, int64_t M, TOut* out) {
  const int64_t N = pw.blocks * kLanes;
  const int64_t strips = (pw.blocks + kStripBlocks - 1) / kStripBlocks;
  const int64_t step = chunk_rows(M, pw.K);
  for (int64_t m0 = 0; m0 < M; m0 += step) {
    const int64_t m1 = std::min(M, m0 + step);
    at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s)
        rows_times_strip(x, pw, m0, m1, s * kStripBlocks,
                         std::min(pw.blocks, (s + 1) * kStripBlocks), bias, out, N);
    });
  }
}

}  // namespace packed_linear

// y = x W^T + bias with W packed as above (kernels.pack_linear): x [tokens, in] bf16,
// bias [out] or None; y [tokens, out] bf16, or fp32 when float_out.
inline at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed,
                                     const std::optional<at::Tensor>& bias, bool float_out) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(),
              "linear_bf16_packed: tensors must be on the CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == packed_linear::kLanes && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "linear_bf16_packed: weight must be packed by kernels.pack_linear, got ", packed.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * packed.size(1) && x.scalar_type() == at::kBFloat16,
              "linear_bf16_packed: x must be bf16 [tokens, ", 2 * packed.size(1), "], got ",
              x.scalar_type(), " ", x.sizes());
  const packed_linear::Packed pw{reinterpret_cast<const bf16_t*>(packed.data_ptr()),
                                 packed.size(0), x.size(1)};
  const int64_t M = x.size(0), N = pw.blocks * packed_linear::kLanes;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear_bf16_packed: bias must be [out]");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const bf16_t*>(xc.data_ptr());
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  if (float_out) {
    packed_linear::run(xp, pw, bias_ptr, M, out.data_ptr<float>());
  } else {
    packed_linear::run(xp, pw, bias_ptr, M, reinterpret_cast<bf16_t*>(out.data_ptr()));
  }
  return out;
}

}  // namespace pagedserve

#endif  // PAGEDSERVE_HAS_DPBF16
