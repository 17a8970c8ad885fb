"""Non-causal (bidirectional) prefill attention, ``causal=False``: the encoders'
(BERT), where every query token of sequence i sees all ``context_lens[i]`` keys.

* The reference against a dense softmax(Q K^T * scale) V written here, in
  float64 from the contiguous K/V the cache was filled from (not read back
  from the cache): whole prompts of varied lengths (1 token, block edges,
  random), an extend over a cached prefix (its tokens see the prefix *and*
  the tokens after them), a padding entry; GQA, MQA and MHA; block sizes 1,
  4, 16 and 128; with and without a soft cap.  The same dense form with a
  causal mask checks that the default is still causal, and causal and
  non-causal must differ on every row but a whole prompt's last.
* The compiled CPU op (every build this CPU runs) against the reference,
  float32 and bf16, one context longer than a split-KV partition; the
  dispatch (auto, the ``cpu`` and ``torch`` backends, the PyTorch fallback)
  and what it hands the op: ``causal`` only when False.
* Triton under the interpreter (float32; PAGEDSERVE_TEST_DEVICE=cuda: the
  GPU) against the reference, in child processes (kernel_case_runner.py).
* A sliding window with causal=False is a ValueError everywhere.
* The attention layer passes causal=False to the prefill kernel, not decode.

Fresh random inputs each session; a failure names the seed
(PAGEDSERVE_TEST_SEED=<seed> pytest tests/kernels/test_noncausal_prefill.py).
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

import kernels
from engine.model.layers.attention import PagedAttention
from kernel_cases import DTYPES, call_prefill, case_seed, compare, make_paged_cache
from kernel_subprocess import balanced_batches, run_in_children
from kernels.cpu import ops as cpu_ops
from kernels.reference import paged_prefill_attention_reference
from need import need

# (head_dim, heads, kv_heads, block_size): MHA, GQA 2/3/8, MQA; block sizes 1, 4, 16, 128.
REFERENCE_SHAPES = ((64, 4, 4, 1), (80, 8, 4, 4), (64, 9, 3, 16), (128, 8, 1, 16), (64, 16, 2, 128))
# head_dims every compiled build takes (multiples of 32).
COMPILED_SHAPES = ((64, 4, 4, 1), (128, 8, 1, 16), (64, 16, 2, 128), (64, 9, 3, 16))
TRITON_SHAPES = ((64, 4, 4, 1), (80, 8, 4, 16), (128, 8, 1, 16), (64, 16, 2, 128))
CAPS = (None, 3.0)


def _plan(block_size: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """(context_len, new tokens) per sequence: whole prompts (1 token, either
    side of a block edge, several blocks, a random length), a padding entry,
    and an extend of 7 tokens over a cached prefix."""
    bs = block_size
    random_len = int(torch.randint(2, 70, (1,), generator=gen))
    whole = [1, max(bs - 1, 2), bs + 1, 3 * bs + 5, random_len]
    return [(n, n) for n in whole[:2]] + [(0, 0)] + [(n, n) for n in whole[2:]] + [(2 * bs + 8, 7)]


def _inputs(shape, dtype: str, seed: int, plan=None) -> dict:
    head_dim, heads, kv_heads, block_size = shape
    gen = torch.Generator().manual_seed(seed)
    plan = plan or _plan(block_size, gen)
    lengths = [ctx for ctx, _ in plan]
    k_cache, v_cache, tables, keys, values = make_paged_cache(
        lengths, kv_heads, head_dim, block_size, DTYPES[dtype], "cpu", gen)
    cu = torch.tensor([0] + [nq for _, nq in plan]).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(DTYPES[dtype])
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables, cu_seqlens_q=cu,
                context_lens=torch.tensor(lengths, dtype=torch.int32), scale=head_dim ** -0.5,
                keys=keys, values=values)


def _dense(x: dict, causal: bool, cap: float | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale [capped] [causal mask]) V per sequence, float64,
    from the K/V the cache was filled with; query head h reads kv head h // group."""
    rows = []
    cu = x["cu_seqlens_q"].tolist()
    for i, length in enumerate(x["context_lens"].tolist()):
        nq = cu[i + 1] - cu[i]
        if nq == 0:
            continue
        q = x["query"][cu[i]:cu[i + 1]].double()
        group = q.shape[1] // x["keys"][i].shape[1]
        k = x["keys"][i].double().repeat_interleave(group, dim=1)
        v = x["values"][i].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * x["scale"]
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        if causal:  # query j sits at position length - nq + j
            after = torch.arange(length)[None, :] > torch.arange(length - nq, length)[:, None]
            scores = scores.masked_fill(after, float("-inf"))
        rows.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(rows)


