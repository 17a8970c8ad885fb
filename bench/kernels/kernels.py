"""Kernel micro-benchmark: paged attention, store_kvcache and the linear layers.

    pagedserve bench kernels [--output results.json] [--dtype bfloat16] ...

On CUDA it sweeps batch x context with the Triton kernels, timing each with
``triton.testing.do_bench`` (median), and reports:

* achieved GB/s = (K/V bytes read once + query + output) / time, next to the
  device-to-device copy bandwidth measured on the same GPU (the practical
  ceiling for these memory-bound kernels) as a percentage;
* the same workload through ``torch.nn.functional.scaled_dot_product_attention``
  on the same K/V stored contiguously (store_kvcache: against the torch
  reference scatter).

"Same K/V stored contiguously" costs no extra memory: the benchmark lays
each sequence's pages out consecutively, so one buffer is both a paged cache
and a [batch, context, kv_heads, head_dim] tensor::

    k_cache:  [null | s0 p0 | s0 p1 | ... | s1 p0 | s1 p1 | ... ]
    tables:   s0 -> [1, 2, ...], s1 -> [1 + n, 2 + n, ...]
    SDPA:     k_cache[1:].view(batch, context, kv_heads, dim).transpose(1, 2)

Without CUDA it runs a small CPU sweep of the compiled CPU ops (``--backend
cpu``, the default there when they build; ``--backend torch`` for the
reference), against the same SDPA baseline and the machine's copy bandwidth.

``linear`` times one Llama layer's four projections (qkv, o, gate_up, down;
hidden = heads x head_dim, ``--intermediate-size``) per batch of tokens
through the backend's ``linear``, over the weights laid out as the engine
loads them (the backend's ``pack_linear``): with bf16 weights on the CPU that
is the compiled bf16-weight op (over packed weights where the CPU has
AVX512-BF16's dot product), against F.linear over float32 copies of the same
weights (what the CPU would run otherwise). GB/s counts the weights' bytes,
each side its own dtype: at small batches the layer is bound by reading them.

``window`` and ``softcap`` add one decode row each, with a sliding window or
a logits soft cap against the same decode without (bench/kernels/kernel_features.py).

``--floor`` measures instead the weight-read floor of one-stream decode (the
machine's read bandwidth, a model's weight bytes) and the engine's one-stream
ms/token against it (bench/kernels/floor.py).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from bench.common.report import print_table, write_json
from bench.kernels.floor import add_floor_args, run_floor
from bench.kernels.kernel_features import FEATURE_KERNELS, add_feature_args, bench_feature, feature_plan
from bench.kernels.kernel_rows import Row, Shape, make_row, sequential_cache
from bench.kernels.kernel_timing import copy_bandwidth_gbps, make_timer, time_or_none
from kernels import BACKEND_NAMES, get_backend
from kernels.cpu import ops as cpu_ops

GPU_BATCHES = (1, 8, 32, 128, 256)
GPU_CONTEXTS = (128, 1024, 4096, 16384, 32768)
CPU_BATCHES = (1, 16, 64)
CPU_CONTEXTS = (128, 1024)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KERNELS = ("decode", "prefill", "store", "linear") + FEATURE_KERNELS


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------

def contiguous_view(cache: torch.Tensor, batch: int, context: int) -> torch.Tensor:
    """[batch, kv_heads, context, dim] view of a sequential_cache (no copy)."""
    return cache[1:].view(batch, context, cache.shape[2], cache.shape[3]).transpose(1, 2)


def bench_decode(shape: Shape, backend, timer, batch: int, context: int) -> Row:
    k_cache, v_cache, tables = sequential_cache(shape, batch, context)
    lens = torch.full((batch,), context, dtype=torch.int32, device=shape.device)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=shape.device)
    scale = shape.head_dim ** -0.5
    ms = timer(lambda: backend.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale))
    q = query.unsqueeze(2)
    k, v = contiguous_view(k_cache, batch, context), contiguous_view(v_cache, batch, context)
    base_ms = time_or_none(timer, lambda: _sdpa(q, k, v, scale, causal=False))
    nbytes = shape.kv_bytes(batch * context) + 2 * shape.q_bytes(batch)
    extra = _decode_variants(shape, backend, timer, query, k_cache, v_cache, tables, lens, scale)
    return make_row("decode", batch, context, ms, base_ms, "torch sdpa", nbytes, None, extra)


def _decode_variants(shape, backend, timer, query, k_cache, v_cache, tables, lens, scale) -> dict:
    """Triton only: plain vs split-KV timings, to check the split heuristic."""
    if backend.name != "triton":
        return {}
    from kernels import paged_decode as pd

    batch, context = query.shape[0], tables.shape[1] * shape.block_size
    sms = torch.cuda.get_device_properties(shape.device).multi_processor_count
    chosen = pd.choose_decode_partitions(batch, shape.num_kv_heads, context, sms)
    split = max(2, -(-context // pd.DEFAULT_PARTITION_SIZE))
    timings = {"chosen_partitions": chosen}
    for name, parts in (("plain_ms", 1), ("split_ms", split)):
        timings[name] = timer(lambda parts=parts: pd.decode_attention_partitioned(
            query, k_cache, v_cache, tables, lens, scale, parts, pd.DEFAULT_PARTITION_SIZE))
    return timings


def bench_prefill(shape: Shape, backend, timer, batch: int, context: int) -> Row:
    k_cache, v_cache, tables = sequential_cache(shape, batch, context)
    lens = torch.full((batch,), context, dtype=torch.int32, device=shape.device)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=shape.device) * context
    tokens = batch * context
    query = torch.randn(tokens, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=shape.device)
    scale = shape.head_dim ** -0.5
    ms = timer(lambda: backend.paged_prefill_attention(query, k_cache, v_cache, tables, cu, lens, scale))
    q = query.view(batch, context, shape.num_heads, shape.head_dim).transpose(1, 2)
    k, v = contiguous_view(k_cache, batch, context), contiguous_view(v_cache, batch, context)
    base_ms = time_or_none(timer, lambda: _sdpa(q, k, v, scale, causal=True))
    nbytes = shape.kv_bytes(tokens) + 2 * shape.q_bytes(tokens)
    return make_row("prefill", batch, context, ms, base_ms, "torch sdpa", nbytes,
                    prefill_flops(shape, batch, context), {})


def bench_store(shape: Shape, backend, timer, batch: int, context: int) -> Row:
    k_cache, v_cache, _ = sequential_cache(shape, batch, context)
    tokens = batch * context
    key = torch.randn(tokens, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=shape.device)
    value = torch.randn_like(key)
    slots = torch.randperm(tokens, device=shape.device) + shape.block_size  # skip the null block
    ms = timer(lambda: backend.store_kvcache(key, value, k_cache, v_cache, slots))
    torch_store = get_backend("torch").store_kvcache
    base_ms = time_or_none(timer, lambda: torch_store(key, value, k_cache, v_cache, slots))
    nbytes = 2 * shape.kv_bytes(tokens) + slots.numel() * slots.element_size()  # read + write
    return make_row("store", batch, context, ms, base_ms, "torch index_put", nbytes, None, {})


def layer_sizes(shape: Shape, intermediate: int) -> list[tuple[int, int]]:
    """One Llama layer's projections, (out, in): qkv, o, gate_up, down."""
    hidden, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * intermediate, hidden),
            (hidden, intermediate)]


