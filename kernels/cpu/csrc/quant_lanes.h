// The quantized linear's rows at a few tokens in 512-bit lanes: the AVX512
// build's form (with VNNI) of quant_gemv.h's row_dot, for every type.
//
// Why its own form: quant_gemv.h sums each sub-block's 8 int32 lanes into
// one number (hadd rounds, then a cross-lane permute) so that one float
// product per sub-block applies its scale and the token's.  At one token
// that reduction was the largest share of the K-quants' instructions: they
// read at 44-47 % of torch.sum's rate where Q8_0, with 1.9x the bytes per
// weight, read at 86 % (`python -m bench.kernels.quant_linear --rows 1`).
// Here nothing is summed across lanes until a row ends.  One dpbusd takes
// two sub-blocks (64 weights), its 16 int32 lanes go to float as they are,
// and each lane meets its own sub-block's scale times the token's (the 8 or
// 16 products of a group computed once a token, then permuted over the
// lanes they cover) in an FMA into a float accumulator.  A lane holds 4
// products, so a Q6_K half (16 weights with their own scale) is lanes 0-3 or
// 4-7 of its sub-block: no separate form for Q6_K.
//
// A pair of sub-blocks loads as one vector of codes.  Q4_K and Q5_K store
// sub-blocks 2i and 2i + 1 as the low and high nibbles of the same 32 bytes,
// so 64 bytes hold four: their low nibbles are sub-blocks 4h and 4h + 2,
// their high nibbles 4h + 1 and 4h + 3 (kSlots), and the token's codes are
// copied in that order (XScales).  Their 6-bit scales and mins unpack in one
// vector (k4_scales16) rather than word by word.  Together these took a
// fifth off a cold Q4_K row (a 2-thread loop over 24 Qwen3-shaped matrices
// here: 0.78-0.85x the time) without a byte of the file moved.  Q6_K's pairs
// are 64 bytes of ql with their 2-bit highs from one 32-byte qh, rotated per
// half.  The legacy nibble types go four blocks a vector: the first 16
// codes (low nibbles) of blocks 4q .. 4q + 3, then a vector of their last
// 16 (high nibbles), so both vectors' lane l is block 4q + l / 4, their
// dot products add in integers, and one conversion and one FMA serve four
// blocks (kShared; the token's codes go in the same order, by halves).
// Their scales come out of the blocks by 16-bit permutes, not a gather
// (legacy_scales).  The codes go in as stored (0..15, 0..31, 0..63): a symmetric
// type's centre comes off as a min (-8 d, -16 d, met by the token's d *
// sum(q)), Q6_K's as -32 x the 16-code sums at their scales.  Q8_0's codes
// are signed: their sign moves onto the token's codes (dpbusd wants the
// first operand unsigned).
//
// The sums are the same products as quant_gemv.h's, added in another order
// (per lane, then across lanes), within the tests' activation bound.  Rows
// go four at a time at every length (lanes_rows_dot): one row at a time was
// 1.02-1.31x the time, the row's end left in the open.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "prefetch.h"
#include "quant_act.h"
#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDSERVE_QUANT_LANES 1

