"""Rotary position embeddings (RoPE) as HF's Llama applies them: cos/sin
tables built once from transformers' own maths for the config and looked up
per step.  The rotation itself (rotate-half, of q and k together) is the
kernel backend's ``rope`` (kernels.reference.rope_reference)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, built once from HF's own RoPE maths.

    The inverse frequencies and the attention scaling come from transformers'
    rotary-embedding class for this config, so every RoPE variant it knows
    (default, linear, llama3, yarn, ...) is computed the way the model was trained.
    """

    def __init__(self, hf_config, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = _rope_parameters(hf_config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin for the step's positions, [tokens, head_dim] in the model's
        dtype (as HF rounds them): looked up once per step, shared by every layer."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _rope_parameters(hf_config) -> tuple[torch.Tensor, float]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(
            f"RoPE type {rope_type!r} depends on the sequence length and is not supported; "
            f"supported: default, linear, llama3, yarn"
        )
    rotary = LlamaRotaryEmbedding(config=hf_config)
    return rotary.inv_freq, float(rotary.attention_scaling)
