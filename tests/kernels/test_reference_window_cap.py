"""The reference kernels' sliding window and soft cap, at their edges, against a
dense computation written here (issue 57).

The reference is the oracle the compiled ops and Triton are held to, so its
own slips must show without them: a window one token short or long, a cap
applied the wrong way round. Contexts sit exactly at the window, one past
it and far past it; caps are small enough to bend every score. The dense
side is the contract spelled out: query at position p sees keys p - W < k <= p,
scores scale * q.k, capped as cap * tanh(s / cap), one softmax in float64.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import make_paged_cache
from kernels.reference import paged_decode_attention_reference, paged_prefill_attention_reference

HEAD_DIM, HEADS, KV_HEADS, BLOCK = 16, 4, 2, 4  # GQA groups of 2; windows cross blocks
SCALE = HEAD_DIM ** -0.5
WINDOWS = [1, 5, 8]
CAPS = [None, 0.5, 3.0]


def dense(query, keys, values, position, window, cap):
    """query [heads, dim] at `position` over keys/values [length, kv_heads, dim]."""
    first = 0 if window is None else max(0, position - window + 1)
    k = keys[first:position + 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = values[first:position + 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("hd,khd->hk", query.double(), k) * SCALE
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    return torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), v)


def edge_lengths(window: int) -> list[int]:
    """Contexts one short of the window, at it, one past it, and far past it."""
    return sorted({max(1, window - 1), window, window + 1, 3 * window + 2})


def check(out, expected):
    assert not torch.isnan(out).any()
    error = (out.double() - expected).abs().max().item()
    assert error < 1e-5, error


@pytest.mark.parametrize("cap", CAPS, ids=str)
@pytest.mark.parametrize("window", [None, *WINDOWS], ids=str)
def test_decode_reads_exactly_the_last_window_tokens(window, cap):
    lengths = edge_lengths(window or 6) + [0]  # and a padding row
    gen = torch.Generator().manual_seed(len(lengths) * 31 + (window or 0))
    k_cache, v_cache, tables, keys, values = make_paged_cache(
        lengths, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, "cpu", gen)
    query = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=gen)
    out = paged_decode_attention_reference(
        query, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), SCALE,
        sliding_window=window, logits_soft_cap=cap)
    expected = torch.stack([
        dense(query[i], keys[i], values[i], n - 1, window, cap) if n else
        torch.zeros(HEADS, HEAD_DIM, dtype=torch.float64) for i, n in enumerate(lengths)])
    check(out, expected)
    # Rows of one length (one row, the common decode) take the reference's path
    # without a mask: each row alone gives the same numbers.
    for i, n in enumerate(lengths[:-1]):
        alone = paged_decode_attention_reference(
            query[i:i + 1], k_cache, v_cache, tables[i:i + 1],
            torch.tensor([n], dtype=torch.int32), SCALE, sliding_window=window,
            logits_soft_cap=cap)
        check(alone, expected[i:i + 1])


def prefill_plan(window: int) -> list[tuple[int, int]]:
    """(context length, new tokens): whole prompts at the edges, chunks after a
    cached prefix whose first query sits at the window's edge, one-token extends."""
    return [(window, window), (window + 1, window + 1), (2 * window + 3, 2 * window + 3),
            (window + 3, 3), (window + 1, 1), (3 * window, window)]


@pytest.mark.parametrize("cap", CAPS, ids=str)
@pytest.mark.parametrize("window", [None, *WINDOWS], ids=str)
def test_prefill_reads_exactly_each_querys_window(window, cap):
    plan = prefill_plan(window or 6)
    lengths = [n for n, _ in plan]
    gen = torch.Generator().manual_seed(len(plan) * 17 + (window or 0))
    k_cache, v_cache, tables, keys, values = make_paged_cache(
        lengths, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, "cpu", gen)
    cu = torch.tensor([0] + [nq for _, nq in plan]).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), HEADS, HEAD_DIM, generator=gen)
    out = paged_prefill_attention_reference(
        query, k_cache, v_cache, tables, cu, torch.tensor(lengths, dtype=torch.int32), SCALE,
        sliding_window=window, logits_soft_cap=cap)
    rows = []
    for i, (length, nq) in enumerate(plan):
        for j in range(nq):
            rows.append(dense(query[int(cu[i]) + j], keys[i], values[i], length - nq + j,
                              window, cap))
    check(out, torch.stack(rows))


def test_the_edges_matter_here():
    """The dense side itself tells the cases apart: a window one token longer,
    or another cap, moves the output far past the tolerance."""
    gen = torch.Generator().manual_seed(5)
    keys, values = torch.randn(9, KV_HEADS, HEAD_DIM, generator=gen), torch.randn(
        9, KV_HEADS, HEAD_DIM, generator=gen)
    query = torch.randn(HEADS, HEAD_DIM, generator=gen)
    base = dense(query, keys, values, 8, 5, 0.5)
    assert (base - dense(query, keys, values, 8, 6, 0.5)).abs().max() > 1e-2
    assert (base - dense(query, keys, values, 8, 5, 2.0)).abs().max() > 1e-2
