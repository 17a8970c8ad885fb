"""The quantized linear (kernels/cpu/csrc/quant_linear.h) on real model shapes:
µs a call, GB/s of weight bytes at one token against what `torch.sum` reads
over the same bytes, and, at many tokens, the packed bf16 linear of the same
shape beside it.

    PAGEDSERVE_CPU_KERNELS=avx2 python -m bench.kernels.quant_linear [--rows 1,4,32,128]
        [--layout file|engine|both]

``--layout engine`` times the blob as the engine serves it (kernels.pack_linear:
16-row panels of the K-quants and legacy 4- and 5-bit types on the AVX512-VNNI build),
``both`` the two side by side, shape by shape, then alternated in pairs
(file / engine, the median and range of 8 pairs' ratios: the machine's
drift between the two rows cancels in a pair).

Cache-cold-ish: every timing cycles through enough copies of the weight to
pass 64 MB (more than this machine's L2 and L3 together), because a decode
step reads each weight once and from memory, never from cache.
"""

from __future__ import annotations

import argparse
import time

import torch

import kernels
from kernels.cpu import ops as cpu_ops
from kernels.quant import pack_quant_weight, random_quant_blocks

# (label, type, in_features K, out_features N)
SHAPES = (
    ("SmolLM2 gate_up", "Q4_1", 576, 1536),
    ("SmolLM2 down", "Q4_1", 1536, 576),
    ("SmolLM2 LM head", "Q8_0", 576, 49152),
    ("Qwen3-0.6B gate_up", "Q5_K", 1024, 6144),
    ("Llama-1B up", "Q4_0", 2048, 8192),
    ("Llama-1B up", "Q4_K", 2048, 8192),
    ("Llama-1B up", "Q8_0", 2048, 8192),
    ("Llama-1B down", "Q6_K", 8192, 2048),
    ("Llama-1B LM head", "Q6_K", 2048, 128256),
)
COLD_BYTES = 64 << 20


def _copies(make, nbytes: int) -> list:
    """Enough independent tensors from make() to pass COLD_BYTES together."""
    return [make() for _ in range(max(2, -(-COLD_BYTES // nbytes)))]


def _micros(fn, copies: list, seconds: float = 0.4) -> float:
    """The best pass's µs a fn(copy) call, cycling through the copies (the best,
    not the median: this box is shared, and others' work only ever adds time)."""
    for c in copies:
        fn(c)  # warm-up: page faults, thread pool
    samples, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        start = time.perf_counter()
        for c in copies:
            fn(c)
        samples.append((time.perf_counter() - start) / len(copies) * 1e6)
    return min(samples)


def sum_read_gbps(nbytes: int) -> float:
    """The read rate of torch.sum over `nbytes` (as float32), cache-cold-ish."""
    copies = _copies(lambda: torch.rand(nbytes // 4), nbytes)
    return nbytes / _micros(torch.sum, copies) / 1e3


LAYOUTS = {"file": lambda blob: blob, "engine": kernels.pack_linear}


def bench_shape(ops, label, type_name, K, N, rows, generator, layouts=("file",)) -> list[str]:
    lines, copies = [], {}
    for layout in layouts:
        make = lambda: LAYOUTS[layout](  # noqa: E731
            pack_quant_weight([(type_name, random_quant_blocks(type_name, N, K, generator))], K))
        blobs = copies[layout] = _copies(make, make().numel())
        for m in rows:
            lines.append(_row(ops, f"{label} {type_name} {K}->{N}" + (f" ({layout})" if len(layouts) > 1 else ""),
                              blobs, K, N, m))
    if len(layouts) == 2:
        for m in rows:
            lines.append(_pairs(ops, f"{label} {type_name} {K}->{N} ({layouts[0]} / {layouts[1]}, 8 pairs)",
                                [copies[layout] for layout in layouts], K, m))
    return lines


def _pairs(ops, label, blob_sets, K, m, pairs: int = 8) -> str:
    """The two layouts timed in turn, `pairs` times: the median and range of
    first / second (above 1: the second is faster)."""
    x = torch.randn(m, K).bfloat16() * 0.1
    ratios = []
    for _ in range(pairs):
        first, second = (_micros(lambda b: ops.quant_linear(x, b, None, False), blobs, seconds=0.1)
                         for blobs in blob_sets)
        ratios.append(first / second)
    ratios.sort()
    median = (ratios[pairs // 2 - 1] + ratios[pairs // 2]) / 2
    return f"| {label} | {m} | {median:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | | |"


def _row(ops, label, blobs, K, N, m) -> str:
    nbytes = blobs[0].numel()
    x = torch.randn(m, K).bfloat16() * 0.1
    quant_us = _micros(lambda b: ops.quant_linear(x, b, None, False), blobs)
    line = f"| {label} | {m} | {quant_us:,.1f} |"
    if m == 1:
        read = sum_read_gbps(nbytes)
        got = nbytes / quant_us / 1e3
        line += f" {got:.1f} GB/s ({100 * got / read:.0f} % of torch.sum's {read:.1f}) |"
    else:
        line += " |"
    if m >= 32:
        dense = _copies(lambda: kernels.pack_linear((torch.randn(N, K) * 0.02).bfloat16()), 2 * N * K)
        bf16_us = _micros(lambda w: kernels.linear(x, w), dense)
        faster = "quant" if quant_us < bf16_us else "bf16"
        line += f" {bf16_us:,.1f} ({faster} faster) |"
    else:
        line += " |"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,32,128")
    parser.add_argument("--only", default="", help="a substring of the shape labels to keep")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--layout", choices=("file", "engine", "both"), default="file",
                        help="the file's blocks, the engine's layout (kernels.pack_linear), or both")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    ops = cpu_ops.current_ops()
    isa = cpu_ops.requested_isa()
    print(f"ISA {isa}, {torch.get_num_threads()} threads")
    print("| shape | M | quant µs | GB/s of weights (M=1) | bf16 linear µs |")
    print("|---|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for label, type_name, K, N in SHAPES:
        if args.only in f"{label} {type_name}":
            layouts = ("file", "engine") if args.layout == "both" else (args.layout,)
            for line in bench_shape(ops, label, type_name, K, N, rows, generator, layouts):
                print(line, flush=True)


if __name__ == "__main__":
    main()
