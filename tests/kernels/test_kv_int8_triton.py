"""The Triton kernels on int8 KV caches (``--kv-cache-dtype int8``, layout in
kernels/kv_quant.py), on fresh random inputs each session:

* Store: Triton's quantizing store writes the reference's codes and fp16
  scale bytes exactly (ties rounded half to even, an all-zero row, scales
  clamped to fp16's maximum or underflowing to 0), skips slot -1 and touches
  no other slot; float32 and bf16 rows, int32 and int64 slots.
* Round trip: each stored row de-quantizes to within half its scale.
* Attention: decode (the public entry point, and split into partitions) and
  prefill/extend over a cached prefix, each plain, with a sliding window, a
  soft cap and both, at block sizes 1, 16 and 128 (head_dim 80 too: the
  scale bytes sit inside the padded tile), against the reference on the same
  int8 cache; the slots a kernel must not read hold NaN scales.  float32
  queries (the interpreter's bf16 arithmetic is broken), and one bf16 query
  shape for the output dtype.
* Compiled: decode, prefill and store with int8 caches go through the real
  compiler for sm_90, which rejects code the interpreter takes.

The cases run in child processes (kv_quantized_cases.py): the Triton interpreter
on a CPU (PAGEDSERVE_TEST_DEVICE=cuda: the GPU), two children side by side,
and the compile in a third.  A failure names the seed that reproduces it:
PAGEDSERVE_TEST_SEED=<session seed> pytest tests/kernels/test_kv_int8_triton.py.
"""

from __future__ import annotations

import importlib.util

import pytest

from kv_quantized_cases import attention_cases, check_outcome, run_all, shape_name
from need import need

# (head_dim, kv_heads, block_size) of the store cases: head counts and dims that need padding.
STORE_SHAPES = ((64, 4, 1), (80, 3, 16))


def store_cases() -> list[dict]:
    cases = []
    for shape, dtype, slot_dtype in zip(STORE_SHAPES, ("float32", "bfloat16"), ("int64", "int32")):
        cases.append(dict(kernel="store", shape=list(shape), dtype=dtype, slot_dtype=slot_dtype,
                          format="int8", id=f"int8-store-{dtype}-{slot_dtype}-{shape_name(shape)}"))
    cases.append(dict(kernel="roundtrip", shape=[64, 2, 16], format="int8", id="int8-roundtrip-d64-kv2-bs16"))
    return cases


CASES = attention_cases(lambda shape, dtype: "int8") + store_cases()
COMPILED = [dict(kernel="compile", shape=[80, 4, 16], format="int8", id="int8-compile-sm90-bf16-d80-g4-bs16")]


@pytest.fixture(scope="module")
def int8_results(kernel_test_device, session_seed) -> dict:
    """{case id: None or error} of every case."""
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    return run_all(CASES, COMPILED, kernel_test_device, session_seed)


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_triton_int8_cache_matches_reference(case, int8_results, session_seed):
    check_outcome(int8_results, case, session_seed)


@pytest.mark.parametrize("case", COMPILED, ids=[case["id"] for case in COMPILED])
def test_triton_int8_kernels_compile_for_sm90(case, int8_results, session_seed):
    check_outcome(int8_results, case, session_seed)


def test_int8_cache_checks_take_head_dim_from_the_codes(triton_available):
    """An int8 cache serves head_dim = its last dimension - 2 (the scale's
    bytes); rows whose scale could not be read as one fp16 are refused."""
    import torch

    from kernels.paged_attention import check_inputs
    from kernels.store_kvcache_triton import store_kvcache

    query, key = torch.zeros(2, 4, 64), torch.zeros(3, 2, 64)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    cache = torch.zeros(3, 16, 2, 66, dtype=torch.int8)
    check_inputs(query, cache, cache, tables, lens)
    store_kvcache(key[:0], key[:0], cache, cache, torch.zeros(0, dtype=torch.int64))
    codes_only = torch.zeros(3, 16, 2, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        check_inputs(query, codes_only, codes_only, tables, lens)
    with pytest.raises(ValueError, match="does not match"):
        store_kvcache(key, key, codes_only, codes_only, torch.zeros(3, dtype=torch.int64))
    odd_rows = torch.zeros(3, 16, 2, 67, dtype=torch.int8)[..., :66]
    with pytest.raises(ValueError, match="even byte offsets"):
        check_inputs(query, odd_rows, odd_rows, tables, lens)
    with pytest.raises(ValueError, match="even byte offsets"):
        store_kvcache(key, key, odd_rows, odd_rows, torch.zeros(3, dtype=torch.int64))


def test_row_align_is_what_every_row_address_is_a_multiple_of():
    """The hint the kernels compile an int8 cache's loads with: a wrong one
    would let the GPU read a row with loads wider than its alignment."""
    import torch

    from kernels.paged_attention import row_align

    def cache(width: int, used: int = 130) -> torch.Tensor:  # [blocks, block, kv heads, width], a view
        return torch.zeros(4, 16, 3, width, dtype=torch.int8)[..., :used]

    assert row_align(cache(130), cache(130)) == 2   # head_dim 128 + the fp16 scale
    assert row_align(cache(132), cache(132)) == 4
    assert row_align(cache(136), cache(136)) == 8
    assert row_align(cache(144), cache(144)) == 16
    assert row_align(cache(160), cache(160)) == 16  # capped: 16 bytes is the widest load
    shifted = torch.zeros(2 + 4 * 16 * 3 * 144, dtype=torch.int8)[2:].view(4, 16, 3, 144)[..., :130]
    assert row_align(cache(144), shifted) == 2      # either cache's address counts
    floats = torch.zeros(4, 16, 3, 128, dtype=torch.bfloat16)
    assert row_align(floats, floats) == 1           # float caches: no hint