namespace pagedserve {
namespace quant {

// A call's tokens as the lanes read them.
struct LaneView {
  int64_t subs;     // sub-blocks of 32 a token, rounded up to whole groups of 8
  const int8_t* q;  // [tokens, subs, 32]: the codes, contiguous
  const float* d;   // a block's scale, stride floats a token (XScales::d)
  const float* s;   // a block's d * sum(q), the same (XScales::s)
  int64_t stride;
  const float* off;  // Q6_K: [tokens, 2 subs]: -32 x each 16 codes' sum
};

// The 32 bytes at p in both halves of a vector.
inline __m512i both_halves(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The high bits of a K-quant's codes: the `width`-bit field at bit a of each
// of the 32 bytes at p in the low half, at bit a + 2 in the high half,
// masked and rotated up to bit 4 of its byte (a 64-bit rotate moves every
// byte's bits alike), the other bits zero.
inline __m512i fields_at_4(const uint8_t* p, int width, int a) {
  const int mask = (1 << width) - 1, low = (4 - a) & 63, high = (2 - a) & 63;
  const __m512i fields =
      _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8(char(mask << a)), _mm512_set1_epi8(char(mask << (a + 2))));
  return _mm512_rolv_epi64(_mm512_and_si512(both_halves(p), fields),
                           _mm512_setr_epi64(low, low, low, low, high, high, high, high));
}

// The low nibbles of v (shifted right by 4 first when `upper`) with the high
// bits above them: one ternary op, A & C | B over (A, B, C) = (v, high, 0x0F).
// Against masking the nibbles, shifting the highs up and or-ing, two fewer
// vector ops a pair: rows hot in L3 took 70-75 us against 73-80 (Q6_K,
// 2,048 -> 4,096) and 70-73 against 73-77 (Q5_K).
inline __m512i nibbles_under(__m512i v, bool upper, __m512i high) {
  return _mm512_ternarylogic_epi32(upper ? _mm512_srli_epi64(v, 4) : v, high, _mm512_set1_epi8(0x0F), 0xEC);
}

// Lane l of the result: lane 4 i + l / 4 of v, i = 0..3: each of 4 values over 4 lanes.
inline __m512 spread4(__m512 v, int i) {
  const int a = 4 * i;
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(a, a, a, a, a + 1, a + 1, a + 1, a + 1, a + 2, a + 2, a + 2, a + 2, a + 3, a + 3, a + 3, a + 3),
      v);
}

// Per type, for a group of 8 sub-blocks at g (a K-quant's super-block, or 8
// blocks of a legacy type, `count` of them where a row's last group is
// short): codes(g, p, count), the codes of sub-blocks 2p and 2p + 1 as
// dpbusd's unsigned operand (signed for Q8_0: kSigned); scales(g, count, w,
// wm), the weight scales (8, or Q6_K's 16) and the 8 sub-blocks' mins
// (kMins); per_token(w, xd), those scales times the token's 8 block scales;
// lanes(sx, p), pair p's 16 lanes' scales out of per_token's.
template <typename Q>
struct Lanes;

// One scale per sub-block: sub-block 2p over lanes 0-7, 2p + 1 over 8-15.
struct EightScales {
  static __m512 per_token(__m512 w, const float* xd) {
    return _mm512_mul_ps(w, _mm512_zextps256_ps512(_mm256_loadu_ps(xd)));
  }
  static __m512 lanes(__m512 sx, int p) {
    const int a = 2 * p, b = 2 * p + 1;
    return _mm512_permutexvar_ps(_mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b), sx);
  }
};

// A Q4_K or Q5_K super-block's scales: lanes 0-7 its 8 sub-blocks' scales
// times d, lanes 8-15 their mins times -dmin (k4_scales' numbers).  The 12
// bytes at g + 4 (ggml's get_scale_min_k4): for j < 4, scale j is q[j] &
// 63 and min j q[j + 4] & 63; for j >= 4, scale j is q[j + 4] & 15 with
// q[j - 4]'s top two bits above, min j q[j + 4] >> 4 with q[j]'s.
inline __m512 k4_scales16(const uint8_t* g) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 4)));
  const __m512i low_at = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
  const __m512i low = _mm512_and_si512(
      _mm512_srlv_epi32(_mm512_permutexvar_epi32(low_at, q), _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4)),
      _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m512i high_at = _mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
  const __m512i high = _mm512_and_si512(  // (b >> 6) << 4
      _mm512_srli_epi32(_mm512_permutexvar_epi32(high_at, q), 2),
      _mm512_setr_epi32(0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30, 0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30));
  int32_t d_dmin;
  std::memcpy(&d_dmin, g, 4);
  const __m512 dd = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                          _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(d_dmin))));
  const __m512 signs = _mm512_castsi512_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN,
                                                             INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN));
  return _mm512_mul_ps(_mm512_xor_ps(dd, signs), _mm512_cvtepi32_ps(_mm512_or_si512(low, high)));
}

