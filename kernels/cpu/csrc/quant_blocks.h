// GGUF's block formats, decoded 32 weights at a time (kernels/quant.py has
// the blob that carries them; gguf.quants.dequantize is the reference).
//
// Every supported type comes down to the same shape, which is what lets one
// kernel multiply them all: a block of 32 weights (a "sub-block" of a K-quant
// super-block of 256) is 32 small integers q and a float scale, plus a float
// min for the asymmetric types:
//
//   w[i] = wd * q[i]          Q4_0 (q - 8), Q5_0 (q - 16), Q8_0, Q6_K (q - 32)
//   w[i] = wd * q[i] + wm     Q4_1, Q5_1 (wm = m), Q4_K, Q5_K (wm = -dmin * m_j)
//
// Q6_K alone scales each half of a 32 separately (16 weights per int8 scale):
// wd is a pair (lo, hi) for every type, equal halves but there.
//
// The float scales are computed as gguf's numpy code computes them (fp16 ->
// fp32, then d * sc in fp32: exact, since d has 11 significant bits and sc at
// most 8), and a weight as wd * q (+ wm), one rounding each, so decode(...)
// gives gguf's numbers bit for bit (never "+ 0.0" for a symmetric type: it
// would turn a -0.0 into +0.0).
//
// Per type: kElems weights and kBytes bytes a block, kSubs sub-blocks of 32,
// kLevels codes a weight takes (stored as 0 .. kLevels - 1, q = code -
// kCentre; Q8_0's are signed bytes as they are);
// scales(block, wd[2 kSubs], wm[kSubs]); q(block, j, int8 out[32]) in plain
// C++; and where the build has AVX2, q_avx2(block, j) -> the 32 q in a __m256i.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "types.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedserve {
namespace quant {

// The fp16 at p (two bytes of a block: its scale d or min m).
inline float fp16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return pagedserve::fp16_to_float(h);
}

// The 6-bit (sc, m) pair of sub-block j from Q4_K / Q5_K's 12 scale bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#if defined(__AVX2__)
// Q4_K and Q5_K: the 12 scale bytes' 8 (sc, m) pairs of 6 bits unpacked
// four at a time in 32-bit words (llama.cpp's masks; scale_min_k4 is the
// same unpacking one pair at a time), then wd = d * sc, wm = -dmin * m.
inline void k4_scales(const uint8_t* g, __m256& wd, __m256& wm) {
  uint32_t u[4];
  std::memcpy(u, g + 4, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // m4..m7
  const uint32_t m_low = u[1] & k6;                        // m0..m3
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);         // sc4..sc7
  u[2] = m_low;
  u[0] &= k6;                                              // sc0..sc3
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
  wd = _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(g)), sc);
  wm = _mm256_mul_ps(_mm256_set1_ps(-fp16_to_float(g + 2)), m);
}

// 32 nibbles of 16 bytes: byte i's low nibble is q[i], its high nibble q[16 + i].
inline __m256i nibbles_16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

// The 32 bits of qh as 32 bytes: 0x10 where bit i is set, else 0.
inline __m256i high_bits_32(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuffle);
  const __m256i select = _mm256_set1_epi64x(int64_t(0x7fbfdfeff7fbfdfe));
  bytes = _mm256_or_si256(bytes, select);  // all ones where the byte's own bit is set
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
#endif

