// One Llama-style decoder layer over a step's tokens, in one op.
//
// Why: at one stream the step of a small model is not its weights' bytes but
// the glue between them.  SmolLM2 (30 layers) made ~50 Python and aten calls
// a layer, ~6 ms of a ~18 ms decode step on an AVX2 EPYC, while its linears
// streamed at the memory's rate; a speculative step (a row per drafted token)
// paid the same glue again.  This op runs the same compiled ops in the same
// order as the Python layer, so its numbers are the layer's to the bit, and
// a layer costs one call from Python (a whole stack of them one call, with
// llama_layers at the end of this file):
//
//   hidden ─► RMSNorm(+residual) ─► qkv ─► [RMSNorm of each q, k head] ─► RoPE(q, k) ─► K/V into the cache
//          ─► attention: decode rows (one per sequence), then prefill rows
//          ─► o_proj ─► RMSNorm(+residual) ─► gate_up ─► SiLU·mul ─► down
//
// Under LoRA adapters (engine/model/lora/) each of the four projections adds
// its rows' updates, B (A x), through lora.h's shrink and expand, as the
// Python layer's modules do: `lora_ids` gives each row's slot (-1: none) and
// `lora` the layer's stacks (A then B of qkv, o, gate_up, down).
//
// The rows are as AttentionMetadata lays them out: the first num_decode
// tokens one per decoding sequence, then each prefill (or drafted) span.
// qkv's columns are [q heads | k heads | v heads]; q and k are rotated in
// place inside it (rows of heads, any token stride), as the Python path does.
// Only what that path would send to these same ops comes here
// (engine/model/layers/fused_layer.py checks): bf16, no tensor parallelism,
// SiLU, per-head norms (Qwen3's q_norm, k_norm) only as RMSNorm with the
// layer's eps; each linear's weight bf16 or quantized.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <array>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "activation.h"
#include "decode.h"
#include "kv_store.h"
#include "linear.h"
#include "linear_packed.h"
#include "lora.h"
#include "prefill.h"
#include "quant_linear.h"
#include "rms_norm.h"
#include "rope.h"
#include "team.h"

namespace pagedserve {
namespace layer_parts {

// x W^T (+ b) with W as kernels.linear would take it: packed or [out, in],
// or a quantized blob (uint8: kernels/quant.py), as QuantLinear holds it.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (w.scalar_type() == at::kByte) return quant_linear(x, w, b, false);
#if defined(PAGEDSERVE_HAS_PACKED_LINEAR)
  if (w.dim() == 4) return linear_bf16_packed(x, w, b, false, "none");
#endif
  return linear_bf16(x, w, b, false);
}

// A step's LoRA rows: each row's slot, and the layer's stacks (A and B of
// qkv, o, gate_up, down); off when no row runs under an adapter.
struct Lora {
  std::optional<at::Tensor> ids;
  std::array<std::optional<at::Tensor>, 8> stacks;
  bool on() const { return ids.has_value() && ids->defined(); }
};

// linear() plus the LoRA update of projection `which` (0 qkv, 1 o, 2 gate_up,
// 3 down) for the rows that have an adapter.  A stack whose A has more rows
// than B has columns holds a rank block per slice of the projection (qkv: q
// | k | v rows, of q_size, kv_size, kv_size; gate_up: gate | up, halves) and
// only each slice's own block of B (engine/model/lora/stacks.py), so expand
// takes the slices' bounds; one whose A and B agree has a single slice.  A
// quantized weight takes the update inside its own call (quant_linear folds
// it into its region at a few tokens).
inline at::Tensor adapted_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                                 const Lora& lora, int which, int64_t q_size = 0, int64_t kv_size = 0) {
  if (!lora.on()) return layer_parts::linear(x, w, b);
  const std::optional<at::Tensor>& a_stack = lora.stacks[2 * which];
  const std::optional<at::Tensor>& b_stack = lora.stacks[2 * which + 1];
  TORCH_CHECK_VALUE(a_stack.has_value() && b_stack.has_value(), "llama_layer: LoRA stack ", which, " is None");
  std::optional<std::vector<int64_t>> bounds;
  if (a_stack->size(1) != b_stack->size(2)) {
    const int64_t out = b_stack->size(1);
    bounds = which == 0 ? std::vector<int64_t>{0, q_size, q_size + kv_size, out}
                        : std::vector<int64_t>{0, out / 2, out};
    const int64_t slices = int64_t(bounds->size()) - 1;
    TORCH_CHECK_VALUE((which == 0 || which == 2) && a_stack->size(1) == slices * b_stack->size(2),
                      "llama_layer: LoRA stack ", which, " has ", a_stack->size(1), " rank rows and ",
                      b_stack->size(2), " B columns; expected one B block or ", slices, " A blocks");
  }
  const at::OptionalIntArrayRef slices = bounds ? at::OptionalIntArrayRef(*bounds) : std::nullopt;
  if (w.scalar_type() == at::kByte) return quant_linear(x, w, b, false, lora.ids, a_stack, b_stack, slices);
  at::Tensor y = layer_parts::linear(x, w, b);
  return lora_expand(y, lora_shrink(x.contiguous(), *a_stack, *lora.ids, 1.0), *b_stack, *lora.ids, slices);
}

