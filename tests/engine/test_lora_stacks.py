"""A LoRAStack (engine/model/lora/stacks.py) on its own: a fused projection's
slot holds A in a rank block per slice and B compact (only each slice's own
block), and apply() adds every piece's B (A x) to its rows alone, as the
plain per-module formula does in float64. Pieces of smaller rank than the
slot's; a whole-projection piece (Phi-3's fused qkv_proj adapter), whose A
serves every slice's rows; the reference kernels and the compiled CPU op.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.model.lora.stacks import LoRAContext, LoRAStack

IN, MAX_RANK = 64, 8
QKV = [(0, 48), (48, 64), (64, 80)]  # q | k | v rows


def _pieces(generator, whole: bool) -> list:
    """(slice index or None, A [r, in], B [rows, r]): q and v (ranks 4, 8), or the whole projection."""
    def pair(rank, rows):
        return torch.randn(rank, IN, generator=generator), torch.randn(rows, rank, generator=generator)
    if whole:
        return [(None, *pair(6, QKV[-1][1]))]
    return [(0, *pair(4, 48)), (2, *pair(8, 16))]


def _expected(x, y, pieces) -> torch.Tensor:
    out = y.double().clone()
    for index, a, b in pieces:
        start, stop = (0, QKV[-1][1]) if index is None else QKV[index]
        out[:, start:stop] += (x.double() @ a.double().t()) @ b.double().t()
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("whole", [False, True], ids=["slices", "whole"])
def test_a_slot_adds_each_piece_to_its_rows(backend, whole):
    g = torch.Generator().manual_seed(7)
    context = LoRAContext()
    stack = LoRAStack(context, kernels.get_backend(backend), 2, MAX_RANK, QKV, IN, torch.float32, "cpu")
    assert stack.a.shape == (2, 3 * MAX_RANK, IN) and stack.b.shape == (2, 80, MAX_RANK)
    assert stack.bounds == [0, 48, 64, 80]
    pieces = _pieces(g, whole)
    stack.load(1, pieces)
    x, y = torch.randn(5, IN, generator=g), torch.randn(5, 80, generator=g)
    context.row_ids = torch.tensor([1, -1, 1, 0, 1], dtype=torch.int32)  # slot 0 is empty
    got = stack.apply(x, y.clone())
    adapted = context.row_ids == 1
    torch.testing.assert_close(got[adapted].double(), _expected(x[adapted], y[adapted], pieces),
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(got[~adapted], y[~adapted])


def test_a_projection_of_one_slice_takes_no_slices():
    stack = LoRAStack(LoRAContext(), kernels.get_backend("torch"), 1, MAX_RANK, [(0, 64)], IN, torch.float32,
                      "cpu")
    assert stack.bounds is None and stack.b.shape == (1, 64, MAX_RANK)
    with pytest.raises(ValueError, match="from 0 in order"):
        LoRAStack(LoRAContext(), kernels.get_backend("torch"), 1, MAX_RANK, [(0, 8), (9, 16)], IN,
                  torch.float32, "cpu")
