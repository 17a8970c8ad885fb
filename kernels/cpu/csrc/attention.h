// Paged attention for one work item: some query rows that share one kv head.
//
// A row is one (query token, query head) pair.  Decode has `group` rows (the
// query heads of one kv head) that all see the whole context; a prefill work
// item has the rows of several consecutive query tokens, each seeing one more
// token than the one before (causal).  Every row walks the context in tiles
// of kTile tokens, reading K and V straight from their cache blocks:
//
//   block_table  [ 7 | 2 | 5 ]         block_size 16, kTile 32
//   tokens       0 ........ 31 | 32 ... 47
//   tile 0       block 7 rows 0-15, block 2 rows 0-15
//   tile 1       block 5 rows 0-15
//   per tile:  S = Q.K^T (scaled, log2 domain) -> online softmax -> acc += P.V
//
// Results never depend on how the work was cut:
//   * tiles start at multiples of kTile, whatever the block size;
//   * every kPartition tokens the running (max, sum, acc) of a row is folded
//     into a total and restarted, the same fold the split-KV reduction does,
//     so splitting a long context across threads changes no bit;
//   * a prefill row at position p does exactly what a decode row with
//     context p + 1 does (masked scores are -inf, their weights exactly 0).
// So chunked prefill, prefix-cache hits and batch composition all give the
// same outputs for the same tokens.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#include "vec.h"

namespace pagedserve {

constexpr int kTile = 32;         // context tokens per online-softmax step
constexpr int kPartition = 512;   // tokens per split-KV partition (a multiple of kTile)
constexpr int kPair = 2 * vec::W; // head_dim must be a multiple of this
constexpr int kRowBlock = 4;      // query rows sharing one pass over V
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Kv heads [head0, head0 + heads) of one sequence in a paged layer
// [num_blocks, block_size, kv_heads, head_dim].  One token's heads sit side
// by side, so a tile read for all of them streams through whole blocks:
//
//   block 7:  token 0 [h0 h1 h2] token 1 [h0 h1 h2] ... token 15 [h0 h1 h2]
//             <- slot_stride ->
//
// A head's row is head_dim elements, or in an int8 cache (q8_t) head_dim
// codes and the row's 2-byte scale: `row` elements apart.
template <typename T>
struct KvView {
  const T* k;
  const T* v;
  const int32_t* table;  // this sequence's block table row
  int64_t block_size;
  int64_t slot_stride;   // kv_heads * row
  int head0, heads, head_dim, row;
};

// Elements one (token, kv head) row of a cache of type C takes.
template <typename C>
constexpr int row_elements(int head_dim) {
  return is_q8<C> ? head_dim + kQ8ScaleBytes : head_dim;
}

// The next tile's K and V, fetched a cache line at a time while this tile
// computes.  Its blocks sit where no hardware prefetcher can guess, and a
// burst of a few hundred prefetches fills the core's miss queue and stalls
// it; so P.V issues two per token it reads (as many lines as a tile of one
// row block holds: head_dim / 16 per token and kv head) and the tile's end
// issues whatever is left.  On a 2-core EPYC, 128 sequences x ~320 tokens
// of SmolLM2 K/V: 9.7 GB/s with no prefetch, 17.5 with this.
struct Prefetcher {
  const char* rows[2 * kTile];  // each token's K run, then its V run

  // Where fetching has got to: the runs, their length, the run being fetched
  // and the next line in it.  P.V copies it into locals (cursor()) and hands
  // it back after (resume()): stepped through a reference, its fields went to
  // memory and back around every prefetch, a sixth of P.V's samples on
  // cache-warm rows.
  struct Cursor {
    const char* const* rows;
    int64_t bytes, offset;
    int count, next;
    inline void step() {
      if (next == count) return;
      prefetch_l2(rows[next] + offset);
      offset += 64;
      if (offset >= bytes) {
        offset = 0;
        ++next;
      }
    }
  };
  Cursor at{rows, 0, 0, 0, 0};

