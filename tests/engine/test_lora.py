"""LoRA adapters against HF + PEFT: greedy float32, token for token, the base
and three adapters mixed in one batch.

Tiny random checkpoints (a Llama with GQA; Phi-3, whose checkpoints and
adapters fuse q/k/v and gate/up) and random PEFT adapters with non-zero B
(ranks 4 / 8 / 16, different targets, rsLoRA on one), written by peft. Each
prompt runs under the base and under every adapter in the same `generate`,
so every step mixes rows of four weight sets, with the prefix cache on (the
same prompt under two adapters must never share a block), under the
scheduling paths that matter: block sizes 1, 16 and 128, chunked prefill,
forced preemption, and fewer slots than adapters. The comparison rule is
test_hf_parity's (a near-tie at the first divergence is allowed).
"""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.errors import ValidationError
from hf_compare import TOP_K, compare
from lora_models import ADAPTERS, hf_peft_greedy, make_adapter, make_adapters
from test_hf_parity import make_prompts
from tiny_models import make_tiny_family, make_tiny_model

NUM_NEW_TOKENS = 16
CONFIGS = [
    ("block1", dict(block_size=1)),
    ("block128", dict(block_size=128)),
    ("block16-chunked", dict(block_size=16, max_num_batched_tokens=32)),
    ("block16-preempt", dict(block_size=16, max_num_batched_tokens=48, max_model_len=400,
                             num_gpu_blocks_override=40, schedule_conservativeness=0)),
    ("two-slots", dict(block_size=16, max_loras=2)),
    # n-gram drafts: a sequence's drafted rows run under its adapter too
    ("ngram", dict(block_size=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 64})),
]


@pytest.fixture(scope="module", params=["llama", "phi3"])
def lora_case(request, tmp_path_factory, smollm2_path, single_thread):
    """(base folder, {adapter: folder}, prompts, {adapter or None: HF + PEFT outputs})."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    if request.param == "llama":
        base = make_tiny_model(root / "base", smollm2_path)
    else:
        base = make_tiny_family(root / "base", "phi3", smollm2_path)
    adapters = make_adapters(base, root, fused=request.param == "phi3")
    prompts = make_prompts(AutoTokenizer.from_pretrained(str(base)))[:6]
    expected = {name: hf_peft_greedy(base, folder, prompts, NUM_NEW_TOKENS)
                for name, folder in [(None, None), *adapters.items()]}
    return base, adapters, prompts, expected


def requests_of(adapters: dict) -> dict:
    return {name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(adapters.items())}


def engine_greedy(base, adapters, prompts, **engine_args):
    """Every prompt under the base and each adapter, in one generate call."""
    args = dict(dtype="float32", enable_lora=True, max_loras=len(adapters), max_lora_rank=16)
    llm = LLM(str(base), **{**args, **engine_args})
    loras = [None, *requests_of(adapters).values()]
    items = [(p, lora) for lora in loras for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in items], params, use_tqdm=False,
                           lora_request=[lora for _, lora in items])
    results = {}
    for (prompt, lora), output in zip(items, outputs):
        completion = output.outputs[0]
        results.setdefault(None if lora is None else lora.lora_name, []).append(
            (completion.token_ids, [dict(pairs) for pairs in completion.top_logprobs]))
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    return results, engine


@pytest.mark.parametrize("name,engine_args", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_mixed_batch_matches_hf_peft(lora_case, name, engine_args):
    base, adapters, prompts, expected = lora_case
    actual, engine = engine_greedy(base, adapters, prompts, **engine_args)
    if "preempt" in name:
        assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    if name == "ngram":
        assert engine.speculator.stats.num_drafts > 0, "no draft was proposed"
    for adapter, outputs in expected.items():
        result = compare(outputs, actual[adapter])
        assert result["ok"], f"{name}/{adapter}: diverged beyond a near-tie at {result['failures']}"
        assert result["exact"] >= len(prompts) - 2, f"{name}/{adapter}: too many near-ties {result}"


def test_adapters_change_the_outputs(lora_case):
    """The reference itself: each adapter moves some prompt's greedy tokens off the base's."""
    _, _, _, expected = lora_case
    base_ids = [ids for ids, _ in expected[None]]
    for name in ADAPTERS:
        assert [ids for ids, _ in expected[name]] != base_ids, f"{name} changes nothing"


def test_evicted_adapter_reloads_the_same(lora_case):
    """max_cpu_loras=1: each adapter pushes the previous one out of host memory;
    read again from its folder, it gives the same tokens."""
    base, adapters, prompts, expected = lora_case
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    requests = requests_of(adapters)
    for name in [*ADAPTERS, *ADAPTERS]:
        outputs = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False,
                               lora_request=requests[name])
        assert list(outputs[0].outputs[0].token_ids) == expected[name][2][0]
        assert list(llm.engine.runner.lora.cache) == [requests[name].lora_int_id]


def test_remove_waits_for_running_requests(lora_case):
    base, adapters, prompts, _ = lora_case
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    engine = llm.engine
    request = requests_of(adapters)["qv-r4"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompts[1], params, lora_request=request)
    engine.step()
    assert engine.remove_lora(request.lora_int_id)
    assert engine.list_loras() == []  # gone for new requests, kept for "a"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.list_loras() == []
    assert not engine.remove_lora(request.lora_int_id)


def test_refusals_name_the_field(lora_case, tmp_path):
    base, adapters, prompts, _ = lora_case
    plain = LLM(str(base), dtype="float32")
    with pytest.raises(ValidationError, match="enable_lora"):
        plain.engine.add_lora(requests_of(adapters)["qv-r4"])
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    cases = {
        "r=16 is above --max-lora-rank=8": adapters["mlp-r16"],
        "use_dora": make_adapter(base, tmp_path / "dora", 1, r=4, use_dora=True,
                                 target_modules=["o_proj"]),
        "embedding or LM-head": make_adapter(base, tmp_path / "embed", 1, r=4,
                                             target_modules=["embed_tokens"]),
        "not a PEFT LoRA folder": tmp_path,
    }
    for i, (message, folder) in enumerate(cases.items()):
        with pytest.raises(ValidationError, match=message) as error:
            llm.engine.add_lora(LoRARequest(f"bad{i}", 10 + i, str(folder)))
        assert error.value.param == "lora_path"
    assert llm.engine.list_loras() == []



@pytest.mark.parametrize("lora_case", ["llama"], indirect=True)
def test_tensor_parallel_mixed_batch(lora_case):
    """TP=2: each rank reads its slice of every adapter (B's rows of q/k/v and
    gate/up, A's columns of o and down) and maps the step's ids to the same slots."""
    base, adapters, prompts, expected = lora_case
    actual, _ = engine_greedy(base, adapters, prompts, block_size=16, tensor_parallel_size=2)
    for adapter, outputs in expected.items():
        result = compare(outputs, actual[adapter])
        assert result["ok"], f"tp2/{adapter}: diverged beyond a near-tie at {result['failures']}"
        assert result["exact"] >= len(prompts) - 2, f"tp2/{adapter}: too many near-ties {result}"