// Q4_0, Q4_1, Q5_0, Q5_1: d (fp16), then m (fp16) for the _1 types, then the
// fifth bits as a 32-bit word for the Q5 types, then 16 bytes of nibbles.
// Symmetric types centre q on zero (q - 8, q - 16).
template <bool kFifthBit, bool kHasMin>
struct Nibbles {
  static constexpr int kElems = 32, kSubs = 1;
  static constexpr int kHigh = 2 + (kHasMin ? 2 : 0);                  // where the fifth bits are
  static constexpr int kQs = kHigh + (kFifthBit ? 4 : 0);              // where the nibbles are
  static constexpr int kBytes = kQs + 16;
  static constexpr int kCentre = kHasMin ? 0 : (kFifthBit ? 16 : 8);
  static constexpr int kLevels = kFifthBit ? 32 : 16;
  static constexpr bool kMin = kHasMin;
  static constexpr bool kSplit = false;  // one scale for all 32
  static void scales(const uint8_t* b, float* wd, float* wm) {
    wd[0] = wd[1] = fp16_to_float(b);
    if (kHasMin) wm[0] = fp16_to_float(b + 2);
  }
  static void q(const uint8_t* b, int, int8_t* out) {
    uint32_t qh = 0;
    if (kFifthBit) std::memcpy(&qh, b + kHigh, 4);
    for (int i = 0; i < 16; ++i) {
      out[i] = int8_t(((b[kQs + i] & 0xF) | (((qh >> i) & 1) << 4)) - kCentre);
      out[i + 16] = int8_t(((b[kQs + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - kCentre);
    }
  }
#if defined(__AVX2__)
  static __m256i q_avx2(const uint8_t* b, int) {
    __m256i q = nibbles_16(b + kQs);
    if (kFifthBit) q = _mm256_or_si256(q, high_bits_32(b + kHigh));
    return kCentre ? _mm256_sub_epi8(q, _mm256_set1_epi8(kCentre)) : q;
  }
#endif
};
using Q4_0 = Nibbles<false, false>;
using Q4_1 = Nibbles<false, true>;
using Q5_0 = Nibbles<true, false>;
using Q5_1 = Nibbles<true, true>;

struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34, kSubs = 1;
  static constexpr int kLevels = 256, kCentre = 0;
  static constexpr bool kMin = false;
  static constexpr bool kSplit = false;  // one scale for all 32
  static void scales(const uint8_t* b, float* wd, float*) { wd[0] = wd[1] = fp16_to_float(b); }
  static void q(const uint8_t* b, int, int8_t* out) { std::memcpy(out, b + 2, 32); }
#if defined(__AVX2__)
  static __m256i q_avx2(const uint8_t* b, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  }
#endif
};

// Q4_K: d, dmin (fp16), 12 scale bytes, 128 bytes of nibbles: sub-block j
// reads bytes 32 (j / 2) .. + 31, low nibbles for even j, high for odd.
struct Q4_K {
  static constexpr int kElems = 256, kBytes = 144, kSubs = 8;
  static constexpr int kLevels = 16, kCentre = 0;
  static constexpr bool kMin = true;
  static constexpr bool kSplit = false;  // one scale for all 32
  static void scales(const uint8_t* b, float* wd, float* wm) {
    const float d = fp16_to_float(b), dmin = fp16_to_float(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(b + 4, j, sc, m);
      wd[2 * j] = wd[2 * j + 1] = d * float(sc);
      wm[j] = -(dmin * float(m));
    }
  }
  static void q(const uint8_t* b, int j, int8_t* out) {
    const uint8_t* qs = b + 16 + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) out[l] = int8_t((qs[l] >> shift) & 0xF);
  }
#if defined(__AVX2__)
  static __m256i q_avx2(const uint8_t* b, int j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (j / 2)));
    const __m256i shifted = (j % 2) ? _mm256_srli_epi16(v, 4) : v;
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
  }
#endif
};

// Q5_K: Q4_K's fields with 32 bytes of high bits after the scales: bit j of
// qh[l] is the fifth bit of sub-block j's weight l.
struct Q5_K {
  static constexpr int kElems = 256, kBytes = 176, kSubs = 8;
  static constexpr int kLevels = 32, kCentre = 0;
  static constexpr bool kMin = true;
  static constexpr bool kSplit = false;  // one scale for all 32
  static void scales(const uint8_t* b, float* wd, float* wm) { Q4_K::scales(b, wd, wm); }
  static void q(const uint8_t* b, int j, int8_t* out) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48 + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) out[l] = int8_t(((qs[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4));
  }
#if defined(__AVX2__)
  static __m256i q_avx2(const uint8_t* b, int j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * (j / 2)));
    const __m256i low = _mm256_and_si256((j % 2) ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
#endif
};

