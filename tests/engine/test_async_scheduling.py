"""Async scheduling (engine/frontend/async_step.py): the same outputs as the
synchronous engine, token for token and logprob for logprob.

On the CPU every launched step has run by the time it returns, so nothing
overlaps in time, but the whole mechanism runs: placeholders scheduled one step
ahead, their input ids fed from the step before's token tensor, tokens committed
a call later, finished sequences' rows dropped, the fallback to synchronous
steps. The CUDA parity test (eager = graphs = graphs + async) skips without a GPU;
bench/gpu/gpu_graphs.py is the GPU acceptance run.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.frontend.async_step import async_reason, plain
from engine.outputs import RequestOutputKind

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_MODEL_LEN = 256


def engine_args(**overrides) -> dict:
    args = dict(dtype="float32", block_size=16, max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks_override=200,
                seed=0, device="cpu")
    args.update(overrides)
    return args


@pytest.fixture(scope="module")
def pair(tiny_llama_path):
    """(synchronous LLM, async LLM) of one configuration, built once per module."""
    built = {}

    def get(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in built:
            args = engine_args(**overrides)
            built[key] = (LLM(str(tiny_llama_path), **args),
                          LLM(str(tiny_llama_path), async_scheduling=True, **args))
        return built[key]

    return get


def prompts(count: int, seed: int = 0, lengths=(5, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def summary(outputs) -> list[tuple]:
    """Everything a request's output says about its tokens."""
    return [(o.request_id is not None, [(c.index, c.token_ids, c.logprobs, c.top_logprobs,
                                         c.text, c.finish_reason, c.stop_reason)
                                        for c in o.outputs]) for o in outputs]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert engine.requests == {}
    assert not engine.scheduler.has_unfinished()
    assert engine.block_manager.block_tables == {}
    engine.block_manager.check_invariants()


def assert_close(got: list[tuple], expected: list[tuple]) -> None:
    """Everything equal but the logprobs, which may differ in their last bits: a
    row dropped after an unforeseen stop made one step a row larger, and a float32
    GEMM may round a row differently at another batch size (async_step.py)."""
    def without_logprobs(rows):
        return [[(c[0], c[1], c[4], c[5], c[6]) for c in choices] for _, choices in rows]

    def logprobs(rows):
        return [value for _, choices in rows for c in choices for value in (c[2] or [])]

    assert without_logprobs(got) == without_logprobs(expected)
    assert logprobs(got) == pytest.approx(logprobs(expected), abs=1e-5)


def both(pair_llms, prompt_list, params, exact: bool = True) -> tuple[list, int]:
    """Run both engines; `exact`: every logprob bit for bit (no unforeseen stop)."""
    sync, overlapped = pair_llms
    before = overlapped.engine.overlap.num_overlapped
    expected = sync.generate(prompt_list, params, use_tqdm=False)
    got = overlapped.generate(prompt_list, params, use_tqdm=False)
    assert_no_leak(sync)
    assert_no_leak(overlapped)
    if exact:
        assert summary(got) == summary(expected)
    else:
        assert_close(summary(got), summary(expected))
    return expected, overlapped.engine.overlap.num_overlapped - before


def test_greedy_with_logprobs_and_more_requests_than_seats(pair):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    expected, overlapped = both(pair(), prompts(9), params)
    assert overlapped > 0  # once nobody waits for a seat, the steps overlap
    assert all(len(o.outputs[0].token_ids) == 24 for o in expected)


def test_nearly_every_step_overlaps_when_nobody_waits(pair):
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True)
    _, overlapped = both(pair(), prompts(4, seed=9, lengths=(3, 12)), params)
    assert overlapped >= 27  # the async path ran: steps launched while one was in flight


def test_seeded_sampling(pair):
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, max_tokens=20,
                             logprobs=1, ignore_eos=True) for i in range(7)]
    params[3] = SamplingParams(temperature=1.2, min_p=0.05, seed=7, n=2, max_tokens=12)
    _, overlapped = both(pair(), prompts(7, seed=1), params)
    assert overlapped > 0


