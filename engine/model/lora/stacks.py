"""The adapters of one step, stacked per projection, and how a projection adds them.

Every adapted projection (qkv_proj, o_proj, gate_up_proj, down_proj of every
layer) owns one `LoRAStack`: --max-loras slots of A and B, padded to
--max-lora-rank per slice of the projection:

    a  [slots, slices * max_rank, in]      b  [slots, out, slices * max_rank]

    qkv_proj, one slot:   A rows  [ A_q | A_k | A_v ]           (each max_rank rows)
                          B       [ B_q  0    0  ]  q rows
                                  [ 0   B_k   0  ]  k rows
                                  [ 0    0   B_v ]  v rows

so one shrink and one expand add every slice's update at once, and a slot
that adapts only q and v leaves zeros elsewhere. The step's rows name their
slot in one shared `LoRAContext` (-1: the base alone); the kernels
(kernels/lora.py) gather each row's adapter, so a batch mixes adapters in
one call per projection with no loop over them. The base weight is never
touched: an adapter is added, never merged.
"""

from __future__ import annotations

import torch


class LoRAContext:
    """Which slot each row of this step reads (None: no row has an adapter;
    the runner sets it before the forward pass)."""

    def __init__(self) -> None:
        self.row_ids: torch.Tensor | None = None


class LoRAStack:
    def __init__(self, context: LoRAContext, kernels, slots: int, max_rank: int,
                 rows: list[tuple[int, int]], in_features: int, dtype, device) -> None:
        """`rows`: the output rows of each slice of the projection (on this rank)."""
        self.context, self.kernels, self.max_rank, self.rows = context, kernels, max_rank, rows
        width = len(rows) * max_rank
        out = rows[-1][1]
        self.a = torch.zeros(slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out, width, dtype=dtype, device=device)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base's product of x) plus each adapted row's B (A x)."""
        ids = self.context.row_ids
        if ids is None:
            return y
        h = self.kernels.lora_shrink(x, self.a, ids, 1.0)
        return self.kernels.lora_expand(y, h, self.b, ids)

    def load(self, slot: int, pieces: list[tuple[int | None, torch.Tensor, torch.Tensor]]) -> None:
        """Fill a slot: (slice index, or None for the whole projection, A, B) per
        piece the adapter has; everything else in the slot is zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, a, b in pieces:
            start, stop = (self.rows[0][0], self.rows[-1][1]) if index is None else self.rows[index]
            block = (index or 0) * self.max_rank
            rank = a.shape[0]
            self.a[slot, block:block + rank].copy_(a)
            self.b[slot, start:stop, block:block + rank].copy_(b)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes
