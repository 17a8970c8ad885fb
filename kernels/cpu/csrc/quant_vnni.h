// The quantized linear past a few tokens where the CPU has AVX512-VNNI (and
// AMX does not take the call): the tokens quantized to 8 bits as at a few
// tokens (quant_act.h; per 256 inputs where every part is a K-quant, see
// groups_a_scale), a strip of weight rows decoded once into its int8 codes,
// and every token meets the strip in integers.
//
// Why: the other form (quant_strips.h) de-quantizes the strip to bf16 and
// runs the bf16 tiles, whose vdpbf16ps does 32 multiply-adds.  vpdpbusd does
// 64 in the same slot (both two a cycle on Zen 5), and decoding codes to
// bytes is cheaper than scaling them to bf16.  Serving 32 streams of a
// Qwen3-0.6B Q4_K_M file on Zen 5, the bf16 tiles were 46 % of the samples
// and the de-quantizing 15 %; with this form the same offline run gave
// 185-186 output tok/s against 140-141 (docs/performance.md).  At 128
// tokens Llama-1B's linears took 0.55-0.67x the bf16 strips' time.
//
// Blocking: a work item is a strip of columns_for(K) columns of 16 rows.
// It is decoded once (the scales of 16 rows transposed into vectors, the
// codes of two groups of 16 rows transposed in one 16 x 16 of 4-byte
// words), then every token meets it in tiles of kTileTokens x kTileColumns
// columns (4 x 2 ran 1.16x faster than 6 x 2 at 128 tokens).  The next
// item's bytes are prefetched into L2 a line or two a group while the tiles
// run (work_items.h's run_items_ahead): the decode walks 16 rows at once,
// which the hardware prefetchers do not follow.
//
// A strip's layout, 16 weight rows a column (one int32 lane a row):
//
//   codes [column][group of 32 inputs][k = 0..7][16 rows][4 bytes]
//     one 64-byte vector: inputs 4k .. 4k + 3 of the group for 16 rows,
//     what one vpdpbusd meets with a token's 4 codes in every lane
//   meta  [column][group]: each row's scale (per 16 inputs for Q6_K), its
//     min, and -128 x the sum of its codes (per 16 for Q6_K)
//
// Signs: vpdpbusd multiplies unsigned bytes by signed ones.  The weights'
// codes are signed (q_avx2: the type's centre taken off), so the tokens'
// codes go in unsigned, u = q + 128.  Then sum u w = sum q w + 128 sum w,
// and each accumulator starts at -128 sum w, so it ends on the exact integer
// sum q w of the few-token path.  Per group a token's sum then takes
// (wd * xd) * dot + wm * s: quant_linear.h's formula in the same integers,
// summed group after group in fp32.
#pragma once

#include "quant_lanes.h"

#if defined(PAGEDSERVE_QUANT_LANES) && (defined(PAGEDSERVE_ISA_AVX512BF16) || defined(PAGEDSERVE_ISA_AVX512))
#define PAGEDSERVE_QUANT_VNNI 1

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#include "quant_act.h"
#include "quant_blob.h"
#include "quant_blocks.h"
#include "quant_strip_run.h"
#include "quant_tokens.h"
#include "types.h"
#include "vec.h"
#include "work_items.h"

