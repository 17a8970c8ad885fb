"""Triton kernel that scatters new tokens' K/V into the paged cache.

One program per token copies all of that token's kv heads::

    key[t] : [num_kv_heads, head_dim]  ──►  k_cache.view(-1, kv_heads, head_dim)[slot[t]]

slot = -1 marks a padding token: its program loads and stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cache_slot, stride_cache_h, stride_cache_d,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # int64: slot * stride_cache_slot can exceed 2**31 for a large cache.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (slot >= 0) & (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    safe_slot = tl.maximum(slot, 0)

    cache_offsets = safe_slot * stride_cache_slot + heads[:, None] * stride_cache_h + dims[None, :] * stride_cache_d
    k_offsets = token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd
    v_offsets = token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd
    k = tl.load(key_ptr + k_offsets, mask=mask, other=0.0)
    v = tl.load(value_ptr + v_offsets, mask=mask, other=0.0)
    if UPCAST:
        # The interpreter mishandles bf16 values; round-trip through fp32,
        # which is exact for any of our dtypes.
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [num_tokens, kv_heads, head_dim] into their slots, in place."""
    num_tokens, kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if tuple(k_cache.shape[2:]) != (kv_heads, head_dim):
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match key {tuple(key.shape)}")
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("cache blocks must be laid out slot after slot (view(-1, ...) must work)")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        UPCAST=not key.is_cuda,
    )
