"""The candidate fast path of top-k / top-p (engine/sampling/top_k_top_p.py)
keeps exactly what the full sort keeps, on fresh random rows of a real
vocabulary's width, and hands rows it cannot decide to the full sort."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import top_k_top_p
from engine.sampling.top_k_top_p import apply_top_k_top_p

VOCAB = 6000  # wider than CANDIDATES, so the fast path runs


def full_sort(monkeypatch, logits, top_k, top_p):
    with monkeypatch.context() as patch:
        patch.setattr(top_k_top_p, "CANDIDATES", VOCAB)  # never narrower than the row
        return apply_top_k_top_p(logits, top_k, top_p)


def random_case(generator: torch.Generator):
    rows = 8
    scale = float(torch.empty(1).uniform_(0.5, 6.0, generator=generator))
    logits = torch.randn(rows, VOCAB, generator=generator) * scale
    top_k = torch.tensor([0, 1, 5, 40, 700, 3000, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.8, 0.99, 1e-6, 0.999])
    return logits, top_k, top_p


@pytest.mark.parametrize("seed", range(6))
def test_the_fast_path_keeps_what_the_full_sort_keeps(seed, monkeypatch):
    generator = torch.Generator().manual_seed(seed)
    decided = 0
    for _ in range(4):
        logits, top_k, top_p = random_case(generator)
        fast, rows = top_k_top_p._filter_candidates(logits, top_k, top_p)
        full = full_sort(monkeypatch, logits, top_k, top_p)
        decided += int(rows.sum())
        assert torch.equal(fast[rows].isfinite(), full[rows].isfinite())
        assert torch.equal(fast[rows][fast[rows].isfinite()], logits[rows][fast[rows].isfinite()])
        assert torch.equal(apply_top_k_top_p(logits, top_k, top_p), full)
        assert not bool(rows[5])  # top_k 3000: wider than the candidates
    assert decided >= 4 * 4  # the fast path decided most rows


def test_rows_it_cannot_decide_take_the_full_sort(monkeypatch):
    logits = torch.zeros(2, VOCAB)  # every token tied: no cut-off among candidates
    logits[1, :3] = 20.0  # these three hold nearly all the mass: decided
    top_k, top_p = torch.tensor([0, 0]), torch.tensor([0.5, 0.5])
    assert top_k_top_p._filter_candidates(logits, top_k, top_p)[1].tolist() == [False, True]
    out = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(out, full_sort(monkeypatch, logits, top_k, top_p))
    # ties broken by id, as the full sort does: row 0 keeps the lowest ids
    kept = out.isfinite()
    assert kept[0].nonzero().flatten().tolist() == list(range(VOCAB // 2 + 1))[: int(kept[0].sum())]
    # a top-k wider than the candidates needs the whole row's ranking too
    wide = torch.randn(1, VOCAB)
    assert not top_k_top_p._filter_candidates(wide, torch.tensor([2000]), torch.tensor([1.0]))[1]


def test_rows_without_filters_pass_through_beside_filtered_ones():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    out, rows = top_k_top_p._filter_candidates(logits, torch.tensor([0, 0]), torch.tensor([1.0, 0.5]))
    assert rows.tolist() == [True, True]
    assert torch.equal(out[0], logits[0])
    assert 0 < int(out[1].isfinite().sum()) < 200