// Q4_K and Q5_K: vector p holds sub-blocks a and a + 2, a = 4 (p / 2) + p % 2
// (the low or the high nibbles of 64 bytes).
struct NibblePairs {
  // half h of sub-block i: 16-code slot kSlots[2 i + h] of the token's codes
  // (sub-block i whole in its 32-code slot 0, 2, 1, 3, 4, 6, 5, 7)
  static constexpr int kSlots[16] = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15};
  static int first(int p) { return 4 * (p / 2) + p % 2; }
  // nibbles of the 64 code bytes at q holding vector p
  static __m512i nibbles(const uint8_t* q, int p) {
    const __m512i v = _mm512_loadu_si512(q + 64 * (p / 2));
    return _mm512_and_si512(p % 2 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
  }
  static void scales(const uint8_t* g, int, __m512& w, __m256& wm) {
    w = k4_scales16(g);
    wm = _mm512_extractf32x8_ps(w, 1);
  }
  static __m512 per_token(__m512 w, const float* xd) { return EightScales::per_token(w, xd); }
  static __m512 lanes(__m512 sx, int p) {
    const int a = first(p), b = a + 2;
    return _mm512_permutexvar_ps(_mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b), sx);
  }
};

template <>
struct Lanes<Q4_K> : NibblePairs {
  static constexpr bool kSigned = false, kMins = true, kShared = false;
  static __m512i codes(const uint8_t* g, int p, int) { return nibbles(g + 16, p); }
};

template <>
struct Lanes<Q5_K> : Lanes<Q4_K> {
  static __m512i codes(const uint8_t* g, int p, int) {
    // bit j of qh's byte i: sub-block j's code i
    return nibbles_under(_mm512_loadu_si512(g + 48 + 64 * (p / 2)), p % 2, fields_at_4(g + 16, 1, first(p)));
  }
};

