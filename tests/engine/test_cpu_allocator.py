"""The glibc malloc tuning the CPU runner applies at start (engine/model/cpu_allocator.py)."""

import ctypes.util
import platform

import pytest
import torch

from engine.model.cpu_allocator import advise_huge_pages, keep_freed_memory


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


def _vm_flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


def test_a_large_tensor_is_advised_onto_huge_pages():
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("madvise(MADV_HUGEPAGE) is Linux's")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    cache = torch.empty(64 << 20, dtype=torch.uint8)
    assert advise_huge_pages(cache) is True
    # The range is advised ("hg"); whether the kernel then finds free 2 MiB
    # pages at fault time depends on the machine's fragmentation, not on us.
    inside = -(-cache.data_ptr() // (2 << 20)) * (2 << 20)
    assert "hg" in _vm_flags_at(inside)
    cache.zero_()
    assert int(cache.sum()) == 0
    assert advise_huge_pages(torch.empty(16)) is False  # no whole 2 MiB page inside
