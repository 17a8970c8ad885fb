// The quantized linear past a few tokens: strips of weight rows de-quantized
// to bf16 and multiplied by the bf16 linear's tiles (linear.h), or by AMX
// (amx.h); on AVX512-VNNI where AMX does not take the call, and on AVX2,
// int8 strips (quant_vnni.h, quant_maddubs.h).  PAGEDSERVE_QUANT_STRIPS=bf16
// keeps the de-quantized strips there (for side-by-side runs).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "amx_rows.h"
#include "linear.h"
#include "quant_blob.h"
#include "quant_blocks.h"
#include "quant_maddubs.h"
#include "quant_panels.h"
#include "quant_vnni.h"
#include "types.h"
#include "work_items.h"

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

#if defined(PAGEDSERVE_ISA_AVX512BF16) || defined(PAGEDSERVE_ISA_AVX512)
// Half h (16 of the 32 codes q of a sub-block) de-quantized in fp32:
// wd[h] * q (+ wm), the products and sums both AVX-512 builds round to bf16.
template <typename Q>
inline __m512 dequantize16_f32(__m256i q, int h, const float* wd, float wm) {
  const __m128i half = h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
  const __m512 v = _mm512_mul_ps(_mm512_set1_ps(wd[h]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half)));
  return Q::kMin ? _mm512_add_ps(v, _mm512_set1_ps(wm)) : v;
}
#endif

#if defined(PAGEDSERVE_ISA_AVX512BF16)
// 32 de-quantized weights of one sub-block in one vector: one instruction
// rounds all 32 to bf16 (nearest even; it reads fp32 denormals as zero,
// which no weight of a real file is).
template <typename Q>
inline __m512i dequantize32_bf16_vec(const uint8_t* block, int j, const float* wd, float wm) {
  const __m256i q = Q::q_avx2(block, j);
  return (__m512i)_mm512_cvtne2ps_pbh(dequantize16_f32<Q>(q, 1, wd, wm), dequantize16_f32<Q>(q, 0, wd, wm));
}

// 4-bit codes by table: a scale's 16 values, wd * (i - centre) (+ wm) for
// i = 0..15 (the product, sum and rounding of dequantize32_bf16_vec, so the
// same bits), made once per sub-block, and vpermw picks 32 of them for 32
// codes.  Why: ~10 instructions per 32 weights where widening, converting,
// scaling and rounding them took ~17, and the de-quantizing was most of a
// 16-token step of a Q4_K_M model (docs/performance.md).
template <int kCentre, bool kMin>
inline __m512 table_values(float wd, float wm) {
  const __m512 codes = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_ps(float(kCentre)));
  const __m512 v = _mm512_mul_ps(_mm512_set1_ps(wd), codes);
  return kMin ? _mm512_add_ps(v, _mm512_set1_ps(wm)) : v;
}

// 32 codes (bytes 0..31, each below 32) -> their 32 bf16 values in `table`.
inline void look_up32(__m256i codes, __m512i table, bf16_t* out) {
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table));
}

// One Q4_K super-block: the two sub-blocks of each 32 bytes of nibbles
// (low: 2 i, high: 2 i + 1) share a table of 32 (theirs side by side).
inline void q4_k_block_bf16(const uint8_t* b, bf16_t* out) {
  __m256 wd8, wm8;
  k4_scales(b, wd8, wm8);
  alignas(32) float wd[8], wm[8];
  _mm256_store_ps(wd, wd8);
  _mm256_store_ps(wm, wm8);
  const __m256i low = _mm256_set1_epi8(0x0F), second = _mm256_set1_epi8(0x10);
  for (int i = 0; i < 4; ++i) {
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(table_values<0, true>(wd[2 * i + 1], wm[2 * i + 1]),
                                                       table_values<0, true>(wd[2 * i], wm[2 * i]));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * i));
    look_up32(_mm256_and_si256(q, low), table, out + 64 * i);
    look_up32(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low), second), table, out + 64 * i + 32);
  }
}

// One Q4_0 or Q4_1 block: one scale, one table of 16.
template <typename Q>
inline void nibble_block_bf16(const uint8_t* b, bf16_t* out) {
  float wd[2], wm[1] = {};
  Q::scales(b, wd, wm);
  const __m256i values = (__m256i)_mm512_cvtneps_pbh(table_values<Q::kCentre, Q::kMin>(wd[0], wm[0]));
  look_up32(nibbles_16(b + Q::kQs), _mm512_castsi256_si512(values), out);
}
#endif

