"""Rotary position embeddings (RoPE) as HF applies them: cos/sin tables built
once from transformers' own maths for the config and looked up per step.
The rotation itself (rotate-half, of q and k together) is the kernel
backend's ``rope`` (kernels.reference.rope_reference).

Families with two kinds of layers (Gemma 3: sliding layers rotate with a
local base, global layers with the scaled global one) key their RoPE
parameters by layer type; `RotaryEmbedding(config, n, layer_type)` builds
the tables of one kind.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, built once from HF's own RoPE maths.

    The inverse frequencies and the attention scaling come from transformers'
    RoPE initialisers for this config, so every variant it knows (default,
    linear, llama3, yarn, ...) is computed the way the model was trained.
    """

    def __init__(self, hf_config, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_parameters(hf_config, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin for the step's positions, [tokens, head_dim] in the model's
        dtype (as HF rounds them): looked up once per step, shared by every layer."""
        return (self.cos.index_select(0, positions).to(dtype),
                self.sin.index_select(0, positions).to(dtype))


def rope_parameters(hf_config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) of the config's RoPE, for one
    layer type where the config keys its parameters by layer type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    keyed = layer_type is not None and layer_type in params
    if keyed:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported (dynamic and longrope depend on the "
            f"sequence length); supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor < 1 (RoPE on part of each head) is not supported")
    kwargs = {"layer_type": layer_type} if keyed else {}
    if rope_type == "default":
        return _default_inv_freq(hf_config, params["rope_theta"]), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kwargs)
    return inv_freq, float(scaling)


def _default_inv_freq(hf_config, base: float) -> torch.Tensor:
    """The original RoPE: 1 / base^(2i / head_dim), as transformers computes it."""
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
