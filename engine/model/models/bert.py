"""BERT-style encoders over the paged KV cache: BERT and XLM-RoBERTa, as
embedders (BertModel, XLMRobertaModel: the last hidden states, pooled by the
engine) and cross-encoders (*ForSequenceClassification: a head on the first
token's hidden state).

The math follows HF transformers' modeling_bert step for step, in its order:

    embeddings   word + token type, + position, then LayerNorm
    each layer   a = LayerNorm(o_proj(attention(qkv_proj(x))) + x)      (post-norm)
                 x = LayerNorm(down_proj(gelu(up_proj(a))) + a)          (erf GELU)

Attention is bidirectional (causal=False): every token of a sequence sees the
whole sequence. It still goes through the paged cache: the step stores K/V
into the sequence's blocks and the prefill kernel reads them back, so an
encoder shares the runner's batch layout, block tables and metadata with
the decoders (flat [tokens, hidden] rows, no padding). Encoders take no
prefix-cache hits and are never chunked, so a sequence's first row is its
position 0 and its [CLS] token.

Token types (a cross-encoder's query / document halves) arrive in the high
bits of the token ids (engine/model/pooling/token_types.py). XLM-RoBERTa is
the same network with one type and positions counted from pad_token_id + 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention_metadata import AttentionMetadata
from engine.model.distributed.partition import Partition
from engine.model.layers.activation import PlainMLP
from engine.model.layers.attention import PagedAttention
from engine.model.layers.linear import Linear, packed
from engine.model.layers.norm import LayerNorm
from engine.model.models.args import ModelArgs
from engine.model.models.weights import CheckpointLoading
from engine.model.pooling import token_types

# HF names (after the model prefix) -> ours, applied in order: the attention's
# output dense before the MLP's, whose name ends the same way.
RENAMES = (
    ("encoder.layer.", "layers."),
    ("embeddings.LayerNorm.", "embeddings.norm."),
    ("_embeddings.weight", "_embeddings"),  # the tables are parameters, not modules
    (".attention.output.dense.", ".attention.o_proj."),
    (".attention.output.LayerNorm.", ".attention.norm."),
    (".intermediate.dense.", ".mlp.up_proj."),
    (".output.dense.", ".mlp.down_proj."),
    (".output.LayerNorm.", ".mlp_norm."),
)
# q, k and v land in their rows of the fused qkv_proj (models/weights.py).
QKV_SHARDS = {".attention.self.query.": 0, ".attention.self.key.": 1, ".attention.self.value.": 2}
# Buffers some checkpoints save: arange and zeros, rebuilt rather than read.
BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def check_encoder_config(hf_config) -> None:
    """Refuse what the layers here cannot honour, naming it."""
    if hf_config.hidden_size % hf_config.num_attention_heads:
        raise ValueError(f"hidden_size={hf_config.hidden_size} is not a multiple of "
                         f"num_attention_heads={hf_config.num_attention_heads}")
    position_type = getattr(hf_config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type={position_type!r} is not supported; "
                         "supported: absolute")
    if getattr(hf_config, "is_decoder", False) or getattr(hf_config, "add_cross_attention", False):
        raise ValueError("a BERT decoder (is_decoder / add_cross_attention) is not supported")


class EncoderEmbeddings(nn.Module):
    """LayerNorm(word + token type + position), as HF's BertEmbeddings adds them."""

    def __init__(self, args: ModelArgs, type_vocab_size: int, position_offset: int) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.word_embeddings = nn.Parameter(torch.empty(args.vocab_size, hidden))
        self.position_embeddings = nn.Parameter(
            torch.empty(args.max_position_embeddings + position_offset, hidden))
        self.token_type_embeddings = nn.Parameter(torch.empty(type_vocab_size, hidden))
        self.norm = LayerNorm(hidden, args.rms_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids, types = token_types.split(input_ids)
        hidden = F.embedding(ids, self.word_embeddings)
        hidden = hidden + F.embedding(types, self.token_type_embeddings)
        hidden = hidden + F.embedding(positions + self.position_offset, self.position_embeddings)
        return self.norm(hidden)


class EncoderAttention(nn.Module):
    """Bidirectional self-attention and its post-norm: LayerNorm(o_proj(attn) + x).
    q/k/v are one matmul (BERT's query, key and value, biases included):

        qkv_proj row: [ q: heads x head_dim | k: heads x head_dim | v ]
    """

    def __init__(self, args: ModelArgs, layer_index: int, kernels) -> None:
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        width = args.num_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, 3 * width, True, kernels)
        self.o_proj = Linear(width, args.hidden_size, True, kernels)
        self.norm = LayerNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = PagedAttention(args.num_heads, args.num_heads, args.head_dim, args.attn_scale,
                                   layer_index, kernels, causal=False)

    def forward(self, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.norm(self.o_proj(out.view(tokens, -1)), hidden)


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, kernels) -> None:
        super().__init__()
        self.attention = EncoderAttention(args, layer_index, kernels)
        self.mlp = PlainMLP(args.hidden_size, args.intermediate_size, kernels, args.hidden_act)
        self.mlp_norm = LayerNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, kv_cache, meta)
        return self.mlp_norm(self.mlp(hidden), hidden)


