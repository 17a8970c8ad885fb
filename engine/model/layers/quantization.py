"""Weight-only int4 (``--quantization int4``): fewer bytes per decoded token on CPU.

A decode step at small batch reads every weight once per token, and on the CPU
that read is most of the step: in a batch-1 SmolLM2 step (py-spy) the bf16
linear layers and the LM head took about 60 % of the time, moving ~270 MB at
about 14 GB/s. Four-bit weights with a bf16 scale and zero point per group of
32 inputs move about a quarter of that. The layout is what torch's CPU int4
kernel (`torch._weight_int4pack_mm_for_cpu`, the one gpt-fast and torchao
use) expects::

    w[o, 32 g + i] = (q[o, 32 g + i] - 8) * scale[g, o] + zero[g, o]      q in 0..15
    scales_and_zeros: [in / 32, out, 2] bf16           packed: q, two per byte

Two ways to multiply the same numbers: the int4 kernel for a few rows (decode
of a small batch), and oneDNN's bf16 matmul over the dequantized weights for
many rows (prefill, large batches), where the int4 kernel, dequantizing on
every call, is slower (per layer, cache hot: 1 row 89 against 234 µs; 8 rows
285 against 322; 16 rows 564 against 465). Both paths use the same weight
values, so which one served a request changes its numbers only by rounding,
as batching already does.

GGUF's Q4_1 (the default model's file) stores w = d * q + m per 32 weights:
the same grid (scale d, zero m + 8 d), so min/max quantization of the
dequantized checkpoint finds it again, up to bf16 rounding of the scale and
the zero point. That rounding is the kernel's format, and it is not free: bf16
keeps 8 bits, so a group whose offset is large against its step moves by a
visible part of a step. On SmolLM2 the int4 weights differ from the
checkpoint by 0.42-0.48 % (relative norm) where bf16 rounding alone gives
0.13 %; enough to flip a near-tie (tests/engine/test_quantization.py). The LM
head stays bf16, as llama.cpp keeps it at 8 bits (Q8_0) in this same file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32
INT4_KERNEL_MAX_ROWS = 16  # up to this many rows the int4 kernel serves a call


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 per group of 32 inputs.

    Returns (packed weights, scales_and_zeros, the dequantized bf16 weights).
    """
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"int4 needs in_features divisible by {GROUP_SIZE}, got {in_features}")
    groups = weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low = groups.amin(-1, keepdim=True)
    scale = ((groups.amax(-1, keepdim=True) - low) / 15).clamp(min=1e-12)
    q = ((groups - low) / scale).round().clamp(0, 15)
    # The kernel reads bf16 scales and zeros: dequantize with exactly those.
    scale = scale.to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    dequantized = ((q - 8) * scale + zero).view(out_features, in_features).to(torch.bfloat16)
    packed = torch._convert_weight_to_int4pack_for_cpu(
        q.view(out_features, in_features).to(torch.int32), 1)
    scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros.to(torch.bfloat16), dequantized


class Int4Linear(nn.Module):
    """A bf16 nn.Linear's int4 replacement (CPU); see the module docstring."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        packed, scales_and_zeros, dequantized = quantize_int4(weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("weight", dequantized)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        return cls(linear.weight.detach(), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT4_KERNEL_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, GROUP_SIZE, self.scales_and_zeros)
        return out if self.bias is None else out + self.bias