  template <typename T>
  void reset(const KvView<T>& kv, const int64_t* slots, int n) {
    for (int i = 0; i < n; ++i) {
      rows[2 * i] = reinterpret_cast<const char*>(kv.k + slots[i]);
      rows[2 * i + 1] = reinterpret_cast<const char*>(kv.v + slots[i]);
    }
    at = Cursor{rows, int64_t(sizeof(T)) * kv.heads * kv.row, 0, 2 * n, 0};
  }
  Cursor cursor() const { return at; }
  void resume(const Cursor& c) { at = c; }
  void finish() {
    while (at.next < at.count) at.step();
  }
};

// Scratch memory that is written before it is read, so never zeroed.
template <typename T>
struct Buffer {
  explicit Buffer(size_t n) : data_(n ? new T[n] : nullptr) {}
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
};

// Per-thread buffers, sized once per op call.  T is the cache type, QT what
// Q.K multiplies: float (queries converted) or T itself (dpbf16 path).
// Rows are numbered head-major: row = head * rows_per_head + r.  Nothing is
// zeroed but the zero rows, and kf / vf exist only where tiles are converted
// (`convert`): between two layers' weight streams these lines are cold, and
// zero-filling the 25 KB cost a one-stream SmolLM2 decode call ~3 us of its
// ~35 on AVX2.
template <typename T, typename QT>
struct Scratch {
  Scratch(int max_rows, int head_dim, bool convert)
      : q(size_t(max_rows) * head_dim), kf(convert ? size_t(kTile) * head_dim : 0),
        kt(std::is_same_v<QT, float> && vec::W == 16 ? size_t(kTile) * head_dim : 0),
        vf(convert ? size_t(kTile) * head_dim : 0), scores(size_t(max_rows) * kTile), part_m(max_rows),
        part_l(max_rows), part_acc(size_t(max_rows) * head_dim), tot_m(max_rows), tot_l(max_rows),
        tot_acc(size_t(max_rows) * head_dim), zero_f(head_dim, 0.0f), zero_t(row_elements<T>(head_dim), T{}),
        visible(max_rows), lo(max_rows), q_scale(is_q8<T> ? max_rows : 0),
        q_offset(std::is_same_v<QT, int8_t> ? max_rows : 0),
        q_codes(is_q8<T> && !std::is_same_v<QT, int8_t> ? head_dim : 0) {}
  Buffer<QT> q;                      // rows x head_dim, loader layout when QT is float
  Buffer<float> kf, vf;              // one head's tile of K / V converted to fp32
  Buffer<float> kt;                  // an encoder's fp32 K tile transposed (attention_tile.h)
  Buffer<float> scores;              // rows x kTile: scores, then weights
  Buffer<float> part_m, part_l, part_acc;  // running state in this partition
  Buffer<float> tot_m, tot_l, tot_acc;     // folded over partitions
  std::vector<float> zero_f;         // a zero row: pads the last group of 8 tokens
  std::vector<T> zero_t;
  Buffer<int64_t> visible;           // per row of a head: context tokens it may see
  Buffer<int64_t> lo;                // per row of a head: its sliding window's first token
  Buffer<float> q_scale;             // an int8 cache's: per row, the scale of its query's codes
  Buffer<int32_t> q_offset;          // the VNNI build's: per row, 128 x its codes' sum (vec::dots_i8)
  Buffer<int8_t> q_codes;            // an int8 cache's where Q.K multiplies floats: one query row's codes
  int64_t slots[2][kTile];           // element offsets of this tile's and the next tile's tokens
  Prefetcher ahead;                  // the next tile's lines, issued during P.V
};

// Element offset of each token's first head, tokens t0 .. t0 + n - 1.
template <typename T>
void tile_slots(const KvView<T>& kv, int64_t t0, int n, int64_t* out) {
  int64_t block = t0 / kv.block_size, row = t0 % kv.block_size;
  const int64_t head = int64_t(kv.head0) * kv.row;
  for (int i = 0; i < n; ++i) {
    out[i] = (int64_t(kv.table[block]) * kv.block_size + row) * kv.slot_stride + head;
    if (++row == kv.block_size) {
      row = 0;
      ++block;
    }
  }
}

// A quantized cache row as fp32 in the query type L's loader layout (the
// layout the query, the accumulators and the output share).  An int8 row's
// codes come unscaled: its scale is applied to its score (K) and its weight
// (V) instead, one multiply a token rather than one an element.
namespace vec {
template <typename L>
inline void load_pair(const q8_t<L>* p, F& a, F& b) {
  if constexpr (std::is_same_v<L, bf16_t>) {
    load_pair_i8_bf16(&p->bits, a, b);
  } else {
    load_pair_i8(&p->bits, a, b);
  }
}

// An fp8 row's values as fp32 (exact), in L's loader layout.
template <typename L>
inline void load_pair(const e4m3_t<L>* p, F& a, F& b) {
  load_pair_fp8<true>(&p->bits, a, b);
  if constexpr (std::is_same_v<L, bf16_t>) to_bf16_layout(a, b);
}
template <typename L>
inline void load_pair(const e5m2_t<L>* p, F& a, F& b) {
  load_pair_fp8<false>(&p->bits, a, b);
  if constexpr (std::is_same_v<L, bf16_t>) to_bf16_layout(a, b);
}
}  // namespace vec

// Row (raw cache type) -> fp32 in the loader layout.
template <typename T>
inline void convert_row(const T* src, float* dst, int head_dim) {
  for (int d = 0; d < head_dim; d += kPair) {
    vec::F a, b;
    vec::load_pair(src + d, a, b);
    vec::store_pair(dst + d, a, b);
  }
}


// The scale stored after an int8 row's head_dim codes (kernels/kv_quant.py).
template <typename L>
inline float row_scale(const q8_t<L>* row, int head_dim) {
  uint16_t bits;
  std::memcpy(&bits, &row[head_dim].bits, sizeof(bits));
  return fp16_to_float(bits);
}

// Eight dot products q . k[t]; fp32 accumulation in the loader layout.
template <typename KT>
inline void dot8(const float* q, const KT* const* k, int head_dim, float* out) {
  vec::F acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = vec::zero();
  for (int d = 0; d < head_dim; d += kPair) {
    vec::F qa, qb;
    vec::load_pair(q + d, qa, qb);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      vec::F ka, kb;
      vec::load_pair(k[t] + d, ka, kb);
      acc[t] = vec::fma(qa, ka, acc[t]);
      acc[t] = vec::fma(qb, kb, acc[t]);
    }
  }
  vec::reduce8(acc, out);
}