namespace pagedserve {
namespace quant {
namespace vnni {

constexpr int64_t kMaxColumns = 4;               // columns of 16 rows per strip (work item)
constexpr int kTileTokens = 4;                   // tokens per tile
constexpr int kTileColumns = 2;                  // columns per tile: 8 int32 + 8 fp32 accumulators

// One group's numbers for one column's 16 rows (lane l: row l).
struct alignas(64) GroupMeta {
  int32_t init[2][16];  // -128 x the sum of the codes: the whole group, or each half (Q6_K)
  float wd[2][16];      // the scale: the whole group in [0], or each half (Q6_K)
  float wm[16];         // the min (types with one)
};

// Columns a strip takes for K inputs: as many as kMaxColumns whose decoded
// codes and meta fit kStripBudget.  Why: every panel of tokens reads the
// strip again, from L2, while the next strip's raw bytes come into L2 beside
// it; at 8,192 inputs four columns decode to ~850 KB, and with the next
// strip that overran Zen 5's 1 MB L2.  Two columns there took Llama-3.2-1B's
// down projection (8,192 -> 2,048) 0.83-0.92x the time at 32 and 512 tokens,
// Q4_K and Q6_K; at 2,048 inputs four columns stay 0-3 % ahead of two
// (docs/performance.md).  Half of Zen 4/5's L2; a quarter of Sapphire
// Rapids'.
constexpr int64_t kStripBudget = int64_t(512) << 10;
inline int64_t columns_for(int64_t K) {
  const int64_t column = K / 32 * int64_t(512 + sizeof(GroupMeta));
  return std::clamp<int64_t>(kStripBudget / column, 1, kMaxColumns);
}

// A thread's decoded strip: `columns` columns' codes and meta (quant::Strip
// names which rows of the blob a strip is; this holds them decoded).
struct Decoded {
  Decoded(int64_t columns, int64_t groups)
      : codes(new int8_t[size_t(columns * groups * 512)]), meta(new GroupMeta[size_t(columns * groups)]) {}
  std::unique_ptr<int8_t[]> codes;
  std::unique_ptr<GroupMeta[]> meta;
};

// Lane l: -128 x the sum of the codes of v[k] over k in [k0, k1), lane l.
// Every type's codes but Q8_0's are small enough that their byte sums over a
// group (Q6_K: a half) cannot wrap: the types with a min keep codes of 0..31
// (eight make at most 248, unsigned), Q4_0's, Q5_0's and Q6_K's are centred
// (eight of -16..15, or four of -32..31, stay in a signed byte).  So the
// bytes are added first and one vpdpbusd takes each lane's four.  Why: one
// vpdpbusd a vector, each waiting on the last, was an eighth of a 32-token
// Llama-3.2-1B step's decode_column<Q4_K> (docs/performance.md).
template <typename Q>
inline __m512i minus_128_sums(const __m512i* v, int k0, int k1) {
  const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
  __m512i sum;
  if constexpr (std::is_same_v<Q, Q8_0>) {
    __m512i other = zero;  // codes of -128..127: each vector widened, in two chains
    sum = zero;
    for (int k = k0; k < k1; k += 2) {
      sum = _mm512_dpbusd_epi32(sum, ones, v[k]);
      if (k + 1 < k1) other = _mm512_dpbusd_epi32(other, ones, v[k + 1]);
    }
    sum = _mm512_add_epi32(sum, other);
  } else {
    __m512i bytes = v[k0];
    for (int k = k0 + 1; k < k1; ++k) bytes = _mm512_add_epi8(bytes, v[k]);
    sum = Q::kMin ? _mm512_dpbusd_epi32(zero, bytes, ones) : _mm512_dpbusd_epi32(zero, ones, bytes);
  }
  return _mm512_sub_epi32(zero, _mm512_slli_epi32(sum, 7));
}

// A super-block's 16 floats for one row: Q4_K's and Q5_K's 8 scales then
// 8 mins, Q6_K's 16 scales (one per 16 inputs).
template <typename Q>
inline __m512 super_scales(const uint8_t* b) {
  if constexpr (Q::kSplit) {
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    return _mm512_mul_ps(_mm512_set1_ps(fp16_to_float(b + 208)), _mm512_cvtepi32_ps(sc));
  } else {
    __m256 wd, wm;
    k4_scales(b, wd, wm);
    return _mm512_insertf32x8(_mm512_castps256_ps512(wd), wm, 1);
  }
}

// The scales and mins of one column's 16 rows (the lanes past `rows` zero),
// in vectors: a super-block's 16 floats a row, transposed so that each is
// one vector across the rows.  A legacy block's fp16 d (and m after it) for
// 16 rows is one gather.
template <typename Q>
inline void column_scales(const uint8_t* first, int64_t row_bytes, int64_t rows, int64_t K, GroupMeta* meta) {
  const __mmask16 live = __mmask16((1u << rows) - 1);
  if constexpr (Q::kSubs == 1) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(int32_t(row_bytes)));
    for (int64_t g = 0; g < K / 32; ++g) {
      const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, first + g * Q::kBytes, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
      _mm512_store_ps(meta[g].wd[0], d);
      if (Q::kMin) _mm512_store_ps(meta[g].wm, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16))));
    }
  } else {
    for (int64_t b = 0; b < K / Q::kElems; ++b) {
      __m512i v[16];
      for (int64_t l = 0; l < 16; ++l)
        v[l] = l < rows ? _mm512_castps_si512(super_scales<Q>(first + l * row_bytes + b * Q::kBytes))
                        : _mm512_setzero_si512();
      vec::transpose16(v);
      for (int j = 0; j < 8; ++j) {
        GroupMeta& m = meta[b * 8 + j];
        if (Q::kSplit) {
          _mm512_store_si512(m.wd[0], v[2 * j]);
          _mm512_store_si512(m.wd[1], v[2 * j + 1]);
        } else {
          _mm512_store_si512(m.wd[0], v[j]);
          _mm512_store_si512(m.wm, v[8 + j]);
        }
      }
    }
  }
}

