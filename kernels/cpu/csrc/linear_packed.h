// Linear layers over bf16 weights packed at load time (kernels.pack_linear):
// y = x W^T (+ bias, then an activation: epilogue.h), bf16 x, fp32 sums.
// AVX512-BF16, AVX-512 (fp32 FMAs, as AVX2's) and AVX2 builds.
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
// AVX2 has no bf16 dot product, and a 256-bit vector holds half a block: a
// block's pair is two vectors of 8 features, each split into its even and
// odd inputs by one shift and one and (vec::load_pair), and the token's x[2p]
// and x[2p + 1] (converted to fp32 once per call) each broadcast to 8 lanes:
//
//   lanes << 16          W[8h][2p]     ... W[8h+7][2p]      x[2p]     (fma)
//   lanes & 0xffff0000   W[8h][2p + 1] ... W[8h+7][2p + 1]  x[2p + 1] (fma)
//
// Why the layout on AVX2 too: nn.Linear's rows are only 1,152 bytes at 576
// inputs, so the unpacked tile for one token walks 6 short rows at once and
// ends each in horizontal sums; it read 17.7 GB/s where the memory gives
// 27-39.  A packed block is one 18 KB run read front to back, its sums are
// finished in the lanes, and nothing is reduced.
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

#include "vec.h"

#if defined(PAGEDSERVE_HAS_DPBF16) || defined(PAGEDSERVE_ISA_AVX512) || defined(PAGEDSERVE_ISA_AVX2)
#define PAGEDSERVE_HAS_PACKED_LINEAR 1

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "amx.h"
#include "epilogue.h"
#include "prefetch.h"
#include "work_items.h"

namespace pagedserve {
namespace packed_linear {

constexpr int64_t kLanes = 16;         // output features per block: the layout's, on any ISA
constexpr int kSubs = kLanes / vec::W;  // vectors per block and pair: 1 (AVX-512), 2 (AVX2)
#if defined(PAGEDSERVE_HAS_DPBF16)
using XT = bf16_t;                     // the tiles read bf16 tokens as they are
constexpr int kRows = 8;               // tokens per tile
constexpr int kCols = 3;               // blocks per tile: 24 accumulators + 3 weights of 32 registers
constexpr int kOneRowCols = 6;         // one token: more blocks, more dot_accs in flight
#elif defined(PAGEDSERVE_ISA_AVX512)
using XT = float;                      // tokens in fp32, converted once per call
constexpr int kRows = 8;               // 8 x 2 accumulators + 2 x 2 weights + 2 broadcasts of 32
constexpr int kCols = 2;
constexpr int kOneRowCols = 6;         // one token: 6 accumulators, two dependent FMAs each per pair
#else
using XT = float;                      // tokens in fp32, converted once per call
constexpr int kRows = 5;               // 5 x 2 accumulators + 2 x 2 weights + 2 broadcasts: all 16
constexpr int kCols = 1;
constexpr int kOneRowCols = 3;         // one token: 6 accumulators, two dependent FMAs each per pair
#endif
constexpr int64_t kStripBlocks = 6;       // blocks per work item: whole tiles of either shape
constexpr int64_t kChunkBytes = 320 << 10;  // a chunk's x, at most: L2 keeps it and a strip

// The weights of one layer, packed: blocks of 16 features, K / 2 pairs each.
struct Packed {
  const bf16_t* w;
  int64_t blocks, K;
  int64_t block_elems() const { return K * kLanes; }
  const bf16_t* block(int64_t b) const { return w + b * block_elems(); }
};

// The next tile's weights, if it is a whole one (prefetches never fault, but
// a fetch past the end is a wasted line).
template <int C>
inline const bf16_t* next_tile(const Packed& pw, int64_t b, bool prefetch) {
  return prefetch && b + 2 * C <= pw.blocks ? pw.block(b + C) : nullptr;
}

// acc[r][c * kSubs + s] through the epilogue -> out[r, (b + c) * 16 + s * W + lane].
template <int R, int C, typename TOut>
inline void store_tile(const vec::F (&acc)[R][C * kSubs], int64_t b, const Epilogue& ep, TOut* out,
                       int64_t N) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C * kSubs; ++v) {
      const int64_t n = b * kLanes + v * vec::W;
      vec::store_to(out + r * N + n, ep.apply<TOut>(acc[r][v], n));
    }
}

