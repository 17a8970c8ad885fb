"""Scheduler overhead: the scheduler and block manager alone, with a null model.

    pagedserve bench scheduler [--steps 200] [--sizes 1,64,256,1024] [--output sched.json]

No model runs: a null runner "samples" a fake token for every sequence that
samples, so what is timed is the CPU work the engine does around the model
each step. Two levels are timed:

  scheduler   Scheduler.schedule() + Scheduler.update() with the fake tokens
              (plus finishing the sequences that reached max_tokens);
  engine      LLMEngine.step() around the null runner (bench/common/null_engine.py):
              the above plus the engine's own per-step bookkeeping (stop
              checks, RequestOutput for every request that moved). There is
              no tokenizer, so detokenization is not included.

Cases, each with prefix caching off and on:

  decode      N sequences (--sizes) already admitted and prefilled, decoding
              one token per step: steady state. Prompts are distinct random
              tokens of --prompt-len + (i mod block_size) tokens, so block
              boundaries (a new block, a newly full block to hash) are spread
              evenly over the steps instead of all landing on one step in 16.
              ignore_eos, max_tokens and KV blocks large enough that nothing
              finishes or is preempted while it is timed (checked).
  admission   --admission-running sequences decoding as above, plus bursts of
              --burst new prompts (a shared system prompt of half of
              --prompt-len, then their own tokens; --burst-output-len tokens
              out): a new burst arrives whenever the waiting queue is empty,
              so most steps admit sequences and prefill chunks of them beside
              the decodes. Adding the burst is timed apart (add_us_per_seq),
              not as part of a step.

Each case runs its setup (admission and one big prefill step, untimed),
--warmup steps, then --steps timed steps. The null model's own time (drawing
the fake tokens) is taken out of each step. The table gives the median and
p90 wall microseconds per step, the median per scheduled sequence, and the
median in CPU time of the thread (steadier on a shared machine: time spent
descheduled does not count). The benchmark issue's target is a step under
1 ms for 256 running sequences. --cases, --caching and --modes pick a subset;
--profile writes cProfile stats of the timed steps.
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from bench.common.report import print_table, write_json
from bench.common.workload import parse_ints
from bench.offline.scheduler_run import Case, Result, run_case

MODES = ("scheduler", "engine")
CASES = ("decode", "admission")
TARGET_US = 1000.0  # the target: one step under 1 ms for 256 running sequences
TARGET_SEQS = 256


def make_cases(args) -> list[Case]:
    cases = []
    for mode in args.modes:
        for caching in args.caching:
            if "decode" in args.cases:
                cases += [Case("decode", n, caching, mode) for n in args.sizes]
            if "admission" in args.cases:
                cases.append(Case("admission", args.admission_running, caching, mode))
    return cases


# -- report ---------------------------------------------------------------------------------
def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def print_results(results: list[Result]) -> None:
    print_table(
        ["case", "mode", "cache", "running", "seqs/step", "median us", "p90 us", "us/seq",
         "cpu med us"],
        [[r.case, r.mode, _on_off(r.prefix_caching), r.num_running,
          f"{r.mean_seqs_per_step:.1f}", f"{r.median_us:.1f}", f"{r.p90_us:.1f}",
          f"{r.us_per_seq:.2f}", f"{r.cpu_median_us:.1f}"] for r in results],
        left=3)
    for r in results:
        if r.case == "admission":
            print(f"admission {r.mode} caching={_on_off(r.prefix_caching)}: "
                  f"{r.admitted} admitted, {r.mean_tokens_per_step:.0f} tokens/step, "
                  f"add {r.add_us_per_seq:.1f} us/prompt, hit rate {r.prefix_cache_hit_rate:.0%}")


def target_summary(results: list[Result]) -> dict:
    """The issue's target: a scheduler step under 1 ms for 256 running sequences."""
    rows = [r for r in results if r.case == "decode" and r.num_running == TARGET_SEQS]
    return {
        "target_us": TARGET_US,
        "num_running": TARGET_SEQS,
        "met": {f"{r.mode}/caching={_on_off(r.prefix_caching)}": r.median_us < TARGET_US
                for r in rows},
    }


def build_report(args, results: list[Result]) -> dict:
    return {
        "benchmark": "scheduler",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "settings": {
            "steps": args.steps, "warmup": args.warmup, "block_size": args.block_size,
            "prompt_len": args.prompt_len, "max_num_batched_tokens": args.max_num_batched_tokens,
            "admission_running": args.admission_running, "burst": args.burst,
            "burst_output_len": args.burst_output_len, "seed": args.seed,
        },
        "target": target_summary(results),
        "results": [asdict(r) for r in results],
    }


# -- command line ---------------------------------------------------------------------------
def choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return values
    return parse


def parse_caching(text: str) -> list[bool]:
    return [v == "on" for v in choices(("off", "on"))(text)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench scheduler",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    parser.add_argument("--sizes", type=parse_ints, default=[1, 64, 256, 1024],
                        help="running sequences of the decode cases (default 1,64,256,1024)")
    parser.add_argument("--modes", type=choices(MODES), default=list(MODES),
                        help="scheduler (schedule + update) and/or engine (LLMEngine.step)")
    parser.add_argument("--cases", type=choices(CASES), default=list(CASES),
                        help="decode (steady state) and/or admission (bursts of new prompts)")
    parser.add_argument("--caching", type=parse_caching, default=[False, True],
                        help="prefix caching off and/or on (default off,on)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512,
                        help="prompt tokens of each sequence (+ i mod block size)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--admission-running", type=int, default=256,
                        help="sequences decoding beside the bursts")
    parser.add_argument("--burst", type=int, default=64, help="prompts per burst")
    parser.add_argument("--burst-output-len", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=None,
                        help="write cProfile stats of the timed steps (all cases) here")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("steps", "block_size", "prompt_len", "burst", "burst_output_len",
                 "admission_running"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profiler = cProfile.Profile() if args.profile else None
    results = [run_case(case, args, profiler)
               for case in tqdm(make_cases(args), desc="bench scheduler", unit="case")]
    print_results(results)
    if profiler is not None:
        profiler.dump_stats(str(args.profile))
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    if args.output:
        write_json(args.output, build_report(args, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
