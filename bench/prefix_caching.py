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
import gc
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.throughput import parse_range
from engine.cli import add_engine_args, config_from_args

STAT_KEYS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed",
             "evictions", "num_preemptions")


# -- workload -------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int
    num_system_prompts: int
    system_len: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return self.num_requests * self.output_len

    @property
    def num_decode_tokens(self) -> int:
        """Tokens fed to decode steps: every output token but the last (one per step)."""
        return self.num_requests * (self.output_len - 1)


def make_workload(name, num_requests, num_system, system_len, question_range, output_len,
                  vocab_size, seed, assign="round-robin") -> Workload:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        # Skip the first ids: they are the special tokens of most vocabularies.
        return [rng.randrange(100, vocab_size) for _ in range(n)]

    systems = [tokens(system_len) for _ in range(num_system)]
    prompts = []
    for i in range(num_requests):
        system = systems[i % num_system] if assign == "round-robin" else rng.choice(systems)
        prompts.append(system + tokens(rng.randint(*question_range)))
    return Workload(name, prompts, output_len, num_system, system_len)


def unique_prompt_tokens(prompts: list[list[int]]) -> int:
    """Distinct (prefix, token) positions: what a token-exact cache would compute."""
    seen: set[int] = set()
    for prompt in prompts:
        h = 0
        for token in prompt:
            h = hash((h, token))
            seen.add(h)
    return len(seen)