// Row `row`'s codes of groups g and g + 1 (g even): group g's 32 in the
// low half, g + 1's in the high half.  In Q4_K, Q5_K and Q6_K a pair of
// groups shares its bytes (Q4_K: the low and high nibbles of the same 32;
// Q6_K: the low or high nibbles of 64 bytes, the 2-bit highs of the same
// 32), so one load and per-half shifts take both, where a group at a time
// loads and masks each and inserts one into the other.
template <typename Q>
inline __m512i two_groups(const uint8_t* row, int64_t g) {
  const uint8_t* b = row + g / Q::kSubs * Q::kBytes;
  const int j = int(g % Q::kSubs);
  auto broadcast = [](const uint8_t* p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  auto halves = [](int lo, int hi) {  // a shift count per 16-bit lane: lo in the low half, hi in the high
    return _mm512_inserti64x4(_mm512_set1_epi16(short(lo)), _mm256_set1_epi16(short(hi)), 1);
  };
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  if constexpr (std::is_same_v<Q, Q4_K> || std::is_same_v<Q, Q5_K>) {
    const int at = std::is_same_v<Q, Q4_K> ? 16 : 48;
    const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(broadcast(b + at + 32 * (j / 2)), halves(0, 4)), nibble);
    if constexpr (std::is_same_v<Q, Q4_K>) {
      return low;
    } else {
      const __m512i high =
          _mm512_and_si512(_mm512_srlv_epi16(broadcast(b + 16), halves(j, j + 1)), _mm512_set1_epi8(1));
      return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
    }
  } else if constexpr (std::is_same_v<Q, Q6_K>) {
    const int h = j / 4, k = j % 4;  // k is 0 or 2: the pair is k, k + 1
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m512i low = _mm512_and_si512(k == 0 ? ql : _mm512_srli_epi16(ql, 4), nibble);
    const __m512i high =
        _mm512_and_si512(_mm512_srlv_epi16(broadcast(b + 128 + 32 * h), halves(2 * k, 2 * k + 2)), _mm512_set1_epi8(3));
    return _mm512_sub_epi8(_mm512_or_si512(low, _mm512_slli_epi16(high, 4)), _mm512_set1_epi8(32));
  } else {  // the legacy types: two blocks, one after the other
    const __m256i lo = Q::q_avx2(b, 0), hi = Q::q_avx2(b + Q::kBytes, 0);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// Rows [r0, r0 + rows) of a part (rows <= 16) into one column: its codes
// (groups x 512 bytes) and meta (groups).  The lanes past `rows` repeat the
// last row's codes (no branch a row): their scales are zero and their sums
// are never stored.
template <typename Q>
inline void decode_column(const Part& p, int64_t K, int64_t r0, int64_t rows, int8_t* codes, GroupMeta* meta) {
  const int64_t groups = K / 32;
  const uint8_t* row[16];
  for (int64_t l = 0; l < 16; ++l) row[l] = p.data + (r0 + std::min(l, rows - 1)) * p.row_bytes;
  column_scales<Q>(row[0], p.row_bytes, rows, K, meta);
  // Two groups at a time: row l's 64 codes in one vector, then a 16 x 16
  // transpose of their 4-byte words gives vector k the k-th word of every row.
  for (int64_t g = 0; g < groups; g += 2) {
    __m512i v[16];
    if (g + 1 < groups) {
      for (int64_t l = 0; l < 16; ++l) v[l] = two_groups<Q>(row[l], g);
    } else {  // a legacy row's odd last group
      for (int64_t l = 0; l < 16; ++l) v[l] = _mm512_zextsi256_si512(Q::q_avx2(row[l] + g * Q::kBytes, 0));
    }
    vec::transpose16(v);
    for (int64_t h = 0; h < 2 && g + h < groups; ++h) {
      for (int k = 0; k < 8; ++k) _mm512_storeu_si512(codes + (g + h) * 512 + 64 * k, v[8 * h + k]);
      GroupMeta& m = meta[g + h];
      if (Q::kSplit) {
        _mm512_store_si512(m.init[0], minus_128_sums<Q>(v + 8 * h, 0, 4));
        _mm512_store_si512(m.init[1], minus_128_sums<Q>(v + 8 * h, 4, 8));
      } else {
        _mm512_store_si512(m.init[0], minus_128_sums<Q>(v + 8 * h, 0, 8));
      }
    }
  }
}

// The 16 rows' 6-bit scale (mins = false) or min j of a panel's super-block
// at `chunk` (kernels/quant.py's layout), as int32 lanes: ggml's
// get_scale_min_k4 over the 16 rows' packed bytes at once.
inline __m512i panel_k4_field(const uint8_t* chunk, int j, bool mins) {
  auto byte = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 64 + 16 * i)); };
  const __m128i k6 = _mm_set1_epi8(63), k4 = _mm_set1_epi8(15), k2 = _mm_set1_epi8(3);
  __m128i v;
  if (j < 4) {
    v = _mm_and_si128(byte(mins ? j + 4 : j), k6);
  } else {
    const __m128i low = mins ? _mm_and_si128(_mm_srli_epi16(byte(j + 4), 4), k4) : _mm_and_si128(byte(j + 4), k4);
    const __m128i top = _mm_and_si128(_mm_srli_epi16(byte(mins ? j : j - 4), 6), k2);
    v = _mm_or_si128(low, _mm_slli_epi16(top, 4));
  }
  return _mm512_cvtepu8_epi32(v);
}

