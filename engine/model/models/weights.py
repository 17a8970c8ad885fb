"""Checkpoint tensors (HF names) into a model whose projections are fused.

Our layers multiply q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
(one matmul each). A checkpoint usually stores them apart; each lands in its
rows of the fused weight. Phi-3 stores them fused already: they land whole.

    qkv_proj rows:      [ q: heads * head_dim | k: kv_heads * head_dim | v ]
    gate_up_proj rows:  [ gate: intermediate  | up: intermediate ]

With tensor parallelism the tensors arrive as this rank's slices and the
offsets are the slice's (model/distributed/partition.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

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
        for name, tensor in weights:
            target, offset = self._target_of(name)
            if target is None:
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            rows = tensor.shape[0]
            start = self._shard_offset(target, offset)
            param.data[start : start + rows].copy_(tensor)
            indices = range(_shards(target)) if offset == WHOLE else (offset,)
            loaded.update(f"{target}#{i}" for i in indices)
        self._check_all_loaded(params, loaded)

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


def _shards(name: str) -> int:
    """How many checkpoint tensors make up the parameter `name`."""
    return next((n for fused, n in SHARDS.items() if f".{fused}." in name), 1)
