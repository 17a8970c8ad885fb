"""Triton paged attention: the layout every kernel shares, and its device helpers.

The kernels themselves live in ``paged_decode.py`` (decode, plain and
split-KV) and ``paged_prefill.py`` (prefill/extend); this file holds what
both rely on: the token-by-token K/V gather, the online softmax and the
input checks.

Gathering K/V token by token
----------------------------
Every kernel walks a sequence's context in tiles of ``BLOCK_N`` *tokens*, not
cache pages.  Each token finds its own page through the block table::

    tile of BLOCK_N = 8 tokens, block_size = 4, block_table = [7, 2, 5]

    token      0  1  2  3 | 4  5  6  7
    page       7  7  7  7 | 2  2  2  2        page = block_table[token // 4]
    row in it  0  1  2  3 | 0  1  2  3        row  = token % 4

so the tile shape is independent of block_size: any power of two from 1 up
works, and ``tl.dot`` always gets the >= 16 rows it needs.

GQA / MQA: query heads as matrix rows
-------------------------------------
Query head ``h`` reads kv head ``h // group`` (``group = heads // kv_heads``).
A program owns one kv head and puts *all* its query heads in the rows of the
Q tile, so each K/V tile is loaded once per group, not once per query head::

    decode  (rows = group, padded to >= 16):     prefill (rows = tokens x group):
      row r -> head kv_head * group + r            row r -> token r // GROUP_PAD,
                                                            head kv_head * group + r % GROUP_PAD

Softmax is the online (flash) form in fp32, in base 2: scores are multiplied
by ``scale * log2(e)`` so ``exp2`` can be used.  Running maxima start at a
large finite negative number instead of -inf so rows that see no key at all
(padding) stay NaN-free and finish as 0 / 0 -> guarded to 0.

Optional features, each a constexpr flag so that plain attention
compiles exactly as without them:

* ``WINDOW`` (sliding window W): a row at position p sees keys k with
  p - W < k <= p.  The kernels start their KV loop at the tile holding the
  first row's first key, so tiles wholly before the window are never read,
  and mask the rest.
* ``CAUSAL`` (prefill only; off for encoders): a row at position p sees
  keys k <= p; without it every row sees the whole context.
* ``SOFT_CAP`` (Gemma 2): each score s = q.k * scale becomes c * tanh(s / c),
  in fp32, before the mask (``soft_cap_tanh``: the interpreter has no libdevice,
  and the compiled CPU ops evaluate the same rational function).

Precision: fp32 inputs use ``input_precision="ieee"`` (no TF32), since the
engine must match HF transformers token-for-token in float32.  fp16/bf16 use
tensor cores with fp32 accumulation.  Under the Triton interpreter (CPU
tensors) everything is upcast to fp32 right after loading, because the
interpreter's bf16 arithmetic is wrong.

int8 caches (``--kv-cache-dtype int8``, layout in ``kernels/kv_quant.py``)
---------------------------------------------------------------------------
The kernels read the int8 blocks in place: ``load_int8_tile`` loads a tile's
codes and, beside each row, its fp16 scale, inside the tile loop, so no
de-quantized copy of the cache is ever built.  Q.K multiplies codes by codes:
the query's rows are rounded to int8 once (``quantize_query_rows``, as
kernels/kv_quant.py's quantize_query defines it), both sides' codes go to
``tl.dot`` in the query's dtype (exact: |code| <= 127), and the two scales
multiply the sums, as the reference and the CPU op's integer dot product do.
P.V reads V's codes times their scale, rounded once to the query's dtype as
a cache in that dtype would hold them.  Whether a cache is int8 is read from
its pointer's type at compile time: the float caches compile exactly as
before. A row of head_dim + 2 bytes is only 2-aligned, which Triton cannot
see for itself: ``ROW_ALIGN`` (``row_align``) says so, and the loads take
the widest width it allows instead of a byte each.  The query (float32/bf16/fp16) sets the output dtype.

fp8 caches (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``)
-------------------------------------------------------
A torch.float8_e4m3fn (Triton's ``tl.float8e4nv``) or float8_e5m2
(``tl.float8e5``) cache of the usual shape, no scales (vLLM's per-tensor scale
fixed at 1.0).  ``load_kv_tile`` loads the fp8 tile and converts it inside the
tile loop (sm_90: ``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2``, then fp32): exact, so
a bf16 or fp16 query's kernel attends to exactly the stored values.  The
interpreter converts fp8 exactly too, except the NaN / inf bit patterns
(``fp8_values`` puts the NaN back).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.kv_quant import cache_head_dim, is_fp8, is_quantized
from kernels.reference import attention_features

LOG2E = 1.4426950408889634
# Largest finite values of the fp8 formats (torch.finfo(...).max): a @triton.jit
# function may read a global only as a constexpr.
FP8_E4M3_MAX = tl.constexpr(448.0)
FP8_E5M2_MAX = tl.constexpr(57344.0)


# ---------------------------------------------------------------------------
# Shared device helpers
# ---------------------------------------------------------------------------

@triton.jit
def kv_tile_rows(table_row_ptr, token_start, context_len, kv_head,
                 stride_block, stride_slot, stride_head,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """A tile of BLOCK_N context tokens: the tokens, the offset of each one's
    (token, kv head) row in the cache, and which of them are in the context.
    ROW_ALIGN (row_align) tells the compiler every row starts at a multiple of it."""
    tokens = token_start + tl.arange(0, BLOCK_N)
    in_context = tokens < context_len
    page = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=in_context, other=0)
    # int64: page * stride_block overflows int32 on large caches.
    rows = page.to(tl.int64) * stride_block + (tokens % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    if ROW_ALIGN > 1:
        rows = tl.multiple_of(rows, ROW_ALIGN)
    return tokens, rows, in_context


@triton.jit
def load_int8_tile(cache_ptr, rows, in_context, stride_dim, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """An int8 cache's (kernels/kv_quant.py) [BLOCK_N, DIM_PAD] codes of ``rows``
    and each row's fp16 scale in fp32, read in place (the scale sits after the
    HEAD_DIM codes; check_int8_layout made its two bytes contiguous and 2-aligned)."""
    dims = tl.arange(0, DIM_PAD)
    mask = in_context[:, None] & (dims < HEAD_DIM)[None, :]
    codes = tl.load(cache_ptr + rows[:, None] + dims[None, :] * stride_dim, mask=mask, other=0)
    scale_ptr = (cache_ptr + rows + HEAD_DIM * stride_dim).to(tl.pointer_type(tl.float16), bitcast=True)
    return codes, tl.load(scale_ptr, mask=in_context, other=0.0).to(tl.float32)


@triton.jit
def quantize_query_rows(q):
    """Each row of ``q`` as an int8 cache's Q.K reads it (kernels/kv_quant.py,
    quantize_query): its codes, in q's dtype (exact: |code| <= 127), and their
    fp32 scale, max |q| / 127.  Adding and taking away 1.5 * 2^23 leaves fp32's
    nearest integer, ties to even, as torch.round does."""
    x = q.to(tl.float32)
    scale = tl.max(tl.abs(x), 1) / 127.0
    codes = tl.where(scale[:, None] > 0, x / tl.where(scale > 0, scale, 1.0)[:, None], 0.0)
    codes = (codes + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(codes, -127.0), 127.0).to(q.dtype), scale


@triton.jit
def load_kv_tile(cache_ptr, rows, in_context, stride_dim,
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, UPCAST: tl.constexpr):
    """The [BLOCK_N, DIM_PAD] K or V values of ``rows``: the cache's own dtype,
    or, for an int8 cache, each row's codes times its scale in fp32
    (load_int8_tile), or an fp8 cache's values in fp32."""
    if cache_ptr.dtype.element_ty == tl.int8:
        codes, scale = load_int8_tile(cache_ptr, rows, in_context, stride_dim, HEAD_DIM, DIM_PAD)
        x = codes.to(tl.float32) * scale[:, None]
    else:
        dims = tl.arange(0, DIM_PAD)
        mask = in_context[:, None] & (dims < HEAD_DIM)[None, :]
        x = tl.load(cache_ptr + rows[:, None] + dims[None, :] * stride_dim, mask=mask, other=0.0)
        if cache_ptr.dtype.element_ty == tl.float8e4nv:
            x = fp8_values(x, FP8_E4M3_MAX, UPCAST)
        elif cache_ptr.dtype.element_ty == tl.float8e5:
            x = fp8_values(x, FP8_E5M2_MAX, UPCAST)
    return x


