"""CUDA graphs for the decode step: the model's forward captured once per padded
batch size, replayed for a decode-only step instead of ~30 kernel launches per
layer from Python.

    capture sizes   1 2 4 8 16 24 32 ... (every 8), up to the first that holds
                    max_num_seqs, at most 512 (vLLM's list and cap)
    static inputs   input_ids, positions, slot_mapping [S]; decode block tables [S, W];
                    context lens [S]  (+ the window pool's slots and tables for a hybrid
                    model); S the largest size, W = min(max_model_len,
                    MAX_SEQ_LEN_TO_CAPTURE) / block_size, rounded up
    a step of n     rows [:n] filled in place, rows [n:size] neutralised, replay the
    decodes         graph of size = the smallest captured size >= n, read rows [:n]

    rows:      | d0 | d1 | d2 | pad |        n = 3, size 4
    slots:     | s0 | s1 | s2 |  -1 |        -1: the K/V store writes nothing
    lens:      | l0 | l1 | l2 |   0 |        0: attention reads no key (output 0)

Stale values stay where nothing reads them: a padded row's token id and
position (valid ones from an earlier step: the embedding and RoPE lookups stay
in range) and its block-table row, and a real row's table entries past its own
width (the kernel reads a table entry only for a token below the context length).

What runs eager (the model's own forward, as without graphs):
- anything but a decode-only step: prefill chunks, mixed steps, speculative
  steps (a drafted sequence has several query rows: the prefill path);
- more decodes than the largest captured size, or a sequence longer than
  MAX_SEQ_LEN_TO_CAPTURE (vLLM's max_seq_len_to_capture, 8192: the graphs'
  block tables are that wide, which also bounds the split-KV partitions a
  captured decode runs: the Triton wrapper picks them from the table's width,
  a shape, so the choice is fixed at capture);
- whole runners, logged once at start-up (`eager_reason`): not CUDA,
  `--enforce-eager`, the torch reference kernels (they sync with the host),
  tensor parallelism (NCCL all-reduce inside a graph is not done here), and
  mixture-of-experts models (the Triton fused MoE sorts tokens by expert
  with torch.bincount, which reads its maximum back to the host).
Hybrid models (Gemma 2/3's sliding layers in a pool of their own) are captured,
with the window pool's slots and tables as two more static inputs.

Only the forward is captured; the LM head (the sampled rows' logits) and the
sampler run after it, eagerly, on the graph's output rows.

Memory: the graphs are captured after the KV cache is allocated, largest size
first, into one shared pool (torch.cuda.graph_pool_handle()), so the smaller
graphs reuse the largest one's intermediates. The KV budget leaves room for
that pool: `reserve_bytes` runs one eager decode of the largest size before
the KV cache exists and counts its peak allocation, plus every graph's output
and a margin; the capture logs the pool it really took.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time

import torch

from engine.model.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's largest captured batch
MAX_SEQ_LEN_TO_CAPTURE = 8192  # vLLM's max_seq_len_to_capture default
RESERVE_MARGIN_BYTES = 64 << 20  # the allocator's rounding, cuBLAS workspaces in the pool


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, then every 8, up to the first size that holds max_num_seqs
    (every batch the scheduler can form fits one), never past `cap`."""
    sizes = [1, 2, 4] + list(range(8, cap + 1, 8))
    wanted = min(max_num_seqs, cap)
    top = next(s for s in sizes if s >= wanted)
    return [s for s in sizes if s <= top]


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest captured size that holds n rows (None: more than the largest)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if n >= 1 and i < len(sizes) else None


