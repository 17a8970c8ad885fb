"""What a linear may apply to its own output (kernels.linear's ``activation``):
an encoder's up projection, BERT's GELU.  The names are HF's hidden_act
names; the functions compute them as HF's ACT2FN does, the reference every
fused form (the compiled op's epilogue, oneDNN's post-op) is held to."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

LINEAR_ACTIVATIONS = {
    "gelu": F.gelu,  # exact: x * Phi(x), through erf (BERT, XLM-RoBERTa)
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``y`` through the named activation (LINEAR_ACTIVATIONS; None: ``y`` itself)."""
    return y if activation is None else LINEAR_ACTIVATIONS[activation](y)