#if defined(PAGEDSERVE_HAS_DPBF16)
// R tokens (rows of x, stride K) against blocks [b, b + C).  With
// `prefetch`, the next tile's weights are fetched into L2 a line per line loaded.
template <int R, int C, typename TOut>
inline void tile(const bf16_t* x, const Packed& pw, int64_t b, bool prefetch, const Epilogue& ep,
                 TOut* out, int64_t N) {
  const int64_t stride = pw.block_elems(), K = pw.K;
  const bf16_t* w = pw.block(b);
  const bf16_t* next = next_tile<C>(pw, b, prefetch);
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
  store_tile<R, C>(acc, b, ep, out, N);
}
#else
// The same with fp32 FMAs: per pair and half-block, x[2p] times the even
// inputs, then x[2p + 1] times the odd ones, into one accumulator, so a
// (token, feature) sum still walks the inputs in order in one lane.
//
// One token keeps its two broadcasts in registers and walks 2C half-blocks
// (C streams of weights), without software prefetch: the hardware's streams
// alone read a long packed matrix at the memory's rate here (27 GB/s against
// torch.sum's 26-28), and the prefetches only cost slots.  Several tokens
// load a whole block (4 registers) and give each token's broadcasts to both
// of its halves: panels of 5 tokens (10 accumulators) ran the layers at 93
// GFLOP/s for 7 tokens and 157 for 128, panels of 4 at 82 and 136, and 6
// tokens a half-block at a time (the broadcasts loaded twice) at 92 and 112.
template <int R, int C, typename TOut>
inline void tile(const float* x, const Packed& pw, int64_t b, bool prefetch, const Epilogue& ep,
                 TOut* out, int64_t N) {
  const int64_t stride = pw.block_elems(), K = pw.K;
  const bf16_t* w = pw.block(b);
  const bf16_t* next = R > 1 ? next_tile<C>(pw, b, prefetch) : nullptr;
  vec::F acc[R][C * kSubs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C * kSubs; ++v) acc[r][v] = vec::zero();
  for (int64_t p = 0; p < K / 2; ++p) {
    const int64_t at = p * 2 * kLanes;
    if constexpr (R == 1) {
      const vec::F xe = vec::set1(x[2 * p]), xo = vec::set1(x[2 * p + 1]);
      for (int v = 0; v < C * kSubs; ++v) {
        vec::F even, odd;
        vec::load_pair(w + (v / kSubs) * stride + at + (v % kSubs) * 2 * vec::W, even, odd);
        acc[0][v] = vec::fma(xo, odd, vec::fma(xe, even, acc[0][v]));
      }
    } else {
      if (next)
        for (int c = 0; c < C; ++c) prefetch_l2(reinterpret_cast<const char*>(next + c * stride + at));
      for (int c = 0; c < C; ++c) {
        vec::F even[kSubs], odd[kSubs];
        for (int s = 0; s < kSubs; ++s)
          vec::load_pair(w + c * stride + at + s * 2 * vec::W, even[s], odd[s]);
        for (int r = 0; r < R; ++r) {
          const vec::F xe = vec::set1(x[r * K + 2 * p]), xo = vec::set1(x[r * K + 2 * p + 1]);
          for (int s = 0; s < kSubs; ++s) {
            vec::F& a = acc[r][c * kSubs + s];
            a = vec::fma(xo, odd[s], vec::fma(xe, even[s], a));
          }
        }
      }
    }
  }
  store_tile<R, C>(acc, b, ep, out, N);
}
#endif

// R tokens against blocks [b0, b1): whole tiles of C blocks, then one at a time.
template <int R, int C, typename TOut>
void panel(const XT* x, const Packed& pw, int64_t b0, int64_t b1, bool prefetch,
           const Epilogue& ep, TOut* out, int64_t N) {
  int64_t b = b0;
  for (; b + C <= b1; b += C) tile<R, C>(x, pw, b, prefetch, ep, out, N);
  for (; b < b1; ++b) tile<R, 1>(x, pw, b, prefetch, ep, out, N);
}

// The last rows < kRows tokens, as one panel of that height.
template <int R, typename TOut>
void leftover_rows(const XT* x, const Packed& pw, int64_t rows, int64_t b0, int64_t b1,
                   bool prefetch, const Epilogue& ep, TOut* out, int64_t N) {
  if constexpr (R == 1) {
    panel<1, kOneRowCols>(x, pw, b0, b1, prefetch, ep, out, N);
  } else if (rows == R) {
    panel<R, kCols>(x, pw, b0, b1, prefetch, ep, out, N);
  } else {
    leftover_rows<R - 1>(x, pw, rows, b0, b1, prefetch, ep, out, N);
  }
}

