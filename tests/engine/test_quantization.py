"""Quantized weights in the engine (engine/model/layers/quantization.py):
--quantization's meaning, a float checkpoint quantized at load, and a GGUF
file served in its own types against the same file de-quantized."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import add_engine_args, config_from_args
from engine.config import DEFAULT_MODEL, LOAD_QUANTIZATIONS as CONFIG_LOAD_QUANTIZATIONS, EngineConfig
from engine.model.layers.quantization import LOAD_QUANTIZATIONS, QuantLinear
from kernels.quant import QUANT_TYPES, dequantize_reference, quant_parts
from kernels.quantize_k import quantize_q4_k

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_config_restates_the_layers_list():
    assert CONFIG_LOAD_QUANTIZATIONS == LOAD_QUANTIZATIONS


def test_a_gguf_model_is_served_in_its_own_types_by_default(tmp_path):
    assert EngineConfig().quantization == "gguf"
    assert EngineConfig(model="x/model.gguf").quantization == "gguf"
    assert EngineConfig(model=DEFAULT_MODEL, quantization="none").quantization == "none"
    assert EngineConfig(model=str(tmp_path)).quantization is None
    with pytest.raises(ValueError, match="is not a .gguf file"):
        EngineConfig(model=str(tmp_path), quantization="gguf")
    with pytest.raises(ValueError, match="served in its own types"):
        EngineConfig(quantization="q4_0")
    assert EngineConfig(tensor_parallel_size=3).quantization == "none"  # ranks slice floats
    with pytest.raises(ValueError, match="runs on one rank"):
        EngineConfig(quantization="gguf", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="quantization='int4' is not supported"):
        EngineConfig(model=str(tmp_path), quantization="int4")


def test_cli():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--quantization", "q4_k"])
    assert config_from_args(args).quantization == "q4_k"
    assert config_from_args(parser.parse_args(["--model", "m"])).quantization is None


def test_q4_k_rounds_each_weight_to_its_sub_block_grid():
    """Our Q4_K quantizer (gguf writes no K-quants): gguf reads its bytes back
    to within half a grid step of each weight, plus what rounding the
    sub-block's step and offset to 6 bits (in units of fp16 d, dmin) moves."""
    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    weight[0, :256] = 0.0  # an all-zero super-block
    from gguf import GGMLQuantizationType, quants

    back = quants.dequantize(quantize_q4_k(weight), GGMLQuantizationType.Q4_K)
    sub = weight.reshape(-1, 32)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    step = (high - low) / 15
    units = np.maximum(step.reshape(-1, 8).max(-1) / 63, (-low).reshape(-1, 8).max(-1) / 63)
    bound = step / 2 + 16 * np.repeat(units, 8) + 1e-7  # half a step + 6-bit rounding of step/offset
    assert np.all(np.abs(back - weight).reshape(-1, 32) <= bound[:, None])
    assert np.all(back[0, :256] == 0)


@pytest.mark.parametrize("name", LOAD_QUANTIZATIONS)
def test_a_linear_quantized_at_load_holds_its_rounded_weights(name):
    generator = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(512, 24, bias=True)
    linear.kernels = None
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 512, generator=generator) * 0.05)
    layer = QuantLinear.from_linear(linear, name.upper())
    (type_name, _), = quant_parts(layer.weight)
    assert type_name == name.upper() and (layer.out_features, layer.in_features) == (24, 512)
    error = (dequantize_reference(layer.weight) - linear.weight).abs().max().item()
    bits = 8 if name == "q8_0" else 4
    assert error <= 0.6 * linear.weight.abs().max().item() / (2 ** (bits - 1) - 1)
    assert layer.bias is not None and torch.equal(layer.bias, linear.bias.detach())


def test_a_tiny_model_quantized_at_load_serves_and_has_its_own_prefix_cache(tiny_llama_path):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 300, 42, 9]}]
    common = dict(max_model_len=64, num_gpu_blocks_override=16, dtype="bfloat16")
    plain = LLM(str(tiny_llama_path), **common)
    quantized = LLM(str(tiny_llama_path), quantization="q8_0", **common)
    layer = quantized.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert isinstance(layer.mlp.down_proj, QuantLinear)
    out = quantized.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8
    assert plain.engine.fingerprint != quantized.engine.fingerprint


def test_the_default_model_is_served_from_its_file_and_agrees_with_its_floats(smollm2_path):
    """SmolLM2's Q4_1 blocks, multiplied as they are, against the same file
    de-quantized to float32 (HF's numbers): every greedy token agrees, or the
    first that differs was a near-tie of the float model (both tokens in its
    top 5)."""
    common = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)
    quantized = LLM(DEFAULT_MODEL, **common)
    model = quantized.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert [name for name, _ in quant_parts(model.embed_tokens.weight)] == ["Q8_0"]
    held = quantized.engine.runner.memory()["weights_bytes"]
    assert held < 110 << 20  # the file's bytes (~99 MB), not 270 MB of bf16
    reference = LLM(DEFAULT_MODEL, quantization="none", dtype="float32", **common)
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    for got, want in zip(quantized.generate(prompts, params, use_tqdm=False),
                         reference.generate(prompts, params, use_tqdm=False)):
        got_ids, want_ids = got.outputs[0].token_ids, want.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b), None)
        if first is not None:
            top = [token for token, _ in want.outputs[0].top_logprobs[first]]
            assert got_ids[first] in top and want_ids[first] in top, (got.prompt, first)