// A Q4_K panel's super-block at `chunk`: its 16 rows' d and -dmin (k4_scales'
// -dmin, to the bit).
inline void panel_k4_d_dmin(const uint8_t* chunk, __m512& d, __m512& minus_dmin) {
  const __m512i words = _mm512_loadu_si512(chunk);  // each row's d | dmin << 16
  d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
  const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
  minus_dmin = _mm512_xor_ps(_mm512_set1_ps(-0.f), dmin);
}

// (a & 0x0F) | b in every byte, one vpternlogd: a code's nibble joined to
// its high bits, which b holds in place already (Q5_K's fifth at bit 4,
// Q6_K's two at bits 4-5), for the panels' rows and their strips' decode.
inline __m512i nibble_or(__m512i a, __m512i b) {
  return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi8(0x0F), 0xEC);
}

// Bit `bit` of each byte of a Q5_K panel's qh word at bit 4 of that byte,
// the other bits zero (the 16-bit shift's crossings masked off).
inline __m512i k5_fifth(__m512i qh, int bit) {
  const __m512i moved = bit <= 4 ? _mm512_slli_epi16(qh, 4 - bit) : _mm512_srli_epi16(qh, bit - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
}

// A column out of a Q4_K (or, kFifth, Q5_K) part in 16-row panels
// (kernels/quant.py): the panel holding rows [r0, r0 + 16), decoded into the
// strips' codes and meta.  Why it is cheap: a panel already keeps each code
// word's 16 rows side by side, so a pair of groups is a load and two masks a
// word (Q5_K: and its qh word's two bits), where the file's order needs the
// 16 x 16 transposes of decode_column.
template <bool kFifth = false>
inline void decode_panel_column(const Part& p, int64_t K, int64_t r0, int8_t* codes, GroupMeta* meta) {
  constexpr int64_t kChunk = kFifth ? kQ5KPanelChunk : kPanelChunk, kCodes = kFifth ? 768 : 256;
  const uint8_t* panel = p.data + r0 * p.row_bytes;  // r0: a multiple of 16 (parse checks whole panels)
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* chunk = panel + b * kChunk;
    __m512 d, minus_dmin;
    panel_k4_d_dmin(chunk, d, minus_dmin);
    for (int pair = 0; pair < 4; ++pair) {
      __m512i v[16];  // v[k]: group 2 pair's word k, v[8 + k]: group 2 pair + 1's
      for (int k = 0; k < 8; ++k) {
        const __m512i c = _mm512_loadu_si512(chunk + kCodes + 512 * pair + 64 * k);
        if constexpr (kFifth) {  // bits 2 pair and 2 pair + 1 of qh word k's bytes, as 16
          const __m512i qh = _mm512_loadu_si512(chunk + 256 + 64 * k);
          v[k] = nibble_or(c, k5_fifth(qh, 2 * pair));
          v[8 + k] = nibble_or(_mm512_srli_epi16(c, 4), k5_fifth(qh, 2 * pair + 1));
        } else {
          v[k] = _mm512_and_si512(c, nibble);
          v[8 + k] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
        }
      }
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * pair + h;
        const int64_t g = 8 * b + j;
        for (int k = 0; k < 8; ++k) _mm512_storeu_si512(codes + g * 512 + 64 * k, v[8 * h + k]);
        GroupMeta& m = meta[g];
        _mm512_store_si512(m.init[0], minus_128_sums<std::conditional_t<kFifth, Q5_K, Q4_K>>(v + 8 * h, 0, 8));
        const __m512 sc = _mm512_cvtepi32_ps(panel_k4_field(chunk, j, false));
        const __m512 mn = _mm512_cvtepi32_ps(panel_k4_field(chunk, j, true));
        _mm512_store_ps(m.wd[0], _mm512_mul_ps(d, sc));
        _mm512_store_ps(m.wm, _mm512_mul_ps(minus_dmin, mn));
      }
    }
  }
}

