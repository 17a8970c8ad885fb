"""The Triton kernels on fp8 KV caches (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``:
torch.float8_e4m3fn or float8_e5m2 values, per-tensor scale 1.0), on fresh
random inputs each session:

* Store: Triton's store writes exactly torch's bytes for
  ``x.float().clamp(-max, max).to(fp8)``: every finite fp8 value, every tie
  between two neighbours (to even), one fp32 step either side of it,
  subnormals, values that underflow to 0, saturation past the largest, inf,
  NaN, both signs; it skips slot -1 and touches no other slot.  Both formats,
  float32 and bf16 rows, int32 and int64 slots.
* Attention: decode (the public entry point, and split into partitions) and
  prefill/extend over a cached prefix, each plain, with a sliding window, a
  soft cap and both, at block sizes 1, 16 and 128, against the reference on
  the same fp8 cache; the slots a kernel must not read hold NaN.  e4m3 at
  every shape, e5m2 at block size 16 (the formats share every line but the
  conversion); float32 queries (the interpreter's bf16 arithmetic is broken)
  and one bf16 query shape for the output dtype.
* Compiled: decode, prefill and store with caches of either format go through
  the real compiler for sm_90 (which rejects code the interpreter takes), and
  the attention kernels convert their fp8 tiles with the hardware instruction.

The interpreter converts fp8 to fp32 exactly but for the NaN / inf bit
patterns (the kernels put the NaN back under it), and converts fp32 to fp8
wrongly (ties away from zero, a mantissa carry lost, subnormals truncated):
the store does not use that conversion.

The cases run in child processes (kv_quantized_cases.py), as for int8.  A
failure names the seed that reproduces it:
PAGEDSERVE_TEST_SEED=<session seed> pytest tests/kernels/test_kv_fp8_triton.py.
"""

from __future__ import annotations

import importlib.util

import pytest

from kv_quantized_cases import attention_cases, check_outcome, run_all, shape_name
from need import need

# (format, head_dim, kv_heads, block_size, row dtype, slot dtype) of the store
# cases: head counts and dims that need padding.
STORE_CASES = (("fp8_e4m3", 64, 4, 1, "float32", "int64"), ("fp8_e4m3", 80, 3, 16, "bfloat16", "int32"),
               ("fp8_e5m2", 80, 3, 16, "float32", "int32"))


def _format_of(shape, dtype: str) -> str:
    """e5m2 for the float32 cases at block size 16, e4m3 (vLLM's "fp8") elsewhere."""
    return "fp8_e5m2" if shape[3] == 16 and dtype == "float32" else "fp8_e4m3"


def store_cases() -> list[dict]:
    cases = []
    for fmt, *shape, dtype, slot_dtype in STORE_CASES:
        cases.append(dict(kernel="store", shape=shape, dtype=dtype, slot_dtype=slot_dtype, format=fmt,
                          id=f"{fmt}-store-{dtype}-{slot_dtype}-{shape_name(shape)}"))
    return cases


CASES = attention_cases(_format_of) + store_cases()
COMPILED = [dict(kernel="compile", shape=[80, 4, 16], format=fmt, id=f"{fmt}-compile-sm90-bf16-d80-g4-bs16")
            for fmt in ("fp8_e4m3", "fp8_e5m2")]


@pytest.fixture(scope="module")
def fp8_results(kernel_test_device, session_seed) -> dict:
    """{case id: None or error} of every case."""
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    return run_all(CASES, COMPILED, kernel_test_device, session_seed)


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_triton_fp8_cache_matches_reference(case, fp8_results, session_seed):
    check_outcome(fp8_results, case, session_seed)


@pytest.mark.parametrize("case", COMPILED, ids=[case["id"] for case in COMPILED])
def test_triton_fp8_kernels_compile_for_sm90(case, fp8_results, session_seed):
    check_outcome(fp8_results, case, session_seed)


@pytest.mark.parametrize("dtype_name", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_cache_checks(dtype_name, triton_available):
    """An fp8 cache serves any query dtype at its own head_dim (no scale
    bytes); K and V of different dtypes are refused."""
    import torch

    from kernels.paged_attention import check_inputs
    from kernels.store_kvcache_triton import store_kvcache

    dtype = getattr(torch, dtype_name)
    other = torch.float8_e5m2 if dtype == torch.float8_e4m3fn else torch.float8_e4m3fn
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    cache = torch.zeros(3, 16, 2, 64, dtype=dtype)
    for query_dtype in (torch.float32, torch.bfloat16, torch.float16):
        check_inputs(torch.zeros(2, 4, 64, dtype=query_dtype), cache, cache, tables, lens)
    key = torch.zeros(3, 2, 64)
    store_kvcache(key[:0], key[:0], cache, cache, torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="head_dim mismatch"):
        check_inputs(torch.zeros(2, 4, 62), cache, cache, tables, lens)
    with pytest.raises(ValueError, match="v_cache"):
        check_inputs(torch.zeros(2, 4, 64), cache, cache.to(other), tables, lens)
    with pytest.raises(ValueError, match="v_cache"):
        store_kvcache(key, key, cache, cache.to(other), torch.zeros(3, dtype=torch.int64))
