// AVX-512 (F, BW, VL, DQ) + VNNI, with or without AVX512-BF16: 16 fp32 lanes.
//
// Same loader layout as the AVX2 build, twice as wide: a pair is 32
// elements, bf16 split into even and odd elements by a shift and an and.
// With AVX512-BF16 (PAGEDSERVE_HAS_DPBF16) Q.K in bf16 does not convert at
// all: _mm512_dpbf16_ps multiplies 32 bf16 pairs and accumulates in fp32
// (dot8_bf16 below); without it (the avx512 build) every kernel takes its
// fp32 path, as on AVX2.  Rounding to bf16 is integer arithmetic either way,
// so both builds store the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "exp2_poly.h"
#include "reduce8_avx.h"
#include "types.h"

#if defined(PAGEDSERVE_ISA_AVX512BF16)
#define PAGEDSERVE_HAS_DPBF16 1
#endif
#define PAGEDSERVE_HAS_VNNI 1  // the build's -mavx512vnni (ops.py asks every AVX-512 CPU for it)
#define PAGEDSERVE_HAS_I8_DOTS 1  // an int8 cache's Q.K in integers (pack_words16, dots_i8)

namespace pagedserve::vec {

constexpr int W = 16;
// attention_tile.h, prefetch_head_rows: ask for the next kv head's rows while
// one computes (bound by the memory already: no gain measured).
constexpr bool kPrefetchNextHead = false;

struct F {
  __m512 v;
};

inline F zero() { return {_mm512_setzero_ps()}; }
inline F set1(float x) { return {_mm512_set1_ps(x)}; }
inline F load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline F add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F sub(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F min(F a, F b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F div(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c

inline __m256 fold_halves(__m512 a) {
  __m256 lo = _mm512_castps512_ps256(a);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  return _mm256_add_ps(lo, hi);
}

inline float reduce_max(F a) { return _mm512_reduce_max_ps(a.v); }
inline float reduce_add(F a) { return _mm512_reduce_add_ps(a.v); }

inline void reduce8(const F* acc, float* out) {
  __m256 half[8];
  for (int i = 0; i < 8; ++i) half[i] = fold_halves(acc[i].v);
  reduce8_m256(half, out);
}

// 2^x for x <= 0: the AVX2 build's polynomial and exponent trick, so that
// -inf (and anything below -126.5) is exactly 0.
inline F exp2(F x) {
  __m512 y = _mm512_max_ps(x.v, _mm512_set1_ps(-127.0f));
  __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return {_mm512_mul_ps(p, _mm512_castsi512_ps(e))};
}

// ---- pairs: 32 elements of a row <-> two vectors in the loader layout ----

inline void load_pair(const float* p, F& a, F& b) {
  a = load(p);
  b = load(p + W);
}

inline void load_pair(const bf16_t* p, F& a, F& b) {
  __m512i x = _mm512_loadu_si512(p);
  a.v = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  b.v = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int32_t(0xffff0000u))));
}

inline void load_pair(const fp16_t* p, F& a, F& b) {
  a.v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  b.v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + W)));
}

// W elements as fp32 in natural order (load_pair may split bf16's even and
// odd ones): a width's last vector after its whole pairs (lora.h).
inline F load_one(const float* p) { return load(p); }
inline F load_one(const bf16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline F load_one(const fp16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }

// 32 int8 codes as fp32: the low and high 16 (float and fp16's layout) ...
inline void load_pair_i8(const int8_t* p, F& a, F& b) {
  a.v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  b.v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + W))));
}

// ... or the even and odd ones (bf16's): widened to 16 bits, each 32-bit lane
// holds an (even, odd) pair, split by shifts that keep the sign.
inline void load_pair_i8_bf16(const int8_t* p, F& a, F& b) {
  __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  a.v = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 16), 16));
  b.v = _mm512_cvtepi32_ps(_mm512_srai_epi32(x, 16));
}

// fp8 as fp16 bits, 16 bytes widened to 16 bits each (see vec_avx2.h).
inline __m256i fp16_of_e5m2(__m256i w) { return _mm256_slli_epi16(w, 8); }
inline __m256i fp16_of_e4m3(__m256i w) {
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                         _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
}

