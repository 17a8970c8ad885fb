"""`dtype="auto"`: float32 checkpoints run in bfloat16 where bf16 matmuls are
fast (CUDA with bf16, CPUs with AVX512-BF16/AMX, CPUs where the compiled
bf16-weight linear takes the model's widths), as vLLM does; an explicit
dtype always wins; half-precision checkpoints keep their dtype. And the real
model still answers sensibly in bf16 on the CPU fast paths."""

from __future__ import annotations

import types

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model.placement import has_fast_bf16, resolve_dtype
from kernels import compiled_bf16_linear

pytestmark = pytest.mark.usefixtures("single_thread")

CPU = torch.device("cpu")


def _checkpoint(dtype):
    return types.SimpleNamespace(dtype=dtype)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", None])
def test_explicit_dtype_wins(name, checkpoint):
    assert resolve_dtype(EngineConfig(dtype=name), _checkpoint(checkpoint), CPU) == getattr(torch, name)


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", torch.bfloat16, torch.float16])
def test_auto_keeps_a_half_precision_checkpoint(checkpoint):
    expected = getattr(torch, str(checkpoint).removeprefix("torch."))
    assert resolve_dtype(EngineConfig(), _checkpoint(checkpoint), CPU) == expected


@pytest.mark.parametrize("checkpoint", ["float32", torch.float32, None])
def test_auto_downcasts_float32_only_where_bf16_is_fast(checkpoint):
    fast = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert has_fast_bf16(CPU) == fast
    expected = torch.bfloat16 if fast else torch.float32
    assert resolve_dtype(EngineConfig(), _checkpoint(checkpoint), CPU) == expected


def _smollm2_shaped(dtype="float32"):
    return types.SimpleNamespace(dtype=dtype, hidden_size=576, intermediate_size=1536)


def test_auto_downcasts_where_the_compiled_linear_takes_the_layers(monkeypatch):
    probes = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    compiled = compiled_bf16_linear(576) and compiled_bf16_linear(1536)
    expected = torch.bfloat16 if probes or compiled else torch.float32
    assert resolve_dtype(EngineConfig(), _smollm2_shaped(), CPU) == expected
    # The torch backend multiplies with F.linear: only the ISA probes count.
    torch_backend = EngineConfig(kernel_backend="torch")
    assert resolve_dtype(torch_backend, _smollm2_shaped(), CPU) == (
        torch.bfloat16 if probes else torch.float32)
    # A width no build takes (or the op turned off) keeps float32.
    odd = types.SimpleNamespace(dtype="float32", hidden_size=24, intermediate_size=1536)
    assert resolve_dtype(EngineConfig(), odd, CPU) == (torch.bfloat16 if probes else torch.float32)
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "off")
    assert resolve_dtype(EngineConfig(), _smollm2_shaped(), CPU) == (
        torch.bfloat16 if probes else torch.float32)


def test_auto_reaches_the_engine(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), max_model_len=128, num_gpu_blocks_override=16)
    hf = llm.engine.runner.model.args
    widths = (hf.hidden_size, hf.intermediate_size)
    expected = torch.bfloat16 if has_fast_bf16(CPU, "auto", widths) else torch.float32
    assert llm.engine.runner.dtype == expected
    assert llm.engine.runner.kv_cache.dtype == expected


def test_smollm2_in_bfloat16_answers_and_batches_like_it_runs_alone(smollm2_path):
    """bf16 on the CPU paths (bf16 linears, the block-gathering decode
    attention): the model still knows its capitals, and a request decoded in a
    batch of ragged lengths gives the text it gives alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    questions = ["What is the capital of France?", "Name three primary colours.",
                 "Write a haiku about the sea.", "What is 12 times 12?"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    llm = LLM(str(smollm2_path), dtype="bfloat16", max_model_len=512,
              kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=24)
    batched = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert "Paris" in batched[0]
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].text
    assert alone == batched[0]