// The same out of a Q6_K part in panels: a group's word k is ql word k (runs
// 0 and 2) or k + 8 (runs 1 and 3) with the 2-bit highs of qh word k, less
// the centre, 32; the meta as column_scales and minus_128_sums make it.
inline void decode_panel_column_q6k(const Part& p, int64_t K, int64_t r0, int8_t* codes, GroupMeta* meta) {
  const uint8_t* panel = p.data + r0 * p.row_bytes;
  const __m512i two = _mm512_set1_epi8(3), centre = _mm512_set1_epi8(32);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* chunk = panel + b * kQ6KPanelChunk;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + kQ6KPanelD)));
    for (int j = 0; j < 8; ++j) {  // group j: half j / 4, run j % 4
      const int n = j / 4, run = j % 4;
      const int64_t g = 8 * b + j;
      __m512i v[8];
      for (int k = 0; k < 8; ++k) {
        const __m512i ql = _mm512_loadu_si512(chunk + 64 * (16 * n + k + 8 * (run % 2)));
        const __m512i qh = _mm512_loadu_si512(chunk + kQ6KPanelQh + 64 * (8 * n + k));
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * run), two);
        v[k] = _mm512_sub_epi8(nibble_or(run < 2 ? ql : _mm512_srli_epi16(ql, 4), _mm512_slli_epi16(high, 4)), centre);
        _mm512_storeu_si512(codes + g * 512 + 64 * k, v[k]);
      }
      GroupMeta& m = meta[g];
      _mm512_store_si512(m.init[0], minus_128_sums<Q6_K>(v, 0, 4));
      _mm512_store_si512(m.init[1], minus_128_sums<Q6_K>(v, 4, 8));
      for (int h = 0; h < 2; ++h) {  // sub-blocks 2 j and 2 j + 1: super_scales' d x scale, to the bit
        const uint8_t* scales = chunk + kQ6KPanelScales + 16 * (2 * j + h);
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
        _mm512_store_ps(m.wd[h], _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
      }
    }
  }
}

