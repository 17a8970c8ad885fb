// The tile loop of one work item (see attention.h for the pieces it uses).
#pragma once

#include <cstring>
#include <type_traits>

#include "attention_amx.h"

namespace pagedserve {

// One work item: for each of kv.heads kv heads, `rows` query rows (already in
// Scratch::q, head-major) that read it.
template <typename T>
struct Work {
  KvView<T> kv;
  int rows;                // query rows per kv head
  const int64_t* visible;  // tokens row r sees; non-decreasing in r, same for every head
  float scale2;            // softmax scale * log2(e)
  // The optional features (attention.h, score_row_features):
  const int64_t* lo = nullptr;  // sliding window: row r sees tokens [lo[r], visible[r]);
                                // lo non-decreasing in r too.  nullptr: no window
  float cap_scale = 0.0f, cap2 = 0.0f;  // soft cap: scale / c and c * log2(e); 0: none
  bool full = false;  // non-causal (an encoder's rows): every row sees every token
  bool amx = false;   // full rows' Q.K and P.V on AMX tiles: this thread holds them (prefill.h)
};

// One tile of the loop: tokens [t0, t0 + n), which rows [first, last) see
// some of (rows before `first` ended, rows from `last` on start their
// window later), and `begin`: tokens before it no row of the tile sees, so
// their K and V are never read (only a window's first tile has any).
struct Tile {
  int n;
  int64_t t0;
  int first, last, begin;
};

#ifdef PAGEDSERVE_HAS_DPBF16
// Q.K of an encoder's rows (Work::full), on the dpbf16 build: the tile's K
// as pairs of inputs, 16 tokens a vector, so Q.K is the packed linear's
// product (linear_packed.h) with the tokens as its output features:
//
//   kt[p * kTile + t] = (k[t][2p], k[t][2p + 1])     one 32-bit word
//   lane t of scores += q[2p] * k[t][2p] + q[2p + 1] * k[t][2p + 1]
//
// Each K vector serves four rows, and the scores leave in token lanes with
// no horizontal sums (dot8's reduce8 and its stores were a third of a BERT
// prefill call's samples). Its sums run in another order than dot8's, so
// only rows that never meet another path take it: an encoder's are never
// chunked, cached or decoded.
//
// The packing is a transpose of 32-bit words, 16 tokens by 16 pairs at a
// time (vec::transpose16): word by word it was ~1,000 scalar moves a tile.
inline void pack_k_pairs(const bf16_t* const* k, int head_dim, uint32_t* kt) {
  static_assert(kTile % 16 == 0, "whole 16-token blocks");
  for (int t0 = 0; t0 < kTile; t0 += 16)  // tokens past the tile's end read the zero row
    for (int p0 = 0; p0 < head_dim / 2; p0 += 16) {
      __m512i words[16];
      for (int i = 0; i < 16; ++i) words[i] = _mm512_loadu_si512(k[t0 + i] + 2 * p0);
      vec::transpose16(words);  // words[p]: pair p0 + p of the 16 tokens
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(&kt[(p0 + p) * kTile + t0], words[p]);
    }
}

// Scores of R rows (q: R rows of head_dim) over the tile: log2 domain,
// tokens from n on -inf.
template <int R>
inline void full_scores(const bf16_t* q, const uint32_t* kt, int head_dim, int n, float scale2,
                        float* s, int64_t stride = kTile) {
  static_assert(kTile == 2 * vec::W, "a tile is two vectors of tokens");
  vec::F acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vec::zero();
  for (int p = 0; p < head_dim / 2; ++p) {
    const auto* pair = reinterpret_cast<const bf16_t*>(kt + p * kTile);
    const vec::BH k0 = vec::load_bf16(pair), k1 = vec::load_bf16(pair + kTile);
    for (int r = 0; r < R; ++r) {
      const vec::BH qp = vec::broadcast_pair(q + r * head_dim + 2 * p);
      acc[r][0] = vec::dot_acc(acc[r][0], qp, k0);
      acc[r][1] = vec::dot_acc(acc[r][1], qp, k1);
    }
  }
  const vec::F scale = vec::set1(scale2);
  for (int r = 0; r < R; ++r) {
    vec::store(s + r * stride, vec::mul(acc[r][0], scale));
    vec::store(s + r * stride + vec::W, vec::mul(acc[r][1], scale));
    for (int i = n; i < kTile; ++i) s[r * stride + i] = kNegInf;
  }
}

// P.V of R encoder rows (Work::full) over V's tile packed as AMX reads it
// (pack_v_pairs: a 32-bit word holds one element of two tokens, the even
// elements' words, then the odd ones', 32 elements a block), so each
// dot_acc adds two tokens' products for 16 elements: the weights rounded
// to bf16, as amx_pv rounds them (and torch's flash attention for its bf16
// P.V), the sums in fp32 in the rows' accumulators.  Half the multiplies of
// pv_rows' fp32 FMAs over a converted V, and no conversion (those were a
// BERT batch's attention's largest part on a CPU without AMX).
template <int R>
inline void full_pv(const float* p, const bf16_t* vt, float* acc, int head_dim, int64_t stride = kTile) {
  alignas(64) bf16_t weights[R][kTile];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kTile; i += vec::W) vec::store_bf16(&weights[r][i], vec::load(p + r * stride + i));
  for (int b = 0; b < head_dim / kPair; ++b) {
    vec::F even[R], odd[R];
    for (int r = 0; r < R; ++r) vec::load_pair(acc + r * head_dim + b * kPair, even[r], odd[r]);
    for (int pair = 0; pair < kTile / 2; ++pair) {
      const vec::BH ve = vec::load_bf16(vt + (kTile / 2 * (2 * b) + pair) * kPair);
      const vec::BH vo = vec::load_bf16(vt + (kTile / 2 * (2 * b + 1) + pair) * kPair);
      for (int r = 0; r < R; ++r) {
        const vec::BH w = vec::broadcast_pair(&weights[r][2 * pair]);
        even[r] = vec::dot_acc(even[r], w, ve);
        odd[r] = vec::dot_acc(odd[r], w, vo);
      }
    }
    for (int r = 0; r < R; ++r) vec::store_pair(acc + r * head_dim + b * kPair, even[r], odd[r]);
  }
}

