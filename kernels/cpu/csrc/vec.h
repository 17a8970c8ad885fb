// The vector layer of this build: one of three headers, chosen by the ISA
// flag ops.py compiles with.  Each defines vec::W fp32 lanes, the vector type
// F and the same small set of operations, so the kernels are written once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "exp2_poly.h"  // kLog2e for every build

#if defined(PAGEDSERVE_ISA_AVX512BF16)
#include "vec_avx512.h"
#define PAGEDSERVE_ISA_NAME "avx512bf16"
#elif defined(PAGEDSERVE_ISA_AVX512)
#include "vec_avx512.h"
#define PAGEDSERVE_ISA_NAME "avx512"
#elif defined(PAGEDSERVE_ISA_AVX2)
#include "vec_avx2.h"
#define PAGEDSERVE_ISA_NAME "avx2"
#else
#include "vec_portable.h"
#define PAGEDSERVE_ISA_NAME "portable"
#endif

namespace pagedserve::vec {

// A vector rounded as a tensor of storage type T holds it: bf16 loses all
// but 8 significant bits, float32 nothing.  Element-wise ops that mirror a
// chain of torch ops round where torch stores an intermediate.
template <typename T>
inline F round_to(F a) {
  return a;
}
template <>
inline F round_to<bf16_t>(F a) {
  return round_bf16(a);
}

// n values of a row of type T as int8 codes under one scale > 0 (round_codes):
// through a float buffer W lanes at a time, the last n % W one by one the
// same way (a store's head_dim need not be a multiple of W).
template <typename T>
inline void codes_of(const T* x, int64_t n, float scale, int8_t* out) {
  constexpr int64_t kChunk = 64;  // a multiple of every build's W
  float buf[kChunk];
  int64_t d = 0;
  while (n - d >= W) {
    const int64_t m = std::min<int64_t>(kChunk, (n - d) / W * W);
    for (int64_t i = 0; i < m; ++i) buf[i] = to_float(x[d + i]);
    round_codes(buf, int(m), scale, out + d);
    d += m;
  }
  for (; d < n; ++d) out[d] = code_of(to_float(x[d]), scale);
}

}  // namespace pagedserve::vec
