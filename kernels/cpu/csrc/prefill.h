// Prefill / extend: sequence i's query rows cu[i]..cu[i+1] are the last nq of
// its context_len L tokens (already in the cache), causal.
//
//   items   (seq, kv head, query tokens [j0, j1))     rows = tokens x group
//   row (j, g) sees L - nq + j + 1 tokens:  a staircase, longest row last
//
//     context  0 ............................ L-1
//     j0       ######################....                 (# = visible)
//     j0+1     #######################...
//     j1-1     ##########################
//
//   sliding window W: row (j, g) sees only its last W tokens, a band; the
//   item starts at the tile of its first row's first token
//
//     j0       ......######....
//     j1-1     .........######.
//
//   causal = false (encoders): every row sees all L tokens, a rectangle
//   (no window then: the op refuses one)
#pragma once

#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "ops_common.h"

namespace pagedserve {

struct PrefillItem {
  int64_t seq, head, j0, j1;
};

template <typename T>
struct PrefillArgs : OpArgs<T> {
  const int32_t* cu;  // cu_seqlens_q
  bool causal;        // false: every row sees the whole context
};

// Tokens query token j (of nq, the last of the context's len) sees.
inline int64_t prefill_visible(int64_t len, int64_t nq, int64_t j, bool causal) {
  return causal ? len - nq + j + 1 : len;
}

inline std::vector<PrefillItem> plan_prefill(const Layer& l, const int32_t* cu, const int32_t* lens,
                                             int64_t seqs, int64_t tokens_per_item, int64_t window,
                                             bool causal) {
  std::vector<PrefillItem> items;
  std::vector<int64_t> cost;
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t nq = cu[i + 1] - cu[i];
    // An encoder's rows all read every tile, and an item packs each tile's K
    // and V once for its rows: the sequence in as few items as hold it, of
    // even size (135 tokens: one item, not 48 + 48 + 39).
    const int64_t pieces = std::max<int64_t>(1, (nq + tokens_per_item - 1) / tokens_per_item);
    const int64_t per = causal ? tokens_per_item : (nq + pieces - 1) / pieces;
    for (int64_t j0 = 0; j0 < nq; j0 += per)
      for (int64_t h = 0; h < l.kv_heads; ++h)
        items.push_back({i, h, j0, std::min(nq, j0 + per)});
  }
  auto work = [&](const PrefillItem& it) {  // rows x the tokens the item reads
    const int64_t nq = cu[it.seq + 1] - cu[it.seq];
    const int64_t first = prefill_visible(lens[it.seq], nq, it.j0, causal);
    const int64_t last = prefill_visible(lens[it.seq], nq, it.j1 - 1, causal);
    return (it.j1 - it.j0) * (last - window_lo(first, window));
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const PrefillItem& a, const PrefillItem& b) { return work(a) > work(b); });
  return items;
}

// A thread's scratch, and AMX's tiles once an item of encoder rows asks for
// them (attention_amx.h): configured on the thread that uses them, released
// when its region ends.
template <typename C, typename QT>
struct PrefillScratch {
  Scratch<C, QT> s;
#if defined(PAGEDSERVE_HAS_AMX)
  std::optional<amx::Tiles> tiles;
  std::vector<float> wide;  // an encoder item's whole rows of scores (attend_whole)
#endif
};

// Whether an encoder's Q.K and P.V go to AMX: bf16 queries and cache, no
// window or cap (full_tile_scores' own conditions), whole 32-input tile steps.
template <typename T, typename C, typename QT>
bool amx_attention_for(const PrefillArgs<T>& a) {
#if defined(PAGEDSERVE_HAS_AMX)
  if constexpr (std::is_same_v<T, bf16_t> && std::is_same_v<C, bf16_t> && std::is_same_v<QT, bf16_t>)
    return !a.causal && a.convert && a.window == 0 && a.cap2 == 0.0f && a.l.head_dim % 32 == 0 &&
           amx::available();
#endif
  (void)a;
  return false;
}

