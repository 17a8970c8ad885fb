// The quantized linear past a few tokens where the CPU has AVX2 but not
// AVX512-VNNI: quant_vnni.h's int8 strips in 256-bit vectors.  The tokens
// are quantized once (quant_tokens.h: the few-token rows' codes), a
// strip of weight rows is decoded once into its int8 codes, and every token
// meets it in integers.
//
// Why: the rows (quant_gemv.h) decode a weight row again for every 4 tokens
// and sum each sub-block's 8 lanes across them; the de-quantized strips
// (quant_strips.h) widen every weight to fp32 for every token.  On a
// first-generation Zen EPYC at 32 tokens SmolLM2's Q4_1 gate|up took
// 1,808 us through the rows (7.8 G multiply-adds a second a core) where the
// multiply port alone allows ~5x that (docs/performance.md).
//
// The integers (what dpbusd does in one instruction takes two here):
// maddubs multiplies unsigned bytes by signed ones and adds pairs into
// int16, madd(., 1) adds pairs of those into int32.  The weights go in
// unsigned, as stored (0 .. kLevels - 1), the tokens' codes signed, so an
// int16 pair is at most 2 x 127 x (kLevels - 1), and several steps' int16
// sums add up before one madd widens them (steps_in_int16: the 4-bit types
// a whole group, the 5-bit ones four steps, Q6_K two), which spares the
// multiply port (one on a first-generation Zen) a madd per step.  A type's
// centre (Q4_0's 8, Q5_0's 16, Q6_K's 32) comes off in the same integers:
// each accumulator starts at -centre x the token's sum of codes over the
// group (or the half, Q6_K).  Q8_0's codes are signed and reach -128: their
// signs move onto the tokens' codes (sign_epi8, quant_act.h's dot32), a
// step at a time.
//
// A strip's layout, 8 weight rows a column (one int32 lane a row):
//
//   codes [column][group of 32 inputs][k = 0..7][8 rows][4 bytes]
//     one 32-byte vector: inputs 4k .. 4k + 3 of the group for 8 rows
//   meta  [column][group]: each row's scale (per 16 inputs for Q6_K) and min
//
// The sums per group then take (wd * xd) * dot + wm * s, quant_vnni.h's
// formula, with its token scale per 8 groups where every part is a K-quant.
#pragma once

#include "quant_strip_run.h"
#include "quant_tokens.h"

#if defined(__AVX2__) && !defined(PAGEDSERVE_ISA_AVX512BF16) && !defined(PAGEDSERVE_ISA_AVX512)
#define PAGEDSERVE_QUANT_MADDUBS 1

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#include "quant_blob.h"
#include "quant_blocks.h"
#include "types.h"
#include "vec.h"
#include "work_items.h"

