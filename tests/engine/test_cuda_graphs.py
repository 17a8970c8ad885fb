"""CUDA graphs for the decode step (engine/model/cuda_graphs.py).

On the CPU: the capture sizes, the padding and the static buffers as exact
values, the --enforce-eager flag, that no graph object exists on the CPU, and
the whole path through the engine with each would-be replay run as an eager
forward over the static buffers (padded rows included), which must give the
tokens the plain eager engine gives. The replay itself is CUDA-only: those
tests skip without a GPU (bench/gpu/gpu_graphs.py is the GPU acceptance run).
"""

from __future__ import annotations

import argparse
import gc

import pytest
import torch
from tiny_models import make_tiny_family

from engine import LLM, SamplingParams
from engine.args import add_engine_args, config_from_args
from engine.config import EngineConfig
from engine.model.attention_metadata import AttentionMetadata
from engine.model.cuda_graphs import (
    DecodeGraphs,
    StaticDecodeInputs,
    capture_sizes,
    eager_reason,
    graph_size,
    max_blocks_to_capture,
    padded_size,
)

EIGHTS = list(range(8, 513, 8))


@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, [1]),
    (2, [1, 2]),
    (3, [1, 2, 4]),
    (8, [1, 2, 4, 8]),
    (9, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 24]),
    (24, [1, 2, 4, 8, 16, 24]),
    (256, [1, 2, 4] + EIGHTS[:32]),
    (512, [1, 2, 4] + EIGHTS),
    (4096, [1, 2, 4] + EIGHTS),
])
def test_capture_sizes_are_vllms_up_to_the_first_that_holds_max_num_seqs(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


@pytest.mark.parametrize("n, expected", [
    (0, None), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 24), (24, 24), (25, None)])
def test_padded_size_is_the_smallest_size_that_holds_n(n, expected):
    assert padded_size([1, 2, 4, 8, 16, 24], n) == expected


@pytest.mark.parametrize("max_model_len, block_size, expected", [
    (2048, 16, 128), (100, 16, 7), (131072, 16, 512), (8192, 128, 64), (8193, 1, 8192)])
def test_tables_are_as_wide_as_the_longest_captured_sequence(max_model_len, block_size, expected):
    assert max_blocks_to_capture(max_model_len, block_size) == expected


def test_eager_reasons():
    config = EngineConfig(max_model_len=64)
    assert eager_reason(config, "cuda", False, False) is None
    assert "CUDA device" in eager_reason(config, "cpu", False, False)
    assert eager_reason(config.replace(enforce_eager=True), "cuda", False, False) == "--enforce-eager"
    assert "syncs" in eager_reason(config.replace(kernel_backend="torch"), "cuda", False, False)
    assert eager_reason(config.replace(kernel_backend="triton"), "cuda", False, False) is None
    assert "tensor parallelism" in eager_reason(config, "cuda", True, False)
    assert "mixture-of-experts" in eager_reason(config, "cuda", False, True)
    assert "max_model_len" in eager_reason(EngineConfig(), "cuda", False, False)


def test_enforce_eager_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).enforce_eager is False
    assert config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert config_from_args(parser.parse_args(["--no-enforce-eager"])).enforce_eager is False


def _meta(lens, tables, slots, window=None) -> AttentionMetadata:
    int32 = torch.int32
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=len(lens),
        decode_block_tables=torch.tensor(tables, dtype=int32),
        decode_context_lens=torch.tensor(lens, dtype=int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=int32),
        prefill_context_lens=torch.zeros(0, dtype=int32))
    if window is not None:
        meta.window = AttentionMetadata(torch.tensor(window[0]), len(lens),
                                        torch.tensor(window[1], dtype=int32),
                                        meta.decode_context_lens, meta.prefill_block_tables,
                                        meta.prefill_cu_seqlens_q, meta.prefill_context_lens)
    return meta


def test_graph_size_takes_decode_only_steps_that_fit():
    sizes = [1, 2, 4, 8]
    meta = _meta([5, 9, 2], [[1, 0], [2, 3], [4, 0]], [20, 56, 65])
    assert graph_size(sizes, 4, False, 3, 3, 0, meta) == 4
    assert graph_size(sizes, 4, False, 4, 3, 1, meta) is None  # a prefill chunk in the step
    assert graph_size(sizes, 4, False, 9, 9, 0, meta) is None  # more rows than the largest graph
    assert graph_size(sizes, 1, False, 3, 3, 0, meta) is None  # tables wider than the graphs'
    assert graph_size(sizes, 4, True, 3, 3, 0, meta) is None  # graphs for a window pool
    hybrid = _meta([5, 9, 2], [[1, 0], [2, 3], [4, 0]], [20, 56, 65],
                   window=([4, 8, 12], [[7, 0, 0], [8, 9, 0], [5, 0, 0]]))
    assert graph_size(sizes, 4, True, 3, 3, 0, hybrid) == 4
    assert graph_size(sizes, 2, True, 3, 3, 0, hybrid) is None  # its window tables too wide


