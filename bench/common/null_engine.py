"""A null model for `bench scheduler`, and the two drivers it is timed through.

    SchedulerDriver(config)   Scheduler.schedule() + update() with fake tokens
    EngineDriver(config)      LLMEngine.step() around the NullRunner

The NullRunner satisfies engine.model.model_runner.Runner, so the engine is built
through its seam (LLMEngine(config, runner=..., model_info=...)): no weights,
no tokenizer. It "samples" a fake token for every sequence that samples, keeps
the step's SchedulerOutput for the driver to count, and adds up its own time,
which the benchmark takes out of each step.
"""

from __future__ import annotations

import itertools
import time

import torch

from bench.common.workload import FIRST_TOKEN
from engine.core.block_manager import BlockManager
from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.model.model_info import ModelInfo
from engine.model.runner import ModelRunnerOutput
from engine.sampling.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence

VOCAB_SIZE = 32_000
# The model as the engine sees it: a fixed fingerprint stands in for the weights
# in every block hash; EOS is a special id the fake tokens never hit.
NULL_MODEL = ModelInfo(vocab_size=VOCAB_SIZE, eos_token_ids=frozenset({2}))


def fake_token(seq_id: int, position: int) -> int:
    """The token the null model samples at `position` of a sequence (never a special id)."""
    return FIRST_TOKEN + (seq_id * 7919 + position * 31) % (VOCAB_SIZE - FIRST_TOKEN)


def make_scheduler(config: EngineConfig) -> Scheduler:
    manager = BlockManager(config.num_gpu_blocks_override, config.block_size,
                           enable_caching=config.enable_prefix_caching)
    return Scheduler(config, manager)


class NullRunner:
    """A Runner without a model. The real runner lists decodes before prefills;
    the engine pairs tokens with sequences by id, so this one keeps the
    schedule's order and spends as little as it can."""

    device = "cpu"
    dtype = kv_cache_dtype = torch.float32  # nominal: there are no weights and no K/V
    failure = None  # no workers to lose
    sliding_window = None  # full attention: every block stays needed
    hybrid_window, num_window_blocks = None, 0  # one KV pool

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.elapsed_ns = 0  # time spent in here
        self.last: SchedulerOutput | None = None  # the last step it ran

    def close(self) -> None:
        """Nothing to stop."""

    def memory_per_rank(self) -> list[dict[str, int]]:
        return [{"weights_bytes": 0, "kv_cache_bytes": 0}]

    # No K/V: a block's record for the offload tiers is empty.
    def block_record_bytes(self) -> int:
        return 0

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return torch.empty(len(block_ids), 0, dtype=torch.uint8)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        pass

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter_ns()
        self.last = output
        seq_ids, tokens = [], []
        for s in output.sequences:
            if s.sampling is not None:
                seq_ids.append(s.seq_id)
                tokens.append(fake_token(s.seq_id, s.context_len))
        nones = [None] * len(tokens)
        result = ModelRunnerOutput(seq_ids, SamplerOutput(tokens, nones, list(nones)))
        self.elapsed_ns += time.perf_counter_ns() - start
        return result


class SchedulerDriver:
    """Scheduler.schedule() + update() with fake tokens; finishes at max_tokens."""

    def __init__(self, config: EngineConfig) -> None:
        self.scheduler = make_scheduler(config)
        self._seq_ids = itertools.count()
        self.model_ns = 0  # time spent drawing the fake tokens, taken out of the step times
        self._last = SchedulerOutput()

    def add(self, prompt: list[int], params: SamplingParams) -> None:
        seq_id = next(self._seq_ids)
        self.scheduler.add(Sequence(seq_id=seq_id, request_id=str(seq_id), index=0,
                                    prompt_token_ids=prompt, params=params,
                                    hash_extra=NULL_MODEL.fingerprint))

    def step(self) -> None:
        scheduler = self.scheduler
        output = self._last = scheduler.schedule()
        start = time.perf_counter_ns()
        sampled = {s.seq_id: fake_token(s.seq_id, s.context_len)
                   for s in output.sequences if s.sampling is not None}
        self.model_ns += time.perf_counter_ns() - start
        for seq in scheduler.update(output, sampled):
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, "length")

    def take_output(self) -> SchedulerOutput:
        """The last step's SchedulerOutput."""
        return self._last


class EngineDriver:
    """LLMEngine.step() with the NullRunner."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = NullRunner(config.num_gpu_blocks_override)
        self.engine = LLMEngine(config, runner=self.runner, model_info=NULL_MODEL,
                                scheduler=make_scheduler(config))
        self.scheduler = self.engine.scheduler
        self._request_ids = itertools.count()

    def add(self, prompt: list[int], params: SamplingParams) -> None:
        self.engine.add_request(f"r{next(self._request_ids)}", prompt, params)

    @property
    def model_ns(self) -> int:
        return self.runner.elapsed_ns

    def step(self) -> None:
        self.engine.step()

    def take_output(self) -> SchedulerOutput:
        """The last step's SchedulerOutput, as the runner saw it (a step that
        scheduled nothing never reaches the runner)."""
        output, self.runner.last = self.runner.last, None
        return output or SchedulerOutput()
