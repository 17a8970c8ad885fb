// The quantized linear at a few tokens over K-quant, Q4_0, Q4_1, Q5_0 and Q5_1 weights in 16-row panels
// (kernels/quant.py draws the layout; kernels.pack_linear makes it at
// load where this build runs without AMX).  From kFewTokens tokens on, a
// panel blob takes the int8 strips instead (quant_vnni.h decodes a panel
// without transposes).
//
// Why panels: in the file's order a row's sub-blocks of 32 lie side by
// side, so the one-token rows (quant_lanes.h) cover two sub-blocks of one
// row with each vpdpbusd and follow every one with its scales' permute,
// conversion and FMA: ~44 vector operations a super-block, 11 a vpdpbusd,
// which bound those rows by their instructions on Zen 4 (a Q4_K row read
// at ~14.5 GB/s a thread, where memory gave more).  Here an int32 lane is a
// row: it sums a whole sub-block (8 vpdpbusd) before its scale, the 16 rows'
// scales are one vector, and a sub-block's scale is an integer multiply, so
// a super-block's float work is one conversion and two FMAs.  A probe of
// this loop read a 2,048 -> 8,192 matrix at 1.8x the rows' rate on one
// thread, cold (docs/performance.md).
//
// The numbers: each token is rounded to int8 per 256 inputs against a
// K-quant blob (quant_tokens.h, as the strips do for K-quant blobs), per 32
// against a Q4_0, Q4_1, Q5_0 or Q5_1 one (as the file order's rows round it); the codes
// meet the weights' nibbles (0..15; Q4_K's high ones kept at 16x and their
// scale's sum shifted to match; Q5_K's with their fifth bit, 0..31) in
// integers, a sub-block's sums take its 6-bit scale in integers, and a
// super-block's take d and the token's scale in float.  The mins: each
// sub-block's -dmin x min times the token's code sum, in float.
#pragma once

#include "quant_vnni.h"

#if defined(PAGEDSERVE_QUANT_VNNI)

#include <ATen/Parallel.h>

#include <vector>

#include "team.h"

