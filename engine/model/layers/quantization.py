"""Quantized linear layers: GGUF's block formats, multiplied as they are stored.

At one stream a CPU decode step is the weight read: SmolLM2's bf16 linears
moved ~270 MB a token, its Q4_1 file holds them in ~85 MB. So a quantized
weight is never inflated: it stays in its file's blocks (Q4_0 ... Q6_K, see
kernels/quant.py) and the compiled op multiplies them directly, each
activation row quantized per 32 inputs to 8 bits as llama.cpp does (per
256 against K-quants' int8 strips, as its Q8_K; kernels/cpu/csrc/quant_linear.h).

One quantized linear serves every source of quantized weights:

    a GGUF file (--quantization gguf)     the file's own blocks, bit for bit
    a float checkpoint (--quantization q8_0 | q4_0 | ...)
                                          quantized at load, round to nearest
                                          as llama.cpp's quantizer does

The weight is one uint8 tensor, the "blob" of kernels/quant.py: a short
header, then the parts of a fused projection (q | k | v may each have their
own type in a Q4_K_M file) one after another. Being one tensor, it rides
through the fused decoder-layer op's weight arguments like a bf16 weight
(engine/model/layers/fused_layer.py), and the op picks the quantized product
by its dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.quant import QUANT_TYPES, is_quant_weight, quant_parts, quant_shape, quantize_weight
from kernels.activation import activate

# What --quantization can quantize a float checkpoint into at load.
LOAD_QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k")


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W in GGUF blocks (one blob, one or more parts);
    `lora` as on Linear (layers/linear.py)."""

    lora = None

    def __init__(self, blob: torch.Tensor, bias: torch.Tensor | None, kernels) -> None:
        super().__init__()
        self.out_features, self.in_features = quant_shape(blob)
        self.register_buffer("weight", blob)
        self.register_buffer("bias", bias)
        self.kernels = kernels

    @classmethod
    def from_linear(cls, linear, type_name: str) -> "QuantLinear":
        """A float linear layer quantized into `type_name` (q8_0, q4_k, ...)."""
        blob = quantize_weight(linear.weight.detach().float(), type_name.upper())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(blob, bias, linear.kernels)

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        y = self.kernels.quant_linear(x, self.weight, self.bias)
        return activate(y if self.lora is None else self.lora.apply(x, y), activation)

    def extra_repr(self) -> str:
        types = "+".join(name for name, _ in quant_parts(self.weight))
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"


def pack_quant_linears(model: nn.Module, kernels) -> None:
    """Every QuantLinear's blob into the layout the backend multiplies fastest
    (kernels.pack_linear: K-quants, Q4_0/Q4_1/Q5_0/Q5_1 in 16-row panels for the AVX512-VNNI
    build), one blob at a time.  An embedding's table is the model's to pack
    (a tied head's, models/llama.py): its row lookups read either layout."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.weight = kernels.pack_linear(module.weight)


def quant_embedding(kernels, input_ids: torch.Tensor, blob: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The rows of a quantized embedding table for `input_ids`, de-quantized
    (exactly: the file's values) and rounded to the model's dtype. Only the
    looked-up rows are decoded: a step touches a few of the 49152."""
    if input_ids.dim() == 1 and input_ids.dtype == torch.long:  # a step's ids: two ops (its glue runs cold)
        return kernels.quant_dequantize(blob, input_ids).to(dtype)
    rows = kernels.quant_dequantize(blob, input_ids.reshape(-1).long())
    return rows.to(dtype).view(*input_ids.shape, -1)


def check_load_quantization(name: str) -> str:
    """The GGUF type name a --quantization value quantizes into (Q4_K ...)."""
    type_name = name.upper()
    if name not in LOAD_QUANTIZATIONS or type_name not in QUANT_TYPES:
        raise ValueError(f"quantization={name!r}: a float checkpoint can be quantized at "
                         f"load into one of {LOAD_QUANTIZATIONS}")
    return type_name


__all__ = ["LOAD_QUANTIZATIONS", "QuantLinear", "check_load_quantization", "is_quant_weight",
           "pack_quant_linears", "quant_embedding"]
