"""Sliding windows give memory back: BlockManager.free_outside_window releases
the blocks no future query can see, exactly, and the engine serving an
all-sliding model holds only about a window's worth of blocks per sequence."""

from __future__ import annotations

import pytest

from engine.core.block_manager import NULL_BLOCK, BlockManager
from tiny_models import WINDOW, make_tiny_family


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


def held_blocks_over_a_long_sequence(path, **engine_args) -> list[tuple[int, int]]:
    """(full pool, window pool) blocks held after every step of one 240-token
    prompt + 60 output tokens (the window pool is 0 for a model with one pool)."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    # 4 MB of KV: a few thousand blocks, far more than the 75 one sequence
    # takes. Why not the default 1 GiB: the tiny model's blocks are ~1.5 KB,
    # so it makes ~700k of them, and check_invariants walks every block after
    # every step (it was 60 % of this module's minute and a half).
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4,
                                    max_num_batched_tokens=64, enable_prefix_caching=False,
                                    kv_cache_memory_bytes=4 << 20, **engine_args))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("long", list(range(100, 340)), params)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        manager = engine.block_manager
        window = getattr(manager, "window", None)
        held.append((manager.num_usable_blocks - manager.num_free_blocks,
                     window.num_usable_blocks - window.num_free_blocks if window else 0))
        manager.check_invariants()
    return held


WINDOW_BLOCKS = -(-WINDOW // 4) + 1  # the window, plus the block being written


def test_an_all_sliding_model_holds_a_window_of_blocks(tmp_path, smollm2_path, single_thread):
    sliding = [full for full, _ in held_blocks_over_a_long_sequence(
        make_tiny_family(tmp_path / "mistral", "mistral-sliding", smollm2_path))]
    full = [full for full, _ in held_blocks_over_a_long_sequence(
        make_tiny_family(tmp_path / "qwen3", "qwen3", smollm2_path))]
    assert max(sliding[:-1]) <= WINDOW_BLOCKS + 64 // 4  # a 64-token chunk is written whole
    assert sliding[-2] <= WINDOW_BLOCKS
    assert full[-2] == -(-(240 + 59) // 4)  # every token's block, to the end


def test_a_gemma3_holds_a_window_of_blocks_in_its_sliding_layers(tmp_path, smollm2_path,
                                                                  single_thread):
    """Gemma 3 (sliding, global, sliding): the global layer keeps every block, the
    two sliding layers a window's worth; with one pool (the hybrid manager off)
    all three layers keep every block. Layer-blocks held = K/V memory."""
    path = make_tiny_family(tmp_path / "gemma3", "gemma3", smollm2_path)
    hybrid = held_blocks_over_a_long_sequence(path)
    one_pool = held_blocks_over_a_long_sequence(path, disable_hybrid_kv_cache_manager=True)
    all_tokens = -(-(240 + 59) // 4)
    full, window = hybrid[-2]
    assert full == all_tokens and window <= WINDOW_BLOCKS
    assert max(w for _, w in hybrid[:-1]) <= WINDOW_BLOCKS + 64 // 4
    assert one_pool[-2] == (all_tokens, 0)
    layer_blocks_hybrid = full * 1 + window * 2
    layer_blocks_one_pool = all_tokens * 3
    assert layer_blocks_hybrid < 0.4 * layer_blocks_one_pool