#ifdef PAGEDSERVE_HAS_DPBF16
inline void dot8(const bf16_t* q, const bf16_t* const* k, int head_dim, float* out) {
  vec::dot8_bf16(q, k, head_dim, out);
}
#endif

// Q.K of one row over a tile, unscaled: the groups of 8 tokens holding any
// of [lo, visible) (groups wholly before a window's first token `lo` are
// not multiplied at all).
template <typename QT, typename KT>
void dot_row(const QT* q, const KT* const* k, int lo, int visible, int head_dim, float* s) {
  for (int g = lo & ~7; g < visible; g += 8) dot8(q, k + g, head_dim, s + g);
}

// tanh in fp32 for the soft cap: the odd rational minimax approximation of
// degrees 13/6 (Eigen's, also XLA's and MLAS's; kernels/paged_attention.py
// evaluates the same), clamped where tanh rounds to +-1.  Branch-free, about
// 2e-7 absolute error: a tenth of a scalar tanhf's cost.
constexpr float kTanhClamp = 7.90531110763549805f;
constexpr float kTanhNum[7] = {-2.76076847742355e-16f, 2.00018790482477e-13f,
                               -8.60467152213735e-11f, 5.12229709037114e-08f,
                               1.48572235717979e-05f,  6.37261928875436e-04f,
                               4.89352455891786e-03f};  // x^13 .. x^1
