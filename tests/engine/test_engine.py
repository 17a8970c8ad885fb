"""The engine end to end on the tiny random-weight Llama: many requests with
preemption, seeded sampling, n > 1, stop conditions, errors, abort, streaming
deltas and chat. Every test also checks that no KV block leaks."""

from __future__ import annotations

import json
import random

import pytest

from engine import LLM, SamplingParams
from tiny_models import HERMES_CHAT_TEMPLATE

MAX_MODEL_LEN = 256
VOCAB = 49152


# On a busy 2-core machine two OpenMP threads make small ops wait on each other.
pytestmark = pytest.mark.usefixtures("single_thread")


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    bm = engine.block_manager
    assert engine.requests == {}
    assert not engine.scheduler.has_unfinished()
    assert bm.block_tables == {}
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def run(llm: LLM, prompts, params) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm)
    return outputs


def ids_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama_path) -> LLM:
    return LLM(
        str(tiny_llama_path),
        dtype="float32",
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=1100,
        seed=0,
    )


@pytest.fixture(scope="module")
def small_llm(tiny_llama_path) -> LLM:
    """Room for one max_model_len sequence and a little more; admitting without
    headroom for growth (schedule_conservativeness=0) forces preemption."""
    return LLM(
        str(tiny_llama_path),
        dtype="float32",
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=20,
        schedule_conservativeness=0,
        seed=1,
    )


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# -- many requests, with and without memory pressure ----------------------------------------
def mixed_workload(count: int = 64):
    rng = random.Random(2024)
    prompts, params = [], []
    for i in range(count):
        length = rng.choice([1, 2, 15, 16, 17, 31, 33, 64, 100, 128, 199, 200]) if i < 24 \
            else rng.randint(1, 200)
        prompts.append([rng.randrange(3, VOCAB) for _ in range(length)])
        max_tokens = rng.randint(1, 16)
        kind = i % 3
        if kind == 0:
            params.append(greedy(max_tokens))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_k=50, seed=1000 + i,
                                         max_tokens=max_tokens))
        else:
            params.append(SamplingParams(temperature=1.0, max_tokens=max_tokens))
    return prompts, params


@pytest.fixture(scope="module")
def workload_reference(llm):
    prompts, params = mixed_workload()
    return prompts, params, run(llm, prompts, params)


def test_many_mixed_requests_complete(workload_reference, llm):
    prompts, params, outputs = workload_reference
    assert len(outputs) == len(prompts) == 64
    assert [o.request_id for o in outputs] == sorted(
        (o.request_id for o in outputs), key=int
    )  # prompt order
    for prompt, sp, out in zip(prompts, params, outputs):
        assert out.finished
        assert out.prompt_token_ids == prompt
        assert len(out.outputs) == 1
        completion = out.outputs[0]
        assert all(0 <= t < VOCAB for t in completion.token_ids)
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == sp.max_tokens
        else:  # only EOS can stop these
            assert completion.finish_reason == "stop"
            assert completion.token_ids[-1] in llm.engine.eos_token_ids
            assert len(completion.token_ids) <= sp.max_tokens
    assert llm.engine.scheduler.num_preemptions == 0


def test_preemption_keeps_greedy_and_seeded_outputs(workload_reference, small_llm):
    prompts, params, reference = workload_reference
    before = small_llm.engine.scheduler.num_preemptions
    outputs = run(small_llm, prompts, params)
    assert len(outputs) == 64
    assert small_llm.engine.scheduler.num_preemptions > before
    for sp, ref, out in zip(params, reference, outputs):
        assert out.prompt_token_ids == ref.prompt_token_ids
        if sp.greedy or sp.seed is not None:
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert out.outputs[0].text == ref.outputs[0].text
            assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
        else:
            assert out.outputs[0].finish_reason in ("length", "stop")


