"""SamplingParams.output_kind on the tiny random-weight Llama: DELTA outputs add up
to the CUMULATIVE ones (tokens, text with a stop string held back, logprobs; n=1
and n=2), FINAL_ONLY gives one whole output per request, and a DELTA output holds
only the step's new tokens. Each kind runs in the same batch as CUMULATIVE, so
the two see the very same tokens (logprobs: to float32 rounding, as rows of
different batch positions may differ in the last bits)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.frontend.async_engine import AsyncEngine
from engine.outputs import RequestOutputKind

CUMULATIVE, DELTA, FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                 RequestOutputKind.FINAL_ONLY)
PROMPT = "The capital of France is"

# On a busy 2-core machine two OpenMP threads make small ops wait on each other.
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def llm(tiny_llama_path) -> LLM:
    return LLM(str(tiny_llama_path), dtype="float32", block_size=16, max_model_len=256,
               num_gpu_blocks_override=200, seed=0)


def run(llm: LLM, requests: dict[str, SamplingParams]) -> dict[str, list]:
    """Every output of each request, stepping them all in one batch."""
    engine = llm.engine
    for request_id, params in requests.items():
        engine.add_request(request_id, PROMPT, params)
    outputs = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    return outputs


def each_kind(llm: LLM, params: SamplingParams) -> dict:
    """Outputs of the same request in each kind, by the kind's name."""
    requests = {kind.name: params_with(params, kind) for kind in RequestOutputKind}
    return run(llm, requests)


def params_with(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    return dataclasses.replace(params, output_kind=kind)


def joined(steps, index: int) -> dict:
    """Choice `index` of a DELTA stream, its pieces put back together."""
    pieces = [c for s in steps for c in s.outputs if c.index == index]
    with_logprobs = pieces[0].logprobs is not None
    return dict(
        text="".join(c.text for c in pieces),
        token_ids=[t for c in pieces for t in c.token_ids],
        logprobs=[lp for c in pieces for lp in c.logprobs] if with_logprobs else None,
        top_logprobs=[t for c in pieces for t in c.top_logprobs] if with_logprobs else None,
        finish_reason=pieces[-1].finish_reason,
        stop_reason=pieces[-1].stop_reason,
    )


def whole(completion) -> dict:
    return {name: getattr(completion, name) for name in
            ("text", "token_ids", "logprobs", "top_logprobs", "finish_reason", "stop_reason")}


def assert_same(got: dict, expected: dict) -> None:
    """Equal choices: exactly, but for the logprobs' float32 rounding."""
    close = {"logprobs", "top_logprobs"}
    assert {k: v for k, v in got.items() if k not in close} == {
        k: v for k, v in expected.items() if k not in close}
    assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-5)
    assert [[t for t, _ in top] for top in got["top_logprobs"]] == [
        [t for t, _ in top] for top in expected["top_logprobs"]]
    assert [lp for top in got["top_logprobs"] for _, lp in top] == pytest.approx(
        [lp for top in expected["top_logprobs"] for _, lp in top], abs=1e-5)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, **kw)


def check_delta(steps, cumulative, n: int) -> None:
    final = cumulative[-1]
    assert final.finished and steps[-1].finished
    assert all(not s.finished for s in steps[:-1])
    for index in range(n):
        assert_same(joined(steps, index), whole(final.outputs[index]))
    for s in steps:
        for c in s.outputs:  # only the choices that moved, each with what it added
            assert c.changed
            assert c.delta_text == c.text and c.delta_token_ids == c.token_ids


def check_final_only(steps, cumulative, n: int) -> None:
    [final] = steps
    expected = cumulative[-1]
    assert final.finished and len(final.outputs) == n
    for c, e in zip(final.outputs, expected.outputs):
        assert_same(whole(c), whole(e))
        assert c.delta_text == c.text and c.delta_token_ids == c.token_ids


def test_delta_and_final_only_match_cumulative(llm):
    outputs = each_kind(llm, greedy())
    cumulative = outputs["CUMULATIVE"]
    assert len(cumulative) == 24 and len(cumulative[-1].outputs[0].token_ids) == 24
    check_delta(outputs["DELTA"], cumulative, 1)
    check_final_only(outputs["FINAL_ONLY"], cumulative, 1)


