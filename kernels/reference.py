"""Pure-PyTorch reference implementations of the paged KV-cache kernels (and
of the model ops the compiled CPU ops replace: RMSNorm with its residual
add, RoPE, SiLU(gate) * up, and the linear layers' matmul, at the end of
this file, followed by the mixture-of-experts experts, fused_moe).

These are the ground truth for the Triton kernels and the CPU engine's
attention path, so they favour being obviously right, then fast:

* gather the block table into a contiguous [tokens, kv_heads, head_dim] view,
* attend in fp32 with torch's fused scaled_dot_product_attention, the same op
  HF transformers runs, so that float32 greedy outputs match it token for token,
* mask ragged lengths / causal offsets explicitly (a whole prompt is plain causal),
* handle GQA/MQA with SDPA's enable_gqa rather than copying K/V ``group`` times.

Paged layout (one layer)::

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]

    sequence positions   0 1 2 3 | 4 5 6 7 | 8 9
    block_table          [  7    ,   2     ,  5 ]     (block_size = 4)
    slot of position p = block_table[p // 4] * 4 + p % 4
                         (block 0 is the null block that pads tables)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation import activate
from kernels.kv_quant import (dequantize_rows, is_fp8, is_quantized, quantize_query, quantize_rows,
                              to_fp8)

# Bound on the fp32 elements of gathered K (and again V) per decode chunk, so a
# batch with one very long sequence does not materialise
# batch * longest_context * kv_heads * head_dim floats at once.
_DECODE_GATHER_BUDGET = 1 << 26


def store_kvcache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot, in place; slot -1 = skip.
    An int8 or fp8 cache (kernels/kv_quant.py) takes each row quantized."""
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    if bool((slots < 0).any()):  # rare (padding): drop the skipped rows first
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    # view (not reshape) so an incompatible cache layout errors instead of
    # silently writing into a copy.
    flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    if is_quantized(k_cache):
        key, value = quantize_rows(key), quantize_rows(value)
    elif is_fp8(k_cache):  # as bytes: torch has no index_copy_ of fp8
        key, value = to_fp8(key, k_cache.dtype).view(torch.uint8), to_fp8(value, v_cache.dtype).view(torch.uint8)
        flat_k, flat_v = flat_k.view(torch.uint8), flat_v.view(torch.uint8)
    flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, value.to(flat_v.dtype))


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, length: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Paged cache -> contiguous ``[rows, length, kv_heads, head_dim]`` in ``dtype``.

    ``block_tables`` is ``[rows, max_blocks]``; positions >= a row's own
    context length come from padding blocks and must be masked by the caller.
    """
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks].to(device=cache.device, dtype=torch.long)
    pages = cache[ids]  # [rows, num_blocks, block_size, kv_heads, head_dim]
    rows = pages.shape[0]
    flat = pages.reshape(rows, num_blocks * block_size, cache.shape[2], cache.shape[3])[:, :length]
    return _values(flat).to(dtype)


def _values(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as values: an int8 cache's rows de-quantized to float32."""
    return dequantize_rows(rows) if is_quantized(rows) else rows


def _query_values(query: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
    """The query as Q.K reads it: rounded to int8 rows where K is int8
    (kernels/kv_quant.py, quantize_query), else as it is."""
    return quantize_query(query) if is_quantized(k_cache) else query


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               allowed: torch.Tensor | None, scale: float,
               logits_soft_cap: float | None = None, causal: bool = True) -> torch.Tensor:
    """Grouped attention in fp32 through torch's fused SDPA (what HF runs too).

    q: [rows, num_heads, nq, head_dim]; k, v: [rows, kv_heads, length, head_dim]
    allowed: bool mask broadcastable to [rows, num_heads, nq, length], or None
    for plain causal attention (nq == length), or with causal=False none at
    all (every query sees every key). Query head h reads KV head
    h // group (HF's repeat_kv convention) without copying K/V group times.
    With `logits_soft_cap` (Gemma 2) the scores are capped before the mask,
    which SDPA cannot do: the product is spelled out instead.
    """
    if logits_soft_cap is not None:
        return _capped_attention(q, k, v, allowed, scale, logits_soft_cap, causal)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, is_causal=allowed is None and causal, scale=scale, enable_gqa=True
    )


