"""A decoder layer in one compiled call, and every layer of the model in one
call (engine/model/layers/fused_layer.py), against the same layers run
module by module: the same tokens and the same
log-probabilities to the bit, in bf16 on the CPU's compiled ops, for steps of
decodes, of prompt chunks, of both, and of drafted rows (n-gram speculation).

The families that take it: SmolLM2 (Llama, the real weights and shapes, tied
head; its first 4 layers, conftest's smollm2_short_path),
Qwen2 with its q/k/v biases and a sliding layer, Mistral sliding on every
layer, Qwen3 with its per-head norms of q and k, a Qwen3-MoE's dense layers;
the prompts run past the tiny models' 20-token windows. Several prompts at
once, so a step decodes a batch; chunked prefill, so decode rows share steps
with prompt chunks; n-gram drafts, so a sequence has several rows that the
prefill kernel attends. Gemma 2 and Gemma 3 (bf16, and served from GGUF
files) take their own op (kernels/cpu/csrc/gemma_layer.h), a call a layer.
And the layers that must not take it (MoE experts, float32) never do.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.model.layers import fused_layer
from engine.model.layers.activation import MLP
from engine.model.layers.moe import FusedMoE
from engine.model.layers.norm import GemmaRMSNorm, RMSNorm
from engine.model.layers.quantization import QuantLinear
from kernels.cpu import ops as cpu_ops
from lora_models import ADAPTERS, make_adapter
from need import need
from tiny_models import make_tiny_family

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["The sea is", "Write a short poem about a lighthouse keeper and the storm that came in",
           "1, 2, 3, 4,"]


HEAD_DIM = 32  # the smallest here: SmolLM2's is 64, the tiny families' below 32


def _compiled_ops_or_skip():
    need(cpu_ops.ops_for(HEAD_DIM) is not None,
         f"compiled CPU ops: {cpu_ops.unavailable_reason(HEAD_DIM)}")
    need(hasattr(cpu_ops.current_ops(), "llama_layer"), "the build has no llama_layer")


def _generate(llm, mode: str, monkeypatch, prompts=PROMPTS, lora=None) -> tuple[list, int]:
    """Greedy outputs with the layers in one op for the stack ("stack"), in
    one op each ("layer") or module by module ("modules"), and how many layer
    calls took an op (a stack call counts every layer)."""
    model = llm.engine.runner.model
    for layer in model.layers:
        layer.fuse = mode != "modules"
    model.layer_stack.whole = mode == "stack"
    taken = []
    run, run_stacked = fused_layer.run, fused_layer.run_stacked

    def counting(*args):
        taken.append(1)
        return run(*args)

    def counting_stack(*args):
        taken.append(len(model.layers))
        return run_stacked(*args)

    monkeypatch.setattr(fused_layer, "run", counting)
    monkeypatch.setattr(fused_layer, "run_stacked", counting_stack)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    # Every run from an empty prefix cache, so that all schedule the same
    # steps: a cached prefix shortens a prefill, and a quantized linear
    # multiplies a call's tokens with 8-bit activations up to a size
    # (quant_linear.h's kManyRows and kVnniManyRows), with strips past it.
    assert llm.reset_prefix_cache()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    monkeypatch.setattr(fused_layer, "run", run)
    monkeypatch.setattr(fused_layer, "run_stacked", run_stacked)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    return got, sum(taken)


def _same_with_and_without(llm, monkeypatch, prompts=PROMPTS, stacked: bool = True, lora=None):
    """Modules, then an op a layer, then (where the layers stack) one op for
    all: every token and every log-probability the same."""
    modules, none = _generate(llm, "modules", monkeypatch, prompts, lora)
    per_layer, taken = _generate(llm, "layer", monkeypatch, prompts, lora)
    whole, taken_whole = _generate(llm, "stack", monkeypatch, prompts, lora)
    assert none == 0 and taken > 0 and taken_whole > 0
    assert (llm.engine.runner.model.layer_stack.stacked is not None) == stacked
    for got in (per_layer, whole):
        for (ids, logprobs), (ids_m, logprobs_m) in zip(got, modules):
            assert ids == ids_m
            assert logprobs == logprobs_m  # every float the same


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=16, block_size=16)],
                         ids=["plain", "chunked"])
def test_smollm2_fused_layers_give_the_same_numbers(smollm2_short_path, engine_args, monkeypatch):
    _compiled_ops_or_skip()
    llm = LLM(str(smollm2_short_path), dtype="bfloat16", **engine_args)
    _same_with_and_without(llm, monkeypatch)
    bound = [layer._fused for layer in llm.engine.runner.model.layers]
    assert None not in bound and len({one.shape for one in bound}) == 1
    assert llm.engine.runner.model.layer_stack.stacked.final_norm is not None  # the op runs it


def test_a_final_norm_of_another_eps_runs_its_module(smollm2_short_path, monkeypatch):
    """The stack op runs the model's final norm with the layers' eps: a final
    norm of another eps stays with its module, and the numbers stay the modules'."""
    _compiled_ops_or_skip()
    llm = LLM(str(smollm2_short_path), dtype="bfloat16")
    llm.engine.runner.model.norm.eps = 1e-2
    _same_with_and_without(llm, monkeypatch)
    assert llm.engine.runner.model.layer_stack.stacked.final_norm is None


