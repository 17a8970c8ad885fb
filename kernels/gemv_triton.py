r"""Triton GEMV for decode rows: ``out[M, N] = x[M, K] @ W[N, K].T (+ bias)``
for M <= 8 rows and a bf16 / fp16 W, chosen per shape by measurement
against cuBLAS (``DecodeGemv``).

Why: a decode step at one stream does two flops per weight byte, so its
time is the weights' bytes over the bandwidth the product reaches. cuBLAS's
GEMM for M = 1 reached ~72 % of the copy rate on an H100 (a Llama-3.1-8B
step's linear layers: 6.91 ms against 5.0 ms of bytes; docs/performance.md,
"CUDA graphs"). This kernel streams W's rows once, coalesced along K, with
as many programs in flight as the shape needs to fill the device.

One program = BLOCK_N outputs (rows of W) over one of SPLIT_K slices of K::

    for each BLOCK_K tile of its slice:
        w[BLOCK_N, BLOCK_K] = W[rows, k]                       (bf16 / fp16 loads)
        M = 1:   acc[BLOCK_N, BLOCK_K] += w * x[k]             (fp32, summed once at the end)
        M > 1:   acc[16, BLOCK_N] += x[rows 0..15, k] @ w.T    (tl.dot, fp32; rows >= M are 0)
    SPLIT_K = 1:  out[:, rows] = acc (+ bias)                   in out's dtype
    SPLIT_K > 1:  partial[slice, :, rows] = acc; a second launch sums the slices
                  in slice order (+ bias) into out                (deterministic: no atomics)

Split-K is for shapes with few output rows (N / BLOCK_N programs would leave
SMs idle); the wide ones fill the device with BLOCK_N alone.

The product is fp32 throughout, as cuBLAS's for bf16; ``float_out`` writes
the fp32 sums (the logits), never rounded to W's dtype. Nothing here syncs
with the host, so a CUDA graph can hold it; the choice is made before any
capture (``DecodeGemv``: the graphs' warm-up runs each size eagerly first).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from kernels.activation import activate
from kernels.reference import linear_reference

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # decode rows this kernel takes; more rows are a GEMM (cuBLAS)
DOT_ROWS = 16  # tl.dot's smallest M: rows 2..8 are padded to it
DTYPES = (torch.bfloat16, torch.float16)
TIMING_MS = 20  # per candidate when a shape is first seen


@dataclass(frozen=True)
class GemvConfig:
    """One tiling of the kernel."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Candidates measured for each shape: one row (element-wise products), several (tl.dot).
ONE_ROW = (GemvConfig(8, 512), GemvConfig(16, 256), GemvConfig(16, 512, num_warps=8),
           GemvConfig(32, 256, num_warps=8), GemvConfig(64, 128, num_stages=4),
           GemvConfig(16, 256, split_k=4))
