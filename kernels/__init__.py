"""Paged KV-cache kernels (store, decode attention, prefill/extend attention),
the linear layers' matmul and the MoE experts' (fused_moe: kernels/moe.py),
and multi-LoRA's per-row adapters (lora_shrink / lora_expand: kernels/lora.py).

Three implementations share one contract (see ``kernels/reference.py``):

* ``torch``  - pure PyTorch reference (any device),
* ``triton`` - Triton GPU kernels (``kernels/store_kvcache_triton.py``,
  ``kernels/paged_decode.py``, ``kernels/paged_prefill.py``, sharing
  ``kernels/paged_attention.py``; GGUF blocks: ``kernels/quant_triton.py``),
* ``cpu``    - compiled C++ ops for the CPU (``kernels/cpu/csrc/``, built on
  first use by ``kernels/cpu/ops.py``): attention reading the paged cache in
  place, the K/V store, the bf16-weight linear, and a layer's element-wise
  ops (RMSNorm, RoPE, SiLU(gate) * up), one pass each.

``auto`` is Triton on CUDA (and a runner's linear takes decode rows through
``kernels/gemv_triton.py`` where it beats cuBLAS). On the CPU its attention is
the compiled op when it builds and takes the head_dim; otherwise
``kernels/cpu_attention.py`` (bf16/fp16: prefill in the cache dtype) or the
reference (float32, HF's arithmetic), after one logged warning. Its
``linear`` multiplies bf16 weights with the compiled op, an encoder's float32
ones with oneDNN's; every other case is the reference (``F.linear``).  The
element-wise ops and the store take the compiled op on the CPU where it
rounds as torch does; on CUDA, bf16 / fp16 element-wise ops are one Triton kernel
each (``kernels/elementwise_triton.py``, rounding where torch's 2 to 9 kernels
do; float32 keeps the reference).  Each function below says when.

The store module is not ``kernels/store_kvcache.py``: Python would bind that
submodule to ``kernels.store_kvcache``, replacing the function below.

The module-level functions are the ``auto`` backend: Triton for CUDA tensors,
the compiled ops or the torch paths otherwise; ``get_backend("torch")`` forces
one.  Triton is imported lazily (first CUDA call or ``get_backend("triton")``)
so the CPU engine works on machines without triton installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Callable

import torch
import torch.nn.functional as F

from kernels.cpu import ops as cpu_ops
from kernels.cpu_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu
from kernels.kv_quant import QUANTIZED_CACHES
from kernels.activation import activate
from kernels.layer_ops import gemma_layer_op, llama_layer_op, llama_layers_op, llama_stack_args
from kernels.lora import lora_expand, lora_expand_reference, lora_shrink, lora_shrink_reference
from kernels.moe import fused_moe, fused_moe_cpu, fused_moe_reference
from kernels.packed_layout import (PACKED_DIMS, embedding, onednn_linear, over_rows, pack_linear,
                                   packed_linear, unpack_linear)
from kernels.quant import dequantize_reference, quant_linear_reference
from kernels.reference import (
    attention_features, gelu_tanh_and_mul_reference, keep_layout, no_layer_op, linear_reference,
    paged_decode_attention_reference, paged_prefill_attention_reference, rms_norm_reference,
    rope_reference, silu_and_mul_reference, store_kvcache_reference,
)

__all__ = [
    "BACKEND_NAMES", "KernelBackend", "check_backend_support", "compiled_bf16_linear", "embedding",
    "fused_moe", "gelu_tanh_and_mul", "gemma_layer_op", "get_backend", "linear", "llama_layer_op",
    "llama_layers_op", "llama_stack_args", "lora_expand", "lora_shrink", "pack_linear", "paged_decode_attention",
    "paged_prefill_attention", "quant_dequantize", "quant_linear", "rms_norm", "rope", "silu_and_mul",
    "store_kvcache", "unpack_linear",
]

BACKEND_NAMES = ("auto", "torch", "triton", "cpu")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TRITON_HEAD_DIMS = (64, 80, 96, 128, 256)
TRITON_MAX_BLOCK_SIZE = 256


@dataclasses.dataclass(frozen=True)
class KernelBackend:
    """The kernel entry points of one implementation."""

    name: str
    store_kvcache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    linear: Callable[..., torch.Tensor] = linear_reference
    rms_norm: Callable[..., torch.Tensor] = rms_norm_reference
    pack_linear: Callable[..., torch.Tensor] = keep_layout
    embedding: Callable[..., torch.Tensor] = F.embedding
    rope: Callable[..., torch.Tensor] = rope_reference
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_reference
    fused_moe: Callable[..., torch.Tensor] = fused_moe_reference
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_and_mul_reference
    # a weight in GGUF blocks (kernels/quant.py): its product, its exact floats
    quant_linear: Callable[..., torch.Tensor] = quant_linear_reference
    quant_dequantize: Callable[..., torch.Tensor] = dequantize_reference
    # widths -> a whole Llama layer in one op, or None (the layer runs op by op)
    llama_layer_op: Callable[..., Callable | None] = no_layer_op
    # widths -> a stack of such layers in one op, or None (a call per layer)
    llama_layers_op: Callable[..., Callable | None] = no_layer_op
    # widths -> a whole Gemma 2 / 3 layer in one op, or None (the modules)
    gemma_layer_op: Callable[..., Callable | None] = no_layer_op
    # multi-LoRA (kernels/lora.py): h = scale * A[ids] @ x per row, then y += B[ids] @ h
    lora_shrink: Callable[..., torch.Tensor] = lora_shrink_reference
    lora_expand: Callable[..., torch.Tensor] = lora_expand_reference


def _triton_modules():
    """Import the Triton kernels on demand (sys.modules caches them)."""
    store = importlib.import_module("kernels.store_kvcache_triton")
    decode = importlib.import_module("kernels.paged_decode")
    prefill = importlib.import_module("kernels.paged_prefill")
    return store, decode, prefill


def _triton_backend() -> KernelBackend:
    store, decode, prefill = _triton_modules()
    moe = importlib.import_module("kernels.fused_moe_triton")
    quant = importlib.import_module("kernels.quant_triton")
    lora = importlib.import_module("kernels.lora_triton")
    return KernelBackend("triton", store.store_kvcache, decode.paged_decode_attention,
                         prefill.paged_prefill_attention, fused_moe=moe.fused_moe,
                         quant_linear=quant.quant_linear, quant_dequantize=quant.quant_dequantize,
                         lora_shrink=lora.lora_shrink, lora_expand=lora.lora_expand)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write K/V of each token into ``slot_mapping`` slots (-1 = skip), in place.
    On the CPU the compiled op copies the rows when nothing needs converting
    (same dtype, int64 slots, rows of packed heads), or quantizes them into
    an int8 or fp8 cache (kernels/kv_quant.py); else the reference."""
    if key.is_cuda:
        _triton_modules()[0].store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        return
    if ((key.dtype == k_cache.dtype or k_cache.dtype in QUANTIZED_CACHES) and key.dtype == value.dtype
            and k_cache.dtype == v_cache.dtype and slot_mapping.dtype == torch.int64
            and _heads_packed(key) and _heads_packed(value)):
        ops = cpu_ops.current_ops()
        if ops is not None:
            ops.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
            return
    store_kvcache_reference(key, value, k_cache, v_cache, slot_mapping)