def test_the_stack_op_writes_the_caches_it_is_given(smollm2_short_path, monkeypatch):
    """The op's arguments are built once per set of caches: handed another set,
    the same step writes (and reads) those, not the first set."""
    _compiled_ops_or_skip()
    llm = LLM(str(smollm2_short_path), dtype="bfloat16")
    runner = llm.engine.runner
    first, _ = _generate(llm, "stack", monkeypatch)
    old = [c for part in runner.layer_caches for c in part]
    before = [c.clone() for c in old]
    runner.layer_caches = tuple(tuple(torch.zeros_like(c) for c in part) for part in runner.layer_caches)
    again, _ = _generate(llm, "stack", monkeypatch)
    assert again == first
    assert all(c.count_nonzero() > 0 for part in runner.layer_caches for c in part)
    assert all(torch.equal(c, b) for c, b in zip(old, before))  # the first set untouched


@pytest.mark.parametrize("cache, dtype", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_quantized_caches_give_the_same_numbers(smollm2_short_path, monkeypatch, cache, dtype):
    """--kv-cache-dtype int8 / fp8: the op quantizes k and v into the cache as
    the store does, and its attention reads the blocks as the modules' does."""
    _compiled_ops_or_skip()
    llm = LLM(str(smollm2_short_path), dtype="bfloat16", kv_cache_dtype=cache)
    assert llm.engine.runner.kv_cache.dtype == dtype
    _same_with_and_without(llm, monkeypatch)


def test_lora_rows_give_the_same_numbers(smollm2_short_path, tmp_path_factory, monkeypatch):
    """Rows under two LoRA adapters beside a base row: the op adds each row's
    update (kernels/cpu/csrc/lora.h) where the modules' projections do."""
    _compiled_ops_or_skip()
    root = tmp_path_factory.mktemp("smollm2-lora")
    requests = [LoRARequest(name, i + 1,
                            str(make_adapter(smollm2_short_path, root / name, i, **ADAPTERS[name])))
                for i, name in enumerate(["all-r8-rs", "qv-r4"])]
    llm = LLM(str(smollm2_short_path), dtype="bfloat16", enable_lora=True, max_loras=2,
              max_num_batched_tokens=16, block_size=16)
    _same_with_and_without(llm, monkeypatch, lora=[requests[0], None, requests[1]])
    base, _ = _generate(llm, "stack", monkeypatch)
    adapted, _ = _generate(llm, "stack", monkeypatch, lora=[requests[0], None, requests[1]])
    assert base[1] == adapted[1] and base[0][0] != adapted[0][0]


def test_drafted_rows_give_the_same_numbers(smollm2_short_path, monkeypatch):
    """Steps whose sequences carry n-gram drafts: several rows each, attended
    by the prefill kernel inside the op, accepted or rolled back as before."""
    _compiled_ops_or_skip()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(str(smollm2_short_path), dtype="bfloat16", speculative_config=spec)
    repeat = ["Copy this line exactly: the quick brown fox jumps over the lazy dog, the quick brown fox",
              "Repeat after me: one two three four five six seven eight nine ten one two three"]
    _same_with_and_without(llm, monkeypatch, repeat)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("family", ["qwen2-sliding", "mistral-sliding"])
def test_biases_and_windows_give_the_same_numbers(family, tmp_path, smollm2_path, monkeypatch):
    _compiled_ops_or_skip()
    # 4 heads of 32: the AVX512 builds take head_dims in multiples of 32.
    folder = make_tiny_family(tmp_path / family, family, smollm2_path, hidden_size=4 * HEAD_DIM)
    llm = LLM(str(folder), dtype="bfloat16", block_size=16)
    generator = torch.Generator().manual_seed(5)
    for layer in llm.engine.runner.model.layers:  # HF initialises biases to zero: give them weight
        bias = layer.self_attn.qkv_proj.bias
        if bias is not None:
            bias.data.copy_(torch.randn(bias.shape, generator=generator))
    # Qwen2's sliding layer differs from its others in shape: a call per layer.
    _same_with_and_without(llm, monkeypatch, stacked=family == "mistral-sliding")
    windows = {layer._fused.shape.sliding_window for layer in llm.engine.runner.model.layers}
    assert max(windows) == 20


def test_per_head_norms_give_the_same_numbers(tmp_path, smollm2_path, monkeypatch):
    """Qwen3's norms of each q and k head run inside the op (and the stack op)."""
    _compiled_ops_or_skip()
    folder = make_tiny_family(tmp_path / "qwen3", "qwen3", smollm2_path, hidden_size=4 * HEAD_DIM)
    llm = LLM(str(folder), dtype="bfloat16", block_size=16, max_num_batched_tokens=16)
    generator = torch.Generator().manual_seed(7)
    for layer in llm.engine.runner.model.layers:  # HF initialises the norms to ones: vary them
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=generator))
    _same_with_and_without(llm, monkeypatch)
    assert all(layer._fused.weights[10] is layer.self_attn.q_norm.weight
               for layer in llm.engine.runner.model.layers)