def _capped_attention(q, k, v, allowed, scale, cap, causal=True):
    """softmax(cap * tanh(q k^T * scale / cap) + mask) v, as HF's eager Gemma 2."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if allowed is None and causal:
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def window_mask(q_pos: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    """[nq, length] bool: which key positions each query position sees.

    Causal, and with a window W only the last W positions up to the query's
    own (HF's rule: key > query - W):

        W = 3, query at 5:   keys 0 1 2 [3 4 5] 6 7   (6, 7: the future)
    """
    keys = torch.arange(length, device=q_pos.device)[None, :]
    allowed = keys <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= keys > q_pos[:, None] - sliding_window
    return allowed


def attention_features(sliding_window: int | None = None,
                       logits_soft_cap: float | None = None, causal: bool = True) -> dict:
    """The features that are on, as the keyword arguments every backend's
    attention takes ({} for plain attention: the compiled ops' defaults, 0,
    mean off; ``causal`` only as False, prefill's); a window under one token,
    a cap <= 0 or a window without causal is a ValueError."""
    features = {} if causal else {"causal": False}
    check_causal(causal, sliding_window)
    if sliding_window is not None:
        if int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be a positive token count, got {sliding_window!r}")
        features["sliding_window"] = int(sliding_window)
    if logits_soft_cap is not None:
        if not float(logits_soft_cap) > 0.0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap!r}")
        features["logits_soft_cap"] = float(logits_soft_cap)
    return features


def check_causal(causal: bool, sliding_window: int | None) -> None:
    """Bidirectional attention (encoders) takes no sliding window: HF's is causal."""
    if not causal and sliding_window is not None:
        raise ValueError("sliding_window needs causal attention; causal=False takes none")


def _decode_rows(query, k_cache, v_cache, block_tables, context_lens, scale,
                 sliding_window=None, logits_soft_cap=None):
    rows, num_heads, head_dim = query.shape
    length = int(context_lens.max().item()) if rows else 0
    if length == 0:
        return torch.zeros(rows, num_heads, head_dim, dtype=torch.float32, device=query.device)
    lengths = context_lens.to(k_cache.device, torch.long)
    positions = torch.arange(length, device=k_cache.device)
    allowed = positions[None, :] < lengths[:, None]  # [rows, L]
    slots = _context_slots(block_tables, allowed, positions, k_cache.shape[1])
    if sliding_window is not None:  # only the last W positions, the query's own included
        allowed &= positions[None, :] >= lengths[:, None] - sliding_window
    k = _gather_slots(k_cache, slots)
    v = _gather_slots(v_cache, slots)
    # Rows of equal length (a single row, always) need no mask at all.
    mask = allowed[:, None, None, :] if not bool(allowed.all()) else None
    q = _query_values(query.float(), k_cache)[:, :, None, :]
    if logits_soft_cap is not None:
        mask = allowed[:, None, None, :]
        out = _capped_attention(q, k, v, mask, scale, logits_soft_cap)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # A padding row (context_len 0) has nothing to attend to: zeros, not NaN.
    out = out.masked_fill((lengths == 0)[:, None, None, None], 0.0)
    return out.reshape(rows, num_heads, head_dim)


def _context_slots(block_tables, allowed, positions, block_size):
    """Cache slot of every context position of every row, ``[rows, L]``, shared by K and V.

    Positions past a row's own length read the row's position 0 instead of
    whatever the padding blocks hold (possibly NaN), so masking them is
    enough: a finite value times a zero weight is zero. One index gather of
    the slots does the work that gathering pages and then zeroing the
    garbage with `where` did twice over.
    """
    positions = torch.where(allowed, positions[None, :], 0)
    tables = block_tables.to(device=positions.device, dtype=torch.long)
    return tables.gather(1, positions // block_size) * block_size + positions % block_size


def _gather_slots(cache, slots):
    """K or V at ``slots``, as fp32 ``[rows, kv_heads, L, head_dim]``."""
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    return _values(flat[slots]).float().transpose(1, 2)


def paged_decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context
    (with ``sliding_window`` W, to its last W tokens; ``logits_soft_cap`` c
    caps each score s as c * tanh(s / c) before the softmax).

    query: [num_seqs, num_heads, head_dim]; the query token is the last of the
    ``context_lens[i]`` cached tokens.  context_len 0 gives a zero row.
    """
    num_seqs, num_heads, head_dim = query.shape
    _check_heads(num_heads, k_cache.shape[2])
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    longest = max(int(context_lens.max().item()), 1)
    per_row = longest * k_cache.shape[2] * head_dim
    chunk = max(1, _DECODE_GATHER_BUDGET // per_row)
    for start in range(0, num_seqs, chunk):
        end = min(start + chunk, num_seqs)
        out[start:end] = _decode_rows(
            query[start:end], k_cache, v_cache, block_tables[start:end],
            context_lens[start:end], scale, sliding_window, logits_soft_cap,
        ).to(query.dtype)
    return out


def paged_prefill_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context
    (``causal=False``, encoders: each new token sees all ``context_lens[i]``).

    Sequence i owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; they are
    the last ``nq`` of its ``context_lens[i]`` cached tokens::

        context:  [ cached prefix ........ | q0 q1 q2 ]      (nq = 3)
        position:   0 ..... L-nq-1           L-3 L-2 L-1
        q_j at position L - nq + j sees positions 0 .. L - nq + j

    ``compute_dtype`` is what SDPA runs in: float32 for the ground truth; the
    CPU engine passes the cache dtype in half precision (kernels/cpu_attention.py).
    """
    total_q, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    _check_heads(num_heads, kv_heads)
    check_causal(causal, sliding_window)
    out = torch.zeros(total_q, num_heads, head_dim, dtype=query.dtype, device=query.device)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    for i, length in enumerate(lengths):
        q_start, q_end = starts[i], starts[i + 1]
        nq = q_end - q_start
        if nq == 0:
            continue
        if nq > length:
            raise ValueError(f"sequence {i}: {nq} query tokens but context_len {length}")
        k = _gather_context(k_cache, block_tables[i:i + 1], length, compute_dtype)[0].transpose(0, 1)
        v = _gather_context(v_cache, block_tables[i:i + 1], length, compute_dtype)[0].transpose(0, 1)
        q = _query_values(query[q_start:q_end], k_cache).to(compute_dtype).transpose(0, 1)[None]
        allowed = None  # a whole prompt at once: plain causal attention (or none)
        if causal and (nq < length or (sliding_window is not None and sliding_window < length)):
            # q_j (at position length - nq + j) sees positions <= its own, within the window
            q_pos = torch.arange(length - nq, length, device=query.device)
            allowed = window_mask(q_pos, length, sliding_window)
        o = _attention(q, k[None], v[None], allowed, scale, logits_soft_cap, causal)
        out[q_start:q_end] = o[0].transpose(0, 1).to(query.dtype)
    return out


def _check_heads(num_heads: int, kv_heads: int) -> None:
    if kv_heads == 0 or num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv_heads})")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """HF's LlamaRMSNorm: fp32 statistics, cast back to x's dtype before the
    weight. A given residual first becomes ``residual + x``, in place (the
    decoder layer's skip connection, fused in front of the next norm)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotary embedding (rotate-half form) of x [tokens, heads,
    head_dim] by its tokens' cos / sin rows [tokens, head_dim]; a new tensor."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation over the fused gate_up output [tokens, 2 * width]:
    silu(gate) * up, [tokens, width]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP activation over the fused gate_up output [tokens, 2 * width]:
    gelu(gate, tanh approximation) * up, [tokens, width]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def keep_layout(weight: torch.Tensor, torch_float32: bool = True) -> torch.Tensor:
    """A backend's ``pack_linear`` where ``linear`` takes nn.Linear's layout as it is
    (its float32 products are torch's whatever ``torch_float32`` says)."""
    return weight


def no_layer_op(*widths: int) -> None:
    """A backend's ``llama_layer_op`` where no op runs a whole layer:
    the model runs its layers op by op."""
    return None


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     float_out: bool = False, activation: str | None = None) -> torch.Tensor:
    """``activation(x @ weight.T + bias)``: torch's own ops, the ground truth
    of kernels.linear; ``float_out`` returns the product as float32 (rounded
    to x's dtype first here: F.linear has no wider output)."""
    out = F.linear(x, weight, bias)
    return activate(out.float() if float_out else out, activation)


