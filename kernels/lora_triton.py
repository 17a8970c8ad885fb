r"""Triton multi-LoRA shrink and expand (contract: ``kernels/lora.py``).

Each row reads its own adapter slot from ``row_lora_ids`` and skips the
work when it is -1, so a batch of many adapters is one launch per op::

    _shrink_kernel   program (row t, block of R):    h[t, r] = scale * sum_k A[id, r, k] * x[t, k]
    _expand_kernel   program (row t, block of out):  y[t, o] = y[t, o] + sum_r B[id, o, r] * h[t, r]

With a fused projection's slices, a program's outputs lie in one slice
and read that slice's rank block of h: the programs' (first output, end of
its slice, first column of h) come from a small table built on the host
once per shape and device (``_strips``).

A program is a GEMV over one adapter's rows (BGMV). Rows of one id re-read
the same weights, from L2 on a GPU; the adapters are small beside the base
linear, whose cost this adds to. Inputs are upcast to fp32 after loading,
products and sums in fp32 (elementwise products and ``tl.sum``: exact fp32
arithmetic, no tensor-core rounding); y is rounded once, to its dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.lora import checked_slices

BLOCK_K = 128       # inputs per shrink step
BLOCK_OUT = 128     # outputs per expand program
MAX_BLOCK_RANK = 64  # rank rows per shrink program, and per expand step


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, ids_ptr, h_ptr, in_features, rank, scale,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program = (row, block of BLOCK_R rank rows): a GEMV of A[id]'s rows."""
    row = tl.program_id(0)
    slot = tl.load(ids_ptr + row).to(tl.int64)
    if slot < 0:  # no adapter: h's row stays 0
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rank
    a_rows = a_ptr + (slot * rank + r[:, None]) * in_features
    x_row = x_ptr + row.to(tl.int64) * in_features
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + row.to(tl.int64) * rank + r, scale * acc, mask=r_ok)


@triton.jit
def _expand_kernel(y_ptr, h_ptr, b_ptr, ids_ptr, strips_ptr, out_features, rank, h_width,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SLICED: tl.constexpr):
    """One program = (row, block of BLOCK_N outputs of one slice):
    y[row, n] += B[id, n, :] . h[row, the slice's block]."""
    row = tl.program_id(0)
    slot = tl.load(ids_ptr + row).to(tl.int64)
    if slot < 0:  # no adapter: y's row is not touched
        return
    if SLICED:  # strips_ptr: [programs, 3] int32 (first output, its slice's end, h's first column)
        strip = strips_ptr + tl.program_id(1) * 3
        n0, n_end, h0 = tl.load(strip), tl.load(strip + 1), tl.load(strip + 2)
    else:
        n0, n_end, h0 = tl.program_id(1) * BLOCK_N, out_features, 0
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < n_end
    b_rows = b_ptr + (slot * out_features + n[:, None]) * rank
    h_row = h_ptr + row.to(tl.int64) * h_width + h0
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rank
        h = tl.load(h_row + r, mask=r_ok, other=0.0)
        b = tl.load(b_rows + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * h[None, :], axis=1)
    y_at = y_ptr + row.to(tl.int64) * out_features + n
    y = tl.load(y_at, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_at, (y + acc).to(y_ptr.dtype.element_ty), mask=n_ok)


@functools.lru_cache(maxsize=256)
def _strips(bounds: tuple[int, ...], rank: int, device: torch.device) -> torch.Tensor:
    """[programs, 3] int32: each slice cut into BLOCK_OUT outputs, so no program
    straddles two slices; made once per shape (a copy to the GPU per call
    would cost more than the kernel at decode)."""
    rows = [(o, stop, i * rank) for i, (start, stop) in enumerate(zip(bounds, bounds[1:]))
            for o in range(start, stop, BLOCK_OUT)]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _rank_block(rank: int) -> int:
    return min(triton.next_power_of_2(max(rank, 1)), MAX_BLOCK_RANK)


def lora_shrink(x: torch.Tensor, lora_a_stack: torch.Tensor, row_lora_ids: torch.Tensor,
                scale: float) -> torch.Tensor:
    """h [T, R] float32 = scale * A[ids] @ x per row; rows with id -1 are 0."""
    tokens, in_features = x.shape
    rank = lora_a_stack.shape[1]
    h = torch.zeros(tokens, rank, dtype=torch.float32, device=x.device)
    if tokens == 0 or rank == 0:
        return h
    block_r = _rank_block(rank)
    grid = (tokens, triton.cdiv(rank, block_r))
    _shrink_kernel[grid](x.contiguous(), lora_a_stack.contiguous(), row_lora_ids.contiguous(), h,
                         in_features, rank, float(scale), BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b_stack: torch.Tensor,
                row_lora_ids: torch.Tensor, slices=None) -> torch.Tensor:
    """y[t] += B[ids[t]] @ h[t] in place (fp32 sums, one rounding); rows with id -1
    untouched. `slices`: a fused projection's output row bounds (kernels/lora.py)."""
    if not y.is_contiguous():
        raise ValueError("lora_expand (triton): y must be contiguous (it is written in place)")
    tokens, out_features = y.shape
    rank = lora_b_stack.shape[2]
    bounds = checked_slices(slices, out_features, h.shape[1], rank)
    if tokens == 0 or out_features == 0 or rank == 0:
        return y
    if bounds is None:
        strips, programs = row_lora_ids, triton.cdiv(out_features, BLOCK_OUT)  # strips unread
    else:
        strips = _strips(tuple(bounds), rank, y.device)
        programs = strips.shape[0]
    _expand_kernel[(tokens, programs)](
        y, h.float().contiguous(), lora_b_stack.contiguous(), row_lora_ids.contiguous(), strips,
        out_features, rank, h.shape[1], BLOCK_N=BLOCK_OUT, BLOCK_R=_rank_block(rank),
        SLICED=bounds is not None)
    return y
