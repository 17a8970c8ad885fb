"""need(): skip on a user's machine when a tool is missing; fail under CI=true.

A module of its own, not conftest.py, so that helpers in any test folder can
import it (each folder's conftest.py shadows the others' by name).
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI") == "true"


def need(condition: bool, reason: str) -> None:
    """Skip on a user's machine when a tool is missing; fail under CI=true."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)
