"""Automatic prefix caching: the same workload with caching off and on.

    pagedserve bench prefix [--num-requests 32] [--output results.json] [--plot-dir docs]

Workload (shared prefix): K system prompts of --system-len random tokens,
each request one of them (round-robin or random) followed by its own random
question of --question-len tokens; --output-len tokens out (ignore_eos,
greedy). Every request arrives at t=0 and the engine is stepped by hand, so
the time to first token (TTFT) of each request is measured from the start.

Three sections, each run in this process with a fresh engine per setting
(--enable-prefix-caching is ignored: each section sets it as it needs):

  1. shared prefix, caching off vs on: throughput, prefill tokens actually
     computed, hit rate, TTFT, and the speedup an ideal cache would give
     under a simple cost model (below), so measured and ideal sit side by side;
  2. --sweep-block-sizes: the same workload, caching on, per block size:
     throughput, hit rate and KV utilisation;
  3. no reuse (every prompt distinct, 0 % hit rate), caching off vs on: what
     the bookkeeping costs when it can never help (target: under 2 %).

Cost model for the ideal speedup: one step's time is proportional to the
tokens it runs through the model, a prefill token costing as much as a decode
token. A run then costs P + D, P the prefill tokens computed (the engine's
own count) and D = N x (M - 1) the decode tokens (the first output token
comes out of the prefill), and ideal speedup = (P_off + D) / (P_on + D).
A second, calibrated figure keeps the decode-only step time of the
caching-off run and scales its prefill-step time by P_on / P_off.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.common.report import write_json
from bench.common.workload import Workload, parse_range, shared_prefix_workload
from bench.offline.driver import ModelUnderTest, model_under_test
from bench.offline.prefix_report import (compare, ideal_prefill_tokens, prefill_bound,
                                         print_bound, print_comparison, print_no_reuse,
                                         print_runs, write_plots)
from bench.offline.prefix_runs import Run, run_interleaved
from engine.args import add_engine_args, config_from_args

COST_MODEL = ("time ~ prefill tokens computed + decode tokens; "
              "ideal_speedup = (P_off + D) / (P_on + D), D = N * (M - 1); "
              "calibrated: T_on = decode-step s (off) + prefill-step s (off) * P_on / P_off")


@dataclass
class Sections:
    """Every run of the benchmark, and what the comparisons made of them."""

    off: Run
    on: Run
    shared_cmp: dict
    bound: dict
    sweep: list[Run]
    no_reuse: tuple[Run, Run, dict] | None


def run_sections(args, config, shared: Workload, distinct: Workload) -> Sections:
    sweep_sizes = parse_sizes(args.sweep_block_sizes)
    total = 2 + len(sweep_sizes) + (0 if args.skip_no_reuse else 2)
    progress = tqdm(total=total, desc="bench prefix", unit="run")

    def pair(workload: Workload, name: str) -> list[Run]:
        runs = run_interleaved([(config.replace(enable_prefix_caching=caching),
                                 f"{name}, caching {'on' if caching else 'off'}")
                                for caching in (False, True)], workload, args.repeats)
        progress.update(2)
        return runs

    off, on = pair(shared, "shared")
    sweep = []
    for size in sweep_sizes:
        if size == on.block_size:  # already measured: the caching-on run above
            sweep.append(dataclasses.replace(on, label=f"sweep, bs {size} (= on)"))
        else:
            sized = config.replace(enable_prefix_caching=True, block_size=size)
            [run] = run_interleaved([(sized, f"sweep, bs {size}")], shared, args.repeats)
            sweep.append(run)
        progress.update(1)
    no_reuse = None
    if not args.skip_no_reuse:
        d_off, d_on = pair(distinct, "no reuse")
        no_reuse = (d_off, d_on, compare(d_off, d_on, distinct))
    progress.close()
    return Sections(off, on, compare(off, on, shared), prefill_bound(shared, on), sweep, no_reuse)


def parse_sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


# -- report ------------------------------------------------------------------------------------
def print_summary(args, model: ModelUnderTest, shared: Workload, distinct: Workload,
                  sections: Sections) -> None:
    print(f"\nmodel {model.path.name}, dtype {model.dtype}, {model.device}, "
          f"{torch.get_num_threads()} threads; {args.num_requests} requests = "
          f"{args.num_system_prompts} system prompts x {args.system_len} tokens ({args.assign}) "
          f"+ questions of {args.question_len[0]}-{args.question_len[1]} tokens, "
          f"{args.output_len} output tokens each; {shared.num_prompt_tokens} prompt tokens in all")
    print("cost model: time ~ prefill tokens computed + decode tokens "
          f"(D = N x (M-1) = {shared.num_decode_tokens})\n")
    print_runs([sections.off, sections.on])
    print_comparison("shared prefix", sections.shared_cmp)
    print_bound(sections.bound)
    if sections.sweep:
        print()
        print_runs(sections.sweep, title="block-size sweep (caching on, shared prefix; "
                                         "KV util = tokens held / slots allocated)")
    if sections.no_reuse:
        print()
        print_no_reuse(*sections.no_reuse, distinct)


def run_dict(run: Run) -> dict:
    data = asdict(run)
    data.pop("output_token_ids")
    return data


def build_report(args, model: ModelUnderTest, shared: Workload, distinct: Workload,
                 sections: Sections, elapsed: float) -> dict:
    report = {
        "model": model.path.name,
        "dtype": str(model.dtype).replace("torch.", ""),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "wall_seconds": elapsed,
        "cost_model": COST_MODEL,
        "workload": {
            "num_requests": args.num_requests,
            "num_system_prompts": args.num_system_prompts,
            "system_len": args.system_len,
            "question_len": list(args.question_len),
            "output_len": args.output_len,
            "assign": args.assign,
            "seed": args.workload_seed,
            "prompt_tokens": shared.num_prompt_tokens,
            "output_tokens": shared.num_output_tokens,
            "decode_tokens": shared.num_decode_tokens,
        },
        "shared_prefix": {"off": run_dict(sections.off), "on": run_dict(sections.on),
                          **sections.shared_cmp, "prefill_bound": sections.bound},
        "block_size_sweep": [
            {**run_dict(r), "ideal_prefill_tokens": ideal_prefill_tokens(shared.prompts,
                                                                         r.block_size)}
            for r in sections.sweep
        ],
        "no_reuse": None,
    }
    if sections.no_reuse:
        d_off, d_on, d_cmp = sections.no_reuse
        report["no_reuse"] = {"off": run_dict(d_off), "on": run_dict(d_on), **d_cmp,
                              "prompt_tokens": distinct.num_prompt_tokens,
                              "loss": 1 - d_cmp["throughput_ratio_on_off"]}
    return report


# -- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-system-prompts", type=int, default=2, help="K")
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=parse_range, default=(32, 32), help="LOW:HIGH")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--assign", choices=("round-robin", "random"), default="round-robin",
                        help="which system prompt each request gets")
    parser.add_argument("--sweep-block-sizes", default="4,8,16,32,64,128",
                        help="comma-separated; empty to skip the sweep")
    parser.add_argument("--skip-no-reuse", action="store_true",
                        help="leave out the 0 %% hit-rate section")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per setting, fastest kept (off and on alternate)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot-dir", type=Path,
                        help="PNG plots here (default: next to --output, else docs/)")
    parser.add_argument("--no-plots", action="store_true")
    add_engine_args(parser)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.num_system_prompts < 1 or args.output_len < 1:
        parser.error("--num-requests, --num-system-prompts and --output-len must be >= 1")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = model_under_test(config_from_args(args))
    shared = shared_prefix_workload(
        "shared", args.num_requests, args.num_system_prompts, args.system_len, args.question_len,
        args.output_len, model.vocab_size, args.workload_seed, args.assign)
    distinct = shared_prefix_workload(
        "distinct", args.num_requests, args.num_requests, args.system_len, args.question_len,
        args.output_len, model.vocab_size, args.workload_seed + 1)
    started = time.perf_counter()
    sections = run_sections(args, model.config, shared, distinct)
    elapsed = time.perf_counter() - started
    print_summary(args, model, shared, distinct, sections)
    print(f"\nbenchmark wall time {elapsed:.0f} s")
    report = build_report(args, model, shared, distinct, sections, elapsed)
    if not args.no_plots:
        plot_dir = args.plot_dir or (args.output.parent if args.output else Path("docs"))
        report["plots"] = write_plots(report, plot_dir)
        for path in report["plots"]:
            print(f"wrote {path}")
    if args.output:
        write_json(args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
