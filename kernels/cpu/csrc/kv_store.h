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

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "ops_common.h"

namespace pagedserve {
namespace kv_store {

inline void check_rows(const at::Tensor& rows, const char* name) {
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 3 && rows.stride(2) == 1 &&
                  rows.stride(1) == rows.size(2),
              "store_kvcache: ", name, " must be a CPU [tokens, kv_heads, head_dim] tensor, heads and head_dim packed");
}

// The K and V caches as `rows` writes them: contiguous, one shape, heads and
// head_dim as given, of the rows' dtype (`dtype_name` says which in the
// message), or quantized: int8 rows of head_dim codes and a 2-byte scale, or
// fp8 (kernels/kv_quant.py).  Returns the caches' dtype.
inline at::ScalarType check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t kv_heads,
                                   int64_t head_dim, at::ScalarType dtype, const char* dtype_name,
                                   const char* op) {
  const at::ScalarType cache = quantized_cache(k_cache.scalar_type()) ? k_cache.scalar_type() : dtype;
  const int64_t row = cache == at::kChar ? head_dim + kQ8ScaleBytes : head_dim;
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->dim() == 4 && c->is_contiguous() && c->size(2) == kv_heads && c->size(3) == row &&
                    c->sizes() == k_cache.sizes() && c->scalar_type() == cache,
                op, ": the K and V caches must be contiguous ", dtype_name, " (or int8 or fp8) tensors of "
                "one shape; a cache must be [blocks, block_size, kv_heads, head_dim] (int8: head_dim + 2) "
                "with the rows' kv_heads (", kv_heads, ") and head_dim (", head_dim, ")");
  return cache;
}

// The head_dim a cache serves: its rows' length, less an int8 row's scale.
inline int64_t head_dim_of(const at::Tensor& cache) {
  return cache.scalar_type() == at::kChar ? cache.size(-1) - kQ8ScaleBytes : cache.size(-1);
}

// slot_mapping is a contiguous int64 [tokens] tensor and every slot is -1 (not
// stored) or inside the cache: checked before anything is written.
inline const int64_t* checked_slots(const at::Tensor& slot_mapping, int64_t tokens, int64_t slots,
                                    const char* op) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              op, ": slot_mapping must be a contiguous int64 [tokens] tensor");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, op, ": slot ", slot[t], " of token ", t,
                " is outside the cache's ", slots, " slots");
  return slot;
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

// One row of values -> head_dim int8 codes and the fp16 scale after them, as
// kernels/kv_quant.py quantize_rows: s = fp16(max|x| / 127), c = round(x / s)
// (half to even, fp32 division), clamped to +-127; a zero row is all zeros.
template <typename T>
inline void quantize_row(const T* x, int64_t head_dim, int8_t* out) {
  float absmax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) absmax = std::max(absmax, std::fabs(to_float(x[d])));
  const c10::Half half(std::min(absmax / 127.0f, 65504.0f));
  const float scale = float(half);
  if (scale > 0.0f)
    vec::codes_of(x, head_dim, scale, out);
  else
    std::memset(out, 0, size_t(head_dim));
  std::memcpy(out + head_dim, &half.x, kQ8ScaleBytes);
}

// rows() for an int8 cache: every head of token t's K and V rows (`heads`
// rows of head_dim values, k_stride / v_stride elements from one token to
// the next) quantized into slot slot[t].  A step's new tokens only: a
// decode step quantizes one row per head, nothing next to its attention.
template <typename T>
inline void quantized_rows(const T* kp, int64_t k_stride, const T* vp, int64_t v_stride, int8_t* kc,
                           int8_t* vc, const int64_t* slot, int64_t tokens, int64_t heads, int64_t head_dim) {
  const int64_t row = head_dim + kQ8ScaleBytes;
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slot[t] < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        quantize_row(kp + t * k_stride + h * head_dim, head_dim, kc + (slot[t] * heads + h) * row);
        quantize_row(vp + t * v_stride + h * head_dim, head_dim, vc + (slot[t] * heads + h) * row);
      }
    }
  });
}

// fp8 rows: each value clamped to the format's largest finite one and
// rounded to nearest even by torch's own conversion (c10), as
// kernels/kv_quant.py to_fp8 does; same arguments as quantized_rows.
template <typename F8, typename T>
inline void fp8_rows(const T* kp, int64_t k_stride, const T* vp, int64_t v_stride, uint8_t* kc, uint8_t* vc,
                     const int64_t* slot, int64_t tokens, int64_t heads, int64_t head_dim) {
  const float top = float(std::numeric_limits<F8>::max());
  const int64_t row = heads * head_dim;
  auto one = [&](const T* x, uint8_t* out) {
    for (int64_t d = 0; d < row; ++d) out[d] = F8(std::min(top, std::max(-top, to_float(x[d])))).x;
  };
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slot[t] < 0) continue;
      one(kp + t * k_stride, kc + slot[t] * row);
      one(vp + t * v_stride, vc + slot[t] * row);
    }
  });
}

// Token t's K and V (rows of `heads` x head_dim values of type T, k_stride /
// v_stride elements apart) into slot slot[t] of a cache of dtype `cache`:
// copied (the rows' own dtype: row_bytes each), quantized to int8, or to fp8.
template <typename T>
inline void store_rows(at::ScalarType cache, const T* kp, int64_t k_stride, const T* vp, int64_t v_stride,
                       void* kc, void* vc, const int64_t* slot, int64_t tokens, int64_t heads, int64_t head_dim) {
  auto* k8 = static_cast<uint8_t*>(kc);
  auto* v8 = static_cast<uint8_t*>(vc);
  switch (cache) {
    case at::kChar:
      quantized_rows(kp, k_stride, vp, v_stride, reinterpret_cast<int8_t*>(kc), reinterpret_cast<int8_t*>(vc),
                     slot, tokens, heads, head_dim);
      break;
    case at::kFloat8_e4m3fn:
      fp8_rows<c10::Float8_e4m3fn>(kp, k_stride, vp, v_stride, k8, v8, slot, tokens, heads, head_dim);
      break;
    case at::kFloat8_e5m2:
      fp8_rows<c10::Float8_e5m2>(kp, k_stride, vp, v_stride, k8, v8, slot, tokens, heads, head_dim);
      break;
    default:
      rows(reinterpret_cast<const char*>(kp), k_stride * int64_t(sizeof(T)), reinterpret_cast<const char*>(vp),
           v_stride * int64_t(sizeof(T)), static_cast<char*>(kc), static_cast<char*>(vc), slot, tokens,
           heads * head_dim * int64_t(sizeof(T)));
  }
}

}  // namespace kv_store

inline void store_kvcache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  kv_store::check_rows(key, "key");
  kv_store::check_rows(value, "value");
  TORCH_CHECK(value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type(),
              "store_kvcache: key and value must match in shape and dtype");
  const at::ScalarType cache = kv_store::check_caches(k_cache, v_cache, key.size(1), key.size(2),
                                                      key.scalar_type(), c10::toString(key.scalar_type()),
                                                      "store_kvcache");
  const int64_t tokens = key.size(0);
  const int64_t* slot =
      kv_store::checked_slots(slot_mapping, tokens, k_cache.size(0) * k_cache.size(1), "store_kvcache");
  dispatch_dtype(key.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    kv_store::store_rows(cache, static_cast<const T*>(key.data_ptr()), key.stride(0),
                         static_cast<const T*>(value.data_ptr()), value.stride(0), k_cache.data_ptr(),
                         v_cache.data_ptr(), slot, tokens, key.size(1), key.size(2));
  });
}

}  // namespace pagedserve
