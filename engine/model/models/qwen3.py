"""Qwen3: the Llama layout plus an RMSNorm over each head of q and k before
RoPE (`q_norm`, `k_norm`: one weight of head_dim each), an explicit head_dim
that need not be hidden_size / heads, and no q/k/v bias by default. Sliding
layers, where a config turns them on, come from its layer_types."""

from __future__ import annotations

from engine.model.layers.norm import RMSNorm
from engine.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM = RMSNorm
