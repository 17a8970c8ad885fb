// The vector layer of this build: one of three headers, chosen by the ISA
// flag ops.py compiles with.  Each defines vec::W fp32 lanes, the vector type
// F and the same small set of operations, so the kernels are written once.
#pragma once

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
