"""The FusedMoE layer (engine/model/layers/moe.py) against HF transformers'
own MoE blocks, MixtralSparseMoeBlock and Qwen3MoeSparseMoeBlock, built
tiny with random weights: float32 bit for bit, bf16 within rounding; the
weights loaded through load_expert_weight from the HF module's state_dict
(fused expert tensors) and from what save_pretrained writes (per expert).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import kernels
from engine.model.layers.moe import FusedMoE, is_moe_layer
from kernels.cpu import ops as cpu_ops
from need import need

HIDDEN, WIDTH, EXPERTS, TOP_K = 64, 32, 8, 2
SMALL = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, num_experts_per_tok=TOP_K)


def mixtral_config(**extra):
    return MixtralConfig(**{**SMALL, **extra}, intermediate_size=WIDTH, num_local_experts=EXPERTS)


def qwen3_moe_config(norm_topk_prob=True, **extra):
    return Qwen3MoeConfig(**{**SMALL, **extra}, intermediate_size=96, moe_intermediate_size=WIDTH,
                          num_experts=EXPERTS, norm_topk_prob=norm_topk_prob)


FAMILIES = {
    "mixtral": (mixtral_config, MixtralSparseMoeBlock),
    "qwen3_moe-norm": (lambda: qwen3_moe_config(True), Qwen3MoeSparseMoeBlock),
    "qwen3_moe-no-norm": (lambda: qwen3_moe_config(False), Qwen3MoeSparseMoeBlock),
}


def randomize(module: nn.Module, seed: int) -> None:
    """Random weights of O(1 / sqrt(fan_in)): routing and outputs far from zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5)


def hf_block(family: str, seed: int = 0):
    make_config, block_class = FAMILIES[family]
    config = make_config()
    block = block_class(config).eval()
    randomize(block, seed)
    return config, block


def layer_from(config, state: dict, backend: str = "torch") -> FusedMoE:
    layer = FusedMoE.from_hf_config(config, kernels.get_backend(backend))
    for name, tensor in state.items():
        assert layer.load_expert_weight(name, tensor), name
    assert layer.missing_weights() == []
    return layer