// 32 de-quantized weights of one sub-block, rounded to bf16, at out.
template <typename Q>
inline void dequantize32_bf16(const uint8_t* block, int j, const float* wd, float wm, bf16_t* out) {
#if defined(PAGEDSERVE_ISA_AVX512BF16)
  _mm512_storeu_si512(out, dequantize32_bf16_vec<Q>(block, j, wd, wm));
#elif defined(PAGEDSERVE_ISA_AVX512)
  // The same products and sums, rounded by integer arithmetic (vec::store_bf16).
  const __m256i q = Q::q_avx2(block, j);
  for (int h = 0; h < 2; ++h) vec::store_bf16(out + 16 * h, vec::F{dequantize16_f32<Q>(q, h, wd, wm)});
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

// One block's Q::kElems weights, rounded to bf16, at out.
template <typename Q>
inline void dequantize_block_bf16(const uint8_t* block, bf16_t* out) {
#if defined(PAGEDSERVE_ISA_AVX512BF16)
  if constexpr (std::is_same_v<Q, Q4_K>) {
    return q4_k_block_bf16(block, out);
  } else if constexpr (std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1>) {
    return nibble_block_bf16<Q>(block, out);
  }
#endif
  float wd[2 * Q::kSubs], wm[Q::kSubs] = {};
  Q::scales(block, wd, wm);
  for (int j = 0; j < Q::kSubs; ++j) dequantize32_bf16<Q>(block, j, wd + 2 * j, wm[j], out + 32 * j);
}

// Rows [n0, n1) of one part, de-quantized into buf (row-major, bf16).
template <typename Q>
inline void dequantize_rows_bf16(const Part& p, int64_t K, int64_t n0, int64_t n1, bf16_t* buf) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < K / Q::kElems; ++b)
      dequantize_block_bf16<Q>(p.data + n * p.row_bytes + b * Q::kBytes, buf + (n - n0) * K + b * Q::kElems);
}

// Every token against every part, a strip of de-quantized rows at a time.
template <typename X, typename TOut>
inline void run_dequantized(const Blob& blob, const X* xp, int64_t M, const float* bias, TOut* out) {
  const int64_t K = blob.K, N = blob.N;
  const std::vector<Strip> strips = strips_of(blob, linear::kStripCols);
  // Not zeroed: every element is written before it is read.
  auto make = [&] { return std::unique_ptr<bf16_t[]>(new bf16_t[size_t(linear::kStripCols * K)]); };
  run_items(int64_t(strips.size()), make, [&](std::unique_ptr<bf16_t[]>& buf, int64_t i) {
    const Strip& s = strips[i];
    with_type(s.part->type, [&](auto q) { dequantize_rows_bf16<decltype(q)>(*s.part, K, s.n0, s.n1, buf.get()); });
    const int64_t at = s.first + s.n0;
    for (int64_t m0 = 0; m0 < M; m0 += linear::kChunkRows)
      linear::rows_times_strip(xp, buf.get(), bias ? bias + at : nullptr, K, m0,
                               std::min(M, m0 + linear::kChunkRows), 0, s.n1 - s.n0, out + at, N);
  });
}

#if defined(PAGEDSERVE_HAS_AMX)
// ---- many tokens on AMX -----------------------------------------------------------------
//
// Two forms, by the call's tokens, the same sums bit for bit:
// - up to kAmxRowsUpTo tokens (decode batches) the de-quantizing is the cost:
//   rows de-quantize as they lie and AMX reads them as its A operand
//   (amx_rows.h, run_amx_rows);
// - past it (prefill) the tile products are: amx.h's tiles read B in
//   linear_packed.h's layout (a block of 16 features, one input pair of all
//   16 per 64 bytes), so a strip is de-quantized straight into it: 16 rows'
//   same 32 inputs make 16 vectors of 16 pairs, and a 16 x 16 transpose of
//   those 32-bit pairs turns them into 16 pair rows of the block.
// On the 2-vCPU AMX Xeon, Qwen3-0.6B's and Llama-3.2-1B's Q4_K/Q6_K linears
// took 0.63-0.86x the time in the rows form at 16-64 tokens, the same at 96-192
// (Qwen3) and 128 (Llama), 1.12-1.33x at 256-2048 (docs/performance.md).
constexpr int64_t kAmxManyRows = 16;  // fewer: the int8 strips or the rows (quant_linear.h)
constexpr int64_t kAmxRowsUpTo = 128;

// Rows [n0, n0 + 16) of one part, de-quantized into one packed block (K / 2 pairs x 16 x 2).
template <typename Q>
inline void dequantize_block_packed(const Part& p, int64_t K, int64_t n0, bf16_t* out) {
  for (int64_t b = 0; b < K / Q::kElems; ++b) {
    float wd[16][2 * Q::kSubs], wm[16][Q::kSubs] = {};
    for (int l = 0; l < 16; ++l) Q::scales(p.data + (n0 + l) * p.row_bytes + b * Q::kBytes, wd[l], wm[l]);
    for (int j = 0; j < Q::kSubs; ++j) {
      __m512i r[16];
      for (int l = 0; l < 16; ++l)
        r[l] = dequantize32_bf16_vec<Q>(p.data + (n0 + l) * p.row_bytes + b * Q::kBytes, j, wd[l] + 2 * j,
                                        wm[l][j]);
      vec::transpose16(r);
      bf16_t* pairs = out + (b * Q::kElems + 32 * j) * 16;  // 16 pairs x 16 features x 2
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(pairs + 32 * i, r[i]);
    }
  }
}

