"""Fixtures for the kernel tests.

Environment (read here only):
  PAGEDSERVE_TEST_DEVICE  cpu (default: Triton interpreter) or cuda (native Triton)
  PAGEDSERVE_TEST_SEED    reuse a printed seed to reproduce a failure
  CI=true                 a missing triton fails the Triton tests instead of skipping them

Triton cases run in child processes (kernel_case_runner.py), several cases
per child and one child per CPU core, so an interpreter segfault fails the
case that was running instead of killing pytest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kernel_cases import case_seed, estimated_cost

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
RUNNER = HERE / "kernel_case_runner.py"
RESULT_PREFIX = "@@RESULT "
CHILD_TIMEOUT_S = 900
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
    results: dict = {}
    with ThreadPoolExecutor(workers) as pool:
        for batch_result in pool.map(lambda b: run_batch(b, kernel_test_device), batches):
            results.update(batch_result)
    return results


def balanced_batches(jobs: list, workers: int) -> list:
    """One batch per worker, greedy by estimated cost (largest first into the
    lightest batch), so the children finish at about the same time."""
    batches = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for job in sorted(jobs, key=lambda job: -estimated_cost(job["case"])):
        lightest = loads.index(min(loads))
        batches[lightest].append(job)
        loads[lightest] += estimated_cost(job["case"])
    return [batch for batch in batches if batch]


def run_batch(jobs: list, device: str) -> dict:
    """Run jobs in child processes; a crash blames the case it was running."""
    results: dict = {}
    pending = list(jobs)
    while pending:
        request = json.dumps({"device": device, "cases": pending})
        try:
            proc = subprocess.run([sys.executable, str(RUNNER)], input=request, capture_output=True,
                                  text=True, cwd=REPO_ROOT, timeout=CHILD_TIMEOUT_S)
            stdout, returncode, stderr = proc.stdout, proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            stdout, returncode, stderr = _text(exc.stdout), "timeout", _text(exc.stderr)
        for line in stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                reported = json.loads(line[len(RESULT_PREFIX):])
                results[reported["id"]] = reported["error"]
        pending = [job for job in pending if job["case"]["id"] not in results]
        if pending:
            culprit = pending.pop(0)
            results[culprit["case"]["id"]] = (
                f"runner process died (exit {returncode}) while running this case; "
                f"stderr tail:\n{stderr[-2000:]}")
    return results


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data
