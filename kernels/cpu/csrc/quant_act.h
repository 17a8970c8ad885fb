// The activations of the quantized linear: each row quantized once a call,
// per 32 inputs, to int8 with a float scale (quant_linear.h says why), and
// the integer dot product of 32 weights with one such block.  The int8
// strips (quant_vnni.h) take the same rounding over 256 inputs for K-quants.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "quant_blocks.h"
#include "types.h"

namespace pagedserve {
namespace quant {

// One row's activation block of 32 inputs.
struct XBlock {
  float d;    // scale: x ~ d * q
  float s;    // d * sum(q): what a weight min multiplies
  int8_t q[32];
};

// ---- activations --------------------------------------------------------------------------

template <typename T>
inline void quantize_row(const T* x, int64_t K, XBlock* out) {
  for (int64_t b = 0; b < K / 32; ++b) {
    float v[32], amax = 0.f;
    for (int i = 0; i < 32; ++i) {
      v[i] = to_float(x[32 * b + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = int(std::nearbyint(v[i] * id));
      out[b].q[i] = int8_t(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * float(sum);
  }
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest |x| of n inputs (n a multiple of 8).
template <typename T>
inline float abs_max_avx2(const T* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(x + i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32 inputs times id, rounded to nearest even: the codes in order, their sum into sum.
template <typename T>
inline __m256i codes_avx2(const T* x, float id, int& sum) {
  __m256i q[4];
  for (int k = 0; k < 4; ++k)
    q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(load8(x + 8 * k), _mm256_set1_ps(id)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  sum = int(hsum(_mm256_cvtepi32_ps(sum32)));
  // int32 -> int8 in order: packs interleave the 128-bit lanes, the permute undoes it.
  const __m256i q16a = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One block of quantize_row, in vectors: the same numbers (round to nearest
// even).  Returns the 32 codes in order; d and d * sum(q) into d, s.
template <typename T>
inline __m256i quantize_block_avx2(const T* x, float& d, float& s) {
  d = abs_max_avx2(x, 32) / 127.f;
  int sum;
  const __m256i q = codes_avx2(x, d > 0.f ? 1.f / d : 0.f, sum);
  s = d * float(sum);
  return q;
}

// The vector path of quantize_row: same numbers.
template <typename T>
inline void quantize_row_avx2(const T* x, int64_t K, XBlock* out) {
  for (int64_t b = 0; b < K / 32; ++b)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q), quantize_block_avx2(x + 32 * b, out[b].d, out[b].s));
}

// sum of w[i] * x[i] over 32 bytes, as 8 int32 lanes (lane l: bytes 4l .. 4l + 3).
template <bool Signed>
inline __m256i dot32(__m256i w, __m256i x) {
  if (Signed) {  // maddubs's first operand is unsigned: move w's sign onto x
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}
#endif  // __AVX2__

}  // namespace quant
}  // namespace pagedserve
