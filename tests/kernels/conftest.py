"""Fixtures for the kernel tests.

Environment (read here only):
  PAGEDSERVE_TEST_DEVICE  cpu (default: Triton interpreter) or cuda (native Triton)
  PAGEDSERVE_TEST_SEED    reuse a printed seed to reproduce a failure
  CI=true                 a missing triton, or compiled CPU ops that don't build, fail
                          their tests instead of skipping them

Triton cases run in child processes (kernel_case_runner.py), several cases
per child and one child per CPU core, so an interpreter segfault fails the
case that was running instead of killing pytest.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from kernel_cases import case_seed
from kernels.cpu import ops as cpu_ops
from kernel_subprocess import balanced_batches, run_in_children

TRITON_TEST_NAME = "test_triton_kernel_matches_reference"


@pytest.fixture(scope="session")
def kernel_test_device() -> str:
    device = os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu")
    if device not in ("cpu", "cuda"):
        pytest.fail(f"PAGEDSERVE_TEST_DEVICE must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("PAGEDSERVE_TEST_DEVICE=cuda but torch sees no CUDA device")
    return device


@pytest.fixture(scope="session")
def session_seed() -> int:
    given = os.environ.get("PAGEDSERVE_TEST_SEED")
    return int(given) if given else random.SystemRandom().randrange(2**31)


def require_triton() -> None:
    """Fail (CI=true) or skip when triton cannot be imported."""
    if importlib.util.find_spec("triton") is not None:
        return
    message = "triton is not installed; the Triton kernel tests need it (pip install 'pagedserve[triton]')"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def compiled_cpu_ops():
    """This CPU's build of the compiled ops (kernels/cpu/csrc/)."""
    built = cpu_ops.ops_for(64)
    if built is None:
        message = f"compiled CPU ops unavailable: {cpu_ops.unavailable_reason(64)}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return built


@pytest.fixture
def triton_available() -> None:
    require_triton()


@pytest.fixture(scope="session")
def triton_results(request, kernel_test_device, session_seed) -> dict:
    """{case id: None or error} for every selected Triton case, run in children."""
    require_triton()
    cases = [item.callspec.params["case"] for item in request.session.items
             if getattr(item, "originalname", None) == TRITON_TEST_NAME]
    jobs = [{"case": case, "seed": case_seed(session_seed, case["id"])} for case in cases]
    workers = 1 if kernel_test_device == "cuda" else max(1, len(os.sched_getaffinity(0)))
    batches = balanced_batches(jobs, workers)
    return run_in_children(batches, kernel_test_device)


@pytest.fixture(scope="session")
def builds() -> dict:
    """{isa: op namespace} of every build this CPU runs, compiled or loaded here."""
    loaded = {isa: cpu_ops.load(isa) for isa in cpu_ops.runnable_isas()}
    missing = sorted(isa for isa, ops in loaded.items() if ops is None)
    if missing:
        message = f"the {', '.join(missing)} build(s) are unavailable (see the warning)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    assert all(ops.isa() == isa for isa, ops in loaded.items())
    return loaded
