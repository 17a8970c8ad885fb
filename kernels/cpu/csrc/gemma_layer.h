// One Gemma 2 / Gemma 3 decoder layer over a step's tokens, in one op: the
// glue llama_layer.h removes for Llama (a call from Python a layer instead
// of ~60), with llama_layer's parts (layer_parts: the linears, quantized or
// bf16, RoPE and the K/V store through pointers, the decode / prefill
// attention split) and Gemma's own between them (engine/model/models/gemma.py):
//
//   hidden ─► GemmaNorm(+residual) ─► qkv ─► [GemmaNorm of each q and k head] ─► RoPE
//          ─► K/V into the cache ─► attention (window, soft cap) ─► o_proj ─► GemmaNorm
//          ─► GemmaNorm(+residual) ─► gate_up ─► GELU-tanh·mul ─► down ─► GemmaNorm
//
// Gemma's norm and GELU have no compiled op: the modules run them as torch
// ops (layers/norm.py GemmaRMSNorm, kernels.reference's gelu_tanh_and_mul),
// so here they are the same aten ops in the same order, which gives the
// modules' numbers to the bit (a compiled norm would sum the mean in another
// order).  The rest is llama_layer's, so it is the modules' too.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "llama_layer.h"

namespace pagedserve {
namespace gemma_parts {

// GemmaRMSNorm.forward: (x / rms(x) * (1 + w)) in float32, cast back; with a
// residual, residual += x first (in place) and the sum is what is normed.
inline at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                       const std::optional<at::Tensor>& residual = std::nullopt) {
  const at::Tensor src = residual ? residual->add_(x) : x;
  const at::Tensor x32 = src.to(at::kFloat);
  const at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  return (normed * (weight.to(at::kFloat) + 1.0)).to(src.scalar_type());
}

// Gemma 3's q_norm / k_norm over each head, written back into qkv's rows.
// Attention._norm_heads norms copies of the heads and RoPE rotates those;
// norming them in place in qkv and rotating them there changes no number.
inline void norm_heads(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps) {
  const int64_t tokens = qkv.size(0);
  const at::Tensor qk = qkv.narrow(1, 0, (num_heads + num_kv_heads) * head_dim)
                            .view({tokens, num_heads + num_kv_heads, head_dim});
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  q.copy_(norm(q.reshape({-1, head_dim}), q_norm, eps).view(q.sizes()));
  k.copy_(norm(k.reshape({-1, head_dim}), k_norm, eps).view(k.sizes()));
}

// gelu(gate, tanh) * up over [gate | up], as the reference gelu_tanh_and_mul.
inline at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  const int64_t width = x.size(-1) / 2;
  return at::gelu(x.narrow(-1, 0, width), "tanh") * x.narrow(-1, width, width);
}

}  // namespace gemma_parts

// Returns (this layer's normed MLP output, the residual stream), as
// GemmaDecoderLayer.forward does; without a residual (the first layer)
// `hidden`, the scaled embeddings, is the residual.  The weights in
// llama_layer's order with Gemma's two extra norms where they act: the
// pre-feedforward norm after the post-attention one, the post-feedforward
// norm after down_proj's bias; q_norm and k_norm are Gemma 3's (both or
// None).  cos / sin: this layer kind's RoPE tables.
inline std::tuple<at::Tensor, at::Tensor> gemma_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o_weight, const std::optional<at::Tensor>& o_bias,
    const at::Tensor& post_attention_norm, const at::Tensor& pre_feedforward_norm,
    const at::Tensor& gate_up_weight, const std::optional<at::Tensor>& gate_up_bias,
    const at::Tensor& down_weight, const std::optional<at::Tensor>& down_bias,
    const at::Tensor& post_feedforward_norm, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    int64_t num_decode_tokens, const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
    const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
    const at::Tensor& prefill_context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
    double scale, int64_t sliding_window, double logits_soft_cap) {
  layer_parts::check_step("gemma_layer", hidden, num_decode_tokens);
  const int64_t tokens = hidden.size(0), head_dim = kv_store::head_dim_of(k_cache);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const bool first = !(residual.has_value() && residual->defined());
  const at::Tensor stream = first ? hidden : *residual;
  at::Tensor x = first ? gemma_parts::norm(hidden, input_norm, eps)
                       : gemma_parts::norm(hidden, input_norm, eps, stream);

  const at::Tensor qkv = layer_parts::linear(x, qkv_weight, qkv_bias);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "gemma_layer: qkv_proj gives ", qkv.size(1),
              " columns, the heads need ", q_size + 2 * kv_size);
  const bool normed = q_norm.has_value() && q_norm->defined();
  TORCH_CHECK(normed == (k_norm.has_value() && k_norm->defined()), "gemma_layer: q_norm without k_norm");
  if (normed) gemma_parts::norm_heads(qkv, *q_norm, *k_norm, num_heads, num_kv_heads, head_dim, eps);
  const at::Tensor q = layer_parts::rotate_and_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                     num_kv_heads, head_dim, std::nullopt, std::nullopt, eps);
  const layer_parts::Rows rows{num_decode_tokens, decode_block_tables, decode_context_lens,
                               prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens};
  const at::Tensor attn = layer_parts::attend(q, k_cache, v_cache, rows, scale, sliding_window, logits_soft_cap);

  const at::Tensor o = layer_parts::linear(attn.view({tokens, q_size}), o_weight, o_bias);
  x = gemma_parts::norm(gemma_parts::norm(o, post_attention_norm, eps), pre_feedforward_norm, eps, stream);
  const at::Tensor gated = gemma_parts::gelu_tanh_and_mul(layer_parts::linear(x, gate_up_weight, gate_up_bias));
  return {gemma_parts::norm(layer_parts::linear(gated, down_weight, down_bias), post_feedforward_norm, eps),
          stream};
}

}  // namespace pagedserve