def _features(cap, causal=False) -> dict:
    features = {} if causal else {"causal": False}
    return features if cap is None else dict(features, logits_soft_cap=cap)


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("shape", REFERENCE_SHAPES, ids=str)
def test_reference_matches_dense_softmax(shape, cap, session_seed):
    x = _inputs(shape, "float32", session_seed)
    out = call_prefill(paged_prefill_attention_reference, x, **_features(cap))
    error = compare(out, _dense(x, causal=False, cap=cap).float(), "float32")
    assert error is None, f"seed {session_seed}: {error}"


@pytest.mark.parametrize("shape", REFERENCE_SHAPES, ids=str)
def test_causal_default_unchanged_and_differs_from_noncausal(shape, session_seed):
    """The default (no keyword) is causal=True, and the dense causal form; the
    non-causal output differs on every row but each sequence's last token
    (which sees every key either way)."""
    x = _inputs(shape, "float32", session_seed)
    default = call_prefill(paged_prefill_attention_reference, x)
    assert torch.equal(default, call_prefill(paged_prefill_attention_reference, x, causal=True))
    error = compare(default, _dense(x, causal=True).float(), "float32")
    assert error is None, f"seed {session_seed}: {error}"
    bidirectional = call_prefill(paged_prefill_attention_reference, x, causal=False)
    cu = x["cu_seqlens_q"].tolist()
    for i in range(len(cu) - 1):
        for row in range(cu[i], cu[i + 1]):
            same = torch.allclose(default[row], bidirectional[row], atol=1e-5, rtol=1e-5)
            assert same == (row == cu[i + 1] - 1), f"sequence {i}, row {row}, seed {session_seed}"


