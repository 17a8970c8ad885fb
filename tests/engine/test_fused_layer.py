"""A decoder layer in one compiled call (engine/model/layers/fused_layer.py)
against the same layer run module by module: the same tokens and the same
log-probabilities to the bit, in bf16 on the CPU's compiled ops, for steps of
decodes, of prompt chunks, of both, and of drafted rows (n-gram speculation).

The families that take it: SmolLM2 (Llama, the real weights, tied head),
Qwen2 with its q/k/v biases and a sliding layer, Mistral sliding on every
layer; the prompts run past the tiny models' 20-token windows. Several
prompts at once, so a step decodes a batch; chunked prefill, so decode rows
share steps with prompt chunks; n-gram drafts, so a sequence has several
rows that the prefill kernel attends. And the
layers that must not take it (per-head norms, Gemma's norms, MoE, float32)
never do.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.layers import fused_layer
from kernels.cpu import ops as cpu_ops
from need import need
from tiny_models import make_tiny_family

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["The sea is", "Write a short poem about a lighthouse keeper and the storm that came in",
           "1, 2, 3, 4,"]


def _compiled_ops_or_skip():
    need(cpu_ops.ops_for(16) is not None, f"compiled CPU ops: {cpu_ops.unavailable_reason(16)}")
    need(hasattr(cpu_ops.current_ops(), "llama_layer"), "the build has no llama_layer")


def _generate(llm, fuse: bool, monkeypatch, prompts=PROMPTS) -> tuple[list, int]:
    """Greedy outputs with every layer fused (or not), and how many layer calls took the op."""
    for layer in llm.engine.runner.model.layers:
        layer.fuse = fuse
    taken = []
    original = fused_layer.run

    def counting(*args):
        out = original(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(fused_layer, "run", counting)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(fused_layer, "run", original)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    return got, sum(taken)


def _same_with_and_without(llm, monkeypatch, prompts=PROMPTS):
    fused, taken = _generate(llm, True, monkeypatch, prompts)
    modules, none = _generate(llm, False, monkeypatch, prompts)
    assert taken > 0 and none == 0
    for (ids, logprobs), (ids_m, logprobs_m) in zip(fused, modules):
        assert ids == ids_m
        assert logprobs == logprobs_m  # every float the same


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=16, block_size=16)],
                         ids=["plain", "chunked"])
def test_smollm2_fused_layers_give_the_same_numbers(smollm2_path, engine_args, monkeypatch):
    _compiled_ops_or_skip()
    llm = LLM(str(smollm2_path), dtype="bfloat16", **engine_args)
    _same_with_and_without(llm, monkeypatch)
    bound = [layer._fused for layer in llm.engine.runner.model.layers]
    assert None not in bound and len({one.shape for one in bound}) == 1


def test_drafted_rows_give_the_same_numbers(smollm2_path, monkeypatch):
    """Steps whose sequences carry n-gram drafts: several rows each, attended
    by the prefill kernel inside the op, accepted or rolled back as before."""
    _compiled_ops_or_skip()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(str(smollm2_path), dtype="bfloat16", speculative_config=spec)
    repeat = ["Copy this line exactly: the quick brown fox jumps over the lazy dog, the quick brown fox",
              "Repeat after me: one two three four five six seven eight nine ten one two three"]
    _same_with_and_without(llm, monkeypatch, repeat)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("family", ["qwen2-sliding", "mistral-sliding"])
def test_biases_and_windows_give_the_same_numbers(family, tmp_path, smollm2_path, monkeypatch):
    _compiled_ops_or_skip()
    folder = make_tiny_family(tmp_path / family, family, smollm2_path)
    llm = LLM(str(folder), dtype="bfloat16", block_size=16)
    generator = torch.Generator().manual_seed(5)
    for layer in llm.engine.runner.model.layers:  # HF initialises biases to zero: give them weight
        bias = layer.self_attn.qkv_proj.bias
        if bias is not None:
            bias.data.copy_(torch.randn(bias.shape, generator=generator))
    _same_with_and_without(llm, monkeypatch)
    windows = {layer._fused.shape.sliding_window for layer in llm.engine.runner.model.layers}
    assert max(windows) == 20


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "qwen3-moe"])
def test_layers_the_op_does_not_fuse_run_their_modules(family, tmp_path, smollm2_path, monkeypatch):
    folder = make_tiny_family(tmp_path / family, family, smollm2_path)
    llm = LLM(str(folder), dtype="bfloat16", block_size=16)
    _, taken = _generate(llm, True, monkeypatch)
    assert taken == 0
    for layer in llm.engine.runner.model.layers:
        assert getattr(layer, "_fused", None) in (None, fused_layer.UNKNOWN)


def test_float32_runs_the_modules(smollm2_path, monkeypatch):
    llm = LLM(str(smollm2_path), dtype="float32")
    _, taken = _generate(llm, True, monkeypatch)
    assert taken == 0
    layer = llm.engine.runner.model.layers[0]
    assert layer._fused is fused_layer.UNKNOWN  # no step could take it: never bound
    assert fused_layer.bind(layer) is not None  # though the layer itself is eligible
    assert llm.engine.runner.dtype == torch.float32
