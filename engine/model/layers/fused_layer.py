"""A whole decoder layer in one compiled call.

Why: at one stream a small model's decode step is mostly glue. SmolLM2's
30 layers made ~50 Python and aten calls each, ~6 of the ~18 ms a token
took on an AVX2 EPYC, while its linears already read at the memory's rate;
a speculative step, a few rows per sequence, paid the same glue again.
`kernels.llama_layer_op` chains the same compiled ops in C++, in the same
order (decode rows through the decode kernel, prefill and drafted rows
through the prefill kernel, as `PagedAttention` splits them), so a layer's
numbers do not change (tests/engine/test_fused_layer.py holds the two paths
to the bit) and a layer costs one call. The model's layer loop is here too,
so that what a step decides once (is it bf16 on the CPU, ...) is checked
once, not per layer, and a layer costs no module call either:

    LlamaForCausalLM.forward ──► LayerStack ──► step_args (once a step)
        every layer bound alike:  Stacked ──► run_stacked ──► one op for all
        else run_layers, per layer:  bound ──► run ──► one op ──► (hidden, residual)
                                     None  ──► the layer's modules, op by op

A call from Python is dear here: ~21 us of a SmolLM2 layer's ~300 on AVX2
(29 arguments parsed and boxed, on code and data the weight stream of the
layer before pushed out of the caches), so once every layer has been bound
to the same op build and the same numbers, a step makes one call for the
whole stack (`kernels.llama_layers_op`: the layer op for each in turn in
C++, so again the same numbers).

Eligible: a layer built from the shared parts as they are (`Attention`,
with or without Qwen3's per-head `RMSNorm`s of q and k, `MLP` with SiLU,
`RMSNorm`, `Linear` or `QuantLinear`: the op multiplies a quantized weight
by its dtype), no tensor parallelism; then per step: bf16 on the CPU, caches
of the model's dtype, and a build of the compiled ops that takes every
width. Gemma 2 / 3's layers (four `GemmaRMSNorm`s, GELU-tanh, Gemma 3's
per-head norms) take a second op, `kernels.gemma_layer_op`, a call a layer
(`run_kinds`: each kind of layer has its own RoPE tables). Anything else
(MoE experts, float32, a GPU) runs the modules, whose kernels choose for
themselves. Under LoRA adapters the Llama op adds each row's update itself
(StepArgs.lora_ids, Bound.lora); a Gemma layer runs its modules for such a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.attention_metadata import AttentionMetadata
from engine.model.layers.activation import MLP
from engine.model.layers.attention import Attention, PagedAttention
from engine.model.layers.linear import Linear
from engine.model.layers.norm import GemmaRMSNorm, RMSNorm
from engine.model.layers.quantization import QuantLinear
from kernels import llama_stack_args
from kernels.kv_quant import QUANTIZED_CACHES


UNKNOWN = object()  # a layer's Bound before its first step


@dataclass(frozen=True)
class Shape:
    """What the op needs besides tensors, fixed when the layer is built."""

    num_heads: int
    num_kv_heads: int
    widths: tuple[int, ...]  # head_dim and each linear's in_features
    eps: float
    scale: float
    sliding_window: int
    logits_soft_cap: float
    gemma: bool  # GemmaDecoderLayer: gemma_layer_op, else llama_layer_op


def _is_gemma(layer) -> bool:
    """A GemmaDecoderLayer (models/gemma.py imports this module): four norms."""
    return hasattr(layer, "pre_feedforward_layernorm")


def _norms(layer) -> tuple:
    """The layer's norms in its op's order, the per-head ones aside."""
    if _is_gemma(layer):
        return (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm)
    return layer.input_layernorm, layer.post_attention_layernorm


def shape_of(layer) -> Shape | None:
    """The layer's Shape if it is built from the parts the op fuses, else None."""
    attn, mlp, gemma = layer.self_attn, layer.mlp, _is_gemma(layer)
    norms = _norms(layer)
    if type(attn) is Attention and attn.q_norm is not None:  # Qwen3's, Gemma 3's: inside the op
        norms += (attn.q_norm, attn.k_norm)
    # The op runs the activation the backend gives the module (Gemma's: the reference
    # GELU's torch ops, which the CPU's gelu_tanh_and_mul is); another would differ.
    norm_type, act = ((GemmaRMSNorm, attn.kernels.gelu_tanh_and_mul) if gemma
                      else (RMSNorm, attn.kernels.silu_and_mul))
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj) if type(mlp) is MLP else ()
    if (type(attn) is not Attention or attn.group is not None
            or type(mlp) is not MLP or mlp.group is not None or mlp.act_and_mul is not act
            or any(type(norm) is not norm_type or norm.eps != norms[0].eps for norm in norms)
            or any(type(linear) not in (Linear, QuantLinear) for linear in linears)):
        return None
    features = attn.attn.features
    return Shape(attn.num_heads, attn.num_kv_heads,
                 (attn.head_dim,) + tuple(linear.in_features for linear in linears),
                 norms[0].eps, attn.attn.scale, features.get("sliding_window") or 0,
                 features.get("logits_soft_cap") or 0.0, gemma)


