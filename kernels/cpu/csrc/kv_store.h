// store_kvcache: each new token's K and V rows copied into its cache slot.
//
//   key [tokens, kv_heads, head_dim]  (any token stride: a slice of qkv)
//        token t  --slot_mapping[t]-->  k_cache.view(-1, kv_heads, head_dim)[slot]
//   slot -1: the token is skipped (padding)
//
// The reference does this with index_copy_ after checking for -1 slots,
// which reads a flag back and builds index temporaries; every layer of every
// step pays it.  Here it is one copy per row, in the cache's own dtype (a
// caller whose K/V has another dtype takes the reference, which converts).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstring>

namespace pagedserve {
namespace kv_store {

inline void check_pair(const at::Tensor& rows, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 3 && rows.stride(2) == 1 &&
                  rows.stride(1) == rows.size(2),
              "store_kvcache: ", name, " must be a CPU [tokens, kv_heads, head_dim] tensor, heads and head_dim packed");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(2) == rows.size(1) &&
                  cache.size(3) == rows.size(2),
              "store_kvcache: the ", name, " cache must be a contiguous [blocks, block_size, kv_heads, head_dim] "
              "tensor with the rows' heads and head_dim");
  TORCH_CHECK(cache.scalar_type() == rows.scalar_type(), "store_kvcache: ", name,
              " and its cache must have one dtype");
}

// Every slot is -1 (not stored) or inside the cache; checked before anything is written.
inline void check_slots(const int64_t* slot, int64_t tokens, int64_t slots) {
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "store_kvcache: slot ", slot[t], " of token ", t,
                " is outside the cache's ", slots, " slots");
}

// Token t's K and V rows (row_bytes each, k_stride / v_stride bytes apart)
// into cache slot slot[t]; the slots are checked.
inline void rows(const char* kp, int64_t k_stride, const char* vp, int64_t v_stride, char* kc, char* vc,
                 const int64_t* slot, int64_t tokens, int64_t row_bytes) {
  at::parallel_for(0, tokens, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slot[t] < 0) continue;
      std::memcpy(kc + slot[t] * row_bytes, kp + t * k_stride, row_bytes);
      std::memcpy(vc + slot[t] * row_bytes, vp + t * v_stride, row_bytes);
    }
  });
}

}  // namespace kv_store

inline void store_kvcache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  kv_store::check_pair(key, k_cache, "key");
  kv_store::check_pair(value, v_cache, "value");
  TORCH_CHECK(value.size(0) == key.size(0) && k_cache.sizes() == v_cache.sizes(),
              "store_kvcache: key and value (and their caches) must match in shape");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "store_kvcache: slot_mapping must be a contiguous int64 [tokens] tensor");
  const int64_t tokens = key.size(0), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  kv_store::check_slots(slot, tokens, slots);
  kv_store::rows(static_cast<const char*>(key.data_ptr()), key.stride(0) * key.element_size(),
                 static_cast<const char*>(value.data_ptr()), value.stride(0) * value.element_size(),
                 static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()), slot, tokens,
                 key.size(1) * key.size(2) * key.element_size());
}

}  // namespace pagedserve
