"""Kernel test cases and their random inputs, shared by the pytest modules and
the subprocess runner (``kernel_case_runner.py``).

Importing this module must not import triton: the runner has to set
TRITON_INTERPRET first.

A case is a small JSON-able dict; its inputs are drawn from a seed chosen
fresh per test session, so every run explores new values and a failure
reports the seed that reproduces it.

Cache layout used by every builder::

    block 0           : NaN        (null block: pads block tables, never read)
    blocks in use     : random ids from 1..num_blocks-1, shuffled, so a
                        sequence's pages are not contiguous or ordered
    slots past the end
    of a context      : NaN        (a kernel reading them produces NaN)
"""

from __future__ import annotations

import math
import os
import zlib

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}

# (head_dim, num_heads, num_kv_heads, block_size): together they cover every
# head_dim, group ratios 1/2/4/8 (8 with one kv head = MQA) and block sizes
# 1 (smallest supported), 16, 128 and 256 (largest), without a full product.
SHAPES = (
    (64, 4, 4, 1),
    (80, 8, 4, 16),
    (96, 8, 2, 128),
    (128, 8, 1, 16),
    (256, 4, 1, 1),
    (64, 16, 2, 128),
    (128, 4, 2, 256),
)


def case_seed(session_seed: int, case_id: str) -> int:
    """Per-case seed: independent of which cases were selected."""
    return (session_seed + zlib.crc32(case_id.encode())) % 2**31


def _shape_name(shape) -> str:
    head_dim, heads, kv_heads, block_size = shape
    return f"d{head_dim}-h{heads}kv{kv_heads}-bs{block_size}"


def turning(choices: list, index: int) -> list:
    """All of `choices` on a GPU (native Triton runs a case in milliseconds);
    under the interpreter, whose time is the suite's, only the one at `index`,
    so that a caller turning `index` with its other factors still meets every
    choice with each of them (all pairs instead of the full product)."""
    if os.environ.get("PAGEDSERVE_TEST_DEVICE") == "cuda":
        return list(choices)
    return [choices[index % len(choices)]]


def decode_cases() -> list[dict]:
    """Every shape x variant (plain kernel, forced split, auto pick), and each
    dtype with both (every dtype for each pair on a GPU)."""
    cases = []
    for i, shape in enumerate(SHAPES):
        for j, variant in enumerate(("plain", "split", "auto")):
            for dtype in turning(list(DTYPES), i + j):
                cases.append(dict(kernel="decode", shape=list(shape), dtype=dtype, variant=variant,
                                  id=f"decode-{variant}-{dtype}-{_shape_name(shape)}"))
    return cases


def prefill_cases() -> list[dict]:
    """Every shape, each in one dtype under the interpreter (the seven shapes
    meet each dtype two or three times, with every group ratio and block size
    among them); every dtype with every shape on a GPU."""
    cases = []
    for i, shape in enumerate(SHAPES):
        for dtype in turning(list(DTYPES), i):
            cases.append(dict(kernel="prefill", shape=list(shape), dtype=dtype,
                              id=f"prefill-{dtype}-{_shape_name(shape)}"))
    return cases


def store_cases() -> list[dict]:
    """Every shape, and each (dtype, slot dtype) pair with one of them (the
    seven shapes meet all six pairs; every pair with every shape on a GPU)."""
    pairs = [(dtype, slot_dtype) for dtype in DTYPES for slot_dtype in ("int32", "int64")]
    cases = []
    for i, shape in enumerate(SHAPES):
        for dtype, slot_dtype in turning(pairs, i):
            cases.append(dict(kernel="store", shape=list(shape), dtype=dtype, slot_dtype=slot_dtype,
                              id=f"store-{dtype}-{slot_dtype}-{_shape_name(shape)}"))
    return cases


def compile_cases() -> list[dict]:
    """Ahead-of-time compiles for sm_90 (kernel_compile.py): on a CPU-only
    machine the only check that the real Triton compiler accepts the kernels."""
    configs = (("bfloat16", 128, 4, 16), ("float32", 256, 8, 1), ("float16", 80, 1, 128))
    return [dict(kernel="compile", dtype=dtype, shape=[head_dim, group, 1, block_size],
                 id=f"compile-sm90-{dtype}-d{head_dim}-g{group}-bs{block_size}")
            for dtype, head_dim, group, block_size in configs]


