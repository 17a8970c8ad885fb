r"""Triton fused mixture-of-experts: the experts of an MoE layer in two kernels
(contract: ``kernels.reference.fused_moe_reference``).

A torch pre-pass (``moe_align``, vLLM's moe_align_block_size) sorts the
(token, slot) pairs by expert and pads each expert's run to a multiple of
BLOCK_M, so every block of BLOCK_M rows belongs to one expert::

    pair p = t * k + j  (token t's j-th expert)          pad = T * k (no pair)
    sorted_pairs  [ p p p pad | p p pad pad | p p p p | p pad pad pad | pad ... ]
    block_expert  [    e0     |     e2      |   e5    |      e5       |  E  ... ]

    _gate_up_kernel   program (block, tile of I):  x[tokens] @ W_gate_up[e]^T  (gate and up)
                      -> silu(gate) * up -> inter[pair]                [T * k, I]
    _down_kernel      program (block, tile of H):  inter[pair] @ W_down[e]^T * topk_weights[pair]
                      -> partial[pair] (fp32)                         [T * k, H]
    out = partial.view(T, k, H).sum(1), in hidden's dtype

The grid has an upper bound of blocks (cdiv(T * k, BLOCK_M) + min(E, T * k)),
so the pre-pass needs no host sync; blocks past the last expert's (E) return
at once.  Precision as ``kernels/paged_attention.py``: fp32 accumulation,
``input_precision="ieee"`` (fp32 stays fp32, no TF32), and under the
interpreter (CPU tensors) every tile upcast to fp32 after loading.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, inter_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_experts, num_pairs, top_k, hidden_size, width,
    stride_xt, stride_we, stride_wn, stride_wk, stride_ip,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program = (block of one expert's pairs, tile of the I columns)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:  # past the last expert's blocks
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    ks = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    w_up = w_gate + width * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k = k0 + ks
        k_ok = k < hidden_size
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_gate + k[:, None] * stride_wk, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if UPCAST:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate += tl.dot(x, wg, input_precision="ieee")
        up += tl.dot(x, wu, input_precision="ieee")
    act = gate * tl.sigmoid(gate) * up
    rows = pairs.to(tl.int64)[:, None] * stride_ip
    tl.store(inter_ptr + rows + cols[None, :], act.to(inter_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w_ptr, partial_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_experts, num_pairs, width, hidden_size,
    stride_ip, stride_we, stride_wn, stride_wk, stride_pp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program = (block of one expert's pairs, tile of the H columns);
    each pair's row times its routing weight, in fp32."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    safe_pairs = tl.where(valid, pairs, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + ks
        k_ok = k < width
        a = tl.load(inter_ptr + safe_pairs[:, None] * stride_ip + k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision="ieee")
    acc *= tl.load(weights_ptr + safe_pairs, mask=valid, other=0.0)[:, None]
    tl.store(partial_ptr + safe_pairs[:, None] * stride_pp + cols[None, :], acc,
             mask=valid[:, None] & col_ok[None, :])


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_pairs int32 [blocks * block_m], block_expert int32 [blocks]) as drawn
    above: each expert's pairs (ascending pair index) padded to whole blocks."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[(padded_end - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def _config(num_pairs: int) -> dict:
    return {"BLOCK_M": 16 if num_pairs <= 256 else 64, "BLOCK_N": 64, "BLOCK_K": 64}


def fused_moe(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              config: dict | None = None) -> torch.Tensor:
    """The experts' weighted sum [T, H] in hidden's dtype (see the module
    docstring); ``config`` overrides the block sizes (BLOCK_M/N/K, each >= 16)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, width = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    blocks = {**_config(num_pairs), **(config or {})}
    hidden = hidden.contiguous()
    sorted_pairs, block_expert = moe_align(topk_ids, num_experts, blocks["BLOCK_M"])
    upcast = not hidden.is_cuda
    inter = torch.empty(num_pairs, width, dtype=hidden.dtype, device=hidden.device)
    grid = (block_expert.numel(), triton.cdiv(width, blocks["BLOCK_N"]))
    _gate_up_kernel[grid](
        hidden, w_gate_up, inter, sorted_pairs, block_expert,
        num_experts, num_pairs, top_k, hidden_size, width,
        hidden.stride(0), *w_gate_up.stride(), inter.stride(0), UPCAST=upcast, **blocks)
    partial = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    grid = (block_expert.numel(), triton.cdiv(hidden_size, blocks["BLOCK_N"]))
    _down_kernel[grid](
        inter, w_down, partial, weights, sorted_pairs, block_expert,
        num_experts, num_pairs, width, hidden_size,
        inter.stride(0), *w_down.stride(), partial.stride(0), UPCAST=upcast, **blocks)
    return partial.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
