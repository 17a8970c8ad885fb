// The quantized linear at a few tokens (decode steps): a weight row against
// the tokens' 8-bit blocks, 8 sub-blocks of 32 at a time, each decoded once
// for up to 4 tokens.
//
// Why its own path: at one token the tile path (quant_linear.h) spends per 32
// weights an int32 -> float conversion, a scalar scale product, a broadcast,
// an FMA and a scalar min term: more instructions than the decode and the
// dot product together, which left the 4-bit types compute-bound at about
// half the memory's read rate.  Here the 8 dot products of a group (8 blocks
// of a legacy type, or one K-quant super-block's 8 sub-blocks) are summed
// across their lanes into one vector of 8 (lane j: sub-block j), so the
// conversion, the scales (8 side by side, against the token's 8 block scales
// loaded as one vector) and the min term are one vector operation per 256
// weights instead of 8.
//
// Q6_K scales each 16 weights apart, so its sub-blocks' dot products are
// summed as halves instead (split_step): two rounds of hadd leave the first
// halves of four sub-blocks in one 128-bit lane and their second halves in
// the other, which the 16 scales meet in two vectors.
//
// That is the AVX2 build's form, but for Q4_0 and Q4_1, which go two blocks a
// vector with no sum across lanes until a row ends (pair_step).  The AVX512
// build (with VNNI) takes quant_lanes.h's instead, for every type: 64 weights
// a dpbusd and no sum across lanes until a row ends.  XScales, row_dot and
// four_rows are the entry for both.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_act.h"
#include "quant_blocks.h"
#include "quant_lanes.h"
#include "prefetch.h"