// Rows [first, last) of one head: K packed once, then 32 or 16 rows at a
// time on AMX where the thread holds its tiles, four rows at a time else.
template <typename T, typename QT>
void full_tile_scores(Scratch<T, QT>& s, size_t base, const bf16_t* const* k, const Tile& t,
                      int head_dim, float scale2, bool amx) {
  auto* kt = reinterpret_cast<uint32_t*>(s.kf.data());  // a tile of fp32 rows holds a tile of pairs
  pack_k_pairs(k, head_dim, kt);
  int r = t.first;
#if defined(PAGEDSERVE_HAS_AMX)
  if (amx) {
    for (; r + 2 * amx::kTile <= t.last; r += 2 * amx::kTile)
      amx_scores<2>(&s.q[(base + r) * head_dim], kt, head_dim, t.n, scale2, &s.scores[(base + r) * kTile]);
    for (; r + amx::kTile <= t.last; r += amx::kTile)
      amx_scores<1>(&s.q[(base + r) * head_dim], kt, head_dim, t.n, scale2, &s.scores[(base + r) * kTile]);
  }
#else
  (void)amx;
#endif
  for (; r + 4 <= t.last; r += 4)
    full_scores<4>(&s.q[(base + r) * head_dim], kt, head_dim, t.n, scale2, &s.scores[(base + r) * kTile]);
  for (; r < t.last; ++r)
    full_scores<1>(&s.q[(base + r) * head_dim], kt, head_dim, t.n, scale2, &s.scores[(base + r) * kTile]);
}
#endif

// Q.K of an encoder's rows in fp32 (float32 models; bf16 ones where the build
// has no bf16 dot product, their K tile converted to fp32 first): the tile's
// K transposed once, kt[d * kTile + t] = k[t][d], so a row's scores take one
// FMA per element and W tokens, finished in token lanes.  dot8 sums W
// elements of one token a vector and ends every 8 tokens in horizontal sums
// (reduce8), which at head_dim 64 cost more than the multiplies: dot8 was
// the largest part of a float32 BERT batch's attention.  The sums run in
// another order than dot8's, so only rows that meet no other path take it,
// as full_scores: an encoder's.  q and K share their layout (natural for a
// float32 cache, convert_row's where bf16 was converted), so the dot is the same.
// AVX-512 builds only: on AVX2 a transpose element by element cost what the
// horizontal sums saved (a float32 BERT call's attention 1,355 -> 1,331-1,369
// ms, docs/performance.md), so AVX2 keeps dot8.
#if defined(__AVX512F__)
constexpr bool kEncoderDotsF32 = true;
inline void transpose_k(const float* const* k, int head_dim, float* kt) {
  for (int t0 = 0; t0 < kTile; t0 += 16)  // tokens past the tile's end read the zero row
    for (int d0 = 0; d0 < head_dim; d0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(k[t0 + i] + d0);
      vec::transpose16(r);  // r[d]: element d0 + d of the 16 tokens
      for (int d = 0; d < 16; ++d) _mm512_storeu_si512(kt + (d0 + d) * kTile + t0, r[d]);
    }
}
#else
constexpr bool kEncoderDotsF32 = false;
inline void transpose_k(const float* const*, int, float*) {}
#endif

