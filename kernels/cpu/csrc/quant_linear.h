// y = x W^T (+ bias) with W in GGUF blocks (a blob: kernels/quant.py), and
// the blob de-quantized (exactly: quant_blocks.h).
//
// How (llama.cpp's scheme): each row of x is quantized once per call, per
// 32 inputs, to int8 with a float scale (d = max|x| / 127, q = round(x / d))
// and the block's sum d * sum(q) (the int8 strips: per 256 inputs where
// every part is a K-quant, as llama.cpp's Q8_K; quant_vnni.h).  A weight
// sub-block of 32 then meets an activation block in integers:
//
//   sum_i w_i x_i ~ (wd * xd) * sum_i qw_i qx_i  +  wm * xd * sum_i qx_i
//
// AVX2: maddubs (unsigned x signed bytes -> pairs of int16) and madd (->
// int32), with the sign of a signed weight moved onto the activation (abs,
// sign) because maddubs wants its first operand unsigned.  With AVX512-VNNI
// one dpbusd does both steps.  The 8 int32 lanes go to float and into an
// fp32 accumulator with the scale (Q6_K scales each half of the 32 apart:
// lanes 0-3 hold its first 16 weights, 4-7 the rest), summed across lanes at
// the end.  The portable build does the same in plain integer loops.
//
// Why integers: a decode step at one stream reads every weight once, and per
// 32 weights the integer path is ~6 instructions (decode, dot, convert, FMA)
// where de-quantizing to fp32 and FMA-ing with fp32 activations is ~16; the
// price is the activations' 8-bit rounding, which the tests bound
// (tests/kernels/test_quant_linear.py).
//
// Up to kManyRows - 1 tokens (31 on AVX512-BF16; bf16 tokens on
// AVX512-VNNI, and every token on the avx512 build, up to kVnniManyRows - 1, 7; AVX2 up to kMaddubsManyRows - 1,
// 7, or 47 with PAGEDSERVE_QUANT_STRIPS=bf16), quant_gemv.h's rows (every
// type; AVX512: quant_lanes.h), up to 4 tokens a pass.  The portable build
// takes tiles: R tokens x C weight rows; a weight sub-block is decoded once
// per tile and meets the R tokens.  One token takes C = 4 rows (four
// independent chains), several take R = 4 x C = 2.  Either way threads
// split the rows in strips; from there, quant_strips.h: int8 tokens against
// int8 strips on AVX512-VNNI below AMX's count (quant_vnni.h) and on AVX2
// (quant_maddubs.h), elsewhere AMX or de-quantized strips.
//
// A blob whose K-quant (or Q4_0, Q4_1, Q5_0, Q5_1) parts are stored in 16-row
// panels (kernels/quant.py; made at load for the AVX512-VNNI build without
// AMX) takes neither path:
// below 8 tokens quant_panels.h's rows, from 8 the int8 strips, which read a
// panel without transposing it; the other builds refuse such a blob.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <cmath>
#include <optional>
#include <vector>

#include "lora_folded.h"
#include "quant_act.h"
#include "quant_blob.h"
#include "quant_gemv.h"
#include "quant_blocks.h"
#include "quant_strips.h"
#include "team.h"
#include "types.h"

