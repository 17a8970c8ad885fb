"""Triton paged attention: decode (plain and split-KV) and prefill/extend.

Gathering K/V token by token
----------------------------
Every kernel walks a sequence's context in tiles of ``BLOCK_N`` *tokens*, not
cache pages.  Each token finds its own page through the block table::

    tile of BLOCK_N = 8 tokens, block_size = 4, block_table = [7, 2, 5]

    token      0  1  2  3 | 4  5  6  7
    page       7  7  7  7 | 2  2  2  2        page = block_table[token // 4]
    row in it  0  1  2  3 | 0  1  2  3        row  = token % 4

so the tile shape is independent of block_size: any power of two from 1 up
works, and ``tl.dot`` always gets the >= 16 rows it needs.

GQA / MQA: query heads as matrix rows
-------------------------------------
Query head ``h`` reads kv head ``h // group`` (``group = heads // kv_heads``).
A program owns one kv head and puts *all* its query heads in the rows of the
Q tile, so each K/V tile is loaded once per group, not once per query head::

    decode  (rows = group, padded to >= 16):     prefill (rows = tokens x group):
      row r -> head kv_head * group + r            row r -> token r // GROUP_PAD,
                                                            head kv_head * group + r % GROUP_PAD

Softmax is the online (flash) form in fp32, in base 2: scores are multiplied
by ``scale * log2(e)`` so ``exp2`` can be used.  Running maxima start at a
large finite negative number instead of -inf so rows that see no key at all
(padding) stay NaN-free and finish as 0 / 0 -> guarded to 0.

Precision: fp32 inputs use ``input_precision="ieee"`` (no TF32), since the
engine must match HF transformers token-for-token in float32.  fp16/bf16 use
tensor cores with fp32 accumulation.  Under the Triton interpreter (CPU
tensors) everything is upcast to fp32 right after loading, because the
interpreter's bf16 arithmetic is wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Context tokens per split-KV partition (a multiple of every BLOCK_N we use).
DEFAULT_PARTITION_SIZE = 512
# tl.dot needs >= 16 rows, so a decode Q tile (one row per query head of a kv
# group) is padded up to this even for MHA (group = 1).
MIN_ROWS_PER_GROUP_TILE = 16


# ---------------------------------------------------------------------------
# Shared device helpers
# ---------------------------------------------------------------------------

@triton.jit
def _kv_tile_offsets(table_row_ptr, token_start, context_len, kv_head,
                     stride_block, stride_slot, stride_head, stride_dim,
                     BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                     HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """Offsets and mask of a [BLOCK_N, DIM_PAD] tile of context tokens."""
    tokens = token_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, DIM_PAD)
    in_context = tokens < context_len
    page = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=in_context, other=0)
    # int64: page * stride_block overflows int32 on large caches.
    rows = page.to(tl.int64) * stride_block + (tokens % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    offsets = rows[:, None] + dims[None, :] * stride_dim
    mask = in_context[:, None] & (dims < HEAD_DIM)[None, :]
    return tokens, offsets, mask


@triton.jit
def _online_softmax_step(acc, m_i, l_i, scores, v):
    """Fold one tile of base-2 scores [M, N] and values [N, D] into the state."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _attend_range(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row_ptr,
                  kv_start, kv_end, context_len, kv_head, qk_scale,
                  stride_block, stride_slot, stride_head, stride_dim,
                  CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """Attend rows of ``q`` to context tokens [kv_start, kv_end)."""
    for token_start in range(kv_start, kv_end, BLOCK_N):
        tokens, offsets, mask = _kv_tile_offsets(
            table_row_ptr, token_start, context_len, kv_head,
            stride_block, stride_slot, stride_head, stride_dim,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_PAD)
        k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = (tokens < kv_end)[None, :]
        if CAUSAL:
            visible = visible & (tokens[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, scores, v)
    return acc, m_i, l_i


# ---------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------

@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    qk_scale, partition_size,
    stride_qs, stride_qh, stride_qd,
    stride_os, stride_oh, stride_od,
    stride_block, stride_slot, stride_head, stride_dim,
    stride_table,
    GROUP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program = (sequence, kv head, context partition).

    Unsplit: partition_size covers the whole context and the result goes to
    ``out``.  Split: the normalised partial output and its (max, sum) go to
    the part_* buffers [seqs, heads, parts(, dim)] for _decode_reduce_kernel.
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
    kv_start = part * partition_size
    kv_end = tl.minimum(kv_start + partition_size, context_len)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, rows, k_cache_ptr, v_cache_ptr, table_ptr + seq.to(tl.int64) * stride_table,
        kv_start, kv_end, context_len, kv_head, qk_scale,
        stride_block, stride_slot, stride_head, stride_dim,
        False, UPCAST, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_PAD)
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


