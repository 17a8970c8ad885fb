"""Driving a real engine through a workload, one step at a time.

    engine = timed_engine(config)          # the model loaded, its runner timed
    warm_up(engine, small_workload)
    run = drive(engine, workload, "chat")  # every request added at t=0, stepped to the end
    run.engine_seconds, run.ttft, run.steps[i].kv.held, engine.runner.seconds

The benchmark steps the engine itself (rather than LLM.generate) so that it can
look at the engine between steps: what the running sequences hold in the KV
cache, whether the step prefilled, when each request got its first token. That
looking is not part of `engine_seconds`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.common.workload import Workload
from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.model.model_info import load_model
from engine.model.placement import resolve_device, resolve_dtype
from engine.model.models.loader import load_hf_config, resolve_model_path
from engine.model.runner import Runner
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput


@dataclass
class ModelUnderTest:
    """The model a benchmark runs, read before any engine loads it (workloads
    need its vocabulary, reports its name, dtype and device)."""

    config: EngineConfig  # max_model_len resolved
    path: Path
    hf_config: object
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


def model_under_test(config: EngineConfig) -> ModelUnderTest:
    path = resolve_model_path(config.model, config.cache_dir)
    hf_config = load_hf_config(path)
    config = config.resolve_max_model_len(hf_config.max_position_embeddings)
    device = resolve_device(config)
    return ModelUnderTest(config, path, hf_config, device, resolve_dtype(config, hf_config, device))


class TimingRunner:
    """A Runner around another that adds up the wall seconds of its execute()
    (batch preparation, forward, sampling); the rest of a step is the engine's.
    Everything else is the inner runner's."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.num_blocks = runner.num_blocks
        self.device = runner.device
        self.dtype, self.kv_cache_dtype = runner.dtype, runner.kv_cache_dtype
        self.sliding_window = runner.sliding_window
        self.hybrid_window = runner.hybrid_window
        self.num_window_blocks = runner.num_window_blocks
        self.seconds = 0.0

    def execute(self, output: SchedulerOutput):
        start = time.perf_counter()
        try:
            return self.runner.execute(output)
        finally:
            self.seconds += time.perf_counter() - start

    @property
    def failure(self) -> str | None:
        return self.runner.failure

    def close(self) -> None:
        """Close the runner inside (a tensor-parallel one stops its workers)."""
        self.runner.close()

    def memory_per_rank(self) -> list[dict[str, int]]:
        return self.runner.memory_per_rank()

    def block_record_bytes(self) -> int:
        return self.runner.block_record_bytes()

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.runner.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.runner.write_blocks(block_ids, data)


def timed_engine(config: EngineConfig) -> LLMEngine:
    """The model `config` names, behind a TimingRunner (engine.runner.seconds)."""
    config, model_info, runner = load_model(config)
    return LLMEngine(config, runner=TimingRunner(runner), model_info=model_info)


@dataclass
class KvSnapshot:
    """What the running sequences hold in the KV cache at one moment."""

    held: int  # tokens whose K/V are cached
    slots: int  # slots of the blocks in their tables (entries x block size)
    entries: int  # block-table entries
    distinct: int  # distinct blocks among them (< entries: blocks shared)
    running: int  # sequences with a block table


def kv_snapshot(engine: LLMEngine) -> KvSnapshot:
    block_size = engine.config.block_size
    held = entries = running = 0
    distinct: set[int] = set()
    for computed, table in engine.running_block_tables():
        held += min(computed, len(table) * block_size)
        entries += len(table)
        distinct.update(table)
        running += 1
    return KvSnapshot(held, entries * block_size, entries, len(distinct), running)


@dataclass
class Step:
    seconds: float  # engine.step()
    prefilled: bool  # it computed prompt tokens
    kv: KvSnapshot  # right after it


@dataclass
class Drive:
    outputs: list[RequestOutput]  # each request's last output, in workload order
    ttft: list[float]  # start -> the request's first token, in workload order
    steps: list[Step]
    engine_seconds: float  # inside add_request() and step() only
    wall_seconds: float  # start -> the last step, the looking in between included


def drive(engine: LLMEngine, workload: Workload, desc: str | None = None) -> Drive:
    """Add every request at t=0, then step until all are done (greedy, ignore_eos).
    `desc` names a progress bar; None shows none."""
    ids = [f"{workload.name}-{i}" for i in range(workload.num_requests)]
    first: dict[str, float] = {}
    last: dict[str, RequestOutput] = {}
    steps: list[Step] = []
    with tqdm(total=len(ids), desc=desc, unit="req", leave=False, disable=desc is None) as bar:
        start = time.perf_counter()
        for request_id, prompt, n in zip(ids, workload.prompts, workload.output_lens):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            engine.add_request(request_id, list(prompt), params)
        in_engine = time.perf_counter() - start
        computed = engine.stats()["prompt_tokens_computed"]
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            in_engine += now - step_start
            # Not timed: what the step did and what the cache holds after it.
            before, computed = computed, engine.stats()["prompt_tokens_computed"]
            steps.append(Step(now - step_start, computed > before, kv_snapshot(engine)))
            for output in outputs:
                if output.request_id not in first and output.outputs[0].token_ids:
                    first[output.request_id] = now - start
                if output.finished:
                    last[output.request_id] = output
                    bar.update(1)
        wall = time.perf_counter() - start
    outputs = [last[i] for i in ids]
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    return Drive(outputs, [first[i] for i in ids], steps, in_engine, wall)


def warm_up(engine: LLMEngine, workload: Workload) -> None:
    """A few requests through every code path once, then an empty prefix
    cache, so that the measured run neither pays first-call costs nor hits the
    warm-up's blocks."""
    drive(engine, workload)
    engine.reset_prefix_cache()