@dataclass(frozen=True, eq=False)
class Bound:
    """A layer's op and every argument of it that no step changes, gathered
    once. Why: looking the op up (the build, each width) and reading ten
    tensors off the modules took ~45 us a layer, ~1.4 ms of a 17 ms SmolLM2
    step on AVX2; a step now only adds its activations and batch layout."""

    shape: Shape
    op: Callable
    paged: PagedAttention  # the layer's attention: which cache slice and batch view it reads
    weights: tuple  # the op's weight arguments (Llama's twelve, Gemma's fourteen; None: none)
    numbers: tuple  # the op's trailing numbers, from Shape
    lora: tuple | None = None  # the LoRA stacks, A and B of each projection (Llama's op only)


def bind(layer) -> Bound | None:
    """The layer's Bound, or None if it is not built from the fused parts or
    this process's build of the compiled ops cannot take its widths. Called at
    the first step, when the weights are final (loaded, packed or quantized)."""
    shape = shape_of(layer)
    if shape is None:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    op = (attn.kernels.gemma_layer_op if shape.gemma else attn.kernels.llama_layer_op)(*shape.widths)
    if op is None:
        return None
    norms = [norm.weight for norm in _norms(layer)]
    # Gemma's pre-feedforward norm follows the post-attention one, its
    # post-feedforward norm follows down_proj.
    middle, last = (norms[1:3], norms[3:]) if shape.gemma else (norms[1:], [])
    weights = (norms[0], attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
               *middle, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight,
               mlp.down_proj.bias, *last, None if attn.q_norm is None else attn.q_norm.weight,
               None if attn.k_norm is None else attn.k_norm.weight)
    numbers = (shape.num_heads, shape.num_kv_heads, shape.eps, shape.scale, shape.sliding_window,
               shape.logits_soft_cap)
    return Bound(shape, op, attn.attn, weights, numbers, _lora_stacks(layer, shape))


def _lora_stacks(layer, shape: Shape) -> tuple | None:
    """A and B of each projection's LoRAStack (engine/model/lora/stacks.py), in
    the op's order, when the engine serves adapters and the op adds them
    (Llama's; Gemma's layer runs its modules under an adapter)."""
    attn, mlp = layer.self_attn, layer.mlp
    stacks = [attn.qkv_proj.lora, attn.o_proj.lora, mlp.gate_up_proj.lora, mlp.down_proj.lora]
    if shape.gemma or any(stack is None for stack in stacks):
        return None
    return tuple(t for stack in stacks for t in (stack.a, stack.b))


@dataclass(frozen=True)
class StepArgs:
    """What every layer's call shares within a step."""

    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: tuple  # (K of every layer, V of every layer), as the runner gives it
    meta: AttentionMetadata
    lora_ids: torch.Tensor | None = None  # each row's LoRA slot, when some row has one


