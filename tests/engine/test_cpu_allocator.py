"""The glibc malloc tuning the CPU runner applies at start (engine/model/cpu_allocator.py)."""

import ctypes.util
import mmap
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from torch import nn

from engine.model import cpu_allocator
from engine.model.cpu_allocator import (activations_from_heap, advise_huge_pages, huge_pages_offered,
                                      keep_freed_memory, weights_on_huge_pages, zero_lazily)


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


def test_blocks_past_the_mmap_threshold_from_the_heap_stay_correct():
    """Once activations_from_heap ran, blocks over glibc's 32 MiB threshold
    (and over a thread arena's 64 MiB heaps) are freed into the heap and
    taken again: from the main thread and another, each still holds exactly
    what was written into it, independent of the block freed before it."""
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("glibc's mallopt exists only on Linux")
    assert keep_freed_memory() is True and activations_from_heap() is True
    results = []

    def cycle():
        held = []
        for n, value in ((40 << 20, 3), (100 << 20, 5), (40 << 20, 7)):  # bytes
            block = torch.full((n // 8,), value, dtype=torch.int64)
            held.append(bool((block == value).all()) and int(block.sum()) == value * (n // 8))
            del block
        results.append(all(held))

    cycle()
    worker = threading.Thread(target=cycle)
    worker.start()
    worker.join()
    assert results == [True, True]


# Run in a fresh process: there a new thread gets an arena of its own, where
# in the test process it would take over an earlier test thread's.
TOP_OF_A_THREAD_ARENA = """
import ctypes, ctypes.util, mmap, sys, threading
from engine.model import cpu_allocator
assert cpu_allocator.keep_freed_memory() and cpu_allocator.activations_from_heap()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
size, page = 48 << 20, mmap.PAGESIZE
pages = (ctypes.c_ubyte * (size // page))()
resident = []

def resident_mib(start):
    assert libc.mincore(start, size - 2 * page, pages) == 0
    return sum(p & 1 for p in pages[:size // page - 2]) * page >> 20

def step_then_idle():
    live = libc.malloc(1 << 10)  # stays, below the block
    block = libc.malloc(size)  # carved from the top of this thread's arena
    ctypes.memset(block, 1, size)
    libc.free(block)  # back into the top, under M_TRIM_THRESHOLD's 1 GiB
    start = -(-block // page) * page + page
    resident.append(resident_mib(start))
    libc.malloc_trim(0)
    resident.append(resident_mib(start))
    cpu_allocator.release_freed_heap()
    resident.append(resident_mib(start))
    again = libc.malloc(size)  # the threshold is back at 1 GiB: this one stays when freed
    ctypes.memset(again, 1, size)
    libc.free(again)
    resident.append(resident_mib(-(-again // page) * page + page))
    libc.free(live)

worker = threading.Thread(target=step_then_idle)
worker.start()
worker.join()
print(*resident)
"""


def test_an_idle_thread_gives_back_the_top_of_its_own_arena():
    """A thread other than the main one allocates from an arena of its own;
    a block freed at its top (a step's last activation) stays resident
    through glibc's malloc_trim, which trims only the main arena's top.
    release_freed_heap, called on that thread (the engine thread going
    idle), gives it back too. Residency is read with mincore: reading /proc
    between the malloc and the free would allocate above the block."""
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("glibc's mallopt exists only on Linux")
    done = subprocess.run([sys.executable, "-c", TOP_OF_A_THREAD_ARENA], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    freed, trimmed, released, kept_again = (int(x) for x in done.stdout.split())
    assert freed > 40 and trimmed > 40, (freed, trimmed)  # what an idle engine did before
    assert released < 8, (freed, trimmed, released)
    assert kept_again > 40, kept_again  # the next step's activations stay: the threshold is put back


# A fresh process: the arena limit holds for threads that take their first
# arena after it is set, and the test process's threads took theirs long ago.
# "one" and "default": a plain thread after one_arena or without it;
# "engine": the thread AsyncEngine.launch starts, asked through call().
THREAD_BLOCK_IN_THE_MAIN_HEAP = """
import asyncio, sys, threading, torch
from engine.model import cpu_allocator
mode = sys.argv[1]
assert cpu_allocator.keep_freed_memory() and cpu_allocator.activations_from_heap()
if mode == "one":
    assert cpu_allocator.one_arena()

def block_in_heap(_=None):
    block = torch.ones(100 << 20, dtype=torch.uint8)  # a step's activation past a thread heap's 64 MiB
    with open("/proc/self/maps") as maps:  # advised huge pages split [heap] into several mappings
        heap = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps if line.rstrip().endswith("[heap]")]
    inside = any(start <= block.data_ptr() < end for start, end in heap)
    return inside and int(block.sum()) == 100 << 20

if mode == "engine":
    from engine.config import EngineConfig
    from engine.frontend.async_engine import AsyncEngine
    from engine.frontend.llm_engine import LLMEngine

    async def main():
        config = EngineConfig(model=sys.argv[2], max_model_len=256, kv_cache_memory_bytes=64 << 20, dtype="float32")
        bridge = await AsyncEngine.launch(lambda: LLMEngine(config))
        try:
            return await bridge.call(block_in_heap)
        finally:
            bridge.shutdown(timeout=30)

    print(asyncio.run(main()))
else:
    found = []
    worker = threading.Thread(target=lambda: found.append(block_in_heap()))
    worker.start()
    worker.join()
    print(found[0])
"""


@pytest.mark.parametrize("mode", ["one", "default", "engine"])
def test_an_engine_thread_takes_large_blocks_from_the_main_heap_with_one_arena(mode, tiny_llama_path):
    """A thread started after one_arena allocates a 100 MiB block from the
    main heap (the [heap] mapping), where by default its own arena's heaps
    hold at most 64 MiB and the block is a fresh mmap, faulted in again at
    every step; AsyncEngine's engine thread is started after it."""
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("glibc's mallopt exists only on Linux")
    done = subprocess.run([sys.executable, "-c", THREAD_BLOCK_IN_THE_MAIN_HEAP, mode, str(tiny_llama_path)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(mode != "default")]


def _smaps_field(address: int, field: str, pid: str = "self") -> list[str]:
    """A field ("VmFlags", "AnonHugePages") of the mapping holding `address`,
    from /proc/PID/smaps, split into words."""
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return line.split()[1:]
    return []


def _vm_flags_at(address: int) -> list[str]:
    return _smaps_field(address, "VmFlags")


def _need_huge_pages():
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("madvise(MADV_HUGEPAGE) is Linux's")
    if not huge_pages_offered():
        pytest.skip("this kernel offers no transparent huge pages (none, or 'never')")


def test_a_large_tensor_is_advised_onto_huge_pages():
    _need_huge_pages()
    cache = torch.empty(64 << 20, dtype=torch.uint8)
    assert advise_huge_pages(cache) is True
    # The range is advised ("hg"); whether the kernel then finds free 2 MiB
    # pages at fault time depends on the machine's fragmentation, not on us.
    inside = -(-cache.data_ptr() // (2 << 20)) * (2 << 20)
    assert "hg" in _vm_flags_at(inside)
    cache.zero_()
    assert int(cache.sum()) == 0
    assert advise_huge_pages(torch.empty(16)) is False  # no whole 2 MiB page inside


# In a fresh process (the test process's heap holds other tests' memory),
# which prints whether the arena took the freed block's addresses and where
# it starts, then waits while the test reads its smaps.
HUGE_PAGES_WHERE_SMALL_ONES_WERE = """
import sys, torch
from engine.model import cpu_allocator
assert cpu_allocator.keep_freed_memory() and cpu_allocator.activations_from_heap()
size = 48 << 20
earlier = torch.empty(size + (4 << 20), dtype=torch.uint8)
earlier.fill_(1)  # backed with small pages: nothing advised them
lo, hi = earlier.data_ptr(), earlier.data_ptr() + earlier.numel()
del earlier  # kept by the heap (the trim threshold), backed
arena = cpu_allocator.huge_page_bytes(size)
arena.fill_(2)
print(int(lo <= arena.data_ptr() < hi), arena.data_ptr(), flush=True)
sys.stdin.readline()
"""


def test_huge_page_bytes_backs_huge_pages_where_small_ones_were():
    """malloc hands the arena addresses an earlier block backed with small
    pages (the weights' arena after loading's temporaries); those pages are
    dropped first, so the arena is backed by huge pages, not the old small
    ones (without the drop: 0 MiB of 48 here; SmolLM2's weights 22 of 94)."""
    _need_huge_pages()
    child = subprocess.Popen([sys.executable, "-c", HUGE_PAGES_WHERE_SMALL_ONES_WERE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        reused, start = (int(x) for x in child.stdout.readline().split())
        huge_kib = int(_smaps_field(start, "AnonHugePages", str(child.pid))[0])
    finally:
        _, err = child.communicate("\n", timeout=120)
    assert child.returncode == 0, err
    assert reused == 1  # the case this is about: the same addresses again
    # Free 2 MiB pages are the machine's to find; half of them is far from none.
    assert huge_kib >= 24 << 10, huge_kib


def test_weights_move_into_one_advised_arena_unchanged():
    """Every parameter and buffer keeps its object, values, shape and dtype;
    their memory becomes consecutive slices of one advised mapping, in
    registration order, each on a cache line; a tied weight moves once; a
    view and the tensor it views stay where they are, still one memory."""
    _need_huge_pages()
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.LayerNorm(1024), nn.Linear(1024, 300, bias=False))
    model[2].weight.data = torch.randn(300, 1024, generator=generator).to(torch.bfloat16)
    model.register_buffer("table", torch.arange(10, dtype=torch.int64))
    model.register_buffer("view", model.table[2:5])
    tied = nn.Linear(1024, 300, bias=False)
    tied.weight = model[2].weight
    model.add_module("tied", tied)
    before = {name: (id(t), t.clone()) for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    view_address, table_address = model.view.data_ptr(), model.table.data_ptr()
    assert weights_on_huge_pages(model) is True
    moved = list(model.parameters())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        identity, values = before[name]
        assert id(tensor) == identity and torch.equal(tensor, values) and tensor.dtype == values.dtype
    addresses = [t.data_ptr() for t in moved]
    assert addresses == sorted(addresses) and all(a % 64 == 0 for a in addresses)
    assert addresses[0] % (2 << 20) == 0  # the first weight on a page boundary
    assert addresses[-1] - addresses[0] < sum(t.numel() * t.element_size() + 64 for t in moved)
    assert "hg" in _vm_flags_at(addresses[0])
    assert (model.view.data_ptr(), model.table.data_ptr()) == (view_address, table_address)
    model.table[3] = -1
    assert int(model.view[1]) == -1
    assert model.tied.weight is model[2].weight
    x = torch.randn(3, 512, generator=generator)
    assert model[1](model[0](x)).shape == (3, 1024)  # still a working module


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib << 10


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the pages under `tensor` that are backed now (mincore):
    the tensor's own pages, whatever the rest of the process frees or takes
    meanwhile (a test worker's resident set moves by tens of MB between
    calls)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page) * page
    pages = (end - start) // page
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def _reset_peak_resident() -> bool:
    """Start /proc/self/status's VmHWM again from the current resident size."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_resident_bytes() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib << 10


def test_moving_weights_leaves_no_second_copy_resident(monkeypatch):
    """With the engine's malloc tuning, freed weights would stay in the heap,
    still resident; after the move the process holds them once, and on the
    way it never held much more than that."""
    _need_huge_pages()
    assert keep_freed_memory() is True
    monkeypatch.setattr(cpu_allocator, "TRIM_EVERY_BYTES", 32 << 20)
    model = nn.ModuleList(nn.Linear(1024, 2048, bias=False) for _ in range(32))  # 256 MiB, 8 MiB each
    for layer in model:
        layer.weight.data.normal_()
    before = _resident_bytes()
    peak_known = _reset_peak_resident()
    assert weights_on_huge_pages(model) is True
    grown = _resident_bytes() - before
    assert grown < (24 << 20), f"resident memory grew {grown >> 20} MiB for 256 MiB of weights moved"
    if peak_known:
        peak = _peak_resident_bytes() - before
        assert peak < (96 << 20), f"moving 256 MiB of weights peaked {peak >> 20} MiB above the start"


def test_zero_lazily_zeroes_exactly_the_tensor_and_backs_no_pages():
    """A slice of dirty memory that starts and ends mid-page reads as zeros,
    its neighbours keep their bytes, and the whole pages inside it are given
    back (the resident set shrinks by about their size)."""
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("madvise(MADV_DONTNEED) is Linux's")
    buffer = torch.full((64 << 20,), 7, dtype=torch.uint8)  # every page backed and dirty
    inner = buffer[1234:-4321].view(-1)
    before = _resident_bytes()
    assert zero_lazily(inner) is True
    assert before - _resident_bytes() > (48 << 20)
    assert int(inner.count_nonzero()) == 0
    assert bool((buffer[:1234] == 7).all()) and bool((buffer[-4321:] == 7).all())
    inner.fill_(3)  # the dropped pages take writes again
    assert int(inner.sum()) == 3 * inner.numel()
    small = torch.full((100,), 5, dtype=torch.bfloat16)  # inside one page: zeroed by hand
    assert zero_lazily(small) is True and not bool(small.any())


def test_the_offline_llm_backs_its_kv_cache_lazily_and_a_server_at_start(tiny_llama_path):
    """LLM() defaults to kv_cache_prefault=False: its 256 MiB cache costs no
    resident memory until blocks are written, and it still generates; with
    the server's default (True) the whole cache is resident at start."""
    if platform.system() != "Linux" or ctypes.util.find_library("c") is None:
        pytest.skip("madvise(MADV_DONTNEED) and mincore are Linux's")
    from engine import LLM, SamplingParams

    resident = {}
    for prefault in (False, True):
        llm = LLM(str(tiny_llama_path), kv_cache_memory_bytes=256 << 20,
                  **({"kv_cache_prefault": True} if prefault else {}))
        cache = llm.engine.runner.kv_cache
        assert cache.numel() * cache.element_size() > (200 << 20)
        resident[prefault] = _resident_fraction(cache)
        assert llm.config.kv_cache_prefault is prefault
        out = llm.generate(["The sea is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        del llm, out, cache
    assert resident[False] < 0.05 and resident[True] > 0.95, resident
