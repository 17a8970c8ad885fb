// The tile loop of one work item (see attention.h for the pieces it uses).
#pragma once

#include <type_traits>

namespace pagedserve {

// One work item: for each of kv.heads kv heads, `rows` query rows (already in
// Scratch::q, head-major) that read it.
template <typename T>
struct Work {
  KvView<T> kv;
  int rows;                // query rows per kv head
  const int64_t* visible;  // tokens row r sees; non-decreasing in r, same for every head
  float scale2;            // softmax scale * log2(e)
};

// Q.K, softmax and P.V of rows [first, rows) of one head over a tile of n tokens.
// KT / VT: what Q.K and P.V read, the raw cache rows or their fp32 copies;
// either way the arithmetic is the same, only where the conversion happens moves.
template <typename T, typename QT, typename KT, typename VT>
void tile_step(Scratch<T, QT>& s, const Work<T>& w, int head, const KT* const* k,
               const VT* const* v, int n, int64_t t0, int first) {
  const int head_dim = w.kv.head_dim;
  const size_t base = size_t(head) * w.rows;
  auto n_for = [&](int r) { return int(std::min<int64_t>(n, w.visible[r] - t0)); };
  for (int r = first; r < w.rows; ++r) {
    float* scores = &s.scores[(base + r) * kTile];
    score_row(&s.q[(base + r) * head_dim], k, n_for(r), head_dim, w.scale2, scores);
    softmax_row(scores, s.part_m[base + r], s.part_l[base + r], &s.part_acc[(base + r) * head_dim],
                head_dim);
  }
  pv_tile(&s.scores[base * kTile], v, first, w.rows, n_for, &s.part_acc[base * head_dim], head_dim,
          s.ahead);
}

// One head of one tile.  Picks where K/V get converted to fp32: a few rows
// (decode: one kv head's query heads) convert on the fly as they load; many
// rows (prefill) would convert the same elements again for every block of
// rows, so the tile is converted once into Scratch::kf / vf.  The dpbf16
// path multiplies raw K.
template <typename T, typename QT>
void run_tile(Scratch<T, QT>& s, const Work<T>& w, int head, const int64_t* slots, int n,
              int64_t t0, int first, bool convert) {
  const int head_dim = w.kv.head_dim;
  const int64_t offset = int64_t(head) * head_dim;
  const T* kp[kTile];
  const T* vp[kTile];
  for (int i = 0; i < n; ++i) {
    kp[i] = w.kv.k + slots[i] + offset;
    vp[i] = w.kv.v + slots[i] + offset;
  }
  for (int i = n; i < kTile; ++i) kp[i] = s.zero_t.data();  // Q.K works in groups of 8
  if (!convert) {
    tile_step<T, QT, T, T>(s, w, head, kp, vp, n, t0, first);
    return;
  }
  const float* vf[kTile];
  for (int i = 0; i < n; ++i) {
    vf[i] = &s.vf[size_t(i) * head_dim];
    convert_row(vp[i], &s.vf[size_t(i) * head_dim], head_dim);
  }
  if constexpr (std::is_same_v<QT, float>) {
    const float* kf[kTile];
    for (int i = 0; i < kTile; ++i) kf[i] = s.zero_f.data();
    for (int i = 0; i < n; ++i) {
      kf[i] = &s.kf[size_t(i) * head_dim];
      convert_row(kp[i], &s.kf[size_t(i) * head_dim], head_dim);
    }
    tile_step<T, QT, float, float>(s, w, head, kf, vf, n, t0, first);
  } else {
    tile_step<T, QT, T, float>(s, w, head, kp, vf, n, t0, first);
  }
}

// Tokens [begin, end) of the item's kv heads; the result is left, folded over
// partitions, in Scratch::tot_*.  `begin` is a multiple of kPartition.
template <typename T, typename QT>
void attend(Scratch<T, QT>& s, const Work<T>& w, int64_t begin, int64_t end, bool convert) {
  const int head_dim = w.kv.head_dim, all_rows = w.kv.heads * w.rows;
  reset_rows(s.tot_m.data(), s.tot_l.data(), s.tot_acc.data(), all_rows, head_dim);
  reset_rows(s.part_m.data(), s.part_l.data(), s.part_acc.data(), all_rows, head_dim);
  if (begin >= end) return;
  int cur = 0, first = 0;
  tile_slots(w.kv, begin, int(std::min<int64_t>(kTile, end - begin)), s.slots[0]);
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int n = int(std::min<int64_t>(kTile, end - t0));
    const int64_t next = t0 + kTile;
    const int n_next = next < end ? int(std::min<int64_t>(kTile, end - next)) : 0;
    tile_slots(w.kv, next, n_next, s.slots[cur ^ 1]);
    s.ahead.reset(w.kv, s.slots[cur ^ 1], n_next);
    while (w.visible[first] <= t0) ++first;  // rows that end before this tile are done
    for (int head = 0; head < w.kv.heads; ++head)
      run_tile(s, w, head, s.slots[cur], n, t0, first, convert);
    s.ahead.finish();
    if (next % kPartition == 0 || next >= end) fold_partition(s, all_rows, head_dim);
    cur ^= 1;
  }
}

}  // namespace pagedserve
