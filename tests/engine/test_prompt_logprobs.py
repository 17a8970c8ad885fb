"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF's float32 log-softmax.

Every prompt position's logprob of the prompt token, its rank and the top-k
must equal HF's `log_softmax(model(prompt).logits)` to 1e-4: in one prefill,
in chunks, after the prompt was cached by an earlier request (the request
recomputes it: no prefix hits for it, yet it fills the cache for others),
through preemptions (recomputed from 0, nothing twice), over two
tensor-parallel ranks, and with max_tokens=0, which answers the prompt alone.
Block sizes 1 and 16.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import RequestOutputKind

K = 3
TOLERANCE = 1e-4
_rng = random.Random(7)
PREFIX = [_rng.randrange(100, 49000) for _ in range(24)]  # shared: a prefix-cache candidate
PROMPTS = [PREFIX + [_rng.randrange(100, 49000) for _ in range(n)] for n in (13, 26, 1)]

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def hf(tiny_llama_path) -> dict[tuple[int, ...], torch.Tensor]:
    """HF's float32 log-softmax at every position of each prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_path), dtype=torch.float32)
    with torch.no_grad():
        return {tuple(p): torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
                for p in PROMPTS}


def make_llm(path, block_size: int, **overrides) -> LLM:
    settings = dict(dtype="float32", block_size=block_size, max_model_len=128,
                    max_num_batched_tokens=256, kv_cache_memory_bytes=16 << 20, seed=0)
    return LLM(str(path), **{**settings, **overrides})


def run(llm: LLM, params, prompts=PROMPTS) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks  # nothing leaked
    return outputs


def scored(max_tokens: int = 3, k: int = K, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=k, **kw)


def assert_matches_hf(output, hf, k: int = K) -> None:
    ids, entries = output.prompt_token_ids, output.prompt_logprobs
    reference = hf[tuple(ids)]
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, entry, token = reference[i - 1], entries[i], ids[i]
        own = entry[token]
        assert abs(own.logprob - row[token].item()) < TOLERANCE, (i, own, row[token])
        # its rank, up to tokens within the tolerance of it
        assert 1 + int((row > own.logprob + TOLERANCE).sum()) <= own.rank
        assert own.rank <= 1 + int((row > own.logprob - TOLERANCE).sum())
        for top_id, logprob in entry.items():
            assert abs(logprob.logprob - row[top_id].item()) < TOLERANCE
        top = sorted((lp.logprob for lp in entry.values() if lp.rank <= k), reverse=True)
        assert torch.allclose(torch.tensor(top), row.topk(k).values, atol=TOLERANCE), i
        assert len(entry) in (k, k + 1)  # the prompt token, besides the top k or among them


@pytest.mark.parametrize("block_size", [1, 16])
def test_prompt_logprobs_equal_hf_and_leave_the_output_alone(tiny_llama_path, hf, block_size):
    llm = make_llm(tiny_llama_path, block_size)
    outputs = run(llm, scored())
    for output in outputs:
        assert_matches_hf(output, hf)
        assert output.num_cached_tokens == 0
    # The same greedy tokens as without them; and the prompts they computed were
    # cached for others: these hit them.
    plain = run(llm, SamplingParams(temperature=0, max_tokens=3))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs]
    assert [o.prompt_logprobs for o in plain] == [None] * len(PROMPTS)
    assert plain[1].num_cached_tokens >= len(PREFIX) // block_size * block_size > 0


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_cached_prompt_is_recomputed_for_its_logprobs(tiny_llama_path, hf, block_size):
    llm = make_llm(tiny_llama_path, block_size)
    warm = run(llm, SamplingParams(temperature=0, max_tokens=1))
    assert warm[1].num_cached_tokens > 0  # the shared prefix hit within the batch
    before = llm.engine.stats()["prompt_tokens_computed"]
    outputs = run(llm, scored(k=5))
    for output in outputs:
        assert output.num_cached_tokens == 0
        assert_matches_hf(output, hf, k=5)
    computed = llm.engine.stats()["prompt_tokens_computed"] - before
    assert computed == sum(len(p) for p in PROMPTS)  # every prompt token, once


@pytest.mark.parametrize("block_size, chunk", [(1, 5), (16, 16)])
def test_chunked_prefill_adds_up_the_chunks(tiny_llama_path, hf, block_size, chunk):
    llm = make_llm(tiny_llama_path, block_size, max_num_batched_tokens=chunk)
    for output in run(llm, scored(max_tokens=2)):
        assert_matches_hf(output, hf)


@pytest.mark.parametrize("block_size, num_blocks", [(1, 131), (16, 10)])
def test_preemption_recomputes_without_duplicates(tiny_llama_path, hf, block_size, num_blocks):
    """Room for one max_model_len sequence and little more, admitted without
    headroom: the three prompts preempt one another while they prefill (in
    chunks) and decode."""
    llm = make_llm(tiny_llama_path, block_size, num_gpu_blocks_override=num_blocks,
                   schedule_conservativeness=0, max_num_batched_tokens=16)
    outputs = run(llm, scored(max_tokens=40, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert_matches_hf(output, hf)
        assert len(output.outputs[0].token_ids) == 40


@pytest.mark.parametrize("block_size", [1, 16])
def test_max_tokens_0_answers_the_prompt_alone(tiny_llama_path, hf, block_size):
    llm = make_llm(tiny_llama_path, block_size, max_num_batched_tokens=16)
    run(llm, SamplingParams(max_tokens=1), PROMPTS[:1])  # a cached prefix: still finishes
    outputs = run(llm, [scored(max_tokens=0, k=1), SamplingParams(max_tokens=0),
                        scored(max_tokens=0, k=0, n=2)])
    for output in outputs:
        assert output.finished
        for choice in output.outputs:
            assert (choice.token_ids, choice.text, choice.finish_reason) == ([], "", "length")
    assert_matches_hf(outputs[0], hf, k=1)
    assert outputs[1].prompt_logprobs is None and outputs[1].num_cached_tokens > 0
    assert len(outputs[2].outputs) == 2
    assert_matches_hf(outputs[2], hf, k=0)
    assert llm.engine.stats()["generation_tokens"] == 1  # the warm-up's only


def test_a_delta_stream_carries_them_once_after_the_prefill(tiny_llama_path, hf):
    llm = make_llm(tiny_llama_path, 16, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("r", PROMPTS[1], scored(max_tokens=4,
                                               output_kind=RequestOutputKind.DELTA))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 4  # one per token: the prefill's chunks report nothing
    assert [o.prompt_logprobs is not None for o in outputs] == [True, False, False, False]
    whole = copy.deepcopy(outputs[0])
    for output in outputs[1:]:
        whole.add(output)
    assert_matches_hf(whole, hf)


def test_two_tensor_parallel_ranks_score_the_prompt(tiny_llama_path, hf):
    """The rows travel in the encoded step (its sample rows): rank 0 gathers
    their logits from both ranks' vocabulary slices."""
    llm = make_llm(tiny_llama_path, 4, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        for output in run(llm, scored(max_tokens=2)):
            assert_matches_hf(output, hf)
    finally:
        llm.engine.close()
