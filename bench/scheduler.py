"""Scheduler overhead: the scheduler and block manager alone, with a null model.

    pagedserve bench scheduler [--steps 200] [--sizes 1,64,256,1024] [--output sched.json]

No model runs: a null runner "samples" a fake token for every sequence that
samples, so what is timed is the CPU work the engine does around the model
each step. Two levels are timed:

  scheduler   Scheduler.schedule() + Scheduler.update() with the fake tokens
              (plus finishing the sequences that reached max_tokens);
  engine      LLMEngine.step() with the null runner in place of ModelRunner:
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
import gc
import itertools
import json
import platform
import pstats
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model_runner import ModelRunnerOutput
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence

VOCAB_SIZE = 32_000
NULL_FINGERPRINT = b"\x00" * 32  # stands in for the model fingerprint in every block hash
MODES = ("scheduler", "engine")
CASES = ("decode", "admission")
TARGET_US = 1000.0  # the target: one step under 1 ms for 256 running sequences
TARGET_SEQS = 256


# -- the null model ----------------------------------------------------------------------
def fake_token(seq_id: int, position: int) -> int:
    """The token the null model samples at `position` of a sequence (never a special id)."""
    return 100 + (seq_id * 7919 + position * 31) % (VOCAB_SIZE - 100)


def sample(output: SchedulerOutput) -> dict[int, int]:
    return {
        s.seq_id: fake_token(s.seq_id, s.context_len)
        for s in output.sequences
        if s.sampling is not None
    }


class NullRunner:
    """ModelRunner's interface without a model: a fake token for each sequence that samples.

    The real runner lists decodes before prefills; the engine pairs tokens
    with sequences by id, so the null runner keeps the schedule's order and
    spends as little as it can.
    """

    device = "cpu"
    dtype = "null"

    def __init__(self) -> None:
        self.elapsed_ns = 0  # time spent in here, taken out of the step times

    def execute(self, output: SchedulerOutput):
        start = time.perf_counter_ns()
        seq_ids, tokens = [], []
        for s in output.sequences:
            if s.sampling is not None:
                seq_ids.append(s.seq_id)
                tokens.append(fake_token(s.seq_id, s.context_len))
        nones = [None] * len(tokens)
        result = ModelRunnerOutput(seq_ids, SamplerOutput(tokens, nones, list(nones)))
        self.elapsed_ns += time.perf_counter_ns() - start
        return result


def null_engine(config: EngineConfig):
    """An LLMEngine whose runner is the NullRunner: no weights, no tokenizer.

    Built around __init__ (which loads a model); the attributes are the ones
    LLMEngine.__init__ sets, and the smoke test catches any that go missing.
    """
    from engine.llm_engine import LLMEngine

    engine = LLMEngine.__new__(LLMEngine)
    engine.model_path = None
    engine.config = config
    engine.tokenizer = None
    engine.eos_token_ids = frozenset({2})
    engine.runner = NullRunner()
    engine.vocab_size = VOCAB_SIZE
    engine.block_manager = BlockManager(
        config.num_gpu_blocks_override, config.block_size,
        enable_caching=config.enable_prefix_caching,
    )
    engine.fingerprint = NULL_FINGERPRINT
    engine.scheduler = Scheduler(config, engine.block_manager)
    engine.requests = {}
    engine._seq_ids = itertools.count()
    engine.num_prompt_tokens = 0
    engine.num_generation_tokens = 0
    return engine


# -- drivers: the same workload through the scheduler alone or the whole engine -----------------
class SchedulerDriver:
    """Scheduler.schedule() + update() with fake tokens; finishes at max_tokens."""

    def __init__(self, config: EngineConfig) -> None:
        manager = BlockManager(config.num_gpu_blocks_override, config.block_size,
                               enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(config, manager)
        self._seq_ids = itertools.count()
        self.model_ns = 0  # time spent drawing the fake tokens, taken out of the step times

    def add(self, prompt: list[int], params: SamplingParams) -> None:
        seq_id = next(self._seq_ids)
        self.scheduler.add(Sequence(seq_id=seq_id, request_id=str(seq_id), index=0,
                                    prompt_token_ids=prompt, params=params,
                                    hash_extra=NULL_FINGERPRINT))

    def step(self) -> None:
        scheduler = self.scheduler
        output = scheduler.schedule()
        start = time.perf_counter_ns()
        sampled = sample(output)
        self.model_ns += time.perf_counter_ns() - start
        grew = scheduler.update(output, sampled)
        for seq in grew:
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, "length")


class EngineDriver:
    """LLMEngine.step() with the null runner."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = null_engine(config)
        self.scheduler = self.engine.scheduler
        self._request_ids = itertools.count()

    def add(self, prompt: list[int], params: SamplingParams) -> None:
        self.engine.add_request(f"r{next(self._request_ids)}", prompt, params)

    @property
    def model_ns(self) -> int:
        return self.engine.runner.elapsed_ns

    def step(self) -> None:
        self.engine.step()


