"""KVOffload: which blocks go down into the tiers, and how blocks come back up.

Write policy. A full prompt block is worth a copy once it proves reusable:
every arriving request counts one *sighting* of each of its prompt blocks,
and at the `store_threshold`-th sighting (2 by default: on its second
request) the block is queued for storing. At the end of the step in which
its K/V exist on the device, the engine copies it out (a cheap gather: the
block may be evicted right after), and a store thread encodes it (hash,
namespace, checksum) and writes it to every tier missing it. A step never
waits for a tier; when the store thread falls behind, new stores are dropped.
The bytes waiting for the store thread are counted under `queue_lock`: the
engine thread adds a copy's bytes, the store thread takes them off.

Read path. Admission looks up the device prefix cache first; with tiers on
it carries the lookup on past the device hits, through the tiers:

    prompt blocks    h0 h1 h2 | h3 h4 h5 | h6 h7
    device cache     hit hit hit| miss ...
    tiers / loads             | found    | not found: computed as usual
                                 \\_ a *load job*: device blocks are allocated
                                    now, filled by a load thread, registered
                                    in the prefix cache when they arrive

The local tiers are asked at admission, on the engine thread (in-memory
indexes); the remote ones (Redis) in the background, so that no step waits on
the network: the sequence waits aside for their answer, which a later step
uses (engine/core/kv_offload/lookup.py, as vLLM's KV connectors do).

The sequence leaves the waiting queue for a `loading` list while it waits
for its look-up or its jobs, so it holds up nobody: requests behind it are
admitted as usual (vLLM users met the opposite, #44294: requests queued
behind another's load, and throughput fell by 40 %). A request that needs
blocks another request is already loading joins that job instead of loading
them twice. When its jobs are done the sequence goes back to the front of the
waiting queue and is admitted like any other: the loaded blocks are now plain
prefix-cache hits.

A job holds its blocks (and the sequence's device hits, so they cannot be
evicted meanwhile) under a key of its own in the block manager, until every
sequence waiting on it has been admitted or has gone. Jobs together hold at
most `usable blocks - blocks of one max_model_len sequence`, so whichever
sequence is ready first can always be admitted: loads never deadlock the pool.
A load that fails (a miss, a bad record, a tier gone) leaves its block
unregistered: that part of the prompt is computed. Never wrong KV.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.block_manager import BlockManager
from engine.core.kv_offload import record
from engine.core.kv_offload.lookup import RemoteLookups
from engine.core.kv_offload.tier import Tier

logger = logging.getLogger(__name__)

MAX_SIGHTINGS = 1 << 16  # block hashes whose sightings are counted (LRU)
MAX_PENDING = 4096  # blocks queued for storing but not computed yet
MAX_PENDING_STEPS = 512  # a block not computed within this many steps is no longer awaited
MAX_STORE_QUEUE_BYTES = 256 << 20  # copies waiting for the store thread
REFRESH_SECONDS = 1.0  # how often tiers that can come back (Redis) are looked after


class BlockIO(Protocol):
    """What the offload manager needs of the model runner: whole blocks as bytes."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...  # [n, bytes] uint8, CPU

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None: ...


@dataclass(eq=False)
class LoadJob:
    key: tuple  # the job's own entry in the block manager, which holds its blocks
    chain: list[bytes]  # the block hashes of the sequence that started it
    fetch: list[tuple[int, int]]  # (index in `chain`, device block) that this job loads
    token_slice: object  # the sequence's token_slice and cache salt, for KV events
    cache_salt: bytes
    future: Future | None = None  # -> a payload (or None: a miss) per entry of `fetch`
    waiters: set[int] = field(default_factory=set)  # sequences that wait for it
    applied: bool = False  # loaded blocks written and registered
    num_blocks: int = 0  # blocks its entry holds

    def block_of(self, block_hash: bytes) -> int:
        """The device block this job loads `block_hash` into."""
        return next(block for index, block in self.fetch if self.chain[index] == block_hash)


