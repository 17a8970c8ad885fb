"""The glibc malloc tuning the CPU runner applies at start (engine/cpu_allocator.py)."""

import ctypes.util
import platform

import pytest
import torch

from engine.cpu_allocator import keep_freed_memory


def test_tuning_applies_on_glibc_and_tensors_still_work():
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("glibc's mallopt exists only on Linux")
    assert keep_freed_memory() is True
    # Big activations come from the heap now; a free/alloc cycle must still
    # hand back correct, independent memory.
    a = torch.arange(8 << 20, dtype=torch.int64)
    total = int(a.sum())
    del a
    b = torch.ones(8 << 20, dtype=torch.float32)
    assert float(b.sum()) == 8 << 20 and total == (8 << 20) * ((8 << 20) - 1) // 2
