"""The cases of bench/gpu/gpu_kernels.py, one generator per kernel family.

Each generator yields (label, thunk) pairs; a thunk builds what only its row
needs, times the Triton kernel, and checks the kernel's result against the
reference on the same inputs (all of them, or a sample where the reference
is slow), so no speed is reported for a wrong answer. Inputs shared by
several rows (a bf16 weight, a KV cache) are made once by the generator,
between yields: the runner can stop calling thunks (its time budget) and
still list what it skipped.

Bytes are what the kernel has to move at least, each byte once: a
memory-bound kernel's time is bounded below by them over the copy bandwidth.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bench.kernels.kernel_rows import Shape, sequential_cache
from bench.kernels.kernel_timing import time_or_none
from kernels.quant import QUANT_TYPES, _scale_fields, dequantize_reference, pack_quant_weight

# (rtol, atol) of a result in this dtype against the float32 reference: one
# rounding of the output (bf16 keeps 8 bits), and the order of fp32 sums.
TOLERANCE = {torch.bfloat16: (2.0 ** -7, 1e-3), torch.float16: (2.0 ** -10, 1e-3),
             torch.float32: (1e-4, 1e-5)}
# Attention reads K and V rounded to the query's dtype (and P too): the
# kernel tests' tolerance (tests/kernels/kv_quantized_cases.py).
ATTENTION_TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-2, 2e-2),
                       torch.float32: (1e-4, 1e-4)}
# int8_aN: the int8 rows in a cache whose rows start a multiple of N bytes apart
# (a padded view, the same values): what the alignment of the rows' loads is worth.
CACHE_FORMATS = ("float", "int8", "int8_a4", "int8_a8", "int8_a16", "fp8_e4m3")


def compare(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> dict:
    """max_abs_err and ok (|got - ref| <= atol + rtol |ref| everywhere; a NaN fails)."""
    got, ref = got.float().cpu(), ref.float().cpu()
    err = (got - ref).abs()
    within = err <= atol + rtol * ref.abs()
    return {"max_abs_err": float(err.max()) if err.numel() else 0.0, "ok": bool(within.all())}


def make_row(kernel: str, case: str, ms: float, nbytes: int, check: dict, **extra) -> dict:
    return {"kernel": kernel, "case": case, "ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6,
            **check, **extra}


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------
# GGUF de-quantizing GEMM (kernels/quant_triton.py)
# ---------------------------------------------------------------------------

def quant_weight(type_name: str, n: int, k: int, device: torch.device) -> torch.Tensor:
    """A CPU blob of n x k random valid blocks: random bytes (made on the device:
    the gguf quantizer would take minutes at 14336 x 4096 and has no Q6_K),
    every fp16 scale field in [1e-3, 4e-3] so the outputs stay well inside
    bf16's range (kernels/quant.py's random_quant_blocks also draws extremes)."""
    kind = QUANT_TYPES[type_name]
    data = torch.randint(0, 256, (n, kind.row_bytes(k)), dtype=torch.uint8, device=device)
    blocks = data.view(-1, kind.block_bytes)
    for field in _scale_fields(type_name):
        scales = torch.empty(blocks.shape[0], device=device).uniform_(1e-3, 4e-3).half()
        blocks[:, field:field + 2] = scales.view(torch.uint8).view(-1, 2)
    return pack_quant_weight([(type_name, data.cpu())], k)


def kernel_launch(x: torch.Tensor, blob: torch.Tensor):
    """(launch, out): quant_linear's one launch for a one-part blob, its header
    read once. quant_linear reads the header from the blob on every call, a
    device-to-host copy and a sync on a GPU, which at M = 1 can cost more than
    the kernel: the entry point's time is the engine's, this one the kernel's."""
    import triton

    from kernels import quant_triton as qt
    from kernels.quant import quant_parts

    ((type_name, data),) = quant_parts(blob)
    m, k, n = x.shape[0], x.shape[1], data.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = {"BLOCK_M": 16 if m <= 16 else 32 if m <= 64 else 64, **qt._tiles(k)}
    grid = (triton.cdiv(m, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    constants = dict(qt._type_constants(type_name), **tiles)

    def launch():
        qt._quant_linear_kernel[grid](x, data, out, out, m, n, k, data.shape[1], 0, x.stride(0),
                                      out.stride(0), HAS_BIAS=False, **constants)
    return launch, out


def quant_row(type_name: str, x: torch.Tensor, blobs: dict, n: int, baseline: tuple,
              timer, check_rows: int) -> dict:
    """quant_linear at x's rows, through its entry point and as the bare launch;
    checked on `check_rows` outputs spread over N against gguf's de-quantized
    weights (and quant_dequantize against their bits)."""
    from kernels import quant_triton as qt

    k = x.shape[1]
    if "cpu" not in blobs:  # the first M of this type and shape makes the blob
        blobs["cpu"] = quant_weight(type_name, n, k, x.device)
        blobs["device"] = blobs["cpu"].to(x.device)
    blob = blobs["device"]
    out = qt.quant_linear(x, blob)
    entry_ms = timer(lambda: qt.quant_linear(x, blob))
    launch, launched = kernel_launch(x, blob)
    launch()
    ms = timer(launch)
    sample = torch.linspace(0, n - 1, min(check_rows, n)).round().long()
    weight = dequantize_reference(blobs["cpu"], sample)
    ref = x.float().cpu() @ weight.t()
    rtol, atol = TOLERANCE[x.dtype]
    check = compare(out[:, sample.to(x.device)], ref, rtol, atol * float(ref.abs().max()))
    bits = qt.quant_dequantize(blob, sample.to(x.device)).cpu()
    check["dequantize_exact"] = bool(bits.view(torch.int32).equal(weight.view(torch.int32)))
    check["launch_matches_entry"] = bool(launched.equal(out))
    check["ok"] = check["ok"] and check["dequantize_exact"] and check["launch_matches_entry"]
    base_ms, base_bytes = baseline
    return make_row("quant_linear", f"{type_name} {k}->{n}", ms, _nbytes(blob, x, out), check,
                    rows=x.shape[0], entry_ms=entry_ms,
                    baseline="F.linear " + str(x.dtype).replace("torch.", ""),
                    baseline_ms=base_ms,
                    baseline_gbps=None if base_ms is None else base_bytes / base_ms / 1e6)


def quant_cases(sizes, device: torch.device, dtype: torch.dtype, timer):
    """Each type at [intermediate, hidden] and [hidden, intermediate], M rows each;
    F.linear over a dense weight of the shape, timed once per shape and M."""
    for n, k in ((sizes.intermediate, sizes.hidden), (sizes.hidden, sizes.intermediate)):
        dense = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
        xs = {m: torch.randn(m, k, device=device).to(dtype) for m in sizes.quant_rows}
        baselines = {m: (time_or_none(timer, lambda x=x: F.linear(x, dense)),
                         _nbytes(dense, x) + m * n * dense.element_size()) for m, x in xs.items()}
        for type_name in sizes.quant_types:
            blobs: dict = {}
            for m in sizes.quant_rows:
                yield (f"quant_linear {type_name} {k}->{n} M={m}",
                       functools.partial(quant_row, type_name, xs[m], blobs, n, baselines[m], timer,
                                         sizes.check_rows))
        del dense, xs


# ---------------------------------------------------------------------------
# Multi-LoRA shrink and expand (kernels/lora_triton.py)
# ---------------------------------------------------------------------------

def _adapters_read(ids: torch.Tensor) -> int:
    """Distinct adapters the rows use: each one's weights come from memory once
    (the other rows of an id re-read them from L2)."""
    return int(torch.unique(ids[ids >= 0]).numel())


def shrink_row(x: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, timer) -> dict:
    from kernels import lora_triton
    from kernels.lora import lora_shrink_reference

    scale = 0.5
    h = lora_triton.lora_shrink(x, a, ids, scale)
    ms = timer(lambda: lora_triton.lora_shrink(x, a, ids, scale))
    ref = lora_shrink_reference(x, a, ids, scale)
    check = compare(h, ref, 1e-4, 1e-4 * float(ref.abs().max()))  # both fp32 sums
    rank, width = a.shape[1], a.shape[2]
    nbytes = _adapters_read(ids) * rank * width * a.element_size() + _nbytes(x, h)
    return make_row("lora_shrink", f"r{rank} {width}->r", ms, nbytes, check, rows=x.shape[0],
                    adapters=_adapters_read(ids))


def expand_row(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, timer) -> dict:
    """y += B[ids] h in place: checked on a copy of y before the timing (which
    keeps adding to y)."""
    from kernels import lora_triton
    from kernels.lora import lora_expand_reference, lora_shrink_reference

    h = lora_shrink_reference(x, a, ids, 0.5)
    y0 = torch.randn(x.shape[0], b.shape[1], device=x.device).to(b.dtype)
    got = lora_triton.lora_expand(y0.clone(), h, b, ids)
    ref = lora_expand_reference(y0.clone(), h, b, ids)
    rtol, atol = TOLERANCE[b.dtype]
    check = compare(got, ref, rtol, atol * float(ref.abs().max()))
    y = y0.clone()
    ms = timer(lambda: lora_triton.lora_expand(y, h, b, ids))
    rank, width = b.shape[2], b.shape[1]
    nbytes = _adapters_read(ids) * rank * width * b.element_size() + _nbytes(h) + 2 * _nbytes(y)
    return make_row("lora_expand", f"r{rank} r->{width}", ms, nbytes, check, rows=x.shape[0],
                    adapters=_adapters_read(ids))


def lora_cases(sizes, device: torch.device, dtype: torch.dtype, timer):
    """Shrink from hidden (both projections' input), expand to hidden and to
    intermediate; rows take the adapters in turn (t % adapters)."""
    hidden = sizes.hidden
    for rank in sizes.lora_ranks:
        a = (torch.randn(sizes.lora_adapters, rank, hidden, device=device) * hidden ** -0.5).to(dtype)
        for out_features in (hidden, sizes.intermediate):
            b = (torch.randn(sizes.lora_adapters, out_features, rank, device=device) * rank ** -0.5).to(dtype)
            for rows in sizes.lora_rows:
                ids = (torch.arange(rows, device=device) % sizes.lora_adapters).to(torch.int32)
                x = torch.randn(rows, hidden, device=device).to(dtype)
                if out_features == hidden:
                    yield (f"lora_shrink r{rank} {hidden}->r T={rows}",
                           functools.partial(shrink_row, x, a, ids, timer))
                yield (f"lora_expand r{rank} r->{out_features} T={rows}",
                       functools.partial(expand_row, x, a, b, ids, timer))


# ---------------------------------------------------------------------------
# Paged decode over float, int8 and fp8 caches (kernels/paged_decode.py)
# ---------------------------------------------------------------------------

def stored_cache(cache: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float cache as the format stores it (kernels/kv_quant.py)."""
    from kernels.kv_quant import quantize_rows, to_fp8

    if fmt == "int8":
        return quantize_rows(cache)
    if fmt.startswith("int8_a"):
        rows, align = quantize_rows(cache), int(fmt.removeprefix("int8_a"))
        width = rows.shape[-1]
        padded = rows.new_zeros(*rows.shape[:-1], -(-width // align) * align)
        padded[..., :width] = rows
        return padded[..., :width]
    if fmt == "fp8_e4m3":
        return to_fp8(cache, torch.float8_e4m3fn)
    return cache


def decode_row(fmt: str, query, k_float, v_float, tables, lens, timer, timings: dict,
               check_seqs: int) -> dict:
    """Decode through the triton backend over the stored cache; checked on the
    first `check_seqs` sequences against the reference over the same cache."""
    from kernels import get_backend, paged_decode
    from kernels.reference import paged_decode_attention_reference

    k_cache, v_cache = stored_cache(k_float, fmt), stored_cache(v_float, fmt)
    decode = get_backend("triton").paged_decode_attention
    scale = query.shape[-1] ** -0.5
    out = decode(query, k_cache, v_cache, tables, lens, scale)
    ms = timer(lambda: decode(query, k_cache, v_cache, tables, lens, scale))
    n = min(check_seqs, query.shape[0])
    ref = paged_decode_attention_reference(query[:n], k_cache, v_cache, tables[:n], lens[:n], scale)
    check = compare(out[:n], ref, *ATTENTION_TOLERANCE[query.dtype])
    batch, context = query.shape[0], int(lens[0])
    row_bytes = k_cache.shape[-1] * k_cache.element_size()  # an int8 row's scale included
    nbytes = 2 * batch * context * k_cache.shape[2] * row_bytes + 2 * _nbytes(query)
    timings[fmt] = ms
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 1
    parts = paged_decode.choose_decode_partitions(batch, k_cache.shape[2], tables.shape[1] * k_cache.shape[1],
                                                  sms)
    name = str(k_cache.dtype).replace("torch.", "") + (fmt[4:] if fmt.startswith("int8_a") else "")
    return make_row("decode", f"{name} {batch}x{context}", ms, nbytes, check, rows=batch,
                    context=context, cache_dtype=name, partitions=parts,
                    vs_float_cache=timings["float"] / ms if "float" in timings else None)


def decode_cases(sizes, device: torch.device, dtype: torch.dtype, timer):
    """Each (batch, context): one float cache (pages in sequence order,
    bench/kernels/kernel_rows.py), read as itself, as int8 and as fp8."""
    shape = Shape(sizes.heads, sizes.kv_heads, sizes.head_dim, sizes.block, dtype, device)
    for batch, context in sizes.decode:
        k_float, v_float, tables = sequential_cache(shape, batch, context)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        query = torch.randn(batch, shape.num_heads, shape.head_dim, device=device).to(dtype)
        timings: dict = {}
        for fmt in CACHE_FORMATS:
            yield (f"decode {fmt} {batch}x{context}",
                   functools.partial(decode_row, fmt, query, k_float, v_float, tables, lens, timer,
                                     timings, sizes.check_seqs))
        del k_float, v_float, tables, query
        if device.type == "cuda":
            torch.cuda.empty_cache()


FAMILIES = {"quant": quant_cases, "lora": lora_cases, "decode": decode_cases}