def test_output_stops_at_max_model_len(llm):
    prompt = list(range(100, 100 + MAX_MODEL_LEN - 6))
    [out] = run(llm, [prompt], greedy(50, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].finish_reason == "length"
    [out] = run(llm, [list(range(100, 100 + MAX_MODEL_LEN - 1))], greedy(50, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"


# -- seeded sampling -----------------------------------------------------------------------------
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=20)
SEEDED_PROMPT = "Once upon a time, in a quiet village"


@pytest.fixture(scope="module")
def seeded_alone(llm):
    [out] = run(llm, [SEEDED_PROMPT], SEEDED)
    assert len(out.outputs[0].token_ids) == 20
    return out.outputs[0].token_ids


def filler(i: int):
    rng = random.Random(i)
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 150))]
    if i % 2:
        sp = SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 25))
    else:
        sp = SamplingParams(temperature=0.7, seed=i, max_tokens=rng.randint(1, 25))
    return prompt, sp


@pytest.mark.parametrize("position", [0, 4, 10])
def test_seeded_sampling_independent_of_batch(llm, seeded_alone, position):
    others = [filler(i + 10 * position) for i in range(10)]
    prompts = [p for p, _ in others]
    params = [sp for _, sp in others]
    prompts.insert(position, SEEDED_PROMPT)
    params.insert(position, SEEDED)
    outputs = run(llm, prompts, params)
    assert outputs[position].outputs[0].token_ids == seeded_alone


def test_seeded_sampling_same_on_another_instance(small_llm, seeded_alone):
    # another engine with another memory size, budget and default seed
    prompts = [filler(i)[0] for i in range(3)] + [SEEDED_PROMPT]
    params = [filler(i)[1] for i in range(3)] + [SEEDED]
    outputs = run(small_llm, prompts, params)
    assert outputs[3].outputs[0].token_ids == seeded_alone


def test_seeded_sampling_same_after_repeat(llm, seeded_alone):
    [out] = run(llm, [SEEDED_PROMPT], SEEDED)
    assert out.outputs[0].token_ids == seeded_alone


def test_different_seeds_differ(llm, seeded_alone):
    prompts = [SEEDED_PROMPT, "The weather today", "def main():"]
    seeds = [42, 43, 44]
    params, batch = [], []
    for prompt in prompts:
        for seed in seeds:
            batch.append(prompt)
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=20))
    outputs = ids_of(run(llm, batch, params))
    assert outputs[0] == seeded_alone
    per_prompt = [outputs[i * 3:(i + 1) * 3] for i in range(len(prompts))]
    assert any(len({tuple(o) for o in group}) > 1 for group in per_prompt)


# -- n > 1 ---------------------------------------------------------------------------------------
def test_n_samples_match_separate_seeded_requests(llm):
    prompt = "A list of fruits:"
    multi = SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=7, max_tokens=12)
    singles = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=12)
               for i in range(3)]
    outputs = run(llm, [prompt, prompt, prompt, prompt], [multi] + singles)
    completions = outputs[0].outputs
    assert [c.index for c in completions] == [0, 1, 2]
    assert outputs[0].finished
    for i, completion in enumerate(completions):
        assert completion.finish_reason is not None
        assert completion.token_ids == outputs[1 + i].outputs[0].token_ids
        assert completion.text == outputs[1 + i].outputs[0].text


def test_n_unseeded_and_greedy(llm):
    outputs = run(llm, ["Hi", "Hi"], [SamplingParams(n=4, temperature=1.0, max_tokens=5),
                                      greedy(5, n=2)])
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 5 for c in outputs[0].outputs)
    a, b = outputs[1].outputs
    assert a.token_ids == b.token_ids and a.text == b.text


# -- stop conditions -------------------------------------------------------------------------------
STOP_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def base(llm):
    """Greedy continuation of STOP_PROMPT without any stop condition."""
    [out] = run(llm, [STOP_PROMPT], greedy(30, ignore_eos=True))
    completion = out.outputs[0]
    assert len(completion.token_ids) == 30
    return completion


def test_max_tokens_is_length(base):
    assert base.finish_reason == "length"
    assert base.stop_reason is None


