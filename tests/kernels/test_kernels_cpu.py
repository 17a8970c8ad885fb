"""The CPU half-precision attention (kernels/cpu_attention.py) against the
naive float64 loop and the reference, on fresh random inputs.

The inputs come from the shared builders: a NaN-filled cache, so a slot the
path should not read (the null block, the tail of a last block) turns the
output NaN and fails the comparison.
"""

import pytest
import torch

import kernels
import kernels.cpu_attention as cpu_attention
from kernel_cases import (DTYPES, build_decode_inputs, build_prefill_inputs, compare,
                          make_paged_cache)
from kernels.cpu_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu
from kernels.reference import paged_decode_attention_reference, paged_prefill_attention_reference
from test_kernels_reference import SHAPES, naive_decode, naive_prefill

HALF = ["bfloat16", "float16"]


def _run(fn, x):
    return fn(x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], x["scale"])


def _run_prefill(fn, x):
    return fn(x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["cu_seqlens_q"],
              x["context_lens"], x["scale"])


# kind -> (input builder, CPU op, naive float64 loop, how to call)
KINDS = {
    "decode": (build_decode_inputs, paged_decode_attention_cpu, naive_decode, _run),
    "prefill": (build_prefill_inputs, paged_prefill_attention_cpu, naive_prefill, _run_prefill),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_cpu_attention_matches_naive_loop(kind, shape, dtype, session_seed):
    """Decode rows of ragged lengths (one empty); prefill of whole prompts,
    chunks after a cached prefix and single-token extends."""
    build, op, naive, call = KINDS[kind]
    x = build({"shape": list(shape), "dtype": dtype}, session_seed, "cpu")
    out = call(op, x)
    assert out.dtype == DTYPES[dtype]
    error = compare(out, naive(x).to(out.dtype), dtype)
    assert error is None, f"seed {session_seed}: {error}"
    if kind == "decode":
        padding = x["context_lens"] == 0
        assert torch.equal(out[padding], torch.zeros_like(out[padding]))


def _ragged_batch(seed, dtype, rows=24, block_size=16, kv_heads=2, heads=6, head_dim=64):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9 * block_size, (rows,), generator=gen).tolist()
    lengths[3] = 0  # a padding row in the middle
    k_cache, v_cache, tables, _, _ = make_paged_cache(
        lengths, kv_heads, head_dim, block_size, DTYPES[dtype], "cpu", gen)
    query = torch.randn(rows, heads, head_dim, generator=gen).to(DTYPES[dtype])
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                context_lens=torch.tensor(lengths, dtype=torch.int32), scale=head_dim ** -0.5)


@pytest.mark.parametrize("dtype", HALF)
def test_cpu_decode_matches_reference_on_a_ragged_batch(dtype, session_seed):
    x = _ragged_batch(session_seed, dtype)
    out = _run(paged_decode_attention_cpu, x)
    expected = _run(paged_decode_attention_reference, x)
    error = compare(out, expected, dtype)
    assert error is None, f"seed {session_seed}: {error}"


def test_cpu_decode_chunks_rows_by_length(monkeypatch, session_seed):
    """Rows sorted longest first and cut into chunks under the gather budget
    give what one chunk gives, each row back in its own place."""
    x = _ragged_batch(session_seed, "bfloat16")
    whole = _run(paged_decode_attention_cpu, x)
    longest = int(x["context_lens"].max())
    monkeypatch.setattr(cpu_attention, "_GATHER_BUDGET", 5 * longest * 2 * 64)
    order, chunks = cpu_attention._chunks_by_length(x["context_lens"], 2 * 64)
    lengths = x["context_lens"][order].tolist()
    assert len(chunks) > 1 and lengths == sorted(lengths, reverse=True)
    assert [c[0] for c in chunks[1:]] == [c[1] for c in chunks[:-1]] and chunks[-1][1] == 24
    chunked = _run(paged_decode_attention_cpu, x)
    error = compare(chunked, whole, "bfloat16")
    assert error is None, f"seed {session_seed}: {error}"
    expected = _run(paged_decode_attention_reference, x)
    assert compare(chunked, expected, "bfloat16") is None


def test_float32_goes_to_the_reference(session_seed):
    x = build_decode_inputs({"shape": [64, 4, 2, 16], "dtype": "float32"}, session_seed, "cpu")
    assert torch.equal(_run(paged_decode_attention_cpu, x), _run(paged_decode_attention_reference, x))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_backend_without_the_compiled_op_uses_the_cpu_path(dtype, session_seed, monkeypatch):
    # With the compiled op built, auto takes it instead (test_kernels_cpu_compiled.py).
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "off")
    x = _ragged_batch(session_seed, dtype)
    auto = kernels.get_backend("auto")
    assert torch.equal(_run(auto.paged_decode_attention, x), _run(paged_decode_attention_cpu, x))


def test_cpu_prefill_in_float32_is_the_reference(session_seed, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "off")  # else auto takes the compiled op
    x = build_prefill_inputs({"shape": [64, 4, 2, 16], "dtype": "float32"}, session_seed, "cpu")
    assert torch.equal(_run_prefill(paged_prefill_attention_cpu, x),
                       _run_prefill(paged_prefill_attention_reference, x))
    auto = kernels.get_backend("auto")
    assert torch.equal(_run_prefill(auto.paged_prefill_attention, x),
                       _run_prefill(paged_prefill_attention_reference, x))
