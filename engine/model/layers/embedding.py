"""The token embedding and the LM head, both over this rank's vocabulary slice."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.distributed.partition import Partition
from engine.model.layers.linear import all_reduce
from engine.model.layers.quantization import is_quant_weight, quant_embedding


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's vocabulary slice. A token outside the
    slice embeds to zeros here, so the all-reduce leaves each token the one
    row that holds it (a sum with zeros: exact in any dtype)."""

    def __init__(self, part: Partition, hidden_size: int, kernels, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(part.vocab_rows, hidden_size))
        self.start = part.vocab_start
        self.rows = part.vocab_rows
        self.kernels = kernels
        self.group = group

    def use_quantized(self, blob: torch.Tensor) -> None:
        """Keep the table in a GGUF file's blocks (kernels/quant.py): a step
        de-quantizes only the rows it looks up, and a tied LM head multiplies
        the blocks as they are. Rows come out in the float table's dtype (the model's)."""
        self.rows_dtype = self.weight.dtype
        del self.weight
        self.register_buffer("weight", blob)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if is_quant_weight(self.weight):  # no tensor parallelism here (models/weights.py)
            return quant_embedding(self.kernels, input_ids, self.weight, self.rows_dtype)
        # The backend's embedding: the weight may be packed as the tied LM head.
        if self.group is None:
            return self.kernels.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        rows = self.kernels.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0), self.group)


def compute_logits(kernels, hidden: torch.Tensor, weight: torch.Tensor, group,
                   vocab_size: int) -> torch.Tensor | None:
    """Logits over the whole vocabulary; with tensor parallelism each rank
    computes its slice's and rank 0 gathers them (the others get None)."""
    # float32 logits: rounded to bf16 they tie wherever two tokens are within
    # one bf16 step (~0.1 at typical logit sizes), and greedy picks between
    # ties by token id.
    if is_quant_weight(weight):
        logits = kernels.quant_linear(hidden, weight, float_out=True)
    else:
        logits = kernels.linear(hidden, weight, float_out=True)
    if group is None:
        return logits
    slices = group.gather(logits)
    if slices is None:
        return None
    return torch.cat(slices, dim=-1)[:, :vocab_size]
