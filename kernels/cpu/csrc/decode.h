// Decode: one query token per sequence, attending to its whole context.
//
//   items   (seq, tokens [begin, end)) x every kv head, longest first: a tile
//           of a sequence is read for all its heads at once, whole blocks
//           streaming in rather than one head's strided slices
//   short batch or one long row:  long contexts split into kPartition items
//     item -> (max, sum, acc) per query row in `partials`
//     merge_partials folds them in order, exactly as one whole item would.
//   fewer items than threads (one stream):  each item's kv heads cut into
//     parts, so every thread reads some of the K/V; heads are independent,
//     so no bit changes.
//   sliding window W: a sequence's items start at the tile holding its
//     (L - W)th token; the blocks before it are never read.
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <vector>

#include "ops_common.h"

namespace pagedserve {

struct DecodeItem {
  int64_t seq, begin, end;  // tokens [begin, end) of the context
  int64_t partial;          // where a split item leaves its state; -1: it writes the output
  int head0, heads;         // its kv heads [head0, head0 + heads)
};

struct DecodePlan {
  std::vector<DecodeItem> items;
  std::vector<int64_t> split_seqs;            // sequences whose items left partial states
  std::vector<int64_t> first_partial, parts;  // per sequence
  int64_t num_partials = 0;
};

// K/V elements (tokens x kv heads x head_dim) below which a step's decode
// stays whole: a second thread's start costs what it saves.  Measured on the
// 2-vCPU Xeon, 28 layers' caches read cold, cut / whole: SmolLM2's 3 x 64 at
// 128-160 tokens (24-31K) 0.96-1.05x, at 256 (49K) 0.81x; Qwen3-0.6B's
// 8 x 128 at 32 tokens (32K) 0.85x, at 256 0.67x.  On the 2-vCPU Zen 4
// EPYC SmolLM2's one-stream steps over 9-137 tokens (2-26K) took 0.82x the
// attention time cut (docs/performance.md, 2026-12-04), so the bar sits
// lower: 8K, ~43 of SmolLM2's tokens, 8 of Qwen3-0.6B's.
constexpr int64_t kSplitHeadsMin = 1 << 13;

// Each item's kv heads cut into parts, where the items are fewer than twice
// the threads: two items a thread keep them even.  Why: a one-stream step's
// attention was one item, so one thread read the whole K/V while the other
// waited (6 % of a Qwen3-0.6B step's samples at 128-528 tokens, 2 threads).
inline void split_heads(std::vector<DecodeItem>& items, int64_t threads, int kv_heads, int64_t head_dim) {
  const int64_t n = int64_t(items.size());
  int64_t work = 0;
  for (const DecodeItem& it : items) work += (it.end - it.begin) * kv_heads * head_dim;
  if (threads < 2 || n == 0 || n >= 2 * threads || work < kSplitHeadsMin) return;
  const int parts = int(std::min<int64_t>(kv_heads, (2 * threads + n - 1) / n));
  std::vector<DecodeItem> cut;
  for (const DecodeItem& it : items)
    for (int p = 0; p < parts; ++p) {
      const int h0 = kv_heads * p / parts, h1 = kv_heads * (p + 1) / parts;
      cut.push_back({it.seq, it.begin, it.end, it.partial, h0, h1 - h0});
    }
  items.swap(cut);
}

// Whole sequences as items, unless one is more than half of a thread's fair
// share of the work: then long contexts are cut into partitions too.  A
// sequence's work starts at `first` (0, or the tile its window starts in).
inline DecodePlan plan_decode(const int32_t* lens, int64_t seqs, int64_t threads, int64_t window,
                              int kv_heads, int64_t head_dim) {
  DecodePlan plan;
  std::vector<int64_t> first(seqs);
  int64_t total = 0, longest = 0;
  for (int64_t i = 0; i < seqs; ++i) {
    first[i] = window_lo(lens[i], window) / kTile * kTile;
    total += lens[i] - first[i];
    longest = std::max<int64_t>(longest, lens[i] - first[i]);
  }
  const bool split = threads > 1 && longest > kPartition && 2 * longest * threads > total;
  plan.first_partial.assign(seqs, -1);
  plan.parts.assign(seqs, 0);
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t len = lens[i];
    if (!split || len - first[i] <= kPartition) {
      plan.items.push_back({i, first[i], len, -1, 0, kv_heads});
      continue;
    }
    const int64_t p0 = first[i] / kPartition, parts = (len + kPartition - 1) / kPartition - p0;
    plan.first_partial[i] = plan.num_partials;
    plan.parts[i] = parts;
    plan.split_seqs.push_back(i);
    for (int64_t p = 0; p < parts; ++p)
      plan.items.push_back({i, std::max(first[i], (p0 + p) * kPartition),
                            std::min(len, (p0 + p + 1) * kPartition), plan.num_partials + p, 0, kv_heads});
    plan.num_partials += parts;
  }
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const DecodeItem& a, const DecodeItem& b) {
    return a.end - a.begin > b.end - b.begin;
  });
  split_heads(plan.items, threads, kv_heads, head_dim);
  return plan;
}

template <typename T>
struct DecodeArgs : OpArgs<T> {
  float* part_ml;   // [num_partials, heads, 2]: max, sum
  float* part_acc;  // [num_partials, heads, head_dim]
};

