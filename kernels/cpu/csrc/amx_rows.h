// AMX tiles over row-major weights: the de-quantized strips of a GGUF
// linear (quant_strips.h), weights as the A operand, tokens as B.
//
// Why not amx.h's tiles: they read the weights as B, in pairs of 16 features
// (linear_packed.h's layout), and a GGUF row de-quantizes one feature at a
// time.  Writing a strip in that layout took a 16 x 16 transpose of every 512
// weights, and with the scales it made the de-quantizing ~1/3 of a 32-token
// decode step of a Q4_K_M model on a 2-vCPU Xeon, more than the tile products.
// Swapping the operands computes the same sums transposed: C^T = W X^T.
//
//   A tile = 16 features x 32 inputs of the strip, rows K * 2 bytes apart:
//            the de-quantized rows as they are written;
//   B tile = 16 input pairs x 16 tokens: x in pairs, made once per call
//            (M x K, a few hundred KB, against the MBs of weights);
//   C tile = 16 features x 16 tokens, transposed once per 16 x 16 sums
//            on the way out.
//
// A token's sum still walks its inputs 32 at a time in order, whatever its
// neighbours: its numbers do not depend on its batch.
#pragma once

#include "amx.h"

#if defined(PAGEDSERVE_HAS_AMX)

namespace pagedserve {
namespace amx {

// x in input pairs, 16 tokens a group: group g's pair p is 16 tokens x 2
// bf16 (one B tile row); tokens past M are zeros.
struct Pairs {
  std::vector<bf16_t> data;
  int64_t groups = 0, K = 0;
  const bf16_t* at(int64_t g, int64_t pair) const { return data.data() + (g * K / 2 + pair) * 2 * kTile; }
};

// Groups [g0, g1) of x's rows in pairs: 16 tokens' same 16 pairs make 16
// vectors, transposed into 16 pair rows.
inline void pair_groups(const bf16_t* x, int64_t M, Pairs& out, int64_t g0, int64_t g1) {
  const int64_t K = out.K;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t p = 0; p < K / 2; p += kTile) {
      __m512i r[16];
      for (int64_t t = 0; t < kTile; ++t) {
        const int64_t row = g * kTile + t;
        r[t] = row < M ? _mm512_loadu_si512(x + row * K + 2 * p) : _mm512_setzero_si512();
      }
      vec::transpose16(r);
      bf16_t* dst = out.data.data() + (g * K / 2 + p) * 2 * kTile;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 2 * kTile, r[i]);
    }
}

inline Pairs pairs_of(const bf16_t* x, int64_t M, int64_t K) {
  Pairs out;
  out.groups = (M + kTile - 1) / kTile;
  out.K = K;
  out.data.resize(size_t(out.groups * kTile * K));
  at::parallel_for(0, out.groups, 4, [&](int64_t g0, int64_t g1) { pair_groups(x, M, out, g0, g1); });
  return out;
}

// F A tiles (16 features each, from row w) times T B tiles (token groups
// from g): the fp32 sums into stage [16 F features][16 T tokens].
template <int F, int T>
PAGEDSERVE_AMX_TARGET inline void tile_rows(const bf16_t* w, int64_t K, const Pairs& x, int64_t g,
                                            float* stage) {
  zero_sums();
  const int64_t stride = K * int64_t(sizeof(bf16_t));
  const bf16_t* w1 = w + kTile * K;
  for (int64_t p = 0; p < K / 2; p += kPairs) {
    _tile_loadd(4, w + 2 * p, stride);
    _tile_loadd(6, x.at(g, p), 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (T == 2) {
      _tile_loadd(7, x.at(g + 1, p), 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (F == 2) {
      _tile_loadd(5, w1 + 2 * p, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (T == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_sums<F, T>(stage);
}

// stage -> out[token, n0 + feature] (+ bias), for the tokens below M: each
// 16 x 16 tile transposed into 16 tokens' rows of 16 features.
template <int F, int T, typename TOut>
inline void finish_rows(const float* stage, int64_t g, int64_t M, int64_t n0, const float* bias, TOut* out,
                        int64_t N) {
  for (int f = 0; f < F; ++f)
    for (int t = 0; t < T; ++t) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_castps_si512(_mm512_loadu_ps(stage + (f * kTile + i) * T * kTile + t * kTile));
      vec::transpose16(r);
      const int64_t n = n0 + f * kTile, first = (g + t) * kTile;
      const int64_t rows = std::min<int64_t>(kTile, M - first);
      for (int64_t i = 0; i < rows; ++i) {
        const vec::F s{_mm512_castsi512_ps(r[i])};
        vec::store_to(out + (first + i) * N + n, bias ? vec::add(s, vec::load(bias + n)) : s);
      }
    }
}

// Weight rows [0, rows) of a strip (row-major bf16, rows a multiple of 16)
// times the token groups [g0, g1), into out's columns [n0, n0 + rows).
template <int F, typename TOut>
PAGEDSERVE_AMX_TARGET void features_times_groups(const bf16_t* w, int64_t K, const Pairs& x, int64_t g0,
                                                 int64_t g1, int64_t M, int64_t n0, const float* bias,
                                                 TOut* out, int64_t N) {
  alignas(64) float stage[2 * kTile * 2 * kTile];
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2) {
    tile_rows<F, 2>(w, K, x, g, stage);
    finish_rows<F, 2>(stage, g, M, n0, bias, out, N);
  }
  if (g < g1) {
    tile_rows<F, 1>(w, K, x, g, stage);
    finish_rows<F, 1>(stage, g, M, n0, bias, out, N);
  }
}

// y[:, n0 + (0..rows)] = x W_strip^T (+ bias[n0 + ...]), the tiles' caller holding
// Tiles.  Tokens go in chunks that L2 keeps beside the strip; within a
// chunk, 32 features at a time meet every token group.
template <typename TOut>
void strip_times_pairs(const bf16_t* w, int64_t rows, const Pairs& x, int64_t M, int64_t n0,
                       const float* bias, TOut* out, int64_t N) {
  const int64_t K = x.K, chunk = chunk_rows(K) / kTile;
  for (int64_t g0 = 0; g0 < x.groups; g0 += chunk) {
    const int64_t g1 = std::min(x.groups, g0 + chunk);
    int64_t f = 0;
    for (; f + 2 * kTile <= rows; f += 2 * kTile)
      features_times_groups<2>(w + f * K, K, x, g0, g1, M, n0 + f, bias, out, N);
    if (f < rows)
      features_times_groups<1>(w + f * K, K, x, g0, g1, M, n0 + f, bias, out, N);
  }
}

}  // namespace amx
}  // namespace pagedserve

#endif  // PAGEDSERVE_HAS_AMX