namespace pagedserve {
namespace quant {

// Whether this build's rows take quant_lanes.h (AVX512 + VNNI) rather than
// the 256-bit forms below (AVX2), whose tokens' codes go as they come.
#if defined(PAGEDSERVE_QUANT_LANES)
constexpr bool kQuantLanes = true;
#else
constexpr bool kQuantLanes = false;
template <typename Q>
constexpr const int* lane_slots() {
  return nullptr;
}
#endif

// The tokens' block scales d and sums s side by side: 8 of them load as one
// vector (zeros past a token's last, which a row's last group reads).  With
// `halves` (Q6_K) also each block's two 16-code sums, in split_step's lane
// order per 8 blocks: first halves of blocks 0-3, their second halves, the
// same of blocks 4-7.  In the AVX512 build (kQuantLanes: quant_lanes.h) the
// codes contiguous instead, a token's in whole groups of 8 sub-blocks (a
// short last group zero-filled), half h of sub-block i of each group in
// 16-code slot slots[2 i + h] (quant_lanes.h's lane_slots; nullptr: as
// they come), and Q6_K's half sums times -32 in block order.
struct XScales {
  int64_t stride, padded;  // XBlocks a token; floats a token here
  int64_t whole;           // sub-blocks a token in the lanes' codes: whole groups of 8
  std::vector<float> d, s;
  std::vector<int32_t> half;  // 2 stride a token
  std::vector<int8_t> lane_q;   // the codes, contiguous
  std::vector<float> lane_off;  // Q6_K: -32 x each 16 codes' sum
  XScales(const XBlock* x, int64_t n, int64_t tokens, bool halves = false, const int* slots = nullptr)
      : stride(n), padded(n + 8), whole((n + 7) / 8 * 8), d(size_t(tokens * padded)), s(size_t(tokens * padded)) {
    constexpr bool lanes = kQuantLanes;
    if (halves && !lanes) half.resize(size_t(tokens * 2 * n));
    if (lanes) lane_q.resize(size_t(tokens * whole * 32));
    if (lanes && halves) lane_off.resize(size_t(tokens * whole * 2));
    for (int64_t m = 0; m < tokens; ++m)
      for (int64_t i = 0; i < n; ++i) {
        const XBlock& b = x[m * n + i];
        d[size_t(m * padded + i)] = b.d;
        s[size_t(m * padded + i)] = b.s;
        if (lanes)
          for (int h = 0; h < 2; ++h) {
            const int64_t slot = 2 * (i - i % 8) + (slots ? slots[2 * (i % 8) + h] : 2 * (i % 8) + h);
            std::memcpy(lane_q.data() + 16 * (2 * m * whole + slot), b.q + 16 * h, 16);
          }
        if (!halves) continue;
        int32_t sums[2] = {0, 0};
        for (int k = 0; k < 32; ++k) sums[k / 16] += b.q[k];
        if (lanes) {
          for (int h = 0; h < 2; ++h) lane_off[size_t(2 * (m * whole + i) + h)] = -32.f * float(sums[h]);
          continue;
        }
        const int64_t group = i / 8 * 16, lane = i % 8 / 4 * 8 + i % 4;
        for (int h = 0; h < 2; ++h) half[size_t(m * 2 * n + group + lane + 4 * h)] = sums[h];
      }
  }
#if defined(PAGEDSERVE_QUANT_LANES)
  LaneView lanes() const {
    return {whole, lane_q.data(), d.data(), s.data(), padded, lane_off.data()};
  }
#endif
};

#if defined(__AVX2__)
// Lane j of the result: the sum of v[j]'s 8 lanes.
inline __m256i sum_lanes8(const __m256i (&v)[8]) {
  // a = [v0 v1 v2 v3 low halves' sums | the same of the high halves]; b of v4..v7.
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Q4_0 and Q4_1 go two blocks a vector instead (pair_step).
template <typename Q>
constexpr bool kPairs = std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1>;

// pair_step's pair p of a group: lanes 0-3 read block 2p, lanes 4-7 block 2p + 1.
inline __m256 pair_scales(__m256 s, int p) {
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1,
                                                       2 * p + 1, 2 * p + 1));
}

// group_step for the 4-bit legacy types, two blocks a vector and nothing
// summed across lanes until the row ends (quant_lanes.h's idea in 256 bits).
// Why: group_step's per-group work was port-5 work on Intel (the nibbles'
// 128-bit inserts, sum_lanes8's six hadds and two permutes), which left a
// one-token Q4_1 row of the AVX2 build bound by that port.  Here a pair of
// blocks loads as one vector (block 2p's 16 bytes low, 2p + 1's high), its
// low nibbles are the two blocks' first 16 codes and its high nibbles their
// last 16, so their maddubs with the token's codes in the same order add in
// int16 (at most 2 x 2 x 15 x 127), one madd leaves lanes 0-3 block 2p's
// sum and lanes 4-7 block 2p + 1's, and one conversion and one FMA by the
// pair's scales serve both blocks.  The codes go in unsigned (0..15): Q4_0's
// centre comes off as a min, -8 d times the token's d * sum(q) (XScales::s).
// A short group's missing block re-reads its pair's first (its scale is 0).
template <typename Q, bool kFull, int R>
__attribute__((always_inline)) inline void pair_step(const uint8_t* g, int count, const XBlock* x,
                                                     const XScales& xs, int64_t m0, int64_t x0, __m256 (&acc)[R],
                                                     __m256 (&mins)[R]) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i lo[4], hi[4];
  auto second = [&](int p) { return kFull || 2 * p + 1 < count ? 1 : 0; };
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    if (!kFull && 2 * p >= count) continue;
    const uint8_t* a = g + 2 * p * Q::kBytes + Q::kQs;
    const __m256i v = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(a + second(p) * Q::kBytes),
                                          reinterpret_cast<const __m128i*>(a));
    lo[p] = _mm256_and_si256(v, low);
    hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
  __m256 wd, wm;
  group_scales<Q>(g, kFull ? 8 : count, wd, wm);
  if (!Q::kMin) wm = _mm256_mul_ps(wd, _mm256_set1_ps(-float(Q::kCentre)));
  for (int r = 0; r < R; ++r) {
    const XBlock* xr = x + (m0 + r) * xs.stride + x0;
    const __m256 s = _mm256_mul_ps(wd, _mm256_loadu_ps(xs.d.data() + (m0 + r) * xs.padded + x0));
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      if (!kFull && 2 * p >= count) continue;
      const int8_t* xa = xr[2 * p].q;
      const int8_t* xb = xr[2 * p + second(p)].q;
      const __m256i xl = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(xb),
                                             reinterpret_cast<const __m128i*>(xa));
      const __m256i xh = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(xb + 16),
                                             reinterpret_cast<const __m128i*>(xa + 16));
      const __m256i sums = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xl), _mm256_maddubs_epi16(hi[p], xh)), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), pair_scales(s, p), acc[r]);
    }
    mins[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xs.s.data() + (m0 + r) * xs.padded + x0), mins[r]);
  }
}

