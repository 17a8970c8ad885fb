"""Triton kernel that scatters new tokens' K/V into the paged cache.

One program per token copies all of that token's kv heads::

    key[t] : [num_kv_heads, head_dim]  ──►  k_cache.view(-1, kv_heads, head_dim)[slot[t]]

slot = -1 marks a padding token: its program loads and stores nothing.

An int8 cache (``kernels/kv_quant.py``) takes each (token, kv head) row
quantized as it is written: head_dim codes, then the row's fp16 scale, the
numbers of ``kv_quant.quantize_rows`` bit for bit (correctly rounded
divisions, round half to even).

An fp8 cache (float8_e4m3fn / float8_e5m2) takes each value as torch's
``x.float().clamp(-max, max).to(fp8)`` does, byte for byte (``_fp8_bits``:
round to nearest even, subnormals, saturation at the format's largest finite
value, NaN as 0x7F with its sign), computed in integer arithmetic.  Not
Triton's ``.to(fp8)``: on sm_90 that is the exact ``cvt.rn.satfinite``, but
the interpreter's rounds ties away from zero, can drop a mantissa carry
(7.75 -> 4.0 in e4m3) and truncates subnormals, so the CPU tests could not
hold the GPU's code to torch's bytes; this code is the same on both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import CODE_MAX, FP16_MAX, cache_head_dim, is_quantized
from kernels.paged_attention import FP8_E4M3_MAX, FP8_E5M2_MAX, check_int8_layout

# A @triton.jit function may read a global only as a constexpr.
_CODE_MAX = tl.constexpr(float(CODE_MAX))
_FP16_MAX = tl.constexpr(FP16_MAX)


@triton.jit
def _round_half_even(y):
    """fp32 round to nearest, ties to even (torch.round), for |y| < 2**31.
    By hand: the interpreter has no libdevice rint, and floor(y + 0.5) both
    rounds ties up and misrounds the float just below 0.5.  y - floor(y) is
    exact, so a tie is seen exactly."""
    low = tl.floor(y)
    frac = y - low
    odd = (low.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, low + 1.0, low)


@triton.jit
def _quantize(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """kv_quant.quantize_rows of fp32 rows [ROWS, COLS] (zero past head_dim):
    (int8 codes, fp16 scale of each row).  div_rn: Triton's plain fp32 `/` is
    not correctly rounded on the GPU, torch's is, and a scale one fp16 step
    off would change every code of its row."""
    absmax = tl.max(tl.abs(x), 1)
    scale = tl.math.div_rn(absmax, tl.full([ROWS], _CODE_MAX, tl.float32))
    scale = tl.minimum(scale, _FP16_MAX).to(tl.float16)
    s32 = scale.to(tl.float32)
    divisor = tl.broadcast_to(tl.where(s32 > 0.0, s32, 1.0)[:, None], (ROWS, COLS))
    # Clamped before rounding (the same codes: 127 is an integer) so that an
    # fp16-max scale under a huge x cannot overflow the int32 parity test.
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, divisor), -_CODE_MAX), _CODE_MAX)
    # An all-zero row has scale 0: its codes are 0, not 0 / 0.
    codes = tl.where(s32[:, None] > 0.0, _round_half_even(y), 0.0)
    return codes.to(tl.int8), scale


@triton.jit
def _shift_right_rne(v, s):
    """int32 v >= 0 divided by 2**s (1 <= s <= 31), rounded to nearest, ties to even."""
    q = v >> s
    rest = v - (q << s)
    half = 1 << (s - 1)
    up = (rest > half) | ((rest == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def _fp8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr):
    """The fp8 byte (MANT mantissa bits, exponent bias BIAS, largest finite TOP)
    of fp32 x as torch stores x.clamp(-TOP, TOP): round to nearest even on the
    fp32 bits.  A normal result is x's bits re-biased and shifted, a mantissa
    carry running into the exponent; a subnormal one is the significand in
    units of the smallest subnormal, 2**(1 - BIAS - MANT) (a carry to 2**MANT
    is the smallest normal's byte)."""
    bits = tl.minimum(tl.maximum(x, -TOP), TOP).to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    normal = _shift_right_rne(mag - ((127 - BIAS) << 23), 23 - MANT)
    # Clamped shifts: an oversized one would be undefined even where unselected.
    shift = tl.minimum(tl.maximum(151 - BIAS - MANT - exp, 1), 31)
    subnormal = _shift_right_rne((mag & 0x7FFFFF) | 0x800000, shift)
    code = tl.where(exp > 127 - BIAS, normal, subnormal)
    # NaN is 0x7F in both formats; the GPU's min/max dropped it, so test x.
    code = tl.where(x != x, 0x7F, code)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def _store_rows(x, cache_ptr, rows, mask, row_mask, stride_d,
                HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    """Write one token's rows x [HEADS_PAD, DIM_PAD] at their cache ``rows``:
    converted to the cache dtype, or quantized into an int8 or fp8 cache."""
    dims = tl.arange(0, DIM_PAD)
    offsets = rows[:, None] + dims[None, :] * stride_d
    cache_ty = cache_ptr.dtype.element_ty
    if cache_ty == tl.int8:
        codes, scale = _quantize(x.to(tl.float32), HEADS_PAD, DIM_PAD)
        tl.store(cache_ptr + offsets, codes, mask=mask)
        # check_int8_layout made the scale's two bytes contiguous and 2-aligned.
        scale_ptr = (cache_ptr + rows + HEAD_DIM * stride_d).to(tl.pointer_type(tl.float16), bitcast=True)
        tl.store(scale_ptr, scale, mask=row_mask)
    elif cache_ty == tl.float8e4nv:
        bits = _fp8_bits(x.to(tl.float32), 3, 7, FP8_E4M3_MAX)
        tl.store(cache_ptr + offsets, bits.to(cache_ty, bitcast=True), mask=mask)
    elif cache_ty == tl.float8e5:
        bits = _fp8_bits(x.to(tl.float32), 2, 15, FP8_E5M2_MAX)
        tl.store(cache_ptr + offsets, bits.to(cache_ty, bitcast=True), mask=mask)
    else:
        tl.store(cache_ptr + offsets, x.to(cache_ty), mask=mask)


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
    row_mask = (slot >= 0) & (heads < NUM_KV_HEADS)
    mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    safe_slot = tl.maximum(slot, 0)

    rows = safe_slot * stride_cache_slot + heads * stride_cache_h
    k_offsets = token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd
    v_offsets = token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd
    k = tl.load(key_ptr + k_offsets, mask=mask, other=0.0)
    v = tl.load(value_ptr + v_offsets, mask=mask, other=0.0)
    if UPCAST:
        # The interpreter mishandles bf16 values; round-trip through fp32,
        # which is exact for any of our dtypes.
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    _store_rows(k, k_cache_ptr, rows, mask, row_mask, stride_cache_d, HEAD_DIM, HEADS_PAD, DIM_PAD)
    _store_rows(v, v_cache_ptr, rows, mask, row_mask, stride_cache_d, HEAD_DIM, HEADS_PAD, DIM_PAD)


def _check_store(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    if (k_cache.shape[2], cache_head_dim(k_cache)) != (kv_heads, head_dim):
        raise ValueError(f"cache {tuple(k_cache.shape)} {k_cache.dtype} does not match "
                         f"key {tuple(key.shape)}")
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("cache blocks must be laid out slot after slot (view(-1, ...) must work)")
    if is_quantized(k_cache):
        check_int8_layout(k_cache)
        check_int8_layout(v_cache)
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [num_tokens, kv_heads, head_dim] into their slots, in place."""
    _check_store(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, kv_heads, head_dim = key.shape
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
