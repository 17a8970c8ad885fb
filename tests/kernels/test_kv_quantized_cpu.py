"""Quantized KV caches (kernels/kv_quant.py: int8 rows with their scales,
fp8 e4m3 and e5m2) in the compiled CPU ops, against the reference, through
every build this CPU runs: the store writes exactly the reference's bytes;
decode and prefill/extend read the blocks in place, with and without a
sliding window and a soft cap, at block sizes 1, 16 and 128; the int8
round trip stays within its stated bound; and Q.K over an int8 cache reads
the query rounded to int8 rows as kernels/kv_quant.py defines.

Fresh random inputs each session.  The caches are kernel_cases' float caches
quantized row by row: an unwritten (NaN) row stays NaN (an int8 row gets a
NaN scale), and runs with a window poison every row before it the same way,
so a kernel that reads a row it should skip shows NaN.
"""

import pytest
import torch

import kernels
from kernel_cases import (build_decode_inputs, build_prefill_inputs, build_store_inputs, call_decode,
                          call_prefill, compare, feature_sets, poisoned_before, window_starts)
from kernels.kv_quant import dequantize_rows, quantize_query, quantize_rows, row_scales, to_fp8
from kernels.reference import (paged_decode_attention_reference, paged_prefill_attention_reference,
                               store_kvcache_reference)

# (head_dim, heads, kv_heads, block_size): MHA, MQA, GQA 8 and 3 (SmolLM2's 9/3).
# 96: a head of one and a half 64-byte chunks (the VNNI build packs K 64 codes at a time).
SHAPES = ((64, 4, 4, 1), (128, 8, 1, 16), (64, 16, 2, 128), (64, 9, 3, 16), (96, 6, 2, 16))
FEATURES = ("none", "window", "cap", "both")


CACHES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def quantized(cache: torch.Tensor, name: str) -> torch.Tensor:
    """A float cache's rows as a cache of the named quantized dtype stores them."""
    return quantize_rows(cache) if name == "int8" else to_fp8(cache, CACHES[name])


def with_quantized_caches(x: dict, name: str = "int8") -> dict:
    return dict(x, k_cache=quantized(x["k_cache"], name), v_cache=quantized(x["v_cache"], name))


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_attention_matches_the_reference(builds, kernel, shape, dtype, features, cache, session_seed):
    inputs = build_decode_inputs if kernel == "decode" else build_prefill_inputs
    x = inputs({"shape": list(shape), "dtype": dtype}, session_seed, "cpu")
    run, reference = {"decode": (call_decode, paged_decode_attention_reference),
                      "prefill": (call_prefill, paged_prefill_attention_reference)}[kernel]
    for kwargs in feature_sets(features, shape[3]) if features != "none" else [{}]:
        expected = run(reference, with_quantized_caches(x, cache), **kwargs)
        starts = window_starts(x, kwargs.get("sliding_window"), prefill=kernel == "prefill")
        poisoned = with_quantized_caches(poisoned_before(x, starts), cache)
        for isa, ops in builds.items():
            out = run(getattr(ops, f"paged_{kernel}_attention"), poisoned, **kwargs)
            error = compare(out, expected, dtype)
            assert error is None, f"{isa} build, seed {session_seed}, {kwargs}: {error}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_an_int8_head_of_80_codes_matches_the_reference(builds, kernel, dtype, session_seed):
    """80 = two 32-byte vectors and a half: the AVX2 build's integer Q.K
    (vec::dot8_i8) takes the last 16 codes in a half vector. Only the builds
    whose pairs divide 80 (not AVX-512's 32) take such a head."""
    import kernels.cpu.ops as cpu_ops

    shape = (80, 8, 2, 16)
    inputs = build_decode_inputs if kernel == "decode" else build_prefill_inputs
    x = with_quantized_caches(inputs({"shape": list(shape), "dtype": dtype}, session_seed, "cpu"))
    run, reference = {"decode": (call_decode, paged_decode_attention_reference),
                      "prefill": (call_prefill, paged_prefill_attention_reference)}[kernel]
    expected = run(reference, x)
    taking = {isa: ops for isa, ops in builds.items() if shape[0] % cpu_ops.PAIR_LENGTH[isa] == 0}
    assert "portable" in taking
    for isa, ops in taking.items():
        error = compare(run(getattr(ops, f"paged_{kernel}_attention"), x), expected, dtype)
        assert error is None, f"{isa} build, seed {session_seed}: {error}"


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(64, 4, 4, 1), (128, 8, 2, 16), (64, 9, 3, 128)], ids=str)
def test_store_writes_the_reference_bytes(builds, shape, dtype, cache, session_seed):
    """Slots -1 skipped, non-contiguous K/V (slices of a fused qkv), an all-zero
    row (int8: scale 0, codes 0), a large outlier, exact ties, values past
    fp8's range (saturated) and below its smallest (subnormals, zero)."""
    x = build_store_inputs({"shape": list(shape), "dtype": dtype, "slot_dtype": "int64"},
                           session_seed, "cpu")
    x["key"][0] = 0.0
    x["value"][1, 0, 3] = 300.0
    x["value"][2, 0, :4] = torch.tensor([1e5, -7e4, 3e-6, -1e-3], dtype=x["value"].dtype)
    # exact ties: max 127 makes the int8 scale 1.0, so x / s is .5 (half to even, not away)
    x["key"][1, 0, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 126.5], dtype=x["key"].dtype)
    head_dim = shape[0] + (2 if cache == "int8" else 0)
    blank = torch.zeros(*x["k_cache"].shape[:3], head_dim, dtype=CACHES[cache])
    expected_k, expected_v = blank.clone(), blank.clone()
    store_kvcache_reference(x["key"], x["value"], expected_k, expected_v, x["slot_mapping"])
    for isa, ops in builds.items():
        k_cache, v_cache = blank.clone(), blank.clone()
        ops.store_kvcache(x["key"], x["value"], k_cache, v_cache, x["slot_mapping"])
        same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in ((k_cache, expected_k), (v_cache, expected_v))]
        assert all(same), isa