@triton.jit
def fp8_values(x, TOP: tl.constexpr, UPCAST: tl.constexpr):
    """fp8 values in fp32, exactly (every e4m3fn and e5m2 value is an fp16, the
    GPU's conversion goes through it).  The interpreter decodes the NaN (and
    e5m2's inf) bit patterns as finite numbers past the format's largest, TOP:
    made NaN again, so a slot read that must not be still shows (the store
    never writes an inf: it clamps)."""
    x = x.to(tl.float32)
    if UPCAST:
        x = tl.where(tl.abs(x) > TOP, float("nan"), x)
    return x


@triton.jit
def soft_cap_tanh(x):
    """tanh in fp32: the odd rational minimax approximation of degrees 13/6
    (Eigen's; kernels/cpu/csrc/attention.h, tanh_rational), clamped where tanh
    rounds to +-1.  Branch-free, ~2e-7 absolute error, full relative accuracy near 0."""
    x = tl.minimum(tl.maximum(x, -7.90531110763549805), 7.90531110763549805)
    x2 = x * x
    p = x2 * -2.76076847742355e-16 + 2.00018790482477e-13
    p = p * x2 + -8.60467152213735e-11
    p = p * x2 + 5.12229709037114e-08
    p = p * x2 + 1.48572235717979e-05
    p = p * x2 + 6.37261928875436e-04
    p = p * x2 + 4.89352455891786e-03
    q = x2 * 1.19825839466702e-06 + 1.18534705686654e-04
    q = q * x2 + 2.26843463243900e-03
    q = q * x2 + 4.89352518554385e-03
    return p * x / q


