"""The offload manager across its threads: the store queue's byte count, and
remote look-ups that run in the background so that no step waits on a tier.

The engine tests run the tiny Llama against a Redis that takes connections and
never answers (a stopped redis-server, a bare TCP listener): every step stays
far under the tier's 0.5 s reply timeout, and every request is served.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.kv_offload import lookup as lookup_module, record
from engine.core.kv_offload.host import HostTier
from engine.core.kv_offload.offload import KVOffload
from kv_records import NS, h
from live_server import wait_until
from redis_server import start_redis

PAYLOAD = 64
RECORD = record.record_size(NS, PAYLOAD)


class BlockIO:
    """Blocks of zeros out, anything in: the bytes do not matter here."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return torch.zeros(len(block_ids), PAYLOAD, dtype=torch.uint8)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        assert data.shape == (len(block_ids), PAYLOAD)


# -- the store queue's byte count ---------------------------------------------------------
class YieldingInt(int):
    """A size whose arithmetic is a Python call that lets other threads run.

    CPython switches threads only at calls and jumps, so `self.n += size` with
    plain ints is never split between its read and its write, and a lost update
    cannot be provoked. With this size it can, as on a free-threaded build.
    """

    def _yield(self, value: int) -> YieldingInt:
        time.sleep(0)
        return YieldingInt(value)

    def __add__(self, other): return self._yield(int(self) + int(other))
    def __sub__(self, other): return self._yield(int(self) - int(other))
    def __rsub__(self, other): return self._yield(int(other) - int(self))
    def __mul__(self, other): return self._yield(int(self) * int(other))
    __radd__ = __add__
    __rmul__ = __mul__


class EmptyHostTier(HostTier):
    """Never holds a block, so every sighted block is stored again."""

    def _contains(self, block_hash: bytes) -> bool:
        return False


def test_queued_bytes_return_to_zero_after_many_concurrent_stores():
    """The engine thread adds each copy's bytes, the store threads take them off
    as they finish: with 8 store threads racing the engine thread, none is lost."""
    names = [f"block {i}" for i in range(3000)]
    manager = SimpleNamespace(cached={h(n): 1 for n in names})  # every block computed
    tier = EmptyHostTier(NS, 1 << 20, RECORD)
    offload = KVOffload([tier], manager, BlockIO(), YieldingInt(PAYLOAD), 1, 0)
    offload.storer.shutdown()
    offload.storer = ThreadPoolExecutor(8, thread_name_prefix="kv-store")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for name in names:
            offload.note_arrival([h(name)])
            offload.after_step()  # one block copied out and handed to the store threads
    finally:
        offload.close()
        sys.setswitchinterval(interval)
    assert offload.counters["blocks_stored"] == len(names)
    assert offload.counters["stores_dropped"] == 0
    assert offload.queued_bytes == 0


# -- look-ups in the background -------------------------------------------------------------
class GatedRemoteTier(HostTier):
    """A remote tier whose look-ups answer only when the test says so."""

    name = "gated"
    remote = True
    ttl_seconds = 3600

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.go = threading.Event()

    def present(self, block_hashes: list[bytes]) -> list[bool]:
        assert self.go.wait(30)
        return super().present(block_hashes)


@pytest.fixture
def gated():
    """A gated tier holding blocks a and b, under a manager with a small device pool."""
    tier = GatedRemoteTier(NS, 1 << 20, RECORD)
    for name in "ab":
        tier.store(h(name), record.encode(NS, h(name), bytes(PAYLOAD)))
    manager = BlockManager(16, 4, enable_caching=True)
    offload = KVOffload([tier], manager, BlockIO(), PAYLOAD, 2, 8)
    seq = SimpleNamespace(seq_id=1, block_hashes=[h("a"), h("b"), h("c")],
                          token_slice=lambda start, end: [0] * (end - start), cache_salt=b"")
    yield tier, manager, offload, seq
    tier.go.set()
    offload.close()


