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