namespace pagedserve {
namespace quant {
namespace maddubs {

// Columns of 8 rows per strip (work item): 4, so that a layer's narrowest
// linear still splits evenly over the threads (SmolLM2's 576 rows: 18
// strips, where 8 columns made 9 and its down projection took 1.08x the time).
constexpr int64_t kMaxColumns = 4;
constexpr int kTileTokens = 4;      // tokens per tile
constexpr int kTileColumns = 2;     // columns per tile: 8 int32 accumulators of AVX2's 16 registers

// One group's numbers for one column's 8 rows (lane l: row l).
struct alignas(32) GroupMeta {
  float wd[2][8];  // the scale: the whole group in [0], or each half (Q6_K)
  float wm[8];     // the min (types with one)
};

// Columns a strip takes for K inputs: as many as kMaxColumns whose decoded
// codes and meta fit half a first-generation Zen's 512 KB L2, for the reason
// quant_vnni.h's columns_for gives (the next strip's bytes come in beside).
constexpr int64_t kStripBudget = int64_t(256) << 10;
inline int64_t columns_for(int64_t K) {
  const int64_t column = K / 32 * int64_t(256 + sizeof(GroupMeta));
  return std::clamp<int64_t>(kStripBudget / column, 1, kMaxColumns);
}

// Steps (4 inputs each) whose maddubs sums add in int16 before one madd: a
// power of two up to 8 whose sum stays in int16; 0 for Q8_0 (signed codes).
template <typename Q>
constexpr int steps_in_int16() {
  if (Q::kLevels > 128) return 0;
  int steps = 8;
  while (2 * 127 * (Q::kLevels - 1) * steps > 32767) steps /= 2;
  return steps;
}

// A thread's decoded strip: `columns` columns' codes and meta.
struct Decoded {
  Decoded(int64_t columns, int64_t groups)
      : codes(new int8_t[size_t(columns * groups * 256)]), meta(new GroupMeta[size_t(columns * groups)]) {}
  std::unique_ptr<int8_t[]> codes;
  std::unique_ptr<GroupMeta[]> meta;
};

// v[l] (row l's 32 codes) -> v[k]: the k-th 4-byte word of every row.
inline void transpose8(__m256i (&v)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
    v[4 + k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
  }
}

// Rows [r0, r0 + rows) of a part (rows <= 8) into one column: its codes
// (groups x 256 bytes) and meta (groups).  The lanes past `rows` repeat the
// last row's codes with zero scales; their sums are never stored.
template <typename Q>
inline void decode_column(const Part& p, int64_t K, int64_t r0, int64_t rows, int8_t* codes, GroupMeta* meta) {
  const int64_t groups = K / 32;
  const uint8_t* row[8];
  for (int64_t l = 0; l < 8; ++l) row[l] = p.data + (r0 + std::min(l, rows - 1)) * p.row_bytes;
  for (int64_t b = 0; b < K / Q::kElems; ++b)
    for (int64_t l = 0; l < 8; ++l) {
      float wd[2 * Q::kSubs], wm[Q::kSubs] = {};
      Q::scales(row[l] + b * Q::kBytes, wd, wm);
      for (int j = 0; j < Q::kSubs; ++j) {
        GroupMeta& m = meta[b * Q::kSubs + j];
        const bool live = l < rows;
        m.wd[0][l] = live ? wd[2 * j] : 0.f;
        m.wd[1][l] = live ? wd[2 * j + 1] : 0.f;
        m.wm[l] = live ? wm[j] : 0.f;
      }
    }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i v[8];
    for (int64_t l = 0; l < 8; ++l) {
      const __m256i q = Q::q_avx2(row[l] + g / Q::kSubs * Q::kBytes, int(g % Q::kSubs));
      v[l] = Q::kCentre ? _mm256_add_epi8(q, _mm256_set1_epi8(char(Q::kCentre))) : q;  // as stored
    }
    transpose8(v);
    for (int k = 0; k < 8; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + g * 256 + 32 * k), v[k]);
  }
}

// One step's int16 pair sums: a vector of codes w times token codes q (4 a
// lane, broadcast).  Q8_0 (S = 0): w's signs move onto q.
template <int S>
inline __m256i step(__m256i w, __m256i q) {
  if constexpr (S > 0) {
    return _mm256_maddubs_epi16(w, q);
  } else {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
  }
}

// T tokens (from m) against C columns (codes and meta `c` columns apart):
// out[t][c] lane l = the sum for token m + t and the column's row l.
// quant_vnni.h's tile, the int32 accumulators fed kS steps at a time.
template <typename Q, int kPer, int T, int C>
inline void tile(const Tokens& x, int64_t m, const int8_t* codes, const GroupMeta* meta, int64_t groups,
                 __m256 (&out)[T][C], Ahead& ahead, int64_t per_group) {
  constexpr int kHalves = Q::kSplit ? 2 : 1, kSteps = 8 / kHalves;
  constexpr int kS0 = steps_in_int16<Q>(), kS = kS0 == 0 ? 1 : std::min(kS0, kSteps);
  const int64_t scales = groups / kPer;
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256 f[T][C], p[T][C];
  __m256(&sums)[T][C] = kPer == 1 ? f : p;  // what a group's sums go into
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) f[t][c] = p[t][c] = _mm256_setzero_ps();
  const uint8_t* xq = x.codes + m * x.K;
  for (int64_t g = 0; g < groups; ++g) {
    ahead.fetch(per_group);
    const uint8_t* xg = xq + 32 * g;
    const int8_t* wg = codes + g * 256;
#pragma GCC unroll 2
    for (int h = 0; h < kHalves; ++h) {
      __m256i acc[T][C];
      for (int t = 0; t < T; ++t) {
        const int32_t* sum = x.halves + 2 * ((m + t) * groups + g);
        const int32_t codes_sum = Q::kSplit ? sum[h] : sum[0] + sum[1];
        const __m256i init = _mm256_set1_epi32(-Q::kCentre * codes_sum);
        for (int c = 0; c < C; ++c) acc[t][c] = init;
      }
#pragma GCC unroll 8
      for (int k0 = h * kSteps; k0 < (h + 1) * kSteps; k0 += kS) {
        for (int t = 0; t < T; ++t)
          for (int c = 0; c < C; ++c) {
            const int8_t* w = wg + c * groups * 256;
            __m256i s16;
#pragma GCC unroll 8
            for (int k = k0; k < k0 + kS; ++k) {
              int32_t word;
              std::memcpy(&word, xg + t * x.K + 4 * k, 4);
              const __m256i product =
                  step<kS0>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * k)), _mm256_set1_epi32(word));
              s16 = k == k0 ? product : _mm256_add_epi16(s16, product);
            }
            acc[t][c] = _mm256_add_epi32(acc[t][c], _mm256_madd_epi16(s16, ones16));
          }
      }
      for (int c = 0; c < C; ++c) {
        const __m256 wd = _mm256_load_ps(meta[c * groups + g].wd[h]);
        for (int t = 0; t < T; ++t) {
          const __m256 scale =
              kPer == 1 ? _mm256_mul_ps(wd, _mm256_set1_ps(x.d[size_t((m + t) * scales + g)])) : wd;
          sums[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][c]), scale, sums[t][c]);
        }
      }
    }
    if (Q::kMin)
      for (int t = 0; t < T; ++t) {
        const __m256 s = _mm256_set1_ps(x.sums[size_t((m + t) * groups + g)]);
        for (int c = 0; c < C; ++c)
          sums[t][c] = _mm256_fmadd_ps(_mm256_load_ps(meta[c * groups + g].wm), s, sums[t][c]);
      }
    if (kPer > 1 && (g + 1) % kPer == 0)
      for (int t = 0; t < T; ++t) {
        const __m256 d = _mm256_set1_ps(x.d[size_t((m + t) * scales + g / kPer)]);
        for (int c = 0; c < C; ++c) {
          f[t][c] = _mm256_fmadd_ps(p[t][c], d, f[t][c]);
          p[t][c] = _mm256_setzero_ps();
        }
      }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) out[t][c] = f[t][c];
}