# Shapes of the sliding-window / soft-cap cases: block sizes 1, 16 and 128,
# MHA, MQA and GQA.
FEATURE_SHAPES = ((64, 4, 4, 1), (128, 8, 1, 16), (64, 16, 2, 128))


def feature_sets(features: str, block_size: int) -> list[dict]:
    """The keyword arguments a features case runs in turn: windows of one
    token, a block and a few tokens (shorter than some contexts of
    context_lengths(), longer than others) and longer than any context; a cap
    small enough to saturate tanh; both at once."""
    windows = [{"sliding_window": w} for w in (1, block_size + 5, 100_000)]
    both = [{"sliding_window": 2 * block_size + 3, "logits_soft_cap": 5.0}]
    return {"window": windows, "cap": [{"logits_soft_cap": 2.0}], "both": both}[features]


def feature_cases() -> list[dict]:
    """Decode and prefill with each feature, in float32; decode split into
    partitions too with a window (some partitions lie wholly before it),
    where the blocks are small enough for that to be cheap."""
    cases = []
    for shape in FEATURE_SHAPES:
        for features in ("window", "cap", "both"):
            name = f"{features}-float32-{_shape_name(shape)}"
            split = features != "cap" and shape[3] <= 16
            for variant in ("plain", "split") if split else ("plain",):
                cases.append(dict(kernel="decode", shape=list(shape), dtype="float32", variant=variant,
                                  features=features, id=f"decode-{variant}-{name}"))
            cases.append(dict(kernel="prefill", shape=list(shape), dtype="float32", features=features,
                              id=f"prefill-{name}"))
    return cases


def all_cases() -> list[dict]:
    return decode_cases() + prefill_cases() + feature_cases() + store_cases() + compile_cases()


def estimated_cost(case: dict) -> float:
    """Rough interpreter run time, only used to balance the child processes:
    work grows with the context lengths, i.e. with block_size."""
    block_size = case["shape"][3]
    weight = {"prefill": 3.0, "decode": 1.0, "store": 1.0, "compile": 0.0}[case["kernel"]]
    runs = len(feature_sets(case["features"], block_size)) if "features" in case else 1
    return weight * runs * max(block_size, 16)


# ---------------------------------------------------------------------------
# Input builders
# ---------------------------------------------------------------------------

def context_lengths(block_size: int) -> list[int]:
    """Lengths that straddle block edges: 1, bs-1, bs+1 and several blocks."""
    lengths = [1, block_size - 1, block_size + 1, 3 * block_size + 5]
    return [n for n in lengths if n > 0]


def make_paged_cache(lengths, kv_heads, head_dim, block_size, dtype, device, gen):
    """Random K/V for sequences of ``lengths`` in a NaN-filled paged cache.

    Returns k_cache, v_cache, block_tables (int32, padded with block 0 plus
    one extra column of padding) and the contiguous per-sequence K/V.
    """
    blocks_per_seq = [math.ceil(n / block_size) for n in lengths]
    num_blocks = 1 + sum(blocks_per_seq) + 3  # null block + spares never used
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lengths), max(blocks_per_seq, default=0) + 1, dtype=torch.int32)
    keys, values = [], []
    for row, (length, count) in enumerate(zip(lengths, blocks_per_seq)):
        pages, ids = ids[:count], ids[count:]
        tables[row, :count] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype)
        for position in range(0, length, block_size):
            end = min(position + block_size, length)
            page = pages[position // block_size]
            k_cache[page, : end - position] = k[position:end]
            v_cache[page, : end - position] = v[position:end]
        keys.append(k)
        values.append(v)
    return (k_cache.to(device), v_cache.to(device), tables.to(device), keys, values)


def build_decode_inputs(case: dict, seed: int, device) -> dict:
    head_dim, heads, kv_heads, block_size = case["shape"]
    dtype = DTYPES[case["dtype"]]
    gen = torch.Generator().manual_seed(seed)
    # A context_len 0 padding row in the middle of real ones.
    lengths = context_lengths(block_size)
    lengths = lengths[:1] + [0] + lengths[1:]
    k_cache, v_cache, tables, keys, values = make_paged_cache(
        lengths, kv_heads, head_dim, block_size, dtype, device, gen)
    query = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype).to(device)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
                scale=head_dim ** -0.5, keys=keys, values=values)


