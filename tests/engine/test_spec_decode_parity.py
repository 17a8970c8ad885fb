"""Speculative decoding gives the same tokens as plain decoding: SmolLM2 in
float32 (the HF-exact path), greedy and seeded, across block sizes, prefix
hits, chunked prefill, forced preemption, stop strings, n = 2 and a JSON
schema. Each case also checks that drafts were accepted, so the speculative
path really ran."""

from __future__ import annotations

import json

import pytest

from engine.frontend.llm import LLM
from engine.sampling.structured_outputs import StructuredOutputsParams
from engine.sampling_params import SamplingParams

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, "
           "carrying a can of oil and a cloth to polish the great brass lens. "
           "Ships passing the rocky point trusted the light to guide them home.")
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{PASSAGE}"}],
    [{"role": "user", "content": "Fix the typos and return the whole sentence: "
                                 "The quik brown fox jumpd over the lazzy dog near the rivr."}],
    [{"role": "user", "content": "Write a short poem about autumn."}],  # open, not grounded
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
BASE = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20, num_threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
SHORT = SamplingParams(temperature=0.0, max_tokens=32)  # the layout variants


@pytest.fixture(scope="module")
def reference(smollm2_path):
    llm = LLM(str(smollm2_path), **BASE)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def speculative(smollm2_path):
    llm = LLM(str(smollm2_path), speculative_config=NGRAM, **BASE)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def expected(reference):
    """params -> the reference's tokens for CONVERSATIONS, each computed once in
    the module (GREEDY and SHORT serve several tests)."""
    done = {}

    def get(params):
        if id(params) not in done:
            done[id(params)] = token_ids(reference, params)
        return done[id(params)]

    return get


def token_ids(llm, params=GREEDY, conversations=CONVERSATIONS):
    return [[list(c.token_ids) for c in out.outputs]
            for out in llm.chat(conversations, params, use_tqdm=False)]


def accepted(llm) -> int:
    return llm.engine.speculator.stats.num_accepted_tokens


def assert_same_with_drafts(llm, expected, params=GREEDY, conversations=CONVERSATIONS):
    before = accepted(llm)
    assert token_ids(llm, params, conversations) == expected
    assert accepted(llm) > before, "no draft token was accepted: speculation never ran"


def test_greedy_outputs_equal_with_prefix_hits(expected, speculative):
    assert_same_with_drafts(speculative, expected(GREEDY))
    hits = speculative.engine.block_manager.stats.hits
    assert_same_with_drafts(speculative, expected(GREEDY))  # the same prompts again: prefix hits
    assert speculative.engine.block_manager.stats.hits > hits


@pytest.mark.parametrize("engine_args", [
    dict(block_size=1), dict(block_size=128), dict(max_num_batched_tokens=32),
    # prompts of 37, 58 and 81 tokens, 32 out each: 19 blocks of 16 wanted, 12 usable
    dict(num_gpu_blocks_override=13, block_size=16, max_model_len=192,
         schedule_conservativeness=0.0),
], ids=["block-1", "block-128", "chunked-prefill", "preemption"])
def test_greedy_outputs_equal_in_every_layout(smollm2_path, expected, engine_args):
    llm = LLM(str(smollm2_path), speculative_config=NGRAM, **{**BASE, **engine_args})
    try:
        assert_same_with_drafts(llm, expected(SHORT), SHORT)
        if "num_gpu_blocks_override" in engine_args:
            assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.close()


def test_suffix_decoding_gives_the_same_tokens(smollm2_path, expected):
    llm = LLM(str(smollm2_path), speculative_config={"method": "suffix"}, **BASE)
    try:
        assert_same_with_drafts(llm, expected(GREEDY))
    finally:
        llm.engine.close()


def test_stop_strings_n2_and_seeded_sampling_equal(reference, speculative):
    stop = SamplingParams(temperature=0.0, max_tokens=48, stop=["brass"])
    expected = token_ids(reference, stop)
    assert token_ids(speculative, stop) == expected
    outs = speculative.chat(CONVERSATIONS[0], stop, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop" and "brass" not in outs[0].outputs[0].text
    pair = SamplingParams(temperature=0.0, max_tokens=48, n=2)
    assert_same_with_drafts(speculative, token_ids(reference, pair), pair)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=11, n=2)
    assert_same_with_drafts(speculative, token_ids(reference, seeded), seeded)


def test_json_schema_outputs_equal(reference, speculative):
    schema = {"type": "object", "properties": {"quote": {"type": "string"}},
              "required": ["quote"]}
    params = SamplingParams(temperature=0.0, max_tokens=96,
                            structured_outputs=StructuredOutputsParams(json=schema))
    conversation = [[{"role": "user", "content": "Answer in JSON with the key quote: "
                                                 f"quote this exactly: {PASSAGE}"}]]
    expected = token_ids(reference, params, conversation)
    assert_same_with_drafts(speculative, expected, params, conversation)
    text = speculative.get_tokenizer().decode(expected[0][0], skip_special_tokens=True)
    assert json.loads(text)["quote"]