def test_sequences_that_finish_at_different_steps(pair):
    """Stop token, stop string, max_tokens and EOS end rows of one batch at
    different steps; each already had a row in the step after (dropped)."""
    sync, _ = pair()
    prompt_list = prompts(6, seed=2)
    free = sync.generate(prompt_list, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in free]
    text = free[2].outputs[0].text
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[0][4]]),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=30, stop=[text[len(text) // 3:][:4]]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[3][9]],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=17, logprobs=0),
    ]
    expected, overlapped = both(pair(), prompt_list, params, exact=False)
    assert overlapped > 0
    lengths = {len(o.outputs[0].token_ids) for o in expected}
    assert len(lengths) >= 4, lengths  # they did end at different steps
    assert [o.outputs[0].finish_reason for o in expected].count("stop") >= 2


def test_mixed_steps_a_prefill_chunk_beside_decodes(pair, monkeypatch):
    """Long prompts are prefilled in chunks of the 64-token budget while the
    short ones decode: a step with both runs overlapped."""
    sync, overlapped = pair()
    mixed = []
    schedule = overlapped.engine.scheduler.schedule

    def recording():
        output = schedule()
        sizes = {s.num_new_tokens > 1 for s in output.sequences}
        mixed.append(sizes == {True, False})
        return output

    monkeypatch.setattr(overlapped.engine.scheduler, "schedule", recording)
    prompt_list = prompts(3, seed=3, lengths=(4, 8)) + prompts(3, seed=4, lengths=(150, 200))
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    both((sync, overlapped), prompt_list, params)
    assert any(mixed)


def step_until_done(llm: LLM, prompt_list, params, abort_id: str, abort_after: int) -> dict:
    """Drive the engine by hand, aborting `abort_id` once it reported
    `abort_after` tokens; every request's last output."""
    engine = llm.engine
    for i, prompt in enumerate(prompt_list):
        engine.add_request(str(i), prompt, params)
    last = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            last[output.request_id] = summary([output])
        if abort_id in engine.requests and abort_id in last:
            if len(last[abort_id][0][1][0][1]) >= abort_after:
                engine.abort_request(abort_id)
    assert_no_leak(llm)
    return last


def test_a_request_aborted_midway(pair):
    sync, overlapped = pair()
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=1, ignore_eos=True,
                            output_kind=RequestOutputKind.CUMULATIVE)
    prompt_list = prompts(6, seed=5)
    expected = step_until_done(sync, prompt_list, params, "2", 5)
    got = step_until_done(overlapped, prompt_list, params, "2", 5)
    assert got == expected
    assert len(expected["2"][0][1][0][1]) == 5  # it stopped where it was aborted
    assert overlapped.engine.overlap.num_overlapped > 0


def test_preemption_under_a_small_kv_cache(pair):
    """20 blocks for 6 growing sequences: the newest are preempted and recompute."""
    sync, overlapped = pair(num_gpu_blocks_override=20, schedule_conservativeness=0,
                            max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    both((sync, overlapped), prompts(6, seed=6, lengths=(20, 40)), params)
    assert overlapped.engine.scheduler.num_preemptions > 0


def test_a_request_that_is_not_plain_makes_the_steps_synchronous(pair):
    """prompt_logprobs and a repetition penalty read the host's tokens: the step
    in flight is drained and those steps run synchronously; the outputs stay the same."""
    sync, overlapped = pair()
    engine = overlapped.engine.overlap
    before = engine.num_sync_steps
    plain_params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [plain_params, SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=2),
              plain_params, SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3)]
    expected = sync.generate(prompts(4, seed=7), params, use_tqdm=False)
    got = overlapped.generate(prompts(4, seed=7), params, use_tqdm=False)
    assert summary(got) == summary(expected)
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in expected]
    assert engine.num_sync_steps > before
    assert_no_leak(overlapped)


def test_which_requests_are_plain():
    assert plain(SamplingParams(temperature=0.7, seed=3, logprobs=5, stop=["x"], n=2))
    for settings in ({"prompt_logprobs": 1}, {"repetition_penalty": 1.1}, {"min_tokens": 2},
                     {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"max_tokens": 0}):
        assert not plain(SamplingParams(**settings))


def test_engines_that_step_synchronously():
    config = EngineConfig(model="m", max_model_len=64, async_scheduling=True)
    assert async_reason(config, object()) is not None  # no launch: a custom runner
    assert "lora" in async_reason(config.replace(enable_lora=True), object())
    assert EngineConfig(model="m").async_scheduling is False


def test_the_cli_flag():
    import argparse

    from engine.args import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--async-scheduling"])).async_scheduling
    assert not config_from_args(parser.parse_args([])).async_scheduling


def tokenless_llama(folder) -> str:
    """A tiny random Llama from transformers' config class, with no tokenizer (token-id
    prompts): nothing to download, so it runs on a bare GPU machine too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=1024, initializer_range=0.3,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def three_ways(folder: str, device: str, runs) -> list:
    """Token ids of 13 prompts (9 seats: some wait) through an engine per run."""
    rng = random.Random(8)
    prompt_list = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 90))] for _ in range(13)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = []
    for extra in runs:
        llm = LLM(folder, **engine_args(device=device, max_num_seqs=9, max_num_batched_tokens=256,
                                        num_gpu_blocks_override=400), **extra)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params,
                               use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
        graphs = llm.engine.runner.graphs
        if device == "cuda" and not extra.get("enforce_eager"):
            assert graphs is not None and graphs.replays > 0
        if extra.get("async_scheduling"):
            assert llm.engine.overlap.num_overlapped > 20
        del llm, graphs
        if device == "cuda":
            torch.cuda.empty_cache()
    return tokens


def test_a_model_without_a_tokenizer(tmp_path):
    sync, overlapped = three_ways(tokenless_llama(tmp_path), "cpu", ({}, dict(async_scheduling=True)))
    assert sync == overlapped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA parity needs a CUDA device; "
                    "on a CPU machine the CPU tests above cover the async path")
def test_cuda_eager_graphs_and_graphs_with_async_give_the_same_tokens(tmp_path):
    eager, graphs, overlapped = three_ways(tokenless_llama(tmp_path), "cuda", (
        dict(enforce_eager=True), {}, dict(async_scheduling=True)))
    assert eager == graphs == overlapped
