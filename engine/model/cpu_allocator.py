"""Where CPU tensors get their memory: freed activations stay in the heap, and
the KV cache and the weights are backed by huge pages.

Freed activations, so they are not faulted in again.

glibc serves every allocation above its mmap threshold (128 KiB, rising
dynamically up to 32 MiB) with a fresh mmap and unmaps it on free. A prefill
step allocates and frees activations of tens of MiB dozens of times per
layer, so each one pays a page fault per 4 KiB touched: a bf16 -> fp32 copy
of [8192, 576] ran 1.2 ms with the default and 0.6 ms once the memory came
from the heap. vLLM's CPU backend asks users to preload tcmalloc for the same
reason; this does the glibc equivalent in-process, at engine start
(keep_freed_memory):

    M_MMAP_THRESHOLD = 32 MiB   smaller blocks come from the heap
    M_TRIM_THRESHOLD = 1 GiB    freed heap memory is kept for the next step

and once the weights and the KV cache are in place (activations_from_heap):

    M_MMAP_MAX       = 0        larger blocks too: 32 MiB is glibc's ceiling
                                for the threshold, and a BERT-base prefill
                                step's [5,750, 3,072] bf16 activation is 35
                                MB, a Llama-1B one's [4,096, 16,384] 134 MB

Not before: loading frees large temporaries (a dummy weight before its move
to the huge-page arena, a checkpoint tensor after its copy), which leave at
once as mmaps; kept in the heap they raised a Llama-3.2-1B shape's peak at
load from 3.56 GB to 4.3-4.9 GB.

A thread other than the main one allocates from an arena of its own, whose
heaps hold at most 64 MiB: larger blocks there are mmapped whatever
M_MMAP_MAX says. A server builds and steps its engine on a thread, so
before that thread starts (one_arena):

    M_ARENA_MAX      = 1        every thread allocates from the main arena

A thread keeps the arena it took at its first allocation, hence before the
thread starts. On the 2-core EPYC (Zen 4, AVX512-BF16, 2026-12-05), the
prefill of 32 prompts of 128 tokens on the Llama-3.2-1B Q4_K_M shape took
12.7-12.9 s on the main thread, 14.3 s on another thread, and 12.9 s on
another thread with one arena: its [4,096, 16,384] activations had been
faulted in again at every step.

Measured on the 2-core CPU, SmolLM2 bf16, one 8,000-token prefill step:
7.7-8.2 s -> 5.8-7.0 s (the threshold and the trim). The mmap limit, on the
2-core EPYC (AVX512-BF16, 2026-11-30): a bf16 GELU over [5,750, 3,072] 0.60
-> 0.16 ns an element, BERT-base's `LLM.embed` of 128 texts 28.7-30.8 ->
31.5-32.2 texts a second, the prefill of 32 prompts of 128 tokens on the
Llama-3.2-1B shape 11.0-11.1 -> 10.1-10.3 s. Decode steps (small tensors)
are unchanged. It changes only where glibc finds memory, never what a
tensor holds; an idle engine gives the heap's free memory back
(release_freed_heap).

The KV cache, on 2 MiB pages. Decode attention reads each sequence's blocks
where the block table says, all over a cache of a GiB or more; with 4 KiB
pages nearly every 6 KB block read also misses the TLB. Linux gives a
mapping transparent huge pages when it is madvise()d MADV_HUGEPAGE (the
default "madvise" mode of /sys/kernel/mm/transparent_hugepage/enabled), if
that happens before the pages are first touched. Measured on the 2-core
CPU, SmolLM2's decode attention over 128 sequences x ~320 tokens in a 1 GiB
cache: 17.5 -> 19.3 GB/s.

The weights, on 2 MiB pages too, in one arena in the order the model
registers them (a layer's norms and projections, layer by layer: the order
a decode step reads them). A one-stream decode step streams every weight
once; on 4 KiB pages that is a TLB miss every 4 KiB on each of the two
threads' streams. Measured on the 2-core AVX2 EPYC, SmolLM2's 120 layer
matrices through the packed one-token linear, alternated in one run: 22.1
-> 25.3 GB/s (a float32 sum over 1 GiB: 25.7 -> 27.3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from pathlib import Path

import torch
from torch import nn

MADV_DONTNEED = 4  # Linux
MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 << 20
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
FREE_THAT_TRIMS_BYTES = 1 << 16  # glibc's FASTBIN_CONSOLIDATION_THRESHOLD: a free this large trims
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TENSOR_ALIGN = 64  # bytes: each weight starts on a cache line, as the heap would place it
TRIM_EVERY_BYTES = 256 << 20  # while moving weights: give the old copies back this often


def _libc_with(function: str):
    """The C library, if it has `function`; None otherwise (not glibc, not Linux)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, function) else None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above; False (and nothing done) without glibc."""
    return _mallopt(((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))


def activations_from_heap() -> bool:
    """Serve every later block from the heap, however large (above): call
    once the weights and the KV cache are allocated."""
    return _mallopt(((M_MMAP_MAX, 0),))


def one_arena() -> bool:
    """Every thread allocates from the main arena (above): call before
    starting a thread that will step an engine."""
    return _mallopt(((M_ARENA_MAX, 1),))


def _mallopt(settings) -> bool:
    libc = _libc_with("mallopt")
    if libc is None:
        return False
    return all([bool(libc.mallopt(option, value)) for option, value in settings])


def advise_huge_pages(tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside `tensor` with huge pages
    (before anything touches them); False where it cannot or will not."""
    first, last = _whole_pages(tensor, HUGE_PAGE_BYTES)
    return last > first and _madvise(first, last, MADV_HUGEPAGE)