def step_args(rope_tables, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata,
              lora=None) -> StepArgs | None:
    """The step's shared arguments, or None where this step cannot take the op
    (then every layer runs its modules): bf16 rows on the CPU, RoPE tables of
    that dtype, caches of that dtype or int8 / fp8 (kernels/kv_quant.py), int64
    slots. `lora`: the LoRAContext of an engine serving adapters (its rows'
    slots go to the op, which adds their updates)."""
    cos, sin = rope_tables
    cache_dtype = kv_cache[0][0].dtype
    if not (hidden.dtype == torch.bfloat16 and hidden.is_cpu and hidden.dim() == 2
            and hidden.is_contiguous() and hidden.shape[0] > 0 and cos.dtype == hidden.dtype
            and cache_dtype in (hidden.dtype, *QUANTIZED_CACHES) and kv_cache[1][0].dtype == cache_dtype
            and cos.is_contiguous() and sin.is_contiguous()
            and meta.slot_mapping.dtype == torch.int64):
        return None
    return StepArgs(cos, sin, kv_cache, meta, None if lora is None else lora.row_ids)


def run(bound: Bound, step: StepArgs, hidden: torch.Tensor, residual: torch.Tensor | None):
    """(MLP output, residual) of one layer, in one op."""
    k_cache, v_cache, meta = bound.paged.layer_view(step.kv_cache, step.meta)
    lora = () if step.lora_ids is None else (step.lora_ids, *bound.lora)
    return bound.op(hidden, residual, *bound.weights, step.cos, step.sin, k_cache, v_cache,
                    meta.slot_mapping, meta.num_decode_tokens, meta.decode_block_tables,
                    meta.decode_context_lens, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                    meta.prefill_context_lens, *bound.numbers, *lora)


def run_layers(layers, step: StepArgs | None, rope_tables, hidden: torch.Tensor, kv_cache,
               meta: AttentionMetadata):
    """(last MLP output, residual) after every layer: each in one op where it
    is bound and the step allows (`step` is not None), else by its modules.
    A layer is bound at its first step (its parts and weights are final by
    then) unless its `fuse` is False."""
    residual = None
    for layer in layers:
        hidden, residual = run_layer(layer, step, rope_tables, hidden, residual, kv_cache, meta)
    return hidden, residual


def run_layer(layer, step: StepArgs | None, rope_tables, hidden: torch.Tensor, residual, kv_cache,
              meta: AttentionMetadata):
    """(MLP output, residual) of one layer: in one op where it is bound and
    the step allows, else by its modules (which take `rope_tables` as given)."""
    bound = None
    if step is not None and layer.fuse:
        if layer._fused is UNKNOWN:
            layer._fused = bind(layer)
        bound = layer._fused
    if bound is None or (step.lora_ids is not None and bound.lora is None):
        return layer(rope_tables, hidden, residual, kv_cache, meta)
    return run(bound, step, hidden, residual)


def run_kinds(layers, rope_tables: dict, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata,
              lora=None):
    """Gemma's layer loop: run_layers with RoPE tables per kind of layer
    (`layer.layer_type`), so a step's StepArgs per kind; a call a layer."""
    steps = {kind: step_args(tables, hidden, kv_cache, meta, lora) for kind, tables in rope_tables.items()}
    residual = None
    for layer in layers:
        hidden, residual = run_layer(layer, steps[layer.layer_type], rope_tables, hidden, residual,
                                     kv_cache, meta)
    return hidden, residual


@dataclass(frozen=True, eq=False)
class Stacked:
    """Every layer of a model bound to one op build with one Shape, gathered
    for the stack op: its weights in layer order (twelve a layer, as Bound holds
    them) and which caches the layers read; they all read the first layer's
    view of the batch (`stack` checks)."""

    op: Callable
    weights: list  # the layers' Bound.weights, one after another
    numbers: tuple
    indices: tuple[int, ...] | None  # each layer's cache index, None when they are 0, 1, 2, ...
    paged: PagedAttention  # the first layer's attention: the batch view every layer reads
    lora_weights: list | None  # weights with each layer's Bound.lora after its twelve (None: no adapters)
    final_norm: torch.Tensor | None  # the model's final norm's weight, run by the op (None: by its module)

    def args(self, kv_cache, lora: bool):
        """The op's unchanging arguments over these caches (kernels.llama_stack_args)."""
        keys, values = kv_cache
        if self.indices is not None:
            keys, values = [keys[i] for i in self.indices], [values[i] for i in self.indices]
        weights, per_layer = (self.lora_weights, 20) if lora else (self.weights, 12)
        return llama_stack_args(self.op, weights, list(keys), list(values), self.final_norm, per_layer)