// q, k and v are column ranges of qkv's rows ([q heads | k heads | v heads]).
// q and k are rotated in place and k and v stored into the cache through
// pointers, as rotary_embedding and store_kvcache would do on narrowed views
// of qkv (aten's narrow, view and contiguous cost ~1 us each, and the Python
// layer's path took seven of them a layer); returns q, contiguous, for the
// attention kernels.
// Qwen3's norms of each q and k head over head_dim, in place in qkv's rows:
// the numbers of the rms_norm op over those heads as rows (Attention._norm_heads).
inline void norm_heads(bf16_t* rows, int64_t tokens, int64_t width, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, const at::Tensor& q_norm, const at::Tensor& k_norm, double eps) {
  for (const at::Tensor* w : {&q_norm, &k_norm})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == head_dim && w->is_contiguous() &&
                    w->scalar_type() == at::kBFloat16,
                "llama_layer: q_norm and k_norm must be contiguous bf16 [head_dim]");
  const auto* qw = reinterpret_cast<const bf16_t*>(q_norm.data_ptr());
  const auto* kw = reinterpret_cast<const bf16_t*>(k_norm.data_ptr());
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      bf16_t* q = rows + t * width;
      bf16_t* k = q + num_heads * head_dim;
      norm::rows(q, static_cast<bf16_t*>(nullptr), qw, q, 0, num_heads, head_dim, float(eps));
      norm::rows(k, static_cast<bf16_t*>(nullptr), kw, k, 0, num_kv_heads, head_dim, float(eps));
    }
  });
}

inline at::Tensor rotate_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, const std::optional<at::Tensor>& q_norm,
                                   const std::optional<at::Tensor>& k_norm, double eps) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;  // width is q_size + 2 * kv_size (checked by the caller)
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == at::kBFloat16 && head_dim % 2 == 0,
              "llama_layer: qkv must be contiguous bf16 and head_dim even");
  rope::check_tables(cos, sin, tokens, head_dim, at::kBFloat16, "bf16", "llama_layer");
  const at::ScalarType cache =
      kv_store::check_caches(k_cache, v_cache, num_kv_heads, head_dim, at::kBFloat16, "bf16", "llama_layer");
  const int64_t* slot =
      kv_store::checked_slots(slot_mapping, tokens, k_cache.size(0) * k_cache.size(1), "llama_layer");
  auto* rows = reinterpret_cast<bf16_t*>(qkv.data_ptr());
  const bool normed = q_norm.has_value() && q_norm->defined();
  TORCH_CHECK(normed == (k_norm.has_value() && k_norm->defined()), "llama_layer: q_norm without k_norm");
  if (normed) norm_heads(rows, tokens, width, num_heads, num_kv_heads, head_dim, *q_norm, *k_norm, eps);
  rope::rows(rows, tokens, num_heads + num_kv_heads, head_dim, width,
             reinterpret_cast<const bf16_t*>(cos.data_ptr()), reinterpret_cast<const bf16_t*>(sin.data_ptr()));
  kv_store::store_rows(cache, rows + q_size, width, rows + q_size + kv_size, width, k_cache.data_ptr(),
                       v_cache.data_ptr(), slot, tokens, num_kv_heads, head_dim);
  at::Tensor q = at::empty({tokens, num_heads, head_dim}, qkv.options());
  auto* qp = reinterpret_cast<bf16_t*>(q.data_ptr());
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(qp + t * q_size, rows + t * width, size_t(q_size) * sizeof(bf16_t));
  return q;
}