def layer_weights(shape: Shape, intermediate: int) -> list[torch.Tensor]:
    return [torch.randn(o, i, device=shape.device).div_(i ** 0.5).to(shape.dtype)
            for o, i in layer_sizes(shape, intermediate)]


def bench_linear(shape: Shape, backend, timer, batch: int, intermediate: int) -> Row:
    weights = layer_weights(shape, intermediate)
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device=shape.device).to(shape.dtype)
              for w in weights}
    loaded = [(w.shape[1], backend.pack_linear(w)) for w in weights]  # as the engine holds them
    ms = timer(lambda: [backend.linear(inputs[width], w) for width, w in loaded])
    weights32 = [w.float() for w in weights]
    inputs32 = {width: x.float() for width, x in inputs.items()}
    base_ms = time_or_none(timer, lambda: [F.linear(inputs32[w.shape[1]], w) for w in weights32])
    params = sum(w.numel() for w in weights)
    row = make_row("linear", batch, 0, ms, base_ms, "F.linear fp32", params * shape.elem,
                   2.0 * batch * params, {"intermediate_size": intermediate})
    if base_ms is not None:  # the baseline reads float32 weights: its own bytes
        row.baseline_gbps = params * 4 / base_ms / 1e6
    return row


def _sdpa(q, k, v, scale, causal):
    if q.shape[1] != k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)


def prefill_flops(shape: Shape, batch: int, context: int) -> float:
    """Causal attention FLOPs: QK^T and PV, 2 flops per MAC, half the square."""
    pairs = context * (context + 1) / 2
    return 4.0 * batch * pairs * shape.num_heads * shape.head_dim


# ---------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------

def needed_bytes(shape: Shape, kernel: str, batch: int, context: int) -> int:
    tokens = batch * context
    total = shape.kv_bytes(tokens)
    if kernel == "prefill":
        total += 3 * shape.q_bytes(tokens)  # query, output, SDPA output
    if kernel == "store":
        total *= 2  # the new key/value
    if kernel == "linear":  # weights, their float32 copies (context is intermediate_size)
        total = sum(o * i for o, i in layer_sizes(shape, context)) * (shape.elem + 4)
    return total


def skip_reason(shape: Shape, kernel: str, batch: int, context: int, args) -> str | None:
    if kernel != "linear" and context % shape.block_size:
        return f"context not a multiple of block_size {shape.block_size}"
    if kernel == "prefill":
        if batch * context > args.max_prefill_tokens:
            return f"more than --max-prefill-tokens {args.max_prefill_tokens}"
        if prefill_flops(shape, batch, context) > args.max_prefill_tflop * 1e12:
            return f"more than --max-prefill-tflop {args.max_prefill_tflop}"
    if kernel == "store" and batch * context > args.max_store_tokens:
        return f"more than --max-store-tokens {args.max_store_tokens}"
    budget = _memory_budget(shape.device)
    if needed_bytes(shape, kernel, batch, context) > budget:
        return f"needs more than the {budget / 2**30:.1f} GiB memory budget"
    return None


