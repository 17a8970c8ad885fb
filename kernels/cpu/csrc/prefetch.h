// Software prefetch, shared by the attention and linear kernels.
#pragma once

namespace pagedserve {

// One software prefetch into L2.  Volatile asm on x86 because GCC counts
// __builtin_prefetch as free of side effects: a function that only
// prefetches is then "const", and its calls are deleted (C++ loops are
// assumed to finish): that is how attention.h's first prefetches compiled
// to nothing.  The address goes in a register, not as a memory operand: with
// "m", GCC kept the packed linear's 24 accumulators on the stack (40 % of
// the tile's speed).
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
  asm volatile("" : : "r"(p));
#endif
}

}  // namespace pagedserve
