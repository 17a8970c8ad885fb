"""Multi-LoRA: each row of a batch through its own adapter, around the base linear.

A batch mixes sequences that ask for different adapters (or none). The
adapters' low-rank pairs are stacked in slots, and each row names its slot::

    lora_shrink(x, lora_a_stack, row_lora_ids, scale) -> h
        x [T, in] fp32 / bf16 / fp16; lora_a_stack [S, R, in], x's dtype;
        row_lora_ids [T] int32 or int64, a slot or -1 (no adapter);
        h [T, R] float32: h[t] = scale * (A[ids[t]] @ x[t]), products of the
        inputs upcast to float32, float32 sums; rows with id -1 are 0.
    lora_expand(y, h, lora_b_stack, row_lora_ids, slices=None) -> y     (in place)
        y [T, out] (the base linear's output); lora_b_stack [S, out, R], y's dtype;
        y[t] = (y[t].float() + B[ids[t]].float() @ h[t]).to(y.dtype) where
        ids[t] >= 0; rows with id -1 untouched (bit for bit).
        slices = [s_0 = 0 < s_1 < ... < s_n = out]: a fused projection's n
        slices (qkv_proj's q | k | v rows); h is [T, n * R], and output rows
        [s_i, s_i+1) read only h's columns [i * R, (i + 1) * R):
        y[t, s_i:s_i+1] += B[ids[t], s_i:s_i+1] @ h[t, i*R:(i+1)*R].

R is the padded rank (an adapter of smaller rank has zero rows in A and
zero columns in B); the scale (alpha / rank) is applied once, in shrink.
Why slices: without them a fused projection's B is block-diagonal,
[out, n * R] with each slice's rows zero outside its own block, and expand
reads (n - 1) / n zeros; with them B holds only the blocks ([out, R]).

Here: the references (any device; a loop over the distinct ids, each a
gather and one matmul: never a [T, R, in] gather of the weights), and the
CPU entry points, which take the compiled op (kernels/cpu/csrc/lora.h: any
width, runs of equal ids share their weights' loads) when this process has
a build, else the reference; and the ``auto`` entry points, which send CUDA
tensors to Triton's (kernels/lora_triton.py).
"""

from __future__ import annotations

import importlib

import torch

from kernels.cpu import ops as cpu_ops

LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _slots(row_lora_ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, the rows that take it) for every slot the batch uses."""
    ids = row_lora_ids.long()
    return [(slot, (ids == slot).nonzero().squeeze(1))
            for slot in torch.unique(ids).tolist() if slot >= 0]


def lora_shrink_reference(x: torch.Tensor, lora_a_stack: torch.Tensor, row_lora_ids: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """h [T, R] float32; see the module docstring."""
    h = torch.zeros(x.shape[0], lora_a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _slots(row_lora_ids):
        h[rows] = scale * (x[rows].float() @ lora_a_stack[slot].float().t())
    return h


def checked_slices(slices, out: int, h_width: int, rank: int) -> list[int] | None:
    """`slices` as a list of ints (None stays None), refused with a ValueError
    unless they cut [0, out) into n slices and h is n rank blocks wide."""
    if slices is None:
        if h_width != rank:
            raise ValueError(f"lora_expand: h is {h_width} wide, lora_b_stack's rank {rank}")
        return None
    bounds = [int(s) for s in slices]
    n = len(bounds) - 1
    if n < 1 or bounds[0] != 0 or bounds[-1] != out or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"lora_expand: slices {bounds} must rise from 0 to out = {out}")
    if h_width != n * rank:
        raise ValueError(f"lora_expand: h is {h_width} wide; {n} slices of rank {rank} need {n * rank}")
    return bounds


def lora_expand_reference(y: torch.Tensor, h: torch.Tensor, lora_b_stack: torch.Tensor,
                          row_lora_ids: torch.Tensor, slices=None) -> torch.Tensor:
    """y += B[ids] @ h in place (one rounding to y's dtype); see the module docstring."""
    rank = lora_b_stack.shape[2]
    bounds = checked_slices(slices, y.shape[1], h.shape[1], rank)
    if bounds is not None:  # each slice on its own: views of y's columns and h's block
        for i, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            lora_expand_reference(y[:, start:stop], h[:, i * rank:(i + 1) * rank],
                                  lora_b_stack[:, start:stop], row_lora_ids)
        return y
    for slot, rows in _slots(row_lora_ids):
        y[rows] = (y[rows].float() + h[rows].float() @ lora_b_stack[slot].float().t()).to(y.dtype)
    return y


def _compiled_takes(rows: torch.Tensor, stack: torch.Tensor, row_lora_ids: torch.Tensor) -> bool:
    """The compiled op's terms: CPU tensors of one supported dtype, 2-D rows,
    a 3-D stack, integer ids. Contiguity is the caller's to arrange."""
    return (rows.is_cpu and stack.is_cpu and row_lora_ids.is_cpu and rows.dim() == 2
            and stack.dim() == 3 and rows.dtype in LORA_DTYPES and stack.dtype == rows.dtype
            and row_lora_ids.dtype in (torch.int32, torch.int64))


def lora_shrink_cpu(x: torch.Tensor, lora_a_stack: torch.Tensor, row_lora_ids: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The compiled shrink when this process has a build (any width), else the reference."""
    if _compiled_takes(x, lora_a_stack, row_lora_ids):
        ops = cpu_ops.current_ops()
        if ops is not None:
            return ops.lora_shrink(x.contiguous(), lora_a_stack.contiguous(), row_lora_ids, float(scale))
    return lora_shrink_reference(x, lora_a_stack, row_lora_ids, scale)


def lora_expand_cpu(y: torch.Tensor, h: torch.Tensor, lora_b_stack: torch.Tensor,
                    row_lora_ids: torch.Tensor, slices=None) -> torch.Tensor:
    """The compiled expand when this process has a build and y is contiguous
    (it is written in place), else the reference. Returns y."""
    if (_compiled_takes(y, lora_b_stack, row_lora_ids) and y.is_contiguous()
            and h.dtype == torch.float32 and h.is_cpu):
        ops = cpu_ops.current_ops()
        if ops is not None:
            bounds = None if slices is None else [int(s) for s in slices]
            ops.lora_expand(y, h.contiguous(), lora_b_stack.contiguous(), row_lora_ids, bounds)
            return y
    return lora_expand_reference(y, h, lora_b_stack, row_lora_ids, slices)


# The ``auto`` backend's entry points (kernels/__init__.py exports them):
# Triton for CUDA tensors, imported on first use; the CPU paths above otherwise.
def lora_shrink(x: torch.Tensor, lora_a_stack: torch.Tensor, row_lora_ids: torch.Tensor,
                scale: float) -> torch.Tensor:
    """h [T, R] float32 = scale * A[ids[t]] @ x[t] per row (0 where the id is -1)."""
    if x.is_cuda:
        return importlib.import_module("kernels.lora_triton").lora_shrink(x, lora_a_stack, row_lora_ids, scale)
    return lora_shrink_cpu(x, lora_a_stack, row_lora_ids, scale)


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b_stack: torch.Tensor,
                row_lora_ids: torch.Tensor, slices=None) -> torch.Tensor:
    """y[t] += B[ids[t]] @ h[t] in place (rows with id -1 untouched; `slices`:
    see the module docstring); returns y. A y the kernels cannot write in
    place (not contiguous) takes the reference."""
    if y.is_cuda and y.is_contiguous():
        triton_lora = importlib.import_module("kernels.lora_triton")
        return triton_lora.lora_expand(y, h, lora_b_stack, row_lora_ids, slices)
    if y.is_cuda:
        return lora_expand_reference(y, h, lora_b_stack, row_lora_ids, slices)
    return lora_expand_cpu(y, h, lora_b_stack, row_lora_ids, slices)
