"""The compiled CPU attention (kernels/cpu/csrc/, built by kernels/cpu/ops.py)
against the naive float64 loop, on fresh random inputs, and its fallbacks.

The caches come from the shared builders: NaN wherever nothing was written,
so a slot the op should not read (the null block, the tail of a last block)
turns the output NaN and fails the comparison.

Under CI=true the op must build; elsewhere a machine without a compiler
skips these tests (the engine then runs the torch paths, tested elsewhere).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernel_cases import (DTYPES, SHAPES, build_decode_inputs, build_prefill_inputs, compare,
                          feature_sets, make_paged_cache)
from kernels.cpu import ops as cpu_ops
from test_kernels_reference import naive_decode, naive_prefill

REPO_ROOT = Path(__file__).resolve().parents[2]
# The shared shapes, plus SmolLM2's (9 query heads on 3 kv heads) and a
# group of 8 with head_dim 128 and block size 32.
COMPILED_SHAPES = SHAPES + ((64, 9, 3, 16), (128, 32, 4, 32), (64, 6, 2, 4))


@pytest.fixture(scope="module")
def ops(compiled_cpu_ops):
    return compiled_cpu_ops


def _usable(shape) -> bool:
    return cpu_ops.ops_for(shape[0]) is not None


def _decode(op, x):
    return op(x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], x["scale"])


def _prefill(op, x):
    return op(x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["cu_seqlens_q"],
              x["context_lens"], x["scale"])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", COMPILED_SHAPES, ids=str)
def test_decode_matches_naive_loop(ops, shape, dtype, session_seed):
    if not _usable(shape):
        pytest.skip(f"head_dim {shape[0]} is not a multiple of this build's vector pair")
    x = build_decode_inputs({"shape": list(shape), "dtype": dtype}, session_seed, "cpu")
    out = _decode(ops.paged_decode_attention, x)
    error = compare(out, naive_decode(x).to(out.dtype), dtype)
    assert error is None, f"seed {session_seed}: {error}"
    padding = x["context_lens"] == 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", COMPILED_SHAPES, ids=str)
def test_prefill_matches_naive_loop(ops, shape, dtype, session_seed):
    """Whole prompts, chunks after a cached prefix, single-token extends."""
    if not _usable(shape):
        pytest.skip(f"head_dim {shape[0]} is not a multiple of this build's vector pair")
    x = build_prefill_inputs({"shape": list(shape), "dtype": dtype}, session_seed, "cpu")
    out = _prefill(ops.paged_prefill_attention, x)
    error = compare(out, naive_prefill(x).to(out.dtype), dtype)
    assert error is None, f"seed {session_seed}: {error}"


def _long_batch(seed, dtype=torch.bfloat16, lengths=(2600, 40, 0, 700)):
    gen = torch.Generator().manual_seed(seed)
    k, v, tables, _, _ = make_paged_cache(list(lengths), 3, 64, 16, dtype, "cpu", gen)
    query = torch.randn(len(lengths), 9, 64, generator=gen).to(dtype)
    return dict(query=query, k_cache=k, v_cache=v, block_tables=tables,
                context_lens=torch.tensor(lengths, dtype=torch.int32), scale=0.125)


def _decode_on_one_and_two_threads(ops, x):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = _decode(ops.paged_decode_attention, x)
        torch.set_num_threads(2)
        return whole, _decode(ops.paged_decode_attention, x)
    finally:
        torch.set_num_threads(threads)


def test_splitting_a_long_context_changes_no_bit(ops, session_seed):
    """With two threads the 2600-token row is cut into partitions and merged;
    with one it is not: the op folds partitions the same way in both."""
    x = _long_batch(session_seed)
    whole, split = _decode_on_one_and_two_threads(ops, x)
    assert torch.equal(whole, split)
    error = compare(whole, naive_decode(x).to(whole.dtype), "bfloat16")
    assert error is None, f"seed {session_seed}: {error}"


@pytest.mark.parametrize("cache", ["bfloat16", "int8"])
@pytest.mark.parametrize("lengths", [(300,), (300, 5), (1000,)], ids=str)
def test_cutting_a_short_batch_by_kv_head_changes_no_bit(ops, cache, lengths, session_seed):
    """One or two sequences over two threads: each item's kv heads are cut
    into parts (decode.h's split_heads, past kSplitHeadsMin elements), the
    1000-token row's two partitions too; with one thread nothing is cut."""
    from kernels.kv_quant import quantize_rows

    x = _long_batch(session_seed, lengths=lengths)
    if cache == "int8":
        x = dict(x, k_cache=quantize_rows(x["k_cache"]), v_cache=quantize_rows(x["v_cache"]))
    whole, cut = _decode_on_one_and_two_threads(ops, x)
    assert torch.equal(whole, cut)
    if cache == "int8":  # the cache's own values, and the query as the int8 path rounds it
        return
    error = compare(whole, naive_decode(x).to(whole.dtype), "bfloat16")
    assert error is None, f"seed {session_seed}: {error}"


@pytest.mark.parametrize("cache", ["float32", "bfloat16-int8"])
@pytest.mark.parametrize("features", [{}] + feature_sets("both", 16) + feature_sets("window", 64))
def test_chunked_prefill_and_decode_agree_bit_for_bit(ops, features, cache, session_seed):
    """A prompt prefilled at once, in chunks over its own cached prefix, or
    token by token as decodes: each position gets the same bits (with a
    sliding window and a soft cap too).  The int8 cache under bf16 queries
    too: a decode's one block of rows converts V's codes as it reads them,
    a prefill's many convert a tile once into scratch."""
    from kernels.kv_quant import quantize_rows

    gen = torch.Generator().manual_seed(session_seed)
    length, dtype = 300, torch.float32 if cache == "float32" else torch.bfloat16
    k, v, tables, _, _ = make_paged_cache([length], 3, 64, 16, dtype, "cpu", gen)
    if cache.endswith("int8"):
        k, v = quantize_rows(k), quantize_rows(v)
    query = torch.randn(length, 9, 64, generator=gen).to(dtype)

    def prefill(start, end):
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        lens = torch.tensor([end], dtype=torch.int32)
        return ops.paged_prefill_attention(query[start:end], k, v, tables, cu, lens, 0.125,
                                           **features)

    whole = prefill(0, length)
    chunks = torch.cat([prefill(s, min(s + 100, length)) for s in range(0, length, 100)])
    assert torch.equal(whole, chunks)
    for position in (0, 15, 16, 255, 299):
        lens = torch.tensor([position + 1], dtype=torch.int32)
        row = ops.paged_decode_attention(query[position:position + 1], k, v, tables, lens, 0.125,
                                         **features)
        assert torch.equal(row[0], whole[position])


def test_bad_inputs_are_value_errors(ops):
    x = _long_batch(0, torch.float32, lengths=(40, 10))
    tables = x["block_tables"].clone()
    tables[0, 1] = x["k_cache"].shape[0]  # one past the last block
    with pytest.raises(ValueError, match="out of range"):
        ops.paged_decode_attention(x["query"], x["k_cache"], x["v_cache"], tables,
                                   x["context_lens"], 0.125)
    too_long = torch.tensor([10_000, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit its block table"):
        ops.paged_decode_attention(x["query"], x["k_cache"], x["v_cache"], x["block_tables"],
                                   too_long, 0.125)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ops.paged_prefill_attention(x["query"], x["k_cache"], x["v_cache"], x["block_tables"],
                                    torch.tensor([0, 1], dtype=torch.int32), x["context_lens"], 0.125)


def test_auto_and_cpu_backends_use_the_op(ops, session_seed):
    x = _long_batch(session_seed, torch.float32, lengths=(70, 5))
    expected = _decode(ops.paged_decode_attention, x)
    assert torch.equal(_decode(kernels.paged_decode_attention, x), expected)
    assert torch.equal(_decode(kernels.get_backend("cpu").paged_decode_attention, x), expected)
    # The model hands attention a view of the fused qkv projection.
    wide = torch.cat([x["query"], x["query"]], dim=-1)[..., :64]
    assert not wide.is_contiguous()
    assert torch.equal(_decode(kernels.paged_decode_attention, dict(x, query=wide)), expected)
    kernels.check_backend_support("cpu", 16, 64, torch.bfloat16, "cpu")


def test_head_dims_the_build_cannot_take_fall_back(ops):
    odd = 8  # no build's vector pair divides it
    assert cpu_ops.ops_for(odd) is None
    kernels.check_backend_support("auto", 16, odd, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple of"):
        kernels.check_backend_support("cpu", 16, odd, torch.float32, "cpu")


def test_the_isa_choice():
    assert cpu_ops.isa_for_this_cpu() in cpu_ops.ISAS
    with pytest.MonkeyPatch.context() as m:
        m.setenv(cpu_ops.ENV_VAR, "sse9")
        with pytest.raises(ValueError, match="expected auto, off or one of"):
            cpu_ops.requested_isa()
        m.setenv(cpu_ops.ENV_VAR, "off")
        assert cpu_ops.ops_for(64) is None


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


FALLBACK_CHECK = """
import torch, kernels
from kernels.reference import paged_decode_attention_reference as ref
torch.manual_seed(0)
k, v = torch.randn(2, 6, 4, 2, 64).unbind(0)
tables = torch.tensor([[3, 1], [5, 0]], dtype=torch.int32)
lens = torch.tensor([7, 2], dtype=torch.int32)
q = torch.randn(2, 4, 64)
for _ in range(3):
    assert torch.equal(kernels.paged_decode_attention(q, k, v, tables, lens, 0.25),
                       ref(q, k, v, tables, lens, 0.25))
try:
    kernels.check_backend_support("cpu", 16, 64, torch.float32, "cpu")
except ValueError as exc:
    print("refused:", exc)
"""


def test_turned_off_means_the_reference_exactly():
    result = _run_python(FALLBACK_CHECK, PAGEDSERVE_CPU_KERNELS="off")
    assert result.returncode == 0, result.stderr
    assert "refused: cpu backend: turned off" in result.stdout


def test_a_failed_build_falls_back_with_one_warning(tmp_path):
    """No working compiler: one warning, then the torch paths; never a crash."""
    result = _run_python(FALLBACK_CHECK, CXX="/bin/false", XDG_CACHE_HOME=str(tmp_path),
                         PAGEDSERVE_CPU_KERNELS="portable")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("compiled CPU ops (portable) unavailable") == 1, result.stderr
    assert "refused: cpu backend: the portable build failed" in result.stdout