namespace pagedserve {
namespace quant {

// From this many tokens a call decodes strips (run_many) instead of going
// a row at a time.  Measured per build (docs/performance.md, "The
// one-token path prefetched"): with the weights prefetched and the last 1-3
// tokens of a row in one pass, the integer path beat the strips at up to 24
// tokens (and split the shapes at 32) where the strips have the bf16 dot
// product, and at up to 32 (5 shapes of 7 at 64) where they convert to fp32
// (AVX2: the strips lost 2-4x at 8-16 tokens).  The portable build keeps its
// tiles' old crossover.
// Where AMX multiplies the strips (amx.h; bf16 tokens) they win from 12-16 tokens (a Q4_K/Q6_K
// 0.6B stack, 2-vCPU Xeon: 22-28 ms at 8-32, the integer path 15 at 8, 22-29 at 12-16, 60 at 32).
// The int8 strips (quant_vnni.h) beat the rows from 16 tokens in
// `bench.kernels.quant_linear` (1,194 against 1,668 us for Llama-1B's Q4_K
// up at 16), but a 32-stream Qwen3-0.6B Q4_K_M run took 172-177 tok/s from
// 16 against 185 from 32 (Zen 5): 32 stays where the tokens are float32.
// Since the strips were prefetched and sized to L2, bf16 tokens take them
// from 8 (kVnniManyRows): at 16 tokens Llama-1B's Q4_K up took 0.64 against
// the rows' 1.19 ms, at 24 0.83 against 2.25, its Q6_K head 16.5 against
// 37.2; at 8 the strips won 0.59-0.79x but for the head (1.04x), at 4 they
// lose (Zen 5, 2026-12-03, docs/performance.md).
constexpr int64_t kVnniManyRows = 8;  // kAmxManyRows (16): quant_strips.h
// AVX2's int8 strips (quant_maddubs.h) take float32 and bf16 tokens alike
// from 8: at 8 tokens SmolLM2's Q4_1 linears took 0.53-0.75x the rows' time,
// its Q8_0 head 0.56x, Llama-1B's Q4_K up 0.76x and Q6_K down 0.79x (a
// first-generation Zen EPYC, 2026-12-04, docs/performance.md).
constexpr int64_t kMaddubsManyRows = 8;
// The avx512 build (VNNI, no BF16) sends float32 tokens to the int8 strips
// from kVnniManyRows too: its de-quantized strips widen to fp32, as AVX2's did.
#if defined(PAGEDSERVE_ISA_AVX512BF16) || defined(PAGEDSERVE_ISA_AVX512)
constexpr int64_t kManyRows = 32;
#elif defined(__AVX2__)
constexpr int64_t kManyRows = 48;
#else
constexpr int64_t kManyRows = 8;
#endif

// ---- one tile -----------------------------------------------------------------------------

// The weights of one part, as the tiles read them.
struct Rows {
  const uint8_t* data;
  int64_t row_bytes, blocks;  // blocks per row, of the type's kElems
};

#if !defined(__AVX2__)
// out[r][c] = sum over K of x row r times weight row c, for R tokens (XBlock
// rows, stride xs) and C weight rows starting at `w`: the portable build's
// path (the AVX2 and AVX512 builds take quant_gemv.h's row_dot).
template <typename Q, int R, int C>
inline void tile(const Rows& rows, const uint8_t* w, const XBlock* x, int64_t xs, float (&out)[R][C]) {
  float mins[R][C] = {}, acc[R][C] = {};
  for (int64_t b = 0; b < rows.blocks; ++b) {
    float wd[C][2 * Q::kSubs], wm[C][Q::kSubs];
    for (int c = 0; c < C; ++c) Q::scales(w + c * rows.row_bytes + b * Q::kBytes, wd[c], wm[c]);
    for (int j = 0; j < Q::kSubs; ++j) {
      const int64_t xb = b * Q::kSubs + j;
      int8_t q[C][32];
      for (int c = 0; c < C; ++c) Q::q(w + c * rows.row_bytes + b * Q::kBytes, j, q[c]);
      for (int r = 0; r < R; ++r) {
        const XBlock& xr = x[r * xs + xb];
        for (int c = 0; c < C; ++c) {
          int lo = 0, hi = 0;
          for (int i = 0; i < 16; ++i) lo += int(q[c][i]) * int(xr.q[i]);
          for (int i = 16; i < 32; ++i) hi += int(q[c][i]) * int(xr.q[i]);
          acc[r][c] += float(lo) * (wd[c][2 * j] * xr.d) + float(hi) * (wd[c][2 * j + 1] * xr.d);
          if (Q::kMin) mins[r][c] += wm[c][j] * xr.s;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = acc[r][c] + mins[r][c];
}
#endif

// Where a tile's sums go: out[m, n] (+ bias[n]), stored as TOut.
template <typename TOut>
struct Sink {
  TOut* out;
  int64_t N;
  const float* bias;
  template <int R, int C>
  void put(const float (&sums)[R][C], int64_t m, int64_t n) const {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        store_scalar(out + (m + r) * N + n + c, sums[r][c] + (bias ? bias[n + c] : 0.f));
  }
};

// Nothing to do per weight row (a folded adapter's prefetches: lora_folded.h).
struct NoStep {
  void operator()() const {}
};

// Tokens [0, M) against rows [n0, n1) of one part (its rows start at global
// row `first`); `step()` runs once per weight row.
template <typename Q, typename TOut, typename Step = NoStep>
inline void part_rows(const Rows& rows, int64_t first, int64_t n0, int64_t n1, const XBlock* x,
                      int64_t M, const Sink<TOut>& sink, const Step& step = Step{}) {
  const int64_t xs = rows.blocks * Q::kSubs;  // XBlocks per token
#if defined(__AVX2__)
  // Every type, a row at a time, 8 sub-blocks a step: quant_gemv.h.
  const XScales scales(x, xs, M, Q::kSplit, lane_slots<Q>());
  int64_t n = M == 1 ? four_rows<Q>(rows, first, n0, n1, x, scales, sink, step) : n0;
  for (; n < n1; ++n) {
    step();
    const uint8_t* w = rows.data + (n - first) * rows.row_bytes;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      float sums[4][1];
      row_dot<Q, 4>(w, rows.blocks, x, scales, m, sums);
      sink.template put<4, 1>(sums, m, n);
    }
    // The last 1-3 tokens in one pass too: the row is decoded once for them
    // (a pass per token made 2 tokens cost ~1.8 one token's time).
    auto last = [&](auto r_tag) {
      constexpr int R = decltype(r_tag)::value;
      float sums[R][1];
      row_dot<Q, R>(w, rows.blocks, x, scales, m, sums);
      sink.template put<R, 1>(sums, m, n);
    };
    if (M - m == 3) last(std::integral_constant<int, 3>{});
    if (M - m == 2) last(std::integral_constant<int, 2>{});
    if (M - m == 1) last(std::integral_constant<int, 1>{});
  }
#else
  // The portable build: tiles (quant_linear.h's header).
  auto run = [&](auto r_tag, auto c_tag, int64_t m, int64_t n) {
    constexpr int R = decltype(r_tag)::value, C = decltype(c_tag)::value;
    float sums[R][C];
    tile<Q, R, C>(rows, rows.data + (n - first) * rows.row_bytes, x + m * xs, xs, sums);
    sink.template put<R, C>(sums, m, n);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  for (int64_t n = n0; n < n1; ++n) step();  // the portable build: its prefetches first
  if (M == 1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) run(I1{}, I4{}, 0, n);
    for (; n < n1; ++n) run(I1{}, I1{}, 0, n);
    return;
  }
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) run(I4{}, I2{}, m, n);
    for (; m < M; ++m) run(I1{}, I2{}, m, n);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) run(I1{}, I1{}, m, n);
#endif
}

// Many tokens: bf16 strips (quant_strips.h) instead of quantized tokens.
inline bool takes_strips(const Blob& blob, int64_t M, bool bf16_x) {
  if (blob.panels) return true;  // at every count: quant_strips.h's run_many
  if (blob.K % linear::kPairLen) return false;
#if defined(PAGEDSERVE_HAS_AMX)
  if (bf16_x && M >= kAmxManyRows && amx_takes(blob)) return true;
#endif
#if defined(PAGEDSERVE_QUANT_VNNI)
  if ((bf16_x || !linear::kDotBf16) && M >= kVnniManyRows && !dequantized_strips_asked()) return true;
#endif
#if defined(PAGEDSERVE_QUANT_MADDUBS)
  if (M >= kMaddubsManyRows && !dequantized_strips_asked()) return true;
#endif
  (void)bf16_x;
  return M >= kManyRows;
}

// A one-token call's rows go to the threads in tiles of 4 rows, every
// part's in order, at least kTileGrain tiles a thread (run, below).
constexpr int64_t kTileGrain = 4;
inline int64_t row_tiles(const Part& p) { return (p.rows + 3) / 4; }

// Where run's second thread starts over file-order rows (its split of the
// tiles among two threads), or nullptr where one thread takes them all.
inline const uint8_t* second_row_share(const Blob& blob) {
  int64_t tiles = 0;
  for (const Part& p : blob.parts) tiles += row_tiles(p);
  if (shares(tiles, kTileGrain, 2) != 2) return nullptr;
  int64_t tile = (tiles + 1) / 2;
  for (const Part& p : blob.parts) {
    if (tile < row_tiles(p)) return p.data + 4 * tile * p.row_bytes;
    tile -= row_tiles(p);
  }
  return nullptr;  // not reached: tile < tiles
}

// Before the serial part ahead of a call of M tokens over `blob` (llama_layer.h):
// where the two threads' shares of it start, for the team's waiting thread to
// fetch into its L2 (team.h's hint), 64 KiB of each.  Panels split as
// quant_panels.h's run splits them, rows as run below; many tokens (the
// strips) are not hinted.  Measured on SmolLM2's layers: 32 and 128 KiB no
// better than 64 (docs/performance.md).
constexpr size_t kFetchAheadBytes = 64 << 10;
inline void fetch_ahead(const Blob& blob, int64_t M, bool bf16_x) {
  Team* team = free_team();
  if (team == nullptr || team->threads() != 2 || blob.parts.empty()) return;
  const uint8_t* second = nullptr;
#if defined(PAGEDSERVE_QUANT_VNNI)
  if (blob.panels && M < panels::kFewTokens) second = panels::second_share(blob);
#endif
  if (!blob.panels && !takes_strips(blob, M, bf16_x)) second = second_row_share(blob);
  if (second != nullptr) team->hint(second, blob.parts[0].data, kFetchAheadBytes);
}

// Nothing folded around a call's rows: the plain linear.
struct NoFold {};

// With `fold` (lora.h's Folded: fewer than kManyRows tokens), every thread of
// the region writes its rows while fold->ahead's prefetches run, runs
// fold->before (its share of the shrink), meets the others at a barrier,
// and runs fold->after over the ranges of output rows it wrote.
template <typename TX, typename TOut, typename Fold = NoFold>
inline void run(const Blob& blob, const TX* x, int64_t M, const float* bias, TOut* out, Fold* fold = nullptr) {
  if (takes_strips(blob, M, std::is_same_v<TX, bf16_t>)) {
    TORCH_CHECK((std::is_same_v<Fold, NoFold>), "quant_linear: nothing folds into ", M, " tokens");
    return run_many(blob, x, M, bias, out);
  }
  const int64_t K = blob.K, xs = K / 32;
  std::vector<XBlock> xq(size_t(M * xs));
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
#if defined(__AVX2__)
      quantize_row_avx2(x + m * K, K, xq.data() + m * xs);
#else
      quantize_row(x + m * K, K, xq.data() + m * xs);
#endif
    }
  });
  const Sink<TOut> sink{out, blob.N, bias};
  for (const Part& p : blob.parts)
    TORCH_CHECK(with_type(p.type, [](auto) {}), "quant_linear: unsupported ggml type ", p.type);
  // Whole 4-row tiles of every part in one parallel region (at least 16 rows
  // a thread), not a region per part. Why: at one token a region is a fork,
  // a join and the two threads' imbalance at it, and a fused qkv or gate|up
  // blob is 2-3 parts: SmolLM2's layer made 7 regions of its 4 linears.
  std::vector<int64_t> tiles{0};  // tiles[i]: the first tile of part i
  for (const Part& p : blob.parts) tiles.push_back(tiles.back() + row_tiles(p));
  // visit(part, its first output row, n0, n1) for each part's rows in tiles [t0, t1).
  auto tiles_rows = [&](int64_t t0, int64_t t1, const auto& visit) {
    int64_t first = 0;  // the part's first row in the output
    for (size_t i = 0; i < blob.parts.size(); ++i) {
      const int64_t a = std::max(t0, tiles[i]) - tiles[i], b = std::min(t1, tiles[i + 1]) - tiles[i];
      if (a < b) visit(blob.parts[i], first, first + 4 * a, first + std::min(4 * b, blob.parts[i].rows));
      first += blob.parts[i].rows;
    }
  };
  auto base_rows = [&](const auto& step) {
    return [&, step](const Part& p, int64_t first, int64_t n0, int64_t n1) {
      with_type(p.type, [&](auto q) {
        using Q = decltype(q);
        part_rows<Q>(Rows{p.data, p.row_bytes, K / Q::kElems}, first, n0, n1, xq.data(), M, sink, step);
      });
    };
  };
  if constexpr (std::is_same_v<Fold, NoFold>) {
    pagedserve::parallel_for(0, tiles.back(), kTileGrain, [&](int64_t t0, int64_t t1) { tiles_rows(t0, t1, base_rows(NoStep{})); });
  } else {
    TORCH_CHECK(fold != nullptr, "quant_linear: no adapter to fold");
  // Each thread: its base rows (fetching its share of the adapter's bytes as
  // it goes), its share of the shrink, the barrier (h whole), the update of
  // its rows.  The barrier needs every thread of the region at it, which
  // at::parallel_for cannot promise: OpenMP directly, the tiles split as
  // at::parallel_for splits them (kTileGrain).
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t total = tiles.back();
    const int64_t used = shares(total, kTileGrain, int(threads)), chunk = (total + used - 1) / used;
    const int64_t t0 = std::min(total, tid * chunk), t1 = std::min(total, (tid + 1) * chunk);
    std::vector<std::pair<int64_t, int64_t>> mine;
    tiles_rows(t0, t1, [&](const Part&, int64_t, int64_t n0, int64_t n1) { mine.push_back({n0, n1}); });
    auto fetch = fold->ahead(tid, threads, mine);
    tiles_rows(t0, t1, base_rows([&] { fetch.step(); }));
    fold->before(tid, threads);
#pragma omp barrier
    fold->after(out, mine);
  }
  }
}

