// Rotary position embedding (RoPE) of q and k, in place, in the rotate-half
// form of HF's Llama.  Each head of each token is turned by its position's
// cos / sin row:
//
//            first half          second half
//   head   [ x1 ............ | x2 ............ ]
//   cos    [ c1 ............ | c2 ............ ]      (sin alike: s1 | s2)
//
//   out1 = x1 * c1 - x2 * s1
//   out2 = x2 * c2 + x1 * s2
//
// torch runs x * cos + cat(-x2, x1) * sin as five ops with a temporary each,
// rounding every product and the sum to the dtype.  Here one pass rounds at
// the same three points, so the result is torch's bit for bit: in bf16 a
// product of two bf16 is exact in fp32 before it is rounded, and ops.py
// compiles with -ffp-contract=off, so float32 keeps its multiply and its add
// apart.  (Rounding is symmetric, so subtracting x2 * s1 equals adding the
// rounded -x2 * s1 that torch computes.)
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>

#include "types.h"
#include "vec.h"

namespace pagedserve {
namespace rope {

template <typename T>
inline void rotate(vec::F x1, vec::F x2, vec::F c1, vec::F c2, vec::F s1, vec::F s2, vec::F& out1,
                   vec::F& out2) {
  using vec::round_to;
  out1 = vec::sub(round_to<T>(vec::mul(x1, c1)), round_to<T>(vec::mul(x2, s1)));
  out2 = vec::add(round_to<T>(vec::mul(x2, c2)), round_to<T>(vec::mul(x1, s2)));
}

// One head of `2 * half` elements; cos and sin are this token's rows.
template <typename T>
void head(T* x, const T* cos, const T* sin, int64_t half) {
  constexpr int kPair = 2 * vec::W;  // the loader layout is the same for x, cos and sin
  int64_t i = 0;
  for (; i + kPair <= half; i += kPair) {
    vec::F x1[2], x2[2], c1[2], c2[2], s1[2], s2[2], o1[2], o2[2];
    vec::load_pair(x + i, x1[0], x1[1]);
    vec::load_pair(x + half + i, x2[0], x2[1]);
    vec::load_pair(cos + i, c1[0], c1[1]);
    vec::load_pair(cos + half + i, c2[0], c2[1]);
    vec::load_pair(sin + i, s1[0], s1[1]);
    vec::load_pair(sin + half + i, s2[0], s2[1]);
    for (int j = 0; j < 2; ++j) rotate<T>(x1[j], x2[j], c1[j], c2[j], s1[j], s2[j], o1[j], o2[j]);
    vec::store_pair(x + i, o1[0], o1[1]);
    vec::store_pair(x + half + i, o2[0], o2[1]);
  }
  for (; i < half; ++i) {  // head dims that are not a multiple of the pair
    const float a = to_float(x[i]), b = to_float(x[half + i]);
    store_scalar(x + i, rounded<T>(a * to_float(cos[i])) - rounded<T>(b * to_float(sin[i])));
    store_scalar(x + half + i,
                 rounded<T>(b * to_float(cos[half + i])) + rounded<T>(a * to_float(sin[half + i])));
  }
}

// Every head of every token: x's rows `stride` elements apart, each `heads`
// heads of `dim` packed; cos / sin [tokens, dim] packed.  No checks: the
// callers (below, and the layer op on its qkv rows) check the shapes.
template <typename T>
void rows(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, const T* cos, const T* sin) {
  // A decode step's few thousand elements cost less than waking a thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) head(x + t * stride + h * dim, cos + t * dim, sin + t * dim, dim / 2);
  });
}

// cos / sin as `rows` takes them: contiguous [tokens, dim] in the rows'
// dtype (`dtype_name` says which in the message).
inline void check_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t tokens, int64_t dim,
                         at::ScalarType dtype, const char* dtype_name, const char* op) {
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == tokens && t->size(1) == dim && t->is_contiguous() &&
                    t->scalar_type() == dtype,
                op, ": cos and sin must be contiguous ", dtype_name, " [tokens, head_dim] tensors");
}

}  // namespace rope

// x [tokens, heads, head_dim] (heads and head_dim packed, any token stride:
// q and k are slices of the fused qkv projection), cos / sin [tokens,
// head_dim] in x's dtype: x rotated in place.
inline void rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_embedding: x must be a CPU [tokens, heads, head_dim] tensor, heads and head_dim packed");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rotary_embedding: x must be float32 or bf16");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary_embedding: head_dim must be even");
  rope::check_tables(cos, sin, x.size(0), x.size(2), x.scalar_type(),
                     x.scalar_type() == at::kFloat ? "float32" : "bf16", "rotary_embedding");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), stride = x.stride(0);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rope::rows(reinterpret_cast<T*>(x.data_ptr()), tokens, heads, dim, stride,
               reinterpret_cast<const T*>(cos.data_ptr()), reinterpret_cast<const T*>(sin.data_ptr()));
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(bf16_t{});
}

}  // namespace pagedserve
