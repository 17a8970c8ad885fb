"""Inputs and checks of the int8 KV-cache Triton tests (test_kv_int8_triton.py),
and the child process that runs them: the interpreter is switched on before
triton is imported, and an interpreter crash fails the cases instead of
killing pytest.

Usage:  python kv_int8_cases.py DEVICE < cases.json     (DEVICE: cpu, cuda or
sm90, the last compiling for sm_90 without a GPU) prints one line
``@@KVINT8 {"id": ..., "error": null | str}`` per case.

The attention inputs are kernel_cases.py's (a NaN-filled float cache, pages
shuffled), quantized row by row: a NaN row becomes codes 0 with a NaN scale,
so a kernel that reads a slot it must not (padding, null block, the tokens
before a sliding window's first tile) still outputs NaN.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

RESULT_PREFIX = "@@KVINT8 "
# (atol, rtol).  Both sides read the same int8 codes: float32 outputs differ
# only by the order of fp32 sums; bf16 / fp16 outputs by their own rounding.
TOLERANCE = {"float32": (1e-4, 0.0), "bfloat16": (2e-2, 2e-2), "float16": (2e-2, 2e-2)}
SENTINEL = 0x5A  # what an int8 cache holds before a store: untouched slots keep it


def feature_sets(block_size: int) -> list[dict]:
    """Plain attention, a window of a block and a few tokens, a cap that
    saturates tanh, and a longer window with a cap."""
    return [{}, {"sliding_window": block_size + 5}, {"logits_soft_cap": 2.0},
            {"sliding_window": 2 * block_size + 3, "logits_soft_cap": 5.0}]


def _quantized(x: dict, poisoned: dict) -> dict:
    """x with its float caches replaced by int8 ones; k_run / v_run: those of
    `poisoned` (the slots the kernel must not read carry NaN scales)."""
    from kernels.kv_quant import quantize_rows

    return dict(x, k_cache=quantize_rows(x["k_cache"]), v_cache=quantize_rows(x["v_cache"]),
                k_run=quantize_rows(poisoned["k_cache"]), v_run=quantize_rows(poisoned["v_cache"]))


def _attention_inputs(kc, case: dict, seed: int, device: str, features: dict, block_n: int) -> dict:
    """float32 inputs as kernel_cases builds them, with int8 caches and the
    query in the case's dtype."""
    import torch

    build = kc.build_prefill_inputs if case["kernel"] == "prefill" else kc.build_decode_inputs
    x = build(dict(case, dtype="float32"), seed, device)
    starts = kc.window_starts(x, features.get("sliding_window"), block_n, case["kernel"] == "prefill")
    x = _quantized(x, kc.poisoned_before(x, starts) if any(starts) else x)
    x["query"] = x["query"].to(getattr(torch, case["dtype"]))
    return x


def _compare(out, expected, dtype_name: str) -> str | None:
    import torch

    if out.dtype != expected.dtype or out.shape != expected.shape:
        return f"got {tuple(out.shape)} {out.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    a, e = out.float().cpu(), expected.float().cpu()
    if torch.isnan(a).any():
        return f"{int(torch.isnan(a).sum())} NaN elements (a slot read that must not be, or a scale misread)"
    atol, rtol = TOLERANCE[dtype_name]
    if torch.allclose(a, e, atol=atol, rtol=rtol):
        return None
    return f"max abs error {(a - e).abs().max().item():.3g} (atol {atol}, rtol {rtol})"


