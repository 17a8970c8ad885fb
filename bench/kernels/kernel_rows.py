"""What the kernel benchmark measures on and reports: the attention shape, one
result row, and the paged cache laid out in sequence order (bench/kernels/kernels.py
tells why). Shared by the sweep and its feature rows (bench/kernels/kernel_features.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def elem(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of K plus V for ``tokens`` tokens."""
        return 2 * tokens * self.num_kv_heads * self.head_dim * self.elem

    def q_bytes(self, tokens: int) -> int:
        return tokens * self.num_heads * self.head_dim * self.elem


@dataclass
class Row:
    kernel: str
    batch: int
    context: int
    ms: float
    gbps: float
    tflops: float | None
    baseline: str
    baseline_ms: float | None
    baseline_gbps: float | None
    fraction_of_copy: float | None = None
    extra: dict = field(default_factory=dict)


def sequential_cache(shape: Shape, batch: int, context: int):
    """Paged cache whose pages are in sequence order (see bench/kernels/kernels.py)."""
    pages = context // shape.block_size
    size = (1 + batch * pages, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.empty(size, dtype=shape.dtype, device=shape.device).normal_()
    v_cache = torch.empty(size, dtype=shape.dtype, device=shape.device).normal_()
    tables = torch.arange(1, 1 + batch * pages, dtype=torch.int32, device=shape.device).view(batch, pages)
    return k_cache, v_cache, tables


def make_row(kernel, batch, context, ms, base_ms, baseline, nbytes, flops, extra) -> Row:
    """A Row from a timing and its baseline's: GB/s over ``nbytes``, TFLOP/s over ``flops``."""
    return Row(
        kernel=kernel, batch=batch, context=context, ms=ms, gbps=nbytes / ms / 1e6,
        tflops=None if flops is None else flops / ms / 1e9,
        baseline=baseline, baseline_ms=base_ms,
        baseline_gbps=None if base_ms is None else nbytes / base_ms / 1e6,
        extra=extra,
    )