// A thread's buffer for a strip of de-quantized rows, and its tile configuration.
struct AmxScratch {
  explicit AmxScratch(int64_t elements) : buf(new bf16_t[size_t(elements)]) {}
  std::unique_ptr<bf16_t[]> buf;  // not zeroed: every element is written before it is read
  amx::Tiles tiles;
};

// Every token against every part, a strip of blocks de-quantized at a time.
template <typename TOut>
inline void run_amx(const Blob& blob, const bf16_t* x, int64_t M, const float* bias, TOut* out) {
  const int64_t K = blob.K, N = blob.N, strip = amx::kStripBlocks * amx::kTile;
  std::vector<bf16_t> storage;
  const amx::Rows rows = amx::rows_of(x, M, K, storage);
  const std::vector<Strip> strips = strips_of(blob, strip);
  run_items(int64_t(strips.size()), [&] { return AmxScratch(strip * K); }, [&](AmxScratch& scratch, int64_t i) {
    const Strip& s = strips[i];
    const int64_t blocks = (s.n1 - s.n0) / amx::kTile;
    bf16_t* buf = scratch.buf.get();
    with_type(s.part->type, [&](auto q) {
      for (int64_t b = 0; b < blocks; ++b)
        dequantize_block_packed<decltype(q)>(*s.part, K, s.n0 + amx::kTile * b, buf + b * amx::kTile * K);
    });
    const int64_t at = s.first + s.n0;
    amx::rows_times_strip(rows, amx::B{buf, blocks, K}, 0, M, 0, blocks,
                          Epilogue{bias ? bias + at : nullptr}, out + at, N);
  });
}

// Every token against every part, a strip of rows de-quantized at a time
// (row-major, as they lie in the file) and multiplied as AMX's A operand.
template <typename TOut>
inline void run_amx_rows(const Blob& blob, const bf16_t* x, int64_t M, const float* bias, TOut* out) {
  const int64_t K = blob.K, N = blob.N, strip = amx::kStripBlocks * amx::kTile;
  const amx::Pairs pairs = amx::pairs_of(x, M, K);
  const std::vector<Strip> strips = strips_of(blob, strip);
  run_items(int64_t(strips.size()), [&] { return AmxScratch(strip * K); }, [&](AmxScratch& scratch, int64_t i) {
    const Strip& s = strips[i];
    with_type(s.part->type, [&](auto q) { dequantize_rows_bf16<decltype(q)>(*s.part, K, s.n0, s.n1, scratch.buf.get()); });
    amx::strip_times_pairs(scratch.buf.get(), s.n1 - s.n0, pairs, M, s.first + s.n0, bias, out, N);
  });
}

// AMX takes a call of bf16 tokens whose parts are whole blocks of 16 rows.
inline bool amx_takes(const Blob& blob) {
  if (!amx::takes(blob.K)) return false;
  for (const Part& p : blob.parts)
    if (p.rows % 16) return false;
  return true;
}
#endif

// x as linear.h's tiles read it (bf16 as it is where the build has the bf16
// dot product, else fp32 in its pair order), then run_dequantized.
template <typename TX, typename TOut>
inline void run_many(const Blob& blob, const TX* x, int64_t M, const float* bias, TOut* out) {
  if (blob.panels) {  // any count of tokens, float32 or bf16: the int8 strips read panels directly
#if defined(PAGEDSERVE_QUANT_VNNI)
    return M < panels::kFewTokens ? panels::run(blob, x, M, bias, out) : vnni::run(blob, x, M, bias, out);
#else
    TORCH_CHECK(false, "quant_linear: a blob in 16-row panels is multiplied by the AVX512-VNNI build only "
                "(kernels.pack_linear makes them for it)");
#endif
  }
#if defined(PAGEDSERVE_QUANT_MADDUBS)
  if (!dequantized_strips_asked()) return maddubs::run(blob, x, M, bias, out);
#endif
#if defined(PAGEDSERVE_QUANT_VNNI)
  // Without the bf16 dot product (the avx512 build) the int8 strips take
  // float32 tokens too: the de-quantized strips would widen to fp32.
  if constexpr (!linear::kDotBf16)
    if (!dequantized_strips_asked()) return vnni::run(blob, x, M, bias, out);
#endif
  if constexpr (linear::kDotBf16 && std::is_same_v<TX, bf16_t>) {
#if defined(PAGEDSERVE_HAS_AMX)
    if (M >= kAmxManyRows && amx_takes(blob))
      return M <= kAmxRowsUpTo ? run_amx_rows(blob, x, M, bias, out) : run_amx(blob, x, M, bias, out);
#endif
#if defined(PAGEDSERVE_QUANT_VNNI)
    if (!dequantized_strips_asked()) return vnni::run(blob, x, M, bias, out);
#endif
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
