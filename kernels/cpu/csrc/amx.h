// Many-token linear tiles on Intel AMX (AVX512-BF16 build, Sapphire Rapids
// and later), over the packed layout of linear_packed.h.
//
// Why: from a dozen tokens a call a linear layer is bound by multiply-adds,
// not by its weight read, and AVX512-BF16's dot product does 64 of them a
// cycle where AMX's tile product does 512 (bf16 in, fp32 sums).  On a 2-vCPU
// Xeon (family 6 model 207) the packed tiles ran 105-147 GFLOP/s for 32-512
// tokens, oneDNN's AMX matmul 340-720.
//
// The packed layout is already AMX's B operand.  tdpbf16ps multiplies a
// 16 x 32 tile of A (16 tokens, 16 input pairs) by a 16 x 64-byte tile of B
// whose row p holds one input pair for 16 output features:
//
//   B row p = | W[n][2p] W[n][2p+1] | W[n+1][2p] W[n+1][2p+1] | ... 16 features
//
// which is a packed block's pair p (packed[n / 16][p][0..15][0..1]), so a B
// tile is 16 consecutive pairs of one block, rows 64 bytes apart, read where
// it lies.  A is x itself, 16 rows K * 2 bytes apart.
//
// Tiles: C is 2 x 2 tiles of 16 x 16 fp32 (32 tokens x 32 features, tmm0-3),
// A two (tmm4-5), B two (tmm6-7): each K step loads four tiles for four
// products.  A token's sum walks its inputs 32 at a time in order, whatever
// its neighbours, so its numbers do not depend on its batch, and AMX takes
// every call, one token too (a decode step is bound by the weight read
// either way): AMX's sums round differently from the AVX-512 dot product's,
// and a token must not get different numbers in a batch of 1 and of 20.
//
// Linux gives a process AMX's 8 KB of tile state only when it asks
// (arch_prctl ARCH_REQ_XCOMP_PERM), and tile configuration is per thread:
// each work item loads the configuration and releases the tiles when done.
// PAGEDSERVE_CPU_AMX=off keeps the AVX-512 tiles (for side-by-side runs).
#pragma once

#if defined(PAGEDSERVE_ISA_AVX512BF16) && defined(__x86_64__) && defined(__linux__)
#define PAGEDSERVE_HAS_AMX 1

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "epilogue.h"
#include "prefetch.h"
#include "vec.h"
#include "work_items.h"