def moe_groups(topk_ids: torch.Tensor, num_experts: int):
    """(expert, token rows, slot of each row) for each expert that has tokens, in
    ascending expert order, as HF's MoE blocks visit them: within an expert the
    rows are ordered slot-major ((slot, token) order, as torch.where over HF's
    [k, T] expert mask gives them).  One host sync (the per-expert counts)."""
    num_tokens = topk_ids.shape[0]
    flat = topk_ids.t().reshape(-1).long()  # index j * T + t
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens, slots = order % num_tokens, order // num_tokens
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, tokens[start:start + count], slots[start:start + count]
        start += count


def fused_moe_reference(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts of a mixture-of-experts layer, tokens grouped per expert:

        out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j]

    hidden [T, H]; w_gate_up [E, 2I, H] (rows: gate, then up); w_down [E, H, I];
    topk_weights [T, k] float32; topk_ids [T, k].  Returns [T, H] in hidden's dtype.
    HF's order of operations (modeling_mixtral.py / modeling_qwen3_moe.py):
    each expert's output times its routing weight, added into the output
    expert by expert in ascending order; the sum is float32 here (HF's is
    hidden's dtype), so float32 matches HF bit for bit."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert, tokens, slots in moe_groups(topk_ids, w_gate_up.shape[0]):
        gated = silu_and_mul_reference(F.linear(hidden[tokens], w_gate_up[expert]))
        expert_out = F.linear(gated, w_down[expert])
        out.index_add_(0, tokens, expert_out * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)