def _heads_packed(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with heads and head_dim packed (any token stride:
    q, k and v are slices of the fused qkv projection), as the compiled ops take it."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, *,
                           sliding_window=None, logits_soft_cap=None):
    """Decode attention over the paged cache; see kernels.reference for the contract
    (``sliding_window``: only the last W keys; ``logits_soft_cap``: Gemma 2's cap on
    the scores; every implementation takes both)."""
    features = attention_features(sliding_window, logits_soft_cap)  # only those set
    if query.is_cuda:
        return _triton_modules()[1].paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale, **features)
    ops = cpu_ops.ops_for(query.shape[-1])
    if ops is not None:
        return ops.paged_decode_attention(
            query.contiguous(), k_cache, v_cache, block_tables, context_lens, scale, **features)
    quantized = k_cache.dtype in QUANTIZED_CACHES  # the CPU fallback reads the query's dtype
    fallback = paged_decode_attention_reference if quantized else paged_decode_attention_cpu
    return fallback(query, k_cache, v_cache, block_tables, context_lens, scale, **features)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                            *, sliding_window=None, logits_soft_cap=None, causal=True):
    """Prefill/extend attention over the paged cache, causal unless ``causal=False``
    (encoders: every new token sees its whole context); see kernels.reference."""
    features = attention_features(sliding_window, logits_soft_cap, causal)  # causal only if False
    if query.is_cuda:
        return _triton_modules()[2].paged_prefill_attention(
            query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, **features)
    ops = cpu_ops.ops_for(query.shape[-1])
    if ops is not None:
        return ops.paged_prefill_attention(query.contiguous(), k_cache, v_cache, block_tables,
                                           cu_seqlens_q, context_lens, scale, **features)
    if k_cache.dtype in QUANTIZED_CACHES:
        return paged_prefill_attention_reference(query, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                 context_lens, scale, **features)
    return paged_prefill_attention_cpu(
        query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, **features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           float_out: bool = False, activation: str | None = None) -> torch.Tensor:
    """``activation(x @ weight.T + bias)`` (kernels/activation.py).  CPU bf16 weights: the compiled
    op (fp32 sums; float32 out with ``float_out``, the logits, whose bf16 rounding would make
    near-ties ties; GELU, ReLU in its epilogue); oneDNN's layout: oneDNN's (+ post-op); else F.linear."""
    # Called ~120 times per decode step: every check here is on the hot path
    # (a 2-D x skips the reshape and view, ~6 us a call on this machine).
    if weight.dim() == PACKED_DIMS:
        return packed_linear(x, weight, bias, float_out, activation)
    if weight.is_mkldnn:
        return onednn_linear(x, weight, bias, float_out, activation)
    if weight.dtype == torch.bfloat16 and x.is_cpu:
        ops = cpu_ops.ops_for(weight.shape[1])
        if ops is not None:
            return activate(over_rows(ops.linear_bf16, x, weight.shape[1], weight, bias, float_out), activation)
    return linear_reference(x, weight, bias, float_out, activation)


