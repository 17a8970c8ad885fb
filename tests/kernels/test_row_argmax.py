"""Greedy decoding's argmax (kernels/argmax.py, kernels/cpu/csrc/argmax.h)
against torch.argmax (the reference) on fresh random rows, through every
build this CPU runs: ties (the first index wins), NaN (the first NaN wins),
infinities, rows whose length is no multiple of a vector, a NaN or the
maximum in the tail, short rows, and strided rows (logits[:, :vocab] of a
padded head)."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import row_argmax

WIDTHS = (1, 7, 31, 33, 100, 4096, 49152, 32000 + 5)


def check(ops, logits: torch.Tensor, what: str) -> None:
    got = ops.row_argmax(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1)), what


@pytest.mark.parametrize("width", WIDTHS)
def test_random_rows_and_ties(builds, width, session_seed):
    g = torch.Generator().manual_seed(session_seed + width)
    rows = [torch.randn(5, width, generator=g),
            torch.randint(-3, 3, (5, width), generator=g).float()]  # many ties a row
    rows[1][0, width - 1] = 9.0  # the maximum last (in a tail)
    rows[1][1, width // 2] = 9.0
    rows[1][1, width - 1] = 9.0  # ... tied with an earlier one
    for isa, ops in builds.items():
        for logits in rows:
            check(ops, logits, f"{isa} width {width}")


@pytest.mark.parametrize("width", WIDTHS)
def test_nan_and_infinities(builds, width, session_seed):
    g = torch.Generator().manual_seed(session_seed + 2 * width)
    logits = torch.randn(7, width, generator=g)
    logits[0, width - 1] = float("nan")  # a NaN last: it wins
    logits[1, [0, width - 1]] = float("nan")  # two: the first wins
    logits[2] = float("-inf")  # nothing allowed: index 0
    logits[3] = float("-inf")
    logits[3, width // 3] = 1.0  # one token allowed
    logits[4, width // 2] = float("inf")
    logits[5, width // 2] = float("inf")
    logits[5, width - 1] = float("nan")  # NaN above +inf
    logits[6, width // 4] = -0.0
    logits[6] = logits[6].clamp(max=0.0)  # 0.0 and -0.0 tie: the first
    for isa, ops in builds.items():
        check(ops, logits, f"{isa} width {width}")


def test_strided_rows_and_the_dispatch(builds, session_seed):
    g = torch.Generator().manual_seed(session_seed)
    padded = torch.randn(4, 49152 + 128, generator=g)
    for isa, ops in builds.items():
        check(ops, padded[:, :49152], isa)  # a row stride wider than the row
        check(ops, padded[1:3, 5:40005], isa)  # and an offset start
        check(ops, torch.empty(0, 10), isa)
    # kernels.argmax.row_argmax: the compiled op where it applies, torch's elsewhere.
    for logits in (padded, torch.randn(3, 100, generator=g).to(torch.bfloat16),
                   torch.randn(100, 3, generator=g).t()):
        assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))


def test_refusals(builds):
    for ops in builds.values():
        with pytest.raises(RuntimeError, match="float32"):
            ops.row_argmax(torch.zeros(2, 8, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="no logits"):
            ops.row_argmax(torch.zeros(2, 0))
