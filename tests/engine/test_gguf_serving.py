"""Tiny GGUF files of every family served as they are (LLM(model=file.gguf),
--quantization gguf: the blocks in the compiled op, 8-bit activations) against
the same file de-quantized to float32 (--quantization none: HF's numbers).

The rule, vLLM's check_logprobs_close: every greedy token agrees, or the first
that differs is a near-tie of the float model (both tokens in its top 5);
the quantized path rounds activations to 8 bits per 32 values, so it may pick
the other side of a near-tie, never an unlikely token. Llama's mixed Q4_K_M
file also runs with prefix caching, chunked prefill, preemption and block
sizes 1, 16 and 128, each held to the same rule.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model.layers.quantization import QuantLinear
from kernels.cpu import ops as cpu_ops
from kernels.quant import has_panels

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], [12, 900, 3, 44, 2048, 7, 7, 31, 600, 8, 5, 19, 250],
           [42] * 3 + [100, 200, 300]]
TOKENS = 10
# (family, file type): every family once, a legacy or K type each.
CASES = [("llama", "Q4_K_M"), ("mistral", "Q4_0"), ("qwen2", "Q5_1"), ("qwen3", "Q8_0"),
         ("phi3", "Q5_0"), ("gemma2", "Q4_1"), ("gemma3", "Q6_K"), ("mixtral", "Q8_0"),
         ("qwen3-moe", "Q5_K")]
COMMON = dict(max_model_len=128, kv_cache_memory_bytes=16 << 20)


def _generate(llm, prompts=PROMPTS, logprobs=None):
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def _assert_close(reference, got) -> None:
    for i, (want, out) in enumerate(zip(reference, got)):
        first = next((k for k, (a, b) in enumerate(zip(want.token_ids, out.token_ids)) if a != b), None)
        if first is not None:
            top = [token for token, _ in want.top_logprobs[first]]
            assert want.token_ids[first] in top and out.token_ids[first] in top, \
                f"prompt {i}: token {first} is {out.token_ids[first]}, the float model's top 5 {list(top)}"


@pytest.fixture(scope="module")
def float_reference(tiny_gguf):
    """(family, type) -> the de-quantized float32 engine's greedy outputs, computed once."""
    results = {}

    def get(family, tensor_type):
        if (family, tensor_type) not in results:
            llm = LLM(str(tiny_gguf(family, tensor_type)), quantization="none", dtype="float32",
                      **COMMON)
            results[family, tensor_type] = _generate(llm, logprobs=5)
        return results[family, tensor_type]

    return get


@pytest.mark.parametrize("family,tensor_type", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_a_family_served_from_its_blocks_agrees_with_its_floats(tiny_gguf, float_reference,
                                                                family, tensor_type):
    llm = LLM(str(tiny_gguf(family, tensor_type)), **COMMON)
    assert llm.engine.config.quantization == "gguf"
    attention = llm.engine.runner.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, QuantLinear) and isinstance(attention.o_proj, QuantLinear)
    if tensor_type in ("Q4_K_M", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K"):  # in 16-row panels where the op wants
        ops = cpu_ops.current_ops()
        wanted = ops is not None and ops.quant_panels()
        model = llm.engine.runner.model
        assert has_panels(attention.o_proj.weight) == wanted
        assert has_panels(attention.qkv_proj.weight) == wanted  # Q4_K_M's v is Q6_K
        if model.lm_head is None:  # a tied head: the embedding's table serves both, in panels
            assert has_panels(model.embed_tokens.weight) == wanted
    _assert_close(float_reference(family, tensor_type), _generate(llm))


@pytest.mark.parametrize("features", [
    dict(block_size=1), dict(block_size=128),
    dict(block_size=16, max_num_batched_tokens=16, enable_prefix_caching=True),
    dict(block_size=16, num_gpu_blocks_override=4, max_model_len=32, schedule_conservativeness=0.0),
], ids=["block-1", "block-128", "chunked-prefill-and-prefix-cache", "preemption"])
def test_engine_features_over_quantized_weights(tiny_gguf, float_reference, features):
    common = {k: v for k, v in COMMON.items() if k not in features}
    llm = LLM(str(tiny_gguf("llama", "Q4_K_M")), **common, **features)
    reference = float_reference("llama", "Q4_K_M")
    _assert_close(reference, _generate(llm))
    # Again, with every prompt's blocks cached where caching is on.
    _assert_close(reference, _generate(llm))
    if "num_gpu_blocks_override" in features:  # 5 blocks of K/V wanted, 3 usable
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_tied_head_is_multiplied_and_looked_up_from_the_same_panels(tiny_gguf, float_reference):
    """A Q4_K_M file without output.weight (a tied head, Q6_K as llama.cpp
    writes it): the embedding's table goes into panels where the op wants
    them, once, and serves both the row lookups and the head."""
    llm = LLM(str(tiny_gguf("gemma2", "Q4_K_M")), **COMMON)
    model = llm.engine.runner.model
    assert model.lm_head is None
    ops = cpu_ops.current_ops()
    assert has_panels(model.embed_tokens.weight) == (ops is not None and ops.quant_panels())
    _assert_close(float_reference("gemma2", "Q4_K_M"), _generate(llm))
