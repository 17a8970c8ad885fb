"""The engine against HF transformers: greedy float32 outputs, token for token.

vLLM's HfRunner-vs-engine pattern. The reference is `generate(do_sample=False)`
one prompt at a time (no padding to blur it). The engine runs every prompt in
one batch under configurations that exercise every scheduling path: block
sizes 4, 16 and 128, a token budget small enough to chunk every prefill, and
a KV budget small enough to force preemption.

The only tolerance is vLLM's `check_logprobs_close` rule: at the first position
where the tokens differ, each side's token must be among the other side's
top-k candidates (a near-tie that batching arithmetic may flip); after that the
sequences are no longer comparable.
"""

from __future__ import annotations

import functools

import pytest

from engine import LLM, SamplingParams
from hf_compare import TOP_K, compare, hf_greedy

NUM_NEW_TOKENS = 32

TEXT = (
    "The history of computing is a story of layers. Early machines were programmed by "
    "rewiring panels; stored programs made software possible; compilers let people write "
    "for humans first and machines second. Operating systems then hid the hardware behind "
    "processes and virtual memory, where pages of a fixed size are handed out on demand and "
    "a table maps each virtual page to a physical frame. The same idea now serves language "
    "models: the attention cache of every request is split into blocks, and a block table "
    "says where each block lives, so memory is never reserved for tokens that may not come. "
)


def make_prompts(tokenizer) -> list[list[int]]:
    """Eight prompts from 1 token to several 128-token blocks."""
    ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)
    lengths = [1, 3, 7, 16, 17, 45, 150, 300]
    assert len(ids) >= max(lengths)
    return [ids[i * 3 : i * 3 + n] for i, n in enumerate(lengths)]


def engine_greedy(model_path, prompts, **engine_args):
    llm = LLM(str(model_path), dtype="float32", **engine_args)
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=TOP_K
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        tops = [dict(pairs) for pairs in completion.top_logprobs]
        results.append((completion.token_ids, tops))
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    engine.block_manager.check_invariants()
    return results, engine.scheduler.num_preemptions


# (name, engine arguments, must the run preempt?)
CONFIGS = [
    ("block4", dict(block_size=4), False),
    ("block16", dict(block_size=16), False),
    ("block128", dict(block_size=128), False),
    ("block16-chunked", dict(block_size=16, max_num_batched_tokens=32), False),
    ("block128-chunked", dict(block_size=128, max_num_batched_tokens=128), False),
    # admitting without headroom for growth (schedule_conservativeness=0) forces preemption
    ("block4-preempt", dict(block_size=4, max_model_len=400, num_gpu_blocks_override=110,
                            schedule_conservativeness=0), True),
    ("block16-chunked-preempt",
     dict(block_size=16, max_num_batched_tokens=48, max_model_len=400, num_gpu_blocks_override=30,
          schedule_conservativeness=0),
     True),
]


def hf_case(model_name: str, path):
    """(name, folder, prompts, HF's greedy outputs) of a model folder."""
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(str(path)))
    return model_name, path, prompts, hf_greedy(path, prompts, NUM_NEW_TOKENS, "cpu")


def check_greedy(case, name: str, engine_args: dict, preempts: bool) -> dict:
    """The engine's greedy outputs under `engine_args` against HF's (the rule above)."""
    model_name, path, prompts, expected = case
    actual, num_preemptions = engine_greedy(path, prompts, **engine_args)
    if preempts:
        assert num_preemptions > 0, "the KV budget was meant to force preemption"
    result = compare(expected, actual)
    assert result["ok"], f"{model_name}/{name}: diverged beyond a near-tie at {result['failures']}"
    return result


# The tiny Llama runs every schedule above; the real SmolLM2 (30 layers,
# 13-19 s of float32 compute a schedule on one AVX2 core) one of each kind: a
# plain run, chunked prefill at block 128, and chunked prefill with preemption.
SMOLLM2_CONFIGS = ("block16", "block128-chunked", "block16-chunked-preempt")
CASES = [(model, *config) for model in ("tiny-llama", "smollm2") for config in CONFIGS
         if model == "tiny-llama" or config[0] in SMOLLM2_CONFIGS]


@pytest.fixture(scope="module")
def model_cases(tiny_llama_path, smollm2_path):
    """model name -> hf_case, HF's greedy run made once per model in the module."""
    paths = {"tiny-llama": tiny_llama_path, "smollm2": smollm2_path}
    return functools.cache(lambda model_name: hf_case(model_name, paths[model_name]))


@pytest.mark.parametrize("model_name,name,engine_args,preempts", CASES,
                         ids=[f"{case[0]}-{case[1]}" for case in CASES])
def test_greedy_matches_hf(model_cases, model_name, name, engine_args, preempts):
    check_greedy(model_cases(model_name), name, engine_args, preempts)
