// Eight horizontal sums at once (AVX): shared by the AVX2 and AVX-512 builds.
#pragma once

#include <immintrin.h>

namespace pagedserve::vec {

// out[i] = sum of the lanes of acc[i], i < 8: one hadd tree for eight dot
// products instead of eight horizontal sums.  Lane i of the result depends
// on acc[i] alone, so a score never depends on its neighbours.
inline void reduce8_m256(const __m256* acc, float* out) {
  __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]);
  __m256 t1 = _mm256_hadd_ps(acc[2], acc[3]);
  __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]);
  __m256 t3 = _mm256_hadd_ps(acc[6], acc[7]);
  // u0 = [acc0..3 over lanes 0-3 | acc0..3 over lanes 4-7]; adding the
  // 128-bit halves of u0, u1 crosswise finishes all eight sums.
  __m256 u0 = _mm256_hadd_ps(t0, t1);
  __m256 u1 = _mm256_hadd_ps(t2, t3);
  __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20);
  __m256 hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

}  // namespace pagedserve::vec
