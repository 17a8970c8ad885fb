"""Multi-LoRA shrink / expand (kernels/lora.py) on the CPU, on fresh random inputs:

* the references against the contract's per-row formula in float64;
* every compiled build this CPU runs (kernels/cpu/csrc/lora.h: avx512bf16, avx512,
  avx2, portable) against the references: ids in runs with -1 among them,
  1, 5 and 64 rows (runs longer than a work item's), ranks 4, 16, 48,
  widths 64, 576 and 100 (a scalar tail), float32 and bf16, scale 0.5, a
  stack of 3 adapters; then fp16, int64 ids, ranks up to 200 and widths
  whose tails take each path; expand leaves the rows with id -1 bit for bit;
* expand with a fused projection's slices (compact B, a rank block of h per
  slice): the reference against the per-slice formula in float64, every
  build against the reference (SmolLM2's q | k | v, slices that cut work
  items short, ranks whose blocks start off a vector pair);
* a row's numbers do not depend on its batch; bad ids and slices are refused;
* the dispatch: auto / cpu take the compiled op, the reference without a build
  or for a y it cannot write in place.

Bounds (lora_cases.py): float32 within twice fp32's summation bound; bf16
outputs within half a bf16 unit in the last place of each side more.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernel_cases import case_seed
from kernels.lora import lora_expand_reference, lora_shrink_reference
from lora_cases import block_diagonal, check_close, make_inputs

SCALE = 0.5
RANKS = (4, 16, 48)
QKV = (0, 576, 768, 960)  # SmolLM2's qkv_proj: q 576 rows, k and v 192


def _seed(session_seed: int, *parts) -> int:
    """Per-test inputs of the session seed (a failure prints it: PAGEDSERVE_TEST_SEED)."""
    return case_seed(session_seed, repr(parts))


def _naive_shrink(x, a, ids, scale):
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(ids.tolist()):
        if slot >= 0:
            h[t] = scale * (a[slot].double() @ x[t].double())
    return h


def _naive_expand(y, h, b, ids):
    out = y.double().clone()
    for t, slot in enumerate(ids.tolist()):
        if slot >= 0:
            out[t] += b[slot].double() @ h[t].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_reference_matches_the_per_row_formula(tokens, dtype, session_seed):
    x, a, y, b, ids = make_inputs(tokens, 16, 100, dtype, _seed(session_seed, tokens, str(dtype)), out=70)
    h = lora_shrink_reference(x, a, ids, SCALE)
    assert h.dtype == torch.float32 and h.shape == (tokens, 16)
    error = check_close(h, _naive_shrink(x, a, ids, SCALE), x, a, ids, scale=SCALE)
    assert error is None, f"shrink, seed {session_seed}: {error}"
    assert torch.equal(h[ids < 0], torch.zeros_like(h[ids < 0]))
    got = lora_expand_reference(y.clone(), h, b, ids)
    error = check_close(got, _naive_expand(y, h, b, ids), h, b, ids, base=y)
    assert error is None, f"expand, seed {session_seed}: {error}"
    assert torch.equal(got[ids < 0], y[ids < 0])


def _naive_sliced_expand(y, h, b, ids, slices):
    out = y.double().clone()
    rank = b.shape[2]
    for t, slot in enumerate(ids.tolist()):
        if slot < 0:
            continue
        for i, (start, stop) in enumerate(zip(slices, slices[1:])):
            out[t, start:stop] += b[slot, start:stop].double() @ h[t, i * rank:(i + 1) * rank].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_reference_matches_the_per_slice_formula(tokens, dtype, session_seed):
    x, a, y, b, ids = make_inputs(tokens, 16, 64, dtype, _seed(session_seed, "sliced", tokens, str(dtype)),
                                  out=QKV[-1], blocks=3)
    h = lora_shrink_reference(x, a, ids, SCALE)
    got = lora_expand_reference(y.clone(), h, b, ids, list(QKV))
    error = check_close(got, _naive_sliced_expand(y, h, b, ids, QKV), h, block_diagonal(b, QKV), ids, base=y)
    assert error is None, f"seed {session_seed}: {error}"
    assert torch.equal(got[ids < 0], y[ids < 0])
    # One slice is the plain expand.
    one = lora_expand_reference(y.clone(), h[:, :16], b, ids, (0, QKV[-1]))
    assert torch.equal(one, lora_expand_reference(y.clone(), h[:, :16].contiguous(), b, ids))


def _check_builds(builds, x, a, y, b, ids) -> None:
    """Each build's shrink and expand against the references (computed once)."""
    expected_h = lora_shrink_reference(x, a, ids, SCALE)
    expected_y = lora_expand_reference(y.clone(), expected_h, b, ids)
    for isa, ops in builds.items():
        where = f"{isa} {tuple(x.shape)} R={a.shape[1]} {x.dtype}"
        h = ops.lora_shrink(x, a, ids, SCALE)
        assert h.dtype == torch.float32 and h.shape == expected_h.shape, where
        error = check_close(h, expected_h, x, a, ids, scale=SCALE)
        assert error is None, f"shrink {where}: {error}"
        assert torch.equal(h[ids < 0], torch.zeros_like(h[ids < 0])), where
        out = y.clone()
        returned = ops.lora_expand(out, expected_h, b, ids)
        assert returned.data_ptr() == out.data_ptr(), f"{where}: expand must return y itself"
        error = check_close(out, expected_y, expected_h, b, ids, base=y)
        assert error is None, f"expand {where}: {error}"
        assert torch.equal(out[ids < 0], y[ids < 0]), f"{where}: a row with id -1 changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 576, 100])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_every_build_matches_the_reference(builds, tokens, width, dtype, session_seed):
    for rank in RANKS:
        x, a, y, b, ids = make_inputs(tokens, rank, width, dtype,
                                      _seed(session_seed, tokens, width, rank, str(dtype)))
        _check_builds(builds, x, a, y, b, ids)


