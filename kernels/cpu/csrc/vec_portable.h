// Portable build: plain C++ over 8-float arrays (the compiler vectorises what
// it can for the baseline ISA).  Pairs are the natural 16 elements.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "types.h"

namespace pagedserve::vec {

constexpr int W = 8;
// attention_tile.h, prefetch_head_rows: ask for the next kv head's rows while
// one computes (not measured).
constexpr bool kPrefetchNextHead = false;

struct F {
  float v[W];
};

#define PAGEDSERVE_LANES(expr) \
  F r;                         \
  for (int i = 0; i < W; ++i) r.v[i] = (expr); \
  return r

inline F zero() { PAGEDSERVE_LANES(0.0f); }
inline F set1(float x) { PAGEDSERVE_LANES(x); }
inline F load(const float* p) { PAGEDSERVE_LANES(p[i]); }
inline void store(float* p, F a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline F add(F a, F b) { PAGEDSERVE_LANES(a.v[i] + b.v[i]); }
inline F sub(F a, F b) { PAGEDSERVE_LANES(a.v[i] - b.v[i]); }
inline F mul(F a, F b) { PAGEDSERVE_LANES(a.v[i] * b.v[i]); }
inline F max(F a, F b) { PAGEDSERVE_LANES(std::max(a.v[i], b.v[i])); }
inline F min(F a, F b) { PAGEDSERVE_LANES(std::min(a.v[i], b.v[i])); }
inline F div(F a, F b) { PAGEDSERVE_LANES(a.v[i] / b.v[i]); }
inline F round_bf16(F a) { PAGEDSERVE_LANES(rounded<bf16_t>(a.v[i])); }
inline F fma(F a, F b, F c) { PAGEDSERVE_LANES(std::fma(a.v[i], b.v[i], c.v[i])); }
// 2^x as the AVX builds give it: exactly 0 below -126.5, for -inf, and for NaN.
inline F exp2(F x) { PAGEDSERVE_LANES(x.v[i] >= -126.5f ? std::exp2(x.v[i]) : 0.0f); }

#undef PAGEDSERVE_LANES

inline float reduce_max(F a) {
  float m = a.v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, a.v[i]);
  return m;
}

inline float reduce_add(F a) {
  float s = a.v[0];
  for (int i = 1; i < W; ++i) s += a.v[i];
  return s;
}

inline void reduce8(const F* acc, float* out) {
  for (int t = 0; t < 8; ++t) out[t] = reduce_add(acc[t]);
}

inline void load_pair(const float* p, F& a, F& b) {
  a = load(p);
  b = load(p + W);
}

inline void load_pair(const bf16_t* p, F& a, F& b) {
  for (int i = 0; i < W; ++i) {
    a.v[i] = to_float(p[i]);
    b.v[i] = to_float(p[i + W]);
  }
}

inline void load_pair(const fp16_t* p, F& a, F& b) {
  for (int i = 0; i < W; ++i) {
    a.v[i] = c10::detail::fp16_ieee_to_fp32_value(p[i].bits);
    b.v[i] = c10::detail::fp16_ieee_to_fp32_value(p[i + W].bits);
  }
}

// W elements as fp32 in natural order: a width's last vector after its whole pairs (lora.h).
inline F load_one(const float* p) { return load(p); }
inline F load_one(const bf16_t* p) {
  F a;
  for (int i = 0; i < W; ++i) a.v[i] = to_float(p[i]);
  return a;
}
inline F load_one(const fp16_t* p) {
  F a;
  for (int i = 0; i < W; ++i) a.v[i] = c10::detail::fp16_ieee_to_fp32_value(p[i].bits);
  return a;
}

// int8 codes as fp32 in the loader layout, which is natural order here for
// every type (bf16's included).
inline void load_pair_i8(const int8_t* p, F& a, F& b) {
  for (int i = 0; i < W; ++i) {
    a.v[i] = float(p[i]);
    b.v[i] = float(p[i + W]);
  }
}

inline void load_pair_i8_bf16(const int8_t* p, F& a, F& b) { load_pair_i8(p, a, b); }

// fp8 values as fp32 (natural order), through their fp16 bits (see vec_avx2.h).
template <bool E4M3>
inline void load_pair_fp8(const uint8_t* p, F& a, F& b) {
  auto one = [](uint8_t x) {
    if constexpr (E4M3) {
      const uint16_t h = uint16_t((x & 0x80) << 8 | (x & 0x7f) << 7);
      return c10::detail::fp16_ieee_to_fp32_value(h) * 256.0f;
    } else {
      return c10::detail::fp16_ieee_to_fp32_value(uint16_t(x << 8));
    }
  };
  for (int i = 0; i < W; ++i) {
    a.v[i] = one(p[i]);
    b.v[i] = one(p[i + W]);
  }
}

inline void to_bf16_layout(F&, F&) {}  // bf16's layout is natural order here

inline void store_pair(float* p, F a, F b) {
  store(p, a);
  store(p + W, b);
}

inline void store_pair(bf16_t* p, F a, F b) {
  for (int i = 0; i < W; ++i) {
    store_scalar(p + i, a.v[i]);
    store_scalar(p + i + W, b.v[i]);
  }
}

inline void store_pair(fp16_t* p, F a, F b) {
  for (int i = 0; i < W; ++i) {
    p[i].bits = c10::detail::fp16_ieee_from_fp32_value(a.v[i]);
    p[i + W].bits = c10::detail::fp16_ieee_from_fp32_value(b.v[i]);
  }
}

// int8 codes of n values (n a multiple of W) under one scale > 0:
// clamp(round(x / scale), -127, 127), the fp32 division and half-to-even
// rounding of std::nearbyint, NaN to -127 as std::max(-127.0f, NaN) gives
// (kv_store.h's quantize_row, attention_tile.h's prepare_q8_query). Why
// vectors: a prefill quantizes every query row and every new K and V row,
// and the scalar loop was a third of the AVX2 build's int8 prefill attention.
inline void round_codes(const float* x, int n, float scale, int8_t* out) {
  for (int d = 0; d < n; ++d) out[d] = code_of(x[d], scale);
}

}  // namespace pagedserve::vec