def stack(layers, norm) -> Stacked | None:
    """The layers as one Stacked, or None: some layer is not bound, the
    layers differ in shape or in the view of the batch they read, or the
    build has no stack op. `norm`, the model's final norm, goes in when it
    is the op's RMSNorm with the layers' eps."""
    bounds = [layer._fused for layer in layers]
    if not bounds or any(b is None or b is UNKNOWN for b in bounds):
        return None
    first = bounds[0]
    if first.shape.gemma:  # Gemma's layers have no stack op
        return None
    windows = {"sliding_window" in b.paged.features for b in bounds}
    if any(b.shape != first.shape or b.op is not first.op for b in bounds) or len(windows) > 1:
        return None
    op = first.paged.kernels.llama_layers_op(*first.shape.widths)
    if op is None:
        return None
    indices = tuple(b.paged.layer_index for b in bounds)
    lora = None if first.lora is None else [t for b in bounds for t in (*b.weights, *b.lora)]
    fused_norm = type(norm) is RMSNorm and norm.eps == first.shape.eps
    return Stacked(op, [w for b in bounds for w in b.weights], first.numbers,
                   None if indices == tuple(range(len(bounds))) else indices, first.paged, lora,
                   norm.weight if fused_norm else None)


def run_stacked(stacked: Stacked, args, step: StepArgs, hidden: torch.Tensor):
    """(the final norm's output, or the last MLP output where the op has no
    final norm; the residual) after every layer, in one op. `args`:
    stacked.args() over the step's caches, with the adapters' stacks when
    the step has adapters."""
    _, _, meta = stacked.paged.layer_view(step.kv_cache, step.meta)
    lora = () if step.lora_ids is None else (step.lora_ids,)
    return stacked.op(hidden, args, step.cos, step.sin, meta.slot_mapping,
                      meta.num_decode_tokens, meta.decode_block_tables, meta.decode_context_lens,
                      meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                      *stacked.numbers, *lora)


class LayerStack:
    """A model's layer loop and its final norm: all its layers (and the norm)
    in one op once each has been bound alike at its first step (`stacked`),
    else run_layers and the norm's module. `whole` False keeps a call per
    layer (the tests compare the two)."""

    def __init__(self, layers, norm) -> None:
        self.layers = layers
        self.norm = norm
        self.stacked = UNKNOWN  # a Stacked, or None, once every layer has had its first step
        self.whole = True
        self.lora = None  # the LoRAContext when the engine serves adapters (engine/model/lora/)
        # The op's arguments over the caches last seen, with and without adapters:
        # {has adapters: (kv_cache, the args)}; the runner passes the same caches every step.
        self._args: dict[bool, tuple] = {}

    def __call__(self, rope_tables, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The final norm's output for every row: the model's last hidden states."""
        layers = self.layers
        step = step_args(rope_tables, hidden, kv_cache, meta, self.lora) if len(layers) else None
        if step is not None and self.whole and all(layer.fuse for layer in layers):
            if self.stacked is UNKNOWN and all(layer._fused is not UNKNOWN for layer in layers):
                self.stacked = stack(layers, self.norm)
            stacked = self.stacked
            lora = step.lora_ids is not None
            if stacked is not UNKNOWN and stacked is not None and (not lora or stacked.lora_weights is not None):
                hidden, residual = run_stacked(stacked, self._stack_args(stacked, kv_cache, lora), step, hidden)
                return hidden if stacked.final_norm is not None else self.norm(hidden, residual)[0]
        hidden, residual = run_layers(layers, step, rope_tables, hidden, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def _stack_args(self, stacked: Stacked, kv_cache, lora: bool):
        held = self._args.get(lora)
        if held is None or held[0] is not kv_cache:
            held = self._args[lora] = (kv_cache, stacked.args(kv_cache, lora))
        return held[1]
