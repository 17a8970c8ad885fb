// The int8 strips' driver, shared by their two forms: quant_vnni.h
// (AVX512-VNNI, columns of 16 weight rows) and quant_maddubs.h (AVX2,
// columns of 8).  A call quantizes its tokens once (quant_tokens.h), cuts
// the blob into strips of a few columns (the work items, taken from one
// counter), and each thread decodes a strip into its int8 codes once, then
// runs every token against it in tiles.  What a form brings is a type K:
//
//   kRows, kTileTokens, kTileColumns   a column's rows, a tile's tokens and columns
//   kUnsignedTokens                    the tokens' codes as dpbusd wants them (+128)
//   Decoded                            a thread's decoded strip
//   columns_for(K)                     columns a strip takes for K inputs
//   decode_column<Q>(...)              one column's codes and meta
//   tile_out<Q, kPer, T, C>(...)       T tokens x C columns, into the output
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#include "quant_blob.h"
#include "quant_blocks.h"
#include "quant_tokens.h"
#include "work_items.h"

#if defined(__AVX2__)
namespace pagedserve {
namespace quant {

// Every token from m, T at a time, against one strip's `columns` columns.
template <typename K, typename Q, int kPer, int T, typename TOut>
inline void tokens_times_strip(const Tokens& x, int64_t m, const typename K::Decoded& s, int64_t columns,
                               int64_t rows, int64_t groups, const float* bias, int64_t at, TOut* out, int64_t N,
                               Ahead& ahead, int64_t per_group) {
  int64_t c = 0;
  for (; c + K::kTileColumns <= columns; c += K::kTileColumns)
    K::template tile_out<Q, kPer, T, K::kTileColumns>(x, m, s, c, rows, groups, bias, at, out, N, ahead,
                                                      per_group);
  for (; c < columns; ++c)
    K::template tile_out<Q, kPer, T, 1>(x, m, s, c, rows, groups, bias, at, out, N, ahead, per_group);
}

// y = x W^T (+ bias) for M tokens through form K's strips.
template <typename K, typename TX, typename TOut>
inline void run_strips(const Blob& blob, const TX* x, int64_t M, const float* bias, TOut* out) {
  static_assert(K::kTileTokens == 4, "the last tokens go 3, 2 or 1 a tile");
  const int64_t Kin = blob.K, N = blob.N, groups = Kin / 32;
  const Tokens tokens = quantize_tokens(x, M, Kin, groups_a_scale(blob), K::kUnsignedTokens);
  const int64_t strip_columns = K::columns_for(Kin);
  const std::vector<Strip> strips = strips_of(blob, K::kRows * strip_columns);
  auto bytes_of = [&](int64_t i) {
    const Strip& item = strips[size_t(i)];
    return Ahead(item.part->data + item.n0 * item.part->row_bytes, (item.n1 - item.n0) * item.part->row_bytes);
  };
  if (!strips.empty()) bytes_of(0).fetch(INT64_MAX);
  const int64_t panels = (M + K::kTileTokens - 1) / K::kTileTokens;
  auto make = [&] { return typename K::Decoded(strip_columns, groups); };
  run_items_ahead(int64_t(strips.size()), make, [&](typename K::Decoded& s, int64_t i, int64_t next) {
    const Strip& item = strips[size_t(i)];
    const int64_t rows = item.n1 - item.n0, columns = (rows + K::kRows - 1) / K::kRows, at = item.first + item.n0;
    with_type(item.part->type, [&](auto q) {
      using Q = decltype(q);
      for (int64_t c = 0; c < columns; ++c)
        K::template decode_column<Q>(*item.part, Kin, item.n0 + K::kRows * c,
                                     std::min<int64_t>(K::kRows, rows - K::kRows * c),
                                     s.codes.get() + c * groups * 32 * K::kRows, s.meta.get() + c * groups);
      // The decode walks a column's rows at once, which the hardware
      // prefetchers did not keep ahead of: the next strip's bytes come into
      // L2 while this strip's tiles run, a line or two at each group of each
      // tile.  Why so spread: a slice per panel of tokens (at 32 tokens, 144
      // prefetches back to back) left decode_column waiting on a quarter of
      // its loads, and a 32-token Llama-3.2-1B Q4_K_M step took 121-131 ms
      // against 108-120 this way (AVX512-VNNI, docs/performance.md).
      Ahead ahead = next >= 0 ? bytes_of(next) : Ahead{};
      const int64_t tiles = panels * (columns / K::kTileColumns + columns % K::kTileColumns);
      const int64_t per_group = (ahead.lines + tiles * groups - 1) / (tiles * groups);
      auto times = [&](auto tokens_a_tile, int64_t m) {
        constexpr int T = decltype(tokens_a_tile)::value;
        if constexpr (Q::kElems == 256) {  // the only types groups_a_scale gives 8 for
          if (tokens.per == 8)
            return tokens_times_strip<K, Q, 8, T>(tokens, m, s, columns, rows, groups, bias, at, out, N, ahead,
                                                  per_group);
        }
        tokens_times_strip<K, Q, 1, T>(tokens, m, s, columns, rows, groups, bias, at, out, N, ahead, per_group);
      };
      int64_t m = 0;
      for (; m + K::kTileTokens <= M; m += K::kTileTokens) times(std::integral_constant<int, K::kTileTokens>{}, m);
      switch (M - m) {
        case 3: times(std::integral_constant<int, 3>{}, m); break;
        case 2: times(std::integral_constant<int, 2>{}, m); break;
        case 1: times(std::integral_constant<int, 1>{}, m); break;
        default: break;
      }
      ahead.fetch(INT64_MAX);
    });
  });
}

}  // namespace quant
}  // namespace pagedserve
#endif  // __AVX2__
