"""The KV cache's dtype (--kv-cache-dtype) and the shape and bytes of its tensors.

    auto, bfloat16, float32:  [2, layers, blocks, block_size, kv_heads, head_dim]
                              in the serving dtype (the attention kernels read a
                              float cache in the query's dtype)
    int8:                     [2, layers, blocks, block_size, kv_heads, head_dim + 2]
                              int8: each (token, kv head) row is its codes and its
                              fp16 scale (kernels/kv_quant.py holds that layout)
    fp8, fp8_e4m3, fp8_e5m2:  [2, layers, blocks, block_size, kv_heads, head_dim]
                              in torch.float8_e4m3fn / float8_e5m2

Whatever allocates a cache or sizes one against a memory budget goes through a
KVLayout, and the block bytes the offload tiers move are read from the cache
tensors themselves: nothing assumes the cache is in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import KV_CACHE_DTYPES, EngineConfig
from kernels.kv_quant import QUANTIZED_CACHES, is_fp8, row_width

_NAMED = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8,
          "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for config.kv_cache_dtype on a model served in `dtype`;
    ValueError, naming the valid choices, for one the kernels cannot read. Every
    backend reads int8 and fp8 caches beside a query of any float dtype."""
    name = config.kv_cache_dtype
    if name == "auto":
        return dtype
    cache = _NAMED[name]
    if cache not in QUANTIZED_CACHES and cache != dtype:
        raise ValueError(f"kv_cache_dtype={name!r} differs from the serving dtype "
                         f"{dtype_name(dtype)}: a float cache is read in the query's dtype, "
                         f"so choose 'auto', 'int8', an fp8 or the serving dtype (valid choices: "
                         f"{KV_CACHE_DTYPES})")
    return cache


def check_cache_on_device(cache: torch.dtype, capability: tuple[int, int] | None) -> None:
    """ValueError for a cache the device's kernels cannot store: Triton has e4m3
    (fp8, fp8_e4m3) only from sm_89 (Ada, Hopper); `capability` is the CUDA
    device's, None on the CPU (whose kernels take every cache dtype)."""
    if capability is not None and cache == torch.float8_e4m3fn and tuple(capability) < (8, 9):
        raise ValueError(f"kv_cache_dtype fp8 / fp8_e4m3 needs a GPU of compute capability 8.9 or "
                         f"later (this one is {capability[0]}.{capability[1]}): choose fp8_e5m2, "
                         f"int8 or auto (valid choices: {KV_CACHE_DTYPES})")


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the CLI, the logs, /metrics and the offload namespace name it ("int8")."""
    return str(dtype).removeprefix("torch.")


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache as the block copies index it: an fp8 cache viewed as its bytes
    (torch has no index_copy_ / index_select of fp8), any other as it is."""
    return cache.view(torch.uint8) if is_fp8(cache) else cache


def token_capacity(num_blocks: int, block_size: int) -> int:
    """Tokens a pool of `num_blocks` blocks holds: every block but the null block 0."""
    return max(num_blocks - 1, 0) * block_size


@dataclass(frozen=True)
class KVLayout:
    """One rank's cache: its dtype, and the shape of a block of one layer."""

    dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def row_width(self) -> int:
        """Elements of one (token, kv head) row: head_dim, and an int8 row's scale."""
        return row_width(self.head_dim) if self.dtype == torch.int8 else self.head_dim

    def shape(self, num_layers: int, num_blocks: int) -> tuple[int, ...]:
        return (2, num_layers, num_blocks, self.block_size, self.num_kv_heads, self.row_width)

    def layer_block_bytes(self) -> int:
        """One block's K and V of one layer: the unit the memory budget is cut into."""
        elements = 2 * self.block_size * self.num_kv_heads * self.row_width
        return elements * torch.empty((), dtype=self.dtype).element_size()

    def zeros(self, num_layers: int, num_blocks: int, device) -> torch.Tensor:
        """A zeroed cache of these layers and blocks (a small scratch one for profiling)."""
        return torch.zeros(self.shape(num_layers, num_blocks), dtype=self.dtype, device=device)
