// Storage types of the cache, as the kernels see them: bit patterns only.
// The torch binding casts at::BFloat16 / at::Half pointers to these, so the
// kernel headers need no torch include.  Also the one home of one-element
// bf16 <-> fp32 conversion (the vector ones are in the vec_*.h headers).
#pragma once

#include <cstdint>
#include <cstring>

namespace pagedserve {

struct bf16_t {
  uint16_t bits;
};

struct fp16_t {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {  // a bf16 is the top half of an fp32
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline void store_scalar(float* p, float v) { *p = v; }
inline void store_scalar(bf16_t* p, float v) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  p->bits = v != v ? uint16_t(0x7fc0) : uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// v as the storage type T would hold it (torch rounds every op's result so).
template <typename T>
inline float rounded(float v) {
  T t;
  store_scalar(&t, v);
  return to_float(t);
}

}  // namespace pagedserve