template <typename T, typename C, typename QT>
void prefill_item(PrefillScratch<C, QT>& p, const PrefillArgs<T>& a, const PrefillItem& it, bool amx) {
  Scratch<C, QT>& s = p.s;
  const int group = int(a.l.group), head_dim = int(a.l.head_dim);
  const int64_t nq = a.cu[it.seq + 1] - a.cu[it.seq], len = a.lens[it.seq];
  const int rows = int(it.j1 - it.j0) * group;
  for (int64_t j = it.j0; j < it.j1; ++j) {
    const int64_t row0 = (a.cu[it.seq] + j) * a.l.heads + it.head * group;
    for (int g = 0; g < group; ++g) {
      const int r = int(j - it.j0) * group + g;
      prepare_row(s, size_t(r), a.query + (row0 + g) * head_dim, head_dim);
      s.visible[r] = prefill_visible(len, nq, j, a.causal);
      s.lo[r] = window_lo(s.visible[r], a.window);
    }
  }
  Work<C> w = make_work(a, kv_view<C>(a.l, a.k_cache, a.v_cache, a.tables, it.seq, int(it.head), 1),
                        rows, s.visible.data(), s.lo.data());
  w.full = !a.causal;
  w.amx = amx;
#if defined(PAGEDSERVE_HAS_AMX)
  if (!attend_whole(s, w, s.visible[rows - 1], a.convert, p.wide))
#endif
    attend(s, w, s.lo[0] / kTile * kTile, s.visible[rows - 1], a.convert);
  for (int64_t j = it.j0; j < it.j1; ++j) {
    const int64_t row0 = (a.cu[it.seq] + j) * a.l.heads + it.head * group;
    for (int g = 0; g < group; ++g) {
      const int r = int(j - it.j0) * group + g;
      finish_row(&s.tot_acc[size_t(r) * head_dim], s.tot_l[r], head_dim,
                 a.out + (row0 + g) * head_dim);
    }
  }
}

inline void check_prefill(const at::Tensor& query, const at::Tensor& cu_t, const at::Tensor& lens_t,
                          const at::Tensor& tables) {
  const int64_t seqs = lens_t.numel();
  TORCH_CHECK_VALUE(cu_t.scalar_type() == at::kInt && cu_t.is_contiguous() && cu_t.numel() == seqs + 1,
                    "paged_prefill_attention: cu_seqlens_q must be int32 [num_seqs + 1]");
  TORCH_CHECK_VALUE(tables.size(0) >= seqs, "paged_prefill_attention: a block table row per sequence");
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(cu[0] >= 0 && cu[seqs] <= query.size(0),
                    "paged_prefill_attention: cu_seqlens_q out of range");
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t nq = cu[i + 1] - cu[i];
    TORCH_CHECK_VALUE(nq >= 0, "paged_prefill_attention: cu_seqlens_q must not decrease");
    TORCH_CHECK_VALUE(nq <= lens[i], "sequence ", i, ": ", nq, " query tokens but context_len ", lens[i]);
  }
}

template <typename T, typename C>
void prefill_typed(const Layer& l, const at::Tensor& query, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& cu,
                   const at::Tensor& lens, double scale, const Features& f, bool causal, at::Tensor& out) {
  using QT = QueryFor<T, C>;
  const int64_t tokens_per_item = std::max<int64_t>(1, (causal ? kPrefillRows : kEncoderRows) / l.group);
  const std::vector<PrefillItem> items = plan_prefill(
      l, cu.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), lens.numel(), tokens_per_item, f.window, causal);
  const PrefillArgs<T> a{{l, static_cast<const T*>(query.data_ptr()), static_cast<T*>(out.data_ptr()),
                          k_cache, v_cache, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                          float(scale) * kLog2e,
                          is_q8<C> || is_fp8<C> || (!std::is_same_v<T, float> && tokens_per_item * l.group > kRowBlock),
                          f.window, f.cap_scale, f.cap2},
                         cu.data_ptr<int32_t>(), causal};
  const bool amx = amx_attention_for<T, C, QT>(a);
  auto make = [&] {
    return PrefillScratch<C, QT>{Scratch<C, QT>(int(tokens_per_item * l.group), int(l.head_dim), a.convert)};
  };
  run_items(int64_t(items.size()), make, [&](PrefillScratch<C, QT>& p, int64_t i) {
#if defined(PAGEDSERVE_HAS_AMX)
    if (amx && !p.tiles) p.tiles.emplace();
#endif
    prefill_item<T, C, QT>(p, a, items[i], amx);
  });
}

inline at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                          const at::Tensor& cu_seqlens_q,
                                          const at::Tensor& context_lens, double scale,
                                          int64_t sliding_window, double logits_soft_cap,
                                          bool causal = true) {
  const Layer l = check_inputs(query, k_cache, v_cache, block_tables, context_lens);
  const Features f = features(sliding_window, logits_soft_cap, scale);
  TORCH_CHECK_VALUE(causal || f.window == 0,
                    "paged_prefill_attention: sliding_window needs causal attention; causal=False takes none");
  check_prefill(query, cu_seqlens_q, context_lens, block_tables);
  const int64_t seqs = context_lens.numel();
  check_tables(l, block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), seqs);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  // Rows outside every sequence's range stay zero, as in the reference.
  const bool covered = cu[0] == 0 && cu[seqs] == query.size(0);
  at::Tensor out = covered ? at::empty_like(query) : at::zeros_like(query);
  dispatch_cache(query.scalar_type(), k_cache.scalar_type(), [&](auto query_tag, auto cache_tag) {
    prefill_typed<decltype(query_tag), decltype(cache_tag)>(l, query, k_cache, v_cache, block_tables,
                                                            cu_seqlens_q, context_lens, scale, f, causal, out);
  });
  return out;
}

}  // namespace pagedserve
