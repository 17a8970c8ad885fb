"""A decode step over long contexts, one KV-cache dtype against another, side by side.

    python scripts/make_shape_folder.py llama-3.2-1b shapes/llama-1b
    python scripts/kv_decode_bench.py shapes/llama-1b [--seqs 16] [--context 4096]
                                      [--dtypes auto,int8] [--rounds 6] [--threads 2]
                                      [--quantization q8_0|q4_k|...]
    python scripts/kv_decode_bench.py shapes/llama-3.2-1b-Q4_K_M.gguf ...   (its own weights)

Each dtype gets its own engine on the same random weights (--load-format
dummy, same seed) and a cache holding `seqs` sequences of `context` tokens
of random K/V, written as each dtype stores it.  A round times one decode
step of every engine in turn (alternated, so drift on a shared machine hits
both alike): the model's forward over `seqs` decode rows, each attending
its whole context, then the logits.  Filling the caches directly skips the
prefill, which at these sizes would take far longer than the steps it
sets up; scheduling and sampling are left out (they do not depend on the
cache's dtype).  Reported: the median step per dtype, the ratios against
the first, and each engine's KV bytes.  Benchmark-only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def fill_cache(cache: torch.Tensor, gen: torch.Generator) -> None:
    """Random K/V rows in every block, written as this cache's dtype stores them."""
    from kernels.kv_quant import cache_head_dim, is_quantized, quantize_rows

    head_dim = cache_head_dim(cache)
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    for start in range(0, flat.shape[0], 1 << 14):
        rows = flat[start:start + (1 << 14)]
        values = torch.randn(*rows.shape[:-1], head_dim, generator=gen)
        rows.copy_(quantize_rows(values) if is_quantized(cache) else values.to(cache.dtype))


def decode_inputs(seqs: int, context: int, block_size: int, device) -> tuple:
    """(input_ids, positions, meta) of one step: every sequence decodes its token
    `context` after `context` cached ones, sequence i in its own blocks."""
    from engine.model.attention_metadata import AttentionMetadata

    per_seq = context // block_size + 1
    tables = (1 + torch.arange(seqs * per_seq, dtype=torch.int32)).view(seqs, per_seq)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    empty = torch.zeros(0, per_seq, dtype=torch.int32)
    meta = AttentionMetadata(slots.to(device), seqs, tables.to(device),
                             torch.full((seqs,), context + 1, dtype=torch.int32, device=device),
                             empty.to(device), torch.zeros(1, dtype=torch.int32, device=device),
                             torch.zeros(0, dtype=torch.int32, device=device))
    ids = torch.randint(100, 30000, (seqs,), device=device)
    return ids, torch.full((seqs,), context, dtype=torch.long, device=device), meta


def make_engine(folder: str, dtype: str, args):
    from engine import LLM

    blocks = args.seqs * (args.context // 16 + 1) + 2
    # A .gguf file brings its own (random, quantized) weights; a folder gets
    # random float ones, quantized at load with --quantization.
    weights = {} if folder.endswith(".gguf") else {"load_format": "dummy"}
    llm = LLM(folder, **weights, quantization=args.quantization, seed=0, kv_cache_dtype=dtype,
              block_size=16, num_gpu_blocks_override=blocks, max_model_len=args.context + 16,
              max_num_seqs=args.seqs, enable_prefix_caching=False, num_threads=args.threads)
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(1)
    fill_cache(runner.kv_cache, gen)
    return llm, runner


@torch.inference_mode()
def step_seconds(runner, inputs) -> float:
    ids, positions, meta = inputs
    runner.use_configured_threads()
    started = time.perf_counter()
    hidden = runner.model(ids, positions, runner.layer_caches, meta)
    runner.model.compute_logits(hidden)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a config-only model folder (scripts/make_shape_folder.py), "
                                       "or a GGUF file (scripts/make_gguf_shape.py)")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--dtypes", default="auto,int8", help="KV-cache dtypes, the first is the baseline")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default=None,
                        help="the weights' format (engine's --quantization): a folder's float weights "
                             "quantized at load (q8_0, q4_k, ...); a GGUF file's default is its own")
    args = parser.parse_args()

    dtypes = args.dtypes.split(",")
    engines = {d: make_engine(args.folder, d, args) for d in dtypes}
    inputs = decode_inputs(args.seqs, args.context, 16, next(iter(engines.values()))[1].device)
    times: dict[str, list[float]] = {d: [] for d in dtypes}
    for d in dtypes:  # warm-up: first-call costs out of the numbers
        step_seconds(engines[d][1], inputs)
    for _ in range(args.rounds):
        for d in dtypes:
            times[d].append(step_seconds(engines[d][1], inputs))
    base = statistics.median(times[dtypes[0]])
    for d in dtypes:
        median = statistics.median(times[d])
        kv_bytes = engines[d][1].memory()["kv_cache_bytes"]
        print(f"kv_cache_dtype={d:9s} step {median * 1e3:8.1f} ms  (x{base / median:.2f} vs {dtypes[0]})  "
              f"KV {kv_bytes / 2**20:,.0f} MiB  rounds {[round(t * 1e3) for t in times[d]]}")


if __name__ == "__main__":
    main()
