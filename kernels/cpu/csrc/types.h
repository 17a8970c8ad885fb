// Storage types of the cache, as the kernels see them: bit patterns only.
// The torch binding casts at::BFloat16 / at::Half pointers to these, so the
// kernel headers need no torch include.
#pragma once

#include <cstdint>

namespace pagedserve {

struct bf16_t {
  uint16_t bits;
};

struct fp16_t {
  uint16_t bits;
};

}  // namespace pagedserve