def quant_linear(x: torch.Tensor, blob: torch.Tensor, bias: torch.Tensor | None = None,
                 float_out: bool = False) -> torch.Tensor:
    """``x @ W.T + bias`` with W a quantized blob (kernels/quant.py): on the
    CPU the compiled op (activations quantized per 32 inputs to 8 bits,
    integer products: kernels/cpu/csrc/quant_linear.h), on CUDA Triton's; out
    in x's dtype or float32 with ``float_out``; else the reference (slow)."""
    if x.is_cuda:
        return importlib.import_module("kernels.quant_triton").quant_linear(x, blob, bias, float_out)
    if x.is_cpu and x.dtype in (torch.bfloat16, torch.float32):
        ops = cpu_ops.current_ops()
        if ops is not None:
            flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            out = ops.quant_linear(flat, blob, bias, float_out)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], -1)
    return quant_linear_reference(x, blob, bias, float_out)


def quant_dequantize(blob: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A blob's weights as float32 [N, K], or its `rows` (an embedding lookup), bit for bit
    gguf's (Triton's decoder on CUDA, the compiled one on the CPU, else gguf's)."""
    if blob.is_cuda:
        return importlib.import_module("kernels.quant_triton").quant_dequantize(blob, rows)
    ops = cpu_ops.current_ops()
    return ops.quant_dequantize(blob, rows) if ops is not None else dequantize_reference(blob, rows)


def _on_triton(x: torch.Tensor) -> bool:
    """Whether an element-wise op takes its Triton kernel (kernels/elementwise_triton.py):
    bf16 / fp16 on CUDA.  float32 keeps the reference (bit-exact HF parity)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _rows(x: torch.Tensor) -> bool:  # [rows, width], unit column stride: as Triton's kernels take it
    return x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm, with ``residual += x`` in front when a residual is given (see
    kernels.reference.rms_norm_reference).  bf16 on the CPU runs the compiled
    op, bf16 / fp16 on CUDA the Triton kernel: one call instead of nine torch
    ops; float32 keeps the reference, whose mean sums in torch's order (bit-exact HF parity)."""
    if _on_triton(x) and _rows(x) and weight.dim() == 1 and (residual is None or (
            _rows(residual) and residual.dtype == x.dtype and residual.shape == x.shape)):
        return importlib.import_module("kernels.elementwise_triton").rms_norm(x, weight, eps, residual)
    if x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.is_contiguous():
        ops = cpu_ops.current_ops()  # the op takes any width
        if ops is not None and (residual is None or residual.is_contiguous()):
            return ops.rms_norm(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [tokens, heads, head_dim] by cos / sin [tokens, head_dim]
    (kernels.reference.rope_reference); returns the rotated tensor, which may
    be x itself, rotated in place.  The compiled op on the CPU (float32, bf16)
    and Triton's on CUDA (bf16, fp16) round where torch's five ops do: the reference bit for bit."""
    if (cos.dtype == x.dtype and sin.dtype == x.dtype and _heads_packed(x)
            and cos.is_contiguous() and sin.is_contiguous()):
        if _on_triton(x):
            return importlib.import_module("kernels.elementwise_triton").rope(x, cos, sin)
        ops = cpu_ops.current_ops() if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) else None
        if ops is not None:
            ops.rotary_embedding(x, cos, sin)
            return x
    return rope_reference(x, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over x = [gate | up] (kernels.reference.silu_and_mul_reference).
    bf16 on the CPU runs the compiled op, bf16 / fp16 on CUDA Triton's: one pass
    instead of two ops; float32 keeps the reference (bit-exact HF parity)."""
    if _on_triton(x) and _rows(x) and x.shape[1] % 2 == 0:
        return importlib.import_module("kernels.elementwise_triton").silu_and_mul(x)
    if x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.is_contiguous():
        ops = cpu_ops.current_ops()
        if ops is not None:
            return ops.silu_and_mul(x)
    return silu_and_mul_reference(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gemma's gelu(gate, tanh) * up (kernels.reference.gelu_tanh_and_mul_reference):
    Triton's kernel for bf16 / fp16 on CUDA, else the reference."""
    if _on_triton(x) and _rows(x) and x.shape[1] % 2 == 0:
        return importlib.import_module("kernels.elementwise_triton").gelu_tanh_and_mul(x)
    return gelu_tanh_and_mul_reference(x)


def compiled_bf16_linear(in_features: int) -> bool:
    """Whether ``linear`` multiplies bf16 weights of this width with the compiled op."""
    return cpu_ops.ops_for(in_features) is not None


def _compiled(name: str) -> Callable[..., torch.Tensor]:
    """One op of the ``cpu`` backend: the compiled build, contiguous query."""

    def op(query, *args, **features):
        ops = cpu_ops.ops_for(query.shape[-1])
        if ops is None:  # check_backend_support refuses this config up front
            raise RuntimeError(f"cpu backend: {cpu_ops.unavailable_reason(query.shape[-1])}")
        return getattr(ops, name)(query.contiguous(), *args, **attention_features(**features))

    op.__name__ = name
    return op


def get_backend(name: str, device=None) -> KernelBackend:
    """The named backend (a new frozen object); on a CUDA ``device`` auto's and triton's
    linear take decode rows through the GEMV where it measures faster (one tuner each)."""
    if name in ("auto", "triton") and device is not None and torch.device(device).type == "cuda":
        gemv = importlib.import_module("kernels.gemv_triton").DecodeGemv()
        return dataclasses.replace(get_backend(name), linear=gemv.linear)
    if name == "auto":
        return KernelBackend("auto", store_kvcache, paged_decode_attention, paged_prefill_attention,
                             linear, rms_norm, pack_linear, embedding, rope, silu_and_mul, fused_moe=fused_moe,
                             quant_linear=quant_linear, quant_dequantize=quant_dequantize,
                             llama_layer_op=llama_layer_op, llama_layers_op=llama_layers_op,
                             gemma_layer_op=gemma_layer_op, lora_shrink=lora_shrink, lora_expand=lora_expand,
                             gelu_tanh_and_mul=gelu_tanh_and_mul)
    if name == "torch":
        return KernelBackend("torch", store_kvcache_reference, paged_decode_attention_reference,
                             paged_prefill_attention_reference)
    if name == "triton":
        return _triton_backend()
    if name == "cpu":
        return KernelBackend("cpu", store_kvcache, _compiled("paged_decode_attention"),
                             _compiled("paged_prefill_attention"), linear, rms_norm, pack_linear, embedding,
                             rope, silu_and_mul, fused_moe=fused_moe_cpu,
                             quant_linear=quant_linear, quant_dequantize=quant_dequantize,
                             llama_layer_op=llama_layer_op, llama_layers_op=llama_layers_op,
                             gemma_layer_op=gemma_layer_op, lora_shrink=lora_shrink, lora_expand=lora_expand)
    raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKEND_NAMES}")


def check_backend_support(backend_name: str, block_size: int, head_dim: int,
                          dtype: torch.dtype, device) -> None:
    """Raise ValueError (naming what is supported) if the backend can't run this config.

    Rules:
      * every backend: dtype in float32/float16/bfloat16, block_size >= 1,
        head_dim >= 1;
      * triton: block_size a power of two in [1, 256]; head_dim in
        {64, 80, 96, 128, 256}; a CUDA device (or CPU under TRITON_INTERPRET=1);
        triton importable;
      * cpu: a CPU device, and the compiled ops built for this CPU with a
        head_dim that is a multiple of the build's vector pair;
      * auto: the triton rules on CUDA, the torch rules elsewhere.

    On the CPU this is also where the compiled ops are built or loaded (once
    per process), so the first request does not wait for the compiler.
    """
    if backend_name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {backend_name!r}; expected one of {BACKEND_NAMES}")
    device = torch.device(device)
    resolved = backend_name
    if backend_name == "auto":
        resolved = "triton" if device.type == "cuda" else "torch"
    _check_common(block_size, head_dim, dtype)
    if resolved == "triton":
        _check_triton(block_size, head_dim, device)
    elif device.type == "cpu":
        ops = cpu_ops.ops_for(head_dim)  # builds now; auto falls back if None
        if backend_name == "cpu" and ops is None:
            raise ValueError(f"cpu backend: {cpu_ops.unavailable_reason(head_dim)}")
    elif backend_name == "cpu":
        raise ValueError(f"cpu backend needs a CPU device, got {device}")


def _check_common(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: float32, float16, bfloat16")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")


def _check_triton(block_size: int, head_dim: int, device: torch.device) -> None:
    power_of_two = block_size & (block_size - 1) == 0
    if not power_of_two or block_size > TRITON_MAX_BLOCK_SIZE:
        raise ValueError(
            f"triton backend: block_size must be a power of two in [1, {TRITON_MAX_BLOCK_SIZE}], "
            f"got {block_size}")
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"triton backend: head_dim must be one of {TRITON_HEAD_DIMS}, got {head_dim}")
    # Read at call time on purpose: the interpreter is a per-process choice.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"triton backend needs a CUDA device (or TRITON_INTERPRET=1 on CPU), got {device}")
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        raise ValueError(
            "triton backend needs the 'triton' package (pip install 'pagedserve[triton]')"
        ) from exc
