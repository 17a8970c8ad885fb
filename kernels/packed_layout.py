"""nn.Linear's weights in the layout the compiled CPU linear reads fastest,
and the helpers that take a weight in either layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import ops as cpu_ops
from kernels.quant import is_quant_weight, pack_quant_panels, quant_shape
from kernels.activation import activate
from kernels.reference import linear_reference

# -- weights packed for the bf16 dot product ------------------------------------------
#
#   W [out, in]  ->  packed [out / 16, in / 2, 16, 2]:  W[n][2p + j] = packed[n // 16][p][n % 16][j]
#
# One 64-byte vector of the packed weight is one input pair of 16 output
# features, what AVX512-BF16's dot product multiplies by a broadcast pair of
# x; AVX2 reads it as two vectors of 8 features and splits each pair with a
# shift and an and (kernels/cpu/csrc/linear_packed.h draws both).

PACKED_DIMS = 4
PACK_LANES = 16


def pack_linear(weight: torch.Tensor, torch_float32: bool = True) -> torch.Tensor:
    """``weight`` [out, in] in the layout ``linear`` multiplies fastest: packed
    as above where the compiled ops have the packed linear (bf16 weights, a CPU
    with AVX-512 or AVX2, out a multiple of 16), else ``weight`` itself.  ``linear``,
    ``unpack_linear`` and ``embedding`` take either.

    A float32 weight keeps torch's matmul (MKL's sgemm, whose sums are HF's
    to the bit: the decoders' float32 parity) unless the caller lets it go
    (``torch_float32=False``: an encoder, held to its reference within a
    bound); then it moves to oneDNN's layout, whose float32 matmul ran
    1.8-2.2x MKL's on BERT's shapes on a Zen 5 CPU, where MKL takes no
    AVX-512 path (outputs within 1e-6 of MKL's, relative to the largest).
    A quantized blob: ``pack_quant_linear``'s layout."""
    if is_quant_weight(weight):
        return pack_quant_linear(weight)
    if weight.dtype == torch.float32 and not torch_float32:
        return onednn_layout(weight)
    if weight.dtype != torch.bfloat16 or not weight.is_cpu or weight.dim() != 2:
        return weight
    out_features, in_features = weight.shape
    ops = cpu_ops.ops_for(in_features)
    if ops is None or not hasattr(ops, "linear_bf16_packed") or out_features % PACK_LANES:
        return weight
    blocks = weight.reshape(out_features // PACK_LANES, PACK_LANES, in_features // 2, 2)
    return blocks.transpose(1, 2).contiguous()


def unpack_linear(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's [out, in] layout back (a copy) from ``pack_linear``'s; any other weight as it is."""
    if weight.is_mkldnn:
        return weight.to_dense()
    if weight.dim() != PACKED_DIMS:
        return weight
    return weight.transpose(1, 2).reshape(-1, 2 * weight.shape[1])


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding over a weight in either layout: a tied LM head is packed,
    and the embedding reads its rows from there rather than keep a second copy."""
    if weight.dim() != PACKED_DIMS:
        return F.embedding(ids, weight)
    flat = ids.reshape(-1)
    rows = weight[flat // PACK_LANES, :, flat % PACK_LANES, :]  # [tokens, in / 2, 2]
    return rows.reshape(*ids.shape, 2 * weight.shape[1])


# The activations linear_bf16_packed applies in its epilogue (kernels/cpu/csrc/epilogue.h).
EPILOGUE_ACTIVATIONS = ("gelu", "relu")


def packed_linear(x, weight, bias=None, float_out=False, activation=None):
    """``linear`` over a weight in this layout (the compiled op, with the
    activation in its epilogue where it has it; the reference on the unpacked
    copy where the ops were turned off after packing)."""
    in_features = 2 * weight.shape[1]
    ops = cpu_ops.ops_for(in_features)
    if ops is None:  # the ops were turned off after the weights were packed
        return linear_reference(x, unpack_linear(weight), bias, float_out, activation)
    if activation is None:  # every decoder's call: nothing more to look up
        return over_rows(ops.linear_bf16_packed, x, in_features, weight, bias, float_out)
    if activation in EPILOGUE_ACTIVATIONS:
        return over_rows(ops.linear_bf16_packed, x, in_features, weight, bias, float_out, activation)
    return activate(over_rows(ops.linear_bf16_packed, x, in_features, weight, bias, float_out), activation)


def over_rows(op, x, in_features, weight, bias, float_out, *options):
    """A compiled linear, which takes x as [tokens, in], over x of any leading shape."""
    if x.dim() == 2:
        return op(x, weight, bias, float_out, *options)
    out = op(x.reshape(-1, in_features), weight, bias, float_out, *options)
    return out.view(*x.shape[:-1], out.shape[-1])


# -- quantized blobs in 16-row panels ---------------------------------------------------


def pack_quant_linear(blob: torch.Tensor) -> torch.Tensor:
    """A CPU blob in 16-row panels where this process's compiled op reads
    them (its AVX512-VNNI build without AMX; K-quant parts, or Q4_0, Q4_1,
    Q5_0 and Q5_1 ones, of whole panels: kernels/quant.py), else the blob itself.  Made at load for the build
    that will multiply it: another build refuses a panel blob."""
    ops = cpu_ops.ops_for(quant_shape(blob)[1])
    if blob.is_cpu and ops is not None and hasattr(ops, "quant_panels") and ops.quant_panels():
        return pack_quant_panels(blob)
    return blob


# -- float32 weights in oneDNN's layout -------------------------------------------------


def onednn_layout(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU weight as a oneDNN tensor (``linear`` then calls oneDNN's
    matmul), where torch was built with oneDNN; else ``weight`` itself."""
    if not weight.is_cpu or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return weight
    return weight.detach().contiguous().to_mkldnn()


# kernels.activation.LINEAR_ACTIVATIONS' names -> oneDNN's post-op and its algorithm.
ONEDNN_POST_OPS = {None: ("none", ""), "gelu": ("gelu", "none"), "gelu_pytorch_tanh": ("gelu", "tanh"),
                   "relu": ("relu", "")}


def onednn_linear(x, weight, bias=None, float_out=False, activation=None):
    """``linear`` over a weight in oneDNN's layout: the op inductor's fused
    linears call, with the activation as oneDNN's post-op (its GELU and ReLU
    gave F.gelu's and F.relu's of its own product to the bit on BERT's shapes)."""
    attr, algorithm = ONEDNN_POST_OPS[activation]
    out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
    return out.float() if float_out else out