// 32 fp8 values as fp32 in natural order: the low and high 16.
template <bool E4M3>
inline void load_pair_fp8(const uint8_t* p, F& a, F& b) {
  __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + W)));
  if constexpr (E4M3) {
    a.v = _mm512_mul_ps(_mm512_cvtph_ps(fp16_of_e4m3(lo)), _mm512_set1_ps(256.0f));
    b.v = _mm512_mul_ps(_mm512_cvtph_ps(fp16_of_e4m3(hi)), _mm512_set1_ps(256.0f));
  } else {
    a.v = _mm512_cvtph_ps(fp16_of_e5m2(lo));
    b.v = _mm512_cvtph_ps(fp16_of_e5m2(hi));
  }
}

// A natural-order pair (a: elements 0-15, b: 16-31) into bf16's loader layout
// (a: the even elements, b: the odd ones).
inline void to_bf16_layout(F& a, F& b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 e = _mm512_permutex2var_ps(a.v, even, b.v);
  b.v = _mm512_permutex2var_ps(a.v, odd, b.v);
  a.v = e;
}

inline void store_pair(float* p, F a, F b) {
  store(p, a);
  store(p + W, b);
}

// fp32 -> bf16 bits in the high half, rounded to nearest even; NaN stays NaN.
inline __m512i round_to_bf16_high(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

// a rounded to bf16's 8 significant bits (nearest even), kept in fp32.
inline F round_bf16(F a) {
  return {_mm512_castsi512_ps(_mm512_and_si512(round_to_bf16_high(a.v), _mm512_set1_epi32(int32_t(0xffff0000u))))};
}

inline void store_pair(bf16_t* p, F a, F b) {
  __m512i even = _mm512_srli_epi32(round_to_bf16_high(a.v), 16);
  __m512i odd = _mm512_castps_si512(round_bf16(b).v);
  _mm512_storeu_si512(p, _mm512_or_si512(even, odd));
}

inline void store_pair(fp16_t* p, F a, F b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + W), _mm512_cvtps_ph(b.v, _MM_FROUND_TO_NEAREST_INT));
}

