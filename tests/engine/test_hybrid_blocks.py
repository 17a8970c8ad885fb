"""The two KV pools of a model mixing sliding and global layers (engine/core/hybrid_blocks.py):
exact bookkeeping of both block tables, prefix hits that need the window's blocks,
copy on write in both pools, and the engine holding a window of blocks for its
sliding layers only."""

from __future__ import annotations

from engine.core.block_manager import NULL_BLOCK
from engine.core.hybrid_blocks import HybridBlockManager


def manager(num_blocks=32, num_window=16, block_size=4, window=6) -> HybridBlockManager:
    return HybridBlockManager(num_blocks, num_window, block_size, window, enable_caching=True)


def hashes(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def test_both_tables_grow_together_and_only_the_window_releases():
    bm = manager()
    bm.allocate("a", 20)
    assert len(bm.block_table("a")) == len(bm.window_table("a")) == 5
    # the next token (20) reads 15..20: window blocks 0..2 are dead, all full blocks live
    assert bm.free_outside_window("a", 20) == 3
    assert bm.window_table("a")[:3] == [NULL_BLOCK] * 3
    assert NULL_BLOCK not in bm.block_table("a")
    assert bm.append_slots("a", 24) is not None
    assert len(bm.block_table("a")) == len(bm.window_table("a")) == 6
    bm.check_invariants()
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert bm.window.num_free_blocks == bm.window.num_usable_blocks


def test_a_short_window_pool_refuses_without_changing_anything():
    bm = manager(num_window=4)  # 3 usable window blocks
    assert bm.allocate("a", 16) is None  # 4 blocks: the full pool has them, the window not
    assert not bm.has("a") and not bm.window.has("a")
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.allocate("b", 12)
    assert bm.append_slots("b", 13) is None
    assert len(bm.block_table("b")) == len(bm.window_table("b")) == 3
    bm.check_invariants()



def test_the_window_pool_gives_its_last_free_block():
    """At the boundary: a request for exactly the window blocks left is served
    (allocation and growth alike); one more is refused."""
    bm = manager(num_window=5)  # 4 usable window blocks
    assert bm.allocate("a", 16) is not None  # all 4
    bm.free("a")
    assert bm.allocate("b", 12) is not None  # 3 of 4
    assert bm.window.num_free_blocks == 1
    assert bm.append_slots("b", 13) is not None  # the last one
    assert bm.window.num_free_blocks == 0
    assert bm.append_slots("b", 17) is None
    bm.check_invariants()


def cached_window_hit(window_taken: int) -> tuple[HybridBlockManager, list[int]]:
    """A 24-token chain cached and freed, then `window_taken` window blocks held
    by another sequence, leaving the chain's window blocks 4 and 5 (the ones a
    25-token prompt's hit needs) cached but free; returns the manager and the hit."""
    bm = manager(num_window=8)  # 7 usable window blocks
    chain = hashes(6)
    bm.allocate("a", 24)
    bm.cache_full_blocks("a", chain, 24)
    bm.free_outside_window("a", 24)  # window blocks 0..3 leave first: evicted first
    bm.free("a")
    bm.allocate("x", 4 * window_taken)  # the full pool takes never-used blocks
    assert chain[4] in bm.window.cached and chain[5] in bm.window.cached
    hits = bm.find_cached_prefix(chain, 25)
    assert len(hits) == 6
    return bm, hits


def test_a_hits_cached_free_window_blocks_count_against_the_window_pool():
    """A hit takes its cached window blocks out of the free ones: a 25-token
    prompt over a 6-block hit needs one fresh window block and the two cached
    ones, three in all. With exactly three free it is served; with two it is
    refused, and neither pool changes."""
    bm, hits = cached_window_hit(4)
    assert bm.window.num_free_blocks == 3
    assert bm.allocate("b", 25, hits) is not None
    assert bm.window.num_free_blocks == 0
    bm.check_invariants()

    bm, hits = cached_window_hit(5)
    assert bm.window.num_free_blocks == 2
    free = bm.num_free_blocks
    assert bm.allocate("b", 25, hits) is None
    assert not bm.has("b") and not bm.window.has("b")
    assert (bm.num_free_blocks, bm.window.num_free_blocks) == (free, 2)
    bm.check_invariants()


def test_the_budget_splits_by_each_pools_own_layer_count():
    """Three sliding layers and one global one: the window pool takes what the
    running sequences' windows need at three layers a block, the main pool the
    rest at one layer a block."""
    from engine.config import EngineConfig
    from engine.model.kv_groups import KVGroups

    config = EngineConfig(model="unused", block_size=16, max_num_seqs=2,
                          max_num_batched_tokens=32, max_model_len=256)
    groups = KVGroups((1,), (0, 2, 3), 20)
    # each sequence: ceil(19 / 16) + 2 window blocks; a step's 2; the null block
    assert groups.window_blocks_wanted(config) == 2 * 4 + 2 + 1
    assert groups.split(10_000, 100, config) == ((10_000 - 11 * 100 * 3) // 100, 11)
    assert KVGroups((0, 1, 2, 3), (), None).split(10_000, 100, config) == (25, 0)

def test_a_prefix_hit_needs_the_windows_blocks_and_nulls_the_older_ones():
    bm = manager(num_window=8)  # 7 usable window blocks
    chain = hashes(6)
    bm.allocate("a", 24)
    bm.cache_full_blocks("a", chain, 24)
    bm.free_outside_window("a", 24)
    bm.free("a")
    # A 25-token prompt may reuse 6 blocks (24 tokens); token 24 reads 19..24, so
    # the window group must still hold blocks 4 and 5; 0..3 are not needed.
    hits = bm.find_cached_prefix(chain, 25)
    assert len(hits) == 6
    bm.allocate("b", 25, hits)
    assert bm.window_table("b")[:4] == [NULL_BLOCK] * 4
    assert NULL_BLOCK not in bm.window_table("b")[4:]
    assert bm.block_table("b")[:6] == hits
    bm.check_invariants()
    bm.free("b")
    # Another sequence takes every free window block, evicting the cached ones:
    # no block of the chain is left in the window pool, so nothing can be reused.
    bm.allocate("c", 28)
    assert bm.find_cached_prefix(chain, 25) == []
    bm.check_invariants()


def test_a_hit_is_shortened_to_where_the_window_still_has_its_blocks():
    bm = manager(num_window=12)
    chain = hashes(6)
    bm.allocate("a", 24)
    bm.cache_full_blocks("a", chain, 24)
    bm.free("a")  # freed tail first: window blocks of 5, 4, .. queue in that order
    # Take exactly two cached window blocks (the LRU ones: the chain's 5 and 4).
    empty = len(bm.window.free_queue)
    bm.allocate("x", 4 * (empty + 2))
    assert chain[5] not in bm.window.cached and chain[4] not in bm.window.cached
    hits = bm.find_cached_prefix(chain, 25)
    # 6 blocks would need window blocks 4, 5; a 4-block hit (token 16 reads 11..16)
    # needs blocks 2, 3, still cached.
    assert len(hits) == 4
    bm.check_invariants()


def test_forks_share_both_tables_and_copy_on_write_copies_both():
    bm = manager()
    bm.allocate("a", 10)
    bm.fork("a", "b", 10)
    assert bm.is_shared("b", 2)
    copy = bm.copy_on_write("b", 2)
    window_copies = bm.take_window_copies()
    assert copy is not None and len(window_copies) == 1
    assert window_copies[0][0] == bm.window_table("a")[2]
    assert window_copies[0][1] == bm.window_table("b")[2] != bm.window_table("a")[2]
    assert bm.take_window_copies() == []
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    bm.check_invariants()


def test_reset_and_popular_reach_both_pools():
    bm = manager()
    chain = hashes(3)
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", chain, 12)
    assert bm.set_popular(chain[:2]) == 2
    assert len(bm.window.popular_hashes) == 2
    bm.free("a")
    assert bm.reset_prefix_cache() == 3
    assert not bm.cached and not bm.window.cached
    bm.check_invariants()


def test_gemma3_prefix_hits_forks_and_a_tight_window_pool_match_hf(tmp_path, smollm2_path,
                                                                    single_thread):
    """The same prompts twice through one engine (the second run hits the prefix
    cache wherever the window pool still holds the blocks it needs), with a
    window pool small enough to evict and preempt, and greedy parallel samples
    (forks: copy on write in both pools): HF's greedy tokens every time."""
    from engine import LLM, SamplingParams
    from hf_compare import TOP_K, compare
    from test_hf_parity import NUM_NEW_TOKENS, hf_case
    from tiny_models import make_tiny_family

    case = hf_case("gemma3", make_tiny_family(tmp_path / "gemma3", "gemma3", smollm2_path))
    _, path, prompts, expected = case
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
              max_model_len=400, num_gpu_blocks_override=400, num_window_blocks_override=40)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=TOP_K)
    requests = [{"prompt_token_ids": p} for p in prompts]
    # all prompts twice (the window pool churns: hits only where it kept the
    # blocks), then the 150-token one alone twice (the second run must hit)
    for run, indices in enumerate([range(8), range(8), [6], [6]]):
        outputs = llm.generate([requests[i] for i in indices], params, use_tqdm=False)
        actual = [(o.outputs[0].token_ids, [dict(t) for t in o.outputs[0].top_logprobs])
                  for o in outputs]
        result = compare([expected[i] for i in indices], actual)
        assert result["ok"], f"run {run}: {result}"
    engine = llm.engine
    assert engine.block_manager.stats.hits >= 148  # the last run reused 37 blocks
    assert engine.scheduler.num_preemptions > 0  # 40 window blocks cannot hold 8 windows
    forked = llm.generate(requests[5:7], SamplingParams(
        n=2, temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for output, (ids, _) in zip(forked, expected[5:7]):
        assert [c.token_ids for c in output.outputs] == [ids, ids]
    manager = engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.window.num_free_blocks == manager.window.num_usable_blocks
