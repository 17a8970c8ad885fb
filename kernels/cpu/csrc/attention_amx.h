// An encoder's attention tiles on AMX (the avx512bf16 build, where the CPU
// has AMX-BF16): Q.K and P.V of 16 or 32 query rows against a 32-token tile
// (attention_tile.h's full rows; prefill.h configures the tiles on each
// thread that takes an encoder item).
//
// Why: a BERT-base bf16 embedding call spent ~25 % of its samples in the
// non-causal prefill attention, ~13 % of them in Q.K and its K packing and
// 8 % in P.V, each a few vdpbf16ps or FMAs per 16 lanes; tdpbf16ps does a
// 16 x 16 x 32 product in one instruction.  Only an encoder's rows take it:
// its sums round differently from the vector rows', and P.V multiplies the
// weights rounded to bf16, so a row's numbers must not depend on anything but
// its place in its own sequence, which holds for encoder items (never
// chunked, cached or decoded).
#pragma once

#include "amx.h"

#if defined(PAGEDSERVE_HAS_AMX)
#include <immintrin.h>

#include <cstdint>

namespace pagedserve {

// full_scores' scores for 16 R rows: the packed K pairs (pack_k_pairs) are
// already B tiles (row p: pair p of 16 tokens, a tile per 16 of the tile's
// tokens), the query rows A tiles, and the sums land as the score rows.  An
// item's last rows short of 16 keep full_scores.
template <int R>
PAGEDSERVE_AMX_TARGET inline void amx_scores(const bf16_t* q, const uint32_t* kt, int head_dim, int n,
                                             float scale2, float* s) {
  constexpr int kCols = int(kTile / amx::kTile);  // B tiles across the tile's tokens
  static_assert(kCols == 2, "AMX's tiles take a 32-token attention tile");
  const int64_t q_stride = head_dim * int64_t(sizeof(bf16_t)), row = kTile * int64_t(sizeof(float));
  const bf16_t* q1 = q + amx::kTile * head_dim;
  amx::zero_sums();
  for (int p = 0; p < head_dim / 2; p += int(amx::kPairs)) {
    _tile_loadd(4, q + 2 * p, q_stride);
    _tile_loadd(6, kt + p * kTile, row);
    _tile_loadd(7, kt + p * kTile + amx::kTile, row);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, q1 + 2 * p, q_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  amx::store_sums<R, kCols>(s);
  const vec::F scale = vec::set1(scale2);
  for (int r = 0; r < R * int(amx::kTile); ++r) {
    float* out = s + r * kTile;
    vec::store(out, vec::mul(vec::load(out), scale));
    vec::store(out + vec::W, vec::mul(vec::load(out + vec::W), scale));
    for (int i = n; i < kTile; ++i) out[i] = kNegInf;
  }
}

// V's 32 tokens as AMX B tiles for P.V, in the order the rows' accumulators
// keep their dims (vec::load_pair's for bf16: of each 32 dims, the 16 even
// ones, then the 16 odd ones).  Tile j holds accumulator lanes [16 j, 16 j +
// 16), its row p the pair of tokens (2p, 2p + 1) at each: for block b = j / 2
// and parity e = j % 2, lane i is dim 32 b + 2 i + e, so
//   vt[(16 j + p) * 32 + 2 i + u] = v[2p + u][32 b + 2 i + e]
// which is each row's 32-bit words split by halves: the low halves (even
// dims) of both rows side by side, then the high halves (odd dims).
inline void pack_v_pairs(const bf16_t* const* v, int head_dim, bf16_t* vt) {
  const __m512i low = _mm512_set1_epi32(0xffff), high = _mm512_set1_epi32(int32_t(0xffff0000u));
  for (int p = 0; p < int(kTile) / 2; ++p)
    for (int b = 0; b < head_dim / 32; ++b) {
      const __m512i x = _mm512_loadu_si512(v[2 * p] + 32 * b), y = _mm512_loadu_si512(v[2 * p + 1] + 32 * b);
      const __m512i even = _mm512_or_si512(_mm512_and_si512(x, low), _mm512_slli_epi32(y, 16));
      const __m512i odd = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_and_si512(y, high));
      _mm512_storeu_si512(vt + (16 * (2 * b) + p) * 32, even);
      _mm512_storeu_si512(vt + (16 * (2 * b + 1) + p) * 32, odd);
    }
}

// acc[r] += p[r] . V for 16 rows: the weights rounded to bf16 (as torch's
// flash attention rounds them for its bf16 P.V), the sums in fp32 in the
// rows' own accumulators, a 16-dim tile at a time.
PAGEDSERVE_AMX_TARGET inline void amx_pv(const float* p, const bf16_t* vt, float* acc, int head_dim) {
  alignas(64) bf16_t weights[amx::kTile * kTile];
  for (int r = 0; r < int(amx::kTile); ++r) {
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + r * kTile + 16), _mm512_loadu_ps(p + r * kTile));
    _mm512_store_si512(weights + r * kTile, reinterpret_cast<const __m512i&>(w));
  }
  const int64_t acc_stride = head_dim * int64_t(sizeof(float));
  _tile_loadd(4, weights, kTile * int64_t(sizeof(bf16_t)));
  for (int j = 0; j < head_dim / 16; ++j) {
    _tile_loadd(0, acc + 16 * j, acc_stride);
    _tile_loadd(6, vt + 16 * j * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, acc + 16 * j, acc_stride);
  }
}

}  // namespace pagedserve

#endif  // PAGEDSERVE_HAS_AMX
