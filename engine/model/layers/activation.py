"""The gated MLP of Llama-style decoders: down(act(gate(x)) * up(x)), with
act SiLU (Llama, Qwen, Mistral, Phi-3) or tanh-approximated GELU (Gemma);
and the plain MLP of encoders: down(act(up(x))), act BERT's exact (erf) GELU."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers.linear import Linear, all_reduce
from kernels.activation import LINEAR_ACTIVATIONS

# HF's hidden_act names -> the kernel backend's fused act(gate) * up.
ACTIVATIONS = {
    "silu": "silu_and_mul",
    "gelu_pytorch_tanh": "gelu_tanh_and_mul",
    "gelu_tanh": "gelu_tanh_and_mul",
}


class MLP(nn.Module):
    """gate_up_proj column-parallel, down_proj row-parallel (+ all-reduce).
    The gate and up projections are one matmul:

        gate_up row: [ gate: width | up: width ]  ->  silu(gate) * up
    """

    def __init__(self, hidden_size: int, width: int, bias: bool, kernels, group,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"hidden activation {activation!r} is not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        self.act_and_mul = getattr(kernels, ACTIVATIONS[activation])
        self.kernels = kernels
        self.group = group
        self.gate_up_proj = Linear(hidden_size, 2 * width, bias, kernels)
        self.down_proj = Linear(width, hidden_size, bias, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.act_and_mul(self.gate_up_proj(x))
        return all_reduce(self.down_proj(gated), self.group)


class PlainMLP(nn.Module):
    """An encoder's feed-forward block, ungated: down_proj(act(up_proj(x)))
    (BERT's intermediate.dense and output.dense).  The activation rides in
    the up projection's call (kernels.linear's epilogue on the CPU), so its
    [tokens, width] output is written once."""

    def __init__(self, hidden_size: int, width: int, kernels, activation: str = "gelu") -> None:
        super().__init__()
        if activation not in LINEAR_ACTIVATIONS:
            raise ValueError(f"hidden activation {activation!r} is not supported; "
                             f"supported: {', '.join(LINEAR_ACTIVATIONS)}")
        self.activation = activation
        self.up_proj = Linear(hidden_size, width, True, kernels)
        self.down_proj = Linear(width, hidden_size, True, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj(x, self.activation))
