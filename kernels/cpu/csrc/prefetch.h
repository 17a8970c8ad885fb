// Software prefetch, shared by the attention and linear kernels.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagedserve {

// One software prefetch, into L1 (Level 1: attention's next head,
// attention_tile.h) or L2 (Level 2: the weights, the next attention tile).
// Volatile asm on x86 because GCC counts __builtin_prefetch as free of side
// effects: a function that only prefetches is then "const", and its calls
// are deleted (C++ loops are assumed to finish): that is how attention.h's
// first prefetches compiled to nothing.  The address goes in a register, not
// as a memory operand: with "m", GCC kept the packed linear's 24
// accumulators on the stack (40 % of the tile's speed).
template <int Level>
inline void prefetch_into(const char* p) {
  static_assert(Level == 1 || Level == 2, "L1 or L2");
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (Level == 1)
    asm volatile("prefetcht0 (%0)" : : "r"(p));
  else
    asm volatile("prefetcht1 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 0, Level == 1 ? 3 : 2);
  asm volatile("" : : "r"(p));
#endif
}
inline void prefetch_l1(const char* p) { prefetch_into<1>(p); }
inline void prefetch_l2(const char* p) { prefetch_into<2>(p); }

// How far ahead of the group being decoded a row's loop asks for weights
// (into L2).  Why: at one token this loop is a single stream through the
// weights with little work per byte, and on the 2-vCPU Xeon the hardware
// prefetchers alone left it waiting on loads, at 25-30 % of the read rate
// (`python -m bench.kernels.quant_linear --rows 1`); 4 KiB ahead measured
// best of 1, 2, 4 and 8 KiB (docs/performance.md).
constexpr int64_t kAhead = 4096;

// The lines of the `bytes` at p, into L2.  Prefetches never fault, so the
// last rows may ask past the blob.
inline void prefetch_bytes(const uint8_t* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(c + o);
}

// Lines still to prefetch into L2, in address order, a few at each step of
// the loop that reads the bytes before them: the next panel of contiguous
// rows (quant_lanes.h's lanes_rows_dot says why address order) or the next
// int8 strip (quant_vnni.h).  Spread, because a burst of a hundred or more
// prefetches outruns the core's miss buffers.
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
  Ahead() = default;
  Ahead(const uint8_t* start, int64_t bytes) : p(reinterpret_cast<const char*>(start)), lines((bytes + 63) / 64) {}
  void fetch(int64_t n) {
    for (; n > 0 && lines > 0; --n, --lines, p += 64) prefetch_l2(p);
  }
};

// The same in address order from kAhead past `start`, for reads in chunks
// that are not whole lines (quant_panels.h's legacy panels: 288-384 bytes):
// through(end) asks for every line up to kAhead past `end` not asked yet.
struct LinesAhead {
  const char* p;
  explicit LinesAhead(const uint8_t* start)
      : p(reinterpret_cast<const char*>(uintptr_t(start + kAhead) & ~uintptr_t(63))) {}
  void through(const uint8_t* end) {
    for (const char* until = reinterpret_cast<const char*>(end + kAhead); p < until; p += 64) prefetch_l2(p);
  }
};

// The panel of rows to ask for while reading the panel at w (`panel` bytes
// of contiguous rows): the next one, or where a panel is shorter than
// kAhead the first one at least kAhead past w.  Why: a panel of four short
// rows (SmolLM2's Q4_1 rows of 576 inputs, 1,440 bytes) is read in less
// time than its lines take to arrive, so asking for the very next one came
// too late.
inline Ahead panel_ahead(const uint8_t* w, int64_t panel) {
  const int64_t panels = std::max<int64_t>(1, (kAhead + panel - 1) / panel);
  return Ahead(w + panels * panel, panel);
}

// The lines of the `bytes` at g + kAhead: a later group of this row or of the
// rows after it (a part's rows are contiguous).
inline void prefetch_ahead(const uint8_t* g, int64_t bytes) { prefetch_bytes(g + kAhead, bytes); }

}  // namespace pagedserve