def test_load_fills_rows_and_neutralises_the_padding():
    inputs = StaticDecodeInputs(8, 4, hybrid=True, device="cpu")
    for buffer in (inputs.input_ids, inputs.positions, inputs.slots, inputs.lens,
                   inputs.window_slots):
        buffer.fill_(7)  # an earlier, larger step's values
    inputs.tables.fill_(7)
    meta = _meta([5, 17, 2], [[1, 0], [2, 3], [4, 0]], [20, 56, 65],
                 window=([4, 8, 12], [[9, 0, 0], [8, 6, 0], [5, 0, 0]]))
    inputs.load(3, 4, torch.tensor([11, 12, 13]), torch.tensor([4, 16, 1]), meta)
    assert inputs.input_ids.tolist() == [11, 12, 13, 7, 7, 7, 7, 7]
    assert inputs.positions.tolist() == [4, 16, 1, 7, 7, 7, 7, 7]
    assert inputs.slots.tolist() == [20, 56, 65, -1, 7, 7, 7, 7]
    assert inputs.window_slots.tolist() == [4, 8, 12, -1, 7, 7, 7, 7]
    assert inputs.lens.tolist() == [5, 17, 2, 0, 7, 7, 7, 7]
    assert inputs.tables[:4].tolist() == [[1, 0, 7, 7], [2, 3, 7, 7], [4, 0, 7, 7], [7] * 4]
    assert inputs.window_tables[:3].tolist() == [[9, 0, 0, 0], [8, 6, 0, 0], [5, 0, 0, 0]]
    view = inputs.metadata(4)
    assert view.num_decode_tokens == 4
    assert view.decode_block_tables.shape == (4, 4) and view.decode_context_lens.shape == (4,)
    assert view.decode_block_tables.data_ptr() == inputs.tables.data_ptr()
    assert view.window.slot_mapping.tolist() == [4, 8, 12, -1]
    assert view.window.decode_block_tables.data_ptr() == inputs.window_tables.data_ptr()
    assert view.prefill_block_tables.shape == (0, 0) and view.prefill_cu_seqlens_q.tolist() == [0]


class EagerReplay(DecodeGraphs):
    """The graphs' buffers and padding, with the forward run eagerly where a graph
    would replay (the CPU has no graphs): what a replay computes, row for row."""

    def capture(self, caches) -> None:
        self.caches = caches
        self.graphs = dict.fromkeys(self.sizes)

    def _replay(self, size: int) -> torch.Tensor:
        return self._forward(size, self.caches)


def _greedy(llm, prompts, max_tokens):
    """Greedy token ids; `max_tokens` an int, or one per prompt (the batch shrinks
    as they finish, so padded rows follow rows that held other sequences' slots)."""
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in counts]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_path, single_thread):
    return LLM(str(tiny_llama_path), device="cpu", dtype="float32", kernel_backend="torch",
               block_size=4, max_model_len=128, max_num_seqs=8)


def test_no_graphs_on_the_cpu(tiny_llm):
    assert tiny_llm.engine.runner.graphs is None


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_padded_graph_rows_give_the_eager_tokens(tiny_llm, batch):
    runner = tiny_llm.engine.runner
    prompts = [[5 + i + 7 * j for j in range(3 + 5 * i)] for i in range(batch)]
    max_tokens = [12 - 4 * (i == 1) for i in range(batch)]  # row 1 finishes first: 6 -> 5 rows
    eager = _greedy(tiny_llm, prompts, max_tokens)
    graphs = EagerReplay(runner.model, capture_sizes(8), 32, False, (), runner.dtype, "cpu")
    graphs.capture(runner.layer_caches)
    runner.graphs = graphs
    try:
        tiny_llm.reset_prefix_cache()
        assert _greedy(tiny_llm, prompts, max_tokens) == eager
    finally:
        runner.graphs = None
    assert graphs.replays >= 11  # every decode-only step went through the buffers


def test_hybrid_window_pool_through_the_buffers(tmp_path, smollm2_path, single_thread):
    """Gemma 3's sliding layers keep their own pool and tables: two more buffers."""
    folder = make_tiny_family(tmp_path / "gemma3", "gemma3", smollm2_path)
    llm = LLM(str(folder), device="cpu", dtype="float32", kernel_backend="torch",
              block_size=4, max_model_len=128, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.kv_groups.hybrid
    prompts = [[5 + i + 7 * j for j in range(10 + 9 * i)] for i in range(5)]  # past the window
    max_tokens = [16 - 6 * (i == 0) for i in range(5)]
    eager = _greedy(llm, prompts, max_tokens)
    graphs = EagerReplay(runner.model, capture_sizes(8), 32, True, (), runner.dtype, "cpu")
    graphs.capture(runner.layer_caches)
    runner.graphs = graphs
    llm.reset_prefix_cache()
    assert _greedy(llm, prompts, max_tokens) == eager
    assert graphs.replays >= 15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_replay_gives_the_eager_tokens(tmp_path):
    from bench.gpu.gpu_check import build_model

    folder = build_model(tmp_path, small=True)
    prompts = [[3 + (7 * i + j) % 500 for j in range(1 + 9 * i)] for i in range(5)]
    results = {}
    for eager in (True, False):
        llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256,
                  max_num_seqs=8, gpu_memory_utilization=0.3, enforce_eager=eager)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        results[eager] = _greedy(llm, prompts, [16 - 6 * (i == 1) for i in range(5)])
        if graphs is not None:
            assert graphs.replays >= 15  # every decode step after the prefill
        del llm, graphs
        gc.collect()
        torch.cuda.empty_cache()
    assert results[False] == results[True]
