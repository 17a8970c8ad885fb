"""Runner: what LLMEngine needs of whatever runs the model, and what a step gives back.

ModelRunner (engine/model/model_runner.py) is one, the tensor-parallel runner
(engine/model/distributed/executor.py) another. `LLMEngine(config,
runner=..., model_info=...)` takes any object of this shape and loads
nothing: the benchmarks' null model that "samples" fake tokens
(bench/common/null_engine.py) or a wrapper that times the real runner
(bench/offline/driver.py). What the engine must know of the model itself
(vocabulary, EOS ids, fingerprint, tokenizer) is not the runner's business:
see engine.model.model_info.ModelInfo.

The engine uses every member as it is, without probing for it: a runner with
nothing to do for one (a single process has no workers to stop, a null model
no K/V to copy) implements it trivially.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.sched_output import SchedulerOutput
from engine.model.prompt_logprobs import PromptChunk
from engine.sampling.sampler import SamplerOutput


@dataclass
class ModelRunnerOutput:
    # The sequence of each sampled row. With speculative decoding a sequence may
    # own several rows, in order: its accepted draft tokens, then its new token.
    seq_ids: list[int]
    sampled: SamplerOutput
    # Prompt logprobs its prefill chunk scored, by sequence (engine/model/prompt_logprobs.py).
    prompt_logprobs: dict[int, PromptChunk] = field(default_factory=dict)
    # A pooling step's answers (engine/model/pooling/): each sequence whose prompt
    # it completed, its pooled row (float32, on the host), instead of a sampled token.
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)


class Runner(Protocol):
    # KV blocks, the null block 0 included: the engine sizes its block manager from it.
    num_blocks: int
    # Where seeded requests' generators are made; on CUDA the offload tiers pin host memory.
    device: torch.device | str
    # The dtype the model runs in (in its fingerprint: a block computed in bfloat16
    # is no use to a float32 replica).
    dtype: torch.dtype
    # The dtype of its KV cache: `dtype`, or int8 (engine/model/kv_cache.py). In the
    # offload tiers' namespace and the service's prefix registry (an int8 block's
    # bytes are no float block's), and in the start-up log and /metrics.
    kv_cache_dtype: torch.dtype
    # The window every layer attends within (Mistral, Phi-3, Mixtral), or None: the
    # block manager then releases blocks that left it (free_outside_window).
    sliding_window: int | None
    # A model mixing sliding and global layers (Gemma 2/3): the sliding layers'
    # window and the blocks of their own KV pool (engine/model/kv_groups.py);
    # None and 0 for one pool.
    hybrid_window: int | None
    num_window_blocks: int

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: a sampled token for every sequence whose `sampling` is set."""

    @property
    def failure(self) -> str | None:
        """Why the runner cannot step even while idle (a tensor-parallel worker
        died), or None: LLMEngine.failure, which /health reports."""

    def close(self) -> None:
        """Release what the runner holds outside this process (worker processes);
        called by LLMEngine.close, safe to repeat."""

    def memory_per_rank(self) -> list[dict[str, int]]:
        """{"weights_bytes", "kv_cache_bytes"} of each tensor-parallel rank, in rank
        order: the service's memory metrics."""

    # -- LoRA adapters (engine/model/lora/; a runner built with enable_lora) --
    def add_lora(self, request) -> bytes:
        """Read and check an adapter (a LoRARequest) so that sequences whose
        lora_id is its lora_int_id can run; ValidationError if it does not fit.
        Returns its content's digest (what it adds to a first block's hash)."""

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; whether it was known."""

    def list_loras(self) -> list:
        """The LoRARequests of the adapters it knows."""

    # -- whole blocks as bytes, for the KV offload tiers (engine/core/kv_offload/) --
    def block_record_bytes(self) -> int:
        """Bytes of one block's K/V over all layers and ranks: a row of read_blocks,
        the payload an offload tier stores."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copies of the blocks' K/V: [len(block_ids), block_record_bytes()] uint8 on
        the CPU, taken now (the blocks may be reused right after)."""

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """The inverse of read_blocks: fill the blocks from rows of bytes."""
