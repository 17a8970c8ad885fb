// The vector layer of this build: one of three headers, chosen by the ISA
// flag ops.py compiles with.  Each defines vec::W fp32 lanes, the vector type
// F and the same small set of operations, so the kernels are written once.
#pragma once

#include "exp2_poly.h"  // kLog2e for every build

#if defined(PAGEDSERVE_ISA_AVX512BF16)
#include "vec_avx512.h"
#define PAGEDSERVE_ISA_NAME "avx512bf16"
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

}  // namespace pagedserve::vec