// The bytes of a Q5_0 / Q5_1 panel's nibble word k (h = 0: its low
// nibbles, inputs 4 k .. 4 k + 3; h = 1: its high ones, 16 + 4 k ..) whose
// fifth bit is set, from the 16 rows' qh words (a vector, lane l: row l's):
// each lane's qh byte 2 h + k / 2 spread over its 4 bytes by one shuffle,
// then byte j tested against bit 4 (k % 2) + j.
inline __mmask64 fifth_bits(__m512i qh, int k, int h) {
  const __m512i lanes = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);  // each dword's first byte
  const __m512i spread = _mm512_shuffle_epi8(qh, _mm512_add_epi8(lanes, _mm512_set1_epi8(char(2 * h + k / 2))));
  return _mm512_test_epi8_mask(spread, _mm512_set1_epi32(int32_t(0x08040201u << (4 * (k % 2)))));
}

// The same out of a Q4_0, Q4_1, Q5_0 or Q5_1 part in panels: a block is a
// group, its word k the low (k < 4) or high nibbles of nibble word k % 4
// (with the Q5 types' fifth bits as 16), less the symmetric types' centre
// (Q::q_avx2's codes); d, and the _1 types' m, one load each.
template <typename Q>
inline void decode_panel_column_legacy(const Part& p, int64_t K, int64_t r0, int8_t* codes, GroupMeta* meta) {
  constexpr int64_t kChunk = kPanelRows * Q::kBytes, kWords = kPanelRows * Q::kQs, kQh = kPanelRows * Q::kHigh;
  const uint8_t* panel = p.data + r0 * p.row_bytes;
  const __m512i nibble = _mm512_set1_epi8(0x0F), centre = _mm512_set1_epi8(char(Q::kCentre));
  const __m512i sixteen = _mm512_set1_epi8(0x10);
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* chunk = panel + g * kChunk;
    __m512i v[8];
    [[maybe_unused]] const __m512i qh = Q::kLevels == 32 ? _mm512_loadu_si512(chunk + kQh) : _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      const __m512i c = _mm512_loadu_si512(chunk + kWords + 64 * k);
      v[k] = _mm512_and_si512(c, nibble);
      v[4 + k] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
      if constexpr (Q::kLevels == 32) {
        v[k] = _mm512_mask_add_epi8(v[k], fifth_bits(qh, k, 0), v[k], sixteen);
        v[4 + k] = _mm512_mask_add_epi8(v[4 + k], fifth_bits(qh, k, 1), v[4 + k], sixteen);
      }
      v[k] = _mm512_sub_epi8(v[k], centre);
      v[4 + k] = _mm512_sub_epi8(v[4 + k], centre);
    }
    for (int k = 0; k < 8; ++k) _mm512_storeu_si512(codes + g * 512 + 64 * k, v[k]);
    GroupMeta& m = meta[g];
    _mm512_store_si512(m.init[0], minus_128_sums<Q>(v, 0, 8));
    _mm512_store_ps(m.wd[0], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk))));
    if (Q::kMin)
      _mm512_store_ps(m.wm, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32))));
  }
}