def _check_builds(builds, x, dtype, features, seed) -> dict:
    expected = call_prefill(paged_prefill_attention_reference, x, **features)
    outs = {}
    for isa, ops in builds.items():
        outs[isa] = call_prefill(ops.paged_prefill_attention, x, **features)
        error = compare(outs[isa], expected, dtype)
        assert error is None, f"{isa} build, seed {seed}, {features}: {error}"
    return outs


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", COMPILED_SHAPES, ids=str)
def test_compiled_op_matches_reference(builds, shape, dtype, cap, session_seed):
    x = _inputs(shape, dtype, session_seed)
    _check_builds(builds, x, dtype, _features(cap), session_seed)
    # causal=True is the op's default, and the keyword means what it says.
    for ops in builds.values():
        causal = call_prefill(ops.paged_prefill_attention, x)
        assert torch.equal(causal, call_prefill(ops.paged_prefill_attention, x, causal=True))
        assert not torch.equal(causal, call_prefill(ops.paged_prefill_attention, x, causal=False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_op_over_partitions(builds, dtype, session_seed):
    """A 700-token prompt (past a 512-token split-KV partition, many query
    items) and a 530-token one, 9/3 heads: every item reads the whole context."""
    x = _inputs((64, 9, 3, 16), dtype, session_seed, plan=[(700, 700), (5, 5), (530, 530)])
    _check_builds(builds, x, dtype, {"causal": False}, session_seed)


def test_dispatch_takes_the_compiled_op(compiled_cpu_ops, session_seed):
    x = _inputs((64, 8, 2, 16), "float32", session_seed)
    expected = call_prefill(compiled_cpu_ops.paged_prefill_attention, x, causal=False)
    assert torch.equal(call_prefill(kernels.paged_prefill_attention, x, causal=False), expected)
    cpu = kernels.get_backend("cpu")
    assert torch.equal(call_prefill(cpu.paged_prefill_attention, x, causal=False), expected)
    torch_backend = kernels.get_backend("torch")
    assert torch.equal(call_prefill(torch_backend.paged_prefill_attention, x, causal=False),
                       call_prefill(paged_prefill_attention_reference, x, causal=False))
    assert not torch.equal(call_prefill(kernels.paged_prefill_attention, x), expected)


def test_dispatch_passes_causal_only_when_off(monkeypatch):
    """Like the other features, causal reaches the op only when set (False)."""
    calls = []

    class Spy:
        def paged_prefill_attention(self, *args, **kwargs):
            calls.append(kwargs)
            return args[0]

    monkeypatch.setattr(cpu_ops, "ops_for", lambda width: Spy())
    x = _inputs((64, 4, 4, 16), "float32", 0, plan=[(3, 3)])
    call_prefill(kernels.paged_prefill_attention, x)
    call_prefill(kernels.paged_prefill_attention, x, causal=True)
    call_prefill(kernels.paged_prefill_attention, x, causal=False)
    call_prefill(kernels.paged_prefill_attention, x, causal=False, logits_soft_cap=2.0)
    assert calls == [{}, {}, {"causal": False}, {"causal": False, "logits_soft_cap": 2.0}]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_compiled_op_the_fallback_serves(dtype, session_seed, monkeypatch):
    monkeypatch.setenv(cpu_ops.ENV_VAR, "off")
    x = _inputs((64, 8, 2, 16), dtype, session_seed)
    out = call_prefill(kernels.paged_prefill_attention, x, causal=False)
    expected = paged_prefill_attention_reference(
        x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["cu_seqlens_q"],
        x["context_lens"], x["scale"], compute_dtype=x["k_cache"].dtype, causal=False)
    assert torch.equal(out, expected)
    error = compare(out, _dense(x, causal=False).to(out.dtype), dtype)
    assert error is None, f"seed {session_seed}: {error}"


def test_a_window_without_causal_is_a_value_error(compiled_cpu_ops):
    x = _inputs((64, 4, 4, 16), "float32", 0, plan=[(5, 5)])
    bad = {"causal": False, "sliding_window": 4}
    for op in (paged_prefill_attention_reference, kernels.paged_prefill_attention,
               kernels.get_backend("cpu").paged_prefill_attention, compiled_cpu_ops.paged_prefill_attention):
        with pytest.raises(ValueError, match="causal"):
            call_prefill(op, x, **bad)


def _triton_cases() -> list[dict]:
    cases = [dict(kernel="prefill", shape=list(shape), dtype="float32", causal=False,
                  id=f"noncausal-prefill-float32-d{shape[0]}-h{shape[1]}kv{shape[2]}-bs{shape[3]}")
             for shape in TRITON_SHAPES]
    cases.append(dict(kernel="prefill", shape=[128, 8, 1, 16], dtype="float32", causal=False,
                      features="cap", id="noncausal-prefill-cap-float32-d128-h8kv1-bs16"))
    return cases


TRITON_CASES = _triton_cases()


@pytest.fixture(scope="module")
def triton_noncausal(kernel_test_device, session_seed) -> dict:
    """{case id: None or error}: kernel_case_runner.py runs each case's prefill
    (its build_prefill_inputs: whole prompts, extends, a padding entry, NaN in
    every slot not written) with causal=False against the reference."""
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    jobs = [{"case": case, "seed": case_seed(session_seed, case["id"])} for case in TRITON_CASES]
    workers = 1 if kernel_test_device == "cuda" else max(1, len(os.sched_getaffinity(0)))
    return run_in_children(balanced_batches(jobs, workers), kernel_test_device)


@pytest.mark.parametrize("case", TRITON_CASES, ids=[case["id"] for case in TRITON_CASES])
def test_triton_matches_reference(case, triton_noncausal, session_seed, kernel_test_device):
    error = triton_noncausal[case["id"]]
    assert error is None, (f"{case['id']} on {kernel_test_device} failed (session seed {session_seed}, "
                           f"case seed {case_seed(session_seed, case['id'])}):\n{error}")


class _SpyKernels:
    def __init__(self):
        self.calls = {}

    def store_kvcache(self, *args):
        pass

    def paged_decode_attention(self, query, *args, **kwargs):
        self.calls["decode"] = kwargs
        return torch.zeros_like(query)

    def paged_prefill_attention(self, query, *args, **kwargs):
        self.calls["prefill"] = kwargs
        return torch.zeros_like(query)


@pytest.mark.parametrize("causal", [True, False])
def test_the_layer_passes_causal_to_prefill_only(causal):
    spy = _SpyKernels()
    layer = PagedAttention(4, 2, 8, 0.5, 0, spy, logits_soft_cap=5.0, causal=causal)
    meta = SimpleNamespace(window=None, slot_mapping=None, num_decode_tokens=1, decode_block_tables=None,
                           decode_context_lens=None, prefill_block_tables=None, prefill_cu_seqlens_q=None,
                           prefill_context_lens=None)
    q, kv = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    layer(q, kv, kv, ([None], [None]), meta)
    assert spy.calls["decode"] == {"logits_soft_cap": 5.0}
    assert spy.calls["prefill"] == ({"logits_soft_cap": 5.0} if causal else
                                    {"logits_soft_cap": 5.0, "causal": False})
    assert layer.features == {"logits_soft_cap": 5.0}  # what the fused decoder layer ops read
