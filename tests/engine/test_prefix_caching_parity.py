"""Prefix caching changes what is computed, never what is generated (SmolLM2's
real weights in float32, its first 4 layers: conftest's smollm2_short_path).

Every scenario runs twice on fresh engines, caching off and on, and the
generated tokens must agree. The schedule is driven by hand so that requests
arrive while others are generating: later requests hit the system prompt's
blocks that an earlier, still running request computed.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

SYSTEM = (
    "You are a careful assistant for a team that runs language models in production. "
    "Answer briefly, prefer concrete numbers, and say when you are unsure. The team cares "
    "about latency, memory use and the cost of every request, and reads answers on a phone."
)
QUESTIONS = [
    "What is a KV cache?",
    "Why batch requests?",
    "How much memory does a 135M model need?",
    "Name one benefit of paging.",
    "What is prefix caching?",
    "What does preemption mean here?",
]


def chat_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for question in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
    return prompts


def run_staggered(llm: LLM, prompts, params_list) -> list[list[list[int]]]:
    """First request alone for a few steps, then the rest join mid-generation."""
    engine = llm.engine
    finished = {}
    engine.add_request("r0", prompts[0], params_list[0])
    for _ in range(4):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for i in range(1, len(prompts)):
        engine.add_request(f"r{i}", prompts[i], params_list[i])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    engine.block_manager.check_invariants()
    return [[c.token_ids for c in finished[f"r{i}"].outputs] for i in range(len(prompts))]


def both_ways(path, prompts, params_list, **engine_args):
    results = {}
    for caching in (False, True):
        llm = LLM(str(path), enable_prefix_caching=caching, dtype="float32", **engine_args)
        results[caching] = (run_staggered(llm, prompts, params_list), llm.engine.stats())
    return results


SCENARIOS = [
    ("shared-system-prompt", dict(block_size=16), False),
    ("block4-chunked", dict(block_size=4, max_num_batched_tokens=64), False),
    ("preemption", dict(block_size=16, max_model_len=256, num_gpu_blocks_override=20,
                        schedule_conservativeness=0), True),
]


@pytest.fixture(scope="module")
def prompts(smollm2_short_path):
    from transformers import AutoTokenizer

    return chat_prompts(AutoTokenizer.from_pretrained(str(smollm2_short_path)))


@pytest.mark.parametrize("name,engine_args,preempts", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_greedy_identical_with_and_without_caching(smollm2_short_path, prompts, name, engine_args,
                                                   preempts):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    results = both_ways(smollm2_short_path, prompts, params, **engine_args)
    (off, off_stats), (on, on_stats) = results[False], results[True]
    assert on == off
    assert off_stats["prefix_cache_hits"] == 0
    assert on_stats["prefix_cache_hits"] > 0
    assert on_stats["prompt_tokens_computed"] < off_stats["prompt_tokens_computed"]
    if preempts:  # preempted mid-generation, the cached run resumes from its own cache
        assert on_stats["num_preemptions"] > 0


def test_parallel_samples_identical_with_and_without_caching(smollm2_short_path, prompts):
    """n > 1 shares the prompt's blocks (fork + copy on write) either way."""
    params = [SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=16,
                             ignore_eos=True) for i in range(3)]
    results = both_ways(smollm2_short_path, prompts[:3], params, block_size=16)
    (off, _), (on, on_stats) = results[False], results[True]
    assert on == off
    assert on_stats["prefix_cache_hits"] > 0
    for samples in on:
        assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1
