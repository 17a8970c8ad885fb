"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

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
gate/up -> gate_up_proj); `load_weights` packs the checkpoint's separate
tensors into them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.attention_metadata import AttentionMetadata
from engine.model.distributed.partition import Partition
from engine.model.layers.activation import MLP
from engine.model.layers.attention import Attention
from engine.model.layers.embedding import VocabParallelEmbedding, compute_logits
from engine.model.layers.linear import Linear, packed
from engine.model.layers.norm import RMSNorm
from engine.model.layers.quantization import Int4Linear
from engine.model.layers.rotary import RotaryEmbedding

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class LlamaArgs:
    """The few numbers of an HF config the model needs, checked once."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config) -> "LlamaArgs":
        architectures = getattr(config, "architectures", None) or ["LlamaForCausalLM"]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        qkv_bias = architecture == "Qwen2ForCausalLM" or bool(
            getattr(config, "attention_bias", False)
        )
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=qkv_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
        )


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, part: Partition, layer_index: int, kernels, group) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.self_attn = Attention(args, part, layer_index, kernels, group)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.mlp = MLP(args.hidden_size, part.intermediate_size, args.mlp_bias, kernels, group)

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


# Checkpoint tensors that are packed into one of our fused projections:
# checkpoint name -> (fused name, index of the shard inside it).
PACKED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """The whole model, or with `group` set, one tensor-parallel rank's slice
    of it (`partition`): the layers' sizes are the slice's, the hidden size
    and everything between the layers are whole and equal on every rank."""

    def __init__(self, hf_config, max_positions: int, kernels,
                 partition: Partition | None = None, group=None) -> None:
        super().__init__()
        self.args = args = LlamaArgs.from_hf_config(hf_config)
        self.partition = part = partition or Partition.of(args)
        self.group = group
        self.embed_tokens = VocabParallelEmbedding(part, args.hidden_size, kernels, group)
        self.layers = nn.ModuleList(
            DecoderLayer(args, part, i, kernels, group) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.rope = RotaryEmbedding(hf_config, max_positions)
        self.kernels = kernels
        self.lm_head = None
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, part.vocab_rows, False, kernels)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every scheduled token: [num_tokens, hidden_size]."""
        hidden, residual = self.embed_tokens(input_ids), None
        rope_tables = self.rope.tables(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(rope_tables, hidden, residual, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

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
        if self.lm_head is None:
            self.embed_tokens.weight = packed(self.kernels, self.embed_tokens.weight)

    def quantize_int4(self) -> None:
        """Every decoder layer's linear layers to int4 (engine/model/layers/quantization.py).
        The embedding and the LM head stay bf16: the head decides every sampled
        token, and GGUF files keep it at 8 bits or more (the default model's
        token_embd is Q8_0, its layers Q4_1)."""
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.qkv_proj = Int4Linear.from_linear(attention.qkv_proj)
            attention.o_proj = Int4Linear.from_linear(attention.o_proj)
            mlp.gate_up_proj = Int4Linear.from_linear(mlp.gate_up_proj)
            mlp.down_proj = Int4Linear.from_linear(mlp.down_proj)

    # -- weights -------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model, packing fused projections."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, offset = self._target_of(name)
            if target is None:
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            rows = tensor.shape[0]
            start = self._shard_offset(target, offset)
            param.data[start : start + rows].copy_(tensor)
            loaded.add(f"{target}#{offset}")
        self._check_all_loaded(params, loaded)

    def _target_of(self, name: str) -> tuple[str | None, int]:
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None, 0
        if name == "lm_head.weight" and self.lm_head is None:
            return None, 0  # tied: the embedding is the head
        for part, (fused, index) in PACKED_SHARDS.items():
            if f".{part}." in name:
                return name.replace(part, fused), index
        return name, 0

    def _shard_offset(self, target: str, index: int) -> int:
        """Where a checkpoint tensor (this rank's slice of it) starts in its fused projection."""
        part, head_dim = self.partition, self.args.head_dim
        if ".qkv_proj." in target:
            q, kv = part.num_heads * head_dim, part.num_kv_heads * head_dim
            return (0, q, q + kv)[index]
        if ".gate_up_proj." in target:
            return index * part.intermediate_size
        return 0

    def _check_all_loaded(self, params: dict, loaded: set[str]) -> None:
        missing = []
        for name in params:
            shards = 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
            if any(f"{name}#{i}" not in loaded for i in range(shards)):
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")
