"""Triton paged prefill/extend attention: many query tokens per sequence.

A program owns one tile of BLOCK_M rows (BLOCK_M // GROUP_PAD query tokens
times the query heads of one kv head) of one sequence and attends causally
over that sequence's cached context plus its new tokens (CAUSAL off,
encoders: every row sees the whole context).  Sequences of
different lengths share one launch: ``_find_sequence`` maps a tile number to
its sequence from ``cu_seqlens_q`` on the device, so the host never reads it.

Layout, GQA rows, softmax conventions and int8 / fp8 caches (read in place): see
``kernels/paged_attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import (LOG2E, attend_range, check_inputs, feature_args, output_like,
                                     row_align)


@triton.jit
def _find_sequence(cu_seqlens_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Binary search: the sequence whose q tiles include ``tile``.

    Sequence i's tiles start at first_tile(i) = cu_seqlens[i] // BLOCK_Q + i,
    strictly increasing in i, and it needs at most that much room:
    first_tile(i+1) - first_tile(i) >= cdiv(q_len_i, BLOCK_Q) (the "+ i"
    pays for the rounding).  Tiles past a sequence's end do nothing.
    """
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        go_right = first <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _key_range(context_len, q_len, first_token, window,
               BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
               CAUSAL: tl.constexpr):
    """Keys [start, end) a tile of q tokens from ``first_token`` needs: up to its
    last valid token's position (without CAUSAL, the whole context); from 0, or
    with a window W from the tile holding its first token's first key
    (L - nq + first_token - W + 1)."""
    last_token = tl.minimum(first_token + BLOCK_Q, q_len)
    if CAUSAL:
        kv_end = tl.where(first_token < q_len, context_len - q_len + last_token, 0)
    else:
        kv_end = tl.where(first_token < q_len, context_len, 0)
    kv_start = 0
    if WINDOW:
        first_key = context_len - q_len + first_token - window + 1
        kv_start = tl.maximum(first_key, 0) // BLOCK_N * BLOCK_N
    return kv_start, kv_end


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    qk_scale, num_seqs, window, soft_cap,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_block, stride_slot, stride_head, stride_dim,
    stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, UPCAST: tl.constexpr,
    WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, CAUSAL: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    """One program = (tile of BLOCK_M // GROUP_PAD query tokens, kv head).

    Rows are (token, group member) pairs; the causal bound for a row is the
    absolute position of its token::

        context of length L:   [0 ........ L-nq-1 | L-nq ... L-1]
                                 cached prefix       this chunk's q tokens
        q token j sits at position L - nq + j and sees keys 0 .. L - nq + j
                                 (0 .. L - 1 without CAUSAL)
    """
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_begin
    context_len = tl.load(context_lens_ptr + seq)
    first_token = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_PAD)
    token = first_token + rows // GROUP_PAD
    member = rows % GROUP_PAD
    heads = kv_head * GROUP + member
    row_ok = (token < q_len) & (member < GROUP)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = (q_begin + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len - q_len + token

    kv_start, kv_end = _key_range(context_len, q_len, first_token, window, BLOCK_Q, BLOCK_N, WINDOW, CAUSAL)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr + seq.to(tl.int64) * stride_table,
        kv_start, kv_end, context_len, kv_head, qk_scale, window, soft_cap,
        stride_block, stride_slot, stride_head, stride_dim,
        CAUSAL, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_PAD, WINDOW, SOFT_CAP, UPCAST, ROW_ALIGN)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offsets = q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _prefill_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    dim_pad = triton.next_power_of_2(head_dim)
    group_pad = triton.next_power_of_2(group)
    # fp32 tiles are twice the bytes: fewer pipeline stages keep shared
    # memory well under the ~227 KiB of an H100 (3 stages would need ~140 KiB
    # at head_dim 256 even in fp32 with BLOCK_N 32).
    wide = dim_pad > 128 or dtype == torch.float32
    return dict(
        GROUP_PAD=group_pad,
        BLOCK_M=max(64, group_pad),
        BLOCK_N=64 if dim_pad <= 128 else 32,
        DIM_PAD=dim_pad,
        num_stages=2 if wide else 3,
    )


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            scale, *, out: torch.Tensor | None = None, sliding_window=None,
                            logits_soft_cap=None, causal=True) -> torch.Tensor:
    """Causal prefill/extend attention (see kernels.reference for the contract,
    and its ``sliding_window``, ``logits_soft_cap`` and ``causal``).

    ``out`` as in paged_decode_attention.
    """
    check_inputs(query, k_cache, v_cache, block_tables, context_lens)
    features = feature_args(sliding_window, logits_soft_cap, causal)
    if cu_seqlens_q.dtype != torch.int32:
        raise ValueError("cu_seqlens_q must be int32")
    total_q, heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    config = _prefill_config(head_dim, group, query.dtype)
    out = output_like(query, out)
    if total_q == 0 or num_seqs == 0:
        return out
    block_q = config["BLOCK_M"] // config["GROUP_PAD"]
    # Enough tiles for every sequence without reading cu_seqlens on the host.
    num_tiles = total_q // block_q + num_seqs
    _prefill_kernel[(num_tiles, kv_heads)](
        query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        scale * LOG2E, num_seqs, features.pop("window"), features.pop("soft_cap"),
        query.stride(0), query.stride(1), query.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        UPCAST=not query.is_cuda, ROW_ALIGN=row_align(k_cache, v_cache), CAUSAL=bool(causal), **features, **config,
    )
    return out
