"""The reference kernels against a naive per-token loop written here.

The loop follows the contract literally (position p read from block
block_table[p // bs], row p % bs, token by token; one softmax per query token
and head, in float64), so agreement proves
the vectorised reference, which in turn is the oracle for the Triton kernels.
"""

import pytest
import torch

from kernel_cases import (DTYPES, TOLERANCE, build_decode_inputs, build_prefill_inputs,
                          build_store_inputs, compare)
from kernels.reference import (paged_decode_attention_reference,
                               paged_prefill_attention_reference, store_kvcache_reference)

# Small block sizes keep the Python loop quick; 128 still crosses a block edge.
SHAPES = [(64, 4, 4, 1), (80, 8, 4, 16), (96, 8, 2, 16), (128, 8, 1, 16), (64, 4, 2, 128)]


def naive_gather(cache, table_row, length):
    """Token-by-token gather: position p lives in block table_row[p // bs], row p % bs."""
    block_size = cache.shape[1]
    rows = [cache[int(table_row[p // block_size]), p % block_size].double() for p in range(length)]
    return torch.stack(rows) if rows else cache.new_zeros(0, *cache.shape[2:]).double()


def naive_attention(q_row, keys, values, visible, scale):
    """One query token q_row [heads, dim] over keys/values [visible, kv_heads, dim]:
    one softmax per head, in float64."""
    heads, dim = q_row.shape
    group = heads // keys.shape[1]
    out = torch.zeros(heads, dim, dtype=torch.float64)
    if visible == 0:
        return out
    for head in range(heads):
        kv_head = head // group
        scores = scale * (keys[:visible, kv_head] @ q_row[head].double())
        weights = torch.exp(scores - scores.max())
        out[head] = (weights / weights.sum()) @ values[:visible, kv_head]
    return out


def naive_decode(x):
    rows = []
    for i, length in enumerate(x["context_lens"].tolist()):
        keys = naive_gather(x["k_cache"].cpu(), x["block_tables"][i].cpu(), length)
        values = naive_gather(x["v_cache"].cpu(), x["block_tables"][i].cpu(), length)
        rows.append(naive_attention(x["query"][i].cpu(), keys, values, length, x["scale"]))
    return torch.stack(rows)


def naive_prefill(x):
    rows = []
    cu = x["cu_seqlens_q"].tolist()
    for i, length in enumerate(x["context_lens"].tolist()):
        keys = naive_gather(x["k_cache"].cpu(), x["block_tables"][i].cpu(), length)
        values = naive_gather(x["v_cache"].cpu(), x["block_tables"][i].cpu(), length)
        nq = cu[i + 1] - cu[i]
        for j in range(nq):
            position = length - nq + j  # causal: sees 0..position
            rows.append(naive_attention(x["query"][cu[i] + j].cpu(), keys, values, position + 1,
                                        x["scale"]))
    return torch.stack(rows)


def _case(shape, dtype):
    return {"shape": list(shape), "dtype": dtype}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_reference_matches_naive_loop(shape, dtype, session_seed, kernel_test_device):
    x = build_decode_inputs(_case(shape, dtype), session_seed, kernel_test_device)
    out = paged_decode_attention_reference(x["query"], x["k_cache"], x["v_cache"], x["block_tables"],
                                           x["context_lens"], x["scale"])
    expected = naive_decode(x).to(DTYPES[dtype])
    error = compare(out, expected.to(out.device), dtype)
    assert error is None, f"seed {session_seed}: {error}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prefill_reference_matches_naive_loop(shape, dtype, session_seed, kernel_test_device):
    x = build_prefill_inputs(_case(shape, dtype), session_seed, kernel_test_device)
    out = paged_prefill_attention_reference(x["query"], x["k_cache"], x["v_cache"], x["block_tables"],
                                            x["cu_seqlens_q"], x["context_lens"], x["scale"])
    expected = naive_prefill(x).to(DTYPES[dtype])
    error = compare(out, expected.to(out.device), dtype)
    assert error is None, f"seed {session_seed}: {error}"


def test_decode_padding_row_is_zero(session_seed, kernel_test_device):
    x = build_decode_inputs(_case((64, 4, 2, 16), "float32"), session_seed, kernel_test_device)
    out = paged_decode_attention_reference(x["query"], x["k_cache"], x["v_cache"], x["block_tables"],
                                           x["context_lens"], x["scale"])
    padding = x["context_lens"] == 0
    assert padding.any()
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


def test_prefill_rejects_more_queries_than_context(kernel_test_device):
    cache = torch.zeros(4, 16, 1, 64, device=kernel_test_device)
    query = torch.zeros(5, 2, 64, device=kernel_test_device)
    tables = torch.tensor([[1]], dtype=torch.int32, device=kernel_test_device)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=kernel_test_device)
    lens = torch.tensor([3], dtype=torch.int32, device=kernel_test_device)
    with pytest.raises(ValueError, match="query tokens"):
        paged_prefill_attention_reference(query, cache, cache, tables, cu, lens, 0.1)


@pytest.mark.parametrize("slot_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_store_reference_matches_naive_loop(dtype, slot_dtype, session_seed, kernel_test_device):
    case = {"shape": [64, 4, 2, 16], "dtype": dtype, "slot_dtype": slot_dtype}
    x = build_store_inputs(case, session_seed, kernel_test_device)
    expected_k, expected_v = x["k_cache"].clone(), x["v_cache"].clone()
    block_size = x["k_cache"].shape[1]
    for token, slot in enumerate(x["slot_mapping"].tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = x["key"][token]
            expected_v[slot // block_size, slot % block_size] = x["value"][token]
    store_kvcache_reference(x["key"], x["value"], x["k_cache"], x["v_cache"], x["slot_mapping"])
    # equal_nan: slots that were never written must still be NaN.
    assert torch.allclose(x["k_cache"], expected_k, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(x["v_cache"], expected_v, rtol=0, atol=0, equal_nan=True)


def test_tolerances_are_the_agreed_ones():
    assert TOLERANCE == {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}