// Q6_K: 128 bytes of low nibbles (ql), 64 of 2-bit highs (qh), 16 int8
// scales (one per 16 weights), d (fp16) last.  Sub-block j = 4 h + k of half
// h: low nibbles (k < 2) or high ones (k >= 2) of ql[64 h + 32 (k % 2) ..],
// highs from bits 2k, 2k + 1 of qh[32 h ..]; q - 32.
struct Q6_K {
  static constexpr int kElems = 256, kBytes = 210, kSubs = 8;
  static constexpr int kLevels = 64, kCentre = 32;
  static constexpr bool kMin = false;
  static constexpr bool kSplit = true;  // a scale per 16
  static void scales(const uint8_t* b, float* wd, float*) {
    const float d = fp16_to_float(b + 208);
    for (int s = 0; s < 16; ++s) wd[s] = d * float(int8_t(b[192 + s]));
  }
  static void q(const uint8_t* b, int j, int8_t* out) {
    const int h = j / 4, k = j % 4;
    const uint8_t* ql = b + 64 * h + 32 * (k % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      const int low = k < 2 ? (ql[l] & 0xF) : (ql[l] >> 4);
      out[l] = int8_t((low | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
    }
  }
#if defined(__AVX2__)
  // The 32 codes of sub-block j as stored, 0..63 (q + 32).
  static __m256i codes_avx2(const uint8_t* b, int j) {
    const int h = j / 4, k = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (k % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i low = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0F));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
  static __m256i q_avx2(const uint8_t* b, int j) {
    return _mm256_sub_epi8(codes_avx2(b, j), _mm256_set1_epi8(32));
  }
#endif
};

#if defined(__AVX2__)
// The scales (wd) and mins (wm) of the 8 sub-blocks of 32 that start at g,
// in vectors, without the scalar decode per block (it cost as much as the
// dot products).  Legacy types: the 8 blocks' leading words (d, then m for
// the _1 types) as 8 scalar loads put into one vector, both fp16 halves
// converted at once.  Not a gather: on a first-generation Zen EPYC
// vpgatherdd is microcoded, and the instruction after it took 17 % of the
// AVX2 rows' samples; without it one thread's Q4_1 rows took 0.85-0.97x the
// time, the same bits (docs/performance.md).
// The AVX512 build's rows use quant_lanes.h's legacy_scales, 16-bit permutes
// that AVX2 does not have.
//
// Inlined into the rows (pair_step; group_step at one token): out of line,
// its call and its branches on `count` (a constant there: 8, or a short last
// group's length) were a tenth of the AVX2 build's one-token samples on the
// default file, SmolLM2's gate_up took 1.5x the time and its Q8_0 head 1.2x
// (docs/performance.md).  group_scales_call keeps it out of line for
// group_step's several tokens, whose larger step spilled with it inside
// (the Q8_0 head 1.07x the time at four tokens).
template <typename Q>
__attribute__((always_inline)) inline void group_scales(const uint8_t* g, int count, __m256& wd, __m256& wm) {
  static_assert(Q::kSubs == 1, "K-quants have their own group_scales");
  // lanes past `count` read nothing and stay 0 (a row's last group)
  int32_t w[8];
  for (int i = 0; i < 8; ++i) {
    w[i] = 0;
    if (i < count) std::memcpy(&w[i], g + i * Q::kBytes, sizeof(int32_t));
  }
  const __m256i words = _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
  // per 128-bit lane: the four low halves (d), then the four high ones (m)
  const __m256i split = _mm256_shuffle_epi8(
      words, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m256i halves = _mm256_permute4x64_epi64(split, 0xD8);  // d0..d7 | m0..m7
  wd = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  wm = Q::kMin ? _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)) : _mm256_setzero_ps();
}

template <typename Q>
__attribute__((noinline)) void group_scales_call(const uint8_t* g, int count, __m256& wd, __m256& wm) {
  group_scales<Q>(g, count, wd, wm);
}

template <>
inline void group_scales<Q4_K>(const uint8_t* g, int, __m256& wd, __m256& wm) { k4_scales(g, wd, wm); }
template <>
inline void group_scales<Q5_K>(const uint8_t* g, int, __m256& wd, __m256& wm) { k4_scales(g, wd, wm); }

#endif

// f(std::integral_constant<int, n>{}) for a legacy row's short last group
// of n = 1 .. 7 blocks.  With its length a constant, the group's tests and
// masks fold away: at one token, SmolLM2's rows of 576 inputs (two groups
// and 2 blocks) spent a third of their time in the short group.
template <typename F>
inline void with_short_group(int64_t n, const F& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: f(std::integral_constant<int, 7>{}); break;
  }
}

// ggml type ids (gguf.GGMLQuantizationType) -> a call of f with the type.
template <typename F>
inline bool with_type(int64_t ggml_id, F&& f) {
  switch (ggml_id) {
    case 2: f(Q4_0{}); return true;
    case 3: f(Q4_1{}); return true;
    case 6: f(Q5_0{}); return true;
    case 7: f(Q5_1{}); return true;
    case 8: f(Q8_0{}); return true;
    case 12: f(Q4_K{}); return true;
    case 13: f(Q5_K{}); return true;
    case 14: f(Q6_K{}); return true;
    default: return false;
  }
}

}  // namespace quant
}  // namespace pagedserve
