"""The glibc malloc tuning the CPU runner applies at start (engine/cpu_allocator.py)."""

import ctypes.util
import platform

import pytest
import torch

from engine.cpu_allocator import advise_huge_pages, keep_freed_memory


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


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_huge_pages_back_a_large_tensor_advised_before_first_touch():
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("madvise(MADV_HUGEPAGE) is Linux's")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    before = _anon_huge_kib()
    cache = torch.empty(64 << 20, dtype=torch.uint8)
    assert advise_huge_pages(cache) is True
    cache.zero_()
    assert int(cache.sum()) == 0
    # At least half of the 64 MiB on huge pages (the kernel may fall short when
    # memory is fragmented, never by this much on an idle test machine).
    assert _anon_huge_kib() - before >= 32 << 10
    assert advise_huge_pages(torch.empty(16)) is False  # no whole 2 MiB page inside