// The LoRA stacks quant_linear takes beside x [T, K] and N outputs: A [S, R',
// K] and B [S, N, R] of x's dtype, y in x's dtype.
inline void check_adapters(const at::Tensor& x, int64_t N, bool float_out, const std::optional<at::Tensor>& a,
                           const std::optional<at::Tensor>& b) {
  TORCH_CHECK_VALUE(a.has_value() && a->defined() && b.has_value() && b->defined(),
                    "quant_linear: lora_ids needs lora_a and lora_b");
  TORCH_CHECK_VALUE(!float_out, "quant_linear: rows under adapters give y in x's dtype (float_out=False)");
  lora::check_stack(*a, x.scalar_type(), x.size(1), "quant_linear: lora_a");
  TORCH_CHECK_VALUE(b->dim() == 3, "quant_linear: lora_b must be [S, out, R]");
  lora::check_stack(*b, x.scalar_type(), b->size(2), "quant_linear: lora_b");
  TORCH_CHECK_VALUE(b->size(1) == N, "quant_linear: lora_b has ", b->size(1), " outputs, the weight ", N);
}

}  // namespace quant

// With `lora_ids`, each row also takes its adapter's update (lora.h's
// contract, scale 1: the stacks carry their scaling, engine/model/lora/):
// y += B[id] (A[id] x) for rows whose id is not -1, `lora_slices` as
// lora_expand takes them; the numbers of quant_linear, lora_shrink and
// lora_expand called in turn.  Fewer than kManyRows tokens fold the adapter
// into the linear's region (lora::Folded); more call the two ops after it.
inline at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               bool float_out, const std::optional<at::Tensor>& lora_ids = std::nullopt,
                               const std::optional<at::Tensor>& lora_a = std::nullopt,
                               const std::optional<at::Tensor>& lora_b = std::nullopt,
                               at::OptionalIntArrayRef lora_slices = std::nullopt) {
  const quant::Blob blob = quant::parse(weight);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == blob.K, "quant_linear: x must be [tokens, ",
              blob.K, "] on the CPU, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bf16");
  const int64_t M = x.size(0), N = blob.N;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "quant_linear: bias must be [out]");
    b = bias->to(at::kFloat).contiguous();
  }
  const bool adapted = lora_ids.has_value() && lora_ids->defined();
  if (adapted) quant::check_adapters(x, N, float_out, lora_a, lora_b);
  const at::Tensor xc = x.contiguous();
  const bool bf16_out = x.scalar_type() == at::kBFloat16 && !float_out;
  at::Tensor out = at::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0 || N == 0) return out;
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool fold = adapted && !quant::takes_strips(blob, M, x.scalar_type() == at::kBFloat16);
  auto go = [&](auto* xp, auto* outp) {
    using Elem = std::remove_pointer_t<decltype(outp)>;
    if (!fold) return quant::run(blob, xp, M, bias_ptr, outp);
    lora::Folded<Elem> folded(xc, *lora_a, *lora_b, *lora_ids, lora_slices, 1.0);
    quant::run(blob, xp, M, bias_ptr, outp, &folded);
  };
  if (x.scalar_type() == at::kFloat)
    go(xc.data_ptr<float>(), out.data_ptr<float>());
  else if (bf16_out)
    go(reinterpret_cast<const bf16_t*>(xc.data_ptr()), reinterpret_cast<bf16_t*>(out.data_ptr()));
  else
    quant::run(blob, reinterpret_cast<const bf16_t*>(xc.data_ptr()), M, bias_ptr, out.data_ptr<float>());
  if (!adapted || fold) return out;
  return lora_expand(out, lora_shrink(xc, *lora_a, *lora_ids, 1.0), *lora_b, *lora_ids, lora_slices);
}

