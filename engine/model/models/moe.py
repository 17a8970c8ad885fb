"""Mixture-of-experts families: Mixtral and Qwen3-MoE.

Attention is their dense relative's (Mixtral: Mistral's, with its sliding
window; Qwen3-MoE: Qwen3's, with q/k norm); the feed-forward block of a
layer is a router and E experts (layers/moe.py FusedMoE), whose products run
grouped by expert through kernels.fused_moe. Routing follows HF: softmax in
float32, top-k, then the k weights divided by their sum (always for Mixtral,
with `norm_topk_prob` for Qwen3-MoE). Qwen3-MoE may keep a dense MLP on some
layers (`mlp_only_layers`, `decoder_sparse_step`).

Checkpoint names: Mixtral's `block_sparse_moe.` is our `mlp.`; the expert
tensors go to their layer's FusedMoE.load_expert_weight, which also takes
the fused [E, ...] tensors transformers 5 may write.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from engine.model.layers.linear import Linear, packed
from engine.model.layers.quantization import is_quant_weight
from engine.model.layers.moe import FusedMoE, is_moe_layer
from engine.model.models.args import ModelArgs, MoEArgs
from engine.model.models.llama import LlamaForCausalLM
from engine.model.models.qwen3 import Qwen3ForCausalLM
from engine.model.models.weights import float_values

_EXPERT_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(gate\.weight|experts\..*)$")


def moe_args(hf_config) -> MoEArgs:
    layers = tuple(is_moe_layer(hf_config, i) for i in range(hf_config.num_hidden_layers))
    if getattr(hf_config, "model_type", None) == "mixtral":
        return MoEArgs(hf_config.num_local_experts, hf_config.num_experts_per_tok,
                       hf_config.intermediate_size, layers, True, False)
    return MoEArgs(hf_config.num_experts, hf_config.num_experts_per_tok,
                   hf_config.moe_intermediate_size, layers, bool(hf_config.norm_topk_prob), True)


class ExpertLoading:
    """load_weights that hands every router and expert tensor to its layer's
    FusedMoE and the rest to the dense loader (models/weights.py)."""

    TENSOR_PARALLEL = False  # the experts are not split across ranks yet

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def dense():
            for name, tensor in weights:
                match = _EXPERT_TENSOR.match(name)
                if match is None:
                    yield name, tensor
                    continue
                block = self.layers[int(match.group(1))].mlp
                if not isinstance(block, FusedMoE) or not block.load_expert_weight(
                        match.group(2), float_values(tensor, self.kernels)):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")

        super().load_weights(dense())
        missing = [f"layers.{i}.mlp.{key}" for i, layer in enumerate(self.layers)
                   if isinstance(layer.mlp, FusedMoE) for key in layer.mlp.missing_weights()]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")

    def _check_all_loaded(self, params: dict, loaded: set[str]) -> None:
        dense = {name: p for name, p in params.items() if not _in_experts(name, self.layers)}
        super()._check_all_loaded(dense, loaded)

    def pack_linear_weights(self) -> None:
        """Dense layers as the Llama model packs them; each FusedMoE packs its own."""
        experts = [layer.mlp for layer in self.layers if isinstance(layer.mlp, FusedMoE)]
        inside = {id(m) for block in experts for m in block.modules()}
        for module in self.modules():
            if isinstance(module, Linear) and id(module) not in inside:
                module.weight = packed(self.kernels, module.weight)
        if self.lm_head is None and not is_quant_weight(self.embed_tokens.weight):
            self.embed_tokens.weight = packed(self.kernels, self.embed_tokens.weight)
        for block in experts:
            block.pack_weights()

    def quantize_weights(self, type_name: str) -> None:
        raise ValueError(f"quantizing at load ({type_name}) does not cover mixture-of-experts "
                         "layers yet; serve this model without --quantization")


def _in_experts(name: str, layers) -> bool:
    match = re.match(r"^layers\.(\d+)\.mlp\.", name)
    return match is not None and isinstance(layers[int(match.group(1))].mlp, FusedMoE)


class MixtralForCausalLM(ExpertLoading, LlamaForCausalLM):
    @classmethod
    def model_args(cls, hf_config) -> ModelArgs:
        return ModelArgs.from_hf_config(hf_config, moe=moe_args(hf_config))


class Qwen3MoeForCausalLM(ExpertLoading, Qwen3ForCausalLM):
    @classmethod
    def model_args(cls, hf_config) -> ModelArgs:
        return ModelArgs.from_hf_config(hf_config, moe=moe_args(hf_config))