def test_delta_outputs_hold_only_the_new_tokens(llm):
    steps = run(llm, {"d": params_with(greedy(), DELTA)})["d"]
    assert len(steps) == 24  # one token a step: each output holds it alone
    for s in steps:
        [c] = s.outputs
        assert len(c.token_ids) == len(c.logprobs) == len(c.top_logprobs) == 1


def test_stop_string_held_back(llm):
    text = run(llm, {"base": greedy()})["base"][-1].outputs[0].text
    start = next(i for i in range(len(text) // 2, len(text) - 4) if text[i:i + 4].isalpha())
    stop = text[start:start + 4]
    outputs = each_kind(llm, greedy(stop=stop))
    cumulative = outputs["CUMULATIVE"]
    final = cumulative[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.text == text[:text.find(stop)]
    check_delta(outputs["DELTA"], cumulative, 1)
    check_final_only(outputs["FINAL_ONLY"], cumulative, 1)
    streamed = ""
    for s in outputs["DELTA"]:  # the held-back stop string never shows
        streamed += s.outputs[0].text
        assert stop not in streamed


def sampled(**kw) -> SamplingParams:
    return SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=12, ignore_eos=True,
                          logprobs=1, **kw)


def early_stop_token(llm) -> tuple[int, int]:
    """A stop token id that ends choice 0 after a few tokens and never choice 1
    (each choice's seed is its own, so its tokens before a stop do not change)."""
    [a, b] = run(llm, {"probe": sampled()})["probe"][-1].outputs
    for k in range(2, 8):
        token = a.token_ids[k]
        if token not in a.token_ids[:k] and token not in b.token_ids:
            return token, k + 1
    pytest.fail(f"no token of {a.token_ids} ends choice 0 alone")


def test_n2_with_one_choice_finishing_first(llm):
    stop_token, length = early_stop_token(llm)
    outputs = each_kind(llm, sampled(stop_token_ids=[stop_token]))
    cumulative = outputs["CUMULATIVE"]
    first, second = cumulative[-1].outputs
    assert (len(first.token_ids), first.finish_reason) == (length, "stop")
    assert (len(second.token_ids), second.finish_reason) == (12, "length")
    check_delta(outputs["DELTA"], cumulative, 2)
    check_final_only(outputs["FINAL_ONLY"], cumulative, 2)
    # Once choice 0 finished, DELTA outputs carry choice 1 alone...
    choices = [[c.index for c in s.outputs] for s in outputs["DELTA"]]
    ends = [i for i, s in enumerate(outputs["DELTA"]) for c in s.outputs if c.finished]
    assert choices[ends[0] + 1:] == [[1]] * (len(choices) - ends[0] - 1)
    assert len(choices) > ends[0] + 1
    # ...while CUMULATIVE keeps every choice, the finished one marked unchanged.
    changed = [s.outputs[0].changed for s in cumulative]
    assert changed == [True] * length + [False] * (len(cumulative) - length)


def test_generate_asks_final_only(llm, monkeypatch):
    """LLM.generate returns whole outputs whatever the kind asked, from one
    engine output per request."""
    reference = run(llm, {"ref": greedy()})["ref"][-1]
    seen = []
    step = llm.engine.step

    def counting_step():
        outputs = step()
        seen.extend(outputs)
        return outputs

    monkeypatch.setattr(llm.engine, "step", counting_step)
    [out] = llm.generate([PROMPT], params_with(greedy(), DELTA), use_tqdm=False)
    assert len(seen) == 1 and seen[0] is out
    assert_same(whole(out.outputs[0]), whole(reference.outputs[0]))


def test_output_kind_must_be_a_kind():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_async_engine_passes_the_kind_through(tiny_llama_path):
    """The service's path: DELTA and FINAL_ONLY reach the consumer as the engine made them."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), max_model_len=256,
                                    kv_cache_memory_bytes=16 << 20, dtype="float32"))

    async def body():
        bridge = AsyncEngine(engine)
        bridge.start()
        try:
            streams = [bridge.generate(kind.name, PROMPT, params_with(greedy(), kind))
                       for kind in (DELTA, FINAL_ONLY)]
            return [[out async for out in stream] for stream in streams]
        finally:
            bridge.shutdown(timeout=30)

    delta, final_only = asyncio.run(asyncio.wait_for(body(), 60))
    assert [len(s.outputs[0].token_ids) for s in delta] == [1] * 24
    [final] = final_only
    assert final.finished and len(final.outputs[0].token_ids) == 24
    assert_same(joined(delta, 0), whole(final.outputs[0]))
