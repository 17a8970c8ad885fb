"""int8 KV cache (kernels/kv_quant.py) in the compiled CPU ops, against the
reference, through every build this CPU runs: the store quantizes each row
to exactly the reference's bytes; decode and prefill/extend read the rows in
place, with and without a sliding window and a soft cap, at block sizes 1,
16 and 128; and the round trip stays within its stated bound.

Fresh random inputs each session.  The caches are kernel_cases' float caches
quantized row by row: an unwritten (NaN) row gets a NaN scale, and runs with
a window poison every row before it the same way, so a kernel that reads a
row it should skip shows NaN.
"""

import pytest
import torch

import kernels
from kernel_cases import (build_decode_inputs, build_prefill_inputs, build_store_inputs, call_decode,
                          call_prefill, compare, feature_sets, poisoned_before, window_starts)
from kernels.kv_quant import dequantize_rows, quantize_rows, row_scales
from kernels.reference import (paged_decode_attention_reference, paged_prefill_attention_reference,
                               store_kvcache_reference)

# (head_dim, heads, kv_heads, block_size): MHA, MQA, GQA 8 and 3 (SmolLM2's 9/3).
SHAPES = ((64, 4, 4, 1), (128, 8, 1, 16), (64, 16, 2, 128), (64, 9, 3, 16))
FEATURES = ("none", "window", "cap", "both")


def with_int8_caches(x: dict) -> dict:
    return dict(x, k_cache=quantize_rows(x["k_cache"]), v_cache=quantize_rows(x["v_cache"]))


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_int8_attention_matches_the_reference(builds, kernel, shape, dtype, features, session_seed):
    inputs = build_decode_inputs if kernel == "decode" else build_prefill_inputs
    x = inputs({"shape": list(shape), "dtype": dtype}, session_seed, "cpu")
    run, reference = {"decode": (call_decode, paged_decode_attention_reference),
                      "prefill": (call_prefill, paged_prefill_attention_reference)}[kernel]
    for kwargs in feature_sets(features, shape[3]) if features != "none" else [{}]:
        expected = run(reference, with_int8_caches(x), **kwargs)
        starts = window_starts(x, kwargs.get("sliding_window"), prefill=kernel == "prefill")
        poisoned = with_int8_caches(poisoned_before(x, starts))
        for isa, ops in builds.items():
            out = run(getattr(ops, f"paged_{kernel}_attention"), poisoned, **kwargs)
            error = compare(out, expected, dtype)
            assert error is None, f"{isa} build, seed {session_seed}, {kwargs}: {error}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(64, 4, 4, 1), (128, 8, 2, 16), (64, 9, 3, 128)], ids=str)
def test_int8_store_writes_the_reference_bytes(builds, shape, dtype, session_seed):
    """Slots -1 skipped, non-contiguous K/V (slices of a fused qkv), an all-zero
    row (scale 0, codes 0) and a row with one large outlier."""
    x = build_store_inputs({"shape": list(shape), "dtype": dtype, "slot_dtype": "int64"},
                           session_seed, "cpu")
    x["key"][0] = 0.0
    x["value"][1, 0, 3] = 300.0
    head_dim = shape[0]
    blank = torch.zeros(*x["k_cache"].shape[:3], head_dim + 2, dtype=torch.int8)
    expected_k, expected_v = blank.clone(), blank.clone()
    store_kvcache_reference(x["key"], x["value"], expected_k, expected_v, x["slot_mapping"])
    for isa, ops in builds.items():
        k_cache, v_cache = blank.clone(), blank.clone()
        ops.store_kvcache(x["key"], x["value"], k_cache, v_cache, x["slot_mapping"])
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), isa


def test_the_dispatch_takes_the_compiled_op_for_int8(compiled_cpu_ops, session_seed):
    x = with_int8_caches(build_decode_inputs({"shape": [64, 8, 2, 16], "dtype": "bfloat16"},
                                             session_seed, "cpu"))
    assert torch.equal(call_decode(kernels.paged_decode_attention, x),
                       call_decode(compiled_cpu_ops.paged_decode_attention, x))
    p = with_int8_caches(build_prefill_inputs({"shape": [64, 8, 2, 16], "dtype": "float32"},
                                              session_seed, "cpu"))
    assert torch.equal(call_prefill(kernels.paged_prefill_attention, p),
                       call_prefill(compiled_cpu_ops.paged_prefill_attention, p))


def test_the_round_trip_is_within_its_bound(session_seed):
    """|x - c * s| <= s / 2 + 127 * |s - max|x| / 127| for every element (the
    second term: the fp16 rounding of the scale), rows of very different sizes,
    fp16-subnormal scales included."""
    gen = torch.Generator().manual_seed(session_seed)
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-6, 3, 64)[:, None, None]
    rows = quantize_rows(x)
    scale = row_scales(rows)[..., None]
    exact = x.abs().amax(-1, keepdim=True) / 127
    bound = scale / 2 + 127 * (scale - exact).abs()
    error = (x - dequantize_rows(rows)).abs()
    assert bool((error <= bound * (1 + 2 ** -20) + 1e-12).all())
    # Where the scale is a normal fp16 each row's largest element codes to +-127.
    normal = scale[..., 0] >= 2 ** -14
    assert bool(normal.any()) and bool((~normal).any())
    assert bool((rows[..., :-2].abs().amax(-1)[normal] == 127).all())


def test_a_cache_of_the_wrong_width_is_refused(compiled_cpu_ops):
    x = with_int8_caches(build_decode_inputs({"shape": [64, 4, 4, 16], "dtype": "float32"}, 0, "cpu"))
    narrow = dict(x, k_cache=x["k_cache"][..., :-2].contiguous(), v_cache=x["v_cache"][..., :-2].contiguous())
    with pytest.raises(RuntimeError, match="rows must be 66"):
        call_decode(compiled_cpu_ops.paged_decode_attention, narrow)