constexpr float kTanhDen[4] = {1.19825839466702e-06f, 1.18534705686654e-04f,
                               2.26843463243900e-03f, 4.89352518554385e-03f};  // x^6 .. x^0

inline vec::F tanh_rational(vec::F x) {
  x = vec::max(vec::min(x, vec::set1(kTanhClamp)), vec::set1(-kTanhClamp));
  const vec::F x2 = vec::mul(x, x);
  vec::F p = vec::set1(kTanhNum[0]), q = vec::set1(kTanhDen[0]);
  for (int i = 1; i < 7; ++i) p = vec::fma(p, x2, vec::set1(kTanhNum[i]));
  for (int i = 1; i < 4; ++i) q = vec::fma(q, x2, vec::set1(kTanhDen[i]));
  return vec::div(vec::mul(p, x), q);
}

// A row's dots -> its scores in the log2 domain: times each token's K scale
// (`ks`, an int8 cache's; nullptr for any other), then the softmax scale, or
// with a soft cap c, s = q.k * scale becomes c * tanh(s / c) in fp32
// (cap_scale = scale / c, cap2 = c * log2(e); 0: no cap).  Tokens outside
// [lo, visible) (before a sliding window, past the row's causal position
// or the tile's end) are -inf, whatever their lanes held.
inline void finish_scores(float* s, int lo, int visible, float scale2, float cap_scale, float cap2,
                          const float* ks) {
  if (ks != nullptr)
    for (int i = 0; i < kTile; i += vec::W) vec::store(s + i, vec::mul(vec::load(s + i), vec::load(ks + i)));
  if (cap2 > 0.0f) {
    const vec::F c2 = vec::set1(cap2), cs = vec::set1(cap_scale);
    for (int i = 0; i < kTile; i += vec::W)
      vec::store(s + i, vec::mul(c2, tanh_rational(vec::mul(vec::load(s + i), cs))));
  } else {
    const vec::F scale = vec::set1(scale2);
    for (int i = 0; i < kTile; i += vec::W) vec::store(s + i, vec::mul(vec::load(s + i), scale));
  }
  for (int i = 0; i < lo; ++i) s[i] = kNegInf;
  for (int i = visible; i < kTile; ++i) s[i] = kNegInf;
}

// Online softmax over one tile: scores -> weights, running max / sum updated
// and the accumulator rescaled when the max moved.
inline void softmax_row(float* s, float& m, float& l, float* acc, int head_dim) {
  vec::F top = vec::load(s);
  for (int i = vec::W; i < kTile; i += vec::W) top = vec::max(top, vec::load(s + i));
  float m_new = std::max(m, vec::reduce_max(top));
  // 0 at a partition's first tile (m = -inf); exactly 1 where the max held,
  // as over most of a long context: no libm call there (~4 % of a decode call).
  float alpha = m_new == m ? 1.0f : std::exp2(m - m_new);
  vec::F shift = vec::set1(m_new), sum = vec::zero();
  for (int i = 0; i < kTile; i += vec::W) {
    vec::F p = vec::exp2(vec::sub(vec::load(s + i), shift));
    vec::store(s + i, p);
    sum = vec::add(sum, p);
  }
  l = l * alpha + vec::reduce_add(sum);
  if (alpha != 1.0f) {
    vec::F a = vec::set1(alpha);
    for (int d = 0; d < head_dim; d += vec::W) vec::store(acc + d, vec::mul(vec::load(acc + d), a));
  }
  m = m_new;
}