// T tokens (from m) against C columns (codes and meta `c` columns apart):
// f[t][c] lane l = the sum for token m + t and the column's row l.  With a
// token scale a group (kPer = 1) each group's integer sums take both scales
// into f; with one per kPer groups they take the weight's into p, and f
// takes p times the token's once per kPer groups.
template <bool kSplit, bool kMin, int kPer, int T, int C>
inline void tile(const Tokens& x, int64_t m, const int8_t* codes, const GroupMeta* meta, int64_t groups,
                 __m512 (&out)[T][C], Ahead& ahead, int64_t per_group) {
  constexpr int kHalves = kSplit ? 2 : 1, kSteps = 8 / kHalves;
  const int64_t scales = groups / kPer;
  // f and p here, not in `out`: written through the reference, GCC kept them in memory
  __m512 f[T][C], p[T][C];
  __m512(&sums)[T][C] = kPer == 1 ? f : p;  // what a group's sums go into
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) f[t][c] = p[t][c] = _mm512_setzero_ps();
  const uint8_t* xu = x.codes + m * x.K;
  // One loop over the groups, the token scale's at its last: a loop over
  // scales around one over their 8 groups ran Llama-1B's Q6_K down
  // projection 1.2x slower than this.
  for (int64_t g = 0; g < groups; ++g) {
    ahead.fetch(per_group);
    __m512 xd[T];  // kPer = 1: the token's scale for this group
    for (int t = 0; t < T; ++t) xd[t] = _mm512_set1_ps(kPer == 1 ? x.d[size_t((m + t) * scales + g)] : 1.f);
#pragma GCC unroll 2
    for (int h = 0; h < kHalves; ++h) {
      __m512i acc[T][C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m512i init = _mm512_load_si512(meta[c * groups + g].init[h]);
        for (int t = 0; t < T; ++t) acc[t][c] = init;
      }
#pragma GCC unroll 8
      for (int k = h * kSteps; k < (h + 1) * kSteps; ++k) {
        __m512i w[C];
        for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(codes + (c * groups + g) * 512 + 64 * k);
        for (int t = 0; t < T; ++t) {
          int32_t word;
          std::memcpy(&word, xu + t * x.K + 32 * g + 4 * k, 4);
          const __m512i xb = _mm512_set1_epi32(word);
          for (int c = 0; c < C; ++c) acc[t][c] = _mm512_dpbusd_epi32(acc[t][c], xb, w[c]);
        }
      }
      for (int c = 0; c < C; ++c) {
        const __m512 wd = _mm512_load_ps(meta[c * groups + g].wd[h]);
        for (int t = 0; t < T; ++t) {
          const __m512 scale = kPer == 1 ? _mm512_mul_ps(wd, xd[t]) : wd;
          sums[t][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][c]), scale, sums[t][c]);
        }
      }
    }
    if (kMin)
      for (int t = 0; t < T; ++t) {
        const __m512 s = _mm512_set1_ps(x.sums[size_t((m + t) * groups + g)]);
        for (int c = 0; c < C; ++c)
          sums[t][c] = _mm512_fmadd_ps(_mm512_load_ps(meta[c * groups + g].wm), s, sums[t][c]);
      }
    if (kPer > 1 && (g + 1) % kPer == 0)
      for (int t = 0; t < T; ++t) {
        const __m512 d = _mm512_set1_ps(x.d[size_t((m + t) * scales + g / kPer)]);
        for (int c = 0; c < C; ++c) {
          f[t][c] = _mm512_fmadd_ps(p[t][c], d, f[t][c]);
          p[t][c] = _mm512_setzero_ps();
        }
      }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) out[t][c] = f[t][c];
}