#define PAGEDSERVE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace pagedserve {
namespace amx {

constexpr int64_t kTile = 16;     // tokens of an A tile, features of a B tile
constexpr int64_t kPairs = 16;    // input pairs a tile step takes (32 inputs)
constexpr int64_t kStripBlocks = 8;         // blocks per work item: whole 2-block tiles
constexpr int64_t kChunkBytes = 512 << 10;  // a chunk's x: L2 keeps it and a strip

// The CPU has AMX-TILE and AMX-BF16, the kernel lets this process use the
// tile data, and PAGEDSERVE_CPU_AMX is not "off".
inline bool detect() {
  const char* env = std::getenv("PAGEDSERVE_CPU_AMX");
  if (env && std::strcmp(env, "off") == 0) return false;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Asked once per process: the answer is a fact of the CPU and the kernel.
inline bool available() {
  static const bool yes = detect();
  return yes;
}

// Palette 1, all eight tiles 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The weights, packed: `blocks` blocks of 16 features, K / 2 pairs each.
struct B {
  const bf16_t* w;
  int64_t blocks, K;
  const bf16_t* at(int64_t block, int64_t pair) const { return w + (block * K / 2 + pair) * 2 * kTile; }
};

// The C tiles: tmm0 (A tile 0 x B tile 0), tmm1 (0 x 1), tmm2 (1 x 0), tmm3
// (1 x 1), whichever of them a tile function uses.
PAGEDSERVE_AMX_TARGET inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The used C tiles of R A tiles x C B tiles -> stage [16 R][16 C] fp32.
template <int R, int C>
PAGEDSERVE_AMX_TARGET inline void store_sums(float* stage) {
  const int64_t row = C * kTile * sizeof(float);
  _tile_stored(0, stage, row);
  if constexpr (C == 2) _tile_stored(1, stage + kTile, row);
  if constexpr (R == 2) _tile_stored(2, stage + kTile * C * kTile, row);
  if constexpr (R == 2 && C == 2) _tile_stored(3, stage + kTile * C * kTile + kTile, row);
}

// Tokens (R A tiles: 16 R rows of x, `stride` bytes apart) times C blocks from
// `block`, the fp32 sums into stage [16 R][16 C].
template <int R, int C>
PAGEDSERVE_AMX_TARGET inline void tile(const bf16_t* x, int64_t stride, const B& w, int64_t block,
                                       bool fetch, float* stage) {
  zero_sums();
  const bf16_t* x1 = x + kTile * stride / 2;
  // The next C blocks' same pairs, into L2 while these multiply (the next
  // tile reads them): a 525 MB LM head read 22 GB/s for one token without,
  // 27-29 with, and 32 tokens of a 1B-shaped stack took 0.7-0.9x the time.
  // Only the first panel of a strip fetches: the later ones find the strip
  // in L2, and the fetch loop's address work cost them ~20 % of their time.
  const bool ahead = fetch && block + C < w.blocks;
  const char* next = reinterpret_cast<const char*>(w.at(block + C, 0));
  const int64_t block_bytes = w.K * 2 * kTile;
  for (int64_t p = 0; p < w.K / 2; p += kPairs) {
    if (ahead)
      for (int line = 0; line < C * 16; ++line)
        prefetch_l2(next + (line / 16) * block_bytes + (p + line % 16) * 64);
    _tile_loadd(4, x + 2 * p, stride);
    _tile_loadd(6, w.at(block, p), 64);
    if constexpr (C == 2) _tile_loadd(7, w.at(block + 1, p), 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (C == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, x1 + 2 * p, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (C == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_sums<R, C>(stage);
}

// stage's first `rows` rows through the epilogue -> out[row, 16 block ...].
template <int C, typename TOut>
inline void finish(const float* stage, int64_t rows, int64_t block, const Epilogue& ep, TOut* out,
                   int64_t N) {
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t n = (block + c) * kTile;
      vec::store_to(out + r * N + n, ep.apply<TOut>(vec::load(stage + r * C * kTile + c * kTile), n));
    }
}

// R A tiles of tokens against blocks [b0, b1), in 2-block tiles.
template <int R, typename TOut>
PAGEDSERVE_AMX_TARGET void panel(const bf16_t* x, int64_t stride, int64_t rows, const B& w, int64_t b0,
                                 int64_t b1, bool fetch, const Epilogue& ep, TOut* out, int64_t N) {
  alignas(64) float stage[2 * kTile * 2 * kTile];
  int64_t b = b0;
  for (; b + 2 <= b1; b += 2) {
    tile<R, 2>(x, stride, w, b, fetch, stage);
    finish<2>(stage, rows, b, ep, out, N);
  }
  if (b < b1) {
    tile<R, 1>(x, stride, w, b, fetch, stage);
    finish<1>(stage, rows, b, ep, out, N);
  }
}

// The tokens as the tiles read them: x's rows, and its last M % 16 rows
// again in a zeroed 16-row tile (a tile load always reads 16 rows), copied
// once a call into `storage`.
struct Rows {
  const bf16_t* x;
  const bf16_t* tail;
  int64_t M, K;
};

inline Rows rows_of(const bf16_t* x, int64_t M, int64_t K, std::vector<bf16_t>& storage) {
  const int64_t whole = M / kTile * kTile;
  if (whole == M) return {x, nullptr, M, K};
  storage.assign(size_t(kTile * K), bf16_t{});
  std::memcpy(storage.data(), x + whole * K, size_t((M - whole) * K) * sizeof(bf16_t));
  return {x, storage.data(), M, K};
}

// Tokens [r0, r1) (r0 a multiple of 16) against blocks [b0, b1): 32-token
// panels, then 16, then the tail's tile.
template <typename TOut>
PAGEDSERVE_AMX_TARGET void rows_times_strip(const Rows& x, const B& w, int64_t r0, int64_t r1, int64_t b0,
                                            int64_t b1, const Epilogue& ep, TOut* out, int64_t N) {
  const int64_t K = x.K, stride = K * int64_t(sizeof(bf16_t));
  int64_t r = r0;
  for (; r + 2 * kTile <= r1; r += 2 * kTile)
    panel<2>(x.x + r * K, stride, 2 * kTile, w, b0, b1, r == r0, ep, out + r * N, N);
  for (; r + kTile <= r1; r += kTile)
    panel<1>(x.x + r * K, stride, kTile, w, b0, b1, r == r0, ep, out + r * N, N);
  if (r < r1) panel<1>(x.tail, stride, r1 - r, w, b0, b1, r == r0, ep, out + r * N, N);
}

// Loads the tile configuration on this thread for the scope, then frees the
// tiles (a thread holding them makes every context switch save 8 KB more).
struct Tiles {
  PAGEDSERVE_AMX_TARGET Tiles() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  PAGEDSERVE_AMX_TARGET ~Tiles() { _tile_release(); }
};

// Tokens per chunk: as many as kChunkBytes holds, in whole 32-token panels.
inline int64_t chunk_rows(int64_t K) {
  return std::max<int64_t>(2 * kTile, kChunkBytes / (2 * K) / (2 * kTile) * (2 * kTile));
}

// y [M, 16 blocks] = x [M, K] W^T through the epilogue: each chunk of tokens against
// every strip of blocks, threads taking (chunk, strip) items in chunk order
// from one region (linear_packed.h's run says why).
template <typename TOut>
void run(const bf16_t* x, const B& w, const Epilogue& ep, int64_t M, TOut* out) {
  const int64_t N = w.blocks * kTile, step = chunk_rows(w.K), chunks = (M + step - 1) / step;
  const int64_t strips = (w.blocks + kStripBlocks - 1) / kStripBlocks;
  std::vector<bf16_t> storage;
  const Rows rows = rows_of(x, M, w.K, storage);
  run_items(chunks * strips, [] { return Tiles(); }, [&](const Tiles&, int64_t item) {
    const int64_t m0 = item / strips * step, s = item % strips;
    rows_times_strip(rows, w, m0, std::min(M, m0 + step), s * kStripBlocks,
                     std::min(w.blocks, (s + 1) * kStripBlocks), ep, out, N);
  });
}

// AMX takes this call: the CPU has it, and the inputs are whole tile steps.
// Any number of tokens: a token's numbers then never depend on its batch.
inline bool takes(int64_t K) { return K % (2 * kPairs) == 0 && available(); }

}  // namespace amx
}  // namespace pagedserve

#endif  // PAGEDSERVE_HAS_AMX
