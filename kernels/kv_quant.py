"""Quantized KV caches: how an int8 or fp8 K or V row is laid out, written
and read.  Every backend (the reference, the compiled CPU op, Triton) reads
and writes exactly these formats.

fp8 (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``, vLLM's names) is plain: a
torch.float8_e4m3fn or float8_e5m2 cache of the usual shape, each value
converted on its own (round to nearest even) after clamping to the format's
largest finite value (448 / 57344), with vLLM's per-tensor scale fixed at
1.0.  e4m3 keeps 3 mantissa bits: a relative step of 1/16 at worst.

int8 (``--kv-cache-dtype int8``) carries a scale for every row:

An int8 cache is an int8 tensor ``[blocks, block_size, kv_heads, head_dim + 2]``:
each (token, kv head) row holds its head_dim codes, then its own scale as the
two bytes of an fp16:

    row of K (or V), one token, one kv head:
        c[0] c[1] ... c[D-1] | s (fp16, 2 bytes)        x[d] ~= c[d] * s
        s = fp16(max_d |x[d]| / 127),  c[d] = clamp(round(x[d] / s), -127, 127)

Why a scale per token and per head: a new token's row is written once and
never touched again, so its scale is fixed when it is stored (a scale per
block would have to re-quantize the block's earlier rows as it fills), and
an outlier in one head or one token costs only that row its precision.  Why
beside the codes: a block is self-contained, so prefix caching, copy-on-write,
preemption, the offload tiers and the fleet move int8 blocks as they move any
other (bytes of a block), with nothing to keep beside them.  Why fp16: at
head_dim 64 a row is 66 bytes against bf16's 128 (1.94x the tokens; an fp32
scale would give 1.88x).

Round trip: |x - c * s| <= s / 2 + 127 * |s - max|x| / 127|, s the stored
scale: half a step, plus what the fp16 rounding of the scale moved the
largest element (a scale rounded down clamps it to 127 * s).  That second
term is at most 2^-11 of max|x| while s is a normal fp16 (max|x| >= 127 *
2^-14 ~ 0.0078), at most 127 * 2^-25 ~ 4e-6 below.  Rounding is half to
even, in fp32, dividing by s: every backend computes the same codes.

An int8 cache's K meets a query in int8 too: Q.K reads each (token, query
head) row of the query rounded the same way, with an fp32 scale (it is never
stored), so every score is an integer dot product times two scales:

    q[d] ~= a[d] * r,  r = max_d |q[d]| / 127,  a[d] = clamp(round(q[d] / r), -127, 127)
    score = (sum_d a[d] * c[d]) * s * r * softmax_scale

The sum is exact everywhere (|sum| <= head_dim * 127^2 < 2^24 up to head_dim
1,040, so fp32 sums of the products are exact too), which is what lets the
CPU op take the integer dot product (AVX512-VNNI's ``vpdpbusd``: 64
multiply-adds an instruction, no widening of K's codes) while its other
builds and Triton multiply the codes as floats, all to the same numbers. The
query's rounding costs what K's does (half a step of 1/127 of the row's
largest element); P.V reads V's values, codes times scale, as before.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # the fp16 scale after a row's codes
CODE_MAX = 127  # codes are symmetric: -127 .. 127 (-128 is never written)
FP16_MAX = 65504.0


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_CACHES = (torch.int8, *FP8_DTYPES)  # every backend reads them beside any query dtype


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds int8 rows (codes and their scales)."""
    return cache.dtype == torch.int8


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds fp8 values (no scales: 1.0 per tensor)."""
    return cache.dtype in FP8_DTYPES


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values as an fp8 cache stores them: clamped to the format's range (torch's
    conversion would make 449 a NaN in e4m3fn), then rounded to nearest even."""
    top = torch.finfo(dtype).max
    return x.float().clamp(-top, top).to(dtype)


def row_width(head_dim: int) -> int:
    """Bytes (and int8 elements) of one quantized (token, kv head) row."""
    return head_dim + SCALE_BYTES


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head_dim a cache serves: its last dimension, less the scale of an int8 row."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` floats -> ``[..., head_dim + 2]`` int8 rows (codes, fp16 scale)."""
    x32 = x.float()
    absmax = x32.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor, not a Python number: CUDA torch multiplies by the
    # reciprocal of a scalar, which is not the correctly rounded quotient
    # the other backends compute.
    scale = (absmax / absmax.new_full((), CODE_MAX)).clamp(max=FP16_MAX).to(torch.float16)
    codes = _codes(x32, scale.float()).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def _codes(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded half to even and clamped to +-127, as float32; an
    all-zero row (scale 0) codes to 0, not 0 / 0."""
    codes = torch.where(scale > 0, x32 / torch.where(scale > 0, scale, 1.0), 0.0)
    return codes.round().clamp(-CODE_MAX, CODE_MAX)


def quantize_query(q: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` query rows -> float32 ``[..., head_dim]`` rows as an int8
    cache's Q.K reads them: codes of one fp32 scale per row, times the scale."""
    q32 = q.float()
    scale = q32.abs().amax(dim=-1, keepdim=True) / CODE_MAX
    return _codes(q32, scale) * scale


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim + 2]`` int8 rows -> their ``[..., head_dim]`` values in float32."""
    codes = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    return codes * scale


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim + 2]`` int8 rows -> each row's scale, float32 ``[...]``."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()[..., 0]
