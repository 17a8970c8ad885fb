"""LLMEngine.running_block_tables: what each running sequence holds in the KV cache,
read between steps through the engine's public face (bench/offline/driver.py)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), dtype="float32", block_size=16, max_model_len=128,
              max_num_batched_tokens=256, num_gpu_blocks_override=64, seed=0)
    return llm.engine


def test_running_block_tables_between_steps(engine):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(100, 120)), params)  # 20 tokens: 2 blocks
    engine.add_request("b", list(range(200, 240)), params)  # 40 tokens: 3 blocks
    assert engine.running_block_tables() == []  # waiting, nothing computed yet

    engine.step()  # both prompts prefilled in one step
    (computed_a, table_a), (computed_b, table_b) = engine.running_block_tables()
    assert (computed_a, len(table_a)) == (20, 2)
    assert (computed_b, len(table_b)) == (40, 3)
    assert not set(table_a) & set(table_b)

    table_a.clear()  # a copy: the engine's table is untouched
    assert [len(t) for _, t in engine.running_block_tables()] == [2, 3]

    while engine.has_unfinished_requests():
        engine.step()
    assert engine.running_block_tables() == []
