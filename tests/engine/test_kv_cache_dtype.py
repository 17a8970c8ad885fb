"""--kv-cache-dtype int8 and fp8 end to end on the tiny random Llama in float32
(the exact-parity setting): prefix-cache hits, copy-on-write forks and
preemption change what is computed, never what a quantized cache generates.
The same budget holds ~1.94x bfloat16's blocks at head_dim 64 (int8; fp8 2x),
and SmolLM2's greedy outputs stay close to its float cache's. The offload tiers' int8 runs, and a tier's block
of another cache dtype, are in test_kv_offload_engine.py; bad values in
test_config.py."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model.kv_cache import KVLayout, check_cache_on_device, resolve_kv_cache_dtype
from tiny_models import make_tiny_model

VOCAB = 49152
BS = 16

# On a busy 2-core machine two OpenMP threads make small ops wait on each other.
pytestmark = pytest.mark.usefixtures("single_thread")


def quantized_llm(path, cache: str, **changes) -> LLM:
    settings = dict(dtype="float32", kv_cache_dtype=cache, block_size=BS, max_model_len=256,
                    max_num_batched_tokens=128, num_gpu_blocks_override=200, seed=0)
    return LLM(str(path), **{**settings, **changes})


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM, prompts, params) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_usable_blocks, "blocks leaked"
    return outputs


def ids_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def random_prompts(count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(*lengths))] for _ in range(count)]


@pytest.fixture(scope="module", params=["int8", "fp8"])
def cache(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llm(tiny_llama_path, cache) -> LLM:
    """The reference: a quantized cache with room for everything and no prefix caching."""
    return quantized_llm(tiny_llama_path, cache, enable_prefix_caching=False)


def test_the_cache_holds_quantized_rows(llm, cache):
    runner = llm.engine.runner
    expected = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[cache]
    assert runner.kv_cache_dtype == expected and runner.dtype == torch.float32
    head_dim = runner.model.args.head_dim + (2 if cache == "int8" else 0)
    assert runner.kv_cache.dtype == expected and runner.kv_cache.shape[-1] == head_dim
    assert runner.read_blocks([1, 2]).shape == (2, runner.block_record_bytes())


def test_prefix_cache_hits_give_the_same_tokens(llm, cache, tiny_llama_path):
    head = random_prompts(1, (40, 40), seed=5)[0]  # two full blocks shared, and a partial one
    prompts = [head + tail for tail in random_prompts(4, (3, 20), seed=6)]
    cached = quantized_llm(tiny_llama_path, cache)
    outputs = ids_of(run(cached, prompts[:1], greedy())) + ids_of(run(cached, prompts[1:], greedy()))
    assert cached.engine.stats()["prefix_cache_hits"] >= 3 * 2 * BS
    assert outputs == ids_of(run(llm, prompts, greedy()))


def test_forked_samples_match_separate_requests(llm, monkeypatch):
    """n=2 shares the prompt's blocks and copies the partial one on write: each
    sample draws what a request of its own with its seed draws."""
    prompt = random_prompts(1, (21, 21), seed=7)[0]  # 21 % 16: a shared partial block
    runner, copies = llm.engine.runner, []
    copy = runner._copy_blocks

    def counted(cache, sources, destinations):
        copies.append(len(sources))
        copy(cache, sources, destinations)

    monkeypatch.setattr(runner, "_copy_blocks", counted)
    [forked] = run(llm, [prompt], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12,
                                                 ignore_eos=True))
    monkeypatch.undo()
    assert copies, "no block was copied on write"
    alone = run(llm, [prompt, prompt], [SamplingParams(temperature=0.8, seed=seed, max_tokens=12,
                                                       ignore_eos=True) for seed in (7, 8)])
    assert [c.token_ids for c in forked.outputs] == ids_of(alone)


def test_preemption_recomputes_the_same_tokens(llm, cache, tiny_llama_path):
    """20 blocks hold one max_model_len sequence and a little more: eight prompts
    admitted without headroom (schedule_conservativeness=0) preempt each other."""
    prompts = random_prompts(8, (20, 120), seed=8)
    small = quantized_llm(tiny_llama_path, cache, enable_prefix_caching=False, num_gpu_blocks_override=20,
                     schedule_conservativeness=0)
    outputs = ids_of(run(small, prompts, greedy(24)))
    assert small.engine.scheduler.num_preemptions > 0
    assert outputs == ids_of(run(llm, prompts, greedy(24)))


# -- the block budget ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def head_dim_64_path(tmp_path_factory, smollm2_path):
    """The tiny Llama with SmolLM2's head_dim, 64 (4 heads of 64 over a hidden size of 64)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-hd64"), smollm2_path, head_dim=64)


