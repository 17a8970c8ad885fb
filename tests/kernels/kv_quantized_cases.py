"""Inputs and checks of the quantized KV-cache Triton tests
(test_kv_int8_triton.py, test_kv_fp8_triton.py), and the child process that
runs them: the interpreter is switched on before triton is imported, and an
interpreter crash fails the cases instead of killing pytest.

Usage:  python kv_quantized_cases.py DEVICE < jobs.json     (DEVICE: cpu, cuda
or sm90, the last compiling for sm_90 without a GPU) prints one line
``@@KVQUANT {"id": ..., "error": null | str}`` per case.

A case's ``format`` is its cache's: ``int8`` (kernels/kv_quant.py's rows of
codes and an fp16 scale), ``fp8_e4m3`` or ``fp8_e5m2`` (torch.float8_e4m3fn /
float8_e5m2 values).  The attention inputs are kernel_cases.py's (a NaN-filled
float cache, pages shuffled), stored in that format: a NaN row becomes codes 0
with a NaN scale, or fp8 NaN bytes, so a kernel that reads a slot it must not
(padding, null block, the tokens before a sliding window's first tile) still
outputs NaN.
"""

from __future__ import annotations

import sys

RESULT_PREFIX = "@@KVQUANT "
FP8_FORMATS = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# (atol, rtol).  Both sides read the same stored values: float32 outputs differ
# only by the order of fp32 sums; bf16 / fp16 outputs by their own rounding.
TOLERANCE = {"float32": (1e-4, 0.0), "bfloat16": (2e-2, 2e-2), "float16": (2e-2, 2e-2)}
SENTINEL = 0x5A  # each byte of a cache before a store: untouched slots keep it
# (head_dim, num_heads, num_kv_heads, block_size): MHA, MQA and GQA at block sizes 1, 16, 128.
ATTENTION_SHAPES = ((64, 4, 4, 1), (80, 8, 1, 16), (64, 8, 2, 128))


def attention_cases(format_of) -> list[dict]:
    """Decode (the public entry point, and split) and prefill at each of
    ATTENTION_SHAPES in float32, and bf16 at block size 16 (no split); the
    cache format of each is format_of(shape, dtype)."""
    cases = []
    for shape in ATTENTION_SHAPES:
        dtypes = ("float32", "bfloat16") if shape[3] == 16 else ("float32",)
        for dtype in dtypes:
            for kernel, variant in (("decode", "entry"), ("decode", "split"), ("prefill", "")):
                if dtype == "bfloat16" and variant == "split":
                    continue
                fmt = format_of(shape, dtype)
                label = "-".join(filter(None, (kernel, variant, dtype, shape_name(shape))))
                cases.append(dict(kernel=kernel, variant=variant, dtype=dtype, shape=list(shape),
                                  format=fmt, id=f"{fmt}-{label}"))
    return cases


def shape_name(shape) -> str:
    return "-".join(f"{tag}{n}" for tag, n in zip(("d", "h", "kv", "bs"), shape))


def _cost(case: dict) -> float:
    """Rough interpreter time, to balance the two children: prefill does the
    most tiles, and work grows with the block size (the context lengths)."""
    weight = {"prefill": 3.0, "decode": 1.0}.get(case["kernel"], 0.2)
    return weight * max(case["shape"][-1], 16)


def _batches(cases: list, compiled: list, device: str) -> list[tuple[str, list]]:
    """(device, cases) of each child: the interpreted cases in two batches of
    about equal cost (one on a GPU), the sm_90 compiles apart (the interpreter
    is a per-process choice)."""
    ordered = sorted(cases, key=_cost, reverse=True)
    if device == "cuda":
        return [("cuda", ordered), ("sm90", compiled)]
    halves = ([], [])
    for case in ordered:  # greedy: the next largest into the lighter half
        min(halves, key=lambda half: sum(map(_cost, half))).append(case)
    return [("cpu", halves[0]), ("cpu", halves[1]), ("sm90", compiled)]


def check_outcome(results: dict, case: dict, session_seed: int) -> None:
    """Fail with the case's error (and the seeds that reproduce it), if it has one."""
    from kernel_cases import case_seed

    error = results[case["id"]]
    assert error is None, (f"{case['id']} (session seed {session_seed}, case seed "
                           f"{case_seed(session_seed, case['id'])}):\n{error}")


