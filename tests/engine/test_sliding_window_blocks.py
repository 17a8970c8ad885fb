"""Sliding windows give memory back: BlockManager.free_outside_window releases
the blocks no future query can see, exactly, and the engine serving an
all-sliding model holds only about a window's worth of blocks per sequence."""

from __future__ import annotations

import pytest

from engine.core.block_manager import NULL_BLOCK, BlockManager


def manager(window, num_blocks=16, block_size=4, caching=True) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_caching=caching, sliding_window=window)


def test_blocks_behind_the_window_are_released_head_first():
    bm = manager(window=6)
    bm.allocate("a", 20)  # blocks 1..5 cover positions 0..19
    # 20 tokens computed: the next token (position 20) reads positions 15..20,
    # so blocks 0..2 (positions 0..11) are dead; block 3 (12..15) is live.
    assert bm.free_outside_window("a", 20) == 3
    assert bm.block_table("a") == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4, 5]
    assert list(bm.free_queue)[-3:] == [1, 2, 3]
    bm.check_invariants()
    assert bm.free_outside_window("a", 20) == 0  # nothing more until the window moves
    bm.append_slots("a", 24)
    assert bm.free_outside_window("a", 23) == 1  # position 23 reads 18..23: block 3 is dead
    bm.check_invariants()
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.parametrize("computed, released", [(0, 0), (7, 0), (8, 1), (11, 1), (12, 2), (16, 3)])
def test_the_boundary(computed, released):
    """Window 5, blocks of 4: the next token at p reads p-4..p, so block i
    (positions 4i..4i+3) is dead once 4i + 3 < computed - 4."""
    bm = manager(window=5)
    bm.allocate("a", 16)
    assert bm.free_outside_window("a", computed) == released


def test_without_a_window_nothing_is_released():
    bm = manager(window=None)
    bm.allocate("a", 20)
    assert bm.free_outside_window("a", 20) == 0
    assert NULL_BLOCK not in bm.block_table("a")


def test_released_cached_blocks_stay_findable_and_forks_skip_the_null_block():
    bm = manager(window=4)
    hashes = [bytes([i]) * 32 for i in range(4)]
    bm.allocate("a", 16)
    bm.cache_full_blocks("a", hashes, 16)
    bm.free_outside_window("a", 16)  # next token at 16 reads 13..16: blocks 0..2 dead
    assert bm.block_table("a")[:3] == [NULL_BLOCK] * 3
    assert bm.find_cached_prefix(hashes, 17) == [1, 2, 3, 4]  # all still cached
    bm.fork("a", "b", 16)
    assert bm.ref_counts[NULL_BLOCK] == 0 and bm.ref_counts[4] == 2
    bm.cache_full_blocks("b", hashes, 16)  # null entries are never registered
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    bm.check_invariants()


def held_blocks_over_a_long_sequence(path) -> list[int]:
    """Blocks held after every step of one 240-token prompt + 60 output tokens."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4,
                                    max_num_batched_tokens=64, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("long", list(range(100, 340)), params)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        manager = engine.block_manager
        held.append(manager.num_usable_blocks - manager.num_free_blocks)
        manager.check_invariants()
    return held


def test_an_all_sliding_model_holds_a_window_of_blocks(tmp_path, smollm2_path, single_thread):
    from tiny_models import WINDOW, make_tiny_family

    sliding = held_blocks_over_a_long_sequence(
        make_tiny_family(tmp_path / "mistral", "mistral-sliding", smollm2_path))
    full = held_blocks_over_a_long_sequence(
        make_tiny_family(tmp_path / "qwen3", "qwen3", smollm2_path))
    window_blocks = -(-WINDOW // 4) + 1  # the window, plus the block being written
    assert max(sliding[:-1]) <= window_blocks + 64 // 4  # a 64-token chunk is written whole
    assert sliding[-2] <= window_blocks
    assert full[-2] == -(-(240 + 59) // 4)  # every token's block, to the end
