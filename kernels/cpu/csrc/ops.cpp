// Torch ops: paged decode and prefill attention over the paged KV cache, read
// in place (same contract as kernels/reference.py), and the new tokens' K/V
// written into it (kv_store.h); linear layers over bf16 weights (linear.h;
// packed for the bf16 dot product: linear_packed.h) and over GGUF's
// quantized blocks (quant_linear.h); and the element-wise
// ops of a Llama layer, one pass each: RMSNorm with its residual add
// (rms_norm.h), RoPE (rope.h), SiLU(gate) * up (activation.h); and a whole
// Llama layer over a step's tokens, those ops chained in C++, and a stack of
// such layers in one call (llama_layer.h); a Gemma 2 / 3 layer alike, a call
// a layer (gemma_layer.h); multi-LoRA's shrink and expand, each row
// through its own adapter (lora.h); and greedy decoding's argmax (argmax.h).
//
// Both attention ops take two optional features: sliding_window W (a query
// sees only its last W tokens; blocks before the window are never read) and
// logits_soft_cap c (Gemma 2: each score s becomes c * tanh(s / c)); 0 = off.
// Prefill also takes causal (true; false: encoders, every query token sees
// its whole context).
//
// Work items are (sequence, kv head) for decode, (sequence, kv head, tile of
// query tokens) for prefill: the query heads of a kv group share every K/V
// load.  Items go longest first to whichever thread is free.  A decode batch
// too small or too ragged to keep every thread busy splits its long
// sequences into kPartition-token items and merges them afterwards.
//
// Built once per ISA (-DPAGEDSERVE_ISA_*) under its own op namespace
// (-DPAGEDSERVE_OPS_NS), so several builds can be loaded side by side.
#include <torch/library.h>

#include <string>

#ifndef PAGEDSERVE_OPS_NS
#error "build with -DPAGEDSERVE_OPS_NS=<op namespace>"
#endif

#include "activation.h"
#include "argmax.h"
#include "decode.h"
#include "gemma_layer.h"
#include "kv_store.h"
#include "linear.h"
#include "linear_packed.h"
#include "llama_layer.h"
#include "lora.h"
#include "prefill.h"
#include "quant_linear.h"
#include "rms_norm.h"
#include "rope.h"

namespace pagedserve {
namespace {

std::string isa_name() { return PAGEDSERVE_ISA_NAME; }

// Whether many-token linears run on AMX's tiles in this process (amx.h).
bool amx_in_use() {
#if defined(PAGEDSERVE_HAS_AMX)
  return amx::available();
#else
  return false;
#endif
}

// Whether quant_linear wants K-quant and legacy 4- and 5-bit weights in 16-row panels (kernels/quant.py):
// the AVX512-VNNI build, where AMX does not take the many-token calls (its
// tiles read the file's order).
bool quant_panels() {
#if defined(PAGEDSERVE_QUANT_VNNI)
  return !amx_in_use();
#else
  return false;
#endif
}

}  // namespace
}  // namespace pagedserve

#define PAGEDSERVE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDSERVE_STRING_(x) #x
#define PAGEDSERVE_STRING(x) PAGEDSERVE_STRING_(x)  // the namespace's name, in a schema