# -- cases --------------------------------------------------------------------------------
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


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB_SIZE) for _ in range(n)]


def make_config(args, num_seqs: int, num_blocks: int, prefix_caching: bool,
                max_model_len: int) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        max_num_seqs=max(num_seqs, 1),
        max_num_batched_tokens=max(args.max_num_batched_tokens, num_seqs, args.block_size),
        max_model_len=max_model_len,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=prefix_caching,
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
        _prefill(driver)
    finally:
        scheduler.max_num_batched_tokens = budget
    if scheduler.waiting or len(scheduler.running) != num_running:
        raise RuntimeError(
            f"setup did not reach steady state: {len(scheduler.running)} running, "
            f"{len(scheduler.waiting)} waiting, expected {num_running} running"
        )


def _prefill(driver) -> None:
    scheduler = driver.scheduler
    for _ in range(1000):
        if not scheduler.waiting and all(
            seq.num_computed_tokens == seq.num_tokens - 1 for seq in scheduler.running
        ):
            break
        driver.step()


def timed_steps(driver, steps: int, before_step=None, profiler=None):
    """Run `steps` steps; per step: wall and CPU nanoseconds, sequences and tokens scheduled.

    The null model's own time (drawing the fake tokens) is taken out of both.
    """
    scheduler = driver.scheduler
    times, cpu_times, seqs, tokens = [], [], [], []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    original_schedule = scheduler.schedule
    last: list[SchedulerOutput] = []

    def schedule():  # keeps each step's output, to be counted outside the timed region
        output = original_schedule()
        last.append(output)
        return output

    scheduler.schedule = schedule
    try:
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
            model = driver.model_ns - model_start  # wall time: an estimate of its CPU time
            elapsed -= model
            cpu_elapsed = max(cpu_elapsed - model, 0)
            if profiler is not None:
                profiler.disable()
            times.append(elapsed)
            cpu_times.append(cpu_elapsed)
            output = last.pop()
            seqs.append(len(output.sequences))
            tokens.append(output.num_batched_tokens)
    finally:
        del scheduler.schedule
    return times, cpu_times, seqs, tokens


