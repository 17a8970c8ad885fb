// RMSNorm with the residual add in front of it, one pass per token:
//
//   residual <- residual + x          (rounded to the dtype, as torch's add)
//   out      <- weight * dtype(residual * rsqrt(mean(residual^2) + eps))
//
// the arithmetic of HF's LlamaRMSNorm (fp32 statistics, cast back before the
// weight), but one op per layer norm where torch runs eight (float, pow,
// mean, add, rsqrt, mul, cast, mul) plus the add: at one decoded token each
// of those is a few microseconds of dispatch for a few hundred elements.
// Only the mean's summation order differs from torch's, so float32 models
// keep torch's path (bit-exact HF parity); kernels/__init__.py decides.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <optional>

#include "types.h"
#include "vec.h"

namespace pagedserve {
namespace norm {

// residual <- dtype(residual + x) when there is a residual; the sum of the
// squares of what is normalized (the new residual, else x).  Two vector
// accumulators, then the tail: a fixed order for a given build.
template <typename T>
float add_and_square(const T* x, T* residual, int64_t dim) {
  constexpr int kPair = 2 * vec::W;
  vec::F acc[2] = {vec::zero(), vec::zero()};
  int64_t i = 0;
  for (; i + kPair <= dim; i += kPair) {
    vec::F v[2];
    vec::load_pair(x + i, v[0], v[1]);
    if (residual) {
      vec::F r[2];
      vec::load_pair(residual + i, r[0], r[1]);
      for (int j = 0; j < 2; ++j) v[j] = vec::round_to<T>(vec::add(v[j], r[j]));
      vec::store_pair(residual + i, v[0], v[1]);
    }
    for (int j = 0; j < 2; ++j) acc[j] = vec::fma(v[j], v[j], acc[j]);
  }
  float sum = vec::reduce_add(vec::add(acc[0], acc[1]));
  for (; i < dim; ++i) {  // widths that are not a multiple of the pair
    float v = to_float(x[i]);
    if (residual) {
      v = rounded<T>(v + to_float(residual[i]));
      store_scalar(residual + i, v);
    }
    sum += v * v;
  }
  return sum;
}

// out <- weight * dtype(src * inv): HF casts the normalized row back to the
// dtype before the weight multiplies it.
template <typename T>
void scale(const T* src, const T* weight, T* out, int64_t dim, float inv) {
  constexpr int kPair = 2 * vec::W;
  const vec::F factor = vec::set1(inv);
  int64_t i = 0;
  for (; i + kPair <= dim; i += kPair) {
    vec::F v[2], w[2];
    vec::load_pair(src + i, v[0], v[1]);
    vec::load_pair(weight + i, w[0], w[1]);
    for (int j = 0; j < 2; ++j) v[j] = vec::mul(w[j], vec::round_to<T>(vec::mul(v[j], factor)));
    vec::store_pair(out + i, v[0], v[1]);
  }
  for (; i < dim; ++i) store_scalar(out + i, to_float(weight[i]) * rounded<T>(to_float(src[i]) * inv));
}

template <typename T>
void rows(const T* x, T* residual, const T* weight, T* out, int64_t r0, int64_t r1, int64_t dim,
          float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    T* rr = residual ? residual + r * dim : nullptr;
    const float sum = add_and_square(x + r * dim, rr, dim);
    const float inv = 1.0f / std::sqrt(sum / float(dim) + eps);
    scale(rr ? rr : x + r * dim, weight, out + r * dim, dim, inv);
  }
}

}  // namespace norm

// out = RMSNorm(x (+ residual)) * weight; a given residual becomes x + residual in place.
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                           const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "rms_norm: x must be a contiguous CPU [tokens, dim] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [dim] tensor of x's dtype");
  const bool add = residual.has_value() && residual->defined();
  if (add)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be contiguous, with x's shape and dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm: x must be float32 or bf16");
  at::Tensor out = at::empty_like(x);
  const int64_t tokens = x.size(0), dim = x.size(1);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    T* rp = add ? reinterpret_cast<T*>(residual->data_ptr()) : nullptr;
    const T* wp = reinterpret_cast<const T*>(weight.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, tokens, 16, [&](int64_t r0, int64_t r1) {
      norm::rows(xp, rp, wp, op, r0, r1, dim, float(eps));
    });
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(bf16_t{});
  return out;
}

}  // namespace pagedserve
