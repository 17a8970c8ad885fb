// What both ops share: input checks, cache views.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <type_traits>

#include "attention.h"
#include "work_items.h"

namespace pagedserve {

#ifdef PAGEDSERVE_HAS_DPBF16
template <typename T>
using QueryOf = std::conditional_t<std::is_same_v<T, bf16_t>, bf16_t, float>;
#else
template <typename T>
using QueryOf = float;
#endif

constexpr int kPrefillRows = 48;  // query rows (tokens x group) per prefill item
constexpr int kEncoderRows = 128;  // at most, per item of an encoder's rows (prefill.h)

struct Layer {
  int64_t heads, kv_heads, group, head_dim, num_blocks, block_size, max_blocks;
};

// int8 or fp8 (kernels/kv_quant.py): a cache any query dtype reads.
inline bool quantized_cache(at::ScalarType dtype) {
  return dtype == at::kChar || dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
}

inline Layer check_inputs(const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& context_lens) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged attention (cpu): tensors must be on the CPU");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged attention (cpu): query [tokens, heads, head_dim], caches "
              "[num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (query.scalar_type() == k_cache.scalar_type() || quantized_cache(k_cache.scalar_type())),
              "paged attention (cpu): the caches must have the query's dtype, or be int8 or fp8 "
              "(kernels/kv_quant.py)");
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged attention (cpu): query and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous(),
              "paged attention (cpu): block_tables and context_lens must be contiguous int32");
  Layer l{query.size(1), k_cache.size(2), 0, query.size(2), k_cache.size(0), k_cache.size(1),
          block_tables.size(1)};
  TORCH_CHECK_VALUE(l.kv_heads > 0 && l.heads % l.kv_heads == 0, "num_heads (", l.heads,
                    ") must be a multiple of num_kv_heads (", l.kv_heads, ")");
  const int64_t row = k_cache.scalar_type() == at::kChar ? l.head_dim + kQ8ScaleBytes : l.head_dim;
  TORCH_CHECK(k_cache.size(3) == row, "paged attention (cpu): the caches' rows must be ", row,
              " elements (head_dim ", l.head_dim, k_cache.scalar_type() == at::kChar ? " + its scale)" : ")");
  TORCH_CHECK(l.head_dim % kPair == 0, "paged attention (cpu): head_dim ", l.head_dim,
              " is not a multiple of ", kPair, " in this build");
  l.group = l.heads / l.kv_heads;
  return l;
}

// What every work item of one op call reads: the layer, the tensors, the scale.
template <typename T>
struct OpArgs {
  Layer l;
  const T* query;
  T* out;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const int32_t* tables;
  const int32_t* lens;
  float scale2;   // softmax scale * log2(e)
  bool convert;   // convert K/V tiles to fp32 once (many rows) rather than per row
  int64_t window;                // sliding window W (a query sees its last W tokens); 0: none
  float cap_scale, cap2;         // logits soft cap c: scale / c and c * log2(e); 0: none
};

// The ops' optional features, as OpArgs holds them: sliding_window <= 0 and
// logits_soft_cap <= 0 mean none.
struct Features {
  int64_t window;
  float cap_scale, cap2;
};

inline Features features(int64_t sliding_window, double logits_soft_cap, double scale) {
  if (logits_soft_cap <= 0.0) return {std::max<int64_t>(sliding_window, 0), 0.0f, 0.0f};
  return {std::max<int64_t>(sliding_window, 0), float(scale / logits_soft_cap),
          float(logits_soft_cap) * kLog2e};
}

// Where a row that sees `visible` tokens starts with a window (0 without one).
inline int64_t window_lo(int64_t visible, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, visible - window) : 0;
}

// One item's Work: its K/V and rows, with the op call's scale and features
// (`lo`, each row's window start, only where there is a window).
template <typename T, typename C>
Work<C> make_work(const OpArgs<T>& a, const KvView<C>& kv, int rows, const int64_t* visible,
                  const int64_t* lo) {
  return {kv, rows, visible, a.scale2, a.window > 0 ? lo : nullptr, a.cap_scale, a.cap2};
}

// Every block a context needs must exist: a bad table would read out of bounds.
inline void check_tables(const Layer& l, const int32_t* tables, const int32_t* lens, int64_t seqs) {
  for (int64_t i = 0; i < seqs; ++i) {
    TORCH_CHECK_VALUE(lens[i] >= 0 && lens[i] <= l.max_blocks * l.block_size, "sequence ", i,
                      ": context_len ", lens[i], " does not fit its block table");
    const int32_t* row = tables + i * l.max_blocks;
    for (int64_t b = 0; b * l.block_size < lens[i]; ++b)
      TORCH_CHECK_VALUE(row[b] >= 0 && row[b] < l.num_blocks, "sequence ", i, ": block id ",
                        row[b], " out of range [0, ", l.num_blocks, ")");
  }
}

template <typename C>
KvView<C> kv_view(const Layer& l, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const int32_t* tables, int64_t seq, int head0, int heads) {
  const int row = row_elements<C>(int(l.head_dim));
  return {static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
          tables + seq * l.max_blocks, l.block_size, l.kv_heads * row, head0, heads,
          int(l.head_dim), row};
}

// What Q.K multiplies: fp32 for an fp8 cache (its rows convert); for an int8
// cache the query's own int8 codes where the build multiplies integers (VNNI,
// or AVX2's vpmaddubsw: attention_tile.h, prepare_q8_query), elsewhere their
// values in QueryOf (exact); else QueryOf.
#ifdef PAGEDSERVE_HAS_I8_DOTS
template <typename T, typename C>
using QueryFor = std::conditional_t<is_fp8<C>, float, std::conditional_t<is_q8<C>, int8_t, QueryOf<T>>>;
#else
template <typename T, typename C>
using QueryFor = std::conditional_t<is_fp8<C>, float, QueryOf<T>>;
#endif

template <typename F>
void dispatch_dtype(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(bf16_t{}); break;
    case at::kHalf: f(fp16_t{}); break;
    default: TORCH_CHECK_VALUE(false, "paged attention (cpu): unsupported dtype ", dtype);
  }
}

// The query type T and the cache type C: T itself, or q8_t<T>, e4m3_t<T>,
// e5m2_t<T> for an int8 or fp8 cache.
template <typename F>
void dispatch_cache(at::ScalarType query, at::ScalarType cache, const F& f) {
  dispatch_dtype(query, [&](auto tag) {
    using T = decltype(tag);
    switch (cache) {
      case at::kChar: f(tag, q8_t<T>{}); break;
      case at::kFloat8_e4m3fn: f(tag, e4m3_t<T>{}); break;
      case at::kFloat8_e5m2: f(tag, e5m2_t<T>{}); break;
      default: f(tag, tag);
    }
  });
}

}  // namespace pagedserve
