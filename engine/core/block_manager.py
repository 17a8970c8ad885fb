"""The block manager: KV-cache memory handed out in fixed-size blocks, like OS pages.

Pure Python, no tensors: it only decides *which* physical block holds which
tokens. The model runner turns its block tables into slot numbers.

    sequence tokens:   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    logical block:          0      |      1      |   2
    block table:      [     7      ,      3      ,   12  ]   (physical block ids)
    slot of token p:  block_table[p // block_size] * block_size + p % block_size

Block 0 is the *null block*: never handed out, it pads block tables to a common
width in a batch, so a padded entry always points at memory that exists.

Prefix caching. A full block whose K/V have been computed is registered under
the hash of its content (engine/core/block_hash.py). A new sequence whose first
blocks hash the same reuses them (ref count + 1) instead of computing them.
When nobody holds a cached block any more it is not wiped: it waits in a free
queue, still findable, until its memory is needed. Free blocks sit in three
queues, taken in this order when a block is needed:

    empty         no content worth keeping                 (deque, O(1))
    cached        content hashed, least recently used first (OrderedDict, O(1))
    popular       cached prefixes marked popular (the fleet registry), LRU, last

A sequence frees its blocks tail first, so the deepest block of a chain is
evicted before its parents: a prefix is only useful from its head.

Every block is in exactly one state: held (ref_count > 0, in >= 1 block table)
or free (ref_count == 0, in exactly one of the three queues).

A model mixing sliding and global layers keeps a second pool for its sliding
layers (engine/core/hybrid_blocks.py); `window_table` and `take_window_copies`
are that pool's, empty here. With `record_events`, each change to the cached
hashes is logged as a KV event (engine/core/kv_events.py).
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from engine.core.block_checks import NULL_BLOCK, check_invariants
from engine.core.kv_events import AllBlocksCleared, add_removed, stored_events


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of those, tokens found cached
    evictions: int = 0  # cached blocks whose content was dropped to reuse the memory


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        max_popular_share: float = 0.5,
        record_events: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        """`sliding_window`: every layer of the model attends only to that many
        most recent tokens, so blocks behind it can be released (free_outside_window)."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block and at least one more")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # content hash -> block id
        self.free_queue: deque[int] = deque(range(1, num_blocks))  # empty blocks
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.popular_free: OrderedDict[int, None] = OrderedDict()
        self.popular_hashes: set[bytes] = set()
        self.num_popular_cached = 0  # of popular_hashes, how many a block holds now
        self.max_popular_blocks = int(max_popular_share * (num_blocks - 1))
        self.block_tables: dict[Hashable, list[int]] = {}
        # Per sequence, how far cache_full_blocks has looked: [number of table
        # entries scanned, ascending indices among them left unregistered].
        self._registration: dict[Hashable, list] = {}
        self.stats = CacheStats()
        # KV events not yet taken by the engine (take_events); None when off.
        self.events: list | None = [] if record_events else None

    # -- queries ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included: they can be taken at any time."""
        return len(self.free_queue) + len(self.cached_free) + len(self.popular_free)

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.block_tables[seq_id]

    def window_table(self, seq_id: Hashable) -> list[int] | None:
        return None  # no pool of its own for sliding layers (hybrid_blocks.py has one)

    def take_window_copies(self) -> list[tuple[int, int]]:
        return []  # (hybrid_blocks.py: the sliding pool's copies on write)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self.block_tables

    def usage(self) -> float:
        """Fraction of usable blocks that some sequence holds."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    # -- prefix cache ------------------------------------------------------------
    def find_cached_prefix(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        """Block ids of the longest cached run of `block_hashes` from the start. The
        last of the `num_tokens` is always left out: the model must compute it
        for there to be logits to sample."""
        if not self.enable_caching:
            return []
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        return self.cached_run(block_hashes[:limit])

    def cached_run(self, block_hashes: Iterable[bytes]) -> list[int]:
        """Block ids holding the leading run of `block_hashes` that is cached now."""
        hits = []
        for block_hash in block_hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq_id: Hashable, block_hashes: list[bytes],
                          num_computed_tokens: int, *,
                          token_slice: Callable[[int, int], list[int]] | None = None,
                          cache_salt: bytes = b"") -> None:
        """Register the sequence's full, computed blocks under their hashes.

        As if every full, computed block were tried, in order, at every call: a
        block whose content another block holds stays unregistered and is tried
        again later (it takes the hash over once that copy is evicted). Only
        tries that can change anything are made, so a decode step looks at no
        block, or at the one it just filled. `token_slice(start, end)` gives the
        tokens the BlockStored events carry, `cache_salt` the sequence's tenant
        (kv_events.tenant_tag); both read only when events are recorded.
        """
        if not self.enable_caching:
            return
        table = self.block_tables[seq_id]
        progress = self._registration.get(seq_id)
        if progress is None:
            progress = self._registration[seq_id] = [0, []]
        scanned, pending = progress
        if not pending and (num_computed_tokens // self.block_size <= scanned
                            or len(block_hashes) <= scanned):
            return  # nothing new is full and computed (the usual decode step)
        count = min(len(block_hashes), num_computed_tokens // self.block_size, len(table))
        fresh = None
        if self.events is not None:  # the entries to try that no hash holds yet
            fresh = [i for i in (*pending, *range(scanned, count))
                     if i < count and self.block_hashes[table[i]] is None]
        unregistered = []
        for i in pending:  # ascending and below `scanned`: the same order as one full pass
            if i >= count or not self._register(table[i], block_hashes[i]):
                unregistered.append(i)
        for i in range(scanned, count):
            if not self._register(table[i], block_hashes[i]):
                unregistered.append(i)
        progress[0] = max(scanned, count)
        progress[1] = unregistered
        if fresh:  # those hashed now were put in the cache by this call
            new = [i for i in fresh if self.block_hashes[table[i]] is not None]
            self.events += stored_events(new, block_hashes, self.block_size, token_slice,
                                         cache_salt)

    def cache_loaded_blocks(self, entries: list[tuple[int, int]], block_hashes: list[bytes],
                            token_slice: Callable[[int, int], list[int]] | None = None,
                            cache_salt: bytes = b"") -> None:
        """Register blocks whose K/V were just loaded from an offload tier, given as
        (index in the `block_hashes` chain, block id); a hash cached meanwhile stays put."""
        new = [i for i, block_id in entries if self._register(block_id, block_hashes[i])]
        if self.events is not None and new:
            self.events += stored_events(new, block_hashes, self.block_size, token_slice,
                                         cache_salt)

    def _register(self, block_id: int, block_hash: bytes) -> bool:
        """Put a held block in the cache under its hash; False if another block has it."""
        if block_id == NULL_BLOCK:
            return True  # released by the sliding window after it was computed
        if self.block_hashes[block_id] is not None:
            return True  # already registered (a hit, or an earlier step)
        if block_hash in self.cached:
            return False  # the same content was computed elsewhere first; keep that copy
        self.block_hashes[block_id] = block_hash
        self.cached[block_hash] = block_id
        self.num_popular_cached += block_hash in self.popular_hashes
        return True

    def set_popular(self, block_hashes: Iterable[bytes]) -> int:
        """Mark prefixes popular (evicted last), up to the bounded share. Returns how many.

        Replaces the previous set. Hashes not cached yet count from the moment
        a block computes them (the fleet's warm-up prefills them next).
        """
        self.popular_hashes = set()
        for block_hash in block_hashes:
            if len(self.popular_hashes) >= self.max_popular_blocks:
                break
            self.popular_hashes.add(block_hash)
        self.num_popular_cached = sum(h in self.cached for h in self.popular_hashes)
        for queue, popular in ((self.cached_free, True), (self.popular_free, False)):
            for block_id in list(queue):  # re-file free blocks whose status changed
                if (self.block_hashes[block_id] in self.popular_hashes) == popular:
                    del queue[block_id]
                    self._file_free_block(block_id)
        return len(self.popular_hashes)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence holds. Returns how many.
        Logs AllBlocksCleared even when nothing was cached, as vLLM does."""
        dropped = 0
        for queue in (self.cached_free, self.popular_free):
            while queue:
                block_id, _ = queue.popitem(last=False)
                self._drop_hash(block_id)
                self.free_queue.append(block_id)
                dropped += 1
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return dropped

    # -- events ------------------------------------------------------------------
    def take_events(self) -> list:
        """The events logged since the last call, oldest first (none when off)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    # -- allocation --------------------------------------------------------------
    def allocate(
        self, seq_id: Hashable, num_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Give a new sequence a block table covering `num_tokens` tokens.

        `cached_blocks` (find_cached_prefix) head the table, fresh blocks follow.
        Returns the table, or None (changing nothing) when memory is short.
        """
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        cached_blocks = cached_blocks or []
        fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        # A hit on a free cached block takes it out of the free queues too.
        reclaimed = sum(1 for b in cached_blocks if b != NULL_BLOCK and self.ref_counts[b] == 0)
        if fresh + reclaimed > self.num_free_blocks:
            return None
        for block_id in cached_blocks:  # the null block: left by a window (hybrid_blocks.py)
            if block_id != NULL_BLOCK:
                self._hold(block_id)
        table = cached_blocks + [self._take_free_block() for _ in range(fresh)]
        self.block_tables[seq_id] = table
        self._registration.pop(seq_id, None)
        return table

    def record_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_cached_tokens

    def append_slots(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Grow a sequence's table so that it covers `num_tokens` tokens in all.

        Returns the newly added block ids (often none), or None (and changes
        nothing) when memory is short: the scheduler then preempts.
        """
        table = self.block_tables[seq_id]
        needed = self.blocks_for(num_tokens) - len(table)
        if needed <= 0:
            return []
        if needed > self.num_free_blocks:
            return None
        new_blocks = [self._take_free_block() for _ in range(needed)]
        table.extend(new_blocks)
        return new_blocks

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> list[int]:
        """Share the parent's blocks covering `num_tokens` with a new child (n > 1)."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        table = self.block_tables[parent_id][: self.blocks_for(num_tokens)]
        for block_id in table:
            self.ref_counts[block_id] += block_id != NULL_BLOCK
        self.block_tables[child_id] = list(table)
        self._registration.pop(child_id, None)
        return self.block_tables[child_id]

    def is_shared(self, seq_id: Hashable, block_index: int) -> bool:
        table = self.block_tables[seq_id]
        return block_index < len(table) and self.ref_counts[table[block_index]] > 1

    def copy_on_write(self, seq_id: Hashable, block_index: int) -> tuple[int, int] | None:
        """Give the sequence a private copy of a shared block before it writes into it.

        Returns (source, destination) for the model runner to copy, or None
        (changing nothing) when no block is free.
        """
        if not self.num_free_blocks:
            return None
        table = self.block_tables[seq_id]
        source = table[block_index]
        destination = self._take_free_block()
        self.ref_counts[source] -= 1  # still held by the others: it cannot reach zero
        table[block_index] = destination
        progress = self._registration.get(seq_id)
        if progress is not None and block_index < progress[0] and block_index not in progress[1]:
            insort(progress[1], block_index)  # the new copy is unregistered: scan it again
        return source, destination

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks, tail first. Unknown ids are ignored."""
        table = self.block_tables.pop(seq_id, None)
        self._registration.pop(seq_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            self._release(block_id)

    def free_outside_window(self, seq_id: Hashable, num_computed_tokens: int) -> int:
        """Release the blocks no future query can see (with window W the token at p
        reads p - W + 1 .. p): their entries become the null block, which the
        kernels skip before the window; cached ones stay findable."""
        if self.sliding_window is None:
            return 0
        table = self.block_tables[seq_id]
        first_live = max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size
        released = 0
        for i in range(min(first_live, len(table))):  # head first: heads are older
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK
                released += 1
        return released

    def _release(self, block_id: int) -> None:
        if block_id == NULL_BLOCK:  # a slot released by the sliding window
            return
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._file_free_block(block_id)

    # -- internals ---------------------------------------------------------------
    def _file_free_block(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is None:
            self.free_queue.append(block_id)
        elif block_hash in self.popular_hashes:
            self.popular_free[block_id] = None
        else:
            self.cached_free[block_id] = None

    def _take_free_block(self) -> int:
        """The free block of lowest future utility: empty, then LRU cached, then popular."""
        if self.free_queue:
            block_id = self.free_queue.popleft()
        else:
            queue = self.cached_free or self.popular_free
            block_id, _ = queue.popitem(last=False)
            if self.events is not None:
                add_removed(self.events, self.block_hashes[block_id])
            self._drop_hash(block_id)
            self.stats.evictions += 1
        self.ref_counts[block_id] = 1
        return block_id

    def _hold(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            self.cached_free.pop(block_id, None)
            self.popular_free.pop(block_id, None)
        self.ref_counts[block_id] += 1

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None and self.cached.get(block_hash) == block_id:
            del self.cached[block_hash]
            self.num_popular_cached -= block_hash in self.popular_hashes
        self.block_hashes[block_id] = None

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests call this)."""
        check_invariants(self)