class Bursts:
    """The admission case's arrivals: --burst prompts whenever nobody is waiting.

    Each prompt is a shared system prompt (half of --prompt-len) and its own
    tokens, so with prefix caching on every prompt after the first burst hits.
    """

    def __init__(self, driver, args, rng: random.Random) -> None:
        self.driver, self.args, self.rng = driver, args, rng
        self.system = random_tokens(rng, args.prompt_len // 2)
        self.params = SamplingParams(temperature=0, ignore_eos=True,
                                     max_tokens=args.burst_output_len)
        self.add_ns: list[int] = []
        self.added = 0

    def arrive(self) -> None:
        if self.driver.scheduler.waiting:
            return
        args = self.args
        prompts = [self.system + random_tokens(self.rng, args.prompt_len - len(self.system))
                   for _ in range(args.burst)]
        start = time.perf_counter_ns()
        for prompt in prompts:
            self.driver.add(prompt, self.params)
        self.add_ns.append(time.perf_counter_ns() - start)
        self.added += args.burst

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


def run_case(case: Case, args, profiler=None) -> Result:
    rng = random.Random(args.seed)
    bs = args.block_size
    margin = bs + args.warmup + args.steps + 8  # tokens a decoding sequence grows by, and slack
    Driver = SchedulerDriver if case.mode == "scheduler" else EngineDriver
    long_params = SamplingParams(temperature=0, ignore_eos=True,
                                 max_tokens=args.warmup + args.steps + 2 * bs + 16)
    max_model_len = args.prompt_len + margin + bs
    prompt_lens = [args.prompt_len + i % bs for i in range(case.num_running)]
    num_blocks = 1 + sum(blocks_needed(n + margin, bs) for n in prompt_lens)
    if case.name == "admission":
        # three bursts' worth: two running (see the seats below) and a spare
        per_burst = blocks_needed(args.prompt_len + args.burst_output_len + 1, bs)
        num_blocks += 3 * args.burst * per_burst
    # Seats for two bursts, so that one can be admitted while the last one finishes.
    config = make_config(args, case.num_running + 2 * args.burst, num_blocks,
                         case.prefix_caching, max_model_len)
    driver = Driver(config)
    scheduler = driver.scheduler
    manager = scheduler.block_manager

    for n in prompt_lens:
        driver.add(random_tokens(rng, n), long_params)
    prefill_until_decoding(driver, case.num_running)

    bursts = Bursts(driver, args, rng) if case.name == "admission" else None
    before_step = bursts.arrive if bursts else None
    gc.collect()
    timed_steps(driver, args.warmup, before_step)
    preemptions_before = scheduler.num_preemptions
    queries_before, hits_before = manager.stats.queries, manager.stats.hits
    if bursts:
        bursts.start_counting()
    times, cpu_times, seqs, tokens = timed_steps(driver, args.steps, before_step, profiler)
    preemptions = scheduler.num_preemptions - preemptions_before
    queries = manager.stats.queries - queries_before
    hits = manager.stats.hits - hits_before
    if case.name == "decode":
        if preemptions or len(scheduler.running) != case.num_running or scheduler.waiting:
            raise RuntimeError(f"{case.label}: left steady state (preemptions={preemptions})")
        if any(n != case.num_running for n in seqs):
            raise RuntimeError(f"{case.label}: a step did not schedule every sequence")

    us = sorted(t / 1000 for t in times)
    cpu_us = sorted(t / 1000 for t in cpu_times)
    median = statistics.median(us)
    mean_seqs = statistics.fmean(seqs) if seqs else 0.0
    return Result(
        case=case.name,
        mode=case.mode,
        prefix_caching=case.prefix_caching,
        num_running=case.num_running,
        block_size=bs,
        prompt_len=args.prompt_len,
        steps=len(us),
        median_us=round(median, 2),
        p90_us=round(percentile(us, 0.9), 2),
        mean_us=round(statistics.fmean(us), 2),
        max_us=round(us[-1], 2),
        cpu_median_us=round(statistics.median(cpu_us), 2),
        cpu_p90_us=round(percentile(cpu_us, 0.9), 2),
        mean_seqs_per_step=round(mean_seqs, 2),
        mean_tokens_per_step=round(statistics.fmean(tokens), 2) if tokens else 0.0,
        us_per_seq=round(median / mean_seqs, 3) if mean_seqs else 0.0,
        num_blocks=num_blocks,
        preemptions=preemptions,
        admitted=bursts.admitted() if bursts else 0,
        add_us_per_seq=bursts.add_us_per_seq() if bursts else 0.0,
        prefix_cache_hit_rate=round(hits / queries, 4) if queries else 0.0,
    )


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


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
def print_table(results: list[Result]) -> None:
    header = (f"{'case':<10} {'mode':<9} {'cache':<5} {'running':>7} {'seqs/step':>9} "
              f"{'median us':>10} {'p90 us':>10} {'us/seq':>8} {'cpu med us':>10}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.case:<10} {r.mode:<9} {'on' if r.prefix_caching else 'off':<5} "
              f"{r.num_running:>7} {r.mean_seqs_per_step:>9.1f} {r.median_us:>10.1f} "
              f"{r.p90_us:>10.1f} {r.us_per_seq:>8.2f} {r.cpu_median_us:>10.1f}")
    for r in results:
        if r.case == "admission":
            print(f"admission {r.mode} caching={'on' if r.prefix_caching else 'off'}: "
                  f"{r.admitted} admitted, {r.mean_tokens_per_step:.0f} tokens/step, "
                  f"add {r.add_us_per_seq:.1f} us/prompt, hit rate {r.prefix_cache_hit_rate:.0%}")


def target_summary(results: list[Result]) -> dict:
    """The issue's target: a scheduler step under 1 ms for 256 running sequences."""
    rows = [r for r in results if r.case == "decode" and r.num_running == TARGET_SEQS]
    return {
        "target_us": TARGET_US,
        "num_running": TARGET_SEQS,
        "met": {f"{r.mode}/caching={'on' if r.prefix_caching else 'off'}": r.median_us < TARGET_US
                for r in rows},
    }


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, comma-separated")
    return values


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "block_size", "prompt_len", "burst", "burst_output_len",
                 "admission_running"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    cases = make_cases(args)
    profiler = cProfile.Profile() if args.profile else None
    results = []
    for case in tqdm(cases, desc="bench scheduler", unit="case"):
        results.append(run_case(case, args, profiler))
    print_table(results)
    report = {
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
    if profiler is not None:
        profiler.dump_stats(str(args.profile))
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