class BertModel(CheckpointLoading, nn.Module):
    """The encoder: every scheduled token's last hidden state (HF's
    last_hidden_state rows). An embedder's checkpoint may carry BERT's pooler;
    nothing here reads it, so it is skipped."""

    CAUSAL = False
    TENSOR_PARALLEL = False
    DEFAULT_POOLING = "CLS"
    PREFIX = "bert."  # of a checkpoint saved from a model with a head
    num_labels: int | None = None  # a classifier's (None: an embedder)

    @classmethod
    def position_offset(cls, hf_config) -> int:
        """Rows of the position table before position 0 (XLM-RoBERTa's padding)."""
        return 0

    @classmethod
    def model_args(cls, hf_config) -> ModelArgs:
        """The config's numbers as the engine's fields: every head its own K/V
        head, LayerNorm's eps in rms_norm_eps, the positions a prompt may use."""
        check_encoder_config(hf_config)
        heads, layers = hf_config.num_attention_heads, hf_config.num_hidden_layers
        head_dim = hf_config.hidden_size // heads
        positions = hf_config.max_position_embeddings - cls.position_offset(hf_config)
        return ModelArgs(
            vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size, num_layers=layers,
            num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
            rms_norm_eps=hf_config.layer_norm_eps, qkv_bias=True, o_bias=True, mlp_bias=True,
            tie_word_embeddings=False, max_position_embeddings=positions,
            hidden_act=getattr(hf_config, "hidden_act", "gelu"),
            sliding_windows=(None,) * layers, attn_scale=head_dim**-0.5)

    def __init__(self, hf_config, max_positions: int, kernels,
                 partition: Partition | None = None, group=None) -> None:
        super().__init__()
        if group is not None:
            raise ValueError(f"{type(self).__name__}: tensor parallelism is not supported")
        self.args = args = self.model_args(hf_config)
        if max_positions > args.max_position_embeddings:
            raise ValueError(f"max_model_len={max_positions} exceeds the encoder's "
                             f"{args.max_position_embeddings} positions")
        self.partition = partition or Partition.of(args)
        self.group = None
        self.kernels = kernels
        self.labels: list[str] = []  # a classifier's, in id2label order
        type_vocab_size = getattr(hf_config, "type_vocab_size", 1) or 1
        self.token_types = type_vocab_size > 1  # whether it reads token_type_ids
        self.embeddings = EncoderEmbeddings(args, type_vocab_size, self.position_offset(hf_config))
        self.layers = nn.ModuleList(EncoderLayer(args, i, kernels) for i in range(args.num_layers))

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every scheduled token: [num_tokens, hidden_size]."""
        hidden = self.embeddings(input_ids, positions)
        for layer in self.layers:
            hidden = layer(hidden, kv_cache, meta)
        return hidden

    def _target_of(self, name: str) -> tuple[str | None, int]:
        """Our parameter for the HF tensor `name` and its shard index (None: skipped)."""
        name = self._rename_head(name.removeprefix(self.PREFIX))
        if name in BUFFERS or (name.startswith("pooler.") and self.num_labels is None):
            return None, 0
        for hf, ours in RENAMES:
            name = name.replace(hf, ours)
        for part, index in QKV_SHARDS.items():
            if part in name:
                return name.replace(part, ".attention.qkv_proj."), index
        return name, 0

    def _rename_head(self, name: str) -> str:
        """A head's HF name as ours (BERT's pooler.dense is our pooler)."""
        return name.replace("pooler.dense.", "pooler.")

    def pack_linear_weights(self) -> None:
        """Every projection's weight into the layout the kernel backend multiplies
        fastest. An encoder's outputs are held to its reference within a bound,
        not to the bit, so float32 weights may take oneDNN's matmul (about twice
        MKL's where MKL takes no AVX-512 path: docs/performance.md)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight = packed(self.kernels, module.weight, torch_float32=False)

    def quantize_weights(self, type_name: str) -> None:
        raise ValueError(f"{type(self).__name__}: quantization ({type_name}) is not supported "
                         "for encoders; serve the float weights")

    def compute_logits(self, hidden: torch.Tensor):
        raise TypeError(f"{type(self).__name__} is a pooling model: it has no LM head")


class BertForSequenceClassification(BertModel):
    """The encoder and HF's head on the first token's hidden state:
    classifier(tanh(pooler(cls))) (BERT's pooler, then the classifier)."""

    def __init__(self, hf_config, max_positions: int, kernels,
                 partition: Partition | None = None, group=None) -> None:
        super().__init__(hf_config, max_positions, kernels, partition, group)
        self.num_labels = hf_config.num_labels
        id2label = getattr(hf_config, "id2label", None) or {}
        self.labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}")))
                       for i in range(self.num_labels)]
        hidden = self.args.hidden_size
        self.pooler = Linear(hidden, hidden, True, kernels)
        self.classifier = Linear(hidden, self.num_labels, True, kernels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[n, hidden] first-token states -> [n, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler(pooled)))


class XLMRobertaModel(BertModel):
    """BERT's network; positions start after the padding row (HF counts a
    sequence's positions from pad_token_id + 1), one token type."""

    PREFIX = "roberta."

    @classmethod
    def position_offset(cls, hf_config) -> int:
        return hf_config.pad_token_id + 1


class XLMRobertaForSequenceClassification(BertForSequenceClassification):
    """XLM-RoBERTa's head is BERT's pooler and classifier under other names:
    out_proj(tanh(dense(cls)))."""

    PREFIX = XLMRobertaModel.PREFIX

    @classmethod
    def position_offset(cls, hf_config) -> int:
        return XLMRobertaModel.position_offset(hf_config)

    def _rename_head(self, name: str) -> str:
        return (name.replace("classifier.dense.", "pooler.")
                .replace("classifier.out_proj.", "classifier."))
