"""Tensor parallelism on CPU with gloo: real worker processes, exact outputs.

Every engine here splits a real checkpoint over N processes and must produce
the greedy tokens of the unsplit model, token for token, in float32: with
prefix caching hitting and every prompt prefilled in chunks (a 16-token
budget). Then the failure paths: a worker killed mid-run or while idle fails
the engine within seconds and leaves no process behind, a size that cannot
split the model is refused before anything starts, and the design brief's
offline snippet runs as a plain script with tensor_parallel_size=2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.model.distributed.executor import WorkerFailedError
from live_server import wait_until
from processes import alive, all_gone
from tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PREFIX = list(range(1000, 1040))  # 40 tokens shared by every prompt
PROMPTS = [PREFIX + [7, 8, 9], PREFIX + [21, 22], PREFIX + list(range(300, 330)), [5, 6, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy_run(model: Path | str, size: int, between=None, **engine_args):
    """Greedy tokens of PROMPTS (the first prompt alone first, so the rest hit its
    prefix; `between(llm)` runs in between), the engine's counters, the offload
    tiers' counters and every rank's memory."""
    llm = LLM(str(model), dtype="float32", tensor_parallel_size=size, block_size=4,
              max_num_batched_tokens=16, max_model_len=256, kv_cache_memory_bytes=32 << 20,
              **engine_args)
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        if between is not None:
            between(llm)
        rest = llm.generate(prompts, GREEDY, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in first + rest]
        engine = llm.engine
        memory = engine.memory_per_rank()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
        return tokens, engine.stats(), engine.offload_stats(), memory
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def tiny_tp1(tiny_llama_path):
    return greedy_run(tiny_llama_path, 1)


@pytest.fixture(scope="module")
def six_head_llama(tmp_path_factory, smollm2_path) -> Path:
    """6 query heads over 3 KV heads: splits over 3 ranks."""
    return make_tiny_model(tmp_path_factory.mktemp("six-heads"), smollm2_path, hidden_size=96,
                           intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


def two_ranks(model: Path) -> LLM:
    """The tiny model over two ranks, for the tests that kill or close them."""
    return LLM(str(model), dtype="float32", tensor_parallel_size=2, max_model_len=256,
               kv_cache_memory_bytes=32 << 20)


def assert_sharded_memory(tp1_memory, memory, size: int) -> None:
    """Each rank holds about 1/N of the weights (norms and RoPE tables are whole
    on every rank) and its KV budget's worth of cache."""
    assert len(memory) == size
    whole = tp1_memory[0]["weights_bytes"]
    for rank in memory:
        assert whole / size <= rank["weights_bytes"] < whole / size * 1.1
        assert 0 < rank["kv_cache_bytes"] <= 32 << 20


@pytest.mark.parametrize("size", [2, 4])
def test_tiny_gqa_llama_matches_one_rank(tiny_llama_path, tiny_tp1, size):
    # 4 heads, 2 KV heads: 2 ranks split the KV heads, 4 ranks replicate them.
    tokens, stats, _, memory = greedy_run(tiny_llama_path, size)
    expected, expected_stats, _, tp1_memory = tiny_tp1
    assert tokens == expected
    assert stats["prefix_cache_hits"] == expected_stats["prefix_cache_hits"] > 0
    assert_sharded_memory(tp1_memory, memory, size)


def test_smollm2_over_three_ranks_matches_one_rank(smollm2_short_path):
    # 9 heads, 3 KV heads, tied embeddings: the vocab-parallel LM head is the
    # embedding (SmolLM2's first 4 layers: its weights and shapes).
    tokens, stats, _, memory = greedy_run(smollm2_short_path, 3)
    expected, expected_stats, _, tp1_memory = greedy_run(smollm2_short_path, 1)
    assert tokens == expected
    assert stats["prefix_cache_hits"] == expected_stats["prefix_cache_hits"] > 0
    assert_sharded_memory(tp1_memory, memory, 3)


def drop_device_cache(llm) -> None:
    """Once the first prompt's 10 full blocks are in the host tier (gathered from
    every rank), drop them from the device: the other prompts load the shared
    prefix back from the tier (each rank writes its slice)."""
    assert wait_until(lambda: llm.engine.offload_stats()["blocks_stored"] == 10, timeout=30)
    llm.reset_prefix_cache()


HOST_TIER = {"kv_offload_host_bytes": 4 << 20, "kv_offload_store_threshold": 1}


def test_offload_tier_records_hold_every_ranks_slice(tiny_llama_path, tiny_tp1):
    tokens, _, offload, _ = greedy_run(tiny_llama_path, 2, between=drop_device_cache,
                                       **HOST_TIER)
    assert tokens == tiny_tp1[0]
    assert offload["blocks_loaded"] == 10