// The `count` sub-blocks of the group at g (all 8, or fewer in a legacy
// row's last group), decoded once, times R tokens' blocks (x, token r at
// x + (m0 + r) * xs.stride) into acc[r] and mins[r].
template <typename Q, bool kFull, int R>
__attribute__((always_inline)) inline void group_step(const uint8_t* g, int count, const XBlock* x,
                                                      const XScales& xs, int64_t m0, int64_t x0, __m256 (&acc)[R],
                                                      __m256 (&mins)[R]) {
  if constexpr (kPairs<Q>) return pair_step<Q, kFull, R>(g, count, x, xs, m0, x0, acc, mins);
  __m256i q[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    q[j] = !kFull && j >= count ? _mm256_setzero_si256()
                                : Q::q_avx2(g + (j / Q::kSubs) * Q::kBytes, j % Q::kSubs);
  __m256 wd, wm;
  if constexpr (R == 1 || Q::kSubs > 1) group_scales<Q>(g, kFull ? 8 : count, wd, wm);
  else group_scales_call<Q>(g, kFull ? 8 : count, wd, wm);
  for (int r = 0; r < R; ++r) {
    const XBlock* xr = x + (m0 + r) * xs.stride + x0;
    __m256i dots[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      dots[j] = !kFull && j >= count
                    ? _mm256_setzero_si256()
                    : dot32<!Q::kMin>(q[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j].q)));
    const float* d = xs.d.data() + (m0 + r) * xs.padded + x0;
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes8(dots)), _mm256_mul_ps(wd, _mm256_loadu_ps(d)), acc[r]);
    if (Q::kMin) mins[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xs.s.data() + (m0 + r) * xs.padded + x0), mins[r]);
  }
}

// One Q6_K super-block (its 8 sub-blocks of 32 at g) times R tokens' blocks
// into acc[r].  A dot32 lane holds 4 bytes, so lanes 0-3 are a sub-block's
// first 16 weights and lanes 4-7 its second; hadd(hadd(d0, d1), hadd(d2, d3))
// is [d0 d1 d2 d3 first halves | the same second halves].  The scales are
// ordered to match: sc[2 j] (first half of j) and sc[2 j + 1] (second).
// The codes go in unsigned (0..63, dpbusd's own operand, no sign moves), and
// 32 times the activations' half sums come off in integers after:
// sum (c - 32) x = sum c x - 32 sum x, the same int32 sums as before.
template <int R>
inline void split_step(const uint8_t* g, const XBlock* x, const XScales& xs, int64_t m0, int64_t x0,
                       __m256 (&acc)[R]) {
  __m256i q[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) q[j] = Q6_K::codes_avx2(g, j);
  // sc[0 2 4 6 1 3 5 7 | 8 10 12 14 9 11 13 15] -> two vectors of floats times d
  const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 192)),
                                      _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
  const __m256 d = _mm256_set1_ps(fp16_to_float(g + 208));
  const __m256 wa = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
  const __m256 wb = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
  for (int r = 0; r < R; ++r) {
    const XBlock* xr = x + (m0 + r) * xs.stride + x0;
    __m256i dots[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      dots[j] = dot32<false>(q[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j].q)));
    const int32_t* halves = xs.half.data() + (m0 + r) * 2 * xs.stride + 2 * x0;
    const __m256i a = _mm256_sub_epi32(
        _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]), _mm256_hadd_epi32(dots[2], dots[3])),
        _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)), 5));
    const __m256i b = _mm256_sub_epi32(
        _mm256_hadd_epi32(_mm256_hadd_epi32(dots[4], dots[5]), _mm256_hadd_epi32(dots[6], dots[7])),
        _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + 8)), 5));
    const float* dx = xs.d.data() + (m0 + r) * xs.padded + x0;
    const __m256 da = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(dx));
    const __m256 db = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(dx + 4));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(wa, da), acc[r]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_mul_ps(wb, db), acc[r]);
  }
}

// One Q6_K row (`blocks` super-blocks at w) times tokens m0 .. m0 + R - 1 into out[r].
template <int R>
inline void split_row_dot(const uint8_t* w, int64_t blocks, const XBlock* x, const XScales& xs, int64_t m0,
                          float (&out)[R][1]) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_ahead(w + b * Q6_K::kBytes, Q6_K::kBytes);
    split_step<R>(w + b * Q6_K::kBytes, x, xs, m0, b * Q6_K::kSubs, acc);
  }
  for (int r = 0; r < R; ++r) out[r][0] = hsum(acc[r]);
}

// One weight row (`blocks` blocks of Q at w) times tokens m0 .. m0 + R - 1 (x, xs) into out[r].
template <typename Q, int R>
inline void row_dot(const uint8_t* w, int64_t blocks, const XBlock* x, const XScales& xs, int64_t m0,
                    float (&out)[R][1]) {
#if defined(PAGEDSERVE_QUANT_LANES)
  (void)x;
  lanes_row_dot<Q, R>(w, blocks, xs.lanes(), m0, out);
#else
  if constexpr (Q::kSplit) {
    split_row_dot<R>(w, blocks, x, xs, m0, out);
  } else {
    constexpr int kPer = 8 / Q::kSubs;  // blocks a group
    __m256 acc[R], mins[R];
    for (int r = 0; r < R; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + kPer <= blocks; b += kPer) {
      prefetch_ahead(w + b * Q::kBytes, kPer * Q::kBytes);
      group_step<Q, true, R>(w + b * Q::kBytes, 8, x, xs, m0, b * Q::kSubs, acc, mins);
    }
    if (b < blocks)  // a legacy row of 8 k + 1 .. 8 k + 7 blocks
      group_step<Q, false, R>(w + b * Q::kBytes, int(blocks - b), x, xs, m0, b, acc, mins);
    for (int r = 0; r < R; ++r) out[r][0] = hsum(_mm256_add_ps(acc[r], mins[r]));
  }
#endif
}