def _check_inputs(query, k_cache, v_cache, block_tables, context_lens):
    heads, head_dim = query.shape[1], query.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, cache {k_cache.shape[3]}")
    if heads % k_cache.shape[2]:
        raise ValueError(f"num_heads ({heads}) must be a multiple of num_kv_heads ({k_cache.shape[2]})")
    if k_cache.dtype != query.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from query dtype {query.dtype}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")


def decode_attention_partitioned(query, k_cache, v_cache, block_tables, context_lens, scale,
                                 num_partitions: int, partition_size: int,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode with an explicit split (num_partitions == 1 runs the plain kernel)."""
    _check_inputs(query, k_cache, v_cache, block_tables, context_lens)
    num_seqs, heads, head_dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    config = _decode_config(head_dim, group)
    if partition_size % config["BLOCK_N"]:
        raise ValueError(f"partition_size must be a multiple of {config['BLOCK_N']}")
    out = _output_like(query, out)
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
        scale * LOG2E, partition_size,
        query.stride(0), query.stride(1), query.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        SPLIT=split, UPCAST=not query.is_cuda, **config,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, heads)](
            part_out, part_m, part_l, out, num_partitions,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim, DIM_PAD=config["DIM_PAD"],
            PARTS_PAD=triton.next_power_of_2(num_partitions),
        )
    return out


def _output_like(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} on {query.device}")
    return out


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: parallelism is irrelevant, keep the plain kernel


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, *,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (see kernels.reference for the contract); picks the split.

    ``out`` (optional, [num_seqs, num_heads, head_dim], query dtype) is filled
    in place instead of allocating, e.g. for CUDA graphs or preallocation.
    """
    max_context = block_tables.shape[1] * k_cache.shape[1]
    parts = choose_decode_partitions(query.shape[0], k_cache.shape[2], max_context, _num_sms(query.device))
    return decode_attention_partitioned(query, k_cache, v_cache, block_tables, context_lens, scale,
                                        parts, DEFAULT_PARTITION_SIZE, out=out)


# ---------------------------------------------------------------------------
# Prefill / extend
# ---------------------------------------------------------------------------

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
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_block, stride_slot, stride_head, stride_dim,
    stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program = (tile of BLOCK_M // GROUP_PAD query tokens, kv head).

    Rows are (token, group member) pairs; the causal bound for a row is the
    absolute position of its token::

        context of length L:   [0 ........ L-nq-1 | L-nq ... L-1]
                                 cached prefix       this chunk's q tokens
        q token j sits at position L - nq + j and sees keys 0 .. L - nq + j
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

    # Keys needed by this tile: up to the position of its last valid token.
    last_token = tl.minimum(first_token + BLOCK_Q, q_len)
    kv_end = tl.where(first_token < q_len, context_len - q_len + last_token, 0)

    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr + seq.to(tl.int64) * stride_table,
        0, kv_end, context_len, kv_head, qk_scale,
        stride_block, stride_slot, stride_head, stride_dim,
        True, UPCAST, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_PAD)
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
                            scale, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal prefill/extend attention (see kernels.reference for the contract).

    ``out`` as in paged_decode_attention.
    """
    _check_inputs(query, k_cache, v_cache, block_tables, context_lens)
    if cu_seqlens_q.dtype != torch.int32:
        raise ValueError("cu_seqlens_q must be int32")
    total_q, heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    config = _prefill_config(head_dim, group, query.dtype)
    out = _output_like(query, out)
    if total_q == 0 or num_seqs == 0:
        return out
    block_q = config["BLOCK_M"] // config["GROUP_PAD"]
    # Enough tiles for every sequence without reading cu_seqlens on the host.
    num_tiles = total_q // block_q + num_seqs
    _prefill_kernel[(num_tiles, kv_heads)](
        query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        scale * LOG2E, num_seqs,
        query.stride(0), query.stride(1), query.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        UPCAST=not query.is_cuda, **config,
    )
    return out
