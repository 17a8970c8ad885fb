"""Gemma 2 and Gemma 3 (text) over the shared layers.

What sets them apart from Llama, each following HF's modeling_gemma2/3:
  * RMSNorm with a (1 + w) weight, applied in float32 (layers/norm.py GemmaRMSNorm);
  * four norms per layer, the block outputs normed before they join the residual:

        x = post_attention_norm(attn(input_norm(h)));       h = h + x
        x = post_feedforward_norm(mlp(pre_feedforward_norm(h))); h = h + x

  * the embedding scaled by sqrt(hidden_size), rounded to the model's dtype;
  * a GELU (tanh) gated MLP; scores scaled by query_pre_attn_scalar ** -0.5;
  * interleaved sliding and global layers (config.layer_types);
  * Gemma 2: the scores capped by attn_logit_softcapping and the logits by
    final_logit_softcapping (cap * tanh(x / cap));
  * Gemma 3: an RMSNorm over each head of q and k, and RoPE with a local base
    on the sliding layers, the (scaled) global one on the others.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.distributed.partition import Partition
from engine.model.layers import fused_layer
from engine.model.layers.activation import MLP
from engine.model.layers.attention import Attention
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.models.args import ModelArgs
from engine.model.models.llama import LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, part: Partition, layer_index: int, kernels, group,
                 qk_norm=None) -> None:
        super().__init__()
        size, eps = args.hidden_size, args.rms_norm_eps
        self.layer_type = args.layer_types[layer_index]
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Attention(args, part, layer_index, kernels, group, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = MLP(size, part.intermediate_size, False, kernels, group, args.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.fuse = True  # the whole layer in one compiled call where eligible (fused_layer.py)
        self._fused = fused_layer.UNKNOWN  # its fused_layer.Bound, or None, from the first step

    def forward(self, rope_tables, hidden, residual, kv_cache, meta):
        """(the previous layer's normed MLP output, the residual stream) -> the
        same for this layer; each pre-norm adds its input into the residual first."""
        if residual is None:  # the first layer: the scaled embeddings are the residual
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope_tables[self.layer_type], hidden, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    LAYER = GemmaDecoderLayer
    NORM = GemmaRMSNorm
    @classmethod
    def model_args(cls, hf_config) -> ModelArgs:
        return ModelArgs.from_hf_config(
            hf_config,
            hidden_act=getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act,
            attn_scale=hf_config.query_pre_attn_scalar**-0.5,
            attn_soft_cap=getattr(hf_config, "attn_logit_softcapping", None),
            final_soft_cap=getattr(hf_config, "final_logit_softcapping", None),
            o_bias=False,
        )

    def make_rope(self, hf_config, max_positions: int) -> nn.Module:
        """One table per kind of layer (equal where the config does not key RoPE by kind)."""
        return nn.ModuleDict({kind: RotaryEmbedding(hf_config, max_positions, kind)
                              for kind in sorted(set(self.args.layer_types))})

    def forward(self, input_ids, positions, kv_cache, meta) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF rounds the scale to the model's dtype before multiplying.
        hidden = hidden * torch.tensor(self.args.hidden_size**0.5, dtype=hidden.dtype)
        rope_tables = {kind: rope.tables(positions, hidden.dtype) for kind, rope in self.rope.items()}
        hidden, residual = fused_layer.run_kinds(self.layers, rope_tables, hidden, kv_cache, meta,
                                                 self.layer_stack.lora)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.args.final_soft_cap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    QK_NORM = GemmaRMSNorm