// 16 sums (+ bias) into out, the first `live` lanes.
inline void store16(float* out, __m512 v, __mmask16 live) { _mm512_mask_storeu_ps(out, live, v); }
inline void store16(bf16_t* out, __m512 v, __mmask16 live) {
  const __m512i high = _mm512_srli_epi32(vec::round_to_bf16_high(v), 16);
  _mm256_mask_storeu_epi16(out, live, _mm512_cvtepi32_epi16(high));
}

// Tokens [m, m + T) against the strip's columns [c0, c0 + C), into out
// (row `at` of the output is the strip's row 0).
template <typename Q, int kPer, int T, int C, typename TOut>
inline void tile_out(const Tokens& x, int64_t m, const Decoded& s, int64_t c0, int64_t rows, int64_t groups,
                     const float* bias, int64_t at, TOut* out, int64_t N, Ahead& ahead, int64_t per_group) {
  __m512 f[T][C];
  tile<Q::kSplit, Q::kMin, kPer, T, C>(x, m, s.codes.get() + c0 * groups * 512, s.meta.get() + c0 * groups, groups, f,
                                 ahead, per_group);
  for (int c = 0; c < C; ++c) {
    const int64_t r = 16 * (c0 + c), live = std::min<int64_t>(16, rows - r);
    const __mmask16 mask = __mmask16((1u << live) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + at + r) : _mm512_setzero_ps();
    for (int t = 0; t < T; ++t) store16(out + (m + t) * N + at + r, _mm512_add_ps(f[t][c], b), mask);
  }
}

// This form as quant_strip_run.h's driver takes it.
struct Form {
  static constexpr int64_t kRows = 16;
  static constexpr int kTileTokens = vnni::kTileTokens, kTileColumns = vnni::kTileColumns;
  static constexpr bool kUnsignedTokens = true;
  using Decoded = vnni::Decoded;
  static int64_t columns_for(int64_t K) { return vnni::columns_for(K); }
  template <typename Q>
  static void decode_column(const Part& p, int64_t K, int64_t r0, int64_t rows, int8_t* codes, GroupMeta* meta) {
    if constexpr (std::is_same_v<Q, Q4_K> || std::is_same_v<Q, Q5_K>) {
      if (p.panels) return decode_panel_column<std::is_same_v<Q, Q5_K>>(p, K, r0, codes, meta);
    } else if constexpr (std::is_same_v<Q, Q6_K>) {
      if (p.panels) return decode_panel_column_q6k(p, K, r0, codes, meta);
    } else if constexpr (std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1> || std::is_same_v<Q, Q5_0> ||
                         std::is_same_v<Q, Q5_1>) {
      if (p.panels) return decode_panel_column_legacy<Q>(p, K, r0, codes, meta);
    }
    vnni::decode_column<Q>(p, K, r0, rows, codes, meta);
  }
  template <typename Q, int kPer, int T, int C, typename TOut>
  static void tile_out(const Tokens& x, int64_t m, const Decoded& s, int64_t c0, int64_t rows, int64_t groups,
                       const float* bias, int64_t at, TOut* out, int64_t N, Ahead& ahead, int64_t per_group) {
    vnni::tile_out<Q, kPer, T, C>(x, m, s, c0, rows, groups, bias, at, out, N, ahead, per_group);
  }
};

// y = x W^T (+ bias) for M tokens: each strip decoded once, then every token.
template <typename TX, typename TOut>
inline void run(const Blob& blob, const TX* x, int64_t M, const float* bias, TOut* out) {
  run_strips<Form>(blob, x, M, bias, out);
}

}  // namespace vnni
}  // namespace quant
}  // namespace pagedserve

#endif  // PAGEDSERVE_QUANT_VNNI