# (dtype, rank, width, out): fp16; ranks and widths whose last W elements go
# as one vector (48 and 80 on AVX-512, 200 on AVX2) or in scalar code (200 on
# AVX-512); rank 192 (3 x 64); 130 outputs: a whole strip of 128 and a partial one.
EDGES = ((torch.float16, 48, 80, 130), (torch.bfloat16, 192, 80, 130), (torch.float32, 200, 112, 33),
         (torch.bfloat16, 200, 48, 70))


@pytest.mark.parametrize("dtype, rank, width, out", EDGES, ids=str)
def test_other_dtypes_ranks_and_int64_ids(builds, dtype, rank, width, out, session_seed):
    x, a, y, b, ids = make_inputs(7, rank, width, dtype, _seed(session_seed, rank, width), out=out)
    _check_builds(builds, x, a, y, b, ids.long())


# (rank, width, slices): SmolLM2's qkv at rank 16 (block 1 starts half way
# into an AVX-512 pair); rank 40 (a pair, a vector on AVX2) on slices that
# end work items at 100 and 130; rank 5 (scalar code), gate | up halves;
# rank 48 with a strip of 128, 128 and 44 in each half.
SLICED = ((16, 64, QKV), (40, 48, (0, 100, 130, 200)), (5, 64, (0, 70, 140)), (48, 64, (0, 300, 600)))


def _check_sliced_builds(builds, h, y, b, ids, slices) -> None:
    expected = lora_expand_reference(y.clone(), h, b, ids, slices)
    padded = block_diagonal(b, slices)  # the bound's magnitudes
    for isa, ops in builds.items():
        where = f"{isa} T={h.shape[0]} R={b.shape[2]} slices {slices} {y.dtype}"
        out = y.clone()
        assert ops.lora_expand(out, h, b, ids, list(slices)).data_ptr() == out.data_ptr(), where
        error = check_close(out, expected, h, padded, ids, base=y)
        assert error is None, f"{where}: {error}"
        assert torch.equal(out[ids < 0], y[ids < 0]), f"{where}: a row with id -1 changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_every_build_matches_the_reference_with_slices(builds, tokens, dtype, session_seed):
    for rank, width, slices in SLICED:
        x, a, y, b, ids = make_inputs(tokens, rank, width, dtype, _seed(session_seed, tokens, rank, slices),
                                      out=slices[-1], blocks=len(slices) - 1)
        _check_sliced_builds(builds, lora_shrink_reference(x, a, ids, SCALE), y, b, ids, slices)


def test_fp16_and_int64_ids_with_slices(builds, session_seed):
    x, a, y, b, ids = make_inputs(7, 24, 48, torch.float16, _seed(session_seed, "fp16 sliced"), out=130,
                                  blocks=3)
    _check_sliced_builds(builds, lora_shrink_reference(x, a, ids, SCALE), y, b, ids.long(), (0, 10, 66, 130))


def test_a_row_does_not_depend_on_its_batch(compiled_cpu_ops, session_seed):
    """The same FMAs in the same order wherever a row lands: alone, or in a
    run of a prefill chunk, its numbers are the same bits."""
    x, a, y, b, ids = make_inputs(40, 48, 100, torch.bfloat16, _seed(session_seed, "batch"), out=200)
    ids[:37] = 1  # a run longer than a work item's, then its leftover rows
    h = compiled_cpu_ops.lora_shrink(x, a, ids, SCALE)
    out = compiled_cpu_ops.lora_expand(y.clone(), h, b, ids)
    for t in (0, 3, 33, 36, 39):
        one = ids[t:t + 1]
        h_row = compiled_cpu_ops.lora_shrink(x[t:t + 1], a, one, SCALE)
        assert torch.equal(h_row, h[t:t + 1]), f"shrink row {t}"
        assert torch.equal(compiled_cpu_ops.lora_expand(y[t:t + 1].clone(), h_row, b, one), out[t:t + 1])