namespace quant {

// Row r of the blob (r < N) as float32 into dst [K]: gguf.quants.dequantize's numbers.
template <typename Q>
inline void dequantize_row(const Part& p, int64_t r, int64_t K, float* dst) {
  uint8_t gathered[kMaxBlockBytes];
  for (int64_t b = 0; b < K / Q::kElems; ++b) {
    const uint8_t* block = row_block(p, r, b, Q::kBytes, gathered);
    float wd[2 * Q::kSubs], wm[Q::kSubs] = {};
    int8_t qs[32];
    Q::scales(block, wd, wm);
    for (int j = 0; j < Q::kSubs; ++j) {
      Q::q(block, j, qs);
      float* o = dst + b * Q::kElems + 32 * j;
      for (int i = 0; i < 32; ++i) {
        const float v = wd[2 * j + i / 16] * float(qs[i]);
        o[i] = Q::kMin ? v + wm[j] : v;
      }
    }
  }
}

}  // namespace quant

// The blob's weights as float32: every row [N, K], or with `rows` (int64
// indices into N, repeats allowed) those rows in that order [len(rows), K]
// (an embedding lookup decodes only the rows it reads).  Exactly
// gguf.quants.dequantize's numbers.
inline at::Tensor quant_dequantize(const at::Tensor& weight, const std::optional<at::Tensor>& rows) {
  const quant::Blob blob = quant::parse(weight);
  for (const quant::Part& p : blob.parts)
    TORCH_CHECK(quant::with_type(p.type, [](auto) {}), "quant_dequantize: unsupported ggml type ", p.type);
  std::vector<int64_t> wanted;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong && rows->device().is_cpu(),
                "quant_dequantize: rows must be a CPU int64 [n] tensor");
    const at::Tensor r = rows->contiguous();
    wanted.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
    for (const int64_t w : wanted)
      TORCH_CHECK_INDEX(w >= 0 && w < blob.N, "quant_dequantize: row ", w, " of a blob of ", blob.N, " rows");
  } else {
    wanted.resize(size_t(blob.N));
    for (int64_t r = 0; r < blob.N; ++r) wanted[size_t(r)] = r;
  }
  const int64_t n = int64_t(wanted.size());
  at::Tensor out = at::empty({n, blob.K}, weight.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t r = wanted[size_t(i)];
      for (const quant::Part& p : blob.parts) {
        if (r >= p.rows) {
          r -= p.rows;
          continue;
        }
        quant::with_type(p.type, [&](auto q) { quant::dequantize_row<decltype(q)>(p, r, blob.K, o + i * blob.K); });
        break;
      }
    }
  });
  return out;
}

}  // namespace pagedserve
