"""The element-wise Triton kernels (kernels/elementwise_triton.py) against the
references (kernels/reference.py), on fresh random inputs each session
(bounds: elementwise_cases.py):

* rms_norm at 1 and 5 rows, widths with a partial block (576, 1000), Llama's
  4096 and one past the widest single block (9000: the two-pass loop), x a
  view with a row stride, with and without the residual (updated in place bit
  for bit); rope over q | k of a fused qkv buffer (head_dim 64, 80 and 128,
  decode and prefill rows); silu_and_mul and gelu_tanh_and_mul with partial
  blocks.  float32 under the interpreter (its bf16 arithmetic is broken);
  float32, bf16 and fp16 on a GPU, with the dispatchers' routing.
* Compiled: every kernel goes through the real compiler for sm_90, which
  rejects code the interpreter takes.

The cases run in a child process (elementwise_cases.py): the interpreter on a
CPU (PAGEDSERVE_TEST_DEVICE=cuda: the GPU), and the compiles apart from it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from elementwise_cases import RESULT_PREFIX
from kernel_cases import case_seed
from kernel_subprocess import run_cases_script
from need import need

HERE = Path(__file__).resolve().parent
NORM_SHAPES = ((1, 576), (5, 1000), (5, 4096), (3, 9000))       # (rows, width)
ROPE_SHAPES = ((1, 32, 8, 128), (7, 9, 3, 64), (5, 4, 2, 80))    # (tokens, heads, kv heads, head_dim)
ACT_SHAPES = ((1, 1000), (5, 14336), (3, 576))                   # (rows, width)
COMPILED = [{"id": "sm90-bfloat16"}]


def _cases(device: str) -> list[dict]:
    dtypes = ("float32",) if device == "cpu" else ("float32", "bfloat16", "float16")
    cases = []
    for dtype in dtypes:
        cases += [{"id": f"rms_norm-{dtype}-T{t}-H{h}", "kernel": "rms_norm", "dtype": dtype, "T": t, "H": h}
                  for t, h in NORM_SHAPES]
        cases += [{"id": f"rope-{dtype}-T{t}-h{q}kv{kv}-d{d}", "kernel": "rope", "dtype": dtype, "T": t,
                   "heads": q, "kv_heads": kv, "dim": d} for t, q, kv, d in ROPE_SHAPES]
        cases += [{"id": f"act-{dtype}-T{t}-W{w}", "kernel": "act", "dtype": dtype, "T": t, "W": w}
                  for t, w in ACT_SHAPES]
        if device == "cuda":
            cases.append({"id": f"dispatch-{dtype}", "kernel": "dispatch", "dtype": dtype})
    return cases


def _run(device: str, cases: list[dict], seed: int):
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    jobs = [dict(case, seed=case_seed(seed, case["id"])) for case in cases]
    return run_cases_script(HERE / "elementwise_cases.py", device, jobs, RESULT_PREFIX)


def _outcome(results, proc, case_id: str, seed: int) -> None:
    assert case_id in results, (
        f"the child stopped before {case_id} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    assert results[case_id] is None, f"{case_id} (session seed {seed}):\n{results[case_id]}"


@pytest.fixture(scope="module")
def elementwise_results(kernel_test_device, session_seed):
    return _run(kernel_test_device, _cases(kernel_test_device), session_seed)


@pytest.mark.parametrize("case_id", [case["id"] for case in _cases("cuda")])
def test_triton_elementwise_matches_reference(case_id, kernel_test_device, elementwise_results, session_seed):
    if case_id not in {case["id"] for case in _cases(kernel_test_device)}:
        pytest.skip("bf16 / fp16 and the dispatch run on a GPU only (the interpreter's bf16 arithmetic is "
                    "broken, and the dispatchers send CPU tensors elsewhere)")
    _outcome(*elementwise_results, case_id, session_seed)


@pytest.fixture(scope="module")
def compiled_elementwise_results():
    return _run("sm90", COMPILED, 0)


@pytest.mark.parametrize("case", COMPILED, ids=[case["id"] for case in COMPILED])
def test_triton_elementwise_compiles_for_sm90(case, compiled_elementwise_results):
    _outcome(*compiled_elementwise_results, case["id"], 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cuda", [True, False])
def test_elementwise_routing(dtype, cuda):
    """CUDA bf16 / fp16 tensors take the Triton kernels; float32 and CPU tensors do not."""
    stand_in = SimpleNamespace(is_cuda=cuda, dtype=dtype)
    assert kernels._on_triton(stand_in) == (cuda and dtype != torch.float32)


def test_cpu_elementwise_does_not_import_triton_kernels(monkeypatch):
    """CPU tensors never reach the Triton module (CPU-only machines lack triton)."""

    def no_import(name, *args):
        raise AssertionError(f"imported {name} for CPU tensors")

    monkeypatch.setattr(kernels.importlib, "import_module", no_import)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(2, 64).to(dtype)
        kernels.rms_norm(x, torch.ones(64, dtype=dtype), 1e-6, x.clone())
        kernels.silu_and_mul(x)
        kernels.gelu_tanh_and_mul(x)
        kernels.rope(x.view(2, 1, 64).clone(), torch.ones(2, 64, dtype=dtype), torch.zeros(2, 64, dtype=dtype))
