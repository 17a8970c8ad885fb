"""The model runner: KV-cache tensors, batch preparation, forward, sampling.

It sees one thing per step, the scheduler's `SchedulerOutput`, and turns it
into the flat tensors the model wants:

    scheduled:  seq A decode (pos 9)   seq B prefill chunk (pos 0..3)   seq C decode (pos 4)
    reordered:  decodes first, then prefills (each attention kernel takes a contiguous slice)
    input_ids:  [ a9  c4 | b0 b1 b2 b3 ]
    positions:  [  9   4 |  0  1  2  3 ]
    slots:      [ table_A[9 // bs] * bs + 9 % bs, ... ]     where each new K/V row is written
    logits:     only at the last token of each sequence that samples this step
    sampling:   one SamplingRequest per such sequence (engine/model/sampling_batch.py)
                from the SchedulerOutput; the tokens it may not draw come from stopping

The KV cache is one tensor, [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
(int8 rows of head_dim + 2 with --kv-cache-dtype int8: engine/model/kv_cache.py);
layer i reads kv_cache[0][i] (K) and kv_cache[1][i] (V). A model mixing sliding
and global layers has two, one per KV-cache group (engine/model/kv_groups.py).

The flattening itself is engine/model/step_inputs.py: a header and one int64
payload, decoded into tensors by `run_step`. With tensor parallelism
(engine/model/distributed/) a ModelRunner holds one rank's slice of the model and
of the KV heads, and every rank runs `run_step` on the same encoded step.
"""

from __future__ import annotations

import logging
import os

import torch

from engine.config import EngineConfig
from engine.errors import ValidationError
from engine.model.lora.request import LoRARequest
from engine.model.cpu_allocator import (activations_from_heap, advise_huge_pages, keep_freed_memory,
                                        weights_on_huge_pages, zero_lazily)
from engine.model.cuda_graphs import DecodeGraphs
from engine.model.distributed.partition import Partition
from engine.model.kv_cache import KVLayout, as_bytes, check_cache_on_device, resolve_kv_cache_dtype
from engine.model.kv_groups import KVGroups
from engine.model.models.registry import model_class
from engine.model.layers.quantization import (LOAD_QUANTIZATIONS, check_load_quantization,
                                              pack_quant_linears)
from engine.model.models.loader import initialize_dummy_weights, iter_checkpoint
from engine.model.prompt_logprobs import prompt_logprob_rows
from engine.model.runner import ModelRunnerOutput
from engine.model.sampling_batch import build_sampling_batch
from engine.sampling.sampler import Sampler, SamplerOutput
from engine.sampling.speculative import verify
from engine.core.sched_output import SchedulerOutput
from engine.model.step_inputs import Op, decode_step, encode_step
from engine.model.step_launch import LaunchedStep, launch_step, ordered_rows
from engine.model.lora.manager import LoRAManager
from engine.model.pooling.pooler import pool, read_pooling_info
from engine.model.placement import resolve_device, resolve_dtype
from kernels import check_backend_support, get_backend

logger = logging.getLogger(__name__)

