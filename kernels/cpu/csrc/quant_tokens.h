// The tokens of the int8 strips (quant_vnni.h on AVX512-VNNI, quant_maddubs.h
// on AVX2): every token quantized once a call, as the few-token rows'
// (quant_act.h), into the layout both forms' tiles read.
#pragma once

#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_act.h"
#include "quant_blob.h"
#include "quant_blocks.h"

#if defined(__AVX2__)
namespace pagedserve {
namespace quant {

// PAGEDSERVE_QUANT_STRIPS=bf16 asks for the de-quantized strips instead
// (quant_strips.h: bf16 where the build has the bf16 dot product, else
// fp32), for side-by-side runs; read once per process, as amx::available()
// is.
inline bool dequantized_strips_asked() {
  static const bool yes = [] {
    const char* env = std::getenv("PAGEDSERVE_QUANT_STRIPS");
    return env && std::strcmp(env, "bf16") == 0;
  }();
  return yes;
}

// Groups of 32 inputs that share a token's scale: a K-quant super-block's
// eight where every part of the blob is a K-quant, else one.  Why: with one
// scale across the eight, a group's int32 sums take the weight's scale
// alone, and the token's once a super-block, not a multiply per group and
// column.  At 512 tokens Llama-3.2-1B's Q4_K up projection took 0.94-0.97x
// the time, its Q6_K down projection 0.83-0.85x; at 32 tokens the Q6_K
// head 0.91-0.92x (Zen 5, docs/performance.md).
// The price: SmolLM2 re-quantized to Q4_K_M, over scripts/gguf_quality.py's
// text, mean KL against the float32 model 0.0055 (per 32: 0.0039),
// perplexity +0.39 % (+0.54 %).  llama.cpp rounds the activations that meet
// K-quants per 256 (Q8_K) too; the legacy types keep 32, as their weights'
// scales do.
inline int groups_a_scale(const Blob& blob) {
  bool k_quants = true;
  for (const Part& p : blob.parts) with_type(p.type, [&](auto q) { k_quants &= decltype(q)::kElems == 256; });
  return k_quants ? 8 : 1;
}

// The sum of v's four int32 lanes.
inline int32_t hsum4(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}

// The tokens as the tiles read them: codes (+ 128 where the tiles take them
// unsigned: quant_vnni.h), a scale d per `per` groups, what a weight's min
// multiplies per group (the sum of its codes, times d where d is the
// group's own, per = 1), and each 16 codes' sum (quant_maddubs.h takes a
// weight's centre off with it).  The four arrays share one allocation: at
// one token a layer's four linears each quantize their input, and four
// zeroed vectors a call measured ~0.8 us of a ~3 us fixed cost that the
// other thread waits through (SmolLM2, Zen 4, docs/performance.md).
struct Tokens {
  int64_t K, groups, per;
  std::unique_ptr<uint8_t[]> buffer;  // the arrays below, every byte written by quantize_tokens
  uint8_t* codes;                     // [tokens, K]
  float* d;                           // [tokens, groups / per]
  float* sums;                        // [tokens, groups]
  int32_t* halves;                    // [tokens, groups, 2]

  Tokens(int64_t M, int64_t K_, int64_t per_) : K(K_), groups(K_ / 32), per(per_) {
    // K is a multiple of 32, so the float arrays after the codes stay aligned.
    const size_t code_bytes = size_t(M * K), scales = size_t(M * (groups / per)), group_rows = size_t(M * groups);
    buffer.reset(new uint8_t[code_bytes + 4 * (scales + 3 * group_rows)]);
    codes = buffer.get();
    d = reinterpret_cast<float*>(codes + code_bytes);
    sums = d + scales;
    halves = reinterpret_cast<int32_t*>(sums + group_rows);
  }
};

// quant_act.h's rounding (d = max|x| / 127 over `per` groups, codes to
// nearest even), written straight into the tiles' layout, + 128 where
// `unsigned_codes`.  With per = 1 these are the few-token path's codes.
template <typename TX>
inline Tokens quantize_tokens(const TX* x, int64_t M, int64_t K, int64_t per, bool unsigned_codes) {
  const int64_t groups = K / 32, scales = groups / per;
  Tokens t(M, K, per);
  const __m256i flip = _mm256_set1_epi8(unsigned_codes ? char(0x80) : 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < scales; ++b) {
        const TX* xb = x + m * K + 32 * per * b;
        const float d = abs_max_avx2(xb, 32 * per) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        t.d[size_t(m * scales + b)] = d;
        for (int64_t j = 0; j < per; ++j) {
          const int64_t g = b * per + j;
          int sum;
          const __m256i q = codes_avx2(xb + 32 * j, id, sum);
          t.sums[size_t(m * groups + g)] = per == 1 ? d * float(sum) : float(sum);
          const __m256i wide = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
          t.halves[size_t(2 * (m * groups + g))] = hsum4(_mm256_castsi256_si128(wide));
          t.halves[size_t(2 * (m * groups + g) + 1)] = hsum4(_mm256_extracti128_si256(wide, 1));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.codes + m * K + 32 * g), _mm256_xor_si256(q, flip));
        }
      }
  });
  return t;
}

}  // namespace quant
}  // namespace pagedserve
#endif  // __AVX2__
