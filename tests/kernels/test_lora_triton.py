"""The Triton multi-LoRA kernels (kernels/lora_triton.py) against the
references (kernels/lora.py), on fresh random inputs each session:

* Bounded: shrink and expand at 1, 5 and 64 rows (ids in runs, -1 among
  them), ranks 4 to 192 (blocks of 64 and a partial one), widths with a
  partial block, and expand with a fused projection's slices (q | k | v,
  gate | up: compact B, a rank block of h per slice), within twice fp32's
  summation bound of the reference (lora_cases.py); expand leaves the rows
  with id -1 bit for bit. float32
  under the interpreter (its bf16 arithmetic is broken); bf16 too on a GPU.
* Compiled: both kernels go through the real compiler for sm_90, which
  rejects code the interpreter takes.

The cases run in a child process (lora_cases.py): the interpreter on a CPU
(PAGEDSERVE_TEST_DEVICE=cuda: the GPU), and the compiles apart from it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kernel_cases import case_seed
from kernel_subprocess import run_cases_script
from kernels import get_backend
from lora_cases import RESULT_PREFIX
from need import need

HERE = Path(__file__).resolve().parent
# (rows, rank, width, out): out None = width.
SHAPES = ((1, 4, 64, None), (5, 48, 100, 70), (64, 16, 576, None), (3, 192, 70, 300))
# (rows, rank per slice, width, slices): SmolLM2's qkv_proj (q 576 rows: a
# partial block; k, v 192 each); gate | up halves of a partial block each,
# rank 80 (a block of 64 and a partial one).
SLICED = ((5, 16, 64, (0, 576, 768, 960)), (64, 16, 100, (0, 576, 768, 960)), (3, 80, 48, (0, 70, 140)))
COMPILED = [{"id": f"sm90-{dtype}-{ids}", "dtype": dtype, "ids": ids}
            for dtype, ids in (("bfloat16", "int32"), ("float32", "int64"))]


def _cases(device: str) -> list[dict]:
    dtypes = ("float32",) if device == "cpu" else ("float32", "bfloat16")
    plain = [{"id": f"{dtype}-T{rows}-R{rank}-w{width}", "dtype": dtype, "T": rows, "R": rank,
              "width": width, "out": out}
             for dtype in dtypes for rows, rank, width, out in SHAPES]
    sliced = [{"id": f"{dtype}-T{rows}-R{rank}-w{width}-slices{len(bounds) - 1}x{bounds[-1]}", "dtype": dtype,
               "T": rows, "R": rank, "width": width, "out": bounds[-1], "slices": list(bounds)}
              for dtype in dtypes for rows, rank, width, bounds in SLICED]
    return plain + sliced


def _run(device: str, cases: list[dict], seed: int):
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    jobs = [dict(case, seed=case_seed(seed, case["id"])) for case in cases]
    return run_cases_script(HERE / "lora_cases.py", device, jobs, RESULT_PREFIX)


def _outcome(results, proc, case_id: str, seed: int) -> None:
    assert case_id in results, (
        f"the child stopped before {case_id} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    assert results[case_id] is None, f"{case_id} (session seed {seed}):\n{results[case_id]}"


@pytest.fixture(scope="module")
def lora_results(kernel_test_device, session_seed):
    return _run(kernel_test_device, _cases(kernel_test_device), session_seed)


@pytest.mark.parametrize("case_id", [case["id"] for case in _cases("cuda")])
def test_triton_lora_matches_reference(case_id, kernel_test_device, lora_results, session_seed):
    if case_id not in {case["id"] for case in _cases(kernel_test_device)}:
        pytest.skip("bf16 runs on a GPU only (the interpreter's bf16 arithmetic is broken)")
    _outcome(*lora_results, case_id, session_seed)


@pytest.fixture(scope="module")
def compiled_lora_results():
    return _run("sm90", COMPILED, 0)


@pytest.mark.parametrize("case", COMPILED, ids=[case["id"] for case in COMPILED])
def test_triton_lora_compiles_for_sm90(case, compiled_lora_results):
    _outcome(*compiled_lora_results, case["id"], 0)


def test_triton_backend_takes_the_lora_kernels(triton_available):
    from kernels import lora_triton

    backend = get_backend("triton")
    assert backend.lora_shrink is lora_triton.lora_shrink
    assert backend.lora_expand is lora_triton.lora_expand