#if defined(PAGEDSERVE_HAS_DPBF16)
// Raw bf16 (natural order, 2W elements) for the dot-product instruction:
// dot_acc(acc, a, b) adds a[2i] * b[2i] + a[2i+1] * b[2i+1] to lane i, with
// exact products (a bf16 times a bf16 fits an fp32) and fp32 sums.
struct BH {
  __m512bh v;
};
inline BH load_bf16(const bf16_t* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
inline F dot_acc(F acc, BH a, BH b) { return {_mm512_dpbf16_ps(acc.v, a.v, b.v)}; }

// One pair of bf16 (x[2p], x[2p + 1], read as one 32-bit word) in every
// lane: the token's side of dot_acc in the packed linear (linear_packed.h).
inline BH broadcast_pair(const bf16_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return {(__m512bh)_mm512_set1_epi32(word)};
}
#endif

// W fp32 lanes -> W bf16, rounded to nearest even; NaN stays NaN.
inline void store_bf16(bf16_t* p, F a) {
  __m512i high = _mm512_srli_epi32(round_to_bf16_high(a.v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}

// out[c] = (r[0][c], ..., r[15][c]) for 16 vectors of 16 32-bit lanes.
inline void transpose16(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // b[4i + k], 128-bit lane L: rows 4i..4i+3 of column 4L + k.
  for (int i = 0; i < 4; ++i)
    for (int h = 0; h < 2; ++h) {
      b[4 * i + 2 * h] = _mm512_unpacklo_epi64(a[4 * i + h], a[4 * i + 2 + h]);
      b[4 * i + 2 * h + 1] = _mm512_unpackhi_epi64(a[4 * i + h], a[4 * i + 2 + h]);
    }
  for (int k = 0; k < 4; ++k) {
    // 0x88: 128-bit lanes 0, 2 of each source; 0xdd: lanes 1, 3.
    const __m512i c0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x88);
    const __m512i c1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xdd);
    const __m512i d0 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x88);
    const __m512i d1 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xdd);
    r[k] = _mm512_shuffle_i32x4(c0, d0, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(c0, d0, 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(c1, d1, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(c1, d1, 0xdd);
  }
}

// W sums into an output row of storage type T (float32, or bf16 rounded once).
inline void store_to(float* p, F a) { store(p, a); }
inline void store_to(bf16_t* p, F a) { store_bf16(p, a); }

#if defined(PAGEDSERVE_HAS_DPBF16)
// Eight bf16 dot products of one query row (raw bf16, natural order) with
// eight K rows, head_dim a multiple of 32: no conversion, one instruction
// per 32 elements.
inline void dot8_bf16(const bf16_t* q, const bf16_t* const* k, int head_dim, float* out) {
  F acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = zero();
  for (int d = 0; d < head_dim; d += 2 * W) {
    __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m512bh kv = (__m512bh)_mm512_loadu_si512(k[t] + d);
      acc[t].v = _mm512_dpbf16_ps(acc[t].v, qv, kv);
    }
  }
  reduce8(acc, out);
}
#endif

// An int8 cache's K in token lanes, for vpdpbusd (the VNNI build's Q.K).
// Sixteen rows of `bytes` codes (a multiple of 32) become 32-bit words, the
// row's four codes 4p .. 4p + 3 in lane t of word p:
//   out[p * stride + t] = rows[t][4p .. 4p + 3], each byte + 128
// vpdpbusd multiplies unsigned bytes by signed ones, so K takes the unsigned
// side offset by 128 (an xor of the sign bit) and dots_i8 takes the offset's
// share back.  A 16 x 16 transpose of words per 64 bytes: interleave words,
// then pairs of words, then 128-bit lanes twice; a last half chunk is read
// under a mask.
inline void pack_words16(const int8_t* const* rows, int bytes, uint32_t* out, int stride) {
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  for (int c = 0; c < bytes; c += 64) {
    const int left = bytes - c, words = left >= 64 ? 16 : left / 4;
    const __mmask64 m = left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
    __m512i r[16], a[16];
    for (int t = 0; t < 16; ++t) r[t] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[t] + c), bias);
    for (int i = 0; i < 8; ++i) {
      a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: word 4L + j of rows 4i .. 4i + 3
      r[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
      r[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
      r[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
      r[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {  // lane L of r[j], r[4 + j], r[8 + j], r[12 + j]: word 4L + j
      const __m512i x0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
      const __m512i y0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44),
                    y1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
      const __m512i w[4] = {_mm512_shuffle_i32x4(x0, y0, 0x88), _mm512_shuffle_i32x4(x0, y0, 0xdd),
                            _mm512_shuffle_i32x4(x1, y1, 0x88), _mm512_shuffle_i32x4(x1, y1, 0xdd)};
      for (int l = 0; l < 4; ++l)
        if (4 * l + j < words) _mm512_storeu_si512(out + size_t(c / 4 + 4 * l + j) * stride, w[l]);
    }
  }
}

// R query rows' int8 codes (head_dim apart) against 2W tokens of K words in
// token lanes (pack_words16, stride 2W): each row's dots in two vectors of
// tokens, exact, as fp32.  K's offset adds 128 * (the row's code sum) to
// every dot: `offset[r]`, worked out once a row, comes off each lane.
template <int R>
inline void dots_i8(const int8_t* q, int head_dim, const int32_t* offset, const uint32_t* kt, float* out) {
  __m512i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (int p = 0; p < head_dim / 4; ++p) {
    const __m512i k0 = _mm512_loadu_si512(kt + p * 2 * W), k1 = _mm512_loadu_si512(kt + p * 2 * W + W);
    for (int r = 0; r < R; ++r) {
      int32_t word;
      std::memcpy(&word, q + r * head_dim + 4 * p, sizeof(word));
      const __m512i qw = _mm512_set1_epi32(word);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], k0, qw);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], k1, qw);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512i o = _mm512_set1_epi32(offset[r]);
    _mm512_storeu_ps(out + r * 2 * W, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], o)));
    _mm512_storeu_ps(out + r * 2 * W + W, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], o)));
  }
}

// int8 codes of n values (n a multiple of W) under one scale > 0:
// clamp(round(x / scale), -127, 127), the fp32 division and half-to-even
// rounding of std::nearbyint, NaN to -127 as std::max(-127.0f, NaN) gives
// (kv_store.h's quantize_row, attention_tile.h's prepare_q8_query). Why
// vectors: a prefill quantizes every query row and every new K and V row,
// and the scalar loop was a third of the AVX2 build's int8 prefill attention.
inline void round_codes(const float* x, int n, float scale, int8_t* out) {
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int d = 0; d < n; d += W) {
    __m512 c = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + d), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(_mm512_max_ps(c, lo), hi);  // max(NaN, lo) is lo
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c)));
  }
}

}  // namespace pagedserve::vec
