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

namespace pagedserve {
namespace norm {

template <typename T>
inline float rounded(float v) {  // v as the dtype would hold it
  T t;
  store_scalar(&t, v);
  return to_float(t);
}

template <typename T>
void rows(const T* x, T* residual, const T* weight, T* out, int64_t r0, int64_t r1, int64_t dim,
          float eps) {
  constexpr int kLanes = 8;  // independent partial sums: vectorisable, and a fixed order
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * dim;
    T* rr = residual ? residual + r * dim : nullptr;
    float partial[kLanes] = {};
    for (int64_t i = 0; i < dim; ++i) {
      float v = to_float(xr[i]);
      if (rr) {
        v = rounded<T>(v + to_float(rr[i]));
        store_scalar(rr + i, v);
      }
      partial[i % kLanes] += v * v;
    }
    float sum = 0.0f;
    for (float p : partial) sum += p;
    const float inv = 1.0f / std::sqrt(sum / float(dim) + eps);
    const T* src = rr ? rr : xr;
    T* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i)
      store_scalar(o + i, to_float(weight[i]) * rounded<T>(to_float(src[i]) * inv));
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