// What a layer op checks of its step: bf16 rows, the decode rows among them.
inline void check_step(const char* op, const at::Tensor& hidden, int64_t num_decode_tokens) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16, op,
              ": hidden must be bf16 [tokens, hidden]");
  TORCH_CHECK(num_decode_tokens >= 0 && num_decode_tokens <= hidden.size(0), op, ": num_decode_tokens ",
              num_decode_tokens, " of ", hidden.size(0), " tokens");
}

// The step's attention rows, as AttentionMetadata gives them.
struct Rows {
  int64_t num_decode;
  const at::Tensor& decode_tables;
  const at::Tensor& decode_lens;
  const at::Tensor& prefill_tables;
  const at::Tensor& prefill_cu_seqlens_q;
  const at::Tensor& prefill_lens;
};

// q [tokens, heads, dim] (contiguous) -> attention out of the same shape:
// decode rows by the decode kernel, the rest by the prefill kernel.
inline at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const Rows& rows, double scale, int64_t window, double cap) {
  const int64_t tokens = q.size(0), d = rows.num_decode;
  if (d == tokens)
    return paged_decode_attention(q, k_cache, v_cache, rows.decode_tables, rows.decode_lens, scale, window, cap);
  if (d == 0)
    return paged_prefill_attention(q, k_cache, v_cache, rows.prefill_tables, rows.prefill_cu_seqlens_q,
                                   rows.prefill_lens, scale, window, cap);
  at::Tensor out = at::empty_like(q);
  out.narrow(0, 0, d).copy_(paged_decode_attention(q.narrow(0, 0, d), k_cache, v_cache, rows.decode_tables,
                                                   rows.decode_lens, scale, window, cap));
  out.narrow(0, d, tokens - d)
      .copy_(paged_prefill_attention(q.narrow(0, d, tokens - d), k_cache, v_cache, rows.prefill_tables,
                                     rows.prefill_cu_seqlens_q, rows.prefill_lens, scale, window, cap));
  return out;
}

// Whether a stack's step runs in one region (team.h): a few decode rows, no
// adapters, every projection quantized.  Then the loops team.h does not
// route (norms, RoPE, the cache's stores, the tokens' rounding) run on the
// calling thread, a few microseconds at 8 tokens, and the quantized
// linears, SiLU and the decode attention route theirs.
constexpr int64_t kTeamTokens = 8;
template <typename Weight>
inline bool few_decode_rows(const at::Tensor& hidden, int64_t num_decode_tokens, bool plain, int64_t layers,
                            const Weight& weight) {
  if (hidden.size(0) > kTeamTokens || num_decode_tokens != hidden.size(0) || !plain) return false;
  for (int64_t l = 0; l < layers; ++l)
    for (int i : {1, 3, 6, 8})  // qkv, o, gate_up, down
      if (weight(l, i).scalar_type() != at::kByte) return false;
  return true;
}

// The next linear's first bytes, fetched by the team's waiting thread while
// this one runs the serial part before it (quant_linear.h's fetch_ahead).
inline void fetch_ahead(const at::Tensor& w, int64_t tokens) {
  if (w.scalar_type() == at::kByte && free_team() != nullptr) quant::fetch_ahead(quant::parse(w), tokens, true);
}

}  // namespace layer_parts