template <>
struct Lanes<Q6_K> {
  static constexpr bool kSigned = false, kMins = false, kShared = false;
  // qh's byte i holds the 2-bit highs of code i of four sub-blocks, 2 bits apart
  static __m512i codes(const uint8_t* g, int p, int) {
    const int h = p / 2, upper = p % 2;  // upper: sub-blocks 4h + 2, 4h + 3 (ql's high nibbles)
    return nibbles_under(_mm512_loadu_si512(g + 64 * h), upper, fields_at_4(g + 128 + 32 * h, 2, 4 * upper));
  }
  static void scales(const uint8_t* g, int, __m512& w, __m256& wm) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 192));
    w = _mm512_mul_ps(_mm512_set1_ps(fp16_to_float(g + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    wm = _mm256_setzero_ps();
  }
  // scale 2j (sub-block j's first 16 weights) and 2j + 1 (its second) meet xd[j]
  static __m512 per_token(__m512 w, const float* xd) {
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_mul_ps(w, _mm512_permutexvar_ps(twice, _mm512_zextps256_ps512(_mm256_loadu_ps(xd))));
  }
  // lanes 4i .. 4i + 3 of pair p: the 16 weights of scale 4p + i
  static __m512 lanes(__m512 sx, int p) { return spread4(sx, p); }
};

// Legacy blocks 2p and 2p + 1 of a group (zeros past a short group's
// `count`): f(block) gives a block's 32 bytes in a 256-bit half.
template <typename Q, typename F>
inline __m512i block_pair(const uint8_t* g, int p, int count, const F& f) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i a = 2 * p < count ? f(g + 2 * p * Q::kBytes) : zero;
  const __m256i b = 2 * p + 1 < count ? f(g + (2 * p + 1) * Q::kBytes) : zero;
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// A legacy block's fifth bits (a 32-bit word), 0 past `count`.
template <typename Q>
inline uint64_t fifth_bits(const uint8_t* g, int j, int count) {
  uint32_t bits = 0;
  if (j < count) std::memcpy(&bits, g + j * Q::kBytes + Q::kHigh, 4);
  return bits;
}

// A legacy group's 8 block scales d (and mins m for the _1 types: fp16 at
// the start of each block) picked out of the group's bytes by 16-bit
// permutes.  Why not quant_blocks.h's group_scales, a gather of the 8
// blocks' first words: on Zen 5 the gather took about as long as the rest
// of a Q4_1 group's work (576 rows of 1,536 inputs, one thread: 22.7 us a
// call with it, 16.8 without, the blocks still a pair a vector).  The loads stop at the group's last block (zeros after
// it), so a short group's missing blocks scale by 0.
template <typename Q>
inline void legacy_scales(const uint8_t* g, int count, __m256& d, __m256& m) {
  constexpr int kHalves = Q::kBytes / 2;  // a block's length in fp16 words
  auto words = [&](int i) {               // the group's fp16 words [32 i, 32 i + 32)
    const int left = std::clamp(count * kHalves - 32 * i, 0, 32);
    return _mm512_maskz_loadu_epi16(left == 32 ? ~0u : (1u << left) - 1, g + 64 * i);
  };
  // word j of the result: block j % 8's d (j < 8) or m (j >= 8), fp16 word kHalves (j % 8) + j / 8 of the group
  constexpr auto word = [](int j) { return kHalves * (j % 8) + j / 8; };
  alignas(64) static constexpr auto kAt = [&] {
    std::array<int16_t, 32> at{};
    for (int j = 0; j < 16; ++j) at[size_t(j)] = int16_t(word(j) % 64);
    return at;
  }();
  constexpr int kLast = word(Q::kMin ? 15 : 7);  // the last word read
  constexpr __mmask32 kPast = [&] {  // the words past the group's first 128 bytes
    __mmask32 past = 0;
    for (int j = 0; j < 16; ++j) past |= __mmask32(word(j) >= 64 && word(j) <= kLast) << j;
    return past;
  }();
  const __m512i at = _mm512_load_si512(kAt.data());
  __m512i d_m = _mm512_permutex2var_epi16(words(0), at, words(1));
  if constexpr (kPast != 0)
    d_m = _mm512_mask_blend_epi16(
        kPast, d_m, _mm512_permutex2var_epi16(words(2), at, kLast >= 96 ? words(3) : _mm512_setzero_si512()));
  d = _mm256_cvtph_ps(_mm512_castsi512_si128(d_m));
  m = Q::kMin ? _mm256_cvtph_ps(_mm512_extracti32x4_epi32(d_m, 1)) : _mm256_setzero_ps();
}

// Q4_0, Q4_1, Q5_0, Q5_1 in quads: vector p holds half p % 2 of blocks
// 4 (p / 2) .. 4 (p / 2) + 3, 16 codes each (a block's low nibbles are its
// first 16 weights, its high nibbles the last 16), so lane l is block
// 4 (p / 2) + l / 4 in both vectors of a quad: their dot products add in
// integers, and one conversion and one FMA serve 4 blocks (kShared), where
// a pair of blocks a vector took one each.  The codes go in as stored (0..15,
// 0..31); a symmetric type's centre becomes its min, -centre x d, met by the
// token's d * sum(q).  kSlots puts the token's codes in the same order.
template <bool kFifthBit, bool kHasMin>
struct Lanes<Nibbles<kFifthBit, kHasMin>> {
  using Q = Nibbles<kFifthBit, kHasMin>;
  static constexpr bool kSigned = false, kMins = true, kShared = true;
  // half h of block i: slot kSlots[2 i + h]
  static constexpr int kSlots[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
  // the 16 nibble bytes of blocks 4 (p / 2) .. + 3 side by side, zeros past
  // `count`; the high nibbles shifted down for p odd; bit i of a fifth-bit
  // word is byte i % 16's 0x10 in half i / 16
  static __m512i codes(const uint8_t* g, int p, int count) {
    const int first = 4 * (p / 2), upper = p % 2;
    // each block's bytes broadcast into its quarter under a mask (a load and
    // a blend; inserts measured the same)
    __m512i v = _mm512_setzero_si512();
    for (int j = 0; j < 4 && first + j < count; ++j) {
      const uint8_t* qs = g + (first + j) * Q::kBytes + Q::kQs;
      v = _mm512_mask_broadcast_i32x4(v, __mmask16(0xF << (4 * j)),
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    }
    __m512i q = _mm512_and_si512(upper ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
    if (kFifthBit) {
      uint64_t bits = 0;
      for (int j = 0; j < 4; ++j) bits |= (fifth_bits<Q>(g, first + j, count) >> (16 * upper) & 0xFFFF) << (16 * j);
      q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)));
    }
    return q;
  }
  static void scales(const uint8_t* g, int count, __m512& w, __m256& wm) {
    __m256 d;
    legacy_scales<Q>(g, count, d, wm);
    if (!kHasMin) wm = _mm256_mul_ps(d, _mm256_set1_ps(-float(Q::kCentre)));
    w = _mm512_zextps256_ps512(d);
  }
  static __m512 per_token(__m512 w, const float* xd) { return EightScales::per_token(w, xd); }
  // lanes 4 j .. 4 j + 3 of quad p / 2: block 4 (p / 2) + j
  static __m512 lanes(__m512 sx, int p) { return spread4(sx, p / 2); }
};

template <>
struct Lanes<Q8_0> : EightScales {
  static constexpr bool kSigned = true, kMins = false, kShared = false;
  static __m512i codes(const uint8_t* g, int p, int count) {
    return block_pair<Q8_0>(g, p, count, [](const uint8_t* b) { return Q8_0::q_avx2(b, 0); });
  }
  static void scales(const uint8_t* g, int count, __m512& w, __m256& wm) {
    __m256 d;
    legacy_scales<Q8_0>(g, count, d, wm);
    w = _mm512_zextps256_ps512(d);
  }
};

// Where a type's vectors take the token's codes from: half h (16 codes) of
// sub-block i of each group of 8 in 16-code slot lane_slots()[2 i + h]
// (nullptr: as they come).
template <typename Q>
constexpr const int* lane_slots() {
  if constexpr (std::is_base_of_v<NibblePairs, Lanes<Q>>) return NibblePairs::kSlots;
  if constexpr (Q::kSubs == 1 && !std::is_same_v<Q, Q8_0>) return Lanes<Q>::kSlots;
  return nullptr;
}

// The group at g (`count` sub-blocks, all 8 when kFull; sub-blocks sub0 ..)
// times tokens m0 .. m0 + R - 1.
template <typename Q, bool kFull, int R>
__attribute__((always_inline)) inline void lanes_step(const uint8_t* g, int count, const LaneView& x, int64_t m0,
                                                      int64_t sub0, __m512 (&acc)[R][2], __m256 (&mins)[R]) {
  using L = Lanes<Q>;
  __m512i c[4];
  __mmask64 negative[4];
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    if (!kFull && (L::kShared ? 4 * (p / 2) : 2 * p) >= count) break;
    c[p] = L::codes(g, p, kFull ? 8 : count);
    if (L::kSigned) {  // dpbusd's first operand is unsigned: |w|, and w's sign onto x
      negative[p] = _mm512_movepi8_mask(c[p]);
      c[p] = _mm512_abs_epi8(c[p]);
    }
  }
  __m512 w;
  __m256 wm;
  L::scales(g, kFull ? 8 : count, w, wm);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const int64_t at = (m0 + r) * x.subs + sub0, xat = (m0 + r) * x.stride + sub0;
    const __m512 sx = L::per_token(w, x.d + xat);
    if (Q::kSplit)  // the codes' centre: 32 x each 16 codes' sum, at their scales
      acc[r][0] = _mm512_fmadd_ps(sx, _mm512_loadu_ps(x.off + 2 * at), acc[r][0]);
    if constexpr (L::kShared) {  // vectors 2 k and 2 k + 1: one conversion, one FMA
#pragma GCC unroll 2
      for (int k = 0; k < 2; ++k) {
        if (!kFull && 4 * k >= count) break;
        const int8_t* xq = x.q + 32 * at + 128 * k;
        const __m512i low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[2 * k], _mm512_loadu_si512(xq));
        const __m512i dot = _mm512_dpbusd_epi32(low, c[2 * k + 1], _mm512_loadu_si512(xq + 64));
        acc[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), L::lanes(sx, 2 * k), acc[r][k]);
      }
    } else {
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        if (!kFull && 2 * p >= count) break;
        __m512i xq = _mm512_loadu_si512(x.q + 32 * at + 64 * p);
        if (L::kSigned) xq = _mm512_mask_sub_epi8(xq, negative[p], _mm512_setzero_si512(), xq);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[p], xq);
        acc[r][p % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), L::lanes(sx, p), acc[r][p % 2]);
      }
    }
    if (L::kMins) mins[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(x.s + xat), mins[r]);
  }
}