// Tokens [r0, r1) against blocks [b0, b1); the first panel prefetches.
template <typename TOut>
void rows_times_strip(const XT* x, const Packed& pw, int64_t r0, int64_t r1, int64_t b0,
                      int64_t b1, const Epilogue& ep, TOut* out, int64_t N) {
  const int64_t K = pw.K;
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows)
    panel<kRows, kCols>(x + r * K, pw, b0, b1, r == r0, ep, out + r * N, N);
  if (r < r1)
    leftover_rows<kRows - 1>(x + r * K, pw, r1 - r, b0, b1, r == r0, ep, out + r * N, N);
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

// Every chunk of tokens against every strip of blocks: one region, whose
// items are (chunk, strip) in chunk order, so the threads still share a
// chunk's x while it lasts, and none waits at a chunk's end for the other's
// last strip.  A region a chunk did wait: BERT-base's 768-feature
// projections have 8 strips, and a 128-text embed call ran ~120 chunks a
// layer through them (libgomp's barrier spin was 2.5 % of its samples).
template <typename TOut>
void run(const XT* x, const Packed& pw, const Epilogue& ep, int64_t M, TOut* out) {
#if defined(PAGEDSERVE_HAS_AMX)
  // The layout is AMX's B operand: where the CPU has AMX, every call takes its tiles (amx.h).
  if (amx::takes(pw.K)) return amx::run(x, amx::B{pw.w, pw.blocks, pw.K}, ep, M, out);
#endif
  const int64_t N = pw.blocks * kLanes;
  const int64_t strips = (pw.blocks + kStripBlocks - 1) / kStripBlocks;
  const int64_t step = chunk_rows(M, pw.K), chunks = (M + step - 1) / step;
  run_items(chunks * strips, [] { return 0; }, [&](int, int64_t item) {
    const int64_t m0 = item / strips * step, s = item % strips;
    rows_times_strip(x, pw, m0, std::min(M, m0 + step), s * kStripBlocks,
                     std::min(pw.blocks, (s + 1) * kStripBlocks), ep, out, N);
  });
}

// x as the tiles read it: bf16 as it is where the dot product takes it, else
// fp32 (scratch holds the converted tokens and must outlive the call).
inline const XT* tile_input(const at::Tensor& x, at::Tensor& scratch) {
#if defined(PAGEDSERVE_HAS_DPBF16)
  (void)scratch;
  return reinterpret_cast<const bf16_t*>(x.data_ptr());
#else
  // A loop, not x.to(kFloat): this runs 120 times a decode step, and the
  // dispatcher's copy costs more than converting 576 numbers.
  scratch = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const auto* in = reinterpret_cast<const bf16_t*>(x.data_ptr());
  float* out = scratch.data_ptr<float>();
  const int64_t n = x.numel();
  at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = to_float(in[i]);
  });
  return out;
#endif
}

}  // namespace packed_linear

// The epilogue's activation by name, as kernels.linear passes it.
inline Act activation_named(c10::string_view name) {
  if (name == "none") return Act::none;
  if (name == "gelu") return Act::gelu;
  TORCH_CHECK(name == "relu", "linear_bf16_packed: activation must be none, gelu or relu, got ",
              std::string(name));
  return Act::relu;
}

// y = act(x W^T + bias) with W packed as above (kernels.pack_linear): x [tokens, in] bf16,
// bias [out] or None; y [tokens, out] bf16, or fp32 when float_out; act the
// epilogue's (epilogue.h: "gelu" is erf's, torch's F.gelu).
inline at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed,
                                     const std::optional<at::Tensor>& bias, bool float_out,
                                     c10::string_view activation) {
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
  const Epilogue ep{b.defined() ? b.data_ptr<float>() : nullptr, activation_named(activation)};
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  at::Tensor scratch;
  const auto* xp = packed_linear::tile_input(xc, scratch);
  if (float_out) {
    packed_linear::run(xp, pw, ep, M, out.data_ptr<float>());
  } else {
    packed_linear::run(xp, pw, ep, M, reinterpret_cast<bf16_t*>(out.data_ptr()));
  }
  return out;
}

}  // namespace pagedserve

#endif  // PAGEDSERVE_HAS_PACKED_LINEAR