// Returns (this layer's MLP output, the residual stream).  Without a residual
// (the first layer) `hidden` is the residual and is updated in place from the
// second norm on, as the Python layer does with the embeddings.
inline std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o_weight, const std::optional<at::Tensor>& o_bias,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight,
    const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down_weight,
    const std::optional<at::Tensor>& down_bias, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    int64_t num_decode_tokens, const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
    const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
    const at::Tensor& prefill_context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
    double scale, int64_t sliding_window, double logits_soft_cap, const std::optional<at::Tensor>& lora_ids,
    const std::optional<at::Tensor>& qkv_lora_a, const std::optional<at::Tensor>& qkv_lora_b,
    const std::optional<at::Tensor>& o_lora_a, const std::optional<at::Tensor>& o_lora_b,
    const std::optional<at::Tensor>& gate_up_lora_a, const std::optional<at::Tensor>& gate_up_lora_b,
    const std::optional<at::Tensor>& down_lora_a, const std::optional<at::Tensor>& down_lora_b) {
  layer_parts::check_step("llama_layer", hidden, num_decode_tokens);
  const layer_parts::Lora adapters{lora_ids, {qkv_lora_a, qkv_lora_b, o_lora_a, o_lora_b, gate_up_lora_a,
                                              gate_up_lora_b, down_lora_a, down_lora_b}};
  const int64_t tokens = hidden.size(0), head_dim = kv_store::head_dim_of(k_cache);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const bool first = !(residual.has_value() && residual->defined());
  const at::Tensor stream = first ? hidden : *residual;
  layer_parts::fetch_ahead(qkv_weight, tokens);
  at::Tensor x = first ? rms_norm(hidden, input_norm, eps, std::nullopt)
                       : rms_norm(hidden, input_norm, eps, stream);

  const at::Tensor qkv = layer_parts::adapted_linear(x, qkv_weight, qkv_bias, adapters, 0, q_size, kv_size);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "llama_layer: qkv_proj gives ", qkv.size(1),
              " columns, the heads need ", q_size + 2 * kv_size);
  layer_parts::fetch_ahead(o_weight, tokens);
  const at::Tensor q = layer_parts::rotate_and_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                     num_kv_heads, head_dim, q_norm, k_norm, eps);
  const layer_parts::Rows rows{num_decode_tokens, decode_block_tables, decode_context_lens,
                               prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens};
  const at::Tensor attn = layer_parts::attend(q, k_cache, v_cache, rows, scale, sliding_window, logits_soft_cap);

  const at::Tensor o = layer_parts::adapted_linear(attn.view({tokens, q_size}), o_weight, o_bias, adapters, 1);
  layer_parts::fetch_ahead(gate_up_weight, tokens);
  x = rms_norm(o, post_norm, eps, stream);
  const at::Tensor up = layer_parts::adapted_linear(x, gate_up_weight, gate_up_bias, adapters, 2);
  layer_parts::fetch_ahead(down_weight, tokens);
  const at::Tensor gated = silu_and_mul(up);
  return {layer_parts::adapted_linear(gated, down_weight, down_bias, adapters, 3), stream};
}

// What every call of a Llama-style stack passes unchanged, handed to C++
// once: `weights`, twelve a layer in llama_layer's order (input norm, qkv
// weight and bias, o weight and bias, post norm, gate_up weight and bias,
// down weight and bias, q_norm, k_norm; biases and the per-head norms may be
// None), or twenty with the layer's LoRA stacks after them (A then B of qkv,
// o, gate_up, down); layer l's K and V caches; and the model's final norm
// (None: the op returns the last MLP output, not the normed state).  Why:
// passed as lists, the 360 weights and 60 caches of SmolLM2 were converted
// from Python objects on every call, ~45 us of a ~4.4 ms one-stream token on
// the Xeon without BF16 (docs/performance.md).  One class a build (the inline
// namespace), as several builds load into one process.
inline namespace PAGEDSERVE_OPS_NS {
struct LayerStackArgs : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;  // undefined where None
  std::vector<at::Tensor> k_caches, v_caches;
  std::optional<at::Tensor> final_norm;
  int64_t per_layer;

  LayerStackArgs(const c10::List<std::optional<at::Tensor>>& weight_list, std::vector<at::Tensor> k,
                 std::vector<at::Tensor> v, std::optional<at::Tensor> norm, int64_t per)
      : k_caches(std::move(k)), v_caches(std::move(v)), final_norm(std::move(norm)), per_layer(per) {
    const int64_t layers = int64_t(k_caches.size());
    TORCH_CHECK_VALUE(per == 12 || per == 20, "llama_layers: 12 weights a layer, or 20 with LoRA stacks; got ",
                      per);
    TORCH_CHECK_VALUE(layers > 0 && int64_t(v_caches.size()) == layers &&
                          int64_t(weight_list.size()) == per * layers,
                      "llama_layers: ", layers, " K caches, ", v_caches.size(), " V caches and ",
                      weight_list.size(), " weights; expected one K and one V cache and ", per, " weights a layer");
    weights.reserve(weight_list.size());
    for (size_t i = 0; i < weight_list.size(); ++i) {
      const std::optional<at::Tensor> w = weight_list.get(i);
      weights.push_back(w.has_value() ? *w : at::Tensor());
    }
    for (int64_t l = 0; l < layers; ++l)
      for (int i : {0, 1, 3, 5, 6, 8})  // the norms and the four projections
        TORCH_CHECK_VALUE(weights[per * l + i].defined(), "llama_layers: layer ", l, " weight ", i, " is None");
  }
  int64_t layers() const { return int64_t(k_caches.size()); }
};
}  // inline namespace PAGEDSERVE_OPS_NS

