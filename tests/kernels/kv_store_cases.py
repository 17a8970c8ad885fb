"""The store cases of the quantized KV-cache Triton tests (kv_quantized_cases.py
runs them in its child processes): Triton's store into an int8 or fp8 cache
against the bytes the format defines, and the int8 round trip.

int8 is held to the reference's store (kernels/kv_quant.py's codes and fp16
scales); fp8 to torch's own conversion, ``x.float().clamp(-max, max).to(fp8)``
(round to nearest even, saturating), written out here so that the test does
not lean on the reference.
"""

from __future__ import annotations

from kv_quantized_cases import SENTINEL, cache_dtype


def special_rows(head_dim: int):
    """Rows that test the edges of the int8 format (kv_quant.py), [5, head_dim]:
    all zeros; exact ties (scale exactly 1/16, x / s = k + 0.5); a scale
    clamped to the fp16 maximum; one that underflows fp16 to 0; a subnormal one."""
    import torch

    ties = (torch.arange(head_dim) % 254 - 126.5) / 16
    ties[0] = 127 / 16
    ramp = torch.linspace(-1.0, 1.0, head_dim)
    return torch.stack((torch.zeros(head_dim), ties, ramp * 1e7, ramp * 1e-9, ramp * 1e-5))


def fp8_specials(dtype):
    """Values that test the edges of an fp8 format, 1-D float32: every finite
    value (subnormals included), the midpoint of each two neighbours (a tie:
    the even one wins, 0 for the smallest subnormal's half), one fp32 step
    either side of each midpoint, values past the largest (saturate), inf,
    NaN, an fp32 subnormal; all with both signs."""
    import torch

    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique()
    middle = (values[1:] + values[:-1]) / 2
    bits = middle.view(torch.int32)
    beside = torch.cat(((bits - 1).view(torch.float32), (bits + 1).view(torch.float32)))
    top = torch.finfo(dtype).max
    edges = torch.tensor([top * 1.01, 2 * top, 1e30, float("inf"), float("nan"), 1e-40, 0.0])
    every = torch.cat((values, middle, beside, edges))
    return torch.cat((every, -every))


