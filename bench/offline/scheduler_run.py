"""One case of `bench scheduler`: set up, warm up, time the steps.

The cases and what each measures are described in bench/offline/scheduler.py.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field

from bench.common.null_engine import VOCAB_SIZE, EngineDriver, SchedulerDriver
from bench.common.report import percentile
from bench.common.workload import Workload, random_tokens
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams


@dataclass
class Case:
    name: str  # "decode" | "admission"
    num_running: int  # sequences decoding in steady state
    prefix_caching: bool
    mode: str  # "scheduler" | "engine"

    @property
    def label(self) -> str:
        caching = "on" if self.prefix_caching else "off"
        return f"{self.name} n={self.num_running} caching={caching} {self.mode}"


@dataclass
class Result:
    case: str
    mode: str
    prefix_caching: bool
    num_running: int
    block_size: int
    prompt_len: int
    steps: int
    median_us: float
    p90_us: float
    mean_us: float
    max_us: float
    # The same steps in CPU time of this thread: steadier than wall time where
    # other processes share the cores (a descheduled step does not count).
    cpu_median_us: float
    cpu_p90_us: float
    mean_seqs_per_step: float  # sequences scheduled per timed step
    mean_tokens_per_step: float  # tokens scheduled per timed step
    us_per_seq: float  # median_us / mean_seqs_per_step
    num_blocks: int
    preemptions: int  # during the timed steps (0 for decode: checked)
    admitted: int = 0  # admission: new sequences admitted during the timed steps
    add_us_per_seq: float = 0.0  # admission: Scheduler.add / add_request, per prompt
    prefix_cache_hit_rate: float = 0.0  # prompt tokens found cached, over the timed steps


@dataclass
class Timings:
    """Per timed step: wall and thread-CPU nanoseconds, sequences and tokens scheduled."""

    wall_ns: list[int] = field(default_factory=list)
    cpu_ns: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# -- setup ----------------------------------------------------------------------------------
def steady_workload(case: Case, args, rng: random.Random) -> Workload:
    """The sequences that decode throughout: prompts of --prompt-len + (i mod
    block size) tokens, so block boundaries spread evenly over the steps, and
    enough max_tokens that none finishes while it is timed."""
    bs = args.block_size
    max_tokens = args.warmup + args.steps + 2 * bs + 16
    prompts = [random_tokens(rng, args.prompt_len + i % bs, VOCAB_SIZE)
               for i in range(case.num_running)]
    return Workload(f"steady-{case.num_running}", prompts, [max_tokens] * case.num_running)


def case_config(case: Case, args, steady: Workload) -> EngineConfig:
    """KV blocks for every steady sequence to grow to its max_tokens (none is
    preempted, and admission's headroom for that growth is there) and, for
    admission, three bursts' worth: two running (seats for two bursts, so one
    is admitted while the last one finishes) and a spare."""
    bs = args.block_size
    margin = bs + max(steady.output_lens, default=0) + 8  # tokens a decoding sequence grows by, and slack
    num_blocks = 1 + sum(blocks_needed(len(p) + margin, bs) for p in steady.prompts)
    if case.name == "admission":
        num_blocks += 3 * args.burst * blocks_needed(args.prompt_len + args.burst_output_len + 1, bs)
    num_seqs = case.num_running + 2 * args.burst
    return EngineConfig(
        block_size=bs,
        max_num_seqs=max(num_seqs, 1),
        max_num_batched_tokens=max(args.max_num_batched_tokens, num_seqs, bs),
        max_model_len=args.prompt_len + margin + bs,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=case.prefix_caching,
        device="cpu",
    )


def prefill_until_decoding(driver, num_running: int) -> None:
    """Step (untimed) until every sequence is admitted and decoding.

    The token budget is lifted meanwhile, so that every prompt is prefilled in
    one step and all sequences start decoding together (none grows, or
    finishes, while the others are still being prefilled).
    """
    scheduler = driver.scheduler
    budget = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = 1 << 40
    try:
        for _ in range(1000):
            if not scheduler.waiting and all(
                seq.num_computed_tokens == seq.num_tokens - 1 for seq in scheduler.running
            ):
                break
            driver.step()
    finally:
        scheduler.max_num_batched_tokens = budget
    if scheduler.waiting or len(scheduler.running) != num_running:
        raise RuntimeError(
            f"setup did not reach steady state: {len(scheduler.running)} running, "
            f"{len(scheduler.waiting)} waiting, expected {num_running} running"
        )


class Bursts:
    """The admission case's arrivals: --burst prompts whenever nobody is waiting.

    Each prompt is a shared system prompt (half of --prompt-len) and its own
    tokens, so with prefix caching on every prompt after the first burst hits.
    """

    def __init__(self, driver, args, rng: random.Random) -> None:
        self.driver, self.args, self.rng = driver, args, rng
        self.system = random_tokens(rng, args.prompt_len // 2, VOCAB_SIZE)
        self.params = greedy(args.burst_output_len)
        self.add_ns: list[int] = []
        self.added = 0

    def arrive(self) -> None:
        if self.driver.scheduler.waiting:
            return
        question_len = self.args.prompt_len - len(self.system)
        prompts = [self.system + random_tokens(self.rng, question_len, VOCAB_SIZE)
                   for _ in range(self.args.burst)]
        start = time.perf_counter_ns()
        for prompt in prompts:
            self.driver.add(prompt, self.params)
        self.add_ns.append(time.perf_counter_ns() - start)
        self.added += len(prompts)

    def start_counting(self) -> None:
        """From here on: those still waiting and those added later count as admissions."""
        self.add_ns.clear()
        self.added = len(self.driver.scheduler.waiting)

    def admitted(self) -> int:
        return self.added - len(self.driver.scheduler.waiting)

    def add_us_per_seq(self) -> float:
        if not self.add_ns:
            return 0.0
        return round(sum(self.add_ns) / 1000 / (len(self.add_ns) * self.args.burst), 2)


# -- timing ---------------------------------------------------------------------------------
def timed_steps(driver, steps: int, before_step=None, profiler=None) -> Timings:
    """Run `steps` steps, timing each; the null model's own time is taken out.
    The step's SchedulerOutput is counted after the clock stops."""
    timings = Timings()
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for _ in range(steps):
        if before_step is not None:
            before_step()
        if profiler is not None:
            profiler.enable()
        model_start = driver.model_ns
        cpu_start = cpu_clock()
        start = clock()
        driver.step()
        elapsed = clock() - start
        cpu_elapsed = cpu_clock() - cpu_start
        if profiler is not None:
            profiler.disable()
        model = driver.model_ns - model_start  # wall time: an estimate of its CPU time
        timings.wall_ns.append(elapsed - model)
        timings.cpu_ns.append(max(cpu_elapsed - model, 0))
        output = driver.take_output()
        timings.seqs.append(len(output.sequences))
        timings.tokens.append(output.num_batched_tokens)
    return timings


