"""Offline throughput: this engine vs HF `generate`, same workloads, same process.

    pagedserve bench throughput [--workload chat|prefill-heavy|both] [--dtype bfloat16]
        [--chat-num-prompts 256] [--prefill-num-prompts 64] [--hf-batch-sizes 16,64]
        [--hf-sort both] [--output results.json]

Workloads (random-token prompts, fixed seeds, greedy, ignore_eos so every
request produces exactly the tokens it asked for):

    chat            256 requests, prompts 16-256 tokens, outputs 16-512 tokens
    prefill-heavy    64 requests, prompts 64-1024 tokens, outputs 64 tokens

Per workload, in this order and in this process, on the same dtype and threads:

  * pagedserve: a fresh engine; the bench drives `engine.step()` itself, so it
    can sample the KV cache between steps (that sampling is not timed).
  * HF `generate` in each configuration of --hf-batch-sizes x --hf-sort
    (in --hf-dtype: HF's fastest dtype is not always ours; on a CPU without
    AVX512-BF16 torch's bf16 matmul is several times slower than its float32 one)
    (requests length-sorted by (output, prompt) length or in arrival order),
    a fresh model each, left padding, each batch generating until its longest
    request is done (only the requested tokens count). The fastest is "best HF".

Reported per system: seconds, output/total tokens per second, requests per
second, peak memory above the level before the system was loaded (CPU: process
RSS sampled every 20 ms, after gc + malloc_trim; CUDA: max_memory_allocated) —
pagedserve's includes its whole KV cache reservation (--kv-cache-memory-bytes),
HF's the KV cache its batches grow — and the fraction of the compute floor it
reaches (floor_seconds / seconds).

Compute floor: the workload's FLOPs (bench/common/measure.py)

    per request, L = prompt + output - 1 tokens fed:
      2 * layer_linear_params * L  +  2 * hidden * vocab * output
      + 4 * layers * heads * head_dim * L (L + 1) / 2      (QK^T and PV, causal)

divided by the best matmul rate (F.linear or kernels.linear, whichever is
faster) measured at the start of this run on the
model's own linear shapes, same dtype and device.

KV utilisation (pagedserve run, sampled after every step, weighted by the
step's duration): tokens whose K/V are held by running sequences over the
slots of the blocks in their block tables, against what a contiguous
max_model_len reservation per running sequence would give for the same batch.
From the mean tokens per running sequence follows how many sequences each
scheme fits in this engine's KV memory.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import torch

from bench.common.measure import FLOP_FORMULA, machine_info, matmul_rate, workload_flops
from bench.common.report import print_table, write_json
from bench.common.workload import Workload, parse_ints, parse_range, random_workload
from bench.offline.driver import ModelUnderTest, model_under_test
from bench.offline.systems import run_hf, run_pagedserve
from engine.args import add_engine_args, config_from_args

WORKLOADS = {
    # name: (num_prompts, prompt LOW:HIGH, output LOW:HIGH, seed)
    "chat": (256, (16, 256), (16, 512), 0),
    "prefill-heavy": (64, (64, 1024), (64, 64), 1),
}
HF_SORTS = {"both": [True, False], "sorted": [True], "unsorted": [False]}


def make_workloads(args, model: ModelUnderTest) -> list[Workload]:
    names = ["chat", "prefill-heavy"] if args.workload == "both" else [args.workload]
    workloads = []
    for name in names:
        if name == "chat":
            count, inputs, outputs = args.chat_num_prompts, args.chat_input_len, args.chat_output_len
        else:
            count, inputs, outputs = (args.prefill_num_prompts, args.prefill_input_len,
                                      args.prefill_output_len)
        limit = model.config.max_model_len
        if inputs[1] + outputs[1] > limit:
            raise ValueError(f"{name}: prompts up to {inputs[1]} + outputs up to {outputs[1]} "
                             f"tokens exceed max_model_len={limit}")
        seed = WORKLOADS[name][3] + args.workload_seed
        workloads.append(random_workload(name, args.num_prompts or count, inputs, outputs,
                                         model.vocab_size, seed))
    return workloads


def workload_settings(workload: Workload) -> dict:
    return {
        "name": workload.name,
        "num_prompts": workload.num_requests,
        **workload.params,
        "ignore_eos": True,
        "greedy": True,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "max_prompt_plus_output": workload.max_total_len,
    }


# -- one workload: pagedserve, then HF in each configuration -----------------------------
def run_workload(args, model: ModelUnderTest, workload: Workload, gflops: float) -> dict:
    flops = workload_flops(model.hf_config, [len(p) for p in workload.prompts],
                           workload.output_lens)
    floor = flops["total"] / (gflops * 1e9)
    ours = run_pagedserve(model.config, workload, model.device)
    hf_runs = [] if args.skip_hf else [
        run_hf(model.path, hf_dtype(args, model), model.device, workload, b, s)
        for b in args.hf_batch_sizes for s in HF_SORTS[args.hf_sort]]
    for r in [ours, *hf_runs]:
        r.fraction_of_floor = floor / r.seconds
    best = max(range(len(hf_runs)), key=lambda i: hf_runs[i].output_tokens_per_s, default=None)
    best_hf = hf_runs[best] if best is not None else None
    return {
        "settings": workload_settings(workload),
        "flops": flops,
        "matmul_gflops": gflops,
        "floor_seconds": floor,
        "pagedserve": asdict(ours),
        "hf": [asdict(r) for r in hf_runs],
        "hf_best_index": best,
        "hf_best": asdict(best_hf) if best_hf else None,
        "ratio_vs_best_hf": (ours.output_tokens_per_s / best_hf.output_tokens_per_s
                             if best_hf else None),
        "memory_ratio_vs_best_hf": (ours.peak_memory_bytes / max(1, best_hf.peak_memory_bytes)
                                    if best_hf else None),
    }


def hf_dtype(args, model: ModelUnderTest) -> torch.dtype:
    return model.dtype if args.hf_dtype == "same" else getattr(torch, args.hf_dtype)


# -- report --------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def print_workload(report: dict) -> None:
    s, fl = report["settings"], report["flops"]
    print(f"\n== {s['name']}: {s['num_prompts']} requests, prompts {s['input_len'][0]}-"
          f"{s['input_len'][1]}, outputs {s['output_len'][0]}-{s['output_len'][1]} "
          f"({s['prompt_tokens']:,} prompt + {s['output_tokens']:,} output tokens)")
    print(f"   {fl['total'] / 1e12:.2f} TFLOP (linear {fl['linear'] / 1e12:.2f}, "
          f"lm_head {fl['lm_head'] / 1e12:.2f}, attention {fl['attention'] / 1e12:.2f}); "
          f"floor {report['floor_seconds']:.1f} s at {report['matmul_gflops']:.1f} GFLOP/s")
    best = report["hf_best_index"]
    marked = [("", report["pagedserve"])]
    marked += [("*" if i == best else "", r) for i, r in enumerate(report["hf"])]
    print_table(
        ["", "system", "config", "seconds", "out tok/s", "total tok/s", "req/s", "peak MiB",
         "of floor"],
        [_row(mark, r) for mark, r in marked], left=3)
    if report["hf_best"]:
        print(f"  * best HF. pagedserve / best HF: throughput {report['ratio_vs_best_hf']:.2f}x, "
              f"peak memory {report['memory_ratio_vs_best_hf']:.2f}x (pagedserve's includes "
              f"its {_mib(report['pagedserve']['extra']['kv_cache_bytes'])} MiB KV cache)")
    _print_kv(report["pagedserve"]["extra"])


def _row(mark: str, r: dict) -> list[str]:
    config = r["config"] if r["system"] == "HF generate" else (
        f"block_size={r['extra']['block_size']}")
    return [mark, r["system"], config, f"{r['seconds']:.1f}", f"{r['output_tokens_per_s']:.1f}",
            f"{r['total_tokens_per_s']:.1f}", f"{r['requests_per_s']:.2f}",
            _mib(r["peak_memory_bytes"]), f"{r['fraction_of_floor']:.1%}"]


def _print_kv(extra: dict) -> None:
    kv = extra["kv_utilization"]
    print(f"  KV utilisation (time-averaged): paged {kv['paged']:.1%}, contiguous "
          f"max_model_len={extra['max_model_len']} reservation {kv['contiguous']:.2%}; "
          f"mean {kv['mean_running_seqs']:.1f} running seqs, {kv['mean_tokens_per_seq']:.0f} "
          f"tokens each")
    print(f"  sequences that fit in the {kv['kv_slots']:,}-slot KV cache: paged "
          f"{kv['paged_seqs_fit']} ({kv['paged_seqs_fit_whole_blocks']} counting whole blocks), "
          f"contiguous {kv['contiguous_seqs_fit']}")


def full_report(args, model: ModelUnderTest, rate: dict, reports: dict) -> dict:
    return {
        "benchmark": "throughput",
        "model": model.path.name,
        "dtype": str(model.dtype),
        "device": str(model.device),
        "engine_config": {k: v for k, v in vars(model.config).items() if _jsonable(v)},
        "hf": {"batch_sizes": args.hf_batch_sizes, "sorted": HF_SORTS[args.hf_sort],
               "dtype": str(hf_dtype(args, model)), "skipped": args.skip_hf},
        "machine": machine_info(model.device),
        "matmul": rate,
        "flop_formula": FLOP_FORMULA,
        "workloads": reports,
    }


def _jsonable(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


# -- command line -------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("chat", "prefill-heavy", "both"), default="both")
    parser.add_argument("--num-prompts", type=int,
                        help="requests in every workload run (overrides the two below)")
    parser.add_argument("--chat-num-prompts", type=int, default=WORKLOADS["chat"][0])
    parser.add_argument("--prefill-num-prompts", type=int, default=WORKLOADS["prefill-heavy"][0])
    parser.add_argument("--chat-input-len", type=parse_range, default=WORKLOADS["chat"][1],
                        help="LOW:HIGH prompt tokens (default %(default)s)")
    parser.add_argument("--chat-output-len", type=parse_range, default=WORKLOADS["chat"][2])
    parser.add_argument("--prefill-input-len", type=parse_range,
                        default=WORKLOADS["prefill-heavy"][1])
    parser.add_argument("--prefill-output-len", type=parse_range,
                        default=WORKLOADS["prefill-heavy"][2])
    parser.add_argument("--workload-seed", type=int, default=0,
                        help="added to each workload's fixed seed")
    parser.add_argument("--hf-batch-sizes", type=parse_ints, default=[16, 64],
                        help="comma-separated HF batch sizes to try (default 16,64)")
    parser.add_argument("--hf-sort", choices=tuple(HF_SORTS), default="both",
                        help="HF batches length-sorted, in arrival order, or both (default)")
    parser.add_argument("--hf-dtype", choices=("same", "float32", "bfloat16", "float16"),
                        default="same", help="HF's dtype (default: pagedserve's)")
    parser.add_argument("--matmul-tokens", type=parse_ints, default=[64, 256, 1024],
                        help="rows of the matmul-rate measurement (best counts)")
    parser.add_argument("--skip-hf", action="store_true", help="pagedserve only")
    parser.add_argument("--output", type=Path, help="write everything as JSON here")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = model_under_test(config_from_args(args))
    workloads = make_workloads(args, model)
    print(f"matmul rate ({model.dtype}, {model.device}) ...", flush=True)
    rate = matmul_rate(model.hf_config, model.dtype, model.device,
                       token_counts=args.matmul_tokens)
    gflops = rate["best_gflops"]
    print(f"  {gflops:.1f} GFLOP/s (best of rows {args.matmul_tokens}: "
          + ", ".join(f"{k}: {v:.1f}" for k, v in rate["gflops_per_token_count"].items()) + ")")
    print(f"model {model.path.name}, dtype {model.dtype}, device {model.device}, "
          f"{torch.get_num_threads()} threads, max_model_len {model.config.max_model_len}")
    reports = {}
    for workload in workloads:
        reports[workload.name] = run_workload(args, model, workload, gflops)
        print_workload(reports[workload.name])
    if args.output:
        write_json(args.output, full_report(args, model, rate, reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
