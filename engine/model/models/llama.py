"""The Llama family over a paged KV cache: Llama, SmolLM2, Mistral and Qwen2
(with their sliding windows), and the base the other families build on.

The math follows HF transformers' modeling_llama step for step (same RMSNorm
casts, same rotate-half RoPE, same residual order), so that in float32 greedy
outputs match `generate()` token for token. What differs is the data layout:

    HF:    hidden [batch, seq_len, dim], one padded rectangle per batch
    here:  hidden [num_tokens, dim], the scheduled tokens of every sequence
           concatenated, decodes first, then prefill chunks:

           | d0 | d1 | d2 |  p0 p0 p0 p0 p0  |  p1 p1 p1 |
            one token each    chunk of seq 3    chunk of seq 4

No padding is computed, and attention reads K/V through block tables
(`AttentionMetadata`), never from a per-request contiguous cache.

Two pairs of projections are fused into one matmul each (q/k/v -> qkv_proj,
gate/up -> gate_up_proj); `load_weights` (models/weights.py) packs the
checkpoint's separate tensors into them.

A family that differs only in config data (which layers slide, biases) is
this class; one that adds a piece overrides a class attribute (Qwen3's
`QK_NORM`) or a method (Gemma's layer and embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention_metadata import AttentionMetadata
from engine.model.distributed.partition import Partition
from engine.model.layers.activation import MLP
from engine.model.layers.attention import Attention
from engine.model.layers.embedding import VocabParallelEmbedding, compute_logits
from engine.model.layers import fused_layer
from engine.model.layers.linear import Linear, packed
from engine.model.layers.moe import FusedMoE
from engine.model.layers.norm import RMSNorm
from engine.model.layers.quantization import QuantLinear, is_quant_weight
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.models.args import ModelArgs
from engine.model.models.weights import CheckpointLoading

def _mlp(args: ModelArgs, part: Partition, layer_index: int, kernels, group) -> nn.Module:
    """The layer's feed-forward block: the gated MLP, or the experts where
    a mixture-of-experts family puts them (args.moe)."""
    moe = args.moe
    if moe is not None and moe.layers[layer_index]:
        return FusedMoE(args.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                        kernels, renormalize=moe.renormalize,
                        weights_in_input_dtype=moe.weights_in_input_dtype, group=group)
    return MLP(args.hidden_size, part.intermediate_size, args.mlp_bias, kernels, group,
               args.hidden_act)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, part: Partition, layer_index: int, kernels, group,
                 qk_norm=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.self_attn = Attention(args, part, layer_index, kernels, group, qk_norm)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.mlp = _mlp(args, part, layer_index, kernels, group)
        self.fuse = True  # the whole layer in one compiled call where eligible (fused_layer.py)
        self._fused = fused_layer.UNKNOWN  # its fused_layer.Bound, or None, from the first step

    def forward(self, rope_tables, hidden, residual, kv_cache, meta):
        """(the previous layer's MLP output, the residual stream) -> the same for
        this layer. Each norm adds its input into the residual first, so
        `hidden + residual` after the last layer is HF's hidden state."""
        if residual is None:  # the first layer: the embeddings are the residual
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope_tables, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CheckpointLoading, nn.Module):
    """The whole model, or with `group` set, one tensor-parallel rank's slice
    of it (`partition`): the layers' sizes are the slice's, the hidden size
    and everything between the layers are whole and equal on every rank."""

    LAYER: type[nn.Module] = DecoderLayer
    NORM: type[nn.Module] = RMSNorm
    QK_NORM: type[nn.Module] | None = None  # a per-head norm of q and k before RoPE
    TENSOR_PARALLEL = True  # whether its checkpoints can be sliced per rank

    @classmethod
    def model_args(cls, hf_config) -> ModelArgs:
        """What this family reads from an HF config (Qwen2 biases q/k/v, not o)."""
        if any(name.startswith("Qwen2") for name in getattr(hf_config, "architectures", None) or ()):
            return ModelArgs.from_hf_config(hf_config, qkv_bias=True, o_bias=False)
        return ModelArgs.from_hf_config(hf_config)

    def __init__(self, hf_config, max_positions: int, kernels,
                 partition: Partition | None = None, group=None) -> None:
        super().__init__()
        self.args = args = self.model_args(hf_config)
        self.partition = part = partition or Partition.of(args)
        self.group = group
        self.embed_tokens = VocabParallelEmbedding(part, args.hidden_size, kernels, group)
        self.layers = nn.ModuleList(
            self.LAYER(args, part, i, kernels, group, self.QK_NORM) for i in range(args.num_layers))
        self.norm = self.NORM(args.hidden_size, args.rms_norm_eps, kernels)
        # The loop over them and the final norm, in one op where it can.
        self.layer_stack = fused_layer.LayerStack(self.layers, self.norm)
        self.rope = self.make_rope(hf_config, max_positions)
        self.kernels = kernels
        self.lm_head = None
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, part.vocab_rows, False, kernels)

    def make_rope(self, hf_config, max_positions: int) -> nn.Module:
        return RotaryEmbedding(hf_config, max_positions)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every scheduled token: [num_tokens, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        rope_tables = self.rope.tables(positions, hidden.dtype)
        return self.layer_stack(rope_tables, hidden, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary (rank 0's; the other ranks get None)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return compute_logits(self.kernels, hidden, weight, self.group, self.args.vocab_size)

    def pack_linear_weights(self) -> None:
        """Every projection's weight, and the LM head's, into the layout the
        kernel backend multiplies fastest (kernels.pack_linear; unchanged where
        it has none).  A tied head is the embedding's weight: packed, it serves
        both (kernels.embedding reads rows from it), never two copies."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight = packed(self.kernels, module.weight)
        if self.lm_head is None and is_quant_weight(self.embed_tokens.weight):
            # A GGUF table stays a buffer; its row lookups gather out of any layout.
            self.embed_tokens.weight = self.kernels.pack_linear(self.embed_tokens.weight)
        elif self.lm_head is None:
            self.embed_tokens.weight = packed(self.kernels, self.embed_tokens.weight)

    def quantize_weights(self, type_name: str) -> None:
        """Every decoder layer's linear layers quantized into `type_name`
        (Q8_0, Q4_K, ...: layers/quantization.py), round to nearest as
        llama.cpp's quantizer does. The embedding and the LM head stay as
        they are: the head decides every sampled token, and GGUF files keep
        it at 6 bits or more (the default model's is Q8_0, its layers Q4_1)."""
        for layer in self.layers:
            for name, module in list(layer.named_modules()):
                if type(module) is Linear:
                    layer.set_submodule(name, QuantLinear.from_linear(module, type_name))
