"""Two KV pools for a model that mixes sliding-window and global layers (Gemma 2/3).

A global layer reads every earlier token, a sliding layer only the last W. With
one block table for all layers, a block could only be released once *no* layer
needs it -- never, for Gemma. So the layers are split in two KV-cache groups,
as vLLM's hybrid allocator does, each with its own pool and block table:

    token blocks:       b0    b1    b2    b3    b4    b5    (window W = 2 blocks)
    full group table:  [ 7  ,  3  , 12  ,  9  ,  4  , 15 ]   global layers: all kept
    window group table:[ 0  ,  0  ,  0  ,  0  , 21  ,  8 ]   sliding layers: the null
                                                             block where the window left

Both tables have one entry per logical block and grow together; the window
group releases (and nulls) its entries as they leave the window, exactly as an
all-sliding model's single table does (BlockManager.free_outside_window).
The full group is this object itself (a BlockManager: the scheduler's budget,
the prefix cache's statistics and KV events are its); the window group is
`self.window`, a second BlockManager with the window set.

Prefix caching: both pools register a computed block under the same hash. A
cached prefix of h blocks is reusable only if the window group still holds the
blocks the next token reads (the ones the window spans before position h x
block_size); older window blocks are not needed and become the null block.
find_cached_prefix shortens the hit until that holds.

Copy on write (parallel samples): a forked child shares both tables; a block
shared in the window group is shared in the full group too, so the scheduler
asks the full group and the window group's copies ride along
(take_window_copies).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

from engine.core.block_checks import NULL_BLOCK
from engine.core.block_manager import BlockManager


class HybridBlockManager(BlockManager):
    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int,
                 window: int, enable_caching: bool = False, max_popular_share: float = 0.5,
                 record_events: bool = False) -> None:
        """`num_blocks` for the global layers, `num_window_blocks` for the sliding
        layers, whose window is `window` tokens."""
        super().__init__(num_blocks, block_size, enable_caching, max_popular_share,
                         record_events)
        self.window = BlockManager(num_window_blocks, block_size, enable_caching,
                                   max_popular_share, sliding_window=window)
        self.window_copies: list[tuple[int, int]] = []

    def window_table(self, seq_id: Hashable) -> list[int] | None:
        return self.window.block_tables[seq_id]

    def take_window_copies(self) -> list[tuple[int, int]]:
        copies, self.window_copies = self.window_copies, []
        return copies

    # -- prefix cache ------------------------------------------------------------
    def find_cached_prefix(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        hits = super().find_cached_prefix(block_hashes, num_tokens)
        count = len(hits)
        while count:
            missing = self._missing_window_block(block_hashes, count)
            if missing is None:
                break
            count = missing  # any longer hit would need that block too
        return hits[:count]

    def _missing_window_block(self, block_hashes: list[bytes], count: int) -> int | None:
        """The last block the window group lacks for a hit of `count` blocks, or None."""
        for index in range(count - 1, self._first_live(count) - 1, -1):
            if block_hashes[index] not in self.window.cached:
                return index
        return None

    def _first_live(self, count: int) -> int:
        """The first block the token after a `count`-block hit reads in a sliding layer."""
        return max(0, count * self.block_size - self.window.sliding_window + 1) // self.block_size

    def cache_full_blocks(self, seq_id: Hashable, block_hashes: list[bytes],
                          num_computed_tokens: int, *,
                          token_slice: Callable[[int, int], list[int]] | None = None,
                          cache_salt: bytes = b"") -> None:
        super().cache_full_blocks(seq_id, block_hashes, num_computed_tokens,
                                  token_slice=token_slice, cache_salt=cache_salt)
        self.window.cache_full_blocks(seq_id, block_hashes, num_computed_tokens)

    def cache_loaded_blocks(self, entries, block_hashes, token_slice=None, cache_salt=b"") -> None:
        raise NotImplementedError("the KV offload tiers hold one pool's blocks: a model "
                                  "with two KV groups runs them with one (see LLMEngine)")

    def set_popular(self, block_hashes: Iterable[bytes]) -> int:
        block_hashes = list(block_hashes)
        self.window.set_popular(block_hashes)
        return super().set_popular(block_hashes)

    def reset_prefix_cache(self) -> int:
        self.window.reset_prefix_cache()
        return super().reset_prefix_cache()

    # -- allocation --------------------------------------------------------------
    def allocate(self, seq_id: Hashable, num_tokens: int,
                 cached_blocks: list[int] | None = None) -> list[int] | None:
        cached_blocks = cached_blocks or []
        window_hits = self._window_hits(cached_blocks)
        fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        reclaimed = sum(1 for b in window_hits if b != NULL_BLOCK and self.window.ref_counts[b] == 0)
        if fresh + reclaimed > self.window.num_free_blocks:
            return None
        table = super().allocate(seq_id, num_tokens, cached_blocks)
        if table is not None:
            self.window.allocate(seq_id, num_tokens, window_hits)
        return table

    def _window_hits(self, cached_blocks: list[int]) -> list[int]:
        """The window group's blocks of a hit in the full group (find_cached_prefix
        checked they exist): the null block before the window."""
        first_live = self._first_live(len(cached_blocks))
        return [self.window.cached[self.block_hashes[block_id]] if index >= first_live
                else NULL_BLOCK for index, block_id in enumerate(cached_blocks)]

    def append_slots(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        needed = self.blocks_for(num_tokens) - len(self.block_tables[seq_id])
        if needed > self.window.num_free_blocks:
            return None
        new_blocks = super().append_slots(seq_id, num_tokens)
        if new_blocks:
            self.window.append_slots(seq_id, num_tokens)
        return new_blocks

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> list[int]:
        self.window.fork(parent_id, child_id, num_tokens)
        return super().fork(parent_id, child_id, num_tokens)

    def copy_on_write(self, seq_id: Hashable, block_index: int) -> tuple[int, int] | None:
        copy_window = self.window.is_shared(seq_id, block_index)
        if not self.num_free_blocks or (copy_window and not self.window.num_free_blocks):
            return None
        if copy_window:
            self.window_copies.append(self.window.copy_on_write(seq_id, block_index))
        return super().copy_on_write(seq_id, block_index)

    def free(self, seq_id: Hashable) -> None:
        self.window.free(seq_id)
        super().free(seq_id)

    def free_outside_window(self, seq_id: Hashable, num_computed_tokens: int) -> int:
        return self.window.free_outside_window(seq_id, num_computed_tokens)

    def check_invariants(self) -> None:
        super().check_invariants()
        self.window.check_invariants()
        for seq_id, table in self.block_tables.items():
            window_table = self.window.block_tables[seq_id]
            assert len(window_table) == len(table), f"{seq_id!r}: the two tables differ in length"
            for index, block_id in enumerate(window_table):
                assert not (self.window.ref_counts[block_id] > 1 >= self.ref_counts[table[index]]), (
                    f"{seq_id!r}: block {index} is shared in the window group only")
        assert set(self.window.block_tables) == set(self.block_tables), "the groups hold other sequences"