// 8 sums (+ bias) into out, the first `live` of them.
inline void store8(float* out, __m256 v, int64_t live) {
  if (live == 8) return _mm256_storeu_ps(out, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(out, tmp, size_t(live) * sizeof(float));
}
inline void store8(bf16_t* out, __m256 v, int64_t live) {
  alignas(32) bf16_t tmp[8];
  vec::store_bf16(tmp, vec::F{v});
  std::memcpy(out, tmp, size_t(live) * sizeof(bf16_t));
}

// Tokens [m, m + T) against the strip's columns [c0, c0 + C), into out
// (row `at` of the output is the strip's row 0).
template <typename Q, int kPer, int T, int C, typename TOut>
inline void tile_out(const Tokens& x, int64_t m, const Decoded& s, int64_t c0, int64_t rows, int64_t groups,
                     const float* bias, int64_t at, TOut* out, int64_t N, Ahead& ahead, int64_t per_group) {
  __m256 f[T][C];
  tile<Q, kPer, T, C>(x, m, s.codes.get() + c0 * groups * 256, s.meta.get() + c0 * groups, groups, f, ahead,
                      per_group);
  for (int c = 0; c < C; ++c) {
    const int64_t r = 8 * (c0 + c), live = std::min<int64_t>(8, rows - r);
    alignas(32) float b[8] = {};
    if (bias) std::memcpy(b, bias + at + r, size_t(live) * sizeof(float));
    for (int t = 0; t < T; ++t) store8(out + (m + t) * N + at + r, _mm256_add_ps(f[t][c], _mm256_load_ps(b)), live);
  }
}

// This form as quant_strip_run.h's driver takes it.
struct Form {
  static constexpr int64_t kRows = 8;
  static constexpr int kTileTokens = maddubs::kTileTokens, kTileColumns = maddubs::kTileColumns;
  static constexpr bool kUnsignedTokens = false;
  using Decoded = maddubs::Decoded;
  static int64_t columns_for(int64_t K) { return maddubs::columns_for(K); }
  template <typename Q>
  static void decode_column(const Part& p, int64_t K, int64_t r0, int64_t rows, int8_t* codes, GroupMeta* meta) {
    maddubs::decode_column<Q>(p, K, r0, rows, codes, meta);
  }
  template <typename Q, int kPer, int T, int C, typename TOut>
  static void tile_out(const Tokens& x, int64_t m, const Decoded& s, int64_t c0, int64_t rows, int64_t groups,
                       const float* bias, int64_t at, TOut* out, int64_t N, Ahead& ahead, int64_t per_group) {
    maddubs::tile_out<Q, kPer, T, C>(x, m, s, c0, rows, groups, bias, at, out, N, ahead, per_group);
  }
};

// y = x W^T (+ bias) for M tokens: each strip decoded once, then every token
// (the next strip's bytes asked for while this one's tiles run).
template <typename TX, typename TOut>
inline void run(const Blob& blob, const TX* x, int64_t M, const float* bias, TOut* out) {
  run_strips<Form>(blob, x, M, bias, out);
}

}  // namespace maddubs
}  // namespace quant
}  // namespace pagedserve

#endif  // PAGEDSERVE_QUANT_MADDUBS