def test_stop_string(llm, base, tokenizer):
    text = base.text
    # a short stop string from the middle of the text, made of letters only
    start = next(i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].isalpha())
    stop = text[start:start + 3]
    first = text.find(stop)
    outputs = run(llm, [STOP_PROMPT] * 3, [
        greedy(30, ignore_eos=True, stop=[stop]),
        greedy(30, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
        greedy(30, ignore_eos=True, stop=["\x00never\x00", stop]),
    ])
    for out, expected in zip(outputs, (text[:first], text[:first + len(stop)], text[:first])):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.stop_reason == stop
        assert completion.text == expected
        ids = completion.token_ids
        assert ids == base.token_ids[:len(ids)]
        # it stopped at the very token that completed the stop string
        assert stop in decode(tokenizer, ids)[first:]
        assert stop not in decode(tokenizer, ids[:-1])
    # min_tokens at the boundary: the stop string completes with output token
    # number j, so min_tokens=j still stops there and min_tokens=j+1 does not
    j = len(outputs[0].outputs[0].token_ids)
    at, after = (o.outputs[0] for o in run(llm, [STOP_PROMPT] * 2, [
        greedy(30, ignore_eos=True, stop=stop, min_tokens=j),
        greedy(30, ignore_eos=True, stop=stop, min_tokens=j + 1),
    ]))
    assert at.token_ids == outputs[0].outputs[0].token_ids
    assert (at.finish_reason, at.stop_reason, at.text) == ("stop", stop, text[:first])
    assert after.token_ids == base.token_ids[:len(after.token_ids)]
    assert len(after.token_ids) > j
    later = text.find(stop, first + 1)
    if after.finish_reason == "stop":
        assert after.stop_reason == stop and after.text == text[:later]
    else:
        assert after.token_ids == base.token_ids and after.text == text


def test_stop_token_ids(llm, base):
    k = next(i for i in range(3, 30) if base.token_ids[i] not in base.token_ids[:i])
    stop_id = base.token_ids[k]
    outputs = run(llm, [STOP_PROMPT] * 3, [
        greedy(30, ignore_eos=True, stop_token_ids=[stop_id]),
        greedy(30, ignore_eos=True, stop_token_ids=[stop_id], include_stop_str_in_output=True),
        greedy(k, ignore_eos=True),
    ])
    plain, included, prefix = (o.outputs[0] for o in outputs)
    for completion in (plain, included):
        assert completion.token_ids == base.token_ids[:k + 1]
        assert completion.finish_reason == "stop"
        assert completion.stop_reason == stop_id
    assert plain.text == prefix.text  # the stop token's text is left out
    assert included.text.startswith(prefix.text) and len(included.text) > len(prefix.text)


def test_min_tokens_with_stop_token_ids(llm, base):
    stop_id = base.token_ids[1]
    [out] = run(llm, [STOP_PROMPT], greedy(30, ignore_eos=True, stop_token_ids=[stop_id],
                                            min_tokens=6))
    ids = out.outputs[0].token_ids
    assert ids[0] == base.token_ids[0]
    assert ids[1] != stop_id
    assert stop_id not in ids[:6]
    assert len(ids) >= 6
    if out.outputs[0].finish_reason == "stop":
        assert ids[-1] == stop_id and ids.count(stop_id) == 1
    else:
        assert len(ids) == 30


@pytest.fixture(scope="module")
def eos_setup(tiny_llama_path, tmp_path_factory, base):
    """The tiny model with its EOS set to a token it greedily produces for
    STOP_PROMPT, so EOS handling can be tested exactly."""
    k = next(i for i in range(2, 30) if base.token_ids[i] not in base.token_ids[:i])
    eos = base.token_ids[k]
    folder = tmp_path_factory.mktemp("tiny-eos")
    for item in tiny_llama_path.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((tiny_llama_path / "config.json").read_text())
    config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), block_size=16, max_model_len=MAX_MODEL_LEN, dtype="float32",
              num_gpu_blocks_override=64, max_num_batched_tokens=256)
    assert eos in llm.engine.eos_token_ids
    return llm, eos, k