def _memory_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.8 * free) - 2**30
    return 4 * 2**30  # the CPU sweep is a small one


def run_sweep(shape: Shape, backend, timer, kernels, batches, contexts, args):
    bench = {"decode": bench_decode, "prefill": bench_prefill, "store": bench_store,
             "linear": bench_linear}
    # linear has no context: its second number is the layer's intermediate size.
    plan = [(k, b, c) for k in kernels if k in bench for b in batches for c in contexts if k != "linear"]
    plan += [("linear", b, args.intermediate_size) for b in batches if "linear" in kernels]
    plan += feature_plan(kernels, args)
    rows, skipped = [], []
    for kernel, batch, context in tqdm(plan, desc="kernel sweep", unit="case"):
        reason = skip_reason(shape, kernel, batch, context, args)
        if reason is None:
            try:
                if kernel in FEATURE_KERNELS:
                    rows.append(bench_feature(kernel, shape, backend, timer, batch, context, args))
                else:
                    rows.append(bench[kernel](shape, backend, timer, batch, context))
            except torch.cuda.OutOfMemoryError:
                reason = "out of memory"
        if reason is not None:
            skipped.append({"kernel": kernel, "batch": batch, "context": context, "reason": reason})
        if shape.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, skipped


def print_rows(rows: list[Row]) -> None:
    print_table(
        ["kernel", "batch", "context", "ms", "GB/s", "% copy", "TFLOP/s", "baseline", "base ms",
         "base GB/s"],
        [[r.kernel, r.batch, r.context if r.kernel != "linear" else "-", f"{r.ms:.4f}", f"{r.gbps:.1f}",
          _fmt(r.fraction_of_copy, "{:.0%}"), _fmt(r.tflops, "{:.1f}"), r.baseline,
          _fmt(r.baseline_ms, "{:.4f}"), _fmt(r.baseline_gbps, "{:.1f}")] for r in rows])


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help="comma list of " + ",".join(KERNELS))
    parser.add_argument("--batches", type=_int_list, help="comma list (default: by device)")
    parser.add_argument("--contexts", type=_int_list, help="comma list (default: by device)")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--intermediate-size", type=int, default=14336,
                        help="linear: the MLP width (hidden is heads x head_dim)")
    parser.add_argument("--backend", choices=BACKEND_NAMES,
                        help="default: triton on CUDA; cpu elsewhere (torch if it can't build)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--max-prefill-tokens", type=int, default=131072)
    parser.add_argument("--max-prefill-tflop", type=float, default=60.0,
                        help="skip prefill cases above this many TFLOP per call")
    parser.add_argument("--max-store-tokens", type=int, default=1 << 20)
    parser.add_argument("--copy-bytes", type=int, default=1 << 30,
                        help="tensor size for the copy-bandwidth measurement")
    add_feature_args(parser)
    add_floor_args(parser)
    return parser


def _default_backend(cuda: bool, head_dim: int) -> str:
    if cuda:
        return "triton"
    return "cpu" if cpu_ops.ops_for(head_dim) is not None else "torch"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.floor:
        return run_floor(args)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; choose from {KERNELS}")
    dtype = DTYPES[args.dtype]
    shape = Shape(args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, dtype, device)
    backend_name = args.backend or _default_backend(cuda, shape.head_dim)
    from kernels import check_backend_support

    check_backend_support(backend_name, shape.block_size, shape.head_dim, dtype, device)
    backend = get_backend(backend_name)
    timer = make_timer(device)
    copy_bytes = args.copy_bytes if cuda else min(args.copy_bytes, 1 << 26)
    copy_gbps = copy_bandwidth_gbps(device, timer, copy_bytes)
    rows, skipped = run_sweep(shape, backend, timer, kernels,
                              args.batches or (GPU_BATCHES if cuda else CPU_BATCHES),
                              args.contexts or (GPU_CONTEXTS if cuda else CPU_CONTEXTS), args)
    for row in rows:
        row.fraction_of_copy = row.gbps / copy_gbps

    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"\n{device_name}, backend {backend_name}, {dtype}, heads {shape.num_heads}/{shape.num_kv_heads}, "
          f"head_dim {shape.head_dim}, block_size {shape.block_size}; copy bandwidth {copy_gbps:.1f} GB/s")
    print_rows(rows)
    for skip in skipped:
        print(f"skipped {skip['kernel']} batch {skip['batch']} context {skip['context']}: {skip['reason']}")
    if args.output:
        report = {
            "device": device_name, "backend": backend_name, "dtype": str(dtype).replace("torch.", ""),
            "shape": {k: v for k, v in asdict(shape).items() if k not in ("dtype", "device")},
            "copy_bandwidth_gbps": copy_gbps, "gpu": cuda,
            "results": [asdict(row) for row in rows], "skipped": skipped,
        }
        write_json(args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