def test_a_lookup_runs_in_the_background_and_its_answer_is_used_later(gated):
    tier, manager, offload, seq = gated
    started = time.perf_counter()
    assert offload.start_loads(seq, [], 3)  # asked in the background: wait aside
    assert time.perf_counter() - started < 0.05
    assert not offload.ready(seq) and not offload.jobs
    tier.go.set()
    assert wait_until(lambda: offload.ready(seq), timeout=10, interval=0.01)
    assert offload.start_loads(seq, [], 3)  # the answer: a and b, one load job
    assert offload.counters["loads"] == 1
    assert wait_until(lambda: (offload.poll(), offload.ready(seq))[1], timeout=10, interval=0.01)
    assert not offload.start_loads(seq, [], 3)  # loaded: admit it
    assert len(manager.cached_run([h("a"), h("b"), h("c")])) == 2
    offload.forget(seq)
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_a_lookup_that_does_not_answer_in_time_is_a_miss(gated, monkeypatch):
    tier, manager, offload, seq = gated
    monkeypatch.setattr(lookup_module, "LOOKUP_WAIT_SECONDS", 0.05)
    assert offload.start_loads(seq, [], 3)
    assert not offload.ready(seq)
    assert wait_until(lambda: offload.ready(seq), timeout=10, interval=0.01)  # gave up
    assert not offload.start_loads(seq, [], 3)  # admitted with what the device has
    assert offload.counters["loads"] == 0
    offload.forget(seq)
    assert manager.num_free_blocks == manager.num_usable_blocks


# -- an engine over a Redis that never answers ----------------------------------------------
VOCAB = 49152
BS = 8
PREFIXES = 6  # 36 blocks of prefix through a 33-block pool: each is evicted by its next round
PREFIX_TOKENS = 48
STEP_LIMIT = 0.25  # seconds: half the Redis tier's reply timeout


def prompts_of(rounds: int = 3) -> list[list[int]]:
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    return [p + [rng.randrange(3, VOCAB) for _ in range(5)]
            for _ in range(rounds) for p in prefixes]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def tiny_llm(path, **offload) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, max_model_len=128,
               max_num_batched_tokens=64, num_gpu_blocks_override=34, seed=0, **offload)


def reference(path, prompts) -> list[list[int]]:
    llm = tiny_llm(path)
    try:
        return [r.outputs[0].token_ids for r in llm.generate(prompts, greedy(), use_tqdm=False)]
    finally:
        llm.engine.close()


def serve(engine, prompts) -> tuple[list[list[int]], float]:
    """Every prompt at once, stepped to the end: the outputs and the slowest step."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, greedy())
    done, slowest = {}, 0.0
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        started = time.perf_counter()
        outputs = engine.step()
        slowest = max(slowest, time.perf_counter() - started)
        done |= {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
    return [done.get(i) for i in ids], slowest


def test_a_redis_that_stops_answering_holds_up_no_step(tiny_llama_path, tmp_path, single_thread):
    """Redis holds the prefixes, then hangs (SIGSTOP: it takes connections and
    answers nothing): the next round's look-ups would each wait out the reply
    timeout; in the background they cost no step anything."""
    prompts = prompts_of()
    expected = reference(tiny_llama_path, prompts[2 * PREFIXES:])
    server = start_redis(tmp_path)
    llm = tiny_llm(tiny_llama_path, kv_offload_redis_url=server.url)
    engine = llm.engine
    try:
        for i in range(0, 2 * PREFIXES, 2):  # rounds 1-2: computed, stored in Redis
            llm.generate(prompts[i:i + 2], greedy(), use_tqdm=False)
        assert wait_until(lambda: engine.offload.queued_bytes == 0, timeout=10)
        assert engine.offload_stats()["tiers"]["redis"]["stores"] > 0
        os.kill(server.process.pid, signal.SIGSTOP)
        outputs, slowest = serve(engine, prompts[2 * PREFIXES:])
    finally:
        if server.process is not None:
            os.kill(server.process.pid, signal.SIGCONT)
        engine.close()
        server.kill()
    assert outputs == expected
    assert slowest < STEP_LIMIT
    assert engine.offload_stats()["blocks_loaded"] == 0


def test_a_redis_that_never_answers_holds_up_no_step(tiny_llama_path, single_thread):
    """A bare listener from the start: the tier starts down, every step is quick."""
    prompts = prompts_of(rounds=2)
    expected = reference(tiny_llama_path, prompts)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        llm = tiny_llm(tiny_llama_path, kv_offload_redis_url=url)
        try:
            outputs, slowest = serve(llm.engine, prompts)
        finally:
            llm.engine.close()
    assert outputs == expected
    assert slowest < STEP_LIMIT
    assert llm.engine.offload_stats()["tiers"]["redis"]["up"] == 0
