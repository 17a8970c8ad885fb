"""Checkpoint tensors (HF names) into a model whose projections are fused.

Our layers multiply q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
(one matmul each). A checkpoint usually stores them apart; each lands in its
rows of the fused weight. Phi-3 stores them fused already: they land whole.

    qkv_proj rows:      [ q: heads * head_dim | k: kv_heads * head_dim | v ]
    gate_up_proj rows:  [ gate: intermediate  | up: intermediate ]

With tensor parallelism the tensors arrive as this rank's slices and the
offsets are the slice's (model/distributed/partition.py).

A GGUF file's quantized tensors (models/gguf_file.py QuantTensor) are not
copied into float weights: the shards of each projection are gathered into
one blob (kernels/quant.py) and the module becomes a QuantLinear
(layers/quantization.py), the embedding a quantized table. Anything else a
file quantizes (the experts of a MoE layer) is de-quantized into its float
weight: the file's values, in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.model.layers.embedding import VocabParallelEmbedding
from engine.model.layers.linear import Linear
from engine.model.layers.quantization import QuantLinear
from engine.model.models.gguf_file import QuantTensor
from kernels.quant import pack_quant_weight

# Checkpoint tensors that are packed into one of our fused projections:
# checkpoint name -> (fused name, index of the shard inside it).
PACKED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}
WHOLE = -1  # a checkpoint tensor that is the whole fused projection


class CheckpointLoading:
    """load_weights for a model with `partition`, `args`, `lm_head` (None when
    tied) and the fused projections above. `FUSED_IN_CHECKPOINT` names the
    projections a family's checkpoints store fused."""

    FUSED_IN_CHECKPOINT: tuple[str, ...] = ()

    # -- weights -------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model, packing fused projections."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        quantized: dict[str, dict[int, QuantTensor]] = {}  # target -> its shards, by index
        for name, tensor in weights:
            target, offset = self._target_of(name)
            if target is None:
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            if isinstance(tensor, QuantTensor) and self._keeps_quantized(target):
                quantized.setdefault(target, {})[offset] = tensor
                indices = range(_shards(target)) if offset == WHOLE else (offset,)
                loaded.update(f"{target}#{i}" for i in indices)
                continue
            tensor = float_values(tensor, self.kernels)
            rows = tensor.shape[0]
            start = self._shard_offset(target, offset)
            param.data[start : start + rows].copy_(tensor)
            indices = range(_shards(target)) if offset == WHOLE else (offset,)
            loaded.update(f"{target}#{i}" for i in indices)
        self._check_all_loaded(params, loaded)
        for target, shards in quantized.items():
            self._place_quantized(target, [shards[i] for i in sorted(shards)])

    def _keeps_quantized(self, target: str) -> bool:
        """Whether a quantized checkpoint tensor stays quantized at `target`:
        a linear layer's weight or the embedding table (never under tensor
        parallelism: loader.iter_checkpoint refuses to slice a GGUF)."""
        path, _, leaf = target.rpartition(".")
        return leaf == "weight" and isinstance(self.get_submodule(path), (Linear, VocabParallelEmbedding))

    def _place_quantized(self, target: str, shards: list[QuantTensor]) -> None:
        """A projection's quantized shards as one blob in the module that owns
        `target`: a linear layer becomes a QuantLinear, the embedding keeps the
        blob as its table."""
        path = target.rpartition(".")[0]
        module = self.get_submodule(path)
        blob = pack_quant_weight([(s.type_name, s.data) for s in shards], shards[0].shape[1])
        if isinstance(module, Linear):
            bias = None if module.bias is None else module.bias.detach()
            self.set_submodule(path, QuantLinear(blob, bias, module.kernels))
        else:
            module.use_quantized(blob)

    def _target_of(self, name: str) -> tuple[str | None, int]:
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None, 0
        if name == "lm_head.weight" and self.lm_head is None:
            return None, 0  # tied: the embedding is the head
        if any(f".{fused}." in name for fused in self.FUSED_IN_CHECKPOINT):
            return name, WHOLE
        for part, (fused, index) in PACKED_SHARDS.items():
            if f".{part}." in name:
                return name.replace(part, fused), index
        return name, 0

    def _shard_offset(self, target: str, index: int) -> int:
        """Where a checkpoint tensor (this rank's slice of it) starts in its fused projection."""
        part, head_dim = self.partition, self.args.head_dim
        if index == WHOLE:
            return 0
        if ".qkv_proj." in target:
            q, kv = part.num_heads * head_dim, part.num_kv_heads * head_dim
            return (0, q, q + kv)[index]
        if ".gate_up_proj." in target:
            return index * part.intermediate_size
        return 0

    def _check_all_loaded(self, params: dict, loaded: set[str]) -> None:
        missing = []
        for name in params:
            if any(f"{name}#{i}" not in loaded for i in range(_shards(name))):
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def float_values(tensor, kernels) -> torch.Tensor:
    """A checkpoint tensor as floats: a quantized one de-quantized (exactly
    the file's values, in float32), any other as it is."""
    if not isinstance(tensor, QuantTensor):
        return tensor
    blob = pack_quant_weight([(tensor.type_name, tensor.data)], tensor.shape[1])
    return kernels.quant_dequantize(blob)


def _shards(name: str) -> int:
    """How many checkpoint tensors make up the parameter `name`."""
    return next((n for fused, n in SHARDS.items() if f".{fused}." in name), 1)
