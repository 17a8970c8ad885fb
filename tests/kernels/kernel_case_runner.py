"""Run Triton kernel cases against the reference, in a child process.

Usage (the tests do this):  python kernel_case_runner.py < request.json
with request = {"device": "cpu" | "cuda", "cases": [{"case": {...}, "seed": int}, ...]}.

For each case it prints one line ``@@RESULT {"id": ..., "error": null | str, "seconds": float}``
and flushes, so when the interpreter segfaults mid-batch the parent knows
which case was running (the first one without a result) and can rerun the
rest.  On CPU it sets TRITON_INTERPRET=1 before triton is imported (unless
the batch only compiles kernels for a GPU target, see kernel_compile.py).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

RESULT_PREFIX = "@@RESULT "


def run_case(case: dict, seed: int, device: str) -> str | None:
    """None on success, else what went wrong."""
    import kernel_cases as kc

    if case["kernel"] == "selftest-crash":  # proves a dying child fails only its case
        os.kill(os.getpid(), signal.SIGKILL)
    if case["kernel"] == "selftest-pass":
        return None

    if case["kernel"] == "decode":
        return _run_decode(kc, case, seed, device)
    if case["kernel"] == "prefill":
        return _run_prefill(kc, case, seed, device)
    if case["kernel"] == "store":
        return _run_store(kc, case, seed, device)
    if case["kernel"] == "compile":
        return _run_compile(kc, case)
    return f"unknown kernel {case['kernel']!r}"


def _poisoned(like):
    import torch

    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


def _run_decode(kc, case, seed, device):
    from kernels import paged_decode as pd
    from kernels.reference import paged_decode_attention_reference

    x = kc.build_decode_inputs(case, seed, device)
    args = (x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], x["scale"])
    block_n = pd._decode_config(x["query"].shape[2], 1)["BLOCK_N"]
    for features in _feature_sets(kc, case):
        expected = paged_decode_attention_reference(*args, **features)
        # With a window, the K/V before its first tile are NaN: they must not be read.
        starts = kc.window_starts(x, features.get("sliding_window"), block_n)
        y = kc.poisoned_before(x, starts) if any(starts) else x
        run = (x["query"], y["k_cache"], y["v_cache"]) + args[3:]
        out = _poisoned(x["query"])
        if case["variant"] == "auto":
            pd.paged_decode_attention(*run, out=out, **features)
        else:
            # split: partitions of up to 4 tiles over the table's width, so a long
            # context fills several tiles of each and a short one is spread thinner.
            max_context = x["block_tables"].shape[1] * x["k_cache"].shape[1]
            parts = max(2, -(-max_context // (4 * block_n))) if case["variant"] == "split" else 1
            pd.decode_attention_partitioned(*run, parts, 4 * block_n, out=out, **features)
        error = kc.compare(out, expected, case["dtype"])
        if error is not None:
            return f"{features or 'no features'}: {error}"
    return None


def _feature_sets(kc, case):
    """The features' keyword arguments to run in turn ({}: plain attention);
    a prefill case with "causal": false adds causal=False to each (encoders)."""
    sets = kc.feature_sets(case["features"], case["shape"][3]) if "features" in case else [{}]
    return sets if case.get("causal", True) else [dict(features, causal=False) for features in sets]


def _run_prefill(kc, case, seed, device):
    from kernels import paged_prefill as pp
    from kernels.reference import paged_prefill_attention_reference

    x = kc.build_prefill_inputs(case, seed, device)
    args = (x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["cu_seqlens_q"],
            x["context_lens"], x["scale"])
    block_n = pp._prefill_config(x["query"].shape[2], 1, x["query"].dtype)["BLOCK_N"]
    for features in _feature_sets(kc, case):
        expected = paged_prefill_attention_reference(*args, **features)
        starts = kc.window_starts(x, features.get("sliding_window"), block_n, prefill=True)
        y = kc.poisoned_before(x, starts) if any(starts) else x
        out = _poisoned(x["query"])
        pp.paged_prefill_attention(x["query"], y["k_cache"], y["v_cache"], *args[3:], out=out,
                                   **features)
        error = kc.compare(out, expected, case["dtype"])
        if error is not None:
            return f"{features or 'no features'}: {error}"
    return None


def _run_store(kc, case, seed, device):
    import torch
    from kernels.store_kvcache_triton import store_kvcache

    x = kc.build_store_inputs(case, seed, device)
    store_kvcache(x["key"], x["value"], x["k_cache"], x["v_cache"], x["slot_mapping"])
    slots = x["slot_mapping"].long()
    written = slots[slots >= 0]
    for name, source in (("k_cache", x["key"]), ("v_cache", x["value"])):
        flat = x[name].view(-1, *x[name].shape[2:])
        if not torch.equal(flat[written], source[slots >= 0]):
            return f"{name}: written slots differ from the input"
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
        untouched[written] = False
        if not torch.isnan(flat[untouched]).all():
            return f"{name}: a slot that should be untouched was written (slot -1 not skipped?)"
    return None


def _select_triton_mode(request: dict) -> None:
    """Interpreter on CPU, native on CUDA.

    Triton fixes interpreted-or-compiled when ``@triton.jit`` runs, i.e. at
    the kernels' import, for the whole process; so compile cases, which need
    real jit functions, come in batches of their own (kernel_subprocess.py).
    """
    kinds = {item["case"]["kernel"] for item in request["cases"]}
    if request["device"] == "cpu" and kinds != {"compile"}:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)


def _run_compile(kc, case):
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "compile cases must run in a batch without interpreter cases"
    import kernel_compile

    head_dim, group, _, block_size = case["shape"]
    kernel_compile.compile_all(kc.DTYPES[case["dtype"]], head_dim, group, block_size)
    return None


def main() -> int:
    request = json.load(sys.stdin)
    # A crashing interpreter must not leave core files in the repository.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parents[1])]  # kernel_cases, then the repo root
    import torch

    torch.set_num_threads(1)  # the parent runs several runners side by side
    _select_triton_mode(request)
    for item in request["cases"]:
        case, seed = item["case"], item["seed"]
        started = time.perf_counter()
        try:
            error = run_case(case, seed, request["device"])
        except Exception:  # report, keep going with the next case
            error = traceback.format_exc(limit=6)
        seconds = round(time.perf_counter() - started, 3)
        print(RESULT_PREFIX + json.dumps({"id": case["id"], "error": error, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
