"""The disk tier: one file per block record, least recently used evicted first.

    <directory>/<namespace, ":" -> "-">/<block hash hex>.kv     one record each
                                       /<block hash hex>.<pid>.tmp  a write in flight

Why files and not one big file: a block is written once and read whole, so
the filesystem is already the allocator and the index; eviction is an unlink,
and a crash can cost at most the files being written.

A write goes to a temporary file that `os.replace` renames into place, so a
reader never sees half a record under its final name. There is no fsync: a
file torn by a power cut fails the record's length or checksum check
(engine/core/kv_offload/record.py) and is a miss, which is all a cache owes.

The index lives in memory (hash -> file size, least recently used first) and
is rebuilt at start from the files, oldest mtime first, so a restarted
replica keeps its disk tier. A hit touches its file's mtime, so that order
is the order of use, not of writing.

File I/O runs outside `self.lock` (the engine thread's `contains` and the
stats must not wait on a disk): a store reserves its bytes under the lock,
writes, then indexes. A disk that refuses a write (full, quota, read-only,
permission, I/O error) disables the tier with one warning: retrying every
block would only fill the log, and the other tiers go on.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from engine.core.kv_offload import record
from engine.core.kv_offload.tier import Tier

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"


class DiskTier(Tier):
    name = "disk"
    remote = False  # this replica's own: the offload manager asks it before storing

    def __init__(self, namespace: str, directory: str | Path, capacity_bytes: int) -> None:
        super().__init__(namespace, capacity_bytes)
        self.folder = Path(directory) / namespace.replace(":", "-")
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, LRU first
        self._used = 0  # sum of self._sizes
        self._reserved = 0  # bytes of writes in flight, not yet indexed
        self._writing: set[bytes] = set()  # hashes being written now
        self._warned = False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            found = self._scan()
        except OSError as exc:
            self._disable(exc)
            return
        with self.lock:
            for block_hash, size in found:
                self._sizes[block_hash] = size
                self._used += size
            victims = self._make_room(0)
        self._unlink(victims)
        if found:
            logger.info("disk tier: %d blocks (%d bytes) found in %s", len(self._sizes),
                        self._used, self.folder)

    # -- start ------------------------------------------------------------------------
    def _scan(self) -> list[tuple[bytes, int]]:
        """(hash, size) of the folder's records, oldest mtime first; stale temp files removed.

        A temp file at start is a write that a crash or kill interrupted: it can
        never be completed, only leak space.
        """
        found = []
        for entry in os.scandir(self.folder):
            name = entry.name
            try:
                if name.endswith(TEMP_SUFFIX):
                    os.unlink(entry.path)
                elif name.endswith(SUFFIX):
                    block_hash = _hash_of(name)
                    if block_hash is not None:
                        info = entry.stat()
                        found.append((info.st_mtime_ns, name, block_hash, info.st_size))
            except OSError as exc:  # removed meanwhile (another replica on the folder), ...
                logger.debug("disk tier: skipping %s at start: %r", entry.path, exc)
        found.sort()
        return [(block_hash, size) for _, _, block_hash, size in found]

    # -- the Tier hooks -----------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def _contains(self, block_hash: bytes) -> bool:
        return block_hash in self._sizes

    def _load(self, block_hash: bytes) -> memoryview | None:
        if block_hash not in self._sizes:  # not ours: no system call for a miss
            return None
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed behind our back
            self._forget(block_hash)
            return None
        except OSError as exc:
            logger.debug("disk tier: reading %s failed: %r", path, exc)
            with self.lock:
                self.stats.errors += 1
            return None
        payload = record.decode(self.namespace, block_hash, data)
        if payload is None:
            self._forget(block_hash)
            self._unlink([path])
            self._bad_record()
            return None
        with self.lock:
            if block_hash in self._sizes:
                self._sizes.move_to_end(block_hash)
        _touch(path)
        return payload

    def _store(self, block_hash: bytes, data: bytes) -> bool:
        size = len(data)
        with self.lock:
            known = block_hash in self._sizes
            if known:  # the same hash is the same content: no rewrite
                self._sizes.move_to_end(block_hash)
            elif block_hash in self._writing:  # another thread is writing it now
                return False
            else:
                victims = self._make_room(size)
                self._reserved += size
                self._writing.add(block_hash)
        if known:
            _touch(self._path(block_hash))
            return True
        self._unlink(victims)
        written = self._write(block_hash, data)
        with self.lock:
            self._reserved -= size
            self._writing.discard(block_hash)
            if written:
                self._sizes[block_hash] = size
                self._used += size
        return written

    # -- files ----------------------------------------------------------------------------
    def _path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}{SUFFIX}"

    def _write(self, block_hash: bytes, data: bytes) -> bool:
        """Write the record under a temporary name, then rename it into place."""
        temp = self.folder / f"{block_hash.hex()}.{os.getpid()}{TEMP_SUFFIX}"
        try:
            with open(temp, "wb") as file:
                file.write(data)
            os.replace(temp, self._path(block_hash))
        except OSError as exc:
            try:
                temp.unlink()
            except OSError:
                pass
            self._disable(exc)
            return False
        return True

    def _make_room(self, size: int) -> list[Path]:
        """Drop least recently used entries until `size` more bytes fit; the caller holds
        the lock and unlinks the returned files after releasing it."""
        victims = []
        while self._sizes and self._used + self._reserved + size > self.capacity_bytes:
            block_hash, old = self._sizes.popitem(last=False)
            self._used -= old
            self.stats.evictions += 1
            victims.append(self._path(block_hash))
        return victims

    def _unlink(self, paths: list[Path]) -> None:
        for path in paths:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # the file stays on disk, out of our accounting
                logger.debug("disk tier: removing %s failed: %r", path, exc)
                with self.lock:
                    self.stats.errors += 1

    def _forget(self, block_hash: bytes) -> None:
        with self.lock:
            size = self._sizes.pop(block_hash, None)
            if size is not None:
                self._used -= size

    def _disable(self, exc: OSError) -> None:
        """Stop using the disk, with one warning however many writes fail at once."""
        with self.lock:
            self.stats.errors += 1
            self.enabled = False
            warn, self._warned = not self._warned, True
        if warn:
            logger.warning("disk tier disabled: %s is not usable (%s); blocks are no longer "
                           "offloaded to disk", self.folder, exc)


def _hash_of(name: str) -> bytes | None:
    """The block hash a record file is named after; None for a foreign name."""
    stem = name[:-len(SUFFIX)]
    if len(stem) != 2 * record.HASH_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def _touch(path: Path) -> None:
    """Mark a file used now, so a restart reads the LRU order back (best effort)."""
    try:
        os.utime(path)
    except OSError:
        pass
