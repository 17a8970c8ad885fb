"""The block manager: KV-cache memory handed out in fixed-size blocks, like OS pages.

Pure Python, no tensors: it only decides *which* physical block holds which
tokens. The model runner turns its block tables into slot numbers.

    sequence tokens:   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    logical block:          0      |      1      |   2
    block table:      [     7      ,      3      ,   12  ]   (physical block ids)
    slot of token p:  block_table[p // block_size] * block_size + p % block_size

Block 0 is the *null block*: never handed out, it pads block tables to a common
width in a batch, so a padded entry always points at memory that exists.

Every block is in exactly one of two states:
    free       ref_count == 0, in the free queue
    in use     ref_count  > 0, in at least one block table
Allocation pops from the front of the free queue and freeing appends at the
back, both O(1); a sequence's blocks are freed tail first, so that when blocks
carry cached content (prefix caching) the tail of a chain is reused before its
head.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

NULL_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block and at least one more")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(1, num_blocks))
        self.block_tables: dict[Hashable, list[int]] = {}

    # -- queries ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.block_tables[seq_id]

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self.block_tables

    def usage(self) -> float:
        """Fraction of usable blocks that some sequence holds."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    # -- allocation --------------------------------------------------------------
    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Give a new sequence a block table that covers `num_tokens` tokens.

        Returns the table, or None (and changes nothing) when memory is short.
        """
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        needed = self.blocks_for(num_tokens)
        if needed > self.num_free_blocks:
            return None
        table = [self._take_free_block() for _ in range(needed)]
        self.block_tables[seq_id] = table
        return table

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

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks, tail first. Unknown ids are ignored."""
        table = self.block_tables.pop(seq_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue.append(block_id)

    def _take_free_block(self) -> int:
        block_id = self.free_queue.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    # -- checking ----------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests call this)."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is in the free queue twice"
        assert NULL_BLOCK not in free, "the null block is in the free queue"
        assert self.ref_counts[NULL_BLOCK] == 0, "the null block is referenced"
        held = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                held[block_id] += 1
        for block_id in range(1, self.num_blocks):
            count = self.ref_counts[block_id]
            assert count >= 0, f"block {block_id} has ref count {count}"
            assert count == held[block_id], (
                f"block {block_id}: ref count {count} but held by {held[block_id]} tables"
            )
            assert (count == 0) == (block_id in free), (
                f"block {block_id}: ref count {count}, free={block_id in free}"
            )
