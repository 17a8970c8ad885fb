r"""Triton paged decode attention: one query token per sequence.

The plain kernel runs one program per (sequence, kv head) over the whole
context.  When that leaves SMs idle (few, long sequences) the context is
split into partitions, each program writes a partial result with its running
max and sum, and a second kernel merges them (flash-decoding)::

    sequence context: | part 0 | part 1 | part 2 |      grid (seq, kv_head, part)
                          |        |        |
                      (o, m, l) (o, m, l) (o, m, l)    fp32 partials
                           \       |       /
                             _decode_reduce_kernel      out[seq, head]

Layout, GQA rows, softmax conventions and int8 / fp8 caches (read in place): see
``kernels/paged_attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import (LOG2E, attend_range, check_inputs, feature_args, output_like,
                                     row_align)

# Context tokens per split-KV partition (a multiple of every BLOCK_N we use).
DEFAULT_PARTITION_SIZE = 512
# tl.dot needs >= 16 rows, so a decode Q tile (one row per query head of a kv
# group) is padded up to this even for MHA (group = 1).
MIN_ROWS_PER_GROUP_TILE = 16


@triton.jit
def _partition(part, num_parts, partition_size, context_len, window, BLOCK_N: tl.constexpr,
               SPLIT: tl.constexpr, WINDOW: tl.constexpr):
    """[start, end) of the context this partition reads. Split, each takes an even,
    BLOCK_N-aligned share of the sequence's own context (at most partition_size):
    the split is fixed by the table's width (a shape: CUDA graphs capture it), so a
    short context in a wide table would otherwise run in one or two programs, each
    a chain of dependent tiles, while the rest exit at once. With a window the
    start moves up to the tile of the window's first token."""
    if SPLIT:
        even = tl.cdiv(tl.cdiv(context_len, num_parts), BLOCK_N) * BLOCK_N
        partition_size = tl.minimum(partition_size, even)
    kv_start = part * partition_size
    kv_end = tl.minimum(kv_start + partition_size, context_len)
    if WINDOW:
        kv_start = tl.maximum(kv_start, tl.maximum(context_len - window, 0) // BLOCK_N * BLOCK_N)
    return kv_start, kv_end


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    qk_scale, partition_size, window, soft_cap,
    stride_qs, stride_qh, stride_qd,
    stride_os, stride_oh, stride_od,
    stride_block, stride_slot, stride_head, stride_dim,
    stride_table,
    GROUP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, ROW_ALIGN: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    """One program = (sequence, kv head, context partition).

    Unsplit: partition_size covers the whole context and the result goes to
    ``out``.  Split: each partition takes an even, BLOCK_N-aligned share of the
    sequence's context (at most partition_size); the normalised partial output
    and its (max, sum) go to the part_* buffers [seqs, heads, parts(, dim)] for
    _decode_reduce_kernel.
    With a window the loop starts at the tile of the window's first token
    (partitions wholly before it do nothing and write l = 0).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    num_parts = tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    kv_start, kv_end = _partition(part, num_parts, partition_size, context_len, window,
                                  BLOCK_N, SPLIT, WINDOW)
    q_pos = tl.zeros([ROWS], dtype=tl.int32) + (context_len - 1)  # the query is the last token
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr + seq.to(tl.int64) * stride_table,
        kv_start, kv_end, context_len, kv_head, qk_scale, window, soft_cap,
        stride_block, stride_slot, stride_head, stride_dim,
        False, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_PAD, WINDOW, SOFT_CAP, UPCAST, ROW_ALIGN)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]

    if SPLIT:
        # part_* are contiguous: [seqs, heads, parts, DIM_PAD] and [seqs, heads, parts].
        stat = (seq.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * num_parts + part
        tl.store(part_out_ptr + stat[:, None] * DIM_PAD + dims[None, :], out, mask=row_mask)
        tl.store(part_m_ptr + stat, m_i, mask=rows < GROUP)
        tl.store(part_l_ptr + stat, l_i, mask=rows < GROUP)
    else:
        o_offsets = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, num_parts,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    """Merge the partitions of one (sequence, head).

    Partition p holds o_p = sum(e^(s - m_p) v) / l_p with l_p = sum(e^(s - m_p)),
    so the exact result is sum_p w_p o_p / sum_p w_p with w_p = l_p 2^(m_p - M),
    M = max_p m_p.  Empty partitions have l_p = 0 and drop out.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTS_PAD)
    dims = tl.arange(0, DIM_PAD)
    in_range = parts < num_parts
    stat = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_parts + parts
    m = tl.load(part_m_ptr + stat, mask=in_range, other=-1.0e30)
    l = tl.load(part_l_ptr + stat, mask=in_range, other=0.0)
    o = tl.load(part_out_ptr + stat[:, None] * DIM_PAD + dims[None, :],
                mask=in_range[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    w = l * tl.exp2(m - tl.max(m, 0))
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    o_offsets = seq.to(tl.int64) * stride_os + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def choose_decode_partitions(num_seqs: int, num_kv_heads: int, max_context: int,
                             num_sms: int, partition_size: int = DEFAULT_PARTITION_SIZE) -> int:
    """How many context partitions the decode should use (1 = no split).

    Heuristic: the plain kernel runs num_seqs * num_kv_heads programs.  If
    that already fills every SM, splitting only adds the reduce pass, so
    don't.  Otherwise (few, long sequences: the flash-decoding case) cut the
    context into ``partition_size`` chunks so the work spreads over the GPU.
    ``max_context`` is an upper bound known without a device sync (the
    block table width times block_size), so a loose table costs some empty
    partitions, each of which exits after writing l = 0.
    """
    if num_seqs * num_kv_heads >= num_sms or max_context <= partition_size:
        return 1
    return triton.cdiv(max_context, partition_size)


def _decode_config(head_dim: int, group: int) -> dict:
    dim_pad = triton.next_power_of_2(head_dim)
    return dict(
        ROWS=max(MIN_ROWS_PER_GROUP_TILE, triton.next_power_of_2(group)),
        BLOCK_N=64 if dim_pad <= 128 else 32,
        DIM_PAD=dim_pad,
    )


def decode_attention_partitioned(query, k_cache, v_cache, block_tables, context_lens, scale,
                                 num_partitions: int, partition_size: int,
                                 out: torch.Tensor | None = None, *, sliding_window=None,
                                 logits_soft_cap=None) -> torch.Tensor:
    """Decode with an explicit split (num_partitions == 1 runs the plain kernel)."""
    check_inputs(query, k_cache, v_cache, block_tables, context_lens)
    features = feature_args(sliding_window, logits_soft_cap)
    num_seqs, heads, head_dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    config = _decode_config(head_dim, group)
    if partition_size % config["BLOCK_N"]:
        raise ValueError(f"partition_size must be a multiple of {config['BLOCK_N']}")
    out = output_like(query, out)
    if num_seqs == 0:
        return out
    split = num_partitions > 1
    if split:
        part_out = torch.empty(num_seqs, heads, num_partitions, config["DIM_PAD"],
                               dtype=torch.float32, device=query.device)
        part_m = torch.empty(num_seqs, heads, num_partitions, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        partition_size = max(block_tables.shape[1] * block_size, 1)
        part_out = part_m = part_l = out  # unused by the SPLIT=False kernel
    _decode_kernel[(num_seqs, kv_heads, num_partitions)](
        query, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_m, part_l,
        scale * LOG2E, partition_size, features.pop("window"), features.pop("soft_cap"),
        query.stride(0), query.stride(1), query.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        SPLIT=split, UPCAST=not query.is_cuda, ROW_ALIGN=row_align(k_cache, v_cache), **features, **config,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, heads)](
            part_out, part_m, part_l, out, num_partitions,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim, DIM_PAD=config["DIM_PAD"],
            PARTS_PAD=triton.next_power_of_2(num_partitions),
        )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: parallelism is irrelevant, keep the plain kernel


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, *,
                           out: torch.Tensor | None = None, sliding_window=None,
                           logits_soft_cap=None) -> torch.Tensor:
    """Decode attention (see kernels.reference for the contract, and its
    ``sliding_window`` and ``logits_soft_cap``); picks the split.

    ``out`` (optional, [num_seqs, num_heads, head_dim], query dtype) is filled
    in place instead of allocating, e.g. for CUDA graphs or preallocation.
    """
    max_context = block_tables.shape[1] * k_cache.shape[1]
    parts = choose_decode_partitions(query.shape[0], k_cache.shape[2], max_context, _num_sms(query.device))
    return decode_attention_partitioned(query, k_cache, v_cache, block_tables, context_lens, scale,
                                        parts, DEFAULT_PARTITION_SIZE, out=out,
                                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