def max_blocks_to_capture(max_model_len: int, block_size: int) -> int:
    """The static block tables' width: the blocks of the longest sequence a graph serves."""
    return -(-min(max_model_len, MAX_SEQ_LEN_TO_CAPTURE) // block_size)


def eager_reason(config, device_type: str, tensor_parallel: bool, moe: bool) -> str | None:
    """Why a runner runs every step eager, or None when it captures decode graphs."""
    if device_type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device_type}"
    if config.enforce_eager:
        return "--enforce-eager"
    if config.kernel_backend not in ("auto", "triton"):
        return f"kernel_backend={config.kernel_backend!r} syncs with the host (Triton does not)"
    if tensor_parallel:
        return "tensor parallelism (no NCCL all-reduce inside a graph)"
    if moe:
        return "mixture-of-experts layers (the fused MoE's torch.bincount syncs with the host)"
    if config.max_model_len < 1:
        return "max_model_len is not resolved"
    if config.enable_lora:
        return "--enable-lora (each step's rows pick their adapters anew)"
    return None


def graph_size(sizes: list[int], max_blocks: int, hybrid: bool, tokens: int, decodes: int,
               prefills: int, meta: AttentionMetadata) -> int | None:
    """The captured size that replays this step, or None to run it eager:
    decode rows only, no more than the largest size, tables no wider than the graphs'."""
    if prefills or decodes != tokens or (meta.window is not None) != hybrid:
        return None
    tables = [meta.decode_block_tables] + ([meta.window.decode_block_tables] if hybrid else [])
    if any(table.shape[1] > max_blocks for table in tables):
        return None
    return padded_size(sizes, tokens)


class StaticDecodeInputs:
    """The buffers every captured graph reads, filled in place before a replay."""

    def __init__(self, max_size: int, max_blocks: int, hybrid: bool, device) -> None:
        long = {"dtype": torch.long, "device": device}
        int32 = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(max_size, **long)
        self.positions = torch.zeros(max_size, **long)
        self.slots = torch.full((max_size,), -1, **long)
        self.tables = torch.zeros(max_size, max_blocks, **int32)
        self.lens = torch.zeros(max_size, **int32)
        self.window_slots = torch.full((max_size,), -1, **long) if hybrid else None
        self.window_tables = torch.zeros(max_size, max_blocks, **int32) if hybrid else None
        # A decode-only step's prefill part: empty, as decode_step makes it.
        self.no_tables = torch.zeros(0, 0, **int32)
        self.cu_seqlens = torch.zeros(1, **int32)
        self.no_lens = torch.zeros(0, **int32)

    def load(self, n: int, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> None:
        """A step of n decode rows into rows [:n]; rows [n:size] write and read nothing."""
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.lens[:n].copy_(meta.decode_context_lens)
        self.lens[n:size].zero_()
        _load_rows(self.slots, self.tables, n, size, meta)
        if self.window_slots is not None:
            _load_rows(self.window_slots, self.window_tables, n, size, meta.window)

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a decode-only step of `size` rows, over the buffers."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], num_decode_tokens=size,
            decode_block_tables=self.tables[:size], decode_context_lens=self.lens[:size],
            prefill_block_tables=self.no_tables, prefill_cu_seqlens_q=self.cu_seqlens,
            prefill_context_lens=self.no_lens)
        if self.window_slots is not None:
            meta.window = dataclasses.replace(meta, slot_mapping=self.window_slots[:size],
                                              decode_block_tables=self.window_tables[:size])
        return meta


def _load_rows(slots: torch.Tensor, tables: torch.Tensor, n: int, size: int,
               meta: AttentionMetadata) -> None:
    slots[:n].copy_(meta.slot_mapping)
    slots[n:size].fill_(-1)
    width = meta.decode_block_tables.shape[1]
    tables[:n, :width].copy_(meta.decode_block_tables)