// Every layer of a Llama-style stack, in one call: llama_layer for each in
// turn, so the numbers are the per-layer calls' to the bit, then the final
// norm where `stack` holds one (as the model's RMSNorm module would run it).
// Why: a call from Python costs ~21 us on a one-stream SmolLM2 step on AVX2
// (29 arguments parsed and boxed, on code the previous layer's weight stream
// pushed out of the caches), ~0.6 ms of a ~12 ms step for 30 layers.  Every
// layer shares the heads, eps, scale and features; `lora_ids` is given
// exactly when `stack` holds the LoRA stacks.  Returns (the last MLP output,
// or with the final norm the model's normed hidden states; the residual stream).
inline std::tuple<at::Tensor, at::Tensor> llama_layers(
    const at::Tensor& hidden, const c10::intrusive_ptr<LayerStackArgs>& stack, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slot_mapping, int64_t num_decode_tokens,
    const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
    const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
    const at::Tensor& prefill_context_lens, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    int64_t sliding_window, double logits_soft_cap, const std::optional<at::Tensor>& lora_ids) {
  const LayerStackArgs& args = *stack;
  const int64_t layers = args.layers(), kPer = args.per_layer;
  TORCH_CHECK_VALUE((lora_ids.has_value() && lora_ids->defined()) == (kPer == 20),
                    "llama_layers: lora_ids go with LoRA stacks (20 weights a layer), got ", kPer, " a layer");
  auto weight = [&](int64_t l, int i) -> const at::Tensor& { return args.weights[kPer * l + i]; };
  auto optional = [&](int64_t l, int i) {
    const at::Tensor& w = weight(l, i);
    return w.defined() ? std::optional<at::Tensor>(w) : std::optional<at::Tensor>();
  };
  auto run = [&]() -> std::tuple<at::Tensor, at::Tensor> {
    at::Tensor h = hidden;
    std::optional<at::Tensor> residual;  // none before the first layer: hidden is the stream
    for (int64_t l = 0; l < layers; ++l) {
      auto stacked = [&](int i) { return i < kPer ? optional(l, i) : std::optional<at::Tensor>(); };
      std::tie(h, residual) = llama_layer(
          h, residual, weight(l, 0), weight(l, 1), optional(l, 2), weight(l, 3), optional(l, 4), weight(l, 5),
          weight(l, 6), optional(l, 7), weight(l, 8), optional(l, 9), optional(l, 10), optional(l, 11), cos, sin,
          args.k_caches[l], args.v_caches[l], slot_mapping, num_decode_tokens, decode_block_tables,
          decode_context_lens, prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, num_heads,
          num_kv_heads, eps, scale, sliding_window, logits_soft_cap, lora_ids, stacked(12), stacked(13),
          stacked(14), stacked(15), stacked(16), stacked(17), stacked(18), stacked(19));
    }
    if (args.final_norm.has_value()) h = rms_norm(h, *args.final_norm, eps, residual);
    return {h, *residual};
  };
  return layer_parts::few_decode_rows(hidden, num_decode_tokens, kPer == 12, layers, weight) ? with_team(run)
                                                                                                : run();
}

}  // namespace pagedserve