def test_eos_stops_and_min_tokens_respected(eos_setup, base):
    llm, eos, k = eos_setup
    outputs = run(llm, [STOP_PROMPT] * 6, [
        greedy(30),
        greedy(30, ignore_eos=True),
        greedy(30, min_tokens=k + 3),
        greedy(k),
        greedy(30, min_tokens=k),  # EOS is token k + 1: allowed
        greedy(30, min_tokens=k + 1),  # EOS is banned as token k + 1
    ])
    stopped, ignored, held, prefix, at, after = (o.outputs[0] for o in outputs)
    assert at.token_ids == stopped.token_ids and at.finish_reason == "stop"
    assert after.token_ids[:k] == base.token_ids[:k]
    assert after.token_ids[k] != eos and len(after.token_ids) > k + 1
    assert stopped.token_ids == base.token_ids[:k + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason is None
    assert stopped.text == prefix.text
    assert ignored.token_ids == base.token_ids
    assert ignored.finish_reason == "length"
    assert held.token_ids[:k] == base.token_ids[:k]
    assert eos not in held.token_ids[:k + 3]
    assert len(held.token_ids) >= k + 3
    if held.finish_reason == "stop":
        assert held.token_ids[-1] == eos and held.token_ids.count(eos) == 1
    else:
        assert held.finish_reason == "length" and len(held.token_ids) == 30


# -- bad prompts ------------------------------------------------------------------------------------
GOOD = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def good_reference(llm):
    return ids_of(run(llm, [GOOD], greedy(8)))[0]


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (list(range(1, MAX_MODEL_LEN + 1)),
         rf"the prompt has {MAX_MODEL_LEN} tokens.*max_model_len={MAX_MODEL_LEN}"),
        (list(range(1, MAX_MODEL_LEN + 41)),
         rf"the prompt has {MAX_MODEL_LEN + 40} tokens.*max_model_len={MAX_MODEL_LEN}"),
        ([], r"the prompt is empty"),
        ("", r"the prompt is empty"),
        ([5, VOCAB, 6], rf"token id {VOCAB} is outside the vocabulary \(0..{VOCAB - 1}\)"),
        ([5, -1], r"token id -1 is outside the vocabulary"),
    ],
)
@pytest.mark.parametrize("where", [0, 1])
def test_bad_prompt_raises_and_engine_recovers(llm, good_reference, bad, pattern, where):
    prompts = [GOOD, GOOD]
    prompts.insert(where, bad)
    if bad == []:
        # also through the {"prompt_token_ids": [...]} form
        prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    with pytest.raises(ValueError, match=pattern):
        llm.generate(prompts, greedy(8), use_tqdm=False)
    assert_no_leak(llm)
    assert ids_of(run(llm, [GOOD, GOOD], greedy(8))) == [good_reference, good_reference]


@pytest.mark.parametrize(
    "bad", [[6.5] + list(range(10, 20)), [5, 6.5], [5, True], [5, "6"]],
    ids=["float-early", "float-last", "bool", "str"],
)
def test_non_integer_token_ids_are_value_errors(llm, good_reference, bad):
    try:
        with pytest.raises(ValueError, match="token id"):
            llm.generate([GOOD, bad], greedy(8), use_tqdm=False)
    finally:
        assert_no_leak(llm)
    assert ids_of(run(llm, [GOOD], greedy(8))) == [good_reference]


def test_bad_prompt_via_engine_add_request(llm, good_reference):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", [7] * MAX_MODEL_LEN, greedy(4))
    assert "too-long" not in engine.requests
    engine.add_request("dup", GOOD, greedy(8))
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", GOOD, greedy(8))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.request_id == "dup" and final.finished
    assert final.outputs[0].token_ids == good_reference
    assert_no_leak(llm)


def test_longest_allowed_prompt(llm):
    [out] = run(llm, [list(range(1, MAX_MODEL_LEN))], greedy(8))
    assert len(out.outputs[0].token_ids) == 1