def _run_decode(kc, case: dict, seed: int, device: str, features: dict) -> str | None:
    from kernels import paged_decode as pd
    from kernels.reference import paged_decode_attention_reference

    block_n = pd._decode_config(case["shape"][0], 1)["BLOCK_N"]
    x = _attention_inputs(kc, case, seed, device, features, block_n)
    common = (x["block_tables"], x["context_lens"], x["scale"])
    expected = paged_decode_attention_reference(x["query"], x["k_cache"], x["v_cache"], *common,
                                                **features)
    if case["variant"] == "split":  # every partition one tile: some wholly before a window
        parts = -(-x["block_tables"].shape[1] * x["k_cache"].shape[1] // block_n)
        out = pd.decode_attention_partitioned(x["query"], x["k_run"], x["v_run"], *common, parts,
                                              block_n, **features)
    else:
        out = pd.paged_decode_attention(x["query"], x["k_run"], x["v_run"], *common, **features)
    return _compare(out, expected, case["dtype"])


def _run_prefill(kc, case: dict, seed: int, device: str, features: dict) -> str | None:
    import torch

    from kernels import paged_prefill as pp
    from kernels.reference import paged_prefill_attention_reference

    block_n = pp._prefill_config(case["shape"][0], 1, getattr(torch, case["dtype"]))["BLOCK_N"]
    x = _attention_inputs(kc, case, seed, device, features, block_n)
    common = (x["block_tables"], x["cu_seqlens_q"], x["context_lens"], x["scale"])
    expected = paged_prefill_attention_reference(x["query"], x["k_cache"], x["v_cache"], *common,
                                                 **features)
    out = pp.paged_prefill_attention(x["query"], x["k_run"], x["v_run"], *common, **features)
    return _compare(out, expected, case["dtype"])


def _run_attention(case: dict, seed: int, device: str) -> str | None:
    import kernel_cases as kc

    run = _run_prefill if case["kernel"] == "prefill" else _run_decode
    for features in feature_sets(case["shape"][3]):
        error = run(kc, case, seed, device, features)
        if error is not None:
            return f"{features or 'no features'}: {error}"
    return None


def special_rows(head_dim: int):
    """Rows that test the edges of the format (kv_quant.py), [5, head_dim]:
    all zeros; exact ties (scale exactly 1/16, x / s = k + 0.5); a scale
    clamped to the fp16 maximum; one that underflows fp16 to 0; a subnormal one."""
    import torch

    ties = (torch.arange(head_dim) % 254 - 126.5) / 16
    ties[0] = 127 / 16
    ramp = torch.linspace(-1.0, 1.0, head_dim)
    return torch.stack((torch.zeros(head_dim), ties, ramp * 1e7, ramp * 1e-9, ramp * 1e-5))


def store_inputs(case: dict, seed: int, device: str) -> dict:
    """Random rows of magnitudes 1e-3 .. 1e3 with special_rows() first, as
    strided views of a fused qkv tensor; distinct random slots, some -1
    (never the special rows, always the last token); an int8 cache of SENTINEL."""
    import torch

    head_dim, kv_heads, block_size = case["shape"]
    gen = torch.Generator().manual_seed(seed)
    num_tokens = max(2 * block_size + 3, 12)
    num_blocks = 1 + -(-2 * num_tokens // block_size)
    fused = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen)
    fused *= 10.0 ** (6 * torch.rand(num_tokens, 3, kv_heads, 1, generator=gen) - 3)
    fused[:5, 1:, 0] = special_rows(head_dim)[:, None]
    skip = torch.rand(num_tokens, generator=gen) < 0.25
    skip[:5], skip[-1] = False, True
    free = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    slots = torch.where(skip, -1, free).to(getattr(torch, case["slot_dtype"]))
    fused = fused.to(getattr(torch, case["dtype"]))
    shape = (num_blocks, block_size, kv_heads, head_dim + 2)
    cache = torch.full(shape, SENTINEL, dtype=torch.int8)
    return dict(key=fused[:, 1].to(device), value=fused[:, 2].to(device), slots=slots.to(device),
                k_cache=cache.to(device), v_cache=cache.clone().to(device))


def _run_store(case: dict, seed: int, device: str) -> str | None:
    """Triton's int8 store against the reference's, byte for byte (run on the
    CPU: that is where torch divides exactly as the format says)."""
    import torch

    from kernels.reference import store_kvcache_reference
    from kernels.store_kvcache_triton import store_kvcache

    x = store_inputs(case, seed, device)
    cpu = {name: t.cpu().clone() for name, t in x.items()}
    store_kvcache(x["key"], x["value"], x["k_cache"], x["v_cache"], x["slots"])
    store_kvcache_reference(cpu["key"], cpu["value"], cpu["k_cache"], cpu["v_cache"], cpu["slots"])
    written = torch.zeros(cpu["k_cache"].shape[:2], dtype=torch.bool).view(-1)
    written[cpu["slots"][cpu["slots"] >= 0].long()] = True
    for name in ("k_cache", "v_cache"):
        got, want = x[name].cpu(), cpu[name]
        untouched = got.view(-1, *got.shape[2:])[~written]
        if not bool((untouched == SENTINEL).all()):
            return f"{name}: a slot not in slot_mapping (or marked -1) was written"
        if not torch.equal(got, want):
            diff = got.view(-1, got.shape[-1]) != want.view(-1, want.shape[-1])
            rows = diff.any(-1).nonzero().flatten().tolist()
            return f"{name}: {int(diff.sum())} bytes differ from the reference, (slot, head) rows {rows[:8]}"
    return None


def _run_roundtrip(case: dict, seed: int, device: str) -> str | None:
    """|x - c * s| <= s / 2 for rows the Triton store quantized (kv_quant.py's
    bound; the slack covers fp32's rounding of x - c * s)."""
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


def _run_compile(case: dict) -> str | None:
    """decode (split), prefill (window and cap on) and store, int8 caches, bf16
    queries, compiled for sm_90: the interpreter takes code the compiler rejects."""
    import torch
    import kernel_compile as kcmp

    from kernels import paged_decode as pd
    from kernels import paged_prefill as pp
    from kernels import store_kvcache_triton as sk

    head_dim, group, block_size = case["shape"]
    attention = dict(q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr="*i8", v_cache_ptr="*i8",
                     table_ptr="*i32", context_lens_ptr="*i32", cu_seqlens_ptr="*i32",
                     part_out_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                     qk_scale="fp32", soft_cap="fp32", stride_block="i64")
    shared = dict(GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, UPCAST=False,
                  WINDOW=True, SOFT_CAP=True)
    decode = dict(shared, SPLIT=True, **pd._decode_config(head_dim, group))
    kcmp._compile(pd._decode_kernel, attention, decode, 90)
    prefill = pp._prefill_config(head_dim, group, torch.bfloat16)
    stages = prefill.pop("num_stages")
    kcmp._compile(pp._prefill_kernel, attention, dict(shared, **prefill), 90, num_stages=stages)
    store = dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*i8", v_cache_ptr="*i8", slot_ptr="*i64")
    constants = dict(NUM_KV_HEADS=2, HEAD_DIM=head_dim, HEADS_PAD=2, DIM_PAD=1 << (head_dim - 1).bit_length(),
                     UPCAST=False)
    kcmp._compile(sk._store_kvcache_kernel, store, constants, 90)
    return None


def run_case(case: dict, seed: int, device: str) -> str | None:
    if case["kernel"] == "compile":
        return _run_compile(case)
    if case["kernel"] == "store":
        return _run_store(case, seed, device)
    if case["kernel"] == "roundtrip":
        return _run_roundtrip(case, seed, device)
    return _run_attention(case, seed, device)


def main(device: str) -> None:
    """Interpreter on the CPU; compiled otherwise (cuda; sm90: compile only)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import torch

    torch.set_num_threads(1)  # children run side by side
    for item in json.load(sys.stdin):
        try:
            error = run_case(item["case"], item["seed"], "cuda" if device == "cuda" else "cpu")
        except Exception:  # noqa: BLE001 - reported as the case's failure
            error = traceback.format_exc(limit=8)
        print(RESULT_PREFIX + json.dumps({"id": item["case"]["id"], "error": error}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
