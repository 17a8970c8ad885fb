"""Sliding window and logits soft cap in the compiled CPU attention
(kernels/cpu/csrc/), against the reference, through every build this CPU
runs, and in the dispatch (kernels.paged_*_attention).

Fresh random inputs each session (kernel_cases: NaN wherever nothing was
written, random block tables, ragged lengths shorter and longer than the
windows).  Every run with a window also poisons the K/V of all positions
before it with NaN: the op must skip them, not mask them (a V row read under
a zero weight still turns the output NaN).  That it reads only about the
window's bytes shows in `pagedserve bench kernels --kernels window`.

Each test runs every build this CPU runs (avx512bf16, avx512, avx2, portable, or
the part of that list it supports) on the same inputs, so the reference runs
once for all of them.  Builds other than this CPU's best are compiled on
first use (~20 s each, then cached under $XDG_CACHE_HOME/pagedserve/cpu_kernels).
"""

import pytest
import torch

import kernels
from kernel_cases import (build_decode_inputs, build_prefill_inputs, call_decode, call_prefill, compare,
                          feature_sets, make_paged_cache, poisoned_before, window_starts)
from kernels.cpu import ops as cpu_ops
from kernels.reference import paged_decode_attention_reference, paged_prefill_attention_reference

# (head_dim, heads, kv_heads, block_size): MHA, MQA, GQA groups of 8 and 3
# (SmolLM2's 9/3), block sizes 1, 16 and 128; head_dims every build takes.
SHAPES = ((64, 4, 4, 1), (128, 8, 1, 16), (64, 16, 2, 128), (64, 9, 3, 16))
FEATURES = ("window", "cap", "both")


def _check(kernel, builds, x, features, dtype, seed) -> dict:
    """Each build's op, on caches NaN before each window, against the reference
    on clean ones; {isa: output}."""
    run, reference = {"decode": (call_decode, paged_decode_attention_reference),
                      "prefill": (call_prefill, paged_prefill_attention_reference)}[kernel]
    expected = run(reference, x, **features)
    starts = window_starts(x, features.get("sliding_window"), prefill=kernel == "prefill")
    poisoned = poisoned_before(x, starts)
    outs = {}
    for isa, ops in builds.items():
        outs[isa] = run(getattr(ops, f"paged_{kernel}_attention"), poisoned, **features)
        error = compare(outs[isa], expected, dtype)
        assert error is None, f"{isa} build, seed {seed}, {features}: {error}"
    return outs


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_features_match_the_reference(builds, kernel, shape, dtype, features, session_seed):
    """Decode: ragged contexts and a padding row; prefill: whole prompts,
    chunks after a cached prefix and single-token extends."""
    inputs = build_decode_inputs if kernel == "decode" else build_prefill_inputs
    x = inputs({"shape": list(shape), "dtype": dtype}, session_seed, "cpu")
    for kwargs in feature_sets(features, shape[3]):
        outs = _check(kernel, builds, x, kwargs, dtype, session_seed)
        if kernel == "decode":
            padding = x["context_lens"] == 0
            for out in outs.values():
                assert torch.equal(out[padding], torch.zeros_like(out[padding]))


def _long_batch(seed, dtype, lengths=(2600, 40, 0, 700, 1300)):
    gen = torch.Generator().manual_seed(seed)
    k, v, tables, _, _ = make_paged_cache(list(lengths), 3, 64, 16, dtype, "cpu", gen)
    query = torch.randn(len(lengths), 9, 64, generator=gen).to(dtype)
    return dict(query=query, k_cache=k, v_cache=v, block_tables=tables,
                context_lens=torch.tensor(lengths, dtype=torch.int32), scale=0.125)


@pytest.mark.parametrize("window", [1, 100, 600, 1100, 5000])
def test_long_contexts_split_with_a_window_change_no_bit(builds, window, session_seed):
    """Two threads cut the long rows into partitions (some before the window,
    one across its start); one thread does not: the same bits either way."""
    x = _long_batch(session_seed, torch.bfloat16)
    features = {"sliding_window": window, "logits_soft_cap": 20.0}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = _check("decode", builds, x, features, "bfloat16", session_seed)
        torch.set_num_threads(2)
        split = _check("decode", builds, x, features, "bfloat16", session_seed)
    finally:
        torch.set_num_threads(threads)
    for isa in builds:
        assert torch.equal(whole[isa], split[isa]), isa


def test_the_dispatch_takes_the_compiled_op(compiled_cpu_ops, session_seed):
    x = _long_batch(session_seed, torch.float32, lengths=(70, 5, 300))
    features = {"sliding_window": 33, "logits_soft_cap": 7.5}
    expected = call_decode(compiled_cpu_ops.paged_decode_attention, x, **features)
    assert torch.equal(call_decode(kernels.paged_decode_attention, x, **features), expected)
    cpu = kernels.get_backend("cpu")
    assert torch.equal(call_decode(cpu.paged_decode_attention, x, **features), expected)
    assert not torch.equal(call_decode(kernels.paged_decode_attention, x), expected)
    p = build_prefill_inputs({"shape": [64, 8, 2, 16], "dtype": "float32"}, session_seed, "cpu")
    expected = call_prefill(compiled_cpu_ops.paged_prefill_attention, p, **features)
    assert torch.equal(call_prefill(kernels.paged_prefill_attention, p, **features), expected)
    assert torch.equal(call_prefill(cpu.paged_prefill_attention, p, **features), expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_compiled_op_the_reference_serves(dtype, session_seed, monkeypatch):
    monkeypatch.setenv(cpu_ops.ENV_VAR, "off")
    features = {"sliding_window": 20, "logits_soft_cap": 3.0}
    x = build_decode_inputs({"shape": [64, 8, 2, 16], "dtype": dtype}, session_seed, "cpu")
    assert torch.equal(call_decode(kernels.paged_decode_attention, x, **features),
                       call_decode(paged_decode_attention_reference, x, **features))
    p = build_prefill_inputs({"shape": [64, 8, 2, 16], "dtype": dtype}, session_seed, "cpu")
    expected = paged_prefill_attention_reference(
        p["query"], p["k_cache"], p["v_cache"], p["block_tables"], p["cu_seqlens_q"],
        p["context_lens"], p["scale"], compute_dtype=p["k_cache"].dtype, **features)
    assert torch.equal(call_prefill(kernels.paged_prefill_attention, p, **features), expected)


@pytest.mark.parametrize("features", [{"sliding_window": 0}, {"sliding_window": -3},
                                      {"logits_soft_cap": 0.0}, {"logits_soft_cap": -1.0}])
def test_a_window_or_cap_that_is_not_positive_is_a_value_error(features):
    x = _long_batch(0, torch.float32, lengths=(5,))
    with pytest.raises(ValueError, match="must be"):
        call_decode(kernels.paged_decode_attention, x, **features)