@triton.jit
def online_softmax_step(acc, m_i, l_i, scores, v):
    """Fold one tile of base-2 scores [M, N] and values [N, D] into the state."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def attend_range(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row_ptr,
                  kv_start, kv_end, context_len, kv_head, qk_scale, window, soft_cap,
                  stride_block, stride_slot, stride_head, stride_dim,
                  CAUSAL: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                  WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, UPCAST: tl.constexpr,
                  ROW_ALIGN: tl.constexpr):
    """Attend rows of ``q`` (at positions ``q_pos``) to context tokens [kv_start, kv_end);
    ``soft_cap`` is the cap times log2(e), as the scores are in base 2."""
    INT8_K: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8
    if INT8_K:  # Q.K of codes by codes, the scales after (see the module's notes)
        q, q_scale = quantize_query_rows(q)
    for token_start in range(kv_start, kv_end, BLOCK_N):
        tokens, rows, in_context = kv_tile_rows(
            table_row_ptr, token_start, context_len, kv_head,
            stride_block, stride_slot, stride_head, BLOCK_SIZE, BLOCK_N, ROW_ALIGN)
        # In q's dtype, so tl.dot takes the tensor cores: the cache's own (q is
        # fp32 under the interpreter, whose bf16 arithmetic is wrong: upcast),
        # or an int8 cache's values rounded once to it, as a bf16 cache holds them
        # (an fp8 cache's convert exactly: fp8 values are bf16 and fp16 values).
        v = load_kv_tile(v_cache_ptr, rows, in_context, stride_dim, HEAD_DIM, DIM_PAD, UPCAST).to(q.dtype)
        if INT8_K:
            k, k_scale = load_int8_tile(k_cache_ptr, rows, in_context, stride_dim, HEAD_DIM, DIM_PAD)
            dots = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
            scores = dots * (q_scale[:, None] * k_scale[None, :]) * qk_scale
        else:
            k = load_kv_tile(k_cache_ptr, rows, in_context, stride_dim, HEAD_DIM, DIM_PAD, UPCAST).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if SOFT_CAP:
            scores = soft_cap * soft_cap_tanh(scores / soft_cap)
        visible = (tokens < kv_end)[None, :]
        if CAUSAL:
            visible = visible & (tokens[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (tokens[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, scores, v)
    return acc, m_i, l_i


# ---------------------------------------------------------------------------
# Host-side checks
# ---------------------------------------------------------------------------

def check_inputs(query, k_cache, v_cache, block_tables, context_lens):
    heads, head_dim = query.shape[1], query.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    if cache_head_dim(k_cache) != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, cache {cache_head_dim(k_cache)}")
    if heads % k_cache.shape[2]:
        raise ValueError(f"num_heads ({heads}) must be a multiple of num_kv_heads ({k_cache.shape[2]})")
    if is_quantized(k_cache):
        check_int8_layout(k_cache)
        check_int8_layout(v_cache)
    elif k_cache.dtype != query.dtype and not is_fp8(k_cache):
        raise ValueError(f"cache dtype {k_cache.dtype} differs from query dtype {query.dtype}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")


def check_int8_layout(cache: torch.Tensor) -> None:
    """The kernels read (and the store writes) an int8 row's scale as one fp16:
    its two bytes must be adjacent and start at an even address."""
    odd = cache.data_ptr() % 2 or any(stride % 2 for stride in cache.stride()[:3])
    if cache.stride(3) != 1 or odd:
        raise ValueError("an int8 cache needs contiguous rows at even byte offsets "
                         f"(strides {tuple(cache.stride())})")


def row_align(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The ROW_ALIGN an int8 cache's rows are read with: the largest power of
    two up to 16 that divides the address of every (token, kv head) row. Triton
    assumes nothing of an integer that is not a multiple of 16, and a row of
    head_dim + 2 bytes a row apart is only 2-aligned; read byte by byte, the
    H200 took an int8 decode 35x as long as a copy 16 bytes apart
    (docs/performance.md). Float caches: 1, no hint (their rows are whole
    head_dims of 2 or 4 bytes, and compile as before)."""
    if not is_quantized(k_cache):
        return 1
    align = 16
    for value in (k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3]):
        align = math.gcd(align, value)
    return align


def feature_args(sliding_window, logits_soft_cap, causal=True) -> dict:
    """The kernels' feature arguments: the values, and the constexpr flags that
    compile the features in (neither set: the plain kernels).  ``causal``
    (prefill's) is only checked here: a window without it is refused."""
    attention_features(sliding_window, logits_soft_cap, causal)  # a bad value is a ValueError
    return dict(window=sliding_window or 0, soft_cap=(logits_soft_cap or 1.0) * LOG2E,
                WINDOW=sliding_window is not None, SOFT_CAP=logits_soft_cap is not None)


def output_like(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} on {query.device}")
    return out
