// What a linear does to a finished sum on its way out: the bias, then the
// activation the layer applies to that output (an encoder's up projection:
// BERT's GELU), so the output is written once instead of written, read back
// and written again by a second op.
//
// Why: BERT-base's up projection writes [tokens, 3,072] bf16, ~35 MB a
// prefill step, and torch's GELU over it took 248 ms of an 8.15 s embed call
// of 128 texts (3 %; a fresh output's page faults and a pass over memory).
// In the linear's epilogue it is a few vector ops per 16 outputs.
//
// Rounding: torch stores the linear's output in its dtype, then computes
// the activation from the stored number, so the sum is rounded to the
// output's type before the activation too (a float32 output: not at all).
#pragma once

#include <cstdint>

#include "vec.h"

namespace pagedserve {

enum class Act { none, gelu, relu };

// GELU through erf, gelu(x) = x/2 (1 + erf(x / sqrt 2)), with erf as
// Abramowitz and Stegun's 7.1.26 (|error| <= 1.5e-7), the formula torch's
// vectorized erf evaluates, so F.gelu and this part ways by float rounding:
//
//   z = |x| / sqrt 2,   t = 1 / (1 + p z)
//   q = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) e^(-z^2)      ~ erfc(z)
//   gelu(x) = max(x, 0) - |x| q / 2
//
// The last line is x (1 - q/2) for x >= 0 and x q / 2 for x < 0: the two
// signs of x/2 (1 + erf) without a branch, and a negative x never forms
// 1 - (1 - q), so its small outputs keep their digits.
inline vec::F gelu(vec::F x) {
  const vec::F zero = vec::zero(), one = vec::set1(1.0f);
  const vec::F ax = vec::max(x, vec::sub(zero, x));
  const vec::F t = vec::div(one, vec::fma(vec::set1(0.3275911f * 0.70710678118654752f), ax, one));
  vec::F poly = vec::set1(1.061405429f);
  poly = vec::fma(poly, t, vec::set1(-1.453152027f));
  poly = vec::fma(poly, t, vec::set1(1.421413741f));
  poly = vec::fma(poly, t, vec::set1(-0.284496736f));
  poly = vec::fma(poly, t, vec::set1(0.254829592f));
  const vec::F gauss = vec::exp2(vec::mul(vec::mul(x, x), vec::set1(-0.5f * kLog2e)));  // e^(-x^2 / 2)
  const vec::F q = vec::mul(vec::mul(poly, t), gauss);
  return vec::sub(vec::max(x, zero), vec::mul(vec::mul(ax, q), vec::set1(0.5f)));
}

struct Epilogue {
  const float* bias = nullptr;  // [out] or none
  Act act = Act::none;

  // The sums of outputs [n, n + W), as the output of type TOut stores them
  // (store_to rounds them once more, a no-op after round_to).
  template <typename TOut>
  vec::F apply(vec::F sums, int64_t n) const {
    if (bias) sums = vec::add(sums, vec::load(bias + n));
    if (act == Act::none) return sums;
    sums = vec::round_to<TOut>(sums);
    return act == Act::gelu ? gelu(sums) : vec::max(sums, vec::zero());
  }
};

}  // namespace pagedserve
