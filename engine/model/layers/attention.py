"""Self-attention over the paged KV cache.

`PagedAttention` is the part every family shares: store this step's K/V into
the cache slots, then attend, decodes and prefill chunks each through their
own kernel (the batch layout is in model/attention_metadata.py).
`Attention` is the block around it that every family here shares: one fused
qkv projection, optionally a per-head RMSNorm of q and k (Qwen3, Gemma 3),
rotary embedding on q and k, and the output projection. What a family
changes is data on `args`: the layer's sliding window, the score scale, a
soft cap on the scores.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention_metadata import AttentionMetadata
from engine.model.distributed.partition import Partition
from engine.model.layers.linear import Linear, all_reduce


class PagedAttention(nn.Module):
    """softmax(q k^T * scale) v for this rank's heads, K/V read from the cache
    (causal, or with causal=False bidirectional: encoders)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_index: int, kernels, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, causal: bool = True) -> None:
        """`causal` False (encoders): each prefill token attends to its whole
        sequence; decode is the same either way (one token sees all it has)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_index = layer_index
        self.kernels = kernels
        # Only the features this layer uses are passed, so a plain layer calls
        # the kernels exactly as before.
        self.features = {name: value for name, value in (
            ("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap))
            if value is not None}
        # The prefill kernel's keywords: `features` plus causal=False where off
        # (kept out of `features`, which the fused decoder layer ops read too).
        self.prefill_features = self.features if causal else dict(self.features, causal=False)

    def layer_view(self, kv_cache, meta: AttentionMetadata):
        """(k_cache, v_cache, meta) this layer reads: its own slice of the cache,
        and the sliding layers' view of the batch where they have their own pool."""
        k_cache, v_cache = kv_cache[0][self.layer_index], kv_cache[1][self.layer_index]
        if meta.window is not None and "sliding_window" in self.features:
            meta = meta.window  # this layer's K/V live in the sliding layers' own pool
        return k_cache, v_cache, meta

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv_heads, dim] -> [tokens, heads, dim]."""
        k_cache, v_cache, meta = self.layer_view(kv_cache, meta)
        self.kernels.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        d = meta.num_decode_tokens
        if d:
            out[:d] = self.kernels.paged_decode_attention(
                q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale, **self.features,
            )
        if d < q.shape[0]:
            out[d:] = self.kernels.paged_prefill_attention(
                q[d:], k_cache, v_cache, meta.prefill_block_tables,
                meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale, **self.prefill_features,
            )
        return out


class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism): qkv_proj is
    column-parallel, o_proj row-parallel, and the all-reduce after it sums
    the ranks' partial outputs (model/distributed/partition.py)."""

    def __init__(self, args, part: Partition, layer_index: int, kernels, group,
                 qk_norm: type[nn.Module] | None = None) -> None:
        """`qk_norm`: the norm class applied to each head of q and k before RoPE."""
        super().__init__()
        self.num_heads = part.num_heads
        self.num_kv_heads = part.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = part.num_heads * args.head_dim
        self.kv_size = part.num_kv_heads * args.head_dim
        self.kernels = kernels
        self.group = group
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, args.qkv_bias, kernels)
        self.o_proj = Linear(self.q_size, args.hidden_size, args.o_bias, kernels)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, args.head_dim,
                                   args.attn_scale, layer_index, kernels,
                                   args.sliding_windows[layer_index], args.attn_soft_cap)
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(args.head_dim, args.rms_norm_eps, kernels)
            self.k_norm = qk_norm(args.head_dim, args.rms_norm_eps, kernels)

    def forward(self, rope_tables, hidden, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        tokens = qkv.shape[0]
        # q and k are adjacent in the fused output: rotate them as one tensor
        # (the compiled op in place, inside qkv).
        #   qkv row: [ q: num_heads x head_dim | k: kv_heads x head_dim | v ]
        qk = qkv[:, : self.q_size + self.kv_size].view(
            tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        if self.q_norm is not None:
            qk = self._norm_heads(qk)
        qk = self.kernels.rope(qk, *rope_tables)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].reshape(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)
        return all_reduce(self.o_proj(out.view(-1, self.q_size)), self.group)

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """q heads through q_norm, k heads through k_norm, each over head_dim,
        into one new [tokens, heads + kv_heads, head_dim] tensor for RoPE."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        dim = self.head_dim
        q = self.q_norm(q.reshape(-1, dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, dim)).view(k.shape)
        return torch.cat((q, k), dim=1)