def ideal_prefill_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Prefill tokens a block-granular cache that never evicts would compute.

    Requests are taken in arrival order; a request reuses the full blocks of
    its prompt already computed by earlier requests (a chain from the first
    block), but always computes at least its last block, so there are logits
    to sample, as a real engine must.
    """
    cached: set[int] = set()
    total = 0
    for prompt in prompts:
        limit = (len(prompt) - 1) // block_size  # full blocks that may be hits
        h, hits, chain = 0, 0, True
        for b in range(len(prompt) // block_size):
            h = hash((h, tuple(prompt[b * block_size : (b + 1) * block_size])))
            if chain and b < limit and h in cached:
                hits += 1
            else:
                chain = False
            cached.add(h)
        total += len(prompt) - hits * block_size
    return total


# -- one run ---------------------------------------------------------------------------
@dataclass
class Run:
    label: str
    prefix_caching: bool
    block_size: int
    seconds: float
    output_tokens_per_s: float
    requests_per_s: float
    prefill_tokens_computed: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    hit_rate: float
    cached_tokens_reported: int  # sum of RequestOutput.num_cached_tokens
    mean_ttft_s: float
    p90_ttft_s: float
    kv_utilization: float  # tokens held / slots of the blocks in their tables
    kv_sharing: float  # block-table entries / distinct blocks (> 1: blocks shared)
    evictions: int
    preemptions: int
    prefill_step_seconds: float  # steps that computed prompt tokens
    decode_step_seconds: float  # steps that only decoded
    runner_seconds: float  # inside ModelRunner.execute (batch preparation, forward, sampling)
    engine_seconds: float  # the rest: add_request, scheduling, cache lookups, hashing, outputs
    num_steps: int
    attempt_seconds: list[float] = field(default_factory=list)  # every timed run (--repeats)
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)


def engine_stats(engine) -> dict:
    stats = getattr(engine, "stats", None)
    if stats is None:
        raise RuntimeError("this engine has no stats(): the prefix-caching engine is needed")
    values = stats()
    return {key: int(values.get(key, 0)) for key in STAT_KEYS}


def run_workload(config, workload: Workload, label: str, repeats: int = 1) -> Run:
    """Best of `repeats` timed runs on one fresh engine (the cache reset in between)."""
    return run_interleaved([(config, label)], workload, repeats)[0]


def run_interleaved(settings, workload: Workload, repeats: int = 1) -> list[Run]:
    """One fresh engine per (config, label); their timed runs alternate, best kept.

    Alternating off, on, on, off, ... spreads the drifts of a shared machine over
    both sides of a comparison instead of charging them to whichever ran second.
    """
    from engine import LLM, SamplingParams

    llms = []
    try:
        for config, _ in settings:
            llm = LLM.from_config(config)
            llms.append(llm)
            warmup = make_workload("warm-up", 2, 2, 24, (4, 4), 2, llm.engine.vocab_size, -1)
            llm.generate([{"prompt_token_ids": p} for p in warmup.prompts],
                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                         use_tqdm=False)
        runs: list[list[Run]] = [[] for _ in settings]
        for attempt in range(repeats):
            order = range(len(settings)) if attempt % 2 == 0 else reversed(range(len(settings)))
            for i in order:
                engine, label = llms[i].engine, settings[i][1]
                if engine.config.enable_prefix_caching:
                    engine.reset_prefix_cache()
                tag = label if repeats == 1 else f"{label} [{attempt + 1}/{repeats}]"
                runs[i].append(_timed_run(engine, workload, tag, attempt))
        best_runs = []
        for (_, label), attempts in zip(settings, runs):
            best = min(attempts, key=lambda r: r.seconds)
            best.label = label
            best.attempt_seconds = [r.seconds for r in attempts]
            best_runs.append(best)
        return best_runs
    finally:
        del llms
        gc.collect()


def _timed_run(engine, workload: Workload, label: str, attempt: int) -> Run:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    block_size = engine.config.block_size
    before = engine_stats(engine)
    computed = before["prompt_tokens_computed"]
    ttft: dict[str, float] = {}
    finished: dict[str, object] = {}
    utilization, sharing = [], []
    prefill_s = decode_s = 0.0
    steps = 0
    ids = [f"{workload.name}-{attempt}-{i}" for i in range(workload.num_requests)]
    runner_s = [0.0]
    execute = engine.runner.execute

    def timed_execute(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            runner_s[0] += time.perf_counter() - t0

    engine.runner.execute = timed_execute  # this instance only; removed below
    bar = tqdm(total=len(ids), desc=label, unit="req", leave=False)
    try:
        start = time.perf_counter()
        for request_id, prompt in zip(ids, workload.prompts):
            engine.add_request(request_id, list(prompt), params)
        in_engine = time.perf_counter() - start  # add_request and step(), not our sampling
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            steps += 1
            in_engine += now - step_start
            stats = engine_stats(engine)
            if stats["prompt_tokens_computed"] > computed:
                prefill_s += now - step_start
            else:
                decode_s += now - step_start
            computed = stats["prompt_tokens_computed"]
            for output in outputs:
                if output.request_id not in ttft and output.outputs[0].token_ids:
                    ttft[output.request_id] = now - start
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
            _sample_kv(engine, block_size, utilization, sharing)
        seconds = time.perf_counter() - start
    finally:
        del engine.runner.execute
        bar.close()
    after = engine_stats(engine)
    delta = {key: after[key] - before[key] for key in STAT_KEYS}
    ordered = [finished[i] for i in ids]
    produced = sum(len(o.outputs[0].token_ids) for o in ordered)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    ttfts = sorted(ttft[i] for i in ids)
    queries = delta["prefix_cache_queries"]
    return Run(
        label=label,
        prefix_caching=engine.config.enable_prefix_caching,
        block_size=block_size,
        seconds=seconds,
        output_tokens_per_s=produced / seconds,
        requests_per_s=len(ids) / seconds,
        prefill_tokens_computed=delta["prompt_tokens_computed"],
        prefix_cache_queries=queries,
        prefix_cache_hits=delta["prefix_cache_hits"],
        hit_rate=delta["prefix_cache_hits"] / queries if queries else 0.0,
        cached_tokens_reported=sum(o.num_cached_tokens for o in ordered),
        mean_ttft_s=statistics.fmean(ttfts),
        p90_ttft_s=ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        kv_utilization=statistics.fmean(utilization) if utilization else 0.0,
        kv_sharing=statistics.fmean(sharing) if sharing else 1.0,
        evictions=delta["evictions"],
        preemptions=delta["num_preemptions"],
        prefill_step_seconds=prefill_s,
        decode_step_seconds=decode_s,
        runner_seconds=runner_s[0],
        engine_seconds=in_engine - runner_s[0],
        num_steps=steps,
        output_token_ids=[list(o.outputs[0].token_ids) for o in ordered],
    )


def _sample_kv(engine, block_size: int, utilization: list, sharing: list) -> None:
    """Tokens whose K/V are held, over the slots of the blocks in the running tables."""
    tables = engine.block_manager.block_tables
    held = entries = 0
    distinct: set[int] = set()
    for seq in engine.scheduler.running:
        table = tables.get(seq.seq_id)
        if not table:
            continue
        held += min(seq.num_computed_tokens, len(table) * block_size)
        entries += len(table)
        distinct.update(table)
    if entries:
        utilization.append(held / (entries * block_size))
        sharing.append(entries / len(distinct))


# -- comparisons ----------------------------------------------------------------------------
def compare(off: Run, on: Run, workload: Workload) -> dict:
    decode = workload.num_decode_tokens
    ideal = (off.prefill_tokens_computed + decode) / max(1, on.prefill_tokens_computed + decode)
    prefill_share = off.prefill_tokens_computed and (
        on.prefill_tokens_computed / off.prefill_tokens_computed)
    calibrated_on = off.decode_step_seconds + off.prefill_step_seconds * prefill_share
    measured = on.output_tokens_per_s / off.output_tokens_per_s
    best = ideal_prefill_tokens(workload.prompts, on.block_size)
    calibrated = off.seconds / calibrated_on if calibrated_on else float("nan")
    return {
        "throughput_ratio_on_off": measured,
        "prefill_computed_ratio_off_on": off.prefill_tokens_computed
        / max(1, on.prefill_tokens_computed),
        "ideal_speedup": ideal,
        "measured_over_ideal": measured / ideal,
        # The same cost model with the fewest prefill tokens any block cache could compute.
        "perfect_cache_speedup": (off.prefill_tokens_computed + decode) / (best + decode),
        "calibrated_ideal_speedup": calibrated,
        "measured_over_calibrated": measured / calibrated if calibrated else float("nan"),
        "mean_ttft_ratio_off_on": off.mean_ttft_s / on.mean_ttft_s,
        # Engine time outside the model runner that caching adds (lookups, hashing, LRU),
        # as a share of the caching-off run: far less noisy than the throughput ratio.
        "engine_overhead_added": (on.engine_seconds - off.engine_seconds) / off.seconds,
        "outputs_identical": sum(
            a == b for a, b in zip(off.output_token_ids, on.output_token_ids)),
    }


def prefill_bound(workload: Workload, on: Run) -> dict:
    """Check: computed prefill with caching <= unique tokens + one block per request."""
    unique = unique_prompt_tokens(workload.prompts)
    ideal = ideal_prefill_tokens(workload.prompts, on.block_size)
    limit = unique + workload.num_requests * on.block_size
    return {
        "unique_prompt_tokens": unique,
        "ideal_prefill_tokens": ideal,
        "computed_with_caching": on.prefill_tokens_computed,
        "limit": limit,
        "ok": on.prefill_tokens_computed <= limit,
    }


# -- printing ----------------------------------------------------------------------------
def print_runs(runs: list[Run]) -> None:
    header = (f"{'run':<22}{'bs':>5}{'seconds':>9}{'out tok/s':>11}{'req/s':>8}"
              f"{'prefill':>9}{'hit rate':>10}{'TTFT s':>8}{'KV util':>9}{'evict':>7}")
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{r.label:<22}{r.block_size:>5}{r.seconds:>9.1f}{r.output_tokens_per_s:>11.1f}"
              f"{r.requests_per_s:>8.2f}{r.prefill_tokens_computed:>9}{r.hit_rate:>10.1%}"
              f"{r.mean_ttft_s:>8.2f}{r.kv_utilization:>9.1%}{r.evictions:>7}")


def print_comparison(name: str, cmp: dict) -> None:
    print(f"{name}: throughput on/off {cmp['throughput_ratio_on_off']:.2f}x, "
          f"prefill computed off/on {cmp['prefill_computed_ratio_off_on']:.2f}x, "
          f"ideal {cmp['ideal_speedup']:.2f}x (measured = {cmp['measured_over_ideal']:.0%} "
          f"of it), calibrated ideal {cmp['calibrated_ideal_speedup']:.2f}x "
          f"({cmp['measured_over_calibrated']:.0%}), mean TTFT off/on "
          f"{cmp['mean_ttft_ratio_off_on']:.2f}x, identical outputs {cmp['outputs_identical']}; "
          f"a perfect block cache would give {cmp['perfect_cache_speedup']:.2f}x")


# -- plots ----------------------------------------------------------------------------------
def write_plots(report: dict, plot_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    sections = [(name, report[key]) for name, key in
                (("shared prefix", "shared_prefix"), ("no reuse", "no_reuse")) if report.get(key)]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for i, (name, section) in enumerate(sections):
        off, on = section["off"]["output_tokens_per_s"], section["on"]["output_tokens_per_s"]
        bars = ax.bar([i - width / 2, i + width / 2], [off, on], width,
                      color=["#9e9e9e", "#1f77b4"], label=["caching off", "caching on"] if i == 0
                      else None)
        ax.bar_label(bars, fmt="%.1f")
    ax.set_xticks(range(len(sections)), [
        f"{name}\non/off {s['throughput_ratio_on_off']:.2f}x" for name, s in sections])
    ax.set_ylabel("output tokens/s")
    top = max(max(s["on"]["output_tokens_per_s"], s["off"]["output_tokens_per_s"])
              for _, s in sections)
    ax.set_ylim(0, top * 1.25)
    ax.set_title(f"Prefix caching off vs on\n{report['model'][:48]}, {report['device']}",
                 fontsize=10)
    ax.legend(loc="upper right")
    fig.tight_layout()
    path = plot_dir / "prefix_caching_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(str(path))

    sweep = report.get("block_size_sweep") or []
    if sweep:
        sizes = [r["block_size"] for r in sweep]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.plot(sizes, [r["output_tokens_per_s"] for r in sweep], "o-", label="caching on")
        off = report.get("shared_prefix", {}).get("off")
        if off:
            left.axhline(off["output_tokens_per_s"], color="#9e9e9e", ls="--",
                         label=f"caching off (bs {off['block_size']})")
        left.set_xscale("log", base=2)
        left.set_xticks(sizes, [str(s) for s in sizes])
        left.set_xlabel("block size (tokens)")
        left.set_ylabel("output tokens/s")
        left.set_ylim(bottom=0)
        left.legend()
        right.plot(sizes, [100 * r["hit_rate"] for r in sweep], "o-", label="hit rate")
        right.plot(sizes, [100 * r["kv_utilization"] for r in sweep], "s-",
                   label="KV utilisation")
        right.set_xscale("log", base=2)
        right.set_xticks(sizes, [str(s) for s in sizes])
        right.set_xlabel("block size (tokens)")
        right.set_ylabel("%")
        right.set_ylim(0, 105)
        right.legend()
        fig.suptitle("Block-size sweep, shared-prefix workload, caching on")
        fig.tight_layout()
        path = plot_dir / "prefix_caching_block_sizes.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths


# -- main ------------------------------------------------------------------------------------
def run_dict(run: Run) -> dict:
    data = asdict(run)
    data.pop("output_token_ids")
    return data


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.num_system_prompts < 1 or args.output_len < 1:
        parser.error("--num-requests, --num-system-prompts and --output-len must be >= 1")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    sweep_sizes = [int(s) for s in args.sweep_block_sizes.split(",") if s.strip()]
    config = config_from_args(args)

    from engine.model_runner import resolve_device, resolve_dtype
    from engine.models.loader import load_hf_config, resolve_model_path

    model_path = resolve_model_path(config.model, config.cache_dir)
    hf_config = load_hf_config(model_path)
    device = resolve_device(config)
    dtype = resolve_dtype(config, hf_config, device)
    vocab = hf_config.vocab_size
    shared = make_workload("shared", args.num_requests, args.num_system_prompts, args.system_len,
                           args.question_len, args.output_len, vocab, args.workload_seed,
                           args.assign)
    distinct = make_workload("distinct", args.num_requests, args.num_requests, args.system_len,
                             args.question_len, args.output_len, vocab, args.workload_seed + 1)
    started = time.perf_counter()
    total_runs = 2 + len(sweep_sizes) + (0 if args.skip_no_reuse else 2)
    progress = tqdm(total=total_runs, desc="bench prefix", unit="run")

    def run(cfg, workload, label):
        result = run_workload(cfg, workload, label, args.repeats)
        progress.update(1)
        return result

    def pair(workload, name):
        runs = run_interleaved([(config.replace(enable_prefix_caching=False),
                                 f"{name}, caching off"),
                                (config.replace(enable_prefix_caching=True),
                                 f"{name}, caching on")], workload, args.repeats)
        progress.update(2)
        return runs

    off, on = pair(shared, "shared")
    shared_cmp = compare(off, on, shared)
    bound = prefill_bound(shared, on)
    sweep = []
    for size in sweep_sizes:
        if size == on.block_size:  # already measured: the caching-on run above
            sweep.append(dataclasses.replace(on, label=f"sweep, bs {size} (= on)"))
            progress.update(1)
            continue
        sweep.append(run(config.replace(enable_prefix_caching=True, block_size=size), shared,
                         f"sweep, bs {size}"))
    no_reuse = None
    if not args.skip_no_reuse:
        d_off, d_on = pair(distinct, "no reuse")
        no_reuse = (d_off, d_on, compare(d_off, d_on, distinct))
    progress.close()
    elapsed = time.perf_counter() - started

    print(f"\nmodel {model_path.name}, dtype {dtype}, {device}, {torch.get_num_threads()} threads; "
          f"{args.num_requests} requests = {args.num_system_prompts} system prompts x "
          f"{args.system_len} tokens ({args.assign}) + questions of "
          f"{args.question_len[0]}-{args.question_len[1]} tokens, {args.output_len} output "
          f"tokens each; {shared.num_prompt_tokens} prompt tokens in all")
    print("cost model: time ~ prefill tokens computed + decode tokens "
          f"(D = N x (M-1) = {shared.num_decode_tokens})\n")
    print_runs([off, on])
    print_comparison("shared prefix", shared_cmp)
    verdict = "OK" if bound["ok"] else "NOT MET"
    print(f"prefill computed with caching {bound['computed_with_caching']} <= unique "
          f"{bound['unique_prompt_tokens']} + one block per request = {bound['limit']}: "
          f"{verdict} (ideal block-granular: {bound['ideal_prefill_tokens']})")
    if sweep:
        print("\nblock-size sweep (caching on, shared prefix; KV util = tokens held / slots "
              "allocated)")
        print_runs(sweep)
    if no_reuse:
        d_off, d_on, d_cmp = no_reuse
        print(f"\nno reuse ({args.num_requests} distinct prompts, "
              f"{distinct.num_prompt_tokens} prompt tokens)")
        print_runs([d_off, d_on])
        loss = 1 - d_cmp["throughput_ratio_on_off"]
        print(f"caching on/off throughput {d_cmp['throughput_ratio_on_off']:.3f}x "
              f"(loss {loss:.1%}, negative = faster; target under 2 %); engine time outside "
              f"the model: off {d_off.engine_seconds:.2f} s, on {d_on.engine_seconds:.2f} s, "
              f"added {d_cmp['engine_overhead_added']:.2%} of the run")
    print(f"\nbenchmark wall time {elapsed:.0f} s")

    report = {
        "model": model_path.name,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "wall_seconds": elapsed,
        "cost_model": "time ~ prefill tokens computed + decode tokens; "
                      "ideal_speedup = (P_off + D) / (P_on + D), D = N * (M - 1); "
                      "calibrated: T_on = decode-step s (off) + prefill-step s (off) * P_on / P_off",
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
        "shared_prefix": {"off": run_dict(off), "on": run_dict(on), **shared_cmp,
                          "prefill_bound": bound},
        "block_size_sweep": [
            {**run_dict(r), "ideal_prefill_tokens": ideal_prefill_tokens(shared.prompts,
                                                                         r.block_size)}
            for r in sweep
        ],
        "no_reuse": None,
    }
    if no_reuse:
        d_off, d_on, d_cmp = no_reuse
        report["no_reuse"] = {"off": run_dict(d_off), "on": run_dict(d_on), **d_cmp,
                              "prompt_tokens": distinct.num_prompt_tokens,
                              "loss": 1 - d_cmp["throughput_ratio_on_off"]}
    if not args.no_plots:
        plot_dir = args.plot_dir or (args.output.parent if args.output else Path("docs"))
        report["plots"] = write_plots(report, plot_dir)
        for path in report["plots"]:
            print(f"wrote {path}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
