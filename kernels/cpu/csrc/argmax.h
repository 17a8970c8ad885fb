// Greedy decoding's choice: each row's argmax, as torch.argmax(dim=-1) gives
// it: the first index of the row's largest value, a NaN ranked above every
// number (so the first NaN, if any).  Why compiled: torch's CPU argmax walks
// a row one element at a time (105 µs for SmolLM2's 49,152 logits, 330 µs
// for Qwen's 151,936, on the AVX512-BF16 Xeon, 2026-11-30); here a vector
// of lanes keeps each lane's first maximum and its index, and the lanes
// then give the smallest index holding the largest value.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedserve {
namespace argmax {

inline int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

// From `at` holding `best` (everything before `from` seen), the rest one by one.
inline int64_t finish(const float* x, int64_t n, int64_t from, float best, int64_t at) {
  for (int64_t i = from; i < n; ++i) {
    if (std::isnan(x[i])) return i;  // no NaN before `from`: this is the first
    if (x[i] > best) best = x[i], at = i;
  }
  return at;
}

// Lane l of a vector part holds the largest value of its elements and the
// first index of it: the row's answer is the smallest index among the lanes
// holding the largest value.
template <int L>
inline int64_t combine(const float (&value)[L], const int32_t (&index)[L], float& best) {
  best = value[0];
  int64_t at = index[0];
  for (int l = 1; l < L; ++l)
    if (value[l] > best || (value[l] == best && index[l] < at)) best = value[l], at = index[l];
  return at;
}

inline int64_t row(const float* x, int64_t n) {
  if (n == 0) return 0;
  int64_t i = 0, at = 0;
  float best = x[0];
#if defined(__AVX512F__)
  if (n >= 32) {
    __m512 vbest = _mm512_loadu_ps(x);
    __m512i vat = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), cur = vat;
    __mmask16 nan = _mm512_cmp_ps_mask(vbest, vbest, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, _mm512_set1_epi32(16));
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
      vbest = _mm512_mask_mov_ps(vbest, gt, v);
      vat = _mm512_mask_mov_epi32(vat, gt, cur);
    }
    if (nan) return first_nan(x, i);
    float value[16];
    int32_t index[16];
    _mm512_storeu_ps(value, vbest);
    _mm512_storeu_si512(index, vat);
    at = combine(value, index, best);
  }
#elif defined(__AVX2__)
  if (n >= 16) {
    __m256 vbest = _mm256_loadu_ps(x);
    __m256i vat = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vat;
    __m256 nan = _mm256_cmp_ps(vbest, vbest, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, _mm256_set1_epi32(8));
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);
      vbest = _mm256_blendv_ps(vbest, v, gt);
      vat = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vat), _mm256_castsi256_ps(cur), gt));
    }
    if (_mm256_movemask_ps(nan)) return first_nan(x, i);
    float value[8];
    int32_t index[8];
    _mm256_storeu_ps(value, vbest);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(index), vat);
    at = combine(value, index, best);
  }
#endif
  if (i == 0) {  // the portable build, or a short row: one by one from the start
    if (std::isnan(x[0])) return 0;
    i = 1;
  }
  return finish(x, n, i, best, at);
}

}  // namespace argmax

// logits [rows, V] float32, V contiguous (rows may be strided): int64 [rows].
inline at::Tensor row_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  (logits.size(1) <= 1 || logits.stride(1) == 1),
              "row_argmax: logits must be a CPU float32 [rows, V] tensor, V contiguous");
  TORCH_CHECK(logits.size(1) > 0 || logits.size(0) == 0, "row_argmax: a row of no logits has no argmax");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 31), "row_argmax: rows of 2^31 logits or more");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 2, [&](int64_t r0, int64_t r1) {  // two rows or more: both threads
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax::row(x + r * stride, n);
  });
  return out;
}

}  // namespace pagedserve
