"""Where a model runs and in which dtype: the device of each tensor-parallel
rank, and `auto`'s choice between bfloat16 and float32 (the serving dtype;
the KV cache's is engine/model/kv_cache.py's)."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from kernels import compiled_bf16_linear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank`: on CUDA, the rank-th GPU from
    the one named (cuda means cuda:0)."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def resolve_dtype(config: EngineConfig, hf_config, device: torch.device) -> torch.dtype:
    """`auto` takes the checkpoint's dtype, except that a float32 (or unnamed)
    checkpoint runs in bfloat16 where bf16 matmuls are fast, as vLLM
    downcasts: a CUDA device that supports bf16, a CPU with AVX512-BF16 or
    AMX, or any CPU where the compiled bf16-weight linear (kernels.linear)
    takes the model's layers. On this project's 2-core AVX2 CPU a SmolLM2
    decode step is 1.8x faster that way than in float32 (one sequence),
    where torch's own bf16 matmul is 4-5x slower than its float32 one.
    Ask for float32 explicitly for bit-exact agreement with HF in float32."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype)
    if dtype in (torch.bfloat16, torch.float16):
        return dtype
    fast = has_fast_bf16(device, config.kernel_backend, _linear_widths(config, hf_config))
    return torch.bfloat16 if fast else torch.float32


def _linear_widths(config: EngineConfig, hf_config) -> list[int]:
    """The in_features of one rank's linear layers: the hidden size, and the
    attention output's and the MLP's inputs, cut by tensor parallelism."""
    tp = config.tensor_parallel_size
    hidden = getattr(hf_config, "hidden_size", 0)
    heads = getattr(hf_config, "num_attention_heads", 0) or 1
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return [hidden, getattr(hf_config, "intermediate_size", 0) // tp, heads * head_dim // tp]


def has_fast_bf16(device: torch.device, kernel_backend: str = "auto",
                  widths: list[int] | tuple[int, ...] = ()) -> bool:
    """bf16 matmuls run at least as fast as float32 ones on `device`. On the
    CPU, `widths` are the in_features of the model's linear layers, which the
    compiled bf16 linear must take (the auto and cpu kernel backends use it)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's cpuinfo (private)
    if any(getattr(torch.cpu, name, lambda: False)() for name in probes):
        return True
    return (kernel_backend in ("auto", "cpu") and len(widths) > 0
            and all(width and compiled_bf16_linear(width) for width in widths))