# -- abort -----------------------------------------------------------------------------------------------
def test_abort_frees_blocks_and_others_finish(llm):
    engine = llm.engine
    bm = engine.block_manager
    prompts = {"a": list(range(10, 50)), "b": list(range(60, 130)), "c": list(range(200, 230))}
    expected = dict(zip(prompts, ids_of(run(llm, list(prompts.values()), greedy(12)))))
    for request_id, prompt in prompts.items():
        engine.add_request(f"abort-{request_id}", prompt, greedy(12))
    engine.add_request("abort-d", list(range(300, 320)), greedy(12))
    for _ in range(3):
        engine.step()
    b_seq = engine.requests["abort-b"].seqs[0]
    assert bm.has(b_seq.seq_id)
    b_blocks = len(bm.block_table(b_seq.seq_id))
    assert b_blocks == bm.blocks_for(b_seq.num_computed_tokens)
    free_before = bm.num_free_blocks
    engine.abort_request("abort-b")
    assert not bm.has(b_seq.seq_id)
    assert bm.num_free_blocks == free_before + b_blocks
    assert b_seq.finish_reason == "abort"
    assert "abort-b" not in engine.requests
    bm.check_invariants()
    engine.abort_request("abort-b")  # twice: ignored
    engine.abort_request("no-such-request")
    engine.abort_request("abort-d")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in ("abort-b", "abort-d")
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished == {"abort-a": expected["a"], "abort-c": expected["c"]}
    # b was prefilled in step 1 and decoded in steps 2 and 3, then stopped
    assert b_seq.output_token_ids == expected["b"][:3]
    assert_no_leak(llm)


# -- streaming --------------------------------------------------------------------------------------
def stream(llm, request_id, prompt, params):
    engine = llm.engine
    engine.add_request(request_id, prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            steps.append(out)
    assert_no_leak(llm)
    return steps


def test_streaming_deltas_add_up(llm):
    steps = stream(llm, "stream-1", "Streaming works like this:", greedy(24, ignore_eos=True))
    final = steps[-1]
    assert final.finished and all(not s.finished for s in steps[:-1])
    assert len(steps) == 24
    completion = final.outputs[0]
    assert "".join(s.outputs[0].delta_text for s in steps) == completion.text
    assert [t for s in steps for t in s.outputs[0].delta_token_ids] == completion.token_ids
    assert all(len(s.outputs[0].delta_token_ids) == 1 for s in steps)
    for i, s in enumerate(steps):  # cumulative fields grow step by step
        assert s.outputs[0].token_ids == completion.token_ids[: i + 1]
        assert completion.text.startswith(s.outputs[0].text[: len(s.outputs[0].text) - 1])
    [batch] = run(llm, ["Streaming works like this:"], greedy(24, ignore_eos=True))
    assert batch.outputs[0].text == completion.text


def test_streaming_never_shows_the_stop_string(llm, base):
    text = base.text
    start = next(i for i in range(len(text) // 2, len(text) - 4) if text[i:i + 4].isalpha())
    stop = text[start:start + 4]
    steps = stream(llm, "stream-2", STOP_PROMPT, greedy(30, ignore_eos=True, stop=stop))
    completion = steps[-1].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    deltas = [s.outputs[0].delta_text for s in steps]
    assert "".join(deltas) == completion.text == text[: text.find(stop)]
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert stop not in streamed


def test_streaming_n2(llm):
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=10)
    steps = stream(llm, "stream-3", "Two answers:", params)
    final = steps[-1]
    for index in range(2):
        completion = final.outputs[index]
        assert "".join(s.outputs[index].delta_text for s in steps) == completion.text
        assert [t for s in steps for t in s.outputs[index].delta_token_ids] == completion.token_ids


# -- chat -----------------------------------------------------------------------------------------
def test_chat_passes_tools_to_the_template(llm, tokenizer):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "Time?"}]
    original = tokenizer.chat_template  # the engine's own tokenizer: restored after
    tokenizer.chat_template = HERMES_CHAT_TEMPLATE
    try:
        expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True)
        [out] = llm.chat(messages, greedy(2), use_tqdm=False, tools=tools)
    finally:
        tokenizer.chat_template = original
    assert '"name": "get_time"' in expected
    assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)


def test_chat(llm, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    [out] = llm.chat(messages, greedy(8), use_tqdm=False)
    assert out.prompt_token_ids == list(expected)
    assert isinstance(out.outputs[0].text, str)
    assert 1 <= len(out.outputs[0].token_ids) <= 8
    # a list of conversations gives one output each, in order
    second = [{"role": "user", "content": "And another?"}]
    outs = llm.chat([messages, second], greedy(8), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs][0] == list(expected)
    assert outs[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert len(outs) == 2
    assert_no_leak(llm)
