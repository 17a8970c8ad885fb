"""The gated MLP of Llama-style decoders: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers.linear import Linear, all_reduce


class MLP(nn.Module):
    """gate_up_proj column-parallel, down_proj row-parallel (+ all-reduce).
    The gate and up projections are one matmul:

        gate_up row: [ gate: width | up: width ]  ->  silu(gate) * up
    """

    def __init__(self, hidden_size: int, width: int, bias: bool, kernels, group) -> None:
        super().__init__()
        self.kernels = kernels
        self.group = group
        self.gate_up_proj = Linear(hidden_size, 2 * width, bias, kernels)
        self.down_proj = Linear(width, hidden_size, bias, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.kernels.silu_and_mul(self.gate_up_proj(x))
        return all_reduce(self.down_proj(gated), self.group)
