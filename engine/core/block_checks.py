"""The block manager's invariants, checked from outside (the tests call it
after every scenario): each block is held or free, never both; ref counts
equal the block tables that hold a block; the hash table and the free
queues agree. Block tables may hold the null block where a sliding window
released a block; it is never counted."""

from __future__ import annotations

NULL_BLOCK = 0  # never handed out: it pads block tables (block_manager.py)


def check_invariants(manager) -> None:
    """Raise AssertionError when the bookkeeping is inconsistent."""
    queues = [list(manager.free_queue), list(manager.cached_free), list(manager.popular_free)]
    free = [b for queue in queues for b in queue]
    assert len(set(free)) == len(free), "a block is in the free queues twice"
    free_set = set(free)
    assert NULL_BLOCK not in free_set, "the null block is in a free queue"
    assert manager.ref_counts[NULL_BLOCK] == 0, "the null block is referenced"
    held = [0] * manager.num_blocks
    for table in manager.block_tables.values():
        for block_id in table:
            held[block_id] += 1
    for block_id in range(1, manager.num_blocks):
        count = manager.ref_counts[block_id]
        assert count >= 0, f"block {block_id} has ref count {count}"
        assert count == held[block_id], (
            f"block {block_id}: ref count {count} but held by {held[block_id]} tables"
        )
        assert (count == 0) == (block_id in free_set), (
            f"block {block_id}: ref count {count}, free={block_id in free_set}"
        )
    for block_id in manager.free_queue:
        assert manager.block_hashes[block_id] is None, f"empty block {block_id} has a hash"
    for block_id in [*manager.cached_free, *manager.popular_free]:
        assert manager.block_hashes[block_id] is not None, f"cached block {block_id} lost its hash"
    for block_hash, block_id in manager.cached.items():
        assert manager.block_hashes[block_id] == block_hash, f"hash table wrong for {block_id}"
    popular_cached = sum(h in manager.cached for h in manager.popular_hashes)
    assert manager.num_popular_cached == popular_cached, "popular count out of step"