PAGEDSERVE_LIBRARY(PAGEDSERVE_OPS_NS, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int sliding_window=0, "
        "float logits_soft_cap=0.0) -> Tensor",
        &pagedserve::paged_decode_attention);
  m.def("paged_prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor context_lens, float scale, "
        "int sliding_window=0, float logits_soft_cap=0.0, bool causal=True) -> Tensor",
        &pagedserve::paged_prefill_attention);
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias, bool float_out=False) -> Tensor",
        &pagedserve::linear_bf16);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual) -> Tensor",
        &pagedserve::rms_norm);
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &pagedserve::rotary_embedding);
  m.def("silu_and_mul(Tensor x) -> Tensor", &pagedserve::silu_and_mul);
  m.def("store_kvcache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()",
        &pagedserve::store_kvcache);
  m.def("llama_layer(Tensor hidden, Tensor(a!)? residual, Tensor input_norm, Tensor qkv_weight, "
        "Tensor? qkv_bias, Tensor o_weight, Tensor? o_bias, Tensor post_norm, Tensor gate_up_weight, "
        "Tensor? gate_up_bias, Tensor down_weight, Tensor? down_bias, Tensor? q_norm, Tensor? k_norm, "
        "Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_decode_tokens, "
        "Tensor decode_block_tables, Tensor decode_context_lens, Tensor prefill_block_tables, "
        "Tensor prefill_cu_seqlens_q, Tensor prefill_context_lens, int num_heads, int num_kv_heads, "
        "float eps, float scale, int sliding_window=0, float logits_soft_cap=0.0, Tensor? lora_ids=None, "
        "Tensor? qkv_lora_a=None, Tensor? qkv_lora_b=None, Tensor? o_lora_a=None, Tensor? o_lora_b=None, "
        "Tensor? gate_up_lora_a=None, Tensor? gate_up_lora_b=None, Tensor? down_lora_a=None, "
        "Tensor? down_lora_b=None) -> (Tensor, Tensor)",
        &pagedserve::llama_layer);
  m.class_<pagedserve::LayerStackArgs>("LayerStackArgs")
      .def(torch::init<const c10::List<std::optional<at::Tensor>>&, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::optional<at::Tensor>, int64_t>());
  m.def("llama_layers(Tensor hidden, __torch__.torch.classes." PAGEDSERVE_STRING(PAGEDSERVE_OPS_NS)
        ".LayerStackArgs stack, Tensor cos, Tensor sin, Tensor slot_mapping, int num_decode_tokens, "
        "Tensor decode_block_tables, Tensor decode_context_lens, Tensor prefill_block_tables, "
        "Tensor prefill_cu_seqlens_q, Tensor prefill_context_lens, int num_heads, int num_kv_heads, float eps, "
        "float scale, int sliding_window=0, float logits_soft_cap=0.0, Tensor? lora_ids=None) "
        "-> (Tensor, Tensor)",
        &pagedserve::llama_layers);
  m.def("gemma_layer(Tensor hidden, Tensor(a!)? residual, Tensor input_norm, Tensor qkv_weight, "
        "Tensor? qkv_bias, Tensor o_weight, Tensor? o_bias, Tensor post_attention_norm, "
        "Tensor pre_feedforward_norm, Tensor gate_up_weight, Tensor? gate_up_bias, Tensor down_weight, "
        "Tensor? down_bias, Tensor post_feedforward_norm, Tensor? q_norm, Tensor? k_norm, Tensor cos, "
        "Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_decode_tokens, "
        "Tensor decode_block_tables, Tensor decode_context_lens, Tensor prefill_block_tables, "
        "Tensor prefill_cu_seqlens_q, Tensor prefill_context_lens, int num_heads, int num_kv_heads, "
        "float eps, float scale, int sliding_window=0, float logits_soft_cap=0.0) -> (Tensor, Tensor)",
        &pagedserve::gemma_layer);
  m.def("quant_linear(Tensor x, Tensor weight, Tensor? bias, bool float_out=False, Tensor? lora_ids=None, "
        "Tensor? lora_a=None, Tensor? lora_b=None, int[]? lora_slices=None) -> Tensor",
        &pagedserve::quant_linear);
  m.def("quant_dequantize(Tensor weight, Tensor? rows=None) -> Tensor", &pagedserve::quant_dequantize);
  m.def("lora_shrink(Tensor x, Tensor lora_a_stack, Tensor row_lora_ids, float scale) -> Tensor",
        &pagedserve::lora_shrink);
  m.def("lora_expand(Tensor(a!) y, Tensor h, Tensor lora_b_stack, Tensor row_lora_ids, int[]? slices=None) "
        "-> Tensor(a!)",
        &pagedserve::lora_expand);
  m.def("row_argmax(Tensor logits) -> Tensor", &pagedserve::row_argmax);
  m.def("isa() -> str", &pagedserve::isa_name);
  m.def("amx() -> bool", &pagedserve::amx_in_use);
  m.def("quant_panels() -> bool", &pagedserve::quant_panels);
#if defined(PAGEDSERVE_HAS_PACKED_LINEAR)
  // AVX512-BF16 and AVX2 builds: kernels.pack_linear asks for it by name and
  // keeps nn.Linear's layout in the portable build.
  m.def("linear_bf16_packed(Tensor x, Tensor weight, Tensor? bias, bool float_out=False, "
        "str activation=\"none\") -> Tensor",
        &pagedserve::linear_bf16_packed);
#endif
}