// Raw dots of R rows (q: R rows of head_dim) with the transposed tile.
template <int R>
inline void full_dots_f32(const float* q, const float* kt, int head_dim, float* s) {
  constexpr int V = kTile / vec::W;  // vectors of tokens a tile: 2 (AVX-512), 4 (AVX2)
  vec::F acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vec::zero();
  for (int d = 0; d < head_dim; ++d) {
    vec::F kv[V];
    for (int v = 0; v < V; ++v) kv[v] = vec::load(kt + d * kTile + v * vec::W);
    for (int r = 0; r < R; ++r) {
      const vec::F qd = vec::set1(q[r * head_dim + d]);
      for (int v = 0; v < V; ++v) acc[r][v] = vec::fma(qd, kv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) vec::store(s + r * kTile + v * vec::W, acc[r][v]);
}

// Rows [first, last) of one head: K transposed once, then kRows rows at a time.
template <typename T>
void full_tile_dots_f32(Scratch<T, float>& s, size_t base, const float* const* k, const Tile& t,
                        int head_dim) {
  constexpr int kRows = 6;  // 6 x 2 accumulators of 32 registers
  float* kt = s.kt.data();
  transpose_k(k, head_dim, kt);
  int r = t.first;
  for (; r + kRows <= t.last; r += kRows)
    full_dots_f32<kRows>(&s.q[(base + r) * head_dim], kt, head_dim, &s.scores[(base + r) * kTile]);
  for (; r < t.last; ++r)
    full_dots_f32<1>(&s.q[(base + r) * head_dim], kt, head_dim, &s.scores[(base + r) * kTile]);
}

// Q.K, softmax and P.V of rows [first, rows) of one head over a tile of n tokens.
// KT / VT: what Q.K and P.V read, the raw cache rows or their fp32 copies;
// either way the arithmetic is the same, only where the conversion happens moves.
// Rows that see nothing of the tile are skipped (a row's first tile with a
// window is the one holding lo[r]), so the softmax never meets an all -inf row.
// ks / vs: an int8 cache's per-token K and V scales (nullptr otherwise):
// folded into the scores before the softmax and into the weights after it;
// its query rows' own scales (Scratch::q_scale) join the softmax scale.
// int8 query codes (QT, the VNNI build) come with their dots in
// Scratch::scores already (q8_tile_dots) and no k.
template <typename T, typename QT, typename KT, typename VT>
void tile_step(Scratch<T, QT>& s, const Work<T>& w, int head, const KT* const* k,
               const VT* const* v, const Tile& t, const float* ks = nullptr, const float* vs = nullptr) {
  const int head_dim = w.kv.head_dim;
  const size_t base = size_t(head) * w.rows;
  auto n_for = [&](int r) { return int(std::min<int64_t>(t.n, w.visible[r] - t.t0)); };
  bool scored = false;  // by full_tile_scores, for every row at once
  bool dotted = false;  // raw dots by full_tile_dots_f32, for every row at once
#ifdef PAGEDSERVE_HAS_DPBF16
  if constexpr (std::is_same_v<QT, bf16_t> && std::is_same_v<KT, bf16_t>) {
    if (w.full && w.lo == nullptr && w.cap2 == 0.0f && ks == nullptr && s.kf.data() != nullptr) {
      full_tile_scores(s, base, k, t, head_dim, w.scale2, w.amx);
      scored = true;
    }
  }
#endif
  if constexpr (kEncoderDotsF32 && std::is_same_v<QT, float> && std::is_same_v<KT, float>) {
    if (w.full && w.lo == nullptr && ks == nullptr) {  // head_dim: a multiple of the pair, 32
      full_tile_dots_f32(s, base, k, t, head_dim);
      dotted = true;
    }
  }
  for (int r = t.first; r < t.last; ++r) {
    float* scores = &s.scores[(base + r) * kTile];
    if (!scored) {
      float qs = 1.0f;  // the query row's scale: an int8 cache's codes
      if constexpr (is_q8<T>) qs = s.q_scale[base + r];
      const int lo = w.lo ? int(std::max<int64_t>(0, w.lo[r] - t.t0)) : 0;
      if constexpr (!std::is_same_v<QT, int8_t>)
        if (!dotted) dot_row(&s.q[(base + r) * head_dim], k, lo, n_for(r), head_dim, scores);
      finish_scores(scores, lo, n_for(r), w.scale2 * qs, w.cap_scale * qs, w.cap2, ks);
    }
    softmax_row(scores, s.part_m[base + r], s.part_l[base + r], &s.part_acc[(base + r) * head_dim],
                head_dim);
    if (vs != nullptr)  // the sum above took the weights as they are; P.V takes them times V's scales
      for (int i = 0; i < kTile; i += vec::W)
        vec::store(scores + i, vec::mul(vec::load(scores + i), vec::load(vs + i)));
  }
  int r = t.first;
#if defined(PAGEDSERVE_HAS_AMX)
  if constexpr (std::is_same_v<QT, bf16_t> && std::is_same_v<VT, bf16_t>) {
    if (w.full && vs == nullptr && s.vf.data() != nullptr) {  // an encoder's rows: V packed once
      auto* vt = reinterpret_cast<bf16_t*>(s.vf.data());  // a tile of fp32 rows holds its pairs
      pack_v_pairs(v, head_dim, vt);
      if (w.amx)  // whole 16-row blocks on AMX
        for (; r + amx::kTile <= t.last; r += amx::kTile)
          amx_pv(&s.scores[(base + r) * kTile], vt, &s.part_acc[(base + r) * head_dim], head_dim);
      for (; r + 4 <= t.last; r += 4)
        full_pv<4>(&s.scores[(base + r) * kTile], vt, &s.part_acc[(base + r) * head_dim], head_dim);
      for (; r < t.last; ++r)
        full_pv<1>(&s.scores[(base + r) * kTile], vt, &s.part_acc[(base + r) * head_dim], head_dim);
      return;
    }
  }
#endif
  pv_tile(&s.scores[base * kTile], v, r, t.last, n_for, &s.part_acc[base * head_dim], head_dim, s.ahead);
}

// An int8 row's codes, unscaled, as fp32 in L's loader layout.
template <typename L>
inline void convert_codes(const q8_t<L>* src, float* dst, int head_dim) {
  convert_row(src, dst, head_dim);
}

// An int8 cache's query row (kernels/kv_quant.py, quantize_query): its codes
// of one fp32 scale, absmax / 127, rounded half to even (the default
// rounding mode) after a true division, as torch rounds them; the scale is
// returned.  `out` gets what Q.K multiplies: the codes themselves (the VNNI
// build; `scratch` unused) or their fp32 values in L's loader layout (the
// codes first in `scratch`).  A query holding inf or NaN gets zero codes and
// a NaN scale.  (The reference's row then comes out NaN; this op's comes out
// zeros, as it did before these codes were vectorized: a known difference.)
template <typename L, typename T, typename QT>
float prepare_q8_query(const T* q, int head_dim, int8_t* scratch, QT* out) {
  int8_t* const codes = std::is_same_v<QT, int8_t> ? reinterpret_cast<int8_t*>(out) : scratch;
  // max |q| in vectors; x * 0 sums to NaN where some x is inf or NaN, and
  // both make the scale below NaN (no codes), so one sum marks them.
  vec::F top_v = vec::zero(), poison = vec::zero();
  for (int d = 0; d < head_dim; d += kPair) {
    vec::F a, b;
    vec::load_pair(q + d, a, b);
    const vec::F abs_ab = vec::max(vec::max(a, vec::sub(vec::zero(), a)), vec::max(b, vec::sub(vec::zero(), b)));
    top_v = vec::max(top_v, abs_ab);
    poison = vec::add(poison, vec::add(vec::mul(a, vec::zero()), vec::mul(b, vec::zero())));
  }
  const float sum = vec::reduce_add(poison);
  const float top = sum != sum ? std::numeric_limits<float>::quiet_NaN() : vec::reduce_max(top_v);
  float scale = top / 127.0f;
  const bool finite = scale > 0.0f && std::isfinite(scale);
  if (finite)
    vec::codes_of(q, head_dim, scale, codes);
  else
    std::memset(codes, 0, size_t(head_dim));
  if (!finite && scale != 0.0f) scale = std::numeric_limits<float>::quiet_NaN();
  if constexpr (!std::is_same_v<QT, int8_t>)
    convert_codes(reinterpret_cast<const q8_t<L>*>(codes), out, head_dim);
  return scale;
}

// Query row r of an item as Q.K multiplies it (Scratch::q), and for an int8
// cache its scale (Scratch::q_scale) and, for the VNNI build's dot product,
// K's offset's share of every dot (Scratch::q_offset): once a row, not a tile.
template <typename T, typename C, typename QT>
void prepare_row(Scratch<C, QT>& s, size_t r, const T* q, int head_dim) {
  if constexpr (is_q8<C>) {
    s.q_scale[r] = prepare_q8_query<T>(q, head_dim, s.q_codes.data(), &s.q[r * head_dim]);
#ifdef PAGEDSERVE_HAS_VNNI
    if constexpr (std::is_same_v<QT, int8_t>) {
      int32_t sum = 0;
      for (int d = 0; d < head_dim; ++d) sum += s.q[r * head_dim + d];
      s.q_offset[r] = 128 * sum;
    }
#endif
  } else {
    prepare_query(q, head_dim, &s.q[r * head_dim]);
  }
}

#ifdef PAGEDSERVE_HAS_I8_DOTS
// Q.K of an int8 tile in integers, the dots left in Scratch::scores for
// tile_step.  The VNNI build packs K's codes once into token lanes
// (vec::pack_words16, in Scratch::kf), then four query rows at a time take
// the integer dot product against them (vec::dots_i8); the AVX2 build takes
// each row against K's rows as they are, eight tokens at a time
// (vec::dot8_i8).  Rows see tokens in a prefix of the tile, so every lane is
// computed and tile_step masks what a row may not see.
template <typename L>
void q8_tile_dots(Scratch<q8_t<L>, int8_t>& s, const Work<q8_t<L>>& w, size_t base, const int8_t* const* k,
                  const Tile& t) {
  const int head_dim = w.kv.head_dim;
  int r = t.first;
#ifdef PAGEDSERVE_HAS_VNNI
  static_assert(kTile == 2 * vec::W, "a tile is two vectors of tokens");
  auto* kt = reinterpret_cast<uint32_t*>(s.kf.data());  // a tile of fp32 rows holds a tile of words
  vec::pack_words16(k, head_dim, kt, kTile);
  vec::pack_words16(k + vec::W, head_dim, kt + vec::W, kTile);
  for (; r + 4 <= t.last; r += 4)
    vec::dots_i8<4>(&s.q[(base + r) * head_dim], head_dim, &s.q_offset[base + r], kt,
                    &s.scores[(base + r) * kTile]);
  for (; r < t.last; ++r)
    vec::dots_i8<1>(&s.q[(base + r) * head_dim], head_dim, &s.q_offset[base + r], kt,
                    &s.scores[(base + r) * kTile]);
#else
  for (; r < t.last; ++r)
    for (int g = 0; g < kTile; g += 8)
      vec::dot8_i8(&s.q[(base + r) * head_dim], k + g, head_dim, &s.scores[(base + r) * kTile + g]);
#endif
}
#endif

// One head of an int8 tile: K's codes read once for every query row (packed
// into token lanes where the build multiplies int8, else converted to fp32),
// V's read in place by P.V where one block of kRowBlock rows reads them
// (decode) and converted once into Scratch::vf where more do (prefill: else
// each block converts them again; the same fp32 values, so the same sums),
// and every token's two scales set aside for tile_step to fold in.  Tokens
// before t.begin and past the tile's end get zero rows and zero scales.
template <typename L, typename QT>
void run_q8_tile(Scratch<q8_t<L>, QT>& s, const Work<q8_t<L>>& w, int head, const int64_t* slots,
                 const Tile& t) {
  const int head_dim = w.kv.head_dim;
  const int64_t offset = int64_t(head) * w.kv.row;
  const q8_t<L>* kp[kTile];
  const q8_t<L>* vp[kTile];
  alignas(64) float ks[kTile] = {}, vs[kTile] = {};
  for (int i = 0; i < kTile; ++i) kp[i] = vp[i] = s.zero_t.data();
  for (int i = t.begin; i < t.n; ++i) {
    kp[i] = w.kv.k + slots[i] + offset;
    vp[i] = w.kv.v + slots[i] + offset;
    ks[i] = row_scale(kp[i], head_dim);
    vs[i] = row_scale(vp[i], head_dim);
  }
  const float* vf[kTile];
  const bool convert_v = t.last - t.first > kRowBlock;
  if (convert_v)
    for (int i = 0; i < kTile; ++i) {
      vf[i] = &s.vf[size_t(i) * head_dim];
      convert_codes(vp[i], &s.vf[size_t(i) * head_dim], head_dim);
    }
#ifdef PAGEDSERVE_HAS_I8_DOTS
  if constexpr (std::is_same_v<QT, int8_t>) {
    const int8_t* codes[kTile];
    for (int i = 0; i < kTile; ++i) codes[i] = &kp[i]->bits;
    q8_tile_dots(s, w, size_t(head) * w.rows, codes, t);
    if (convert_v)
      return tile_step<q8_t<L>, QT, int8_t, float>(s, w, head, nullptr, vf, t, ks, vs);
    return tile_step<q8_t<L>, QT, int8_t, q8_t<L>>(s, w, head, nullptr, vp, t, ks, vs);
  }
#endif
  float* const scratch = s.kf.data();
  const float* kf[kTile];
  for (int i = 0; i < kTile; ++i) {
    kf[i] = scratch + size_t(i) * head_dim;
    convert_codes(kp[i], scratch + size_t(i) * head_dim, head_dim);
  }
  if (convert_v) return tile_step<q8_t<L>, QT, float, float>(s, w, head, kf, vf, t, ks, vs);
  tile_step<q8_t<L>, QT, float, q8_t<L>>(s, w, head, kf, vp, t, ks, vs);
}

// Where an encoder's P.V reads V's tile packed into pairs of tokens (AMX's
// tiles, or full_pv's dot products where AMX does not take the rows): bf16
// rows on the build with AMX's code (every AVX512-BF16 one), with a tile
// buffer to pack into.
template <typename T, typename QT>
bool encoder_pairs(const Work<T>& w, bool convert) {
#if defined(PAGEDSERVE_HAS_AMX)
  if constexpr (std::is_same_v<T, bf16_t> && std::is_same_v<QT, bf16_t>) return w.full && convert;
#endif
  return w.amx;
}

// One head of one tile.  Picks where K/V get converted to fp32: a few rows
// (decode: one kv head's query heads) convert on the fly as they load; many
// rows (prefill) would convert the same elements again for every block of
// rows, so the tile is converted once into Scratch::kf / vf.  The dpbf16
// path multiplies raw K.  Tokens before t.begin read the zero row instead
// of the cache (their scores are -inf, their weights 0).
template <typename T, typename QT>
void run_plain_tile(Scratch<T, QT>& s, const Work<T>& w, int head, const int64_t* slots, const Tile& t,
              bool convert) {
  const int head_dim = w.kv.head_dim, n = t.n;
  const int64_t offset = int64_t(head) * w.kv.row;
  const T* kp[kTile];
  const T* vp[kTile];
  for (int i = 0; i < t.begin; ++i) kp[i] = vp[i] = s.zero_t.data();
  for (int i = t.begin; i < n; ++i) {
    kp[i] = w.kv.k + slots[i] + offset;
    vp[i] = w.kv.v + slots[i] + offset;
  }
  for (int i = n; i < kTile; ++i) kp[i] = s.zero_t.data();  // Q.K works in groups of 8
  if (encoder_pairs<T, QT>(w, convert)) {  // V's raw rows, packed into pairs by tile_step
    for (int i = n; i < kTile; ++i) vp[i] = s.zero_t.data();
    tile_step<T, QT, T, T>(s, w, head, kp, vp, t);
    return;
  }
  if (!convert) {
    tile_step<T, QT, T, T>(s, w, head, kp, vp, t);
    return;
  }
  const float* vf[kTile];
  for (int i = 0; i < t.begin; ++i) vf[i] = s.zero_f.data();
  for (int i = t.begin; i < n; ++i) {
    vf[i] = &s.vf[size_t(i) * head_dim];
    convert_row(vp[i], &s.vf[size_t(i) * head_dim], head_dim);
  }
  if constexpr (std::is_same_v<QT, float>) {
    const float* kf[kTile];
    for (int i = 0; i < kTile; ++i) kf[i] = s.zero_f.data();
    for (int i = t.begin; i < n; ++i) {
      kf[i] = &s.kf[size_t(i) * head_dim];
      convert_row(kp[i], &s.kf[size_t(i) * head_dim], head_dim);
    }
    tile_step<T, QT, float, float>(s, w, head, kf, vf, t);
  } else {
    tile_step<T, QT, T, float>(s, w, head, kp, vf, t);
  }
}

template <typename T, typename QT>
void run_tile(Scratch<T, QT>& s, const Work<T>& w, int head, const int64_t* slots, const Tile& t,
              bool convert) {
  if constexpr (is_q8<T>) {
    run_q8_tile(s, w, head, slots, t);
  } else {
    run_plain_tile(s, w, head, slots, t, convert);
  }
}

// One kv head's K and V rows of tokens [begin, n) of a tile, every line
// each row touches (the last byte's too: an int8 row's scale may sit on a
// line of its own), into L1.  The Prefetcher brought the tile into L2; a
// head's rows are then read at L2's latency, which the AVX2 build's tile
// loop (eight lanes of work per load) does not hide: on a 2-vCPU Zen 5,
// 16 x 4,096 tokens of Llama-3.2-1B's cache, asking for head h + 1 while
// head h computes took decode attention from 6.2 to 5.5 ms a layer on a
// bf16 cache and 5.4-5.7 to 4.7 on an int8 one; the AVX-512 build, bound by
// the memory already, gained nothing (vec::kPrefetchNextHead).
template <typename T>
inline void prefetch_head_rows(const KvView<T>& kv, const int64_t* slots, int begin, int n, int head) {
  const int64_t offset = int64_t(head) * kv.row, bytes = int64_t(sizeof(T)) * kv.row;
  for (int i = begin; i < n; ++i) {
    const char* k = reinterpret_cast<const char*>(kv.k + slots[i] + offset);
    const char* v = reinterpret_cast<const char*>(kv.v + slots[i] + offset);
    for (int64_t o = 0; o < bytes + 63; o += 64) {
      const int64_t at = std::min(o, bytes - 1);
      prefetch_l1(k + at);
      prefetch_l1(v + at);
    }
  }
}

// Tokens [begin, end) of the item's kv heads; the result is left, folded over
// partitions, in Scratch::tot_*.  `begin` is a multiple of kTile (with a
// window, the tile of the first row's first token; else 0 or a multiple of
// kPartition), so every tile starts at the same multiple of kTile however
// the work was cut.
#if defined(PAGEDSERVE_HAS_AMX)
// The item's one kv head's K and V rows of tokens [t0, t0 + n); the rest of
// a tile reads the zero row.
template <typename T, typename QT>
void whole_tile_rows(const Scratch<T, QT>& s, const Work<T>& w, int64_t t0, int n, const T** kp,
                     const T** vp) {
  int64_t slots[kTile];
  tile_slots(w.kv, t0, n, slots);
  for (int i = 0; i < n; ++i) {
    kp[i] = w.kv.k + slots[i];
    vp[i] = w.kv.v + slots[i];
  }
  for (int i = n; i < kTile; ++i) kp[i] = vp[i] = s.zero_t.data();
}

// An encoder's rows without the online softmax.  Every row of an encoder's
// item sees all `end` tokens of its sequence, so where they fit a partition
// (BERT's 512 positions do) the item scores whole rows first, Q.K tile by
// tile into `wide` (rows x end, padded to whole tiles), takes each row's max
// and sum once, then runs P.V tile by tile.  The online softmax paid a max
// and a sum across the lanes, and a rescale of the accumulator whenever the
// max grew, per row and 32-token tile: ~60 % of tile_step's samples in a
// BERT batch.  Q.K and P.V are the tile loop's own (full_scores, full_pv:
// the weights rounded to bf16 as there); only the exponentials' reference
// point moves, from the max so far to the row's max.  Rows on AMX tiles
// (w.amx) keep the tile loop.  False, and nothing done, where the rows
// do not qualify.
template <typename T, typename QT>
bool attend_whole(Scratch<T, QT>& s, const Work<T>& w, int64_t end, bool convert, std::vector<float>& wide) {
  if constexpr (!std::is_same_v<T, bf16_t> || !std::is_same_v<QT, bf16_t>) {
    return false;
  } else {
    if (!w.full || w.amx || !convert || w.kv.heads != 1 || w.lo != nullptr || w.cap2 != 0.0f ||
        end > kPartition)
      return false;
    const int head_dim = w.kv.head_dim, rows = w.rows;
    const int64_t stride = (end + kTile - 1) / kTile * kTile;
    if (wide.size() < size_t(rows) * size_t(stride)) wide.resize(size_t(rows) * size_t(stride));
    reset_rows(s.tot_m.data(), s.tot_l.data(), s.tot_acc.data(), rows, head_dim);
    auto* kt = reinterpret_cast<uint32_t*>(s.kf.data());  // a tile of fp32 rows holds a tile of pairs
    auto* vt = reinterpret_cast<bf16_t*>(s.vf.data());
    const T* kp[kTile];
    const T* vp[kTile];
    const T* next_k[kTile];
    const T* next_v[kTile];
    const int64_t bytes = int64_t(sizeof(T)) * head_dim;
    for (int64_t t0 = 0; t0 < end; t0 += kTile) {  // Q.K; the next tile's K and V asked into L2
      const int n = int(std::min<int64_t>(kTile, end - t0));
      whole_tile_rows(s, w, t0, n, kp, vp);
      if (t0 + kTile < end) {
        const int next_n = int(std::min<int64_t>(kTile, end - t0 - kTile));
        whole_tile_rows(s, w, t0 + kTile, next_n, next_k, next_v);
        for (int i = 0; i < next_n; ++i)
          for (int64_t o = 0; o < bytes; o += 64) {
            prefetch_l2(reinterpret_cast<const char*>(next_k[i]) + o);
            prefetch_l2(reinterpret_cast<const char*>(next_v[i]) + o);
          }
      }
      pack_k_pairs(kp, head_dim, kt);
      float* scores = wide.data() + t0;
      int r = 0;
      for (; r + 4 <= rows; r += 4)
        full_scores<4>(&s.q[size_t(r) * head_dim], kt, head_dim, n, w.scale2, scores + r * stride, stride);
      for (; r < rows; ++r)
        full_scores<1>(&s.q[size_t(r) * head_dim], kt, head_dim, n, w.scale2, scores + r * stride, stride);
    }
    for (int r = 0; r < rows; ++r) {  // each row's max and sum, its weights in place
      float* row = wide.data() + r * stride;
      vec::F top = vec::load(row);
      for (int64_t i = vec::W; i < stride; i += vec::W) top = vec::max(top, vec::load(row + i));
      s.tot_m[r] = vec::reduce_max(top);
      const vec::F shift = vec::set1(s.tot_m[r]);
      vec::F sum = vec::zero();
      for (int64_t i = 0; i < stride; i += vec::W) {
        const vec::F p = vec::exp2(vec::sub(vec::load(row + i), shift));
        vec::store(row + i, p);
        sum = vec::add(sum, p);
      }
      s.tot_l[r] = vec::reduce_add(sum);
    }
    for (int64_t t0 = 0; t0 < end; t0 += kTile) {  // P.V
      whole_tile_rows(s, w, t0, int(std::min<int64_t>(kTile, end - t0)), kp, vp);
      pack_v_pairs(vp, head_dim, vt);
      const float* weights = wide.data() + t0;
      int r = 0;
      for (; r + 4 <= rows; r += 4)
        full_pv<4>(weights + r * stride, vt, &s.tot_acc[size_t(r) * head_dim], head_dim, stride);
      for (; r < rows; ++r)
        full_pv<1>(weights + r * stride, vt, &s.tot_acc[size_t(r) * head_dim], head_dim, stride);
    }
    return true;
  }
}
#endif

template <typename T, typename QT>
void attend(Scratch<T, QT>& s, const Work<T>& w, int64_t begin, int64_t end, bool convert) {
  const int head_dim = w.kv.head_dim, all_rows = w.kv.heads * w.rows;
  reset_rows(s.tot_m.data(), s.tot_l.data(), s.tot_acc.data(), all_rows, head_dim);
  reset_rows(s.part_m.data(), s.part_l.data(), s.part_acc.data(), all_rows, head_dim);
  if (begin >= end) return;
  int cur = 0;
  Tile t{0, begin, 0, w.lo ? 0 : w.rows, 0};
  tile_slots(w.kv, begin, int(std::min<int64_t>(kTile, end - begin)), s.slots[0]);
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    t.n = int(std::min<int64_t>(kTile, end - t0));
    t.t0 = t0;
    const int64_t next = t0 + kTile;
    const int n_next = next < end ? int(std::min<int64_t>(kTile, end - next)) : 0;
    tile_slots(w.kv, next, n_next, s.slots[cur ^ 1]);
    s.ahead.reset(w.kv, s.slots[cur ^ 1], n_next);
    while (w.visible[t.first] <= t0) ++t.first;  // rows that end before this tile are done
    if (w.lo) {  // rows whose window starts in this tile join; lo[first] is the least
      while (t.last < w.rows && w.lo[t.last] < t0 + t.n) ++t.last;
      t.begin = int(std::max<int64_t>(0, w.lo[t.first] - t0));
    }
    for (int head = 0; head < w.kv.heads; ++head) {
      if (vec::kPrefetchNextHead && head + 1 < w.kv.heads)
        prefetch_head_rows(w.kv, s.slots[cur], t.begin, t.n, head + 1);
      run_tile(s, w, head, s.slots[cur], t, convert);
    }
    s.ahead.finish();
    if (next % kPartition == 0 || next >= end) fold_partition(s, all_rows, head_dim);
    cur ^= 1;
  }
}

}  // namespace pagedserve