def _whole_pages(tensor, page: int) -> tuple[int, int]:
    """The addresses [first, last) of the whole `page`-sized pages inside `tensor`."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return -(-start // page) * page, end // page * page


def _madvise(first: int, last: int, advice: int) -> bool:
    """madvise(first, last - first, advice); False where there is none or it refuses."""
    libc = _libc_with("madvise")
    if libc is None:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, last - first, advice) == 0


def zero_lazily(tensor) -> bool:
    """Make a contiguous `tensor` read as zeros without touching its pages:
    MADV_DONTNEED drops every whole page inside it (an anonymous page dropped
    reads back as zeros and is backed only when first written), and the parts
    of pages at its two ends, which it shares with other memory, are zeroed by
    hand. False, and nothing done, where madvise is missing or refuses.

    Why: zero_() writes every page of a KV cache at start, a GiB by default,
    most of which a short run never uses; each page costs a fault and the
    kernel's own zeroing (SmolLM2 float32: 0.4-0.7 s a start, most of it in
    the kernel). Left lazy, a page is paid for when a block on it is first
    written, and only then counts in the resident set."""
    if _libc_with("madvise") is None:
        return False
    start = tensor.data_ptr()
    first, last = _whole_pages(tensor, mmap.PAGESIZE)
    flat = tensor.view(-1).view(torch.uint8)
    if last > first:
        if not _madvise(first, last, MADV_DONTNEED):
            return False
        flat[:first - start].zero_()
        flat[last - start:].zero_()
    else:  # inside one page: nothing to drop
        flat.zero_()
    return True


def huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of untouched uint8 memory starting on a 2 MiB boundary and
    advised onto huge pages (each page is backed when first written); None
    where madvise refuses."""
    buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    aligned = buffer[start:start + nbytes]
    # malloc may hand back addresses an earlier allocation backed with small
    # pages, and a backed page stays small: dropped first, each 2 MiB range is
    # backed by one huge page when first written. (SmolLM2's weights landed
    # there in one start of two: 22 of their 94 MiB on huge pages, not 94.)
    first, last = _whole_pages(aligned, HUGE_PAGE_BYTES)
    if last > first:
        _madvise(first, last, MADV_DONTNEED)
    return aligned if advise_huge_pages(aligned) else None


def huge_pages_offered() -> bool:
    """Whether Linux gives madvise()d memory transparent huge pages ("always"
    or "madvise" mode); False elsewhere (another OS, or "never")."""
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _weights(module: nn.Module) -> list[torch.Tensor]:
    """Each parameter and buffer once, in registration order: CPU, dense,
    contiguous and owning its memory. A view, and a tensor another one views,
    stay put: moving one of the two would part them."""
    everything = list(module.parameters()) + list(module.buffers())
    viewed = {id(t._base) for t in everything if t._base is not None}
    seen, tensors = set(), []
    for tensor in everything:
        if (id(tensor) in seen or id(tensor) in viewed or tensor._base is not None
                or tensor.device.type != "cpu" or tensor.layout != torch.strided
                or not tensor.is_contiguous() or tensor.numel() == 0):
            continue
        seen.add(id(tensor))
        tensors.append(tensor)
    return tensors


def weights_on_huge_pages(module: nn.Module) -> bool:
    """Move `module`'s weights into one arena advised onto huge pages (the
    tensor objects stay, their `.data` moves). The arena's pages are touched
    only as weights land in them and the old copies are given back every
    TRIM_EVERY_BYTES, so the peak is the weights plus ~256 MiB, not twice
    the weights. False, and nothing moved, where huge pages are not offered."""
    tensors = _weights(module)
    if not tensors or not huge_pages_offered():
        return False
    sizes = [-(-t.numel() * t.element_size() // TENSOR_ALIGN) * TENSOR_ALIGN for t in tensors]
    arena = huge_page_bytes(sum(sizes))
    if arena is None:
        return False
    offset = 0
    since_trim = 0
    for tensor, size in zip(tensors, sizes):
        nbytes = tensor.numel() * tensor.element_size()
        home = arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        home.copy_(tensor)
        tensor.data = home
        offset += size
        since_trim += size
        if since_trim >= TRIM_EVERY_BYTES:
            release_freed_heap()
            since_trim = 0
    release_freed_heap()
    return True


def release_freed_heap() -> bool:
    """Give the heap's free memory back to Linux (glibc's malloc_trim). Why:
    with keep_freed_memory's thresholds the old copies of moved weights stay
    in the heap as free chunks, still resident: SmolLM2 held 865 MB after
    loading where it holds 656 without the move, and 656 again after this.
    malloc_trim returns the free pages of every arena's chunks but not the
    free space at the top of a thread's own arena (only the main arena's
    top): the calling thread's top goes first (_trim_own_top)."""
    libc = _libc_with("malloc_trim")
    if libc is None:
        return False
    _trim_own_top(libc)
    libc.malloc_trim(0)
    return True


def _trim_own_top(libc) -> None:
    """Shrink the top of the calling thread's arena. glibc does that only
    inside free(): freeing a block of 64 KiB or more trims a thread arena's
    top when it exceeds M_TRIM_THRESHOLD, so the threshold is lowered for
    one such free and put back. A server's engine thread kept its steps'
    activations there before one_arena, and a thread that took its arena
    before one_arena ran still does: SmolLM2 after 32 streams held 924 MB
    with the top kept, 858 without (docs/performance.md)."""
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    if not _mallopt(((M_TRIM_THRESHOLD, 0),)):
        return
    try:
        libc.free(libc.malloc(FREE_THAT_TRIMS_BYTES))
    finally:
        _mallopt(((M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),))