def test_a_sliced_row_does_not_depend_on_its_batch(compiled_cpu_ops, session_seed):
    x, a, y, b, ids = make_inputs(40, 16, 64, torch.bfloat16, _seed(session_seed, "sliced batch"),
                                  out=QKV[-1], blocks=3)
    ids[:37] = 2
    h = compiled_cpu_ops.lora_shrink(x, a, ids, SCALE)
    out = compiled_cpu_ops.lora_expand(y.clone(), h, b, ids, list(QKV))
    for t in (0, 33, 39):
        row = compiled_cpu_ops.lora_expand(y[t:t + 1].clone(), h[t:t + 1], b, ids[t:t + 1], list(QKV))
        assert torch.equal(row, out[t:t + 1]), f"row {t}"


def test_bad_slices_are_refused(compiled_cpu_ops):
    x, a, y, b, ids = make_inputs(4, 4, 64, torch.float32, 0, out=96, blocks=3)
    h = lora_shrink_reference(x, a, ids, SCALE)
    for bad in ([0, 32, 64], [0, 64, 32, 96], [0, 32, 64, 90], [8, 32, 64, 96], [0, 32, 32, 96], [0], []):
        for expand in (compiled_cpu_ops.lora_expand, lora_expand_reference):
            with pytest.raises(ValueError, match="slices|wide"):
                expand(y.clone(), h, b, ids, bad)
    with pytest.raises(ValueError, match="wide"):  # h of three blocks, no slices
        lora_expand_reference(y.clone(), h, b, ids)


def test_bad_ids_are_refused(compiled_cpu_ops):
    x, a, y, b, ids = make_inputs(4, 4, 64, torch.float32, 0)
    for bad in (3, -2):  # a stack of 3 slots
        ids[2] = bad
        with pytest.raises(ValueError, match="adapter slot"):
            compiled_cpu_ops.lora_shrink(x, a, ids, SCALE)
        with pytest.raises(ValueError, match="adapter slot"):
            compiled_cpu_ops.lora_expand(y, x[:, :4].contiguous(), b, ids)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        compiled_cpu_ops.lora_shrink(x, a, ids.float(), SCALE)


def test_auto_and_cpu_take_the_compiled_op(compiled_cpu_ops, session_seed):
    x, a, y, b, ids = make_inputs(9, 16, 100, torch.bfloat16, _seed(session_seed, "dispatch"))
    h = compiled_cpu_ops.lora_shrink(x, a, ids, SCALE)
    expected = compiled_cpu_ops.lora_expand(y.clone(), h, b, ids)
    for backend in (kernels, kernels.get_backend("auto"), kernels.get_backend("cpu")):
        assert torch.equal(backend.lora_shrink(x, a, ids, SCALE), h)
        out = y.clone()
        assert backend.lora_expand(out, h, b, ids) is out and torch.equal(out, expected)
    torch_backend = kernels.get_backend("torch")
    assert torch_backend.lora_shrink is lora_shrink_reference
    assert torch_backend.lora_expand is lora_expand_reference


def test_the_reference_serves_without_a_build_or_in_place_layout(monkeypatch, session_seed):
    x, a, y, b, ids = make_inputs(6, 16, 64, torch.float32, _seed(session_seed, "fallback"))
    h = lora_shrink_reference(x, a, ids, SCALE)
    expected = lora_expand_reference(y.clone(), h, b, ids)
    wide = torch.zeros(6, 2 * 64)
    strided = wide[:, ::2]  # not contiguous: written in place by the reference
    strided.copy_(y)
    assert kernels.lora_expand(strided, h, b, ids) is strided
    assert torch.equal(strided, expected)
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "off")
    assert torch.equal(kernels.lora_shrink(x, a, ids, SCALE), h)
    assert torch.equal(kernels.lora_expand(y.clone(), h, b, ids), expected)


def test_every_entry_point_takes_slices(compiled_cpu_ops, monkeypatch, session_seed):
    """auto / cpu forward the slices to the compiled op; the reference takes
    them for a y it cannot write in place, and without a build."""
    x, a, y, b, ids = make_inputs(9, 16, 64, torch.bfloat16, _seed(session_seed, "sliced dispatch"),
                                  out=QKV[-1], blocks=3)
    h = compiled_cpu_ops.lora_shrink(x, a, ids, SCALE)
    expected = compiled_cpu_ops.lora_expand(y.clone(), h, b, ids, list(QKV))
    for backend in (kernels, kernels.get_backend("auto"), kernels.get_backend("cpu")):
        out = y.clone()
        assert backend.lora_expand(out, h, b, ids, slices=QKV) is out and torch.equal(out, expected)
    reference = lora_expand_reference(y.clone(), h, b, ids, QKV)
    strided = torch.zeros(9, 2 * QKV[-1], dtype=y.dtype)[:, ::2]
    strided.copy_(y)
    assert torch.equal(kernels.lora_expand(strided, h, b, ids, QKV), reference)
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "off")
    assert torch.equal(kernels.lora_expand(y.clone(), h, b, ids, QKV), reference)