// Rows are the item's query heads, in order: head h0 + r (h0 = head0 x
// group) is row r and reads kv head (h0 + r) / group.
// T: the query and output type; C: the cache's (T, or q8_t<T> for int8).
template <typename T, typename C, typename QT>
void decode_item(Scratch<C, QT>& s, const DecodeArgs<T>& a, const DecodeItem& it) {
  const int heads = int(a.l.heads), head_dim = int(a.l.head_dim), group = int(a.l.group);
  const int rows = it.heads * group;
  const int64_t h0 = int64_t(it.head0) * group;  // the item's first query head
  const T* query = a.query + (it.seq * heads + h0) * head_dim;
  for (int r = 0; r < rows; ++r) prepare_row(s, size_t(r), query + r * head_dim, head_dim);
  for (int g = 0; g < group; ++g) {
    s.visible[g] = a.lens[it.seq];
    s.lo[g] = window_lo(a.lens[it.seq], a.window);
  }
  const Work<C> w = make_work(a, kv_view<C>(a.l, a.k_cache, a.v_cache, a.tables, it.seq, it.head0, it.heads),
                              group, s.visible.data(), s.lo.data());
  attend(s, w, it.begin, it.end, a.convert);
  if (it.partial < 0) {
    T* out = a.out + (it.seq * heads + h0) * head_dim;
    for (int r = 0; r < rows; ++r)
      finish_row(&s.tot_acc[size_t(r) * head_dim], s.tot_l[r], head_dim, out + r * head_dim);
    return;
  }
  float* ml = a.part_ml + (it.partial * heads + h0) * 2;
  for (int r = 0; r < rows; ++r) {
    ml[2 * r] = s.tot_m[r];
    ml[2 * r + 1] = s.tot_l[r];
  }
  std::copy_n(s.tot_acc.data(), size_t(rows) * head_dim, a.part_acc + (it.partial * heads + h0) * head_dim);
}

// Fold a split sequence's partitions in order (as attend() folds them) and write its rows.
template <typename T, typename C, typename QT>
void merge_partials(Scratch<C, QT>& s, const DecodeArgs<T>& a, const DecodePlan& plan, int64_t seq) {
  const int heads = int(a.l.heads), head_dim = int(a.l.head_dim);
  reset_rows(s.tot_m.data(), s.tot_l.data(), s.tot_acc.data(), heads, head_dim);
  for (int64_t p = 0; p < plan.parts[seq]; ++p) {
    const float* ml = a.part_ml + (plan.first_partial[seq] + p) * heads * 2;
    const float* acc = a.part_acc + (plan.first_partial[seq] + p) * heads * head_dim;
    for (int h = 0; h < heads; ++h)
      fold_row(s.tot_m[h], s.tot_l[h], &s.tot_acc[size_t(h) * head_dim], ml[2 * h], ml[2 * h + 1],
               acc + size_t(h) * head_dim, head_dim);
  }
  T* out = a.out + seq * heads * head_dim;
  for (int h = 0; h < heads; ++h)
    finish_row(&s.tot_acc[size_t(h) * head_dim], s.tot_l[h], head_dim, out + h * head_dim);
}

template <typename T, typename C>
void decode_typed(const Layer& l, const at::Tensor& query, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
                  double scale, const Features& f, at::Tensor& out) {
  using QT = QueryFor<T, C>;
  const DecodePlan plan =
      plan_decode(lens.data_ptr<int32_t>(), query.size(0), at::get_num_threads(), f.window, int(l.kv_heads),
                  l.head_dim);
  at::Tensor part_ml, part_acc;  // only where the plan split a sequence
  float *ml = nullptr, *acc = nullptr;
  if (plan.num_partials > 0) {
    part_ml = at::empty({plan.num_partials, l.heads, 2}, query.options().dtype(at::kFloat));
    part_acc = at::empty({plan.num_partials, l.heads, l.head_dim}, part_ml.options());
    ml = part_ml.data_ptr<float>();
    acc = part_acc.data_ptr<float>();
  }
  const DecodeArgs<T> a{{l, static_cast<const T*>(query.data_ptr()), static_cast<T*>(out.data_ptr()),
                         k_cache, v_cache, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                         float(scale) * kLog2e,
                         is_q8<C> || is_fp8<C> || (!std::is_same_v<T, float> && l.group > kRowBlock),
                         f.window, f.cap_scale, f.cap2},
                        ml, acc};
  auto make = [&] { return Scratch<C, QT>(int(l.heads), int(l.head_dim), a.convert); };
  run_items(int64_t(plan.items.size()), make,
            [&](Scratch<C, QT>& s, int64_t i) { decode_item<T, C, QT>(s, a, plan.items[i]); });
  run_items(int64_t(plan.split_seqs.size()), make, [&](Scratch<C, QT>& s, int64_t i) {
    merge_partials<T, C, QT>(s, a, plan, plan.split_seqs[i]);
  });
}

inline at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                                         const at::Tensor& context_lens, double scale,
                                         int64_t sliding_window, double logits_soft_cap) {
  const Layer l = check_inputs(query, k_cache, v_cache, block_tables, context_lens);
  const Features f = features(sliding_window, logits_soft_cap, scale);
  const int64_t seqs = query.size(0);
  TORCH_CHECK_VALUE(context_lens.numel() == seqs && block_tables.size(0) >= seqs,
                    "paged_decode_attention: one context_len and one block table row per query");
  check_tables(l, block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), seqs);
  at::Tensor out = at::empty_like(query);
  dispatch_cache(query.scalar_type(), k_cache.scalar_type(), [&](auto query_tag, auto cache_tag) {
    decode_typed<decltype(query_tag), decltype(cache_tag)>(l, query, k_cache, v_cache, block_tables,
                                                           context_lens, scale, f, out);
  });
  return out;
}

}  // namespace pagedserve
