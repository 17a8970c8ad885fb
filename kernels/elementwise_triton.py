"""Triton kernels for a layer's element-wise ops on CUDA: RMSNorm (with the
residual add in front), RoPE, and the gated MLP's activation (SiLU(gate) * up,
Gemma's tanh-GELU(gate) * up); one launch per call.

Why: the torch references (``kernels/reference.py``) run ~9 kernels for a norm
with its residual, ~5 for RoPE and 2 for the activation: ~30 tiny kernels per
layer, ~1,000 per decode step, each a few microseconds even replayed inside a
CUDA graph, where a one-stream step is otherwise near the HBM floor.  Here each
op is one kernel, reading and writing each element once::

    _rms_norm_kernel      program (row):               [residual += x]; out = w * norm(row)
    _rope_kernel          program (token, head block): x[t, h] rotated in place
    _act_and_mul_kernel   program (row, column block): out = act(gate) * up

Each rounds where the reference's torch ops round (the values are fp32 inside,
rounded to the dtype at the same points), so:

* ``rms_norm``: ``residual + x`` rounded to the residual's dtype (``add_``),
  statistics in fp32, ``x32 * rsqrt(mean + eps)`` rounded to x's dtype, THEN
  times the weight, rounded to the product's dtype (bf16 x bf16 and fp16 x fp16
  products are exact in fp32: one rounding, as torch's).  The mean sums in the
  kernel's order, not torch's: the normalized value may differ from the
  reference's by a unit in the last place of the dtype (the residual never does).
* ``rope``: ``x * cos``, ``rotate_half(x) * sin`` and their sum each rounded
  to the dtype, as torch's three ops do: the reference bit for bit in any dtype
  (launched without FMA contraction, which would fuse a float32 product into the sum).
* ``silu_and_mul`` / ``gelu_tanh_and_mul``: the activation in fp32 as torch's CUDA
  kernels write it (``x / (1 + expf(-x))`` with a correctly rounded division;
  ``0.5 x (1 + tanhf(k (x + 0.044715 x^3)))``, libdevice's expf / tanhf), rounded
  to the dtype, then times up, rounded.  The interpreter has no libdevice: there
  Triton's exp stands in (fp32 tests within a few ulps).

The dispatchers (``kernels/__init__.py``) send bf16 / fp16 CUDA tensors here;
float32 keeps the reference (its mean sums in torch's order: bit-exact HF parity).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_NORM_BLOCK = 8192  # widest row normalized from registers; wider rows loop twice
ACT_BLOCK = 1024       # outputs per activation program
ROPE_ELEMENTS = 1024   # (head, dim) pairs per RoPE program: a few heads each
GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi): torch's kBeta, rounded to fp32
GELU_KAPPA = tl.constexpr(0.044715)


def _libdevice() -> bool:
    """libdevice's expf / tanhf (torch's CUDA math) except under the interpreter,
    which has none.  Read per call: the interpreter is a per-process choice."""
    return os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _sum_row(x_row, r_row, cols, ok, HAS_RESIDUAL: tl.constexpr):
    """The row's values in x's dtype: x, or residual + x stored back into the residual."""
    h = tl.load(x_row + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_row + cols, mask=ok, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(r_row.dtype.element_ty)
        tl.store(r_row + cols, h, mask=ok)
    return h


@triton.jit
def _scale_store(h, inv, w_ptr, out_row, cols, ok):
    """out = w * (h32 * inv rounded to h's dtype), rounded to out's dtype."""
    normed = (h.to(tl.float32) * inv).to(h.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_row + cols, (w * normed).to(out_row.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, width, x_stride, r_stride, out_stride, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """One program = one row; ONE_PASS: the row fits one block, kept in registers."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    r_row = r_ptr + row * r_stride
    out_row = out_ptr + row * out_stride
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        h = _sum_row(x_row, r_row, cols, ok, HAS_RESIDUAL)
        h32 = h.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(h32 * h32, axis=0) / width + eps)
        _scale_store(h, inv, w_ptr, out_row, cols, ok)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < width
            h32 = _sum_row(x_row, r_row, cols, ok, HAS_RESIDUAL).to(tl.float32)
            acc += h32 * h32
        inv = tl.math.rsqrt(tl.sum(acc, axis=0) / width + eps)
        tl.debug_barrier()  # the sums stored into the residual, visible to the second pass
        h_row = r_row if HAS_RESIDUAL else x_row
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < width
            _scale_store(tl.load(h_row + cols, mask=ok, other=0.0), inv, w_ptr, out_row, cols, ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.rms_norm_reference in one launch: x and residual [T, H]
    with unit column stride (any row stride), weight [H]; out in torch's
    promoted dtype of weight and x (x's when they match)."""
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows == 0:
        return out
    block = min(triton.next_power_of_2(width), MAX_NORM_BLOCK)
    res = x if residual is None else residual
    _rms_norm_kernel[(rows,)](x, res, weight.contiguous(), out, width, x.stride(0), res.stride(0),
                              out.stride(0), eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                              ONE_PASS=block >= width, num_warps=min(max(block // 512, 1), 16))
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, heads, x_stride, cs_stride,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """One program = (token, BLOCK_H heads): both halves of each head, in place."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    ok = (h < heads)[:, None] & d_ok[None, :]
    table = t * cs_stride + d
    c1 = tl.load(cos_ptr + table, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    first = x_ptr + t * x_stride + h[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    # out = x * cos + cat(-x2, x1) * sin: each product rounded, then the sum
    out1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    out2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(first, out1.to(dt), mask=ok)
    tl.store(first + HALF, out2.to(dt), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernels.reference.rope_reference, in place: x [T, heads, head_dim] with
    heads and head_dim packed (any token stride), cos / sin [T, head_dim] in
    x's dtype with unit column stride.  Returns x."""
    tokens, heads, head_dim = x.shape
    if tokens == 0 or heads == 0:
        return x
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(heads), max(1, ROPE_ELEMENTS // (2 * half_pad)))
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, cos, sin, heads, x.stride(0), cos.stride(0), HALF=half, HALF_PAD=half_pad, BLOCK_H=block_h,
        enable_fp_fusion=False)
    return x


@triton.jit
def _activation(g, GELU: tl.constexpr, LIBDEVICE: tl.constexpr):
    """silu(g) or tanh-GELU(g) in fp32, as torch's CUDA kernels write them."""
    if GELU:
        inner = GELU_BETA * tl.fma(GELU_KAPPA, g * g * g, g)
        if LIBDEVICE:
            t = libdevice.tanh(inner)
        else:  # tanh(y) = 1 - 2 / (e^2y + 1), clamped where fp32's tanh is +-1
            t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.maximum(inner, -10.0), 10.0)) + 1.0)
        return 0.5 * g * (1.0 + t)
    if LIBDEVICE:
        return tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    return tl.math.div_rn(g, 1.0 + tl.exp(-g))


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, width, x_stride, out_stride,
                        GELU: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
    """One program = (row, BLOCK outputs): act(gate) rounded, times up, rounded."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    x_row = x_ptr + row * x_stride
    gate = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + width + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = _activation(gate, GELU, LIBDEVICE).to(dt).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(dt), mask=ok)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0 or width == 0:
        return out
    _act_and_mul_kernel[(rows, triton.cdiv(width, ACT_BLOCK))](
        x, out, width, x.stride(0), out.stride(0), GELU=gelu, LIBDEVICE=_libdevice(), BLOCK=ACT_BLOCK,
        num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.silu_and_mul_reference: x [T, 2W] with unit column
    stride (any row stride) -> [T, W]."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.gelu_tanh_and_mul_reference, as silu_and_mul."""
    return _act_and_mul(x, gelu=True)
