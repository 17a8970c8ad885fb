// Storage types of the cache, as the kernels see them: bit patterns only.
// The torch binding casts at::BFloat16 / at::Half pointers to these, so the
// kernel headers need no torch include.  Also the one home of one-element
// bf16 <-> fp32 conversion (the vector ones are in the vec_*.h headers).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedserve {

struct bf16_t {
  uint16_t bits;
};

struct fp16_t {
  uint16_t bits;
};

// One element of an int8 KV cache (kernels/kv_quant.py): a (token, kv head)
// row is head_dim codes, then its fp16 scale's two bytes.  L is the query
// type: a row converts to fp32 in L's loader layout (vec_*.h), the layout
// the query, the accumulators and the output store share.
template <typename L>
struct q8_t {
  int8_t bits;
};

template <typename C>
constexpr bool is_q8 = false;
template <typename L>
constexpr bool is_q8<q8_t<L>> = true;

constexpr int kQ8ScaleBytes = 2;  // kernels/kv_quant.py SCALE_BYTES

// One element of an fp8 KV cache (kernels/kv_quant.py): torch's float8_e4m3fn
// or float8_e5m2 bits, no scale.  L as for q8_t: the layout its rows convert into.
template <typename L>
struct e4m3_t {
  uint8_t bits;
};
template <typename L>
struct e5m2_t {
  uint8_t bits;
};

template <typename C>
constexpr bool is_fp8 = false;
template <typename L>
constexpr bool is_fp8<e4m3_t<L>> = true;
template <typename L>
constexpr bool is_fp8<e5m2_t<L>> = true;

// An fp16's value (exact: every fp16 is an fp32), subnormals included: one
// instruction with F16C, else the bits rebuilt (~10 cycles of branches).
inline float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf, NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    float f = float(man) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, sizeof(u));
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {  // a bf16 is the top half of an fp32
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float to_float(fp16_t x) { return fp16_to_float(x.bits); }

// One int8 code under a scale > 0: clamp(round(x / scale), -127, 127), the
// fp32 division and half-to-even rounding of std::nearbyint, NaN to -127
// (vec::round_codes does the same W lanes at a time).
inline int8_t code_of(float x, float scale) {
  return int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(x / scale))));
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
