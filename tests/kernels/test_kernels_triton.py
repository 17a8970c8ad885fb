"""Each Triton kernel against the reference, one test per case.

The cases run in child processes (see conftest.triton_results); here each
test only reports its case's outcome, with the seed that reproduces it
(PAGEDSERVE_TEST_SEED=<session seed> pytest tests/kernels -k <case id>).
"""

import pytest

from kernel_cases import all_cases, case_seed


@pytest.mark.parametrize("case", all_cases(), ids=lambda case: case["id"])
def test_triton_kernel_matches_reference(case, triton_results, session_seed, kernel_test_device):
    error = triton_results[case["id"]]
    assert error is None, (
        f"{case['id']} on {kernel_test_device} failed (session seed {session_seed}, "
        f"case seed {case_seed(session_seed, case['id'])}):\n{error}")


def test_a_crashing_child_fails_only_its_case():
    from kernel_subprocess import run_batch

    jobs = [{"case": {"kernel": "selftest-pass", "id": "a"}, "seed": 0},
            {"case": {"kernel": "selftest-crash", "id": "b"}, "seed": 0},
            {"case": {"kernel": "selftest-pass", "id": "c"}, "seed": 0}]
    results = run_batch(jobs, "cpu")
    assert results["a"] is None and results["c"] is None
    assert "runner process died" in results["b"]
