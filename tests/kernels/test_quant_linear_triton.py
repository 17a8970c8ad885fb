"""The Triton quantized-weight kernels (kernels/quant_triton.py) against
gguf's numbers and the reference product (kernels/quant.py), every type,
on fresh random blocks each session (extreme scales, all-zero blocks):

* Exact: the de-quantized weights equal `gguf.quants.dequantize` bit for bit.
* Bounded: the product at 1, 3, 16 and 128 rows (70 outputs: a partial
  tile; several blocks of inputs) is within float32's rounding bound of the
  reference's (quant_cases.py says which); a mixed-type blob with a bias,
  float16 activations, 3-D and strided x.
* Compiled: each type's kernels go through the real compiler for sm_90,
  which rejects code the interpreter takes.

The cases run in child processes (quant_cases.py): the interpreter on a CPU
(PAGEDSERVE_TEST_DEVICE=cuda: the GPU), and the compiles apart from it.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from kernels import get_backend
from kernels.quant import QUANT_TYPES
from need import need
from kernel_subprocess import run_cases_script
from quant_cases import RESULT_PREFIX

HERE = Path(__file__).resolve().parent
TYPES = tuple(QUANT_TYPES)
CASES = [{"id": name, "kind": "type", "type": name} for name in TYPES]
CASES.append({"id": "mixed-parts", "kind": "mixed"})


def _run_children(device: str, cases: list[dict], seed: int) -> tuple[dict, subprocess.CompletedProcess]:
    """{case id: None or error} of cases run by quant_cases.py on `device`."""
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    jobs = [dict(case, seed=seed + index) for index, case in enumerate(cases)]
    return run_cases_script(HERE / "quant_cases.py", device, jobs, RESULT_PREFIX)


def _outcome(results, proc, case_id: str, seed: int) -> None:
    assert case_id in results, (
        f"the child stopped before {case_id} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    assert results[case_id] is None, f"{case_id} (session seed {seed}):\n{results[case_id]}"


@pytest.fixture(scope="module")
def triton_quant_results(kernel_test_device, session_seed):
    return _run_children(kernel_test_device, CASES, session_seed)


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_triton_quant_matches_gguf_and_reference(case, triton_quant_results, session_seed):
    _outcome(*triton_quant_results, case["id"], session_seed)


# Two types cover the compiler's concerns: a legacy block's bit layout, and
# the K-quants' scale unpacking with 16-input groups (Q6_K, the slowest to compile).
COMPILED = [{"id": f"sm90-{name}", "type": name} for name in ("Q5_1", "Q6_K")]


@pytest.fixture(scope="module")
def compiled_quant_results():
    return _run_children("sm90", COMPILED, 0)


@pytest.mark.parametrize("case", COMPILED, ids=[case["id"] for case in COMPILED])
def test_triton_quant_compiles_for_sm90(case, compiled_quant_results):
    _outcome(*compiled_quant_results, case["id"], 0)


def test_triton_backend_takes_the_quant_kernels(triton_available):
    from kernels import quant_triton

    backend = get_backend("triton")
    assert backend.quant_linear is quant_triton.quant_linear
    assert backend.quant_dequantize is quant_triton.quant_dequantize
