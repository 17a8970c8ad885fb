"""Linear layers whose product is the kernel backend's, and the all-reduce
that closes a row-parallel one under tensor parallelism."""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import activate


class Linear(nn.Linear):
    """nn.Linear whose product is the kernel backend's: on the CPU, bf16
    weights go through the compiled op (kernels.linear), and after
    `pack_linear_weights` the weight is in the layout that op reads fastest.
    `lora`: the LoRA adapters' stack (engine/model/lora/stacks.py) when the
    engine serves adapters, added to the product of the rows that have one."""

    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool, kernels) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels

    def reset_parameters(self) -> None:
        """Nothing to draw: every weight comes from a checkpoint or the dummy
        initializer (models/loader.py), and a weight replaced by a quantized
        layer before anything writes it never becomes resident (a 7B model's
        bf16 layers are 15 GB of pages that are never touched)."""

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """The product, then `activation` (kernels.activation.LINEAR_ACTIVATIONS:
        in the compiled op's epilogue where it has it; after the adapters' rows)."""
        if self.lora is None:
            return self.kernels.linear(x, self.weight, self.bias, activation=activation)
        return activate(self.lora.apply(x, self.kernels.linear(x, self.weight, self.bias)), activation)


def packed(kernels, weight: nn.Parameter, torch_float32: bool = True) -> nn.Parameter:
    """`weight` in the layout the backend multiplies fastest (kernels.pack_linear;
    `torch_float32=False` lets a float32 weight leave torch's own matmul)."""
    return nn.Parameter(kernels.pack_linear(weight.detach(), torch_float32), requires_grad=False)


def all_reduce(partial: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's partial output (itself without tensor parallelism)."""
    if group is not None:
        group.all_reduce(partial)
    return partial