def build_prefill_inputs(case: dict, seed: int, device) -> dict:
    """Sequences as (context_len, new tokens): full prefill, chunked extends
    over a cached prefix, single-token extends and an empty padding entry."""
    head_dim, heads, kv_heads, block_size = case["shape"]
    dtype = DTYPES[case["dtype"]]
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    # The extend chunk is capped at 40 tokens: a bs-1 chunk over 3 blocks of
    # 256 costs the interpreter ~10 s and covers nothing new.
    plan = [(bs + 1, bs + 1), (3 * bs + 5, max(min(bs - 1, 40), 1)), (0, 0), (1, 1), (2 * bs, 1),
            (2 * bs + 8, 7)]
    lengths = [ctx for ctx, _ in plan]
    k_cache, v_cache, tables, keys, values = make_paged_cache(
        lengths, kv_heads, head_dim, block_size, dtype, device, gen)
    q_lens = [nq for _, nq in plan]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(dtype).to(device)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                cu_seqlens_q=cu.to(device),
                context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
                scale=head_dim ** -0.5, keys=keys, values=values)


def build_store_inputs(case: dict, seed: int, device) -> dict:
    """A NaN cache, tokens aimed at distinct random slots outside block 0,
    some marked -1, and key/value as non-contiguous views (like slices of a
    fused qkv projection)."""
    head_dim, _, kv_heads, block_size = case["shape"]
    dtype = DTYPES[case["dtype"]]
    gen = torch.Generator().manual_seed(seed)
    num_tokens = 2 * block_size + 3
    num_blocks = 1 + math.ceil(2 * num_tokens / block_size)
    free_slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    skip = torch.rand(num_tokens, generator=gen) < 0.25
    slots = torch.where(skip, -1, free_slots).to(getattr(torch, case["slot_dtype"]))
    fused = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(key=fused[:, 1], value=fused[:, 2],
                k_cache=torch.full(shape, float("nan"), dtype=dtype, device=device),
                v_cache=torch.full(shape, float("nan"), dtype=dtype, device=device),
                slot_mapping=slots.to(device))


def call_decode(op, x: dict, **features):
    """A decode attention op (any backend's) on a build_decode_inputs dict."""
    return op(x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"],
              x["scale"], **features)


def call_prefill(op, x: dict, **features):
    """A prefill attention op (any backend's) on a build_prefill_inputs dict."""
    return op(x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["cu_seqlens_q"],
              x["context_lens"], x["scale"], **features)


def poisoned_before(x: dict, starts) -> dict:
    """x with copies of its caches in which sequence i's positions before
    starts[i] are NaN: a kernel that reads any of them outputs NaN (how the
    tests see that a sliding window skips the blocks before it)."""
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    block_size = k_cache.shape[1]
    tables = x["block_tables"].tolist()
    for row, start in enumerate(starts):
        for position in range(int(start)):
            block = tables[row][position // block_size]
            k_cache[block, position % block_size] = float("nan")
            v_cache[block, position % block_size] = float("nan")
    return dict(x, k_cache=k_cache, v_cache=v_cache)


def window_starts(x: dict, window: int | None, align: int = 1, prefill: bool = False) -> list[int]:
    """Per sequence, the first position a kernel with a sliding window needs
    (rounded down to a multiple of ``align``, the tile the kernel starts at):
    decode's query is the last of L tokens; a prefill chunk's first query
    (of nq) sits at L - nq."""
    lengths = x["context_lens"].tolist()
    if prefill:
        cu = x["cu_seqlens_q"].tolist()
        lengths = [n - (cu[i + 1] - cu[i]) + 1 for i, n in enumerate(lengths)]
    if window is None:
        return [0] * len(lengths)
    return [max(0, n - window) // align * align for n in lengths]


def compare(actual: torch.Tensor, expected: torch.Tensor, dtype_name: str) -> str | None:
    """None if close enough, else a short description of the mismatch."""
    tol = TOLERANCE[dtype_name]
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"got {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    a, e = actual.float().cpu(), expected.float().cpu()
    if torch.isnan(a).any():
        return f"{int(torch.isnan(a).sum())} NaN elements (unwritten or garbage read)"
    if torch.allclose(a, e, rtol=tol, atol=tol):
        return None
    err = (a - e).abs()
    where = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
    return f"max abs error {err.max().item():.3g} at {where} (tolerance {tol})"