// C weight rows (`row_bytes` apart from w) times one token: out[0][c].  Each
// row's sum is row_dot's to the bit (its groups in the same order, the same
// steps); C rows side by side are C independent chains.  Why: a row of a
// small model is short (SmolLM2's 576 inputs: two groups and a tail), and
// one row at a time left its chain's latency, its sum across lanes and its
// store in the open between rows (~7 % of a one-stream SmolLM2 step's
// samples on the store alone).  The next four rows are asked for in address
// order, a step's share at a time, as quant_lanes.h's lanes_rows_dot says;
// with that, rows of every length go four at a time (below 1,536 bytes only
// while each row asked for 4 KiB past its own group, which past ~1 KiB a
// row lands in the panel being read): a Llama-3.2-1B Q4_K_M token on the
// AVX2 build took 17.9-18.9 ms against 20.4-25.6 (Zen 5, alternated).
template <typename Q, int C>
inline void rows_dot(const uint8_t* w, int64_t row_bytes, int64_t blocks, const XBlock* x, const XScales& xs,
                     float (&out)[1][C]) {
  static_assert(!Q::kSplit, "Q6_K goes a row at a time (four_rows)");
  constexpr int kPer = 8 / Q::kSubs;  // blocks a group
  __m256 acc[C][1], mins[C][1];
  for (int c = 0; c < C; ++c) acc[c][0] = mins[c][0] = _mm256_setzero_ps();
  constexpr int64_t kLines = (C * kPer * Q::kBytes + 63) / 64;  // a step's share of the next panel
  Ahead next = panel_ahead(w, C * row_bytes);
  int64_t b = 0;
  for (; b + kPer <= blocks; b += kPer) {
    next.fetch(kLines);
    for (int c = 0; c < C; ++c)
      group_step<Q, true, 1>(w + c * row_bytes + b * Q::kBytes, 8, x, xs, 0, b * Q::kSubs, acc[c], mins[c]);
  }
  if (b < blocks) {
    next.fetch(INT64_MAX);
    with_short_group(blocks - b, [&](auto count) {
      for (int c = 0; c < C; ++c)
        group_step<Q, false, 1>(w + c * row_bytes + b * Q::kBytes, int(count), x, xs, 0, b, acc[c], mins[c]);
    });
  }
  for (int c = 0; c < C; ++c) out[0][c] = hsum(_mm256_add_ps(acc[c][0], mins[c][0]));
}

// One token against rows [n0, n1) of a part whose rows start at global row
// `first` (quant_linear.h's Rows and Sink), four at a time: in the AVX512
// build every type (quant_lanes.h), in the AVX2 build every type but Q6_K
// (1.22x the time four at a time).  Returns the first row left to row_dot.
// step() runs once per row, sink.put stores the sums.
template <typename Q, typename Rows, typename Sink, typename Step>
inline int64_t four_rows(const Rows& rows, int64_t first, int64_t n0, int64_t n1, const XBlock* x,
                         const XScales& xs, const Sink& sink, const Step& step) {
  int64_t n = n0;
#if defined(PAGEDSERVE_QUANT_LANES)
  for (; n + 4 <= n1; n += 4) {
    for (int c = 0; c < 4; ++c) step();
    float sums[1][4];
    lanes_rows_dot<Q, 4>(rows.data + (n - first) * rows.row_bytes, rows.row_bytes, rows.blocks, xs.lanes(), sums);
    sink.template put<1, 4>(sums, 0, n);
  }
#else
  if constexpr (!Q::kSplit) {
    for (; n + 4 <= n1; n += 4) {
      for (int c = 0; c < 4; ++c) step();
      float sums[1][4];
      rows_dot<Q, 4>(rows.data + (n - first) * rows.row_bytes, rows.row_bytes, rows.blocks, x, xs, sums);
      sink.template put<1, 4>(sums, 0, n);
    }
  }
#endif
  return n;
}
#endif  // __AVX2__

}  // namespace quant
}  // namespace pagedserve