class KVOffload:
    def __init__(self, tiers: list[Tier], block_manager: BlockManager, io: BlockIO,
                 payload_bytes: int, store_threshold: int, max_job_blocks: int) -> None:
        self.tiers = tiers
        self.local = [t for t in tiers if not getattr(t, "remote", False)]
        self.remote = [t for t in tiers if getattr(t, "remote", False)]
        self.block_manager = block_manager
        self.io = io
        self.payload_bytes = payload_bytes
        self.store_threshold = store_threshold
        self.max_job_blocks = max_job_blocks
        self.namespace = tiers[0].namespace
        self.sightings: OrderedDict[bytes, int] = OrderedDict()
        self.pending: dict[bytes, int] = {}  # hash to store -> step it was queued at
        self.sent_remote: OrderedDict[bytes, float] = OrderedDict()  # hash -> when stored
        self.inflight: dict[bytes, LoadJob] = {}  # hash being loaded -> its job
        self.jobs: list[LoadJob] = []  # not yet applied
        self.jobs_of: dict[int, list[LoadJob]] = {}  # sequence -> the jobs it waits for
        self.job_blocks = 0
        self.lookups = RemoteLookups(self.remote)
        self.queue_lock = threading.Lock()  # guards queued_bytes and blocks_stored
        self.queued_bytes = 0  # copies handed to the store thread, not yet written
        self.counters = {"loads": 0, "blocks_loaded": 0, "blocks_load_failed": 0,
                         "blocks_stored": 0, "stores_dropped": 0}
        self.step = 0
        self.last_refresh = 0.0
        self._job_ids = itertools.count()
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self.storer = ThreadPoolExecutor(1, thread_name_prefix="kv-store")

    # -- write policy ---------------------------------------------------------------
    def note_arrival(self, block_hashes: list[bytes]) -> None:
        """A request arrived with these full prompt blocks: count one sighting of each."""
        for block_hash in block_hashes:
            count = self.sightings.pop(block_hash, 0) + 1
            self.sightings[block_hash] = count
            if count >= self.store_threshold and block_hash not in self.pending \
                    and self._needs_store(block_hash) and len(self.pending) < MAX_PENDING:
                self.pending[block_hash] = self.step
        while len(self.sightings) > MAX_SIGHTINGS:
            self.sightings.popitem(last=False)

    def _needs_store(self, block_hash: bytes) -> bool:
        if any(t.enabled and not t.contains(block_hash) for t in self.local):
            return True
        sent = self.sent_remote.get(block_hash)
        return bool(self.remote) and (sent is None or time.monotonic() - sent > self._resend_after())

    def _resend_after(self) -> float:
        """Store a block in a remote tier again once half its TTL has passed."""
        return min(getattr(t, "ttl_seconds", 3600) for t in self.remote) / 2

    def after_step(self) -> None:
        """Copy out the queued blocks whose K/V now exist, for the store thread."""
        self.step += 1
        self._refresh_tiers()
        if not self.pending:
            return
        cached = self.block_manager.cached
        ready = [(h, cached[h]) for h in self.pending if h in cached]
        stale = [h for h, step in self.pending.items() if self.step - step > MAX_PENDING_STEPS]
        for block_hash in [h for h, _ in ready] + stale:
            self.pending.pop(block_hash, None)
        if not ready:
            return
        size = len(ready) * self.payload_bytes
        if not self._reserve_queue(size):
            self.counters["stores_dropped"] += len(ready)
            return
        data = self.io.read_blocks([block for _, block in ready])  # now: it may be reused next
        now = time.monotonic()
        for block_hash, _ in ready:
            self.sent_remote[block_hash] = now
        while len(self.sent_remote) > MAX_SIGHTINGS:
            self.sent_remote.popitem(last=False)
        self.storer.submit(self._store, [h for h, _ in ready], data, size)

    def _reserve_queue(self, size: int) -> bool:
        """Count `size` bytes into the store queue if they fit (engine thread)."""
        with self.queue_lock:
            if self.queued_bytes + size > MAX_STORE_QUEUE_BYTES:
                return False
            self.queued_bytes += size
            return True

    def _store(self, hashes: list[bytes], data: torch.Tensor, size: int) -> None:
        """Store thread: encode each block once and write it to every tier that lacks it."""
        stored = 0
        try:
            for block_hash, payload in zip(hashes, data.numpy()):
                encoded = record.encode(self.namespace, block_hash, payload)
                for tier in self.tiers:
                    if tier.remote or not tier.contains(block_hash):
                        tier.store(block_hash, encoded)
                stored += 1
        except Exception:  # noqa: BLE001 - a tier must never take the engine down
            logger.exception("storing KV blocks in the offload tiers failed")
        finally:
            with self.queue_lock:  # the engine thread adds to it meanwhile
                self.queued_bytes -= size
                self.counters["blocks_stored"] += stored

    def _refresh_tiers(self) -> None:
        now = time.monotonic()
        if self.remote and now - self.last_refresh > REFRESH_SECONDS:
            self.last_refresh = now
            for tier in self.remote:
                self.storer.submit(tier.refresh)

    # -- read path -------------------------------------------------------------------
    def start_loads(self, seq, hits: list[int], limit: int) -> bool:
        """Look past the device hits into the tiers; True if `seq` must wait aside,
        for the remote tiers' answer or for its loads."""
        if seq.seq_id in self.jobs_of:
            return False  # its loads are done: admit it with what they brought
        hashes = seq.block_hashes[len(hits):limit]
        remote = self.lookups.answer(seq.seq_id, seq.block_hashes[:limit]) if hashes else set()
        if remote is None:
            return True  # asked in the background; ready() says when to come back
        room = self.max_job_blocks - self.job_blocks - len(hits)
        run = self._available_run(hashes, remote)[:max(room, 0)]
        if not run:
            return False
        held = hits + [self.inflight[h].block_of(h) for h in run if h in self.inflight]
        new = [i for i, h in enumerate(run, start=len(hits)) if h not in self.inflight]
        key = ("kv-load", next(self._job_ids))
        size = (len(held) + len(new)) * self.block_manager.block_size
        table = self.block_manager.allocate(key, size, held)
        if table is None:
            return False  # no room now: compute instead
        job = LoadJob(key, seq.block_hashes, list(zip(new, table[len(held):])), seq.token_slice,
                      seq.cache_salt, num_blocks=len(table))
        self.job_blocks += job.num_blocks
        joined = {id(j): j for j in (self.inflight[h] for h in run if h in self.inflight)}
        self.jobs_of[seq.seq_id] = [job, *joined.values()]
        for waited in self.jobs_of[seq.seq_id]:
            waited.waiters.add(seq.seq_id)
        if job.fetch:
            for index, _ in job.fetch:
                self.inflight[seq.block_hashes[index]] = job
            job.future = self.loader.submit(self._load, [seq.block_hashes[i] for i, _ in job.fetch])
            self.jobs.append(job)
            self.counters["loads"] += 1
        else:
            job.applied = True  # it only holds blocks; the joined jobs do the loading
        return True

    def _available_run(self, hashes: list[bytes], remote: set[bytes]) -> list[bytes]:
        """The leading hashes that a job is loading, a local tier holds, or the remote
        tiers said they hold."""
        end = 0
        while end < len(hashes) and (hashes[end] in self.inflight or hashes[end] in remote
                                     or any(t.contains(hashes[end]) for t in self.local)):
            end += 1
        return hashes[:end]

    def _load(self, hashes: list[bytes]) -> list[memoryview | None]:
        """Load thread: each block from the first tier that has a sound copy of it."""
        found: dict[bytes, memoryview] = {}
        for tier in self.tiers:
            missing = [h for h in hashes if h not in found]
            if not missing:
                break
            if not tier.remote:
                missing = [h for h in missing if tier.contains(h)]
            for block_hash, payload in zip(missing, tier.load_many(missing)):
                if payload is not None:
                    found[block_hash] = payload
                    self._promote(tier, block_hash, payload)
        return [found.get(h) for h in hashes]

    def _promote(self, source: Tier, block_hash: bytes, payload) -> None:
        """A block found below the first tier is copied into the tiers above it."""
        above = self.tiers[:self.tiers.index(source)]
        if above:
            encoded = record.encode(self.namespace, block_hash, payload)
            for tier in above:
                tier.store(block_hash, encoded)

    def poll(self) -> None:
        """Write the finished jobs' blocks into the device and register them (engine thread)."""
        for job in [j for j in self.jobs if j.future is not None and j.future.done()]:
            self._apply(job)

    def _apply(self, job: LoadJob) -> None:
        try:
            payloads = job.future.result()
        except Exception:  # noqa: BLE001 - a failed load is a miss
            logger.exception("loading KV blocks from the offload tiers failed")
            payloads = [None] * len(job.fetch)
        loaded = [(entry, p) for entry, p in zip(job.fetch, payloads)
                  if p is not None and p.nbytes == self.payload_bytes]
        if loaded:
            data = torch.empty(len(loaded), self.payload_bytes, dtype=torch.uint8)
            for row, (_, payload) in zip(data.numpy(), loaded):
                row[:] = payload
            self.io.write_blocks([block for (_, block), _ in loaded], data)
            self.block_manager.cache_loaded_blocks([entry for entry, _ in loaded], job.chain,
                                                   job.token_slice, job.cache_salt)
        self.counters["blocks_loaded"] += len(loaded)
        self.counters["blocks_load_failed"] += len(job.fetch) - len(loaded)
        for index, _ in job.fetch:
            if self.inflight.get(job.chain[index]) is job:
                del self.inflight[job.chain[index]]
        self._finish(job)

    def _finish(self, job: LoadJob) -> None:
        job.applied = True
        if job in self.jobs:
            self.jobs.remove(job)
        if not job.waiters:
            self.block_manager.free(job.key)
            self.job_blocks -= job.num_blocks

    def ready(self, seq) -> bool:
        """The remote tiers answered (or were given up on) and every job the sequence
        waits for has landed."""
        if self.lookups.waiting(seq.seq_id):
            return False
        return all(job.applied for job in self.jobs_of.get(seq.seq_id, ()))

    def forget(self, seq) -> None:
        """The sequence was admitted (the loaded blocks are its hits now) or has ended:
        it waits for nothing any more, and a later admission may look up and load again."""
        self.lookups.forget(seq.seq_id)
        for job in self.jobs_of.pop(seq.seq_id, ()):
            job.waiters.discard(seq.seq_id)
            if job.applied and not job.waiters:
                self._finish(job)

    # -- the engine's view -----------------------------------------------------------------
    @property
    def loading(self) -> bool:
        return bool(self.jobs)

    def wait_for_loads(self, timeout: float) -> None:
        """Sleep until a load or a look-up finishes (or `timeout`): for an engine with
        nothing else to run."""
        futures = [j.future for j in self.jobs if j.future is not None]
        futures += self.lookups.unanswered()
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def snapshot(self) -> dict:
        return {"tiers": {t.name: t.snapshot() for t in self.tiers}, **self.counters}

    def close(self) -> None:
        """Let the threads finish what they hold, then close the tiers."""
        self.lookups.close()
        self.loader.shutdown(wait=True)
        self.storer.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