def _special_tokens(fmt: str, kv_heads: int, head_dim: int):
    """[tokens, heads, head_dim] of the format's special values for the first
    tokens' first heads: int8's special_rows() in head 0 (a row's scale is its
    own), fp8's values zero-padded over every head (each converts on its own)."""
    import torch

    if fmt == "int8":
        return special_rows(head_dim)[:, None]
    values = fp8_specials(cache_dtype(fmt))
    row = kv_heads * head_dim
    padded = torch.zeros(-(-values.numel() // row) * row)
    padded[: values.numel()] = values
    return padded.view(-1, kv_heads, head_dim)


def store_inputs(case: dict, seed: int, device: str) -> dict:
    """Random rows (magnitudes 1e-3 .. 1e3; fp8: 1e-7 .. 1e6, past both ends of
    both formats) with the format's special tokens first, as strided views of
    a fused qkv tensor; distinct random slots, some -1 (never the special
    tokens, always the last token); a cache of SENTINEL bytes."""
    import torch

    head_dim, kv_heads, block_size = case["shape"]
    fmt = case["format"]
    gen = torch.Generator().manual_seed(seed)
    special = _special_tokens(fmt, kv_heads, head_dim)
    num_tokens = max(2 * block_size + 3, special.shape[0] + 7)
    num_blocks = 1 + -(-2 * num_tokens // block_size)
    fused = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen)
    low, span = (-3, 6) if fmt == "int8" else (-7, 13)
    fused *= 10.0 ** (span * torch.rand(num_tokens, 3, kv_heads, 1, generator=gen) + low)
    fused[: len(special), 1, : special.shape[1]] = special
    fused[: len(special), 2, : special.shape[1]] = special.flip(0)  # V: in another order
    skip = torch.rand(num_tokens, generator=gen) < 0.25
    skip[: len(special)], skip[-1] = False, True
    free = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    slots = torch.where(skip, -1, free).to(getattr(torch, case["slot_dtype"]))
    fused = fused.to(getattr(torch, case["dtype"]))
    width = head_dim + 2 if fmt == "int8" else head_dim
    cache = torch.full((num_blocks, block_size, kv_heads, width), SENTINEL, dtype=torch.uint8)
    cache = cache.view(cache_dtype(fmt))
    return dict(key=fused[:, 1].to(device), value=fused[:, 2].to(device), slots=slots.to(device),
                k_cache=cache.to(device), v_cache=cache.clone().to(device))


def _expected(x: dict, fmt: str) -> dict:
    """The caches the store must leave, on the CPU: the reference's int8 store,
    or torch's fp8 conversion of each kept row at its slot."""
    import torch

    from kernels.reference import store_kvcache_reference

    cpu = {name: t.cpu().clone() for name, t in x.items()}
    if fmt == "int8":
        store_kvcache_reference(cpu["key"], cpu["value"], cpu["k_cache"], cpu["v_cache"], cpu["slots"])
        return cpu
    dtype = cache_dtype(fmt)
    top = torch.finfo(dtype).max
    keep = cpu["slots"] >= 0
    for name, rows in (("k_cache", cpu["key"]), ("v_cache", cpu["value"])):
        flat = cpu[name].view(torch.uint8).view(-1, *rows.shape[1:])
        flat[cpu["slots"][keep].long()] = rows[keep].float().clamp(-top, top).to(dtype).view(torch.uint8)
    return cpu


def run_store(case: dict, seed: int, device: str) -> str | None:
    """Triton's store against _expected, byte for byte (computed on the CPU:
    that is where torch divides exactly as the int8 format says)."""
    import torch

    from kernels.store_kvcache_triton import store_kvcache

    x = store_inputs(case, seed, device)
    want = _expected(x, case["format"])
    store_kvcache(x["key"], x["value"], x["k_cache"], x["v_cache"], x["slots"])
    written = torch.zeros(want["k_cache"].shape[:2], dtype=torch.bool).view(-1)
    written[want["slots"][want["slots"] >= 0].long()] = True
    for name in ("k_cache", "v_cache"):
        got, expected = x[name].cpu().view(torch.uint8), want[name].view(torch.uint8)
        untouched = got.view(-1, *got.shape[2:])[~written]
        if not bool((untouched == SENTINEL).all()):
            return f"{name}: a slot not in slot_mapping (or marked -1) was written"
        if not torch.equal(got, expected):
            diff = got.view(-1, got.shape[-1]) != expected.view(-1, expected.shape[-1])
            rows = diff.any(-1).nonzero().flatten().tolist()
            return f"{name}: {int(diff.sum())} bytes differ from the expected, (slot, head) rows {rows[:8]}"
    return None


def run_roundtrip(case: dict, seed: int, device: str) -> str | None:
    """|x - c * s| <= s / 2 for rows the Triton store quantized into int8
    (kv_quant.py's bound; the slack covers fp32's rounding of x - c * s)."""
    import torch

    from kernels.kv_quant import dequantize_rows, row_scales
    from kernels.store_kvcache_triton import store_kvcache

    head_dim, kv_heads, block_size = case["shape"]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * block_size, kv_heads, head_dim, generator=gen)
    x *= 10.0 ** (5 * torch.rand(4 * block_size, kv_heads, 1, generator=gen) - 2)
    cache = torch.zeros(4, block_size, kv_heads, head_dim + 2, dtype=torch.int8, device=device)
    slots = torch.arange(4 * block_size, device=device)
    store_kvcache(x.to(device), x.to(device), cache, cache.clone(), slots)
    rows = cache.cpu().view(-1, kv_heads, head_dim + 2)
    error = (x - dequantize_rows(rows)).abs()
    bound = row_scales(rows)[..., None] * (0.5 + 1e-5)
    if bool((error > bound).any()):
        worst = (error / bound).max().item()
        return f"round trip error up to {worst:.4g} x (scale / 2)"
    return None