def run_all(cases: list, compiled: list, device: str, session_seed: int) -> dict:
    """{case id: None or error} of every case, the children side by side."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from kernel_cases import case_seed
    from kernel_subprocess import run_cases_script

    def run(batch):
        child_device, batch_cases = batch
        jobs = [{"case": case, "seed": case_seed(session_seed, case["id"])} for case in batch_cases]
        results, proc = run_cases_script(Path(__file__).resolve(), child_device, jobs, RESULT_PREFIX)
        missing = f"the child stopped before this case (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        return {case["id"]: results.get(case["id"], missing) for case in batch_cases}

    batches = _batches(cases, compiled, device)
    with ThreadPoolExecutor(len(batches)) as pool:
        return {case_id: error for part in pool.map(run, batches) for case_id, error in part.items()}


def cache_dtype(fmt: str):
    import torch

    return getattr(torch, FP8_FORMATS.get(fmt, "int8"))


def stored(cache, fmt: str):
    """A float cache as a cache of format ``fmt`` holds it."""
    from kernels.kv_quant import quantize_rows, to_fp8

    return quantize_rows(cache) if fmt == "int8" else to_fp8(cache, cache_dtype(fmt))


def feature_sets(block_size: int) -> list[dict]:
    """Plain attention, a window of a block and a few tokens, a cap that
    saturates tanh, and a longer window with a cap."""
    return [{}, {"sliding_window": block_size + 5}, {"logits_soft_cap": 2.0},
            {"sliding_window": 2 * block_size + 3, "logits_soft_cap": 5.0}]


def _quantized(x: dict, poisoned: dict, fmt: str) -> dict:
    """x with its float caches stored in ``fmt``; k_run / v_run: those of
    `poisoned` (the slots the kernel must not read hold NaN)."""
    return dict(x, k_cache=stored(x["k_cache"], fmt), v_cache=stored(x["v_cache"], fmt),
                k_run=stored(poisoned["k_cache"], fmt), v_run=stored(poisoned["v_cache"], fmt))


def _attention_inputs(kc, case: dict, seed: int, device: str, features: dict, block_n: int) -> dict:
    """float32 inputs as kernel_cases builds them, with caches in the case's
    format and the query in its dtype."""
    import torch

    build = kc.build_prefill_inputs if case["kernel"] == "prefill" else kc.build_decode_inputs
    x = build(dict(case, dtype="float32"), seed, device)
    starts = kc.window_starts(x, features.get("sliding_window"), block_n, case["kernel"] == "prefill")
    x = _quantized(x, kc.poisoned_before(x, starts) if any(starts) else x, case["format"])
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


# Triton's pointer type of each format's cache, and the sm_90 instruction an
# fp8 tile load must convert with (exact, in registers: no de-quantized copy).
POINTER_TYPES = {"int8": "*i8", "fp8_e4m3": "*fp8e4nv", "fp8_e5m2": "*fp8e5"}
FP8_CONVERSIONS = {"fp8_e4m3": "cvt.rn.f16x2.e4m3x2", "fp8_e5m2": "cvt.rn.f16x2.e5m2x2"}


def _run_compile(case: dict) -> str | None:
    """decode (split), prefill (window and cap on) and store, caches of the
    case's format, bf16 queries, compiled for sm_90: the interpreter takes code
    the compiler rejects.  An fp8 attention kernel must convert its tiles with
    the hardware's fp8 -> fp16 instruction."""
    import torch
    import kernel_compile as kcmp

    from kernels import paged_decode as pd
    from kernels import paged_prefill as pp
    from kernels import store_kvcache_triton as sk

    head_dim, group, block_size = case["shape"]
    cache = POINTER_TYPES[case["format"]]
    attention = dict(q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache,
                     table_ptr="*i32", context_lens_ptr="*i32", cu_seqlens_ptr="*i32",
                     part_out_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                     qk_scale="fp32", soft_cap="fp32", stride_block="i64")
    # An int8 cache's rows of head_dim + 2 bytes are 2-aligned (paged_attention.row_align).
    shared = dict(GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, UPCAST=False,
                  WINDOW=True, SOFT_CAP=True, ROW_ALIGN=2 if case["format"] == "int8" else 1)
    decode = dict(shared, SPLIT=True, **pd._decode_config(head_dim, group))
    kernels = {"decode": kcmp._compile(pd._decode_kernel, attention, decode, 90)}
    prefill = pp._prefill_config(head_dim, group, torch.bfloat16)
    stages = prefill.pop("num_stages")
    kernels["prefill"] = kcmp._compile(pp._prefill_kernel, attention, dict(shared, CAUSAL=True, **prefill),
                                       90, num_stages=stages)
    store = dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, slot_ptr="*i64")
    constants = dict(NUM_KV_HEADS=2, HEAD_DIM=head_dim, HEADS_PAD=2, DIM_PAD=1 << (head_dim - 1).bit_length(),
                     UPCAST=False)
    kcmp._compile(sk._store_kvcache_kernel, store, constants, 90)
    wanted = FP8_CONVERSIONS.get(case["format"])
    missing = [name for name, kernel in kernels.items() if wanted and wanted not in kernel.asm["ptx"]]
    return f"{', '.join(missing)}: no {wanted} in the PTX" if missing else None


def run_case(case: dict, seed: int, device: str) -> str | None:
    import kv_store_cases

    if case["kernel"] == "compile":
        return _run_compile(case)
    if case["kernel"] == "store":
        return kv_store_cases.run_store(case, seed, device)
    if case["kernel"] == "roundtrip":
        return kv_store_cases.run_roundtrip(case, seed, device)
    return _run_attention(case, seed, device)


def main(device: str) -> None:
    """Interpreter on the CPU; compiled otherwise (cuda; sm90: compile only)."""
    from kernel_subprocess import serve_cases

    def run(item):
        import torch

        torch.set_num_threads(1)  # children run side by side
        return run_case(item["case"], item["seed"], "cuda" if device == "cuda" else "cpu")

    serve_cases(device, RESULT_PREFIX, run, job_id=lambda item: item["case"]["id"])

if __name__ == "__main__":
    main(sys.argv[1])
