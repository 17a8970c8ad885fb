"""The experts of a mixture-of-experts layer (``fused_moe``): the auto
dispatch and the CPU path.  Contract: ``kernels.reference.fused_moe_reference``.

* CUDA tensors: the Triton kernels (``kernels/fused_moe_triton.py``).
* CPU: the reference's grouping (tokens gathered per expert, experts in
  ascending order), each expert's two GEMMs through ``kernels.linear``, so
  bf16 weights take the compiled linear, and ``kernels.silu_and_mul``.  The
  expert weights may be stacked per-expert packings (``pack_experts``):
  ``w_gate_up[e]`` is then ``kernels.pack_linear`` of expert e's [2I, H].

This module is not ``kernels/fused_moe.py``: importing a submodule of that
name would replace the function ``kernels.fused_moe``.
"""

from __future__ import annotations

import importlib

import torch

import kernels
from kernels.reference import fused_moe_reference, moe_groups

__all__ = ["fused_moe", "fused_moe_cpu", "fused_moe_reference", "pack_experts"]


def fused_moe(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The auto backend's experts: Triton on CUDA, the CPU path otherwise."""
    if hidden.is_cuda:
        triton_moe = importlib.import_module("kernels.fused_moe_triton")
        return triton_moe.fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    return fused_moe_cpu(hidden, w_gate_up, w_down, topk_weights, topk_ids)


def fused_moe_cpu(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The reference's grouping with the CPU's linear: per expert that has
    tokens, gate_up -> silu * mul -> down (float32 out, no bf16 rounding
    before the routing weight), weighted and summed in float32."""
    if hidden.shape[0] == 1:  # a decode step of one sequence: no grouping to do
        return _one_token(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert, tokens, slots in moe_groups(topk_ids, w_gate_up.shape[0]):
        expert_out = _expert(hidden[tokens], w_gate_up[expert], w_down[expert])
        out.index_add_(0, tokens, expert_out * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)


def _one_token(hidden, w_gate_up, w_down, topk_weights, topk_ids):
    """fused_moe_cpu of T = 1: the same sum, in the same (ascending expert) order."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    weights = topk_weights[0].float()
    ids = topk_ids[0].tolist()
    for slot in sorted(range(len(ids)), key=ids.__getitem__):
        out += _expert(hidden, w_gate_up[ids[slot]], w_down[ids[slot]]) * weights[slot]
    return out.to(hidden.dtype)


def _expert(rows, w_gate_up, w_down):
    """One expert's down(silu(gate(x)) * up(x)), float32, for its rows of x."""
    gated = kernels.silu_and_mul(kernels.linear(rows, w_gate_up))
    return kernels.linear(gated, w_down, float_out=True)


def pack_experts(weight: torch.Tensor, pack_linear=None) -> torch.Tensor:
    """[E, out, in] expert weights -> each expert through ``pack_linear``
    (default ``kernels.pack_linear``), stacked: [E, *packed shape].  Returns
    ``weight`` itself where packing does not apply (dtype, CPU, widths)."""
    pack = pack_linear or kernels.pack_linear
    first = pack(weight[0])
    if first.dim() == weight.dim() - 1 and first.shape == weight.shape[1:]:
        return weight
    stacked = torch.empty((weight.shape[0], *first.shape), dtype=first.dtype, device=first.device)
    stacked[0] = first
    for expert in range(1, weight.shape[0]):  # one expert at a time: no second full copy
        stacked[expert] = pack(weight[expert])
    return stacked
