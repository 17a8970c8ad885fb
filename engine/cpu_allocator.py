"""Keep freed activation memory in the heap on CPU, so it is not faulted in again.

glibc serves every allocation above its mmap threshold (128 KiB, rising
dynamically up to 32 MiB) with a fresh mmap and unmaps it on free. A prefill
step allocates and frees activations of tens of MiB dozens of times per
layer, so each one pays a page fault per 4 KiB touched: a bf16 -> fp32 copy
of [8192, 576] ran 1.2 ms with the default and 0.6 ms once the memory came
from the heap. vLLM's CPU backend asks users to preload tcmalloc for the same
reason; this does the glibc equivalent in-process, once, at engine start:

    M_MMAP_THRESHOLD = 32 MiB   anything smaller comes from the heap
    M_TRIM_THRESHOLD = 1 GiB    freed heap memory is kept for the next step

Measured on the 2-core CPU, SmolLM2 bf16, one 8,000-token prefill step:
7.7-8.2 s -> 5.8-7.0 s. Decode steps (small tensors) are unchanged.
It changes only where glibc finds memory, never what a tensor holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above; False (and nothing done) without glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
