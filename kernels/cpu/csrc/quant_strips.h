// The quantized linear past a few tokens: strips of weight rows de-quantized
// to bf16 and multiplied by the bf16 linear's tiles (linear.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "linear.h"
#include "quant_blob.h"
#include "quant_blocks.h"
#include "types.h"

namespace pagedserve {
namespace quant {

// ---- many tokens: de-quantized tiles through the bf16 linear ------------------------------
//
// Past a few tokens (a prefill chunk, a large decode batch) the integer path
// pays its per-block scale work once per token; the bf16 linear's tiles
// (linear.h) reuse each weight vector for 6-8 tokens instead. So a strip of
// weight rows is de-quantized once (exact values, then rounded to bf16) into
// a buffer the size of linear.h's strip, and every token meets it there. The
// activations stay bf16 (not 8-bit) on this path.

// 32 de-quantized weights of one sub-block, rounded to bf16, at out.
template <typename Q>
inline void dequantize32_bf16(const uint8_t* block, int j, const float* wd, float wm, bf16_t* out) {
#if defined(PAGEDSERVE_ISA_AVX512BF16)
  // One instruction rounds all 32 to bf16 (nearest even; it reads fp32
  // denormals as zero, which no weight of a real file is).
  const __m256i q = Q::q_avx2(block, j);
  __m512 v[2];
  for (int h = 0; h < 2; ++h) {
    const __m128i half = h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
    v[h] = _mm512_mul_ps(_mm512_set1_ps(wd[h]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half)));
    if (Q::kMin) v[h] = _mm512_add_ps(v[h], _mm512_set1_ps(wm));
  }
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
#elif defined(__AVX2__)
  const __m256i q = Q::q_avx2(block, j);
  for (int k = 0; k < 4; ++k) {
    const __m128i half = k < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k % 2 ? _mm_srli_si128(half, 8) : half));
    __m256 v = _mm256_mul_ps(_mm256_set1_ps(wd[k / 2]), f);
    if (Q::kMin) v = _mm256_add_ps(v, _mm256_set1_ps(wm));
    vec::store_bf16(out + 8 * k, vec::F{v});
  }
#else
  int8_t q[32];
  Q::q(block, j, q);
  for (int i = 0; i < 32; ++i) {
    const float v = wd[i / 16] * float(q[i]);
    store_scalar(out + i, Q::kMin ? v + wm : v);
  }
#endif
}

// Rows [n0, n1) of one part, de-quantized into buf (row-major, bf16).
template <typename Q>
inline void dequantize_rows_bf16(const Part& p, int64_t K, int64_t n0, int64_t n1, bf16_t* buf) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < K / Q::kElems; ++b) {
      const uint8_t* block = p.data + n * p.row_bytes + b * Q::kBytes;
      float wd[2 * Q::kSubs], wm[Q::kSubs] = {};
      Q::scales(block, wd, wm);
      for (int j = 0; j < Q::kSubs; ++j)
        dequantize32_bf16<Q>(block, j, wd + 2 * j, wm[j], buf + (n - n0) * K + b * Q::kElems + 32 * j);
    }
}

// Every token against every part, a strip of de-quantized rows at a time.
template <typename X, typename TOut>
inline void run_dequantized(const Blob& blob, const X* xp, int64_t M, const float* bias, TOut* out) {
  const int64_t K = blob.K, N = blob.N, strip = linear::kStripCols;
  int64_t first = 0;
  for (const Part& p : blob.parts) {
    with_type(p.type, [&](auto q) {
      using Q = decltype(q);
      at::parallel_for(0, (p.rows + strip - 1) / strip, 1, [&](int64_t s0, int64_t s1) {
        std::vector<bf16_t> buf(size_t(strip * K));
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t n0 = s * strip, n1 = std::min(p.rows, n0 + strip);
          dequantize_rows_bf16<Q>(p, K, n0, n1, buf.data());
          const int64_t at = first + n0;
          for (int64_t m0 = 0; m0 < M; m0 += linear::kChunkRows)
            linear::rows_times_strip(xp, buf.data(), bias ? bias + at : nullptr, K, m0,
                                     std::min(M, m0 + linear::kChunkRows), 0, n1 - n0, out + at, N);
        }
      });
    });
    first += p.rows;
  }
}

// x as linear.h's tiles read it (bf16 as it is where the build has the bf16
// dot product, else fp32 in its pair order), then run_dequantized.
template <typename TX, typename TOut>
inline void run_many(const Blob& blob, const TX* x, int64_t M, const float* bias, TOut* out) {
  if constexpr (linear::kDotBf16 && std::is_same_v<TX, bf16_t>) {
    run_dequantized(blob, x, M, bias, out);
  } else {
    static const auto order = linear::pair_order();
    std::vector<float> xp(size_t(M * blob.K));
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      linear::permute_rows(x, xp.data(), blob.K, r0, r1, order);
    });
    run_dequantized(blob, static_cast<const float*>(xp.data()), M, bias, out);
  }
}

}  // namespace quant
}  // namespace pagedserve
