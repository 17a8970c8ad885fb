// SiLU(gate) * up, the gated MLP's activation, over the fused gate_up
// projection's output:
//
//   x row    [ gate : width | up : width ]
//   out row  [ silu(gate) * up : width ]
//
// torch runs F.silu(gate) * up as two ops, storing silu(gate) in the dtype
// in between; here one pass rounds at the same two points.  silu(g) =
// g / (1 + e^-g) is evaluated as
//
//   silu(g) = g * e^min(g, 0) / (1 + e^-|g|)
//
// (the same value: for g < 0 multiply through by e^g), so both exponentials
// are of a number <= 0, which vec::exp2 takes, and nothing overflows.  Its
// relative error (~1e-6) is far below bf16's rounding step (2^-8), but not
// zero: one value in a few thousand can land one bf16 step from torch's,
// whose exp is another approximation.  kernels/__init__.py therefore runs it
// for bf16 only; float32 keeps torch's ops (bit-exact HF parity).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>

#include "team.h"
#include "types.h"
#include "vec.h"

namespace pagedserve {
namespace activation {

inline vec::F silu(vec::F g) {
  const vec::F zero = vec::zero(), log2e = vec::set1(kLog2e);
  const vec::F down = vec::exp2(vec::mul(vec::min(g, zero), log2e));                       // e^min(g, 0)
  const vec::F tail = vec::exp2(vec::mul(vec::min(g, vec::sub(zero, g)), log2e));          // e^-|g|
  return vec::div(vec::mul(g, down), vec::add(vec::set1(1.0f), tail));
}

template <typename T>
void row(const T* gate, const T* up, T* out, int64_t width) {
  constexpr int kPair = 2 * vec::W;
  int64_t i = 0;
  for (; i + kPair <= width; i += kPair) {
    vec::F g[2], u[2];
    vec::load_pair(gate + i, g[0], g[1]);
    vec::load_pair(up + i, u[0], u[1]);
    for (int j = 0; j < 2; ++j) g[j] = vec::mul(vec::round_to<T>(silu(g[j])), u[j]);
    vec::store_pair(out + i, g[0], g[1]);
  }
  for (; i < width; ++i) {  // widths that are not a multiple of the pair
    const float g = to_float(gate[i]);
    store_scalar(out + i, rounded<T>(g / (1.0f + std::exp(-g))) * to_float(up[i]));
  }
}

}  // namespace activation

// x [tokens, 2 * width] contiguous -> silu(x[:, :width]) * x[:, width:], [tokens, width].
inline at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x must be a contiguous CPU [tokens, 2 * width] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "silu_and_mul: x must be float32 or bf16");
  const int64_t tokens = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({tokens, width}, x.options());
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, width));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    pagedserve::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {  // the team's, in a stack's region
      for (int64_t t = t0; t < t1; ++t)
        activation::row(xp + t * 2 * width, xp + t * 2 * width + width, op + t * width, width);
    });
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(bf16_t{});
  return out;
}

}  // namespace pagedserve