def test_an_int8_cache_over_two_ranks_matches_one_rank(tiny_llama_path):
    """--kv-cache-dtype int8: each rank holds its KV heads' int8 rows, and a
    block's offload record is both ranks' slices of them."""
    expected, _, _, _ = greedy_run(tiny_llama_path, 1, kv_cache_dtype="int8")
    tokens, _, offload, _ = greedy_run(tiny_llama_path, 2, between=drop_device_cache,
                                       kv_cache_dtype="int8", **HOST_TIER)
    assert tokens == expected
    assert offload["blocks_loaded"] == 10


def test_smollm2_refuses_two_ranks_before_starting_anything(smollm2_path):
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split this model: it "
                                         r"has 9 attention heads, 3 KV heads.*sizes that work: 1, 3$"):
        LLM(str(smollm2_path), tensor_parallel_size=2)
    assert time.monotonic() - started < 30


def test_a_worker_killed_mid_run_fails_the_engine_and_leaves_no_process(six_head_llama):
    llm = LLM(str(six_head_llama), dtype="float32", tensor_parallel_size=3, max_model_len=1024,
              kv_cache_memory_bytes=32 << 20)
    pids = llm.engine.runner.workers.pids
    failures: list[tuple[BaseException, float]] = []

    def generate() -> None:
        try:
            llm.generate([{"prompt_token_ids": [5] * 8}] * 4,
                         SamplingParams(max_tokens=1000, ignore_eos=True), use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failures.append((exc, time.monotonic()))

    thread = threading.Thread(target=generate)
    thread.start()
    assert wait_until(lambda: llm.engine.num_generation_tokens > 20, timeout=60)
    os.kill(pids[0], signal.SIGKILL)
    killed = time.monotonic()
    thread.join(30)
    assert not thread.is_alive(), "generate() hung after a worker died"
    error, when = failures[0]
    assert isinstance(error, WorkerFailedError)
    assert f"worker 1 (pid {pids[0]}) exited with code -9" in str(error)
    assert when - killed < 10
    assert all_gone(pids), "the other worker outlived the failure"
    assert llm.engine.failure is not None
    with pytest.raises(WorkerFailedError):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.engine.close()


def test_a_worker_dying_while_idle_is_reported_at_once(tiny_llama_path):
    llm = two_ranks(tiny_llama_path)
    pids = llm.engine.runner.workers.pids
    os.kill(pids[0], signal.SIGKILL)
    assert wait_until(lambda: llm.engine.failure is not None, timeout=5, interval=0.05)
    assert all_gone(pids)
    with pytest.raises(WorkerFailedError, match="exited with code -9"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.engine.close()


def test_rank_0_failing_halfway_through_a_step_stops_the_workers(tiny_llama_path):
    # The workers wait in the second layer's all-reduce that rank 0 never reaches:
    # the group is out of step, so the engine fails rather than hang or mix steps.
    llm = two_ranks(tiny_llama_path)
    pids = llm.engine.runner.workers.pids

    def broken(x):
        raise ValueError("injected fault in rank 0's second layer")

    llm.engine.runner.model.layers[1].mlp.forward = broken
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match="failed on rank 0: .*injected fault"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 10
    assert all_gone(pids)
    llm.engine.close()


def test_close_stops_every_worker(tiny_llama_path):
    llm = two_ranks(tiny_llama_path)
    pids = llm.engine.runner.workers.pids
    assert all(alive(pid) for pid in pids)
    llm.engine.close()
    assert all_gone(pids, timeout=1)
    assert llm.engine.failure is None  # a requested stop is not a failure
    llm.engine.close()  # safe to repeat


SEED_SNIPPET = """\
from engine import LLM, SamplingParams
prompts = ["Hello, my name is", "The capital of France is"]
llm = LLM(model={model!r}, tensor_parallel_size=2, gpu_memory_utilization=0.90, max_num_seqs=256,
          max_num_batched_tokens=8192, block_size=16, enable_prefix_caching=True)
outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=512))
for i in range(len(outputs)):
    print(len(outputs[i].outputs[0].token_ids), repr(outputs[i].prompt))
print("workers", *llm.engine.runner.workers.pids)
"""


def test_the_design_briefs_snippet_runs_with_two_ranks(tiny_llama_path, tmp_path):
    # A plain script, no `if __name__ == "__main__"` guard; it never closes the
    # engine, so its workers must go when the script ends.
    script = tmp_path / "seed.py"
    script.write_text(SEED_SNIPPET.format(model=str(tiny_llama_path)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" ", 1)[1] for line in lines[:2]] == [
        "'Hello, my name is'", "'The capital of France is'"]
    assert all(int(line.split()[0]) > 0 for line in lines[:2]), done.stdout
    pids = [int(pid) for pid in lines[2].split()[1:]]
    assert len(pids) == 1 and all_gone(pids, timeout=5)
