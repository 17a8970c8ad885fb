"""Per-token engine overhead of one long stream, by output kind, with a null model.

    pagedserve bench output-overhead [--tokens 4000] [--kinds cumulative,delta]
        [--logprobs off,on] [--window 100] [--marks 100,1000,2000,4000]
        [--repeats 3] [--tokenizer MODEL] [--output overhead.json]

One request decodes --tokens tokens through LLMEngine.step() around the
NullRunner (bench/common/null_engine.py): no model runs, so a step's time is the
engine's own work for the one token it makes (schedule, update, stop check,
RequestOutput), the null model's time taken out. A CUMULATIVE output copies the
stream's token list (and, with logprobs, its two logprob lists) every step, so
its step time grows with the stream; a DELTA output slices off the new token
only, so its step time should stay flat (engine/frontend/request_state.py).

For each mark t the table gives the median microseconds per step over the
--window steps that made tokens t - window + 1 .. t, pooled over --repeats
runs (the cases interleave, so a slow spell of a shared machine hits them
alike), in wall time and in the thread's CPU time (steadier where other
processes share the cores). `growth` is the last mark over the first. There is
no tokenizer unless --tokenizer names one (then the fake tokens are
detokenized, and the text is part of what is copied).
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from bench.common.null_engine import NULL_MODEL, VOCAB_SIZE, NullRunner, make_scheduler
from bench.common.report import print_table, write_json
from bench.common.workload import parse_ints, random_tokens
from bench.offline.scheduler import choices
from engine.config import EngineConfig, default_cache_dir
from engine.frontend.llm_engine import LLMEngine
from engine.model.model_info import ModelInfo
from engine.outputs import RequestOutputKind
from engine.sampling_params import SamplingParams

KINDS = ("cumulative", "delta")
BLOCK_SIZE = 16


@dataclass
class Case:
    kind: str  # "cumulative" | "delta"
    logprobs: bool
    wall_ns: list[list[int]] = field(default_factory=list)  # per run: per step
    cpu_ns: list[list[int]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.kind} logprobs={'on' if self.logprobs else 'off'}"


def engine_for(args) -> tuple[LLMEngine, NullRunner]:
    """An engine around the null runner with room for one prompt and --tokens outputs."""
    max_model_len = args.prompt_len + args.tokens + BLOCK_SIZE
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=1,
                          max_num_batched_tokens=max(args.prompt_len, BLOCK_SIZE),
                          max_model_len=max_model_len,
                          num_gpu_blocks_override=max_model_len // BLOCK_SIZE + 2, device="cpu")
    runner = NullRunner(config.num_gpu_blocks_override)
    engine = LLMEngine(config, runner=runner, model_info=args.model_info,
                       scheduler=make_scheduler(config))
    return engine, runner


def run_once(case: Case, args, prompt: list[int]) -> None:
    """One stream of --tokens tokens; records each step's wall and CPU time."""
    engine, runner = engine_for(args)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.tokens,
                            logprobs=1 if case.logprobs else None,
                            output_kind=RequestOutputKind[case.kind.upper()])
    engine.add_request("stream", prompt, params)
    wall, cpu = [], []
    gc.collect()
    while engine.has_unfinished_requests():
        model_ns = runner.elapsed_ns
        start_wall, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        engine.step()
        end_wall, end_cpu = time.perf_counter_ns(), time.thread_time_ns()
        model_ns = runner.elapsed_ns - model_ns  # the null model's own time is not overhead
        wall.append(end_wall - start_wall - model_ns)
        cpu.append(end_cpu - start_cpu - model_ns)
    if len(wall) != args.tokens:  # one token a step, or the marks mean nothing
        raise RuntimeError(f"{case.label}: {len(wall)} steps for {args.tokens} tokens")
    case.wall_ns.append(wall)
    case.cpu_ns.append(cpu)


def window_median_us(runs: list[list[int]], mark: int, window: int) -> float:
    """Median of the steps that made tokens mark - window + 1 .. mark, over every run."""
    first = max(mark - window, 0)
    return statistics.median(ns for run in runs for ns in run[first:mark]) / 1000


def summary(case: Case, args) -> dict:
    def medians(runs):
        return {str(m): round(window_median_us(runs, m, args.window), 2) for m in args.marks}

    return {"kind": case.kind, "logprobs": case.logprobs,
            "wall_us": medians(case.wall_ns), "cpu_us": medians(case.cpu_ns)}


def print_results(results: list[dict], marks: list[int]) -> None:
    rows = []
    for r in results:
        for clock in ("wall_us", "cpu_us"):
            values = [r[clock][str(m)] for m in marks]
            growth = values[-1] / values[0] if values[0] else float("nan")
            rows.append([r["kind"], "on" if r["logprobs"] else "off", clock.split("_")[0],
                         *(f"{v:.1f}" for v in values), f"{growth:.2f}x"])
    print_table(["kind", "logprobs", "clock", *(f"@{m} us" for m in marks), "growth"], rows,
                title="median engine overhead per step (one token a step)", left=3)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench output-overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000, help="output tokens of the stream")
    parser.add_argument("--kinds", type=choices(KINDS), default=list(KINDS),
                        help="output kinds to time (default cumulative,delta)")
    parser.add_argument("--logprobs", type=choices(("off", "on")), default=["off", "on"],
                        help="ask for logprobs (1): off and/or on (default off,on)")
    parser.add_argument("--marks", type=parse_ints, default=[100, 1000, 2000, 4000],
                        help="tokens at which each window ends (default 100,1000,2000,4000)")
    parser.add_argument("--window", type=int, default=100, help="steps per window")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokenizer", default=None, metavar="MODEL",
                        help="detokenize the fake tokens with this model's tokenizer "
                        "(a name or folder; default: no tokenizer, no text)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("tokens", "window", "repeats", "prompt_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if max(args.marks) > args.tokens:
        raise ValueError(f"--marks go up to {max(args.marks)}, beyond --tokens {args.tokens}")
    args.model_info = model_info(args.tokenizer)
    return args


def model_info(tokenizer: str | None) -> ModelInfo:
    """The null model, with a real tokenizer when one is named."""
    if tokenizer is None:
        return NULL_MODEL
    from engine.model.models.loader import load_tokenizer, resolve_model_path

    folder = resolve_model_path(tokenizer, default_cache_dir())
    return ModelInfo(vocab_size=VOCAB_SIZE, eos_token_ids=NULL_MODEL.eos_token_ids,
                     tokenizer=load_tokenizer(folder, required=True))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompt = random_tokens(random.Random(args.seed), args.prompt_len, VOCAB_SIZE)
    cases = [Case(kind, logprobs == "on") for logprobs in args.logprobs for kind in args.kinds]
    runs = [case for _ in range(args.repeats) for case in cases]  # interleaved
    for case in tqdm(runs, desc="bench output-overhead", unit="stream"):
        run_once(case, args, prompt)
    results = [summary(case, args) for case in cases]
    print_results(results, args.marks)
    if args.output:
        write_json(args.output, {
            "benchmark": "output-overhead", "python": platform.python_version(),
            "machine": platform.machine(),
            "settings": {k: v for k, v in vars(args).items() if k not in ("output", "model_info")},
            "results": results,
        })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
