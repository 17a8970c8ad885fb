"""The adapters of one step, stacked per projection, and how a projection adds them.

Every adapted projection (qkv_proj, o_proj, gate_up_proj, down_proj of every
layer) owns one `LoRAStack`: --max-loras slots of A and B, padded to
--max-lora-rank per slice of the projection:

    a  [slots, slices * max_rank, in]      b  [slots, out, max_rank]

    qkv_proj, one slot:   A rows  [ A_q | A_k | A_v ]           (each max_rank rows)
                          B       [ B_q ]  q rows
                                  [ B_k ]  k rows
                                  [ B_v ]  v rows

Shrink makes h = [A_q x | A_k x | A_v x] and expand, told the slices' row
bounds, adds B_q (A_q x) to the q rows, B_k (A_k x) to the k rows and so on
(kernels/lora.py): one shrink and one expand add every slice's update at
once, and B holds no zeros between the slices (a block-diagonal B of every
slice's columns read 2/3 zeros for qkv, 1/2 for gate_up at each decode
step). A slot that adapts only q and v leaves zeros in k's blocks. The
step's rows name their slot in one shared `LoRAContext` (-1: the base
alone); the kernels gather each row's adapter, so a batch mixes adapters in
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
        """`rows`: the output rows of each slice of the projection (on this rank),
        in order, from 0 with no gap."""
        self.context, self.kernels, self.max_rank, self.rows = context, kernels, max_rank, rows
        if rows[0][0] != 0 or any(stop != start for (_, stop), (start, _) in zip(rows, rows[1:])):
            raise ValueError(f"LoRAStack: slices {rows} must cover the outputs from 0 in order")
        # expand's slices: the row bounds of a projection of several; None for one
        self.bounds = [0] + [stop for _, stop in rows] if len(rows) > 1 else None
        self.a = torch.zeros(slots, len(rows) * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, rows[-1][1], max_rank, dtype=dtype, device=device)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base's product of x) plus each adapted row's B (A x)."""
        ids = self.context.row_ids
        if ids is None:
            return y
        h = self.kernels.lora_shrink(x, self.a, ids, 1.0)
        return self.kernels.lora_expand(y, h, self.b, ids, slices=self.bounds)

    def load(self, slot: int, pieces: list[tuple[int | None, torch.Tensor, torch.Tensor]]) -> None:
        """Fill a slot: (slice index, or None for the whole projection, A, B) per
        piece the adapter has; everything else in the slot is zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, a, b in pieces:
            rank = a.shape[0]
            # A whole-projection piece (Phi-3's fused qkv_proj adapter) has one
            # A for every output row, but expand feeds slice i's rows from h's
            # block i: its A goes into every slice's block, so each block of h
            # is the same A x, and its B rows into columns [0, rank) as usual.
            blocks = range(len(self.rows)) if index is None else [index]
            for block in blocks:
                self.a[slot, block * self.max_rank:block * self.max_rank + rank].copy_(a)
            start, stop = (0, self.rows[-1][1]) if index is None else self.rows[index]
            self.b[slot, start:stop, :rank].copy_(b)
