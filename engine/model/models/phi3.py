"""Phi-3: the Llama layout, with checkpoints that store q/k/v as one
`qkv_proj` and gate/up as one `gate_up_proj` already, in the order our fused
projections use; a sliding window on every layer where the config sets one.

Tensor parallelism would have to cut those fused tensors into q, k and v
slices per rank; it is refused (models/registry.py) until the partition
learns to.
"""

from __future__ import annotations

from engine.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    FUSED_IN_CHECKPOINT = ("qkv_proj", "gate_up_proj")
    TENSOR_PARALLEL = False