FEW_ROWS = (GemvConfig(16, 256), GemvConfig(32, 128), GemvConfig(32, 256),
            GemvConfig(64, 128), GemvConfig(16, 256, split_k=4), GemvConfig(32, 128, split_k=4))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                 stride_om, stride_split, ONE_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_M: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = rows_n < N
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn
    out_rows = out_ptr + split * stride_split + rows_n
    if ONE_ROW:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            k = k0 + offs_k
            in_k = k < k_stop
            w = tl.load(w_rows + k[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=in_k, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        result = tl.sum(acc, axis=1)
        if HAS_BIAS and not PARTIAL:
            result += tl.load(bias_ptr + rows_n, mask=in_n, other=0.0).to(tl.float32)
        tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=in_n)
    else:
        rows_m = tl.arange(0, DOT_M)
        in_m = rows_m < M
        acc = tl.zeros((DOT_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            k = k0 + offs_k
            in_k = k < k_stop
            w = tl.load(w_rows + k[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
            x = tl.load(x_ptr + rows_m[:, None] * stride_xm + k[None, :],
                        mask=in_m[:, None] & in_k[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        if HAS_BIAS and not PARTIAL:
            acc += tl.load(bias_ptr + rows_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_rows[None, :] + rows_m[:, None] * stride_om, acc.to(out_ptr.dtype.element_ty),
                 mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _split_sum_kernel(partial_ptr, bias_ptr, out_ptr, N, stride_split, stride_pm, stride_om,
                      SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum over slices of partial[slice, m, n] (+ bias[n]), slices in order."""
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + split * stride_split + m * stride_pm + cols, mask=inside, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=inside)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, float_out: bool,
         config: GemvConfig) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) with one tiling; M <= MAX_ROWS, x in W's dtype."""
    rows, width = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=torch.float32 if float_out else x.dtype, device=x.device)
    split = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(width, split), config.block_k) * config.block_k
    split = triton.cdiv(width, k_per_split)  # slices that hold any K
    target = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    _gemv_kernel[(triton.cdiv(n, config.block_n), split)](
        x, weight, bias if has_bias else weight, target, rows, n, width, k_per_split,
        x.stride(0), weight.stride(0), target.stride(-2), target.stride(0) if split > 1 else 0,
        ONE_ROW=rows == 1, HAS_BIAS=has_bias, PARTIAL=split > 1, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, DOT_M=DOT_ROWS, num_warps=config.num_warps,
        num_stages=config.num_stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(n, block), rows)](
            target, bias if has_bias else target, out, n, target.stride(0), target.stride(1),
            out.stride(0), SPLIT_K=split, HAS_BIAS=has_bias, BLOCK=block, num_warps=4)
    return out


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product is a decode GEMV this kernel serves: 2-D x of at most
    MAX_ROWS rows in W's dtype (bf16 / fp16), W [N, K] with K contiguous."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and weight.dtype in DTYPES and x.dtype == weight.dtype and weight.stride(1) == 1
            and x.shape[1] == weight.shape[1])


def rows_bucket(rows: int) -> int:
    """The row counts that share a choice: 1, 2, 4, 8 (CUDA graphs' smallest sizes)."""
    return 1 if rows == 1 else 1 << (rows - 1).bit_length()


class DecodeGemv:
    """The faster of this kernel's candidates and cuBLAS, per shape, timed the
    first time the shape is seen (outside a CUDA graph capture: a shape first
    seen while capturing takes cuBLAS, logged). One per kernel backend, so a
    runner's eager steps and its graphs make the same choice."""

    def __init__(self) -> None:
        self.choices: dict[tuple, GemvConfig | None] = {}  # None: cuBLAS

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               float_out: bool = False, activation: str | None = None) -> torch.Tensor:
        """kernels.linear on CUDA: decode rows by the chosen product, the rest cuBLAS's."""
        if takes(x, weight):
            return activate(self(x, weight, bias, float_out), activation)
        return linear_reference(x, weight, bias, float_out, activation)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 float_out: bool) -> torch.Tensor:
        key = (rows_bucket(x.shape[0]), weight.shape[0], weight.shape[1], weight.dtype,
               bias is not None, float_out)
        if key not in self.choices:
            if torch.cuda.is_current_stream_capturing():
                logger.warning("decode GEMV %s first seen inside a graph capture: cuBLAS", key)
                return _cublas(x, weight, bias, float_out)
            self.choices[key] = self._measure(x, weight, bias, float_out)
        config = self.choices[key]
        return _cublas(x, weight, bias, float_out) if config is None else gemv(x, weight, bias, float_out, config)

    def _measure(self, x, weight, bias, float_out) -> GemvConfig | None:
        """Time every candidate and cuBLAS on this call's tensors at the bucket's rows."""
        rows = rows_bucket(x.shape[0])
        probe = x[:1].expand(rows, -1).contiguous() if rows != x.shape[0] else x
        candidates: list[GemvConfig | None] = [None, *(ONE_ROW if rows == 1 else FEW_ROWS)]
        times = {}
        for config in candidates:
            run = (lambda: _cublas(probe, weight, bias, float_out)) if config is None else (
                lambda config=config: gemv(probe, weight, bias, float_out, config))
            times[config] = _time(run)
        best = min(times, key=times.get)
        logger.info("decode GEMV rows<=%d N=%d K=%d: %s (%.1f us; cuBLAS %.1f us)", rows,
                    weight.shape[0], weight.shape[1], best or "cuBLAS", times[best] * 1e6,
                    times[None] * 1e6)
        return best


def _cublas(x, weight, bias, float_out) -> torch.Tensor:
    return linear_reference(x, weight, bias, float_out)


def _time(run) -> float:
    """Median seconds of one call: triton's do_bench, which flushes the L2 cache
    before each call (a 32 MiB weight would otherwise be read from L2, as a
    decode step's never is), over about TIMING_MS of calls."""
    run()  # compiles a new tiling
    return float(do_bench(run, warmup=TIMING_MS // 4, rep=TIMING_MS, return_mode="median")) / 1e3