// The C rows' sums out of their accumulators.
template <int C>
inline void lanes_sums(const __m512 (&acc)[C][2], const __m256 (&mins)[C], float* out) {
  __m512 v[4];
  for (int c = 0; c < C; ++c)  // every lane of a row's vector is added into its sum: the mins go in the low half
    v[c] = _mm512_add_ps(_mm512_add_ps(acc[c][0], acc[c][1]), _mm512_zextps256_ps512(mins[c]));
  if constexpr (C != 4) {
    for (int c = 0; c < C; ++c) out[c] = _mm512_reduce_add_ps(v[c]);
  } else {  // the four rows reduced side by side: [v0 v1 v2 v3] sums per 128-bit lane, then the lanes added
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// One weight row (`blocks` blocks of Q at w) times tokens m0 .. m0 + R - 1 into out[r].
template <typename Q, int R>
inline void lanes_row_dot(const uint8_t* w, int64_t blocks, const LaneView& x, int64_t m0, float (&out)[R][1]) {
  constexpr int kPer = 8 / Q::kSubs;  // blocks a group
  __m512 acc[R][2];
  __m256 mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    mins[r] = _mm256_setzero_ps();
  }
  int64_t b = 0;
  for (; b + kPer <= blocks; b += kPer) {
    prefetch_ahead(w + b * Q::kBytes, kPer * Q::kBytes);
    lanes_step<Q, true, R>(w + b * Q::kBytes, 8, x, m0, b * Q::kSubs, acc, mins);
  }
  if (b < blocks)  // a legacy row of 8 k + 1 .. 8 k + 7 blocks
    lanes_step<Q, false, R>(w + b * Q::kBytes, int(blocks - b), x, m0, b, acc, mins);
  float sums[R];
  lanes_sums<R>(acc, mins, sums);
  for (int r = 0; r < R; ++r) out[r][0] = sums[r];
}

// C weight rows (`row_bytes` apart from w) times one token: out[0][c], each
// row's sum lanes_row_dot's to the bit.  C rows side by side are C
// independent chains (quant_gemv.h's rows_dot says why that pays; here it
// paid at every row length).
//
// The prefetch: a part's rows are contiguous, so the next C rows are the
// next panel of C x row_bytes bytes (where panels are shorter than 4 KiB,
// the first panel at least that far on: prefetch.h's panel_ahead), and
// each step asks for its 1 / steps share of that panel in address order (C groups' bytes, the lines after
// the last step's).  Why address order: asking for the same group of each
// of the next C rows (the panel in the order it is read) kept C + C
// streams open at once, and a Llama-3.2-1B Q4_K_M token took 21.1-21.8 ms
// against 18.9-20.7 this way, when the VM's memory read ~52 GB/s (equal
// at ~80 GB/s, where the rows are bound by their instructions); the Q6_K
// head's 1,680-byte rows went from 0.74-0.78x torch.sum's rate to
// 0.87-0.96x.  Two panels ahead measured the same, no prefetch 1.4x the
// time (docs/performance.md).  A fixed distance (prefetch_ahead) is wrong
// here: past ~1 KiB a row, 4 KiB lands in the panel being read.
template <typename Q, int C>
inline void lanes_rows_dot(const uint8_t* w, int64_t row_bytes, int64_t blocks, const LaneView& x,
                           float (&out)[1][C]) {
  constexpr int kPer = 8 / Q::kSubs;
  constexpr int64_t kLines = (C * kPer * Q::kBytes + 63) / 64;  // a step's share of the next panel
  __m512 acc[C][2];
  __m256 mins[C];
  for (int c = 0; c < C; ++c) {
    acc[c][0] = acc[c][1] = _mm512_setzero_ps();
    mins[c] = _mm256_setzero_ps();
  }
  Ahead next = panel_ahead(w, C * row_bytes);
  auto step = [&](auto full, int64_t b, auto count) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      __m512(&a)[1][2] = reinterpret_cast<__m512(&)[1][2]>(acc[c]);
      __m256(&m)[1] = reinterpret_cast<__m256(&)[1]>(mins[c]);
      lanes_step<Q, decltype(full)::value, 1>(w + c * row_bytes + b * Q::kBytes, int(count), x, 0, b * Q::kSubs, a,
                                              m);
    }
  };
  int64_t b = 0;
  for (; b + kPer <= blocks; b += kPer) {
    next.fetch(kLines);
    step(std::true_type{}, b, std::integral_constant<int, 8>{});
  }
  if (b < blocks) {  // a legacy row's short group: the rest of the next panel
    next.fetch(INT64_MAX);
    with_short_group(blocks - b, [&](auto count) { step(std::false_type{}, b, count); });
  }
  lanes_sums<C>(acc, mins, out[0]);
}

}  // namespace quant
}  // namespace pagedserve
#endif