namespace pagedserve {
namespace quant {
namespace panels {

// Below this many tokens a panel blob takes the rows here, from it the
// strips: their decode is paid once a call and shared by the tokens.
constexpr int64_t kFewTokens = 8;

// Tokens [m, m + T) against one Q4_K panel (`blocks` super-blocks of 16
// rows), or with kFifth a Q5_K one: out[t] lane l = token m + t's sum for
// the panel's row l.  Q5_K's fifth bits (bit 2 pair of qh byte i for code
// byte i's low nibble, bit 2 pair + 1 for its high one; qh word k holds
// those of code word k of every pair) are shifted to bit 4 and joined to the
// nibbles by one ternary op, so its high nibbles are shifted down, not kept
// at 16x as Q4_K's are.
template <bool kFifth, int T>
inline void panel_times_tokens(const uint8_t* panel, int64_t blocks, const Tokens& x, int64_t m, __m512 (&out)[T]) {
  constexpr int64_t kChunk = kFifth ? kQ5KPanelChunk : kPanelChunk, kCodes = kFifth ? 768 : 256;
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(char(0xF0));
  const int64_t K = x.K, groups = x.groups, scales = groups / 8;
  const uint8_t* codes = x.codes + m * K;
  __m512 f[T];
  for (int t = 0; t < T; ++t) f[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* chunk = panel + b * kChunk;
    const char* ahead = reinterpret_cast<const char*>(chunk + 2 * kChunk);
    for (int line = 32; line < kChunk / 64; ++line) prefetch_l2(ahead + 64 * line);
    __m512 d, minus_dmin;
    vnni::panel_k4_d_dmin(chunk, d, minus_dmin);
    __m512i sums[T];
    __m512 mins[T];
    for (int t = 0; t < T; ++t) {
      sums[t] = _mm512_setzero_si512();
      mins[t] = _mm512_setzero_ps();
    }
    for (int pair = 0; pair < 4; ++pair) {  // sub-blocks 2 pair (low nibbles) and 2 pair + 1 (high)
      __m512i lo[T], hi[T];
      for (int t = 0; t < T; ++t) lo[t] = hi[t] = _mm512_setzero_si512();
      const uint8_t* xq = codes + 256 * b + 64 * pair;
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        prefetch_l2(ahead + 64 * (8 * pair + k));
        const __m512i v = _mm512_loadu_si512(chunk + kCodes + 512 * pair + 64 * k);
        __m512i wl, wh;
        if constexpr (kFifth) {
          const __m512i qh = _mm512_loadu_si512(chunk + 256 + 64 * k);
          wl = vnni::nibble_or(v, vnni::k5_fifth(qh, 2 * pair));
          wh = vnni::nibble_or(_mm512_srli_epi16(v, 4), vnni::k5_fifth(qh, 2 * pair + 1));
        } else {
          wl = _mm512_and_si512(v, low);
          wh = _mm512_and_si512(v, high);
        }
        for (int t = 0; t < T; ++t) {
          int32_t a, c;
          std::memcpy(&a, xq + t * K + 4 * k, 4);
          std::memcpy(&c, xq + t * K + 32 + 4 * k, 4);
          lo[t] = _mm512_dpbusd_epi32(lo[t], wl, _mm512_set1_epi32(a));
          hi[t] = _mm512_dpbusd_epi32(hi[t], wh, _mm512_set1_epi32(c));
        }
      }
      // |a sub-block's sum| <= 32 x 127 x 240, times a scale <= 63: eight fit an int32
      const __m512i sc_lo = _mm512_slli_epi32(vnni::panel_k4_field(chunk, 2 * pair, false), kFifth ? 0 : 4);
      const __m512i sc_hi = vnni::panel_k4_field(chunk, 2 * pair + 1, false);
      const __m512 wm_lo = _mm512_mul_ps(minus_dmin, _mm512_cvtepi32_ps(vnni::panel_k4_field(chunk, 2 * pair, true)));
      const __m512 wm_hi = _mm512_mul_ps(minus_dmin, _mm512_cvtepi32_ps(vnni::panel_k4_field(chunk, 2 * pair + 1, true)));
      for (int t = 0; t < T; ++t) {
        sums[t] = _mm512_add_epi32(sums[t], _mm512_add_epi32(_mm512_mullo_epi32(lo[t], sc_lo),
                                                             _mm512_mullo_epi32(hi[t], sc_hi)));
        const float* s = &x.sums[size_t((m + t) * groups + 8 * b + 2 * pair)];
        mins[t] = _mm512_fmadd_ps(wm_lo, _mm512_set1_ps(s[0]), mins[t]);
        mins[t] = _mm512_fmadd_ps(wm_hi, _mm512_set1_ps(s[1]), mins[t]);
      }
    }
    // Q4_K: the high nibbles' 16x, exactly
    const __m512 d16 = kFifth ? d : _mm512_mul_ps(d, _mm512_set1_ps(1.f / 16));
    for (int t = 0; t < T; ++t) {
      const __m512 xd = _mm512_set1_ps(x.d[size_t((m + t) * scales + b)]);
      f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t]), _mm512_mul_ps(d16, xd), f[t]);
      f[t] = _mm512_fmadd_ps(mins[t], xd, f[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = f[t];
}

// The same for a Q6_K panel (kernels/quant.py's layout: ql words, qh words,
// scales, d).  A word of 4 inputs of the 16 rows is one vector per run: its
// nibble of ql (words u and u + 8 hold runs 0 | 2 and 1 | 3) and its 2 bits
// of qh word u put together by a shift, a mask and one ternary logic op, as
// 0..63; the centre comes off in integers (32 x the token's 16-code sums,
// quant_tokens.h's halves), so a sub-block's sum takes its int8 scale as an
// integer multiply and a super-block ends in one conversion and FMA.
// |a sub-block's sum less 32 x its codes' sum| = |the sum of (q - 32) x|
// <= 16 x 32 x 127, times a scale <= 128, 16 of them: under 2^27.
template <int T>
inline void panel_times_tokens_q6k(const uint8_t* panel, int64_t blocks, const Tokens& x, int64_t m,
                                   __m512 (&out)[T]) {
  const __m512i top = _mm512_set1_epi8(0x30);
  const int64_t K = x.K, groups = x.groups, scales = groups / 8;
  const uint8_t* codes = x.codes + m * K;
  __m512 f[T];
  for (int t = 0; t < T; ++t) f[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* chunk = panel + b * kQ6KPanelChunk;
    const char* ahead = reinterpret_cast<const char*>(chunk + 2 * kQ6KPanelChunk);
    for (int line = 48; line < 53; ++line) prefetch_l2(ahead + 64 * line);
    __m512i acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_si512();
    for (int n = 0; n < 2; ++n)
      for (int hu = 0; hu < 2; ++hu) {  // words u of [4 hu, 4 hu + 4): sub-blocks 8 n + 2 run + hu
        __m512i s[T][4];
        for (int t = 0; t < T; ++t)
          for (int r = 0; r < 4; ++r) s[t][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int u = 4 * hu; u < 4 * hu + 4; ++u) {
          const int step = 8 * n + u;  // 16 steps a super-block, 3 lines of the next-but-one each
          for (int q = 0; q < 3; ++q) prefetch_l2(ahead + 64 * (3 * step + q));
          const __m512i qa = _mm512_loadu_si512(chunk + 64 * (16 * n + u));
          const __m512i qb = _mm512_loadu_si512(chunk + 64 * (16 * n + u + 8));
          const __m512i qh = _mm512_loadu_si512(chunk + kQ6KPanelQh + 64 * (8 * n + u));
          const __m512i w[4] = {vnni::nibble_or(qa, _mm512_and_si512(_mm512_slli_epi16(qh, 4), top)),
                                vnni::nibble_or(qb, _mm512_and_si512(_mm512_slli_epi16(qh, 2), top)),
                                vnni::nibble_or(_mm512_srli_epi16(qa, 4), _mm512_and_si512(qh, top)),
                                vnni::nibble_or(_mm512_srli_epi16(qb, 4), _mm512_and_si512(_mm512_srli_epi16(qh, 2), top))};
          for (int t = 0; t < T; ++t) {
            const uint8_t* xq = codes + t * K + 256 * b + 128 * n + 4 * u;
            for (int r = 0; r < 4; ++r) {
              int32_t a;
              std::memcpy(&a, xq + 32 * r, 4);
              s[t][r] = _mm512_dpbusd_epi32(s[t][r], w[r], _mm512_set1_epi32(a));
            }
          }
        }
        for (int r = 0; r < 4; ++r) {
          const int i = 8 * n + 2 * r + hu;  // the sub-block: inputs 16 i .. 16 i + 15
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + kQ6KPanelScales + 16 * i));
          const __m512i sc = _mm512_cvtepi8_epi32(bytes);
          for (int t = 0; t < T; ++t) {
            const int32_t centre = 32 * x.halves[size_t(2 * ((m + t) * groups + 8 * b) + i)];
            const __m512i centred = _mm512_sub_epi32(s[t][r], _mm512_set1_epi32(centre));
            acc[t] = _mm512_add_epi32(acc[t], _mm512_mullo_epi32(centred, sc));
          }
        }
      }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + kQ6KPanelD)));
    for (int t = 0; t < T; ++t) {
      const __m512 xd = _mm512_set1_ps(x.d[size_t((m + t) * scales + b)]);
      f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), _mm512_mul_ps(d, xd), f[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = f[t];
}

