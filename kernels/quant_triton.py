r"""Triton product and de-quantizer of GGUF-quantized weights (the blob of
``kernels/quant.py``; contract: ``quant_linear_reference``, ``dequantize_reference``).

The kernels read the file's blocks as bytes, as they are in the blob, and
de-quantize a K-tile of W in registers, the way ggml (and gguf.quants)
decodes it: nibbles and high bits by shifts and masks, fp16 scales as two
bytes bitcast, the K-quants' 6-bit sub-block scales unpacked from their 12
bytes. One program = (tile of M rows, tile of N outputs)::

    for each K-tile:   w[BLOCK_K, BLOCK_N] = decode(blocks of rows n, inputs k)   fp32
                       acc += x[rows, k] @ w                               (tl.dot, fp32)
    out[rows, n] = acc (+ bias[n])   in out's dtype

A tile is decoded as [S, GROUP, BLOCK_N]: S scale groups of GROUP inputs
(32, Q6_K's 16), each group's scales loaded once and broadcast over its
inputs; a group never straddles a block, so every address comes from the
input index k alone and BLOCK_K need only be a multiple of GROUP. The
de-quantized weights are gguf's numbers bit for bit: each type's products
are done in gguf's order (d * sc first, then the quant), in fp32.

A blob's parts (q | k | v with their own types) are one launch each, into
their columns of the output. Precision as ``kernels/fused_moe_triton.py``:
fp32 accumulation, ``input_precision="ieee"``; x is upcast to fp32 after
loading, so the weights keep every bit (a K-quant weight can use all 24 of
fp32's significand bits; bf16 keeps 8).
Meant for decode, where the weight bytes are the cost; a prefill-sized M
would want tensor-core operands, which round the weights (not done).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import QUANT_TYPES, quant_parts, quant_shape, select_rows

# Inputs that share one scale (d, or a K-quant's sub-block scale and min).
_GROUP = {"Q6_K": 16}


def _type_constants(type_name: str) -> dict:
    kind = QUANT_TYPES[type_name]
    return dict(QTYPE=type_name, QK=kind.block_elems, BLOCK_BYTES=kind.block_bytes,
                GROUP=_GROUP.get(type_name, 32))


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _fp16(ptr):
    """The little-endian fp16 at ptr, as fp32 (exact, subnormals included)."""
    bits = tl.load(ptr).to(tl.uint16) | (tl.load(ptr + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(qs_ptr, i, HALF: tl.constexpr):
    """Input i of a run of 2 * HALF 4-bit quants: low nibbles first, then high."""
    return (_byte(qs_ptr + i % HALF) >> (4 * (i // HALF))) & 15


@triton.jit
def _k_scale_min(scales_ptr, sub):
    """Sub-block `sub`'s 6-bit scale and min from a Q4_K/Q5_K block's 12 bytes
    (ggml's get_scale_min_k4): 0-3 in bytes 0-7's low 6 bits; 4-7 split
    between bytes 8-11's nibbles and the top 2 bits of bytes 0-7."""
    lo = _byte(scales_ptr + sub % 4)
    mid = _byte(scales_ptr + sub % 4 + 4)
    hi = _byte(scales_ptr + sub % 4 + 8)
    first = sub < 4
    scale = tl.where(first, lo & 63, (hi & 15) | ((lo >> 6) << 4))
    minimum = tl.where(first, mid & 63, (hi >> 4) | ((mid >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _decode_tile(w_ptr, row_bytes, cols, k0, K,
                 QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 [BLOCK_K, BLOCK_N]: W[cols, k0:k0 + BLOCK_K]^T, de-quantized.
    cols must be valid rows; inputs past K read the last group again (the
    caller zeroes their activations)."""
    S: tl.constexpr = BLOCK_K // GROUP
    first = tl.minimum(k0 + tl.arange(0, S) * GROUP, K - GROUP)[:, None, None]  # [S, 1, 1]
    e = tl.arange(0, GROUP)[None, :, None]                                     # [1, GROUP, 1]
    # Each group's block: [S, 1, BLOCK_N] pointers; i = inputs' places in it.
    block = w_ptr + cols.to(tl.int64)[None, None, :] * row_bytes + (first // QK) * BLOCK_BYTES
    i = first % QK + e
    if QTYPE == "Q8_0":
        q = tl.load(block + 2 + i).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * _fp16(block)
    elif QTYPE == "Q4_0":
        w = _fp16(block) * (_nibble(block + 2, i, 16) - 8).to(tl.float32)
    elif QTYPE == "Q4_1":
        w = _fp16(block) * _nibble(block + 4, i, 16).to(tl.float32) + _fp16(block + 2)
    elif QTYPE == "Q5_0":
        high = (_byte(block + 2 + i // 8) >> (i % 8)) & 1  # qh: one bit per input, LE
        w = _fp16(block) * ((_nibble(block + 6, i, 16) | (high << 4)) - 16).to(tl.float32)
    elif QTYPE == "Q5_1":
        high = (_byte(block + 4 + i // 8) >> (i % 8)) & 1
        q = (_nibble(block + 8, i, 16) | (high << 4)).to(tl.float32)
        w = _fp16(block) * q + _fp16(block + 2)
    elif QTYPE == "Q4_K" or QTYPE == "Q5_K":
        sub = first % QK // 32  # 8 sub-blocks of 32; qs holds them in pairs of 32 bytes
        scale, minimum = _k_scale_min(block + 4, sub)
        qs = block + (16 if QTYPE == "Q4_K" else 48) + 32 * (sub // 2)
        q = (_byte(qs + i % 32) >> (4 * (sub % 2))) & 15
        if QTYPE == "Q5_K":  # qh[l]'s bit `sub` tops input l of each sub-block
            q = q | (((_byte(block + 16 + i % 32) >> sub) & 1) << 4)
        w = (_fp16(block) * scale) * q.to(tl.float32) - _fp16(block + 2) * minimum
    else:  # Q6_K: halves of 128 inputs, each 4 runs of 32: ql nibbles, 2 bits of qh
        half, run, lane = i // 128, i % 128 // 32, i % 32
        low = (_byte(block + 64 * half + 32 * (run % 2) + lane) >> (4 * (run // 2))) & 15
        high = (_byte(block + 128 + 32 * half + lane) >> (2 * run)) & 3
        scale = tl.load(block + 192 + first % QK // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_fp16(block + 208) * scale) * ((low | (high << 4)) - 32).to(tl.float32)
    return tl.reshape(w, (BLOCK_K, BLOCK_N))


@triton.jit
def _quant_linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, row_bytes, col0, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program = (tile of x's rows, tile of this part's N outputs)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    safe_cols = tl.minimum(cols, N - 1)  # their weights are decoded, never stored
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        w = _decode_tile(w_ptr, row_bytes, safe_cols, k0, K,
                         QTYPE, QK, BLOCK_BYTES, GROUP, BLOCK_K, BLOCK_N)
        acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col0 + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + col0 + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr, out_ptr, N, K, row_bytes, row0,
    QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program = a [BLOCK_N, BLOCK_K] tile of the part's weights, as floats."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    w = _decode_tile(w_ptr, row_bytes, tl.minimum(cols, N - 1), k0, K,
                     QTYPE, QK, BLOCK_BYTES, GROUP, BLOCK_K, BLOCK_N)
    out = out_ptr + (row0 + cols).to(tl.int64)[None, :] * K + k[:, None]
    tl.store(out, w, mask=(k < K)[:, None] & (cols < N)[None, :])


def _tiles(K: int) -> dict:
    """64 x 64 weights a K-step, every type: a K-quant's whole super-block
    ([256, 64]) is 128 fp32 values a thread at 4 warps, and took several
    times as long to compile for sm_90."""
    return {"BLOCK_K": min(64, triton.next_power_of_2(K)), "BLOCK_N": 64}


def quant_linear(x: torch.Tensor, blob: torch.Tensor, bias: torch.Tensor | None = None,
                 float_out: bool = False, *, config: dict | None = None) -> torch.Tensor:
    """x @ W^T (+ bias), W the blob's de-quantized weights, fp32 accumulation;
    out in x's dtype, or float32 with ``float_out``. ``config`` overrides the
    tiles (BLOCK_M/N/K: powers of two >= 16, BLOCK_K a multiple of 32)."""
    N, K = quant_shape(blob)
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight takes {K}")
    flat = x.reshape(-1, K)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    M = flat.shape[0]
    out = torch.empty(M, N, dtype=torch.float32 if float_out else x.dtype, device=x.device)
    if M == 0:
        return out.view(*x.shape[:-1], N)
    block_m = 16 if M <= 16 else 32 if M <= 64 else 64
    col0 = 0
    for type_name, data in quant_parts(blob):
        tiles = {"BLOCK_M": block_m, **_tiles(K), **(config or {})}
        rows = data.shape[0]
        if rows == 0:
            continue
        grid = (triton.cdiv(M, tiles["BLOCK_M"]), triton.cdiv(rows, tiles["BLOCK_N"]))
        _quant_linear_kernel[grid](
            flat, data, bias if bias is not None else out, out,
            M, rows, K, data.shape[1], col0, flat.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, **_type_constants(type_name), **tiles)
        col0 += rows
    return out.view(*x.shape[:-1], N)


def _dequantize_into(type_name: str, data: torch.Tensor, out: torch.Tensor, row0: int) -> None:
    """out[row0 : row0 + rows] = the part's rows (uint8 [rows, row_bytes]) as float32."""
    rows, K = data.shape[0], out.shape[1]
    if rows == 0:
        return
    tiles = _tiles(K)
    grid = (triton.cdiv(rows, tiles["BLOCK_N"]), triton.cdiv(K, tiles["BLOCK_K"]))
    _dequantize_kernel[grid](data, out, rows, K, data.shape[1], row0,
                             **_type_constants(type_name), **tiles)


def quant_dequantize(blob: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, K]: the blob's weights, gguf's numbers bit for bit; with
    `rows` (int64 indices into N), those rows only, in their order."""
    N, K = quant_shape(blob)
    if rows is not None:
        out = torch.empty(rows.numel(), K, dtype=torch.float32, device=blob.device)
        for type_name, data, where in select_rows(blob, rows):
            part = torch.empty(data.shape[0], K, dtype=torch.float32, device=blob.device)
            _dequantize_into(type_name, data.contiguous(), part, 0)
            out[where] = part
        return out
    out = torch.empty(N, K, dtype=torch.float32, device=blob.device)
    row0 = 0
    for type_name, data in quant_parts(blob):
        _dequantize_into(type_name, data, out, row0)
        row0 += data.shape[0]
    return out
