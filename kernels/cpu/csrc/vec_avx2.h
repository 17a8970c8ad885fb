// AVX2 + FMA + F16C: 8 fp32 lanes.
//
// The loader layout: a "pair" is 16 consecutive elements of a cache row, held
// as two fp32 vectors.  bf16 converts for free if we keep the even and odd
// elements apart (a bf16 is the top half of an fp32):
//
//   16 bf16 in memory      e0 o0 e1 o1 ... e7 o7   (as 8 x 32-bit lanes: o_i:e_i)
//   a = lanes << 16        e0 e1 ... e7            one shift
//   b = lanes & 0xffff0000 o0 o1 ... o7            one and
//
// Every row (queries, K, V, accumulators) goes through the same loader, so
// dot products and P.V never see the permutation; only store_pair undoes it.
// fp16 and fp32 pairs are simply the low and high 8 elements.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "exp2_poly.h"
#include "reduce8_avx.h"
#include "types.h"

#define PAGEDSERVE_HAS_I8_DOTS 1  // an int8 cache's Q.K in integers (dot8_i8)

namespace pagedserve::vec {

constexpr int W = 8;
// attention_tile.h, prefetch_head_rows: ask for the next kv head's rows while
// one computes (its tile loop waits on L2 without it).
constexpr bool kPrefetchNextHead = true;

struct F {
  __m256 v;
};

inline F zero() { return {_mm256_setzero_ps()}; }
inline F set1(float x) { return {_mm256_set1_ps(x)}; }
inline F load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, F a) { _mm256_storeu_ps(p, a.v); }
inline F add(F a, F b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F sub(F a, F b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm256_max_ps(a.v, b.v)}; }
inline F min(F a, F b) { return {_mm256_min_ps(a.v, b.v)}; }
inline F div(F a, F b) { return {_mm256_div_ps(a.v, b.v)}; }
inline F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c

inline float reduce_max(F a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

inline float reduce_add(F a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

inline void reduce8(const F* acc, float* out) {
  __m256 raw[8];
  for (int i = 0; i < 8; ++i) raw[i] = acc[i].v;
  reduce8_m256(raw, out);
}

// 2^x for x <= 0 (scores minus their running max).  exp2_poly.h on
// [-0.5, 0.5] after taking out the integer part; relative error ~2e-7.
// x <= -126.5 (and -inf) gives exactly 0: masked scores weigh nothing.
inline F exp2(F x) {
  __m256 y = _mm256_max_ps(x.v, _mm256_set1_ps(-127.0f));
  __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p, _mm256_castsi256_ps(e))};
}

// ---- pairs: 16 elements of a row <-> two vectors in the loader layout ----

inline void load_pair(const float* p, F& a, F& b) {
  a = load(p);
  b = load(p + W);
}

inline void load_pair(const bf16_t* p, F& a, F& b) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a.v = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  b.v = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int32_t(0xffff0000u))));
}

inline void load_pair(const fp16_t* p, F& a, F& b) {
  a.v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b.v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + W)));
}

// W elements as fp32 in natural order (load_pair may split bf16's even and
// odd ones): a width's last vector after its whole pairs (lora.h).
inline F load_one(const float* p) { return load(p); }
inline F load_one(const bf16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
inline F load_one(const fp16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }

// 16 int8 codes as fp32: the low and high 8 (float and fp16's layout) ...
inline void load_pair_i8(const int8_t* p, F& a, F& b) {
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  a.v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  b.v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
}

// ... or the even and odd ones (bf16's): widened to 16 bits, each 32-bit lane
// holds an (even, odd) pair, split by shifts that keep the sign.
inline void load_pair_i8_bf16(const int8_t* p, F& a, F& b) {
  __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  a.v = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 16), 16));
  b.v = _mm256_cvtepi32_ps(_mm256_srai_epi32(x, 16));
}

// fp8 as fp16 bits, 8 bytes widened to 16 bits each: e5m2 is the top byte of
// an fp16; e4m3fn's exponent and mantissa sit 1 bit lower than fp16's with a
// bias 8 less, so its bits shifted by 7 are the value / 2^8 (subnormals too).
inline __m128i fp16_of_e5m2(__m128i w) { return _mm_slli_epi16(w, 8); }
inline __m128i fp16_of_e4m3(__m128i w) {
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                      _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
}

// 16 fp8 values as fp32 in natural order: the low and high 8.
template <bool E4M3>
inline void load_pair_fp8(const uint8_t* p, F& a, F& b) {
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i lo = _mm_cvtepu8_epi16(x), hi = _mm_cvtepu8_epi16(_mm_srli_si128(x, 8));
  if constexpr (E4M3) {
    a.v = _mm256_mul_ps(_mm256_cvtph_ps(fp16_of_e4m3(lo)), _mm256_set1_ps(256.0f));
    b.v = _mm256_mul_ps(_mm256_cvtph_ps(fp16_of_e4m3(hi)), _mm256_set1_ps(256.0f));
  } else {
    a.v = _mm256_cvtph_ps(fp16_of_e5m2(lo));
    b.v = _mm256_cvtph_ps(fp16_of_e5m2(hi));
  }
}

