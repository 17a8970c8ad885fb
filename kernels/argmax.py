"""Greedy decoding's argmax: torch.argmax(dim=-1)'s answer, compiled on the CPU.

torch's CPU argmax walks a row one element at a time (~105 µs for SmolLM2's
49,152 logits on the AVX512-BF16 Xeon, 2026-11-30); the compiled op
(kernels/cpu/csrc/argmax.h) keeps a vector of lanes' maxima and their first
indices (~9 µs). torch.argmax is the reference, and the GPU's path.
"""

from __future__ import annotations

import torch

from kernels.cpu import ops as cpu_ops


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of a 2-D tensor: each row's first index of
    its largest value (a NaN above every number). float32 rows with
    contiguous columns on the CPU take the compiled op; the rest torch's."""
    if (logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1):
        ops = cpu_ops.current_ops()
        if ops is not None:
            return ops.row_argmax(logits)
    return logits.argmax(dim=-1)
