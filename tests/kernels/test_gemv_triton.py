"""The decode GEMV (kernels/gemv_triton.py) against the exact product, on
fresh random inputs each session:

* Bounded: every candidate tiling at 1, 2, 5 and 8 rows (one row: the
  element-wise path; more: tl.dot over 16 padded rows), widths with a
  partial block of outputs and of inputs, split-K (a short last slice), a
  bias, float32 output, and x a column slice of a wider buffer; within twice
  fp32's summation bound (gemv_cases.py). float32 under the interpreter (its
  bf16 arithmetic is broken); bf16 and fp16 too on a GPU.
* Tuner (GPU only: it times with CUDA events): one choice per row bucket and
  shape, its products within the bound, nine rows cuBLAS's bit for bit.
* Compiled: both kernels go through the real compiler for sm_90, which
  rejects code the interpreter takes.
* The backend: a runner's auto / triton backend on a CUDA device takes its
  linear from the tuner; without a device, or on the CPU, it does not.
* bench/gpu/gpu_gemv.py's smoke run (the GPU benchmark's every path, tiny).

The cases run in a child process (gemv_cases.py): the interpreter on a CPU
(PAGEDSERVE_TEST_DEVICE=cuda: the GPU), the compiles apart from it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gemv_cases import RESULT_PREFIX
from kernel_cases import case_seed
from kernel_subprocess import child_env, run_cases_script
from kernels import get_backend, linear
from need import need

HERE = Path(__file__).resolve().parent
# (M, N, K, bias, float_out, strided)
SHAPES = ((1, 50, 200, False, False, False), (1, 130, 1000, True, True, True),
          (2, 70, 520, True, False, False), (5, 33, 300, False, True, True),
          (8, 130, 1000, True, False, False))
COMPILED = [{"id": f"sm90-{dtype}-{'partial' if partial else 'out'}-{'f32' if float_out else 'x'}",
             "dtype": dtype, "partial": partial, "float_out": float_out}
            for dtype, partial, float_out in (("bfloat16", False, False), ("bfloat16", True, False),
                                              ("bfloat16", False, True), ("float16", False, False))]


def _cases(device: str) -> list[dict]:
    dtypes = ("float32",) if device == "cpu" else ("float32", "bfloat16", "float16")
    cases = [{"id": f"{dtype}-M{m}-N{n}-K{k}{'-bias' if bias else ''}{'-f32out' if f32 else ''}"
                    f"{'-strided' if strided else ''}",
              "dtype": dtype, "M": m, "N": n, "K": k, "bias": bias, "float_out": f32, "strided": strided}
             for dtype in dtypes for m, n, k, bias, f32, strided in SHAPES]
    tuner = [{"id": f"tuner-{dtype}", "tuner": True, "dtype": dtype, "M": 9, "N": 300, "K": 1024,
              "bias": True, "float_out": False} for dtype in ("bfloat16", "float16")]
    return cases + (tuner if device == "cuda" else [])


def _run(device: str, cases: list[dict], seed: int):
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    jobs = [dict(case, seed=case_seed(seed, case["id"])) for case in cases]
    return run_cases_script(HERE / "gemv_cases.py", device, jobs, RESULT_PREFIX)


def _outcome(results, proc, case_id: str, seed: int) -> None:
    assert case_id in results, (
        f"the child stopped before {case_id} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    assert results[case_id] is None, f"{case_id} (session seed {seed}):\n{results[case_id]}"


@pytest.fixture(scope="module")
def gemv_results(kernel_test_device, session_seed):
    return _run(kernel_test_device, _cases(kernel_test_device), session_seed)


@pytest.mark.parametrize("case_id", [case["id"] for case in _cases("cuda")])
def test_triton_gemv_matches_exact_product(case_id, kernel_test_device, gemv_results, session_seed):
    if case_id not in {case["id"] for case in _cases(kernel_test_device)}:
        pytest.skip("bf16 / fp16 and the tuner run on a GPU only (the interpreter's bf16 is broken)")
    _outcome(*gemv_results, case_id, session_seed)


@pytest.fixture(scope="module")
def compiled_gemv_results():
    return _run("sm90", COMPILED, 0)


@pytest.mark.parametrize("case", COMPILED, ids=[case["id"] for case in COMPILED])
def test_triton_gemv_compiles_for_sm90(case, compiled_gemv_results):
    _outcome(*compiled_gemv_results, case["id"], 0)


def test_cuda_backends_take_their_linear_from_a_tuner(triton_available):
    from kernels.gemv_triton import DecodeGemv

    for name in ("auto", "triton"):
        cuda = get_backend(name, torch.device("cuda"))
        assert isinstance(cuda.linear.__self__, DecodeGemv)
        assert cuda.linear.__self__ is not get_backend(name, "cuda").linear.__self__  # one each
        assert get_backend(name).linear is not cuda.linear
    assert get_backend("auto", "cpu").linear is linear
    assert get_backend("torch", "cuda").linear is get_backend("torch").linear


def test_gemv_benchmark_smoke_run(tmp_path, triton_available):
    """bench/gpu/gpu_gemv.py's CPU smoke run: every shape and row count through
    the kernel under the interpreter, each product checked; a JSON row for each."""
    out = tmp_path / "gemv.json"
    env = dict(child_env(), TRITON_INTERPRET="1")  # a package carried in on PYTHONPATH stays
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.gpu_gemv", "--device", "cpu", "--small",
                           "--output", str(out)], cwd=HERE.parents[1], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12 and all(row["ok"] for row in rows)
