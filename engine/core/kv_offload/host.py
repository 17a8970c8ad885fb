"""The host-memory tier: a pool of fixed-size record slots in RAM, LRU.

Every record of one engine has the same size (one block of K/V plus its
header), so the tier is one preallocated byte tensor cut into slots, and
its bookkeeping is a slot per hash:

    pool   [num_slots, record_bytes] uint8     pinned on CUDA: DMA-able, so a
                                                load into the device is one async copy
    index  OrderedDict  hash -> slot            least recently used first
    free   [slot, ...]                          slots holding nothing

The size is fixed up front (--kv-offload-host-bytes), like the device pool:
the tier never grows past its budget and never fragments. On the CPU it is
simply a second, larger and slower pool beside the KV cache; its pages are
touched only as slots fill, so an idle tier costs no resident memory.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.core.kv_offload import record
from engine.core.kv_offload.tier import Tier


class HostTier(Tier):
    name = "host"

    def __init__(self, namespace: str, capacity_bytes: int, record_bytes: int,
                 pin_memory: bool = False) -> None:
        num_slots = capacity_bytes // record_bytes
        super().__init__(namespace, num_slots * record_bytes)
        self.record_bytes = record_bytes
        self.pool = torch.empty((num_slots, record_bytes), dtype=torch.uint8,
                                pin_memory=pin_memory)
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_slots(self) -> int:
        return self.pool.shape[0]

    @property
    def used_bytes(self) -> int:
        return len(self.index) * self.record_bytes

    def _contains(self, block_hash: bytes) -> bool:
        with self.lock:
            return block_hash in self.index

    def _load(self, block_hash: bytes) -> memoryview | None:
        with self.lock:
            slot = self.index.get(block_hash)
            if slot is None:
                return None
            self.index.move_to_end(block_hash)
            data = self.pool[slot].numpy().tobytes()  # a copy: the slot may be reused next
        payload = record.decode(self.namespace, block_hash, data)
        if payload is None:  # cannot happen short of memory corruption; a miss all the same
            self._bad_record()
            self._drop(block_hash)
        return payload

    def _store(self, block_hash: bytes, data: bytes) -> bool:
        if len(data) != self.record_bytes or not self.num_slots:
            return False
        with self.lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
                return True
            if not self.free:
                _, slot = self.index.popitem(last=False)  # the least recently used
                self.stats.evictions += 1
            else:
                slot = self.free.pop()
            self.pool[slot].numpy()[:] = memoryview(data).cast("B")
            self.index[block_hash] = slot
        return True

    def _drop(self, block_hash: bytes) -> None:
        with self.lock:
            slot = self.index.pop(block_hash, None)
            if slot is not None:
                self.free.append(slot)
