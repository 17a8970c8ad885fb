// One Llama-style decoder layer for a batch of decode tokens, in one op.
//
// Why: at one stream the decode step of a small model is not its weights'
// bytes but the glue between them.  SmolLM2 (30 layers) makes ~50 Python and
// aten calls a layer, ~6 ms of a ~18 ms step on an AVX2 EPYC, while its
// linears stream at the memory's rate.  This op runs the same compiled ops
// in the same order, so its numbers are the layer's to the bit, and the
// layer costs one call from Python:
//
//   hidden ─► RMSNorm(+residual) ─► qkv ─► RoPE(q, k) ─► K/V into the cache
//                                      └─► decode attention ─► o_proj
//          ─► RMSNorm(+residual) ─► gate_up ─► SiLU·mul ─► down ─► hidden
//
// qkv's columns are [q heads | k heads | v heads]; q and k are rotated in
// place inside it (rows of heads, any token stride), as the Python path does.
// Only what that path would send to these same ops comes here
// (engine/model/layers/fused_decode.py checks): bf16, decode tokens only, no
// tensor parallelism, no per-head norms, SiLU.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "activation.h"
#include "decode.h"
#include "kv_store.h"
#include "linear.h"
#include "linear_packed.h"
#include "rms_norm.h"
#include "rope.h"

namespace pagedserve {
namespace decode_layer {

// x W^T (+ b) with W as kernels.linear would take it: packed or [out, in].
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
#if defined(PAGEDSERVE_HAS_PACKED_LINEAR)
  if (w.dim() == 4) return linear_bf16_packed(x, w, b, false);
#endif
  return linear_bf16(x, w, b, false);
}

}  // namespace decode_layer

// Returns (this layer's MLP output, the residual stream).  Without a residual
// (the first layer) `hidden` is the residual and is updated in place from the
// second norm on, as the Python layer does with the embeddings.
inline std::tuple<at::Tensor, at::Tensor> llama_decode_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o_weight, const std::optional<at::Tensor>& o_bias,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight,
    const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down_weight,
    const std::optional<at::Tensor>& down_bias, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& context_lens,
    int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t sliding_window,
    double logits_soft_cap) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16,
              "llama_decode_layer: hidden must be bf16 [tokens, hidden]");
  const int64_t tokens = hidden.size(0), head_dim = k_cache.size(-1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const bool first = !(residual.has_value() && residual->defined());
  const at::Tensor stream = first ? hidden : *residual;
  at::Tensor x = first ? rms_norm(hidden, input_norm, eps, std::nullopt)
                       : rms_norm(hidden, input_norm, eps, stream);

  const at::Tensor qkv = decode_layer::linear(x, qkv_weight, qkv_bias);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "llama_decode_layer: qkv_proj gives ",
              qkv.size(1), " columns, the heads need ", q_size + 2 * kv_size);
  const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
  rotary_embedding(qk, cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads).contiguous();
  const at::Tensor k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  store_kvcache(k, v, k_cache, v_cache, slot_mapping);
  const at::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                 sliding_window, logits_soft_cap);

  const at::Tensor o = decode_layer::linear(attn.view({tokens, q_size}), o_weight, o_bias);
  x = rms_norm(o, post_norm, eps, stream);
  const at::Tensor gated = silu_and_mul(decode_layer::linear(x, gate_up_weight, gate_up_bias));
  return {decode_layer::linear(gated, down_weight, down_bias), stream};
}

}  // namespace pagedserve