def run_case(case: Case, args, profiler=None) -> Result:
    rng = random.Random(args.seed)
    steady = steady_workload(case, args, rng)
    config = case_config(case, args, steady)
    driver = (SchedulerDriver if case.mode == "scheduler" else EngineDriver)(config)
    for prompt, max_tokens in zip(steady.prompts, steady.output_lens):
        driver.add(prompt, greedy(max_tokens))
    prefill_until_decoding(driver, case.num_running)
    bursts = Bursts(driver, args, rng) if case.name == "admission" else None
    before_step = bursts.arrive if bursts else None
    gc.collect()
    timed_steps(driver, args.warmup, before_step)
    if bursts:
        bursts.start_counting()
    counters = _counters(driver.scheduler)
    timings = timed_steps(driver, args.steps, before_step, profiler)
    delta = {k: v - counters[k] for k, v in _counters(driver.scheduler).items()}
    if case.name == "decode":
        _check_steady(case, driver.scheduler, delta["preemptions"], timings)
    return _result(case, args, config, timings, delta, bursts)


def _counters(scheduler) -> dict[str, int]:
    stats = scheduler.block_manager.stats
    return {"preemptions": scheduler.num_preemptions, "queries": stats.queries,
            "hits": stats.hits}


def _check_steady(case: Case, scheduler, preemptions: int, timings: Timings) -> None:
    if preemptions or len(scheduler.running) != case.num_running or scheduler.waiting:
        raise RuntimeError(f"{case.label}: left steady state (preemptions={preemptions})")
    if any(n != case.num_running for n in timings.seqs):
        raise RuntimeError(f"{case.label}: a step did not schedule every sequence")


def _result(case: Case, args, config: EngineConfig, timings: Timings, delta: dict,
            bursts: Bursts | None) -> Result:
    us = sorted(t / 1000 for t in timings.wall_ns)
    cpu_us = [t / 1000 for t in timings.cpu_ns]
    median = statistics.median(us)
    mean_seqs = statistics.fmean(timings.seqs) if timings.seqs else 0.0
    queries = delta["queries"]
    return Result(
        case=case.name,
        mode=case.mode,
        prefix_caching=case.prefix_caching,
        num_running=case.num_running,
        block_size=args.block_size,
        prompt_len=args.prompt_len,
        steps=len(us),
        median_us=round(median, 2),
        p90_us=round(percentile(us, 90), 2),
        mean_us=round(statistics.fmean(us), 2),
        max_us=round(us[-1], 2),
        cpu_median_us=round(statistics.median(cpu_us), 2),
        cpu_p90_us=round(percentile(cpu_us, 90), 2),
        mean_seqs_per_step=round(mean_seqs, 2),
        mean_tokens_per_step=round(statistics.fmean(timings.tokens), 2) if timings.tokens else 0.0,
        us_per_seq=round(median / mean_seqs, 3) if mean_seqs else 0.0,
        num_blocks=config.num_gpu_blocks_override,
        preemptions=delta["preemptions"],
        admitted=bursts.admitted() if bursts else 0,
        add_us_per_seq=bursts.add_us_per_seq() if bursts else 0.0,
        prefix_cache_hit_rate=round(delta["hits"] / queries, 4) if queries else 0.0,
    )