def test_the_same_budget_holds_more_quantized_blocks(head_dim_64_path):
    budget = 4 << 20
    blocks = {}
    for dtype, cache in (("bfloat16", "auto"), ("float32", "auto"), ("float32", "int8"), ("bfloat16", "fp8")):
        runner = LLM(str(head_dim_64_path), dtype=dtype, kv_cache_dtype=cache, max_model_len=128,
                     kv_cache_memory_bytes=budget).engine.runner
        assert runner.model.args.head_dim == 64
        assert runner.memory()["kv_cache_bytes"] <= budget
        blocks[dtype if cache == "auto" else cache] = runner.num_blocks
    assert blocks["int8"] >= 1.9 * blocks["bfloat16"]
    assert blocks["int8"] >= 3.8 * blocks["float32"]
    assert blocks["fp8"] >= 1.99 * blocks["bfloat16"]


def test_layout_bytes_per_block():
    """One layer's block of K and V: head_dim codes and a 2-byte scale per row."""
    def layout(dtype):
        return KVLayout(dtype, block_size=16, num_kv_heads=3, head_dim=64)

    assert layout(torch.int8).layer_block_bytes() == 2 * 16 * 3 * 66
    assert layout(torch.bfloat16).layer_block_bytes() == 2 * 16 * 3 * 64 * 2
    assert layout(torch.int8).shape(5, 7) == (2, 5, 7, 16, 3, 66)


@pytest.mark.parametrize("name, serving, expected", [
    ("auto", torch.bfloat16, torch.bfloat16), ("auto", torch.float16, torch.float16),
    ("bfloat16", torch.bfloat16, torch.bfloat16), ("float32", torch.float32, torch.float32),
    ("int8", torch.bfloat16, torch.int8), ("int8", torch.float32, torch.int8),
    ("fp8", torch.bfloat16, torch.float8_e4m3fn), ("fp8_e4m3", torch.float32, torch.float8_e4m3fn),
    ("fp8_e5m2", torch.float16, torch.float8_e5m2),
])
def test_resolved_cache_dtype(name, serving, expected):
    assert resolve_kv_cache_dtype(EngineConfig(kv_cache_dtype=name), serving) == expected


def test_e4m3_is_refused_on_a_gpu_before_sm89():
    """Triton compiles no e4m3 below sm_89 (an A100 is 8.0): refused at start-up, not at the first store."""
    with pytest.raises(ValueError, match=r"fp8_e4m3 needs a GPU of compute capability 8.9.*this one is 8.0"):
        check_cache_on_device(torch.float8_e4m3fn, (8, 0))
    for cache, capability in ((torch.float8_e5m2, (8, 0)), (torch.float8_e4m3fn, (9, 0)),
                              (torch.float8_e4m3fn, None), (torch.int8, (7, 5))):
        check_cache_on_device(cache, capability)


def test_a_float_cache_of_another_dtype_is_refused(tiny_llama_path):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' differs from the serving "
                                         r"dtype float32.*'auto', 'bfloat16', 'float32', 'int8', 'fp8'"):
        LLM(str(tiny_llama_path), dtype="float32", kv_cache_dtype="bfloat16",
            num_gpu_blocks_override=100)


# -- int8 against the float cache on a real model ----------------------------------------------
QUESTIONS = ("What is a KV cache?", "Why batch requests?", "Name one benefit of paging.",
             "What is the capital of France?")


def test_greedy_outputs_stay_close_to_the_float_cache(smollm2_path):
    """SmolLM2 in float32 (head_dim 64), 12 greedy tokens: the first 8 agree on at
    least 3 of 4 chat prompts (measured: 12 to 32 tokens on 8 prompts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
               for q in QUESTIONS]
    outputs = {}
    for cache in ("auto", "int8"):
        model = LLM(str(smollm2_path), dtype="float32", quantization="none", kv_cache_dtype=cache,
                    max_model_len=256, kv_cache_memory_bytes=16 << 20)
        outputs[cache] = ids_of(model.generate(prompts, greedy(12), use_tqdm=False))
    agree = [a[:8] == b[:8] for a, b in zip(outputs["auto"], outputs["int8"])]
    assert sum(agree) >= 3, outputs