def test_a_moe_models_dense_layers_take_the_op_and_its_expert_layers_do_not(tmp_path, smollm2_path,
                                                                            monkeypatch):
    _compiled_ops_or_skip()
    folder = make_tiny_family(tmp_path / "qwen3-moe", "qwen3-moe", smollm2_path, hidden_size=4 * HEAD_DIM)
    llm = LLM(str(folder), dtype="bfloat16", block_size=16)
    _same_with_and_without(llm, monkeypatch, stacked=False)
    layers = llm.engine.runner.model.layers
    assert [layer._fused is None for layer in layers] == [type(layer.mlp) is FusedMoE for layer in layers]
    assert {type(layer.mlp) for layer in layers} == {FusedMoE, MLP}


def _vary_norms(llm) -> None:
    """HF initialises every norm to the identity (RMSNorm's weight to ones,
    Gemma's offset from one to zeros): give each weight, so that a norm the
    op skipped or swapped would show."""
    generator = torch.Generator().manual_seed(7)
    for norm in llm.engine.runner.model.layers.modules():
        if isinstance(norm, (RMSNorm, GemmaRMSNorm)):
            one = 1.0 if isinstance(norm, RMSNorm) else 0.0
            norm.weight.data.copy_(one + 0.3 * torch.randn(norm.weight.shape, generator=generator))


def _same_op_by_op(llm, monkeypatch) -> list:
    """Modules, then an op a layer (Gemma's layers have no stack op): every
    token and log-probability the same; returns the layers' Bounds."""
    modules, none = _generate(llm, "modules", monkeypatch)
    per_layer, taken = _generate(llm, "layer", monkeypatch)
    assert none == 0 and taken > 0
    assert per_layer == modules  # every token and float the same
    return [layer._fused for layer in llm.engine.runner.model.layers]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_layers_give_the_same_numbers(family, tmp_path, smollm2_path, monkeypatch):
    """Gemma 2 (soft-capped scores, sliding and global layers) and Gemma 3
    (per-head norms, RoPE tables per kind of layer, the sliding layers' own
    pool) in the Gemma op, a call a layer: the modules' numbers to the bit."""
    _compiled_ops_or_skip()
    folder = make_tiny_family(tmp_path / family, family, smollm2_path, hidden_size=4 * HEAD_DIM,
                              head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM + 16)
    llm = LLM(str(folder), dtype="bfloat16", block_size=16, max_num_batched_tokens=16)
    _vary_norms(llm)
    bound = _same_op_by_op(llm, monkeypatch)
    assert all(b is not None and b.shape.gemma for b in bound)
    assert {b.shape.sliding_window > 0 for b in bound} == {True, False}
    assert (bound[0].weights[12] is not None) == (family == "gemma3")  # Gemma 3's head norms
    assert llm.engine.runner.model.layer_stack.stacked in (None, fused_layer.UNKNOWN)


@pytest.mark.parametrize("family,tensor_type", [("gemma2", "Q4_1"), ("gemma3", "Q6_K")])
def test_quantized_gemma_layers_give_the_same_numbers(family, tensor_type, tiny_gguf, monkeypatch):
    """Served from a GGUF file: the blobs in the Gemma op, the same numbers
    as the modules (QuantLinear, op by op)."""
    _compiled_ops_or_skip()
    llm = LLM(str(tiny_gguf(family, tensor_type)), max_model_len=128, kv_cache_memory_bytes=16 << 20,
              block_size=16)
    assert llm.engine.runner.dtype == torch.bfloat16
    assert isinstance(llm.engine.runner.model.layers[0].self_attn.qkv_proj, QuantLinear)
    _vary_norms(llm)
    assert None not in _same_op_by_op(llm, monkeypatch)


def test_float32_runs_the_modules(smollm2_short_path, monkeypatch):
    llm = LLM(str(smollm2_short_path), dtype="float32")
    _, taken = _generate(llm, "stack", monkeypatch)
    assert taken == 0
    layer = llm.engine.runner.model.layers[0]
    assert layer._fused is fused_layer.UNKNOWN  # no step could take it: never bound
    assert fused_layer.bind(layer) is not None  # though the layer itself is eligible
    assert llm.engine.runner.dtype == torch.float32
