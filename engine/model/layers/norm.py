"""RMSNorm through the kernel backend (kernels.rms_norm), and the encoders' LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: x / rms(x) * weight, computed in float32 and cast back.
    With a residual it first adds x into it in place, the skip connection fused in:

        out = norm(x)                       (the first layer's input norm)
        out, residual = norm(x, residual)   (residual <- residual + x; out = norm(residual))
    """

    def __init__(self, dim: int, eps: float, kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out = self.kernels.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one and applied
    in float32 before the cast back, (x / rms(x) * (1 + w)).to(dtype), where
    Llama's casts first and multiplies after. Same residual convention as RMSNorm."""

    def __init__(self, dim: int, eps: float, kernels=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            residual.add_(x)
            x = residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class LayerNorm(nn.Module):
    """torch's LayerNorm with a bias, as BERT's post-norm layers use it: with a
    residual, norm(x + residual). The sum is a new tensor, not added in place:
    after a post-norm the normed output is the residual stream."""

    def __init__(self, dim: int, eps: float, kernels=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            x = x + residual
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