def shared_window(windows: tuple[int | None, ...]) -> int | None:
    """The window of a model whose every layer slides by the same one, else None: only then
    may a block that left it be released for all layers (Gemma's global layers read all)."""
    return windows[0] if windows and None not in windows and len(set(windows)) == 1 else None


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_path, eos_token_ids,
                 group=None) -> None:
        """`group`: the tensor-parallel group this runner is one rank of (None: no
        tensor parallelism); it then holds that rank's slice of the model."""
        self.config = config
        self.block_size = config.block_size
        self.group = group
        rank = group.rank if group is not None else 0
        self.device = resolve_device(config, rank)
        self.dtype = resolve_dtype(config, hf_config, self.device)
        # Before the weights load: a cache dtype the kernels cannot read fails at once.
        self.kv_cache_dtype = resolve_kv_cache_dtype(config, self.dtype)
        check_cache_on_device(self.kv_cache_dtype, torch.cuda.get_device_capability(self.device)
                              if self.device.type == "cuda" else None)
        self.kernels = get_backend(config.kernel_backend, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        size = group.size if group is not None else 1
        self.model_class = model_class(hf_config, size, config.runner, config.convert)
        args = self.model_class.model_args(hf_config)
        self.partition = Partition.of(args, rank, size)
        self.kv_layout = KVLayout(self.kv_cache_dtype, self.block_size,
                                  self.partition.num_kv_heads, args.head_dim)
        self.sliding_window = shared_window(args.sliding_windows)
        self.kv_groups = KVGroups.plan(args.sliding_windows, config)
        self.hybrid_window = self.kv_groups.window
        self.model = self._load_model(hf_config, model_path)
        self.lora = (LoRAManager(config, self.model, self.kernels, self.dtype, self.device)
                     if config.enable_lora else None)  # after loading: on the final modules
        check_backend_support(
            config.kernel_backend, config.block_size, args.head_dim, self.dtype, self.device
        )
        self.graphs = DecodeGraphs.for_runner(self)  # None: every step eager (CPU included)
        self.num_blocks, self.num_window_blocks = self._num_kv_blocks()
        self.kv_cache = self._new_cache(len(self.kv_groups.full_layers), self.num_blocks)
        self.window_cache = (self._new_cache(len(self.kv_groups.window_layers),
                                             self.num_window_blocks)
                             if self.kv_groups.hybrid else None)
        self.layer_caches = self.kv_groups.layer_caches(self.kv_cache, self.window_cache)
        if self.device.type == "cpu":
            activations_from_heap()  # the weights and the cache are in place (cpu_allocator says why)
        if self.graphs is not None:  # after the KV cache: the graphs hold its addresses
            self.graphs.capture(self.layer_caches)
        self.pooling = (read_pooling_info(model_path, self.model, min(
            config.max_model_len, config.max_num_batched_tokens))
            if config.runner == "pooling" else None)  # what a pooling step answers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampler = Sampler(args.vocab_size, seed=config.seed)

    # -- start-up -------------------------------------------------------------------
    def _load_model(self, hf_config, model_path) -> torch.nn.Module:
        # Built in the serving dtype: a bf16 model never exists in float32 first
        # (twice the memory at start-up; the copies below round as .to() would).
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            model = self.model_class(hf_config, self.config.max_model_len, self.kernels,
                                     self.partition, self.group)
        finally:
            torch.set_default_dtype(previous)
        if self.config.load_format == "dummy":
            initialize_dummy_weights(model, self.config.seed)
        else:
            slices = self.partition if self.group is not None else None  # None: whole tensors
            model.load_weights(iter_checkpoint(model_path, slices, hf_config))
        model = model.to(device=self.device, dtype=self.dtype).eval()
        self._check_quantization()
        if self.config.quantization in LOAD_QUANTIZATIONS:
            model.quantize_weights(check_load_quantization(self.config.quantization))
        model.pack_linear_weights()  # after quantizing: the layers it replaced stay as they are
        if self.device.type == "cpu":
            pack_quant_linears(model, self.kernels)
            weights_on_huge_pages(model)  # last: every weight is in its final layout
        return model

    def _check_quantization(self) -> None:
        """Quantized weights are multiplied by the compiled CPU op (on a GPU the
        reference would de-quantize every call: refused, not slow)."""
        quantization = self.config.quantization
        if quantization in (None, "none") or self.device.type == "cpu":
            return
        raise ValueError(f"quantization={quantization!r} runs on the CPU, not on {self.device}: "
                         "serve a GGUF de-quantized with --quantization none")

    def _new_cache(self, num_layers: int, num_blocks: int) -> torch.Tensor:
        cache = torch.empty(self.kv_layout.shape(num_layers, num_blocks),
                            dtype=self.kv_cache_dtype, device=self.device)
        if self.device.type != "cpu":
            return cache.zero_()
        advise_huge_pages(cache)  # before anything touches the pages
        # Touched now (a server: no page faults in its first requests) or as
        # blocks are first written (config.kv_cache_prefault says which).
        if self.config.kv_cache_prefault or not zero_lazily(cache):
            cache.zero_()
        return cache

    def layer_block_bytes(self) -> int:
        """One block's K and V of one layer, on this rank, in the cache's own bytes."""
        return self.kv_layout.layer_block_bytes()

    def bytes_per_block(self) -> int:
        """One block's K/V of every layer of the main pool, on this rank."""
        return len(self.kv_groups.full_layers) * self.layer_block_bytes()

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: the model's weights and its KV cache."""
        weights = sum(t.numel() * t.element_size()
                      for t in (*self.model.parameters(), *self.model.buffers()))
        caches = (self.kv_cache, self.window_cache) if self.kv_groups.hybrid else (self.kv_cache,)
        return {"weights_bytes": weights,
                "kv_cache_bytes": sum(c.numel() * c.element_size() for c in caches)}

    def memory_per_rank(self) -> list[dict[str, int]]:
        """memory() of every tensor-parallel rank, in rank order (here: this one)."""
        return [self.memory()]

    failure = None  # one process has no workers to lose (the tensor-parallel runner has)

    def close(self) -> None:
        """Nothing to stop in one process (the tensor-parallel runner stops its workers)."""

    def _num_kv_blocks(self) -> tuple[int, int]:
        """(main pool, window pool) blocks in the memory budget; refuse if one long sequence doesn't fit."""
        config, groups = self.config, self.kv_groups
        if config.num_gpu_blocks_override is not None:
            num_blocks, budget = config.num_gpu_blocks_override, "num_gpu_blocks_override"
            num_window = (config.num_window_blocks_override or num_blocks) if groups.hybrid else 0
        else:
            if self.device.type == "cuda":
                budget_bytes, budget = self._profile_cuda_bytes(), "gpu_memory_utilization"
            else:
                budget_bytes = config.kv_cache_memory_bytes
                budget = f"kv_cache_memory_bytes={budget_bytes}"
            num_blocks, num_window = groups.split(budget_bytes, self.layer_block_bytes(), config)
        if self.group is not None:  # every rank's cache has the same blocks: the smallest wins
            num_blocks, num_window = self.group.all_min(num_blocks), self.group.all_min(num_window)
        needed = -(-config.max_model_len // self.block_size) + 1  # + the null block
        if groups.hybrid:
            needed_window = min(needed, groups.window_blocks_per_sequence(config) + 1)
            if num_window < needed_window:
                needed, num_blocks = needed_window, num_window
        if num_blocks < needed:
            raise ValueError(
                f"KV cache too small: {budget} gives {num_blocks} blocks of "
                f"{self.block_size} tokens ({self.bytes_per_block()} bytes each), but one "
                f"max_model_len={config.max_model_len} sequence needs {needed} blocks. "
                f"Raise the KV budget or lower max_model_len.")
        return num_blocks, num_window

    @torch.inference_mode()
    def _profile_cuda_bytes(self) -> int:
        """total * utilisation - weights - peak activations: the KV cache's bytes."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        available = total * self.config.gpu_memory_utilization - used_by_others - peak
        if self.graphs is not None:  # the decode graphs' pool, captured after the KV cache
            available -= self.graphs.reserve_bytes()
        return max(int(available), 0)

    def _dummy_forward(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` tokens into a one-block scratch cache (slots -1)."""
        scratch = self.kv_layout.zeros(self.model.args.num_layers, 2, self.device)
        # No sequences, so attention itself is skipped; the rest runs at full size.
        header = [Op.STEP, num_tokens, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
        payload = [0] * (2 * num_tokens) + [-1] * num_tokens + [0, num_tokens - 1]
        inputs = decode_step(header, torch.tensor(payload, device=self.device))
        hidden = self.model(inputs.input_ids, inputs.positions, scratch, inputs.meta)
        self.model.compute_logits(hidden[inputs.sample_rows])

    # -- one step --------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.use_configured_threads()
        if self.pooling is not None:
            return self._execute_pooling(output)
        decodes, prefills = ordered_rows(output, self.lora is not None)
        batch = build_sampling_batch(decodes + prefills, self.eos_token_ids)
        prompt = prompt_logprob_rows(decodes + prefills)  # their rows follow the sampled ones
        header, payload = encode_step(decodes, prefills, batch.rows + prompt.rows,
                                      output.blocks_to_copy,
                                      self.block_size, output.window_blocks_to_copy)
        logits = self.run_step(header, self.share(header, payload.to(self.device)))
        logits, prompt_logprobs = prompt.split(logits, len(batch.rows))
        if not batch.rows:
            return ModelRunnerOutput([], SamplerOutput([], [], []), prompt_logprobs)
        if not batch.has_drafts:
            return ModelRunnerOutput(batch.seq_ids, self.sampler(logits, batch.requests),
                                     prompt_logprobs)
        owners, sampled = verify(self.sampler, logits, batch.drafted(self.eos_token_ids))
        return ModelRunnerOutput([batch.seq_ids[i] for i in owners], sampled, prompt_logprobs)

    def launch(self, output: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """A plain step queued on the device, its tokens read later (async scheduling:
        engine/model/step_launch.py); `previous`: the step still in flight."""
        return launch_step(self, output, previous)

    def _execute_pooling(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """A pooling step: the hidden states of every scheduled prompt, pooled per
        sequence whose prompt the step completes (engine/model/pooling/pooler.py)."""
        decodes, prefills = ordered_rows(output, False)  # a pooling runner has no LoRA
        header, payload = encode_step(decodes, prefills, [], output.blocks_to_copy,
                                      self.block_size, output.window_blocks_to_copy)
        inputs = decode_step(header, payload.to(self.device))
        if inputs.copy_sources.numel():
            self._copy_blocks(self.kv_cache, inputs.copy_sources, inputs.copy_destinations)
        hidden = self.model(inputs.input_ids, inputs.positions, self.layer_caches, inputs.meta)
        spans, seq_ids, offset = [], [], 0
        for s in decodes + prefills:
            if s.context_len == len(s.prompt_token_ids):
                spans.append((offset, s.num_new_tokens))
                seq_ids.append(s.seq_id)
            offset += s.num_new_tokens
        if not spans:
            return ModelRunnerOutput([], SamplerOutput([], [], []))
        pooled = pool(hidden, spans, self.pooling.pooling_type)
        if self.pooling.task == "classify":  # the head, in the model's dtype
            pooled = self.model.classify(pooled.to(hidden.dtype)).float()
        return ModelRunnerOutput([], SamplerOutput([], [], []),
                                 pooled=dict(zip(seq_ids, pooled.cpu())))

    # -- LoRA adapters (engine/model/lora/) -------------------------------------------
    def add_lora(self, request: LoRARequest) -> bytes:
        """Read and check an adapter so that requests can run under it; its digest."""
        return self._lora_manager().add(request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self._lora_manager().list()

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValidationError("this engine serves no LoRA adapters: start it with "
                                  "enable_lora (--enable-lora)", "model")
        return self.lora

    def share(self, header: list[int], payload: torch.Tensor) -> torch.Tensor:
        """Hand the encoded step to the other ranks (none: distributed/executor.py broadcasts it)."""
        return payload

    @torch.inference_mode()
    def run_step(self, header: list[int], payload: torch.Tensor) -> torch.Tensor | None:
        """The forward pass of an encoded step (engine/model/step_inputs.py), on every
        rank alike: the logits of its sampled rows (None when nothing samples,
        and on the ranks other than 0)."""
        inputs = decode_step(header, payload)
        if self.lora is not None:
            self.lora.prepare(inputs.lora_ids)  # every rank maps the adapters to its slots alike
        if inputs.copy_sources.numel():
            self._copy_blocks(self.kv_cache, inputs.copy_sources, inputs.copy_destinations)
        if inputs.window_copies is not None and inputs.window_copies.numel():
            pairs = inputs.window_copies
            self._copy_blocks(self.window_cache, pairs[:, 0], pairs[:, 1])
        hidden = self.graphs.run(header, inputs) if self.graphs is not None else None
        if hidden is None:  # not a decode-only step a graph holds (engine/model/cuda_graphs.py)
            hidden = self.model(inputs.input_ids, inputs.positions, self.layer_caches,
                                inputs.meta)
        if not inputs.sample_rows.numel():
            return None
        if not header[6] == header[1] == header[2]:  # else every row is a decode that samples, in order
            hidden = hidden[inputs.sample_rows]
        return self.model.compute_logits(hidden)

    def use_configured_threads(self) -> None:
        """Apply --num-threads in whichever thread steps the engine: an OpenMP
        thread count belongs to the calling thread, and the serving engine
        steps in its own thread. Fewer threads than cores leave a core to the
        HTTP side; on the 2-core CPU one serving stream decoded at 19.9 ms per
        token with 1 thread and 36.0 ms with 2, which stalled whenever the
        event loop or the client took a core (docs/performance.md)."""
        wanted = self.config.num_threads or self._threads_per_rank()
        if wanted and self.device.type == "cpu" and torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def _threads_per_rank(self) -> int:
        """Tensor-parallel ranks on the CPU share its cores: by default each
        takes its share (0, torch's default, for a single rank)."""
        size = self.partition.size
        if size == 1 or self.device.type != "cpu":
            return 0
        return max(1, len(os.sched_getaffinity(0)) // size)

    @staticmethod
    def _copy_blocks(cache: torch.Tensor, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy on write: K and V of every layer from each source block to its destination."""
        # cache: [2, layers, blocks, ...] -> copy along the blocks dimension.
        cache = as_bytes(cache)
        cache.index_copy_(2, destination, cache.index_select(2, source))

    # -- whole blocks as bytes, for the offload tiers (engine/core/kv_offload/) ------------------
    def block_record_bytes(self) -> int:
        """One block's K/V over all tensor-parallel ranks: what read_blocks returns
        per block, and what an offload tier stores."""
        return self.bytes_per_block() * self.partition.size

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copies of blocks' K/V, all layers: [n, block_record_bytes] uint8 on the CPU.

        Each row is one block laid out [2 (K, V), layers, block_size, kv_heads,
        head_dim] in the cache's dtype (int8 rows: kernels/kv_quant.py): the record
        one tier value holds (pinned on CUDA, so the copy out is a DMA the host can
        read as soon as it is done)."""
        return self.to_host(self.block_rows(block_ids))

    def block_rows(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's K/V of the blocks as rows of bytes, on the device."""
        index = self._tensor(block_ids)
        blocks = as_bytes(self.kv_cache).index_select(2, index).permute(2, 0, 1, 3, 4, 5)
        return blocks.contiguous().view(len(block_ids), -1).view(torch.uint8)

    def to_host(self, rows: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return rows
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        return host.copy_(rows)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """The inverse of read_blocks: fill blocks with rows of bytes."""
        shape = (len(block_ids), *self.kv_cache.shape[:2], *self.kv_cache.shape[3:])
        cache = as_bytes(self.kv_cache)
        blocks = data.to(self.device, non_blocking=True).view(cache.dtype).view(shape)
        cache.index_copy_(2, self._tensor(block_ids), blocks.permute(1, 2, 0, 3, 4, 5))

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)