// The same for a Q4_0, Q4_1, Q5_0 or Q5_1 panel (kernels/quant.py's layout:
// the 16 rows' d, the _1 types' m, the Q5 types' qh words, then 4 nibble
// words a block: word w's low nibbles are inputs 4 w .. 4 w + 3, its high
// nibbles 16 + 4 w ..).  The tokens are rounded per 32, as the file order's
// rows round them for these types, so each block's int32 sums (8 vpdpbusd
// over its 32 inputs, the codes as stored, 0..15 or with a fifth bit 0..31,
// added as 16 under a byte mask: vnni::fifth_bits) take d times the token's
// scale in one conversion and FMA, and its min (the _1 types' m; a
// symmetric type's centre as -8 d or -16 d) meets the token's d x code sum
// in one more FMA: ~3 operations a vpdpbusd for Q4_0 / Q4_1 (~6 with the
// fifth bits), where the file order's rows spend ~14 (quant_lanes.h: four
// blocks of one row a vector, their codes put together from four loads, a
// row's lanes reduced at its end).
// A legacy panel's chunks (288-384 bytes) are not whole lines: prefetch.h's
// LinesAhead asks for each line once, in address order.
template <typename Q, int T>
inline void panel_times_tokens_legacy(const uint8_t* panel, int64_t blocks, const Tokens& x, int64_t m,
                                      __m512 (&out)[T]) {
  constexpr int64_t kChunk = kPanelRows * Q::kBytes, kWords = kPanelRows * Q::kQs, kQh = kPanelRows * Q::kHigh;
  const __m512i nibble = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(0x10);
  const int64_t K = x.K, groups = x.groups;
  const uint8_t* codes = x.codes + m * K;
  LinesAhead ahead(panel);
  __m512 f[T];
  for (int t = 0; t < T; ++t) f[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* chunk = panel + b * kChunk;
    ahead.through(chunk + kChunk);
    __m512i lo[T], hi[T];
    for (int t = 0; t < T; ++t) lo[t] = hi[t] = _mm512_setzero_si512();
    [[maybe_unused]] const __m512i qh = Q::kLevels == 32 ? _mm512_loadu_si512(chunk + kQh) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i v = _mm512_loadu_si512(chunk + kWords + 64 * k);
      __m512i wl = _mm512_and_si512(v, nibble), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      if constexpr (Q::kLevels == 32) {
        wl = _mm512_mask_add_epi8(wl, vnni::fifth_bits(qh, k, 0), wl, sixteen);
        wh = _mm512_mask_add_epi8(wh, vnni::fifth_bits(qh, k, 1), wh, sixteen);
      }
      for (int t = 0; t < T; ++t) {
        int32_t a, c;
        std::memcpy(&a, codes + t * K + 32 * b + 4 * k, 4);
        std::memcpy(&c, codes + t * K + 32 * b + 16 + 4 * k, 4);
        lo[t] = _mm512_dpbusd_epi32(lo[t], wl, _mm512_set1_epi32(a));
        hi[t] = _mm512_dpbusd_epi32(hi[t], wh, _mm512_set1_epi32(c));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
    const __m512 wm = Q::kMin ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32)))
                              : _mm512_mul_ps(d, _mm512_set1_ps(-float(Q::kCentre)));
    for (int t = 0; t < T; ++t) {
      const size_t at = size_t((m + t) * groups + b);
      const __m512i sum = _mm512_add_epi32(lo[t], hi[t]);
      f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(x.d[at])), f[t]);
      f[t] = _mm512_fmadd_ps(wm, _mm512_set1_ps(x.sums[at]), f[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = f[t];
}

// The panels a call's threads split (every part's, in order), kGrain at least a thread.
constexpr int64_t kGrain = 4;
inline int64_t count(const Blob& blob) {
  int64_t panels = 0;
  for (const Part& p : blob.parts) panels += p.rows / kPanelRows;
  return panels;
}

// Panel i and its part's type, found by walking the (one to three) parts,
// not from a list built per call: at one token that list's ~190 pushes cost
// ~1 us of a layer's serial time (docs/performance.md).
inline const uint8_t* panel(const Blob& blob, int64_t i, int64_t& type) {
  for (const Part& p : blob.parts) {
    const int64_t n = p.rows / kPanelRows;
    if (i < n) {
      type = p.type;
      return p.data + i * kPanelRows * p.row_bytes;
    }
    i -= n;
  }
  return nullptr;  // not reached: i < count(blob)
}

// Where run's second thread starts (its split of the panels among two
// threads), or nullptr where one thread takes them all.
inline const uint8_t* second_share(const Blob& blob) {
  const int64_t n = count(blob);
  int64_t type = 0;
  return shares(n, kGrain, 2) == 2 ? panel(blob, (n + 1) / 2, type) : nullptr;
}

// y = x W^T (+ bias) for M < kFewTokens tokens over a blob in panels: the
// threads split the panels, each runs all tokens.
template <typename TX, typename TOut>
inline void run(const Blob& blob, const TX* x, int64_t M, const float* bias, TOut* out) {
  const int64_t K = blob.K, N = blob.N;
  const int per = groups_a_scale(blob);  // 8: K-quants (per 256), 1: the legacy types (per 32)
  const Tokens tokens = quantize_tokens(x, M, K, per, false);
  pagedserve::parallel_for(0, count(blob), kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const __m512 b = bias ? _mm512_loadu_ps(bias + kPanelRows * i) : _mm512_setzero_ps();
      int64_t type = 0;
      const uint8_t* data = panel(blob, i, type);
      auto tile = [&](auto count, int64_t m) {
        constexpr int T = decltype(count)::value;
        __m512 f[T];
        switch (type) {
          case kQ6KId: panel_times_tokens_q6k<T>(data, K / 256, tokens, m, f); break;
          case kQ4KId: panel_times_tokens<false, T>(data, K / 256, tokens, m, f); break;
          case kQ5KId: panel_times_tokens<true, T>(data, K / 256, tokens, m, f); break;
          case kQ4_0Id: panel_times_tokens_legacy<Q4_0, T>(data, K / 32, tokens, m, f); break;
          case kQ4_1Id: panel_times_tokens_legacy<Q4_1, T>(data, K / 32, tokens, m, f); break;
          case kQ5_0Id: panel_times_tokens_legacy<Q5_0, T>(data, K / 32, tokens, m, f); break;
          default: panel_times_tokens_legacy<Q5_1, T>(data, K / 32, tokens, m, f); break;  // parse checks the type
        }
        for (int t = 0; t < T; ++t) vnni::store16(out + (m + t) * N + kPanelRows * i, _mm512_add_ps(f[t], b), 0xFFFF);
      };
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{}, m);
      switch (M - m) {
        case 3: tile(std::integral_constant<int, 3>{}, m); break;
        case 2: tile(std::integral_constant<int, 2>{}, m); break;
        case 1: tile(std::integral_constant<int, 1>{}, m); break;
        default: break;
      }
    }
  });
}

}  // namespace panels
}  // namespace quant
}  // namespace pagedserve

#endif  // PAGEDSERVE_QUANT_VNNI
