"""The runs of `bench prefix`: one workload on fresh engines, caching off or on.

Each engine's runner is a TimingRunner (bench/offline/driver.py), passed in through
LLMEngine's runner seam, so a run splits its time into the model runner's
(batch preparation, forward, sampling) and the engine's own (add_request,
scheduling, cache lookups, hashing, outputs): caching's bookkeeping shows in
the second, far less noisy than the throughput ratio.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass, field

from bench.common.report import percentile
from bench.common.workload import Workload, shared_prefix_workload
from bench.offline.driver import Drive, drive, timed_engine, warm_up

STAT_KEYS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed",
             "evictions", "num_preemptions")


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
    runner_seconds: float  # inside the runner's execute (batch preparation, forward, sampling)
    engine_seconds: float  # the rest: add_request, scheduling, cache lookups, hashing, outputs
    num_steps: int
    attempt_seconds: list[float] = field(default_factory=list)  # every timed run (--repeats)
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)


def run_interleaved(settings, workload: Workload, repeats: int = 1) -> list[Run]:
    """One fresh engine per (config, label); their timed runs alternate, best kept.

    Alternating off, on, on, off, ... spreads the drifts of a shared machine over
    both sides of a comparison instead of charging them to whichever ran second.
    """
    engines = []
    try:
        for config, _ in settings:
            engine = timed_engine(config)
            warm_up(engine, shared_prefix_workload("warm-up", 2, 2, 24, (4, 4), 2,
                                                   engine.vocab_size, seed=-1))
            engines.append(engine)
        attempts: list[list[Run]] = [[] for _ in settings]
        for attempt in range(repeats):
            order = range(len(settings)) if attempt % 2 == 0 else reversed(range(len(settings)))
            for i in order:
                engines[i].reset_prefix_cache()
                label = settings[i][1]
                tag = label if repeats == 1 else f"{label} [{attempt + 1}/{repeats}]"
                attempts[i].append(timed_run(engines[i], workload, tag))
        return [_best(runs, label) for (_, label), runs in zip(settings, attempts)]
    finally:
        del engines
        gc.collect()


def _best(runs: list[Run], label: str) -> Run:
    best = min(runs, key=lambda r: r.seconds)
    best.label = label
    best.attempt_seconds = [r.seconds for r in runs]
    return best


def engine_stats(engine) -> dict[str, int]:
    values = engine.stats()
    return {key: int(values.get(key, 0)) for key in STAT_KEYS}


def timed_run(engine, workload: Workload, label: str) -> Run:
    before, runner_before = engine_stats(engine), engine.runner.seconds
    run = drive(engine, workload, label)
    runner_seconds = engine.runner.seconds - runner_before
    after = engine_stats(engine)
    delta = {key: after[key] - before[key] for key in STAT_KEYS}
    queries, hits = delta["prefix_cache_queries"], delta["prefix_cache_hits"]
    return Run(
        label=label,
        prefix_caching=engine.config.enable_prefix_caching,
        block_size=engine.config.block_size,
        seconds=run.wall_seconds,
        output_tokens_per_s=workload.num_output_tokens / run.wall_seconds,
        requests_per_s=workload.num_requests / run.wall_seconds,
        prefill_tokens_computed=delta["prompt_tokens_computed"],
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        hit_rate=hits / queries if queries else 0.0,
        cached_tokens_reported=sum(o.num_cached_tokens for o in run.outputs),
        mean_ttft_s=statistics.fmean(run.ttft),
        p90_ttft_s=percentile(run.ttft, 90),
        **_kv_means(run),
        evictions=delta["evictions"],
        preemptions=delta["num_preemptions"],
        prefill_step_seconds=sum(s.seconds for s in run.steps if s.prefilled),
        decode_step_seconds=sum(s.seconds for s in run.steps if not s.prefilled),
        runner_seconds=runner_seconds,
        engine_seconds=run.engine_seconds - runner_seconds,
        num_steps=len(run.steps),
        output_token_ids=[list(o.outputs[0].token_ids) for o in run.outputs],
    )


def _kv_means(run: Drive) -> dict[str, float]:
    """Mean over the steps after which the running sequences held any block."""
    samples = [s.kv for s in run.steps if s.kv.entries]
    if not samples:
        return {"kv_utilization": 0.0, "kv_sharing": 1.0}
    return {
        "kv_utilization": statistics.fmean(kv.held / kv.slots for kv in samples),
        "kv_sharing": statistics.fmean(kv.entries / kv.distinct for kv in samples),
    }