// acc[r] += sum_t p[r][t] * v[t] for R rows at once: each V element is
// loaded (and converted) once per R rows.  Tokens go in ascending order for
// every row, whatever R is, so the sums round the same way in any blocking.
template <int R, typename VT>
void pv_rows(const float* p, const VT* const* v, int n, float* acc, int head_dim,
             Prefetcher& ahead) {
  Prefetcher::Cursor fetch = ahead.cursor();
  for (int d = 0; d < head_dim; d += kPair) {
    vec::F a[R], b[R];
    for (int r = 0; r < R; ++r) vec::load_pair(acc + r * head_dim + d, a[r], b[r]);
    for (int t = 0; t < n; ++t) {
      fetch.step();
      fetch.step();
      vec::F va, vb;
      vec::load_pair(v[t] + d, va, vb);
      for (int r = 0; r < R; ++r) {
        vec::F w = vec::set1(p[r * kTile + t]);
        a[r] = vec::fma(w, va, a[r]);
        b[r] = vec::fma(w, vb, b[r]);
      }
    }
    for (int r = 0; r < R; ++r) vec::store_pair(acc + r * head_dim + d, a[r], b[r]);
  }
  ahead.resume(fetch);
}

// Rows [first, rows) over V; n_for(r) = tokens row r sees in this tile.
template <typename VT, typename Visible>
void pv_tile(const float* scores, const VT* const* v, int first, int rows, Visible n_for,
             float* acc, int head_dim, Prefetcher& ahead) {
  for (int r = first; r < rows; r += kRowBlock) {
    int count = std::min(kRowBlock, rows - r);
    int n = n_for(r + count - 1);  // rows see non-decreasing counts: the last sees most
    const float* p = scores + size_t(r) * kTile;
    float* a = acc + size_t(r) * head_dim;
    switch (count) {
      case 1: pv_rows<1>(p, v, n, a, head_dim, ahead); break;
      case 2: pv_rows<2>(p, v, n, a, head_dim, ahead); break;
      case 3: pv_rows<3>(p, v, n, a, head_dim, ahead); break;
      default: pv_rows<4>(p, v, n, a, head_dim, ahead); break;
    }
  }
}

// total <- total (+) part: the log-sum-exp merge of two softmax states.
// The split-KV reduction calls this too, in the same order, on the same values.
inline void fold_row(float& tm, float& tl, float* tacc, float pm, float pl, const float* pacc,
                     int head_dim) {
  if (pl == 0.0f) return;  // the row saw nothing in this partition
  float m = std::max(tm, pm);
  float st = std::exp2(tm - m), sp = std::exp2(pm - m);
  tl = tl * st + pl * sp;
  vec::F vt = vec::set1(st), vp = vec::set1(sp);
  for (int d = 0; d < head_dim; d += vec::W)
    vec::store(tacc + d, vec::fma(vec::load(pacc + d), vp, vec::mul(vec::load(tacc + d), vt)));
  tm = m;
}

inline void reset_rows(float* m, float* l, float* acc, int rows, int head_dim) {
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);
  std::fill(acc, acc + size_t(rows) * head_dim, 0.0f);
}

template <typename T, typename QT>
void fold_partition(Scratch<T, QT>& s, int rows, int head_dim) {
  for (int r = 0; r < rows; ++r)
    fold_row(s.tot_m[r], s.tot_l[r], &s.tot_acc[size_t(r) * head_dim], s.part_m[r],
             s.part_l[r], &s.part_acc[size_t(r) * head_dim], head_dim);
  reset_rows(s.part_m.data(), s.part_l.data(), s.part_acc.data(), rows, head_dim);
}

// Normalised output row: acc / l in the output type (zeros when l == 0).
template <typename T>
void finish_row(const float* acc, float l, int head_dim, T* out) {
  vec::F inv = vec::set1(l > 0.0f ? 1.0f / l : 0.0f);
  for (int d = 0; d < head_dim; d += kPair) {
    vec::F a, b;
    vec::load_pair(acc + d, a, b);
    vec::store_pair(out + d, vec::mul(a, inv), vec::mul(b, inv));
  }
}

// Query row (cache type) -> what Q.K multiplies: fp32 in the loader layout,
// or the raw row for the dpbf16 path.
template <typename T, typename QT>
void prepare_query(const T* q, int head_dim, QT* out) {
  if constexpr (std::is_same_v<QT, float>) {
    convert_row(q, out, head_dim);
  } else {
    std::memcpy(out, q, sizeof(T) * head_dim);
  }
}

}  // namespace pagedserve

#include "attention_tile.h"