class DecodeGraphs:
    """The captured decode forwards of one runner, one per capture size."""

    def __init__(self, model, sizes: list[int], max_blocks: int, hybrid: bool,
                 scratch_shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.model = model
        self.sizes = sizes
        self.max_blocks = max_blocks
        self.hybrid = hybrid
        self.scratch_shape = scratch_shape  # a 2-block cache for the reserve measurement
        self.dtype = dtype  # the KV cache's
        self.device = torch.device(device)
        self.inputs = StaticDecodeInputs(sizes[-1], max_blocks, hybrid, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = self.reserved_bytes = 0  # the pool taken; the KV budget's reserve
        self.capture_seconds = 0.0
        self.replays = 0  # decode steps served by a graph (bench and tests read it)

    @classmethod
    def for_runner(cls, runner) -> DecodeGraphs | None:
        """The runner's graphs (not captured yet), or None when it runs eager."""
        config, args = runner.config, runner.model.args
        reason = eager_reason(config, runner.device.type, runner.group is not None,
                              args.moe is not None)
        if reason is not None:
            if runner.device.type == "cuda":
                logger.info("decode steps run eager: %s", reason)
            return None
        scratch = runner.kv_layout.shape(args.num_layers, 2)  # in the cache's own layout
        return cls(runner.model, capture_sizes(config.max_num_seqs),
                   max_blocks_to_capture(config.max_model_len, runner.block_size),
                   runner.kv_groups.hybrid, scratch, runner.kv_cache_dtype, runner.device)

    def _forward(self, size: int, caches) -> torch.Tensor:
        inputs = self.inputs
        return self.model(inputs.input_ids[:size], inputs.positions[:size], caches,
                          inputs.metadata(size))

    @torch.inference_mode()
    def reserve_bytes(self) -> int:
        """What the graph pool will take, estimated before the KV cache exists: the
        peak of one eager decode of the largest size (activations, split-KV
        partials) over a scratch cache, every graph's output rows, a margin."""
        scratch = torch.zeros(self.scratch_shape, dtype=self.dtype, device=self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        hidden = self._forward(self.sizes[-1], scratch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        outputs = sum(self.sizes) * hidden.shape[-1] * hidden.element_size()
        self.reserved_bytes = peak + outputs + RESERVE_MARGIN_BYTES
        return self.reserved_bytes

    @torch.inference_mode()
    def capture(self, caches) -> None:
        """Capture every size into one pool, largest first (its intermediates are
        the ones the smaller graphs reuse); each after an eager warm-up that
        compiles its Triton kernels and lets cuBLAS pick its algorithms."""
        started, device = time.perf_counter(), self.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # as each capture does first: the pool alone is counted
        before = torch.cuda.memory_reserved(device)
        with torch.cuda.device(device):  # the capture stream is the current device's
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):
                self._forward(size, caches)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread of the process may use CUDA meanwhile
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    hidden = self._forward(size, caches)
                self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize(device)
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        self.capture_seconds = time.perf_counter() - started
        logger.info("captured %d decode graphs (batch sizes %d..%d) in %.1f s; pool %.1f MiB "
                    "(reserved for it: %.1f MiB)", len(self.sizes), self.sizes[0], self.sizes[-1],
                    self.capture_seconds, self.pool_bytes / 2**20, self.reserved_bytes / 2**20)

    def run(self, header: list[int], inputs) -> torch.Tensor | None:
        """The hidden states [n, hidden] of a decode-only step by replay, or None:
        run this step eager (a view of the graph's output, valid until the next replay)."""
        tokens, decodes, prefills = header[1], header[2], header[4]
        size = graph_size(self.sizes, self.max_blocks, self.hybrid, tokens, decodes, prefills,
                          inputs.meta)
        if size is None or size not in self.graphs:
            return None
        self.inputs.load(tokens, size, inputs.input_ids, inputs.positions, inputs.meta)
        self.replays += 1
        return self._replay(size)[:tokens]

    def _replay(self, size: int) -> torch.Tensor:
        """Replay the graph of `size` over the loaded buffers: its output rows."""
        graph, hidden = self.graphs[size]
        with torch.cuda.device(self.device):  # the engine may step in another thread
            graph.replay()
        return hidden
