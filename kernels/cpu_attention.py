"""Attention for the CPU engine in bfloat16/float16.

Prefill: the reference's per-sequence SDPA, run in the cache dtype instead of
fp32 (CPU flash attention accumulates in fp32 either way): no fp32 copies of
the gathered K/V, and bf16 SDPA itself is faster (one 1,000-token prompt,
9/3 heads x 64: 12 ms against 16 ms).

Decode, the rest of this page:

The reference (``kernels/reference.py``) gathers every context slot and
attends in fp32 through SDPA. In float32 that is the right thing on a CPU
too: it matches HF transformers bit for bit. In half precision it is the
bottleneck of a large decode batch (torch profiler, batch 64 bf16: the fp32
conversion of the gathered K/V was about half of the step, the slot gather a
quarter, the linear layers under a tenth). Decode attention is a memory
problem, so this path moves as few bytes as it can:

* gather whole blocks (one contiguous ``block_size`` x kv_heads x head_dim
  copy per table entry) instead of single slots, and never copy them again:
  both matmuls read the gathered K/V in place,
* stay in the cache dtype for both matmuls (oneDNN's bf16 kernels accumulate
  in fp32), and do the softmax in fp32,
* meet GQA with block-diagonal queries instead of a head-major copy of K/V.
  One row (kv_heads = 3, group = 3, d = head_dim)::

      K, V gathered       [L, kv_heads * d]          as the cache stores them
      queries spread      [num_heads, kv_heads * d]
          heads 0-2    ->  [ q 0 0 ]
          heads 3-5    ->  [ 0 q 0 ]
          heads 6-8    ->  [ 0 0 q ]
      scores = Q @ K^T    [num_heads, L]             each head meets only its KV head
      P @ V               [num_heads, kv_heads * d]  keep each head's own d columns

  That is kv_heads times the multiply-adds of the grouped form, which costs
  little next to the bytes decode attention moves (a transposing copy of K
  and V cost more than both matmuls here).

Whole blocks bring in slots past a row's length. Where a row's table is
padding, a full block of the longest row is gathered instead of the null
block (`_block_ids`), so those slots hold real K/V. The rest of its last
block holds stale K/V of an earlier owner (or nothing ever written). Masked scores become
-inf whatever K held, but a zero weight times a non-finite V is still NaN, so
those few stale V slots (under block_size per row) are zeroed in the gathered
copy::

    row of length 37, block_size 16, longest row 4 blocks, starting at block 9:
    table   [ 7      | 3      | 12     | 0 (pad) ]
    gather  [ 7      | 3      | 12     | 9       ]
    mask    [ 16 ok  | 16 ok  | 5 ok, 11 stale -> V zeroed | all masked ]

Measured on the 2-core CPU, bf16, one layer, block size 16 (median ms):

    rows  contexts  heads/kv_heads x head_dim   reference   this path, one chunk
      64  100-400         9/3 x 64                 16.4        3.1
     256   16-700         9/3 x 64                 150         58  (21.6 in sorted chunks)
      32  100-400        32/8 x 128                28.4        9.6

A lone row looks cheaper on the reference in isolation (0.13 against 0.17 ms,
cache hot), but inside the model its slot-by-slot gather cost more: a
batch-1 SmolLM2 decode step went from 38.8 to 27.7 ms on this path.

The max abs difference from an fp32 computation is 0.009 (bf16 scores),
against the reference's 0.002.
"""

from __future__ import annotations

import torch

from kernels.reference import (_check_heads, paged_decode_attention_reference,
                               paged_prefill_attention_reference)

# Gathered K (and again V) elements per chunk of rows: 4 MiB of bf16 each, so
# a chunk stays in cache from its gather to its matmuls. Measured, 256 rows of
# 16-700 tokens, 9/3 heads x 64, bf16: one 700-long gather for all rows
# 72.8 ms; sorted chunks of 2^18 / 2^19 / 2^20 / 2^21 / 2^22 elements:
# 33.0 / 28.3 / 28.1 / 21.6 / 32.5 ms.
_GATHER_BUDGET = 1 << 21


