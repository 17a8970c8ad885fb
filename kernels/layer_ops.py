"""Whole decoder layers in one compiled call: which op this process's build
of the CPU ops offers for a layer of these widths (head_dim and each
linear's in_features), or None, and the layer runs its modules
(engine/model/layers/fused_layer.py decides which layers are eligible)."""

from __future__ import annotations

import torch

from kernels.cpu import ops as cpu_ops


def llama_layer_op(*widths: int):
    """The compiled op that runs a whole Llama decoder layer over a step's
    tokens (kernels/cpu/csrc/llama_layer.h: the package's CPU ops chained in
    C++, same order, same numbers), if this process's build takes rows of
    every width given (head_dim and each linear's in_features); else None."""
    ops = cpu_ops.current_ops()
    if ops is None or not hasattr(ops, "llama_layer"):
        return None
    if any(cpu_ops.ops_for(width) is None for width in widths):
        return None
    return ops.llama_layer.default  # the overload itself: one lookup less a layer


def llama_layers_op(*widths: int):
    """The compiled op that runs a stack of such layers in one call
    (llama_layer.h's llama_layers: the layer op for each in turn), under the
    same conditions as ``llama_layer_op``; else None."""
    if llama_layer_op(*widths) is None or not hasattr(cpu_ops.current_ops(), "llama_layers"):
        return None
    return cpu_ops.current_ops().llama_layers.default


def llama_stack_args(op, weights: list, k_caches: list, v_caches: list, final_norm, per_layer: int):
    """What every call of the stack op `op` passes unchanged (llama_layer.h's
    LayerStackArgs, of `op`'s build): `per_layer` weights a layer (12, or 20
    with the LoRA stacks), each layer's K and V cache, the final norm's
    weight or None. Built once; a call then hands over one object, not lists."""
    holder = getattr(torch.classes, op.namespace).LayerStackArgs
    return holder(weights, k_caches, v_caches, final_norm, per_layer)


def gemma_layer_op(*widths: int):
    """The compiled op that runs a whole Gemma 2 / 3 decoder layer
    (kernels/cpu/csrc/gemma_layer.h: llama_layer's parts, and Gemma's norms
    and GELU as the same torch ops the modules run), under the same
    conditions as ``llama_layer_op``; else None."""
    if llama_layer_op(*widths) is None or not hasattr(cpu_ops.current_ops(), "gemma_layer"):
        return None
    return cpu_ops.current_ops().gemma_layer.default
