"""What every offload tier is: a bounded store of block records, keyed by block hash.

    device KV pool (the prefix cache, engine/core/block_manager.py)
          |  miss                             ^ load: bytes into freshly allocated blocks
          v                                   |
    host-memory tier   ->  disk tier  ->  Redis tier (shared by the fleet)
      (RAM pool)          (files, LRU)      (TTL + Redis maxmemory)

A tier holds *records* (engine/core/kv_offload/record.py): the K/V of one block
with its hash, namespace and checksum. It knows nothing of sequences or the
device; the offload manager (engine/core/kv_offload/offload.py) decides what to
store and when to load. Local tiers are called from the engine thread
(`contains`) and from the offload worker threads (`load`, `store`), so each
one guards its own bookkeeping; a remote tier only from the worker threads
(`present` on the look-up thread), so that no step waits on the network.

A tier never raises into the engine: a failing medium counts an error and
answers a miss (and a disk that cannot be written disables its tier with one
warning). A bad record is a miss, never wrong KV.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    hits: int = 0  # blocks loaded from the tier, record sound
    misses: int = 0  # loads that found nothing or a bad record
    bad_records: int = 0  # of the misses, records that failed the checks (corrupt, truncated, foreign)
    stores: int = 0  # blocks written
    bytes_loaded: int = 0
    bytes_stored: int = 0
    evictions: int = 0  # blocks dropped to stay within the bound
    errors: int = 0  # failed operations of the medium (I/O, connection)


class Tier:
    """The interface; subclasses fill in the four `_` methods and `used_bytes`."""

    name = "tier"
    remote = False  # shared over the network: asked in batches, never per block

    def __init__(self, namespace: str, capacity_bytes: int) -> None:
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.enabled = True
        self.lock = threading.Lock()

    # -- what the offload manager calls --------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        return self.enabled and self._contains(block_hash)

    def leading_run(self, block_hashes: list[bytes]) -> int:
        """How many of `block_hashes`, from the first, this tier may hold (one round trip)."""
        count = 0
        for block_hash in block_hashes:
            if not self.contains(block_hash):
                break
            count += 1
        return count

    def present(self, block_hashes: list[bytes]) -> list[bool]:
        """Whether this tier may hold each of `block_hashes` (a remote tier: one round trip)."""
        return [self.contains(block_hash) for block_hash in block_hashes]

    def load(self, block_hash: bytes) -> memoryview | None:
        """The payload stored for `block_hash`, checked; None on a miss."""
        payload = self._load(block_hash) if self.enabled else None
        self._count_load(payload)
        return payload

    def _count_load(self, payload: memoryview | None) -> None:
        with self.lock:
            if payload is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_loaded += payload.nbytes

    def load_many(self, block_hashes: list[bytes]) -> list[memoryview | None]:
        """`load` of each hash (a remote tier answers them in one round trip)."""
        return [self.load(block_hash) for block_hash in block_hashes]

    def store(self, block_hash: bytes, record: bytes) -> bool:
        """Keep `record` (record.encode) under `block_hash`; False if it was not kept.
        A capacity of 0 is no bound of the tier's own (Redis without maxmemory)."""
        if not self.enabled or (self.capacity_bytes and len(record) > self.capacity_bytes):
            return False
        stored = self._store(block_hash, record)
        if stored:
            with self.lock:
                self.stats.stores += 1
                self.stats.bytes_stored += len(record)
        return stored

    @property
    def used_bytes(self) -> int:
        raise NotImplementedError

    def snapshot(self) -> dict[str, int]:
        """Counters and sizes for the engine's stats (read from any thread)."""
        with self.lock:
            return {**asdict(self.stats), "used_bytes": self.used_bytes,
                    "capacity_bytes": self.capacity_bytes, "up": int(self.enabled)}

    def refresh(self) -> None:
        """Periodic care from the store thread (a remote tier reconnects here)."""

    def close(self) -> None:
        """Release what the tier holds open (connections); its data may stay."""

    # -- what a tier implements ----------------------------------------------------------
    def _contains(self, block_hash: bytes) -> bool:
        raise NotImplementedError

    def _load(self, block_hash: bytes) -> memoryview | None:
        raise NotImplementedError

    def _store(self, block_hash: bytes, record: bytes) -> bool:
        raise NotImplementedError

    def _bad_record(self) -> None:
        with self.lock:
            self.stats.bad_records += 1