def paged_prefill_attention_cpu(query, k_cache, v_cache, block_tables, cu_seqlens_q,
                                context_lens, scale, **features):
    """Same contract as ``paged_prefill_attention_reference`` (``features``: its
    sliding_window, logits_soft_cap and causal); float32 is it exactly."""
    return paged_prefill_attention_reference(
        query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
        compute_dtype=k_cache.dtype, **features)


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_decode_attention_reference``; fp32 goes to it, and
    so does a call with a sliding window or a soft cap (this path has neither)."""
    # float32 stays bit-exact with HF.
    if (k_cache.dtype == torch.float32 or query.shape[0] == 0 or sliding_window is not None
            or logits_soft_cap is not None):
        return paged_decode_attention_reference(
            query, k_cache, v_cache, block_tables, context_lens, scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    _, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    _check_heads(num_heads, kv_heads)
    order, chunks = _chunks_by_length(context_lens, kv_heads * head_dim)
    if len(chunks) == 1:
        return _attend(query, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty_like(query)
    for start, end in chunks:
        rows = order[start:end]
        out[rows] = _attend(query[rows], k_cache, v_cache, block_tables[rows],
                            context_lens[rows], scale)
    return out


def _chunks_by_length(context_lens, row_width):
    """Rows longest first, cut into chunks whose gathered K fits the cache budget.

    Sorting keeps a chunk's rows of similar length, so little is gathered
    for padding; small chunks keep the gathered K/V in the CPU caches between
    the gather and the two matmuls that read it.
    """
    order = torch.argsort(context_lens, descending=True, stable=True)
    lengths = context_lens[order].tolist()
    chunks, start = [], 0
    while start < len(lengths):
        count = max(1, _GATHER_BUDGET // (max(lengths[start], 1) * row_width))
        chunks.append((start, min(start + count, len(lengths))))
        start += count
    return order, chunks


def _attend(query, k_cache, v_cache, block_tables, context_lens, scale):
    rows, num_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    lengths = context_lens.to(device=k_cache.device, dtype=torch.long)
    own_blocks = -(-lengths // block_size)  # blocks each row really uses
    num_blocks = max(int(own_blocks.max().item()), 1)
    length = num_blocks * block_size
    ids = _block_ids(block_tables, own_blocks, num_blocks)
    k = k_cache[ids].view(rows, length, kv_heads * head_dim)
    v = v_cache[ids].view(rows, length, kv_heads * head_dim)
    positions = torch.arange(length, device=k_cache.device)[None, :]
    allowed = positions < lengths[:, None]  # [rows, L]
    stale_rows, stale_positions = torch.nonzero(
        ~allowed & (positions < own_blocks[:, None] * block_size), as_tuple=True)
    v[stale_rows, stale_positions] = 0  # the stale tail of each row's last block
    q = _block_diagonal(query.view(rows, kv_heads, num_heads // kv_heads, head_dim))
    scores = torch.bmm(q, k.transpose(1, 2)).float()  # [rows, num_heads, L]
    scores.masked_fill_(~allowed[:, None, :], float("-inf"))
    weights = torch.softmax(scores * scale, dim=-1).to(v.dtype)
    out = torch.bmm(weights, v).view(rows, kv_heads, -1, kv_heads, head_dim)
    # Keep each head's own column block: [rows, group, head_dim, kv_heads] -> heads.
    out = out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(rows, num_heads, head_dim)
    # A padding row (context_len 0) has nothing to attend to: zeros, not NaN.
    out[lengths == 0] = 0.0
    return out


def _block_diagonal(q):
    """``[rows, kv_heads, group, head_dim]`` -> ``[rows, num_heads, kv_heads * head_dim]``
    with each query head's vector in its own KV head's columns, zeros elsewhere."""
    rows, kv_heads, group, head_dim = q.shape
    spread = q.new_zeros(rows, kv_heads, group, kv_heads, head_dim)
    spread.diagonal(dim1=1, dim2=3).copy_(q.permute(0, 2, 3, 1))
    return spread.view(rows, kv_heads * group, kv_heads * head_dim)


def _block_ids(block_tables, own_blocks, num_blocks):
    """``[rows, num_blocks]`` block ids to gather: each row's own blocks, and
    where its table is padding, the first block of the longest row. That block
    is full (the longest row has ``num_blocks`` blocks, and when that is one
    there is no padding), so it holds real, finite K/V for the mask to hide;
    the null block's contents are not promised."""
    tables = block_tables[:, :num_blocks].to(device=own_blocks.device, dtype=torch.long)
    index = torch.arange(num_blocks, device=own_blocks.device)[None, :]
    full_block = tables[int(own_blocks.argmax()), 0]
    return torch.where(index < own_blocks[:, None], tables, full_block)