@pytest.mark.parametrize("cache", list(CACHES))
def test_the_dispatch_takes_the_compiled_op(compiled_cpu_ops, cache, session_seed):
    x = with_quantized_caches(build_decode_inputs({"shape": [64, 8, 2, 16], "dtype": "bfloat16"},
                                             session_seed, "cpu"), cache)
    assert torch.equal(call_decode(kernels.paged_decode_attention, x),
                       call_decode(compiled_cpu_ops.paged_decode_attention, x))
    p = with_quantized_caches(build_prefill_inputs({"shape": [64, 8, 2, 16], "dtype": "float32"},
                                                   session_seed, "cpu"), cache)
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
    # The scale is exactly fp16(max|x| / 127): what every backend stores.
    assert torch.equal(scale[..., 0], (x.abs().amax(-1) / 127).half().float())
    # Where the scale is a normal fp16 each row's largest element codes to +-127.
    normal = scale[..., 0] >= 2 ** -14
    assert bool(normal.any()) and bool((~normal).any())
    assert bool((rows[..., :-2].abs().amax(-1)[normal] == 127).all())


def test_an_int8_cache_reads_the_query_in_int8(session_seed):
    """quantize_query: codes of one fp32 scale a row, max|q| / 127, within half a
    step of q, the largest element exactly +-127 steps, a zero row zero; and the
    reference's decode over an int8 cache is softmax(Q' K^T * scale) V with Q'
    those rows and K, V the cache's values (not the query as it came)."""
    gen = torch.Generator().manual_seed(session_seed)
    q = torch.randn(3, 8, 64, generator=gen) * torch.logspace(-3, 2, 8)[None, :, None]
    q[0, 0] = 0.0
    rounded = quantize_query(q)
    scale = q.abs().amax(-1, keepdim=True) / 127
    assert bool(((rounded - q).abs() <= scale / 2 * (1 + 2 ** -20)).all())
    steps = torch.where(scale > 0, rounded / torch.where(scale > 0, scale, 1.0), 0.0)
    codes = steps.round()
    assert bool(((steps - codes).abs() < 1e-4).all()) and int(codes.abs().amax()) == 127
    assert bool((codes.abs().amax(-1)[scale[..., 0] > 0] == 127).all())
    assert not bool(rounded[0, 0].any())

    x = with_quantized_caches(build_decode_inputs({"shape": [64, 8, 2, 16], "dtype": "float32"}, 1, "cpu"))
    got = call_decode(paged_decode_attention_reference, x)
    k, v = (dequantize_rows(x[name]).flatten(0, 1) for name in ("k_cache", "v_cache"))
    parted = False  # from the query as it came, on some row (a one-token row cannot part)
    for i, length in enumerate(x["context_lens"].tolist()):
        blocks = x["block_tables"][i, :(length + 15) // 16].long()
        slots = (blocks[:, None] * 16 + torch.arange(16)).flatten()[:length]
        keys, values = k[slots].repeat_interleave(4, 1), v[slots].repeat_interleave(4, 1)  # [L, 8, 64]
        want = {}
        for name, query in (("int8", quantize_query(x["query"][i])), ("raw", x["query"][i])):
            scores = torch.einsum("hd,lhd->hl", query, keys) * x["scale"]
            want[name] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
        if length:
            assert torch.allclose(got[i], want["int8"], atol=1e-5, rtol=1e-5), i
            parted |= not torch.allclose(got[i], want["raw"], atol=1e-5, rtol=1e-5)
    assert parted


def test_a_cache_of_the_wrong_width_is_refused(compiled_cpu_ops):
    x = with_quantized_caches(build_decode_inputs({"shape": [64, 4, 4, 16], "dtype": "float32"}, 0, "cpu"))
    narrow = dict(x, k_cache=x["k_cache"][..., :-2].contiguous(), v_cache=x["v_cache"][..., :-2].contiguous())
    with pytest.raises(RuntimeError, match="rows must be 66"):
        call_decode(compiled_cpu_ops.paged_decode_attention, narrow)