def tokens(seed: int = 1, count: int = 13) -> torch.Tensor:
    return torch.randn(1, count, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_matches_hf_block_exactly(family, backend):
    config, block = hf_block(family)
    layer = layer_from(config, block.state_dict(), backend)
    x = tokens()
    with torch.no_grad():
        expected = block(x)
        torch.testing.assert_close(layer(x[0]), expected[0], atol=0, rtol=0)
        torch.testing.assert_close(layer(x[0, :1]), block(x[:, :1])[0], atol=0, rtol=0)  # T = 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_matches_hf_block(family):
    """Same routing as HF (the torch backend's router is F.linear, as HF's);
    the experts' sum in float32 where HF's is bf16: within bf16 rounding."""
    config, block = hf_block(family, seed=2)
    block = block.to(torch.bfloat16)
    layer = layer_from(config, block.state_dict()).to(torch.bfloat16)
    x = tokens(3).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(layer(x[0]).float(), block(x)[0].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe-norm"])
def test_bf16_packed_weights_on_the_compiled_linear(family):
    compiled_cpu_ops = cpu_ops.ops_for(HIDDEN)
    need(compiled_cpu_ops is not None, f"compiled CPU ops: {cpu_ops.unavailable_reason(HIDDEN)}")
    config, block = hf_block(family, seed=4)
    block = block.to(torch.bfloat16)
    layer = layer_from(config, block.state_dict(), "auto").to(torch.bfloat16)
    x = tokens(5)[0].bfloat16()
    with torch.no_grad():
        before = layer(x)
        layer.pack_weights()
        if hasattr(compiled_cpu_ops, "linear_bf16_packed"):
            assert layer.w_gate_up.dim() == layer.w_down.dim() == 5
        after = layer(x)
        expected = block(x[None])[0]
    torch.testing.assert_close(after, before, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(after.float(), expected.float(), atol=2e-2, rtol=2e-2)
    if hasattr(compiled_cpu_ops, "linear_bf16_packed"):  # else (portable) nothing was repacked
        with pytest.raises(RuntimeError, match="before pack_weights"):
            layer.load_expert_weight("gate.weight", block.gate.weight)


@pytest.mark.parametrize("model_class, make_config, prefix", [
    (MixtralForCausalLM, mixtral_config, "model.layers.0.block_sparse_moe."),
    (Qwen3MoeForCausalLM, qwen3_moe_config, "model.layers.0.mlp."),
])
def test_loads_the_per_expert_names_save_pretrained_writes(tmp_path, model_class, make_config, prefix):
    config = make_config()
    model = model_class(config).eval()
    randomize(model.model.layers[0].mlp, seed=6)
    model.save_pretrained(tmp_path)
    layer = FusedMoE.from_hf_config(config, kernels.get_backend("auto"))
    taken = set()
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if layer.load_expert_weight(name, f.get_tensor(name)):
                taken.add(name)
    per_expert = {f"experts.{e}.{p}.weight" for e in range(EXPERTS)
                  for p in (("w1", "w2", "w3") if "block_sparse" in prefix
                            else ("gate_proj", "up_proj", "down_proj"))}
    assert taken == {prefix + name for name in per_expert | {"gate.weight"}}
    assert layer.missing_weights() == []
    x = tokens(7)
    with torch.no_grad():
        ours = layer(x[0])
        # The modeling file's loop (eager): the same arithmetic, bit for bit.  A whole
        # model defaults to grouped_mm where torch has it (other GEMMs, a sum over
        # the k slots): float32 rounding apart.
        model.set_experts_implementation("eager")
        torch.testing.assert_close(ours, model.model.layers[0].mlp(x)[0], atol=0, rtol=0)
        model.set_experts_implementation("grouped_mm")
        torch.testing.assert_close(ours, model.model.layers[0].mlp(x)[0])


def test_load_expert_weight_refuses_what_does_not_fit():
    layer = FusedMoE.from_hf_config(mixtral_config(), kernels.get_backend("torch"))
    assert not layer.load_expert_weight("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))
    assert not layer.load_expert_weight("model.layers.0.mlp.gate_proj.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="has shape"):
        layer.load_expert_weight("block_sparse_moe.experts.0.w1.weight", torch.zeros(WIDTH + 1, HIDDEN))
    with pytest.raises(ValueError, match="expert 8 of 8"):
        layer.load_expert_weight("block_sparse_moe.experts.8.w2.weight", torch.zeros(HIDDEN, WIDTH))
    layer.load_expert_weight("block_sparse_moe.experts.0.w3.weight", torch.ones(WIDTH, HIDDEN))
    assert torch.equal(layer.w_gate_up[0, WIDTH:], torch.ones(WIDTH, HIDDEN))  # up: second half
    missing = layer.missing_weights()
    assert "gate" in missing and "w_gate_up.0.0" in missing and "w_gate_up.0.1" not in missing


def test_tensor_parallelism_is_refused():
    backend = kernels.get_backend("torch")
    with pytest.raises(ValueError, match="tensor parallelism"):
        FusedMoE.from_hf_config(mixtral_config(), backend, group=SimpleNamespace(size=2))
    FusedMoE.from_hf_config(mixtral_config(), backend, group=SimpleNamespace(size=1))


def test_configs_it_does_not_take():
    backend = kernels.get_backend("torch")
    with pytest.raises(ValueError, match="hidden_act 'silu'"):
        FusedMoE.from_hf_config(mixtral_config(hidden_act="gelu"), backend)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        FusedMoE.from_hf_config(SimpleNamespace(model_type="llama"), backend)


def test_which_layers_are_sparse():
    qwen = qwen3_moe_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_moe_layer(qwen, i) for i in range(6)] == [False, True, False, False, False, True]
    assert all(is_moe_layer(qwen3_moe_config(num_hidden_layers=3), i) for i in range(3))
    assert all(is_moe_layer(mixtral_config(num_hidden_layers=3), i) for i in range(3))
