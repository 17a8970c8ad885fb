"""Multi-LoRA shrink + expand on the CPU: the compiled op against the torch reference.

    python scripts/lora_kernel_bench.py [--tokens 1,32,512] [--in-features 576]
        [--out-features 1536] [--rank 48] [--slots 8] [--dtypes bfloat16,float32]
        [--repeats 50] [--threads N] [--expand-only] [--slices 0,576,768,960]

One call pair per measurement: h = lora_shrink(x, A, ids, scale), then
lora_expand(y, h, B, ids), as a LoRA'd linear runs them after its base
product. The ids are what a step would carry: a lone decode row (T=1),
decode rows each with its own adapter slot (ids = t % slots, so every slot
is used and no two neighbours share one), or a prefill chunk of one
sequence (a single run of one id). --expand-only times the expand alone
(h made once). --slices s_0,...,s_n: a fused projection's slices (output
rows [s_i, s_i+1) read h's rank block i), B compact [S, out, rank] and h
n * rank wide; without it B is [S, out, rank] against all of h (the padded
form: pass rank = n * max_rank). Reported: the median of `repeats` calls
after a warm-up, in microseconds, and the reference's time over the
compiled op's. Benchmark-only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu import ops as cpu_ops  # noqa: E402
from kernels.lora import lora_expand_reference, lora_shrink_reference  # noqa: E402


def step_ids(tokens: int, slots: int, prefill_from: int) -> tuple[torch.Tensor, str]:
    """(ids, what they are): decode rows each in its own slot, or one prefill run."""
    if tokens >= prefill_from:
        return torch.zeros(tokens, dtype=torch.int32), "prefill (one run)"
    return torch.arange(tokens, dtype=torch.int32) % slots, "decode (a slot per row)"


def median_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(ops, tokens: int, dtype: torch.dtype, args) -> tuple[str, float, float]:
    """(ids' kind, compiled us, reference us) of one shrink + expand (or expand alone)."""
    g = torch.Generator().manual_seed(tokens)
    slices = [int(s) for s in args.slices.split(",")] if args.slices else None
    width = args.rank * (len(slices) - 1 if slices else 1)  # h's columns, A's rows
    x = torch.randn(tokens, args.in_features, generator=g).to(dtype)
    a = torch.randn(args.slots, width, args.in_features, generator=g).to(dtype)
    b = torch.randn(args.slots, args.out_features, args.rank, generator=g).to(dtype)
    y = torch.randn(tokens, args.out_features, generator=g).to(dtype)
    ids, kind = step_ids(tokens, args.slots, args.prefill_from)
    extra = {"slices": slices} if slices else {}  # today's call when there are none
    h = ops.lora_shrink(x, a, ids, 0.5)

    def compiled():
        ops.lora_expand(y, h if args.expand_only else ops.lora_shrink(x, a, ids, 0.5), b, ids, **extra)

    def reference():
        h_in = h if args.expand_only else lora_shrink_reference(x, a, ids, 0.5)
        lora_expand_reference(y, h_in, b, ids, **extra)

    return kind, median_us(compiled, args.repeats), median_us(reference, args.repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,512", help="rows per call, comma-separated")
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--rank", type=int, default=48, help="padded rank R (per slice with --slices)")
    parser.add_argument("--slots", type=int, default=8, help="adapters in the stack (S)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--prefill-from", type=int, default=128,
                        help="this many rows or more are one prefill run; fewer are decode rows")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--expand-only", action="store_true", help="time lora_expand alone")
    parser.add_argument("--slices", default="", help="output row boundaries s_0,...,s_n (compact B)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = cpu_ops.current_ops()
    if ops is None:
        print("no compiled CPU ops in this process (see the warning); nothing to compare")
        return 1
    print(f"build {ops.isa()}, {torch.get_num_threads()} threads; in {args.in_features}, "
          f"out {args.out_features}, R {args.rank}, S {args.slots}, slices {args.slices or 'none'}; "
          f"{'expand' if args.expand_only else 'shrink + expand'}, median us")
    header = f"{'T':>5}  {'ids':<24} {'dtype':<9} {'compiled':>10} {'reference':>10} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            kind, ours, ref = measure(ops, tokens, dtype, args)
            print(f"{tokens:>5}  {kind:<24} {dtype_name:<9} {ours:>10.1f} {ref:>10.1f} {ref / ours:>8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