// A natural-order pair (a: elements 0-7, b: 8-15) into bf16's loader layout
// (a: the even elements, b: the odd ones).
inline void to_bf16_layout(F& a, F& b) {
  __m256 even = _mm256_shuffle_ps(a.v, b.v, _MM_SHUFFLE(2, 0, 2, 0));  // a0 a2 b0 b2 | a4 a6 b4 b6
  __m256 odd = _mm256_shuffle_ps(a.v, b.v, _MM_SHUFFLE(3, 1, 3, 1));
  a.v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), _MM_SHUFFLE(3, 1, 2, 0)));
  b.v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), _MM_SHUFFLE(3, 1, 2, 0)));
}

inline void store_pair(float* p, F a, F b) {
  store(p, a);
  store(p + W, b);
}

// fp32 -> bf16 bits in the high half, rounded to nearest even; NaN stays NaN.
inline __m256i round_to_bf16_high(__m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}

// a rounded to bf16's 8 significant bits (nearest even), kept in fp32.
inline F round_bf16(F a) {
  return {_mm256_castsi256_ps(_mm256_and_si256(round_to_bf16_high(a.v), _mm256_set1_epi32(int32_t(0xffff0000u))))};
}

inline void store_pair(bf16_t* p, F a, F b) {
  __m256i even = _mm256_srli_epi32(round_to_bf16_high(a.v), 16);
  __m256i odd = _mm256_castps_si256(round_bf16(b).v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(even, odd));
}

// W fp32 lanes -> W bf16, rounded to nearest even; NaN stays NaN.
inline void store_bf16(bf16_t* p, F a) {
  __m256i high = _mm256_srli_epi32(round_to_bf16_high(a.v), 16);  // 0..0xffff: packus keeps it
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// W sums into an output row of storage type T (float32, or bf16 rounded once).
inline void store_to(float* p, F a) { store(p, a); }
inline void store_to(bf16_t* p, F a) { store_bf16(p, a); }

inline void store_pair(fp16_t* p, F a, F b) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + W), _mm256_cvtps_ph(b.v, _MM_FROUND_TO_NEAREST_INT));
}

// An int8 cache's Q.K without VNNI: one query row's codes against eight K
// rows' codes, head_dim (a multiple of 16) bytes each, exact integer dots as
// fp32.  Why: converting K's codes to fp32 and multiplying them as floats
// made this build's int8 decode attention bound by its instructions (0.95x
// the bf16 cache's time on half the bytes).  vpmaddubsw multiplies unsigned
// bytes by signed ones into 16-bit sums of pairs, so the query's magnitudes
// take the unsigned side and K takes the query's signs (vpsignb): each
// product is |q| * (+-k), and a pair's sum stays within 2 * 127^2 < 2^15
// (codes are -127..127; -128 is never written), so nothing saturates.
// Every lane's and every row's sum is an integer under 2^24, so the fp32
// adds of reduce8 are exact too: the same numbers as the fp32 path.
inline __m256i dot_i8_step(__m256i acc, __m256i q_abs, __m256i q, __m256i k) {
  const __m256i pairs = _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(k, q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline void dot8_i8(const int8_t* q, const int8_t* const* k, int head_dim, float* out) {
  __m256i acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_si256();
  int d = 0;
  for (; d + 32 <= head_dim; d += 32) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d));
    const __m256i qa = _mm256_abs_epi8(qv);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t)
      acc[t] = dot_i8_step(acc[t], qa, qv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[t] + d)));
  }
  if (d < head_dim) {  // 16 bytes left: the upper lanes are zero on both sides
    const __m256i qv = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + d)));
    const __m256i qa = _mm256_abs_epi8(qv);
    for (int t = 0; t < 8; ++t) {
      const __m128i kv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k[t] + d));
      acc[t] = dot_i8_step(acc[t], qa, qv, _mm256_zextsi128_si256(kv));
    }
  }
  F sums[8];
  for (int t = 0; t < 8; ++t) sums[t].v = _mm256_cvtepi32_ps(acc[t]);
  reduce8(sums, out);
}

// int8 codes of n values (n a multiple of W) under one scale > 0:
// clamp(round(x / scale), -127, 127), the fp32 division and half-to-even
// rounding of std::nearbyint, NaN to -127 as std::max(-127.0f, NaN) gives
// (kv_store.h's quantize_row, attention_tile.h's prepare_q8_query). Why
// vectors: a prefill quantizes every query row and every new K and V row,
// and the scalar loop was a third of the AVX2 build's int8 prefill attention.
inline void round_codes(const float* x, int n, float scale, int8_t* out) {
  const __m256 s = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int d = 0; d < n; d += W) {
    __m256 c = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + d), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm256_min_ps(_mm256_max_ps(c, lo), hi);  // max(NaN, lo) is lo
    const __m256i i = _mm256_cvtps_epi32(c);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + d), _mm_packs_epi16(words, words));
  }
}

}  // namespace pagedserve::vec
