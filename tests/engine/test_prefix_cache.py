"""Automatic prefix caching: hit lengths, tenant salts, the exact eviction order
(LRU, tail first, popular last, empty blocks before cached ones), ref counts on
hits, blocks registered as decode fills them, fork / copy on write for n > 1,
reset_prefix_cache, a stateful fuzz of the block manager, a scheduler fuzz
against a fake KV cache that checks every token's K/V, and the tiny model end
to end (outputs identical with the cache on and off)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.core.block_hash import ROOT_HASH, hash_block
from engine.core.block_manager import NULL_BLOCK, BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus

FP = b"fingerprint"


# -- helpers -------------------------------------------------------------------------------------
_managers: list[BlockManager] = []


@pytest.fixture(autouse=True)
def all_blocks_come_back():
    """After every test: whatever is still held is freed, and then every block
    is free (empty or cached) and the bookkeeping is consistent."""
    _managers.clear()
    yield
    for bm in _managers:
        for seq_id in list(bm.block_tables):
            bm.free(seq_id)
        assert bm.num_free_blocks == bm.num_usable_blocks
        assert all(count == 0 for count in bm.ref_counts)
        bm.check_invariants()
    _managers.clear()


def new_bm(num_blocks: int = 9, block_size: int = 4, **kw) -> BlockManager:
    bm = BlockManager(num_blocks, block_size, enable_caching=True, **kw)
    _managers.append(bm)
    return bm


def chain(tokens, block_size: int, salt: bytes = b"", extra: bytes = FP) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = hash_block(parent, block, extra + salt if i == 0 else extra)
        hashes.append(parent)
    return hashes


def compute(bm: BlockManager, seq_id, tokens) -> tuple[list[int], int]:
    """Admit a sequence with its cache hits, 'compute' all its tokens, register its blocks."""
    hashes = chain(tokens, bm.block_size)
    hits = bm.find_cached_prefix(hashes, len(tokens))
    table = bm.allocate(seq_id, len(tokens), hits)
    assert table is not None
    assert table[: len(hits)] == hits
    bm.cache_full_blocks(seq_id, hashes, len(tokens))
    bm.check_invariants()
    return list(table), len(hits)


def lookup(bm: BlockManager, tokens) -> list[int]:
    """Block ids a sequence of `tokens` plus one more token would hit."""
    return bm.find_cached_prefix(chain(tokens, bm.block_size), len(tokens) + 1)


def fake_token(seq_id: int, index: int) -> int:
    return 500_000 + seq_id * 1000 + index


def make_seq(seq_id, prompt, max_tokens=4, salt=b"", extra=FP, parent=None) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        index=0 if parent is None else 1,
        prompt_token_ids=list(prompt),
        params=SamplingParams(temperature=0, max_tokens=max_tokens),
        hash_extra=extra,
        cache_salt=salt,
        fork_parent=parent,
    )


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=256, max_num_batched_tokens=512,
                   config=None) -> Scheduler:
    config = config or EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return Scheduler(config, new_bm(num_blocks, config.block_size))


def step(sched: Scheduler):
    """One step with a fake model; finishes sequences at max_tokens.
    Returns (output, [(seq_id, start, num_new, samples)])."""
    out = sched.schedule()
    running = {seq.seq_id: seq for seq in sched.running}
    sampled = {
        s.seq_id: fake_token(s.seq_id, len(running[s.seq_id].output_token_ids))
        for s in out.sequences
        if s.sampling is not None
    }
    sched.update(out, sampled)
    for seq in list(sched.running):
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")
    sched.block_manager.check_invariants()
    return out, [(s.seq_id, s.start_position, s.num_new_tokens, s.sampling is not None)
                 for s in out.sequences]


def run_to_completion(sched: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("scheduler made no progress")


def shared(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


# -- hit lengths ---------------------------------------------------------------------------------
def test_hit_lengths_full_blocks_and_last_token_left_to_compute():
    """240 shared tokens, block_size 16: a prompt of exactly those 240 tokens
    reuses 224 (one token must be computed, so its block is not a hit); with 10
    more tokens of its own it reuses all 240."""
    sched = make_scheduler(num_blocks=64, block_size=16)
    bm = sched.block_manager
    a = make_seq(0, shared(240), max_tokens=8)
    sched.add(a)
    assert len(a.block_hashes) == 15
    _, scheduled = step(sched)
    assert scheduled == [(0, 0, 240, True)]
    assert a.num_cached_tokens == 0
    assert (bm.stats.queries, bm.stats.hits) == (240, 0)
    assert bm.block_table(0) == list(range(1, 16))
    assert bm.num_cached_blocks == 15  # all 15 full blocks were computed

    b = make_seq(1, shared(240), max_tokens=8)
    c = make_seq(2, shared(240) + [7] * 10, max_tokens=8)
    sched.add(b)
    sched.add(c)
    out, scheduled = step(sched)
    assert scheduled == [(0, 240, 1, True), (1, 224, 16, True), (2, 240, 10, True)]
    assert out.blocks_to_copy == []
    assert (b.num_cached_tokens, c.num_cached_tokens) == (224, 240)
    assert (bm.stats.queries, bm.stats.hits) == (240 + 240 + 250, 224 + 240)
    assert bm.stats.evictions == 0
    assert bm.block_table(0) == list(range(1, 17))  # grew by block 16 for its first output
    assert bm.block_table(1) == list(range(1, 15)) + [17]
    assert bm.block_table(2) == list(range(1, 16)) + [18]
    assert [bm.ref_counts[i] for i in range(1, 19)] == [3] * 14 + [2, 1, 1, 1]
    assert sched.num_prompt_tokens_computed == 240 + 16 + 10
    run_to_completion(sched)
    assert [s.output_token_ids for s in (a, b, c)] == [
        [fake_token(s.seq_id, i) for i in range(8)] for s in (a, b, c)
    ]


def test_no_hit_without_a_full_block():
    """block_size 256 (the block manager and scheduler allow it): 240 tokens
    never fill a block, so nothing is hashed and nothing is ever reused."""
    config = SimpleNamespace(block_size=256, max_num_seqs=8, max_num_batched_tokens=1024,
                             max_model_len=0, schedule_conservativeness=1.0,
                             scheduling_policy="fcfs", max_loras=1, runner="generate")
    sched = make_scheduler(num_blocks=8, config=config)
    bm = sched.block_manager
    seqs = [make_seq(0, shared(240)), make_seq(1, shared(240)), make_seq(2, shared(240) + [5] * 10)]
    sched.add(seqs[0])
    step(sched)
    for seq in seqs[1:]:
        sched.add(seq)
    _, scheduled = step(sched)
    assert scheduled == [(0, 240, 1, True), (1, 0, 240, True), (2, 0, 250, True)]
    assert [s.block_hashes for s in seqs] == [[], [], []]
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0]
    assert (bm.stats.queries, bm.stats.hits) == (730, 0)
    assert bm.num_cached_blocks == 0
    run_to_completion(sched)


@pytest.mark.parametrize(
    "length, expected",
    [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12), (16, 12), (17, 16), (30, 16)],
)
def test_find_cached_prefix_hit_length(length, expected):
    """A cached 16-token chain (block_size 4) serves `length` tokens of the same stream."""
    bm = new_bm(num_blocks=12, block_size=4)
    table, _ = compute(bm, "a", shared(16))
    bm.free("a")
    tokens = shared(16) + [7] * max(0, length - 16)
    tokens = tokens[:length]
    hits = bm.find_cached_prefix(chain(tokens, 4), length)
    assert hits == table[: expected // 4]
    assert bm.find_cached_prefix(chain(tokens, 4), length) == hits  # lookups change nothing
    assert list(bm.cached_free) == table[::-1]


def test_hit_stops_at_the_first_miss():
    bm = new_bm(num_blocks=12, block_size=4)
    table, _ = compute(bm, "a", shared(16))
    tokens = shared(16)
    tokens[9] = 0  # block 2 differs
    assert bm.find_cached_prefix(chain(tokens, 4), 17) == table[:2]
    tokens[1] = 0  # block 0 differs: nothing, although later blocks' tokens agree
    assert bm.find_cached_prefix(chain(tokens, 4), 17) == []


def test_caching_disabled_never_hits_nor_registers():
    bm = BlockManager(9, 4, enable_caching=False)
    _managers.append(bm)
    hashes = chain(shared(8), 4)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", hashes, 8)
    assert bm.cached == {} and bm.block_hashes == [None] * 9
    assert bm.find_cached_prefix(hashes, 9) == []
    bm.free("a")
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 8, 2, 1]


# -- salt isolation ------------------------------------------------------------------------------
def test_salt_isolates_tenants_in_the_scheduler():
    sched = make_scheduler(num_blocks=64, block_size=4)
    bm = sched.block_manager
    prompt = shared(10)
    alice = b"A" * 32
    first = make_seq(0, prompt, salt=alice)
    sched.add(first)
    step(sched)
    others = [
        make_seq(1, prompt, salt=b"B" * 32),  # another tenant
        make_seq(2, prompt, salt=alice),  # same tenant
        make_seq(3, prompt),  # no salt
        make_seq(4, prompt, salt=alice, extra=b"another model"),  # same tenant, other weights
    ]
    for seq in others:
        sched.add(seq)
    _, scheduled = step(sched)
    assert scheduled[1:] == [(1, 0, 10, True), (2, 8, 2, True), (3, 0, 10, True), (4, 0, 10, True)]
    assert [s.num_cached_tokens for s in others] == [0, 8, 0, 0]
    assert bm.block_table(2)[:2] == bm.block_table(0)[:2]
    # the salt changes every block's hash, not only the first
    assert all(x != y for x, y in zip(first.block_hashes, others[0].block_hashes))
    assert first.block_hashes[:2] == others[1].block_hashes
    run_to_completion(sched)


# -- eviction order ------------------------------------------------------------------------------
def two_freed_chains(bm):
    """A (3 full blocks) then B (2 full blocks) computed and freed, in that order."""
    a, _ = compute(bm, "A", shared(12, 100))
    b, _ = compute(bm, "B", shared(8, 200))
    assert (a, b) == ([1, 2, 3], [4, 5])
    bm.free("A")
    bm.free("B")
    assert list(bm.free_queue) == [6, 7, 8]
    assert list(bm.cached_free) == [3, 2, 1, 5, 4]  # LRU first; tail first within a chain
    assert bm.num_free_blocks == 8
    return a, b


def take_fillers(bm, count, start=0) -> list[int]:
    """Allocate `count` one-block sequences whose 3 tokens never fill a block."""
    taken = []
    for i in range(start, start + count):
        table = bm.allocate(("filler", i), 3)
        assert table is not None and len(table) == 1
        taken.append(table[0])
    return taken


def test_eviction_order_empty_then_lru_tail_first():
    bm = new_bm()
    two_freed_chains(bm)
    assert take_fillers(bm, 3) == [6, 7, 8]  # never-cached blocks go first
    assert bm.stats.evictions == 0
    assert lookup(bm, shared(12, 100)) == [1, 2, 3]
    assert lookup(bm, shared(8, 200)) == [4, 5]

    expected_order = [3, 2, 1, 5, 4]
    for n, block in enumerate(expected_order, start=1):
        assert take_fillers(bm, 1, start=10 + n) == [block]
        assert bm.stats.evictions == n
        assert bm.block_hashes[block] is None
        assert block not in bm.cached.values()
        bm.check_invariants()
        if n == 1:  # A's tail is gone, its head still hits; B untouched
            assert lookup(bm, shared(12, 100)) == [1, 2]
            assert lookup(bm, shared(8, 200)) == [4, 5]
        if n == 3:
            assert lookup(bm, shared(12, 100)) == []
            assert lookup(bm, shared(8, 200)) == [4, 5]
    assert bm.num_cached_blocks == 0
    assert bm.allocate("one too many", 1) is None
    assert bm.stats.evictions == 5


def test_a_hit_refreshes_lru_position():
    bm = new_bm()
    two_freed_chains(bm)
    table, hits = compute(bm, "G", shared(8, 100) + [9])  # A's first two blocks + 1 token
    assert (table, hits) == ([1, 2, 6], 2)
    assert list(bm.cached_free) == [3, 5, 4]  # hits left the free queues
    bm.free("G")
    assert list(bm.cached_free) == [3, 5, 4, 2, 1]  # ... and came back most recent, tail first
    assert list(bm.free_queue) == [7, 8, 6]  # G's partial block was never cached
    assert take_fillers(bm, 8) == [7, 8, 6, 3, 5, 4, 2, 1]
    assert bm.stats.evictions == 5


def test_popular_blocks_are_evicted_last():
    bm = new_bm()
    a, b = two_freed_chains(bm)
    heads = [chain(shared(12, 100), 4)[0], chain(shared(8, 200), 4)[0]]
    assert bm.set_popular(heads) == 2
    assert list(bm.cached_free) == [3, 2, 5]
    assert list(bm.popular_free) == [1, 4]
    bm.check_invariants()
    assert take_fillers(bm, 8) == [6, 7, 8, 3, 2, 5, 1, 4]
    assert bm.stats.evictions == 5


def test_popular_held_block_is_filed_popular_when_freed_and_unmarked_later():
    bm = new_bm()
    head = chain(shared(8, 100), 4)[0]
    assert bm.set_popular([head]) == 1
    table, _ = compute(bm, "A", shared(8, 100))
    assert table == [1, 2]
    bm.free("A")
    assert list(bm.cached_free) == [2] and list(bm.popular_free) == [1]
    assert bm.set_popular([]) == 0  # no longer popular: back to the ordinary LRU queue
    assert list(bm.cached_free) == [2, 1] and list(bm.popular_free) == []
    assert lookup(bm, shared(8, 100)) == [1, 2]


def test_set_popular_is_bounded_by_max_popular_share():
    bm = new_bm(num_blocks=9, block_size=4, max_popular_share=0.25)  # 2 of 8 blocks
    two_freed_chains(bm)
    all_hashes = chain(shared(12, 100), 4) + chain(shared(8, 200), 4)
    assert bm.set_popular(all_hashes) == 2
    assert list(bm.popular_free) == [2, 1]  # the first two hashes given: A's blocks 0 and 1
    assert list(bm.cached_free) == [3, 5, 4]
    assert bm.set_popular(all_hashes[:1] * 5) == 1  # duplicates count once


def test_popular_cached_count_follows_registration_and_eviction():
    """num_popular_cached (the warm-blocks gauge) counts marked hashes a block holds."""
    bm = new_bm(num_blocks=5, block_size=4)  # popular share 0.5: up to 2 blocks
    hashes = chain(shared(8, 100), 4)
    assert bm.set_popular(hashes) == 2
    assert bm.num_popular_cached == 0  # marked before any block computes them
    compute(bm, "A", shared(8, 100))
    assert bm.num_popular_cached == 2
    bm.free("A")
    assert bm.num_popular_cached == 2  # free but still cached
    assert bm.cached_run(hashes) == [1, 2]
    assert take_fillers(bm, 3) == [3, 4, 2]  # empty blocks, then popular ones, tail first
    assert bm.num_popular_cached == 1 and bm.cached_run(hashes) == [1]
    bm.check_invariants()
    assert bm.reset_prefix_cache() == 1
    assert bm.num_popular_cached == 0 and bm.cached_run(hashes) == []


def test_allocate_holds_hits_before_taking_fresh_blocks():
    """The fresh blocks of a hit allocation may evict cached blocks, but never
    the hits, even when a hit is the least recently used cached block."""
    bm = new_bm(num_blocks=4, block_size=4)
    compute(bm, "A", shared(4, 100))
    compute(bm, "B", shared(8, 200))
    bm.free("A")
    bm.free("B")
    assert list(bm.cached_free) == [1, 3, 2]
    table, hits = compute(bm, "C", shared(4, 100) + [9] * 8)
    assert (table, hits) == ([1, 3, 2], 1)
    assert bm.stats.evictions == 2
    assert [bm.ref_counts[i] for i in (1, 2, 3)] == [1, 1, 1]
    assert lookup(bm, shared(4, 100)) == [1]
    assert lookup(bm, shared(8, 200)) == []


def test_allocate_short_of_memory_with_hits_changes_nothing():
    bm = new_bm(num_blocks=4, block_size=4)
    compute(bm, "A", shared(12, 100))
    bm.free("A")
    hashes = chain(shared(8, 100) + [9] * 5, 4)
    hits = bm.find_cached_prefix(hashes, 13)
    assert hits == [1, 2]  # needs 2 fresh blocks + reclaims 2 cached: 4 > 3 free
    before = (list(bm.cached_free), list(bm.free_queue), list(bm.ref_counts), dict(bm.cached))
    assert bm.allocate("B", 13, hits) is None
    after = (list(bm.cached_free), list(bm.free_queue), list(bm.ref_counts), dict(bm.cached))
    assert after == before
    assert not bm.has("B")
    assert bm.stats.evictions == 0
    assert bm.allocate("B", 12, hits) == [1, 2, 3]  # exactly fits: evicts A's tail
    assert bm.stats.evictions == 1


# -- ref counts on hits --------------------------------------------------------------------------
def test_ref_counts_on_hits_and_free_order():
    bm = new_bm(num_blocks=12, block_size=4)
    a, _ = compute(bm, "A", shared(10))
    b, hits = compute(bm, "B", shared(10))
    assert a == [1, 2, 3] and b == [1, 2, 4] and hits == 2
    assert [bm.ref_counts[i] for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert bm.is_shared("B", 0) and bm.is_shared("B", 1) and not bm.is_shared("B", 2)
    bm.free("A")
    assert [bm.ref_counts[i] for i in (1, 2, 3)] == [1, 1, 0]
    assert list(bm.cached_free) == [] and list(bm.free_queue)[-1] == 3  # partial: not cached
    assert 1 not in bm.free_queue and 2 not in bm.free_queue
    bm.free("B")
    assert list(bm.cached_free) == [2, 1]
    assert 1 not in bm.free_queue and 2 not in bm.free_queue
    assert list(bm.free_queue)[-2:] == [3, 4]
    assert lookup(bm, shared(10)) == [1, 2]
    assert bm.num_cached_blocks == 2


# -- blocks registered as decode fills them -------------------------------------------------------
def test_decode_registers_a_full_block_in_the_step_that_fills_it():
    sched = make_scheduler(num_blocks=16, block_size=4)
    bm = sched.block_manager
    a = make_seq(1, shared(6), max_tokens=10)
    sched.add(a)
    step(sched)  # prefill 6 -> o0
    assert len(a.block_hashes) == 1 and bm.cached == {a.block_hashes[0]: 1}
    step(sched)  # computes o0 (position 6), samples o1: tokens 0..7 known, 7 computed
    assert a.num_tokens == 8 and a.num_computed_tokens == 7
    assert len(a.block_hashes) == 2
    assert a.block_hashes[1] not in bm.cached  # known but not computed yet
    same_step = make_seq(2, a.token_slice(0, 8) + [77])
    sched.add(same_step)
    _, scheduled = step(sched)
    # a's step computes o1 and fills block 1; it is registered at scheduling time,
    # so a request admitted later in the same step already hits it (every layer
    # stores the whole batch's K/V before attending).
    assert scheduled == [(1, 7, 1, True), (2, 8, 1, True)]
    assert same_step.num_cached_tokens == 8
    assert bm.cached[a.block_hashes[1]] == bm.block_table(1)[1] == 2
    assert bm.block_table(2) == [1, 2, 3]

    late = make_seq(3, a.token_slice(0, 8) + [77])
    sched.add(late)
    _, scheduled = step(sched)
    assert a.status is SequenceStatus.RUNNING  # the first one still generates
    assert scheduled == [(1, 8, 1, True), (2, 9, 1, True), (3, 8, 1, True)]
    assert late.num_cached_tokens == 8
    assert bm.block_table(1) == [1, 2, 4]
    assert bm.block_table(3) == [1, 2, 5]
    assert [bm.ref_counts[i] for i in (1, 2)] == [3, 3]
    assert (bm.stats.queries, bm.stats.hits) == (6 + 9 + 9, 0 + 8 + 8)
    run_to_completion(sched)
    for seq in (a, same_step, late):
        assert seq.output_token_ids == [fake_token(seq.seq_id, i)
                                        for i in range(seq.params.max_tokens)]
    assert bm.num_cached_blocks > 0


def test_finished_sequence_prompt_is_hit_by_the_next_one():
    """max_num_seqs=1: the second sample cannot fork while the first runs, so it
    is admitted after the first finished and reuses its cached blocks."""
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1)
    bm = sched.block_manager
    parent = make_seq(0, shared(10), max_tokens=2)
    child = make_seq(1, parent.prompt_token_ids, max_tokens=2, parent=parent)
    sched.add(parent)
    sched.add(child)
    assert step(sched)[1] == [(0, 0, 10, True)]
    assert step(sched)[1] == [(0, 10, 1, True)]
    assert parent.is_finished
    assert list(bm.cached_free) == [2, 1]
    out, scheduled = step(sched)
    assert scheduled == [(1, 8, 2, True)]
    assert out.blocks_to_copy == []
    assert child.num_cached_tokens == 8
    assert bm.block_table(1) == [1, 2, 4]
    run_to_completion(sched)


# -- fork and copy on write ----------------------------------------------------------------------
def test_fork_shares_blocks_and_copy_on_write_gives_a_private_copy():
    bm = new_bm(num_blocks=9, block_size=4)
    assert bm.allocate("P", 10) == [1, 2, 3]
    assert bm.fork("P", "C1", 10) == [1, 2, 3]
    assert bm.fork("P", "C2", 10) == [1, 2, 3]
    assert [bm.ref_counts[i] for i in (1, 2, 3)] == [3, 3, 3]
    assert bm.is_shared("C1", 2) and not bm.is_shared("C1", 3)
    assert bm.copy_on_write("C1", 2) == (3, 4)
    assert bm.block_table("C1") == [1, 2, 4] and bm.block_table("P") == [1, 2, 3]
    assert [bm.ref_counts[i] for i in (1, 2, 3, 4)] == [3, 3, 2, 1]
    assert not bm.is_shared("C1", 2) and bm.is_shared("C2", 2)
    assert bm.copy_on_write("C2", 2) == (3, 5)
    assert not bm.is_shared("P", 2)
    bm.check_invariants()
    bm.free("P")
    assert list(bm.free_queue) == [6, 7, 8, 3]
    bm.free("C1")
    bm.free("C2")
    assert list(bm.free_queue) == [6, 7, 8, 3, 4, 5, 2, 1]


def test_fork_covers_only_the_blocks_of_num_tokens():
    bm = new_bm(num_blocks=9, block_size=4)
    bm.allocate("P", 13)
    assert bm.fork("P", "C", 10) == [1, 2, 3]
    assert [bm.ref_counts[i] for i in (1, 2, 3, 4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError):
        bm.fork("P", "C", 10)


def test_copy_on_write_with_no_free_block_changes_nothing():
    bm = new_bm(num_blocks=4, block_size=4)
    compute(bm, "P", shared(12))
    bm.fork("P", "C", 12)
    before = (list(bm.ref_counts), bm.block_table("C")[:], bm.block_table("P")[:],
              dict(bm.cached), list(bm.block_hashes))
    assert bm.copy_on_write("C", 2) is None
    after = (list(bm.ref_counts), bm.block_table("C")[:], bm.block_table("P")[:],
             dict(bm.cached), list(bm.block_hashes))
    assert after == before
    assert bm.stats.evictions == 0


def test_copy_on_write_may_evict_a_cached_free_block():
    bm = new_bm(num_blocks=5, block_size=4)
    compute(bm, "X", shared(4, 900))
    bm.free("X")
    assert list(bm.cached_free) == [1]
    assert bm.allocate("P", 10) == [2, 3, 4]
    bm.fork("P", "C", 10)
    assert bm.copy_on_write("C", 2) == (4, 1)
    assert bm.stats.evictions == 1
    assert lookup(bm, shared(4, 900)) == []
    assert bm.block_hashes[1] is None


@pytest.mark.parametrize("prompt_len, copy", [(10, (3, 4)), (8, (2, 4))])
def test_scheduler_forks_child_after_parent_prompt(prompt_len, copy):
    """n=2: the child waits while the parent's prompt is computed (here in two
    chunks), then shares its blocks and recomputes only the last prompt token,
    with a private copy of the last prompt block."""
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=prompt_len - 1)
    bm = sched.block_manager
    parent = make_seq(0, shared(prompt_len), max_tokens=3)
    child = make_seq(1, parent.prompt_token_ids, max_tokens=3, parent=parent)
    sched.add(parent)
    sched.add(child)
    out, scheduled = step(sched)
    assert scheduled == [(0, 0, prompt_len - 1, False)] and out.blocks_to_copy == []
    assert child.status is SequenceStatus.WAITING and not bm.has(1)
    out, scheduled = step(sched)  # one prompt token left: the child still waits
    assert scheduled == [(0, prompt_len - 1, 1, True)] and out.blocks_to_copy == []
    assert child.status is SequenceStatus.WAITING and not bm.has(1)

    out, scheduled = step(sched)
    assert scheduled == [(0, prompt_len, 1, True), (1, prompt_len - 1, 1, True)]
    assert out.blocks_to_copy == [copy]
    n_prompt_blocks = -(-prompt_len // 4)
    src, dst = copy
    parent_table = bm.block_table(0)
    child_table = bm.block_table(1)
    assert child_table == parent_table[: n_prompt_blocks - 1] + [dst]
    assert parent_table[n_prompt_blocks - 1] == src
    for block in parent_table[: n_prompt_blocks - 1]:
        assert bm.ref_counts[block] == 2
    assert bm.ref_counts[src] == 1 and bm.ref_counts[dst] == 1
    assert child.num_cached_tokens == parent.num_cached_tokens == 0
    assert sched.num_prompt_tokens_computed == prompt_len + 1
    assert bm.stats.queries == prompt_len  # the child never looked the prefix up

    out, scheduled = step(sched)
    assert scheduled == [(0, prompt_len + 1, 1, True), (1, prompt_len, 1, True)]
    assert out.blocks_to_copy == []
    run_to_completion(sched)
    assert parent.output_token_ids == [fake_token(0, i) for i in range(3)]
    assert child.output_token_ids == [fake_token(1, i) for i in range(3)]


def test_forked_child_inherits_the_parents_cache_hit():
    sched = make_scheduler(num_blocks=16, block_size=4)
    bm = sched.block_manager
    first = make_seq(0, shared(10), max_tokens=1)
    sched.add(first)
    step(sched)
    assert first.is_finished and list(bm.cached_free) == [2, 1]
    parent = make_seq(1, shared(10) + [5, 6], max_tokens=3)
    child = make_seq(2, parent.prompt_token_ids, max_tokens=3, parent=parent)
    sched.add(parent)
    sched.add(child)
    out, scheduled = step(sched)
    assert scheduled == [(1, 8, 4, True)]  # the child waits for the rest of the prompt
    assert parent.num_cached_tokens == 8 and bm.block_table(1) == [1, 2, 4]
    out, scheduled = step(sched)
    assert scheduled == [(1, 12, 1, True), (2, 11, 1, True)]
    assert out.blocks_to_copy == [(4, 6)]
    assert bm.block_table(2) == [1, 2, 6] and bm.block_table(1) == [1, 2, 4, 5]
    assert child.num_cached_tokens == 8
    assert (bm.stats.queries, bm.stats.hits) == (22, 8)
    run_to_completion(sched)


def test_fork_child_waits_when_copy_on_write_finds_no_block():
    """Parent holds every block: the child's fork is undone and it waits."""
    sched = make_scheduler(num_blocks=4, block_size=4)  # 3 usable
    bm = sched.block_manager
    parent = make_seq(0, shared(10), max_tokens=3)
    child = make_seq(1, parent.prompt_token_ids, max_tokens=3, parent=parent)
    sched.add(parent)
    sched.add(child)
    step(sched)
    out, scheduled = step(sched)
    assert scheduled == [(0, 10, 1, True)]
    assert out.blocks_to_copy == []
    assert child.status is SequenceStatus.WAITING and not bm.has(1)
    assert [bm.ref_counts[i] for i in (1, 2, 3)] == [1, 1, 1]
    run_to_completion(sched)
    assert child.output_token_ids == [fake_token(1, i) for i in range(3)]


# -- reset_prefix_cache --------------------------------------------------------------------------
def test_reset_prefix_cache_drops_free_cached_blocks_only():
    bm = new_bm()
    a, _ = compute(bm, "A", shared(12, 100))  # stays held
    compute(bm, "B", shared(8, 200))
    compute(bm, "C", shared(8, 300))
    bm.free("B")
    bm.free("C")
    assert bm.set_popular([chain(shared(8, 300), 4)[0]]) == 1
    assert list(bm.cached_free) == [5, 4, 7] and list(bm.popular_free) == [6]
    assert bm.reset_prefix_cache() == 4
    assert list(bm.free_queue) == [8, 5, 4, 7, 6]
    assert list(bm.cached_free) == [] and list(bm.popular_free) == []
    assert all(bm.block_hashes[i] is None for i in (4, 5, 6, 7))
    assert lookup(bm, shared(8, 200)) == [] and lookup(bm, shared(8, 300)) == []
    assert lookup(bm, shared(12, 100)) == a  # held by a running sequence: still cached
    assert bm.num_cached_blocks == 3
    assert bm.stats.evictions == 0
    bm.check_invariants()
    bm.free("A")
    assert list(bm.cached_free) == [3, 2, 1]
    assert bm.reset_prefix_cache() == 3
    assert bm.cached == {} and bm.num_cached_blocks == 0
    assert bm.reset_prefix_cache() == 0


# -- stateful fuzz of the block manager with caching -----------------------------------------------
BS = 4
NUM_BLOCKS = 13
PREFIXES = [
    tuple(range(1000, 1012)),
    tuple(range(2000, 2012)),
    (1000, 1001, 1002, 1003, 7, 7, 7, 7, 7, 7, 7, 7),  # shares block 0 with the first
]


class PrefixCacheMachine(RuleBasedStateMachine):
    """A model of what every block holds (the token prefix whose K/V it has):
    a hit must serve exactly the prefix the sequence needs, a registered block
    must hold the prefix its hash names, nobody writes into a shared or
    registered block, and every block is taken in the documented order."""

    @initialize()
    def setup(self):
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_caching=True, max_popular_share=0.25)
        self.tokens: dict[int, list[int]] = {}
        self.content: dict[int, tuple] = {}  # block -> prefix whose K/V it holds
        self.prefix_of: dict[bytes, tuple] = {}  # hash -> prefix it names
        self.next_id = 0
        self.evictions = 0
        self.queries = 0

    # helpers
    def _hashes(self, tokens):
        hashes = chain(tokens, BS)
        for i, h in enumerate(hashes):
            prefix = tuple(tokens[: (i + 1) * BS])
            assert self.prefix_of.setdefault(h, prefix) == prefix
        return hashes

    def _take_order(self, exclude=()):
        bm = self.bm
        return (list(bm.free_queue)
                + [b for b in bm.cached_free if b not in exclude]
                + [b for b in bm.popular_free if b not in exclude])

    def _snapshot(self):
        bm = self.bm
        return (list(bm.free_queue), list(bm.cached_free), list(bm.popular_free),
                list(bm.ref_counts), dict(bm.cached), list(bm.block_hashes),
                {k: list(v) for k, v in bm.block_tables.items()}, bm.stats.evictions)

    def _write(self, seq_id, start, end):
        """The sequence computes tokens [start, end): they land in private, unregistered blocks."""
        bm, tokens = self.bm, self.tokens[seq_id]
        table = bm.block_table(seq_id)
        for index in range(start // BS, (end - 1) // BS + 1):
            block = table[index]
            assert bm.ref_counts[block] == 1, f"write into shared block {block}"
            assert bm.block_hashes[block] is None, f"write into registered block {block}"
            self.content[block] = tuple(tokens[: min((index + 1) * BS, end)])
        bm.cache_full_blocks(seq_id, self._hashes(tokens), end)

    def _evicted(self, taken, free_queue_before):
        self.evictions += max(0, len(taken) - len(free_queue_before))

    # rules
    @rule(p=st.integers(0, 2), cut=st.integers(0, 12), suffix=st.lists(st.integers(0, 1), max_size=5))
    def admit(self, p, cut, suffix):
        bm = self.bm
        tokens = list(PREFIXES[p][:cut]) + suffix or [5]
        n = len(tokens)
        hashes = self._hashes(tokens)
        hits = bm.find_cached_prefix(hashes, n)
        limit = min(len(hashes), (n - 1) // BS)
        assert len(hits) <= limit
        for i, block in enumerate(hits):
            assert bm.cached[hashes[i]] == block
            assert self.content[block] == tuple(tokens[: (i + 1) * BS])  # the right K/V
        if len(hits) < limit:
            assert hashes[len(hits)] not in bm.cached  # the longest run
        order = self._take_order(exclude=hits)
        fresh = bm.blocks_for(n) - len(hits)
        free_queue_before = list(bm.free_queue)
        before = self._snapshot()
        seq_id = self.next_id
        table = bm.allocate(seq_id, n, hits)
        if table is None:
            assert fresh + sum(bm.ref_counts[b] == 0 for b in hits) > bm.num_free_blocks
            assert self._snapshot() == before
            return
        self.next_id += 1
        bm.record_lookup(n, len(hits) * BS)
        self.queries += n
        assert table == hits + order[:fresh]
        self._evicted(order[:fresh], free_queue_before)
        for block in table[len(hits):]:
            assert bm.block_hashes[block] is None
        self.tokens[seq_id] = tokens
        self._write(seq_id, len(hits) * BS, n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def append(self, data, extra):
        bm = self.bm
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        old_n = len(self.tokens[seq_id])
        new_n = old_n + len(extra)
        old_table = list(bm.block_table(seq_id))
        needed = bm.blocks_for(new_n) - len(old_table)
        order = self._take_order()
        free_queue_before = list(bm.free_queue)
        before = self._snapshot()
        new = bm.append_slots(seq_id, new_n)
        if new is None:
            assert needed > bm.num_free_blocks
            assert self._snapshot() == before
            return
        assert new == order[: max(needed, 0)]
        self._evicted(new, free_queue_before)
        # copy on write, as the scheduler does, for the blocks the new tokens land in
        for index in range(old_n // BS, (new_n - 1) // BS + 1):
            if not bm.is_shared(seq_id, index):
                continue
            order = self._take_order()
            free_queue_before = list(bm.free_queue)
            before = self._snapshot()
            source = bm.block_table(seq_id)[index]
            copy = bm.copy_on_write(seq_id, index)
            if copy is None:
                assert bm.num_free_blocks == 0
                assert self._snapshot() == before
                bm.free(seq_id)  # the scheduler would preempt it
                del self.tokens[seq_id]
                return
            assert copy == (source, order[0])
            self._evicted([copy[1]], free_queue_before)
            assert bm.ref_counts[source] >= 1
            self.content[copy[1]] = self.content[source]
        self.tokens[seq_id] = self.tokens[seq_id] + extra
        self._write(seq_id, old_n, new_n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        bm = self.bm
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        table = list(bm.block_table(seq_id))
        queues = [list(bm.free_queue), list(bm.cached_free), list(bm.popular_free)]
        released = []
        refs = list(bm.ref_counts)
        for block in reversed(table):
            refs[block] -= 1
            if refs[block] == 0:
                released.append(block)
        for block in released:
            h = bm.block_hashes[block]
            queues[0 if h is None else 2 if h in bm.popular_hashes else 1].append(block)
        bm.free(seq_id)
        assert [list(bm.free_queue), list(bm.cached_free), list(bm.popular_free)] == queues
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        bm = self.bm
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        refs = list(bm.ref_counts)
        child = self.next_id
        self.next_id += 1
        table = bm.fork(parent, child, len(self.tokens[parent]))
        assert table == bm.block_table(parent)
        for block in table:
            assert bm.ref_counts[block] == refs[block] + 1
        self.tokens[child] = list(self.tokens[parent])

    @rule()
    def reset(self):
        bm = self.bm
        dropped = list(bm.cached_free) + list(bm.popular_free)
        queue = list(bm.free_queue)
        held = {h: b for h, b in bm.cached.items() if bm.ref_counts[b] > 0}
        assert bm.reset_prefix_cache() == len(dropped)
        assert list(bm.free_queue) == queue + dropped
        assert bm.cached == held

    @rule(data=st.data())
    def popular(self, data):
        bm = self.bm
        known = sorted(self.prefix_of)
        chosen = data.draw(st.lists(st.sampled_from(known), max_size=4)) if known else []
        expected = set()
        for h in chosen:
            if len(expected) >= bm.max_popular_blocks:
                break
            expected.add(h)
        assert bm.set_popular(chosen) == len(expected)
        assert bm.popular_hashes == expected

    @rule(p=st.integers(0, 2), cut=st.integers(1, 12))
    def lookup_only(self, p, cut):
        tokens = list(PREFIXES[p][:cut])
        hashes = self._hashes(tokens)
        before = self._snapshot()
        hits = self.bm.find_cached_prefix(hashes, cut)
        for i, block in enumerate(hits):
            assert self.content[block] == tuple(tokens[: (i + 1) * BS])
        assert self._snapshot() == before

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants()
        held = [0] * NUM_BLOCKS
        for table in bm.block_tables.values():
            for block in table:
                held[block] += 1
        assert bm.ref_counts == held
        assert NULL_BLOCK not in {b for t in bm.block_tables.values() for b in t}
        assert bm.num_free_blocks + sum(1 for c in held if c) == bm.num_usable_blocks
        for h, block in bm.cached.items():
            assert bm.block_hashes[block] == h
            assert self.content[block] == self.prefix_of[h]  # a cached block holds its prefix
        assert len(set(bm.cached.values())) == len(bm.cached)
        assert {b for b in range(NUM_BLOCKS) if bm.block_hashes[b] is not None} == \
            set(bm.cached.values())
        for block in bm.popular_free:
            assert bm.block_hashes[block] in bm.popular_hashes
        for block in bm.cached_free:
            assert bm.block_hashes[block] not in bm.popular_hashes
        assert bm.stats.evictions == self.evictions
        assert bm.stats.queries == self.queries
        assert set(bm.block_tables) == set(self.tokens)
        for seq_id, tokens in self.tokens.items():
            assert len(bm.block_table(seq_id)) == bm.blocks_for(len(tokens))

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert self.bm.block_tables == {}
        self.bm.check_invariants()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


# -- scheduler fuzz against a fake KV cache ------------------------------------------------------
class FakeKV:
    """Each slot holds the token prefix whose K/V a real model would have written
    there. Copies run first, then every scheduled token is written, then every
    scheduled sequence must read exactly its own prefix at every position.

    A block may be registered in the cache in the very step that fills it (and
    hit by a later sequence of that step), so the rule for writes is: a block
    that was cached before the step and still is (not evicted and reused) may
    only be written with exactly the content it already holds."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[tuple | None] = [None] * (num_blocks * block_size)
        self.hash_before: dict[int, bytes] = {}

    def before_schedule(self, bm: BlockManager) -> None:
        self.hash_before = {block: h for h, block in bm.cached.items()}

    def execute(self, sched: Scheduler, out) -> None:
        bm, bs = sched.block_manager, self.bs
        for src, dst in out.blocks_to_copy:
            assert bm.ref_counts[dst] == 1
            # dst is a block taken fresh in this step; the copy may register it at once
            # (its content is complete by the end of the step), but a block still
            # cached from before the step must keep what it holds.
            copied = self.slots[src * bs:(src + 1) * bs]
            if bm.block_hashes[dst] is not None and \
                    self.hash_before.get(dst) == bm.block_hashes[dst]:
                assert self.slots[dst * bs:(dst + 1) * bs] == copied, f"copy corrupts {dst}"
            self.slots[dst * bs:(dst + 1) * bs] = copied
        running = {seq.seq_id: seq for seq in sched.running}
        written = set()
        for s in out.sequences:
            tokens = running[s.seq_id].token_slice(0, s.context_len)
            for p in range(s.start_position, s.context_len):
                block = s.block_table[p // bs]
                assert block != NULL_BLOCK
                slot = block * bs + p % bs
                content = tuple(tokens[: p + 1])
                if bm.block_hashes[block] is not None and \
                        self.hash_before.get(block) == bm.block_hashes[block]:
                    assert self.slots[slot] == content, f"seq {s.seq_id} corrupts cached {block}"
                assert slot not in written
                written.add(slot)
                self.slots[slot] = content
        for s in out.sequences:
            tokens = running[s.seq_id].token_slice(0, s.context_len)
            for p in range(s.context_len):
                slot = s.block_table[p // bs] * bs + p % bs
                assert self.slots[slot] == tuple(tokens[: p + 1]), (s.seq_id, p)

    def check_cached(self, bm: BlockManager, prefix_of: dict) -> None:
        bs = self.bs
        for h, block in bm.cached.items():
            prefix = prefix_of[h]
            for j in range(bs):
                assert self.slots[block * bs + j] == prefix[: len(prefix) - bs + j + 1]


FUZZ_PREFIXES = [list(range(1000, 1012)), list(range(2000, 2012))]


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    spare_blocks=st.integers(0, 5),
    max_num_seqs=st.integers(1, 5),
    budget_extra=st.integers(0, 12),
    specs=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 12), st.lists(st.integers(0, 1), max_size=4),
                  st.integers(1, 6), st.integers(1, 3), st.integers(0, 2)),
        min_size=1, max_size=6,
    ),
)
def test_random_scenarios_read_exactly_their_own_kv(
    block_size, spare_blocks, max_num_seqs, budget_extra, specs
):
    """Shared prefixes (so hits happen), n > 1 (forks, copy on write), little
    memory (preemption, eviction): every sequence always reads the K/V of its
    own tokens, cached blocks hold what their hash names, outputs are exact."""
    requests = []
    for pid, cut, suffix, max_tokens, n, delay in specs:
        prompt = FUZZ_PREFIXES[pid][:cut] + suffix or [3]
        requests.append((prompt, max_tokens, n, delay))
    longest = max(len(p) + m - 1 for p, m, _, _ in requests)
    num_blocks = -(-longest // block_size) + 2 + spare_blocks
    config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=block_size + budget_extra)
    sched = Scheduler(config, new_bm(num_blocks, block_size))
    bm = sched.block_manager
    kv = FakeKV(num_blocks, block_size)
    seqs, pending, next_id = [], [], 0
    for prompt, max_tokens, n, delay in requests:
        group = []
        for _ in range(n):
            group.append(make_seq(next_id, prompt, max_tokens, parent=group[0] if group else None))
            next_id += 1
        seqs += group
        pending.append((group, delay))
    prefix_of: dict[bytes, tuple] = {}
    steps = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][1] == 0:
            for seq in pending.pop(0)[0]:
                sched.add(seq)
        if pending:
            pending[0] = (pending[0][0], pending[0][1] - 1)
        kv.before_schedule(bm)
        out = sched.schedule()
        kv.execute(sched, out)
        running = {seq.seq_id: seq for seq in sched.running}
        sampled = {
            s.seq_id: fake_token(s.seq_id, len(running[s.seq_id].output_token_ids))
            for s in out.sequences if s.sampling is not None
        }
        sched.update(out, sampled)
        for seq in list(sched.running):
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
        for seq in seqs:
            for i, h in enumerate(seq.block_hashes):
                prefix = tuple(seq.token_slice(0, (i + 1) * block_size))
                assert prefix_of.setdefault(h, prefix) == prefix
        kv.check_cached(bm, prefix_of)
        bm.check_invariants()
        steps += 1
        assert steps < 1000, "no progress"
    for seq in seqs:
        assert seq.output_token_ids == [fake_token(seq.seq_id, i)
                                        for i in range(seq.params.max_tokens)]
        assert seq.num_cached_tokens <= seq.num_prompt_tokens - 1
    assert bm.stats.hits <= bm.stats.queries
    assert bm.block_tables == {}
    assert bm.num_free_blocks == bm.num_usable_blocks


# -- the tiny model end to end -------------------------------------------------------------------
VOCAB = 49152
ENGINE_BS = 8




def tiny_llm(path, caching: bool):
    from engine import LLM

    return LLM(
        str(path),
        dtype="float32",
        block_size=ENGINE_BS,
        max_model_len=128,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=200,
        seed=0,
        enable_prefix_caching=caching,
    )


def batch():
    rng = random.Random(7)
    system = [rng.randrange(3, VOCAB) for _ in range(40)]
    suffix_lengths = [3, 9, 1, 12, 5, 8, 16, 2]
    return [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in suffix_lengths]


def greedy(max_tokens=6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate(llm, prompts, params=None):
    before = dict(llm.engine.stats())
    outputs = llm.generate(prompts, params or greedy(), use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.block_tables == {} and bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()
    after = llm.engine.stats()
    delta = {k: after[k] - before[k] for k in
             ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed",
              "evictions", "num_preemptions")}
    return outputs, delta


@pytest.fixture(scope="module")
def engine_runs(single_thread, tiny_llama_path):
    prompts = batch()
    off = tiny_llm(tiny_llama_path, caching=False)
    on = tiny_llm(tiny_llama_path, caching=True)
    results = {"prompts": prompts}
    results["off"] = generate(off, prompts)
    results["off_stats"] = off.engine.stats()
    results["on1"] = generate(on, prompts)
    results["on2"] = generate(on, prompts)  # everything cached from the first run
    cached_before_reset = on.engine.stats()["kv_blocks_cached"]
    assert on.reset_prefix_cache() is True
    results["reset_cached"] = (cached_before_reset, on.engine.stats()["kv_blocks_cached"])
    results["on3"] = generate(on, prompts)
    results["llm_on"] = on
    return results


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_engine_outputs_identical_with_and_without_prefix_caching(engine_runs):
    reference = ids(engine_runs["off"][0])
    assert all(len(t) == 6 for t in reference)
    assert ids(engine_runs["on1"][0]) == reference
    assert ids(engine_runs["on2"][0]) == reference
    assert ids(engine_runs["on3"][0]) == reference


def test_engine_stats_with_and_without_prefix_caching(engine_runs):
    prompts = engine_runs["prompts"]
    off_out, off = engine_runs["off"]
    on_out, on = engine_runs["on1"]
    assert off["num_preemptions"] == on["num_preemptions"] == 0
    assert off["prefix_cache_hits"] == off["prefix_cache_queries"] == 0
    assert [o.num_cached_tokens for o in off_out] == [0] * 8
    assert engine_runs["off_stats"]["kv_blocks_cached"] == 0
    assert off["prompt_tokens_computed"] == sum(map(len, prompts))
    assert on["prefix_cache_queries"] == sum(map(len, prompts))
    cached = [o.num_cached_tokens for o in on_out]
    assert cached[0] == 0
    assert all(c % ENGINE_BS == 0 and c <= 40 for c in cached)  # only the system prompt
    assert sum(c > 0 for c in cached) >= 4  # later requests hit what earlier ones computed
    assert on["prefix_cache_hits"] == sum(cached) > 0
    assert on["prompt_tokens_computed"] == off["prompt_tokens_computed"] - sum(cached)
    assert on["evictions"] == 0


def test_engine_second_run_hits_every_full_prompt_block(engine_runs):
    prompts = engine_runs["prompts"]
    out, delta = engine_runs["on2"]
    expected = [(len(p) - 1) // ENGINE_BS * ENGINE_BS for p in prompts]
    assert [o.num_cached_tokens for o in out] == expected
    assert delta["prefix_cache_hits"] == sum(expected)
    assert delta["prompt_tokens_computed"] == sum(len(p) - c for p, c in zip(prompts, expected))
    assert delta["evictions"] == 0


def test_engine_reset_prefix_cache_then_hits_only_from_within_the_batch(engine_runs):
    before, after = engine_runs["reset_cached"]
    assert before > 0 and after == 0
    first = [o.num_cached_tokens for o in engine_runs["on1"][0]]
    again = [o.num_cached_tokens for o in engine_runs["on3"][0]]
    assert again == first  # exactly as on a fresh engine
    assert again[0] == 0
    assert engine_runs["on3"][1]["prefix_cache_hits"] == engine_runs["on1"][1]["prefix_cache_hits"]


def run_one(engine, request_id, prompt, params, salt):
    engine.add_request(request_id, prompt, params, cache_salt=salt)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    return final


def test_engine_cache_salt_isolates_tenants(engine_runs):
    llm = engine_runs["llm_on"]
    engine = llm.engine
    llm.reset_prefix_cache()
    prompt = engine_runs["prompts"][3]  # 52 tokens
    full = (len(prompt) - 1) // ENGINE_BS * ENGINE_BS
    order = [("alice", 0), ("bob", 0), ("alice", full), (None, 0), (None, full), ("", full),
             ("bob", full)]
    hits_before = engine.stats()["prefix_cache_hits"]
    outputs = []
    for i, (salt, expected) in enumerate(order):
        out = run_one(engine, f"salt-{i}", prompt, greedy(), salt)
        assert out.num_cached_tokens == expected, (salt, i)
        outputs.append(out.outputs[0].token_ids)
    assert engine.stats()["prefix_cache_hits"] - hits_before == 4 * full
    assert all(o == outputs[0] for o in outputs)  # the salt never changes the numbers
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()


def test_engine_n_greedy_samples_share_the_prompt(engine_runs):
    llm = engine_runs["llm_on"]
    prompt = engine_runs["prompts"][1][:45]  # not a whole number of blocks: a copy on write
    [single], _ = generate(llm, [prompt])
    [multi], _ = generate(llm, [prompt], greedy(n=3))
    assert [c.token_ids for c in multi.outputs] == [single.outputs[0].token_ids] * 3


def test_engine_reset_keeps_blocks_of_running_requests(engine_runs):
    llm = engine_runs["llm_on"]
    engine = llm.engine
    llm.reset_prefix_cache()
    prompt = engine_runs["prompts"][6]  # 56 tokens: 7 full blocks
    engine.add_request("held", prompt, greedy(max_tokens=3))
    engine.step()  # the prefill: 7 full blocks registered
    assert engine.stats()["kv_blocks_cached"] == 7
    assert llm.reset_prefix_cache() is True
    assert engine.stats()["kv_blocks_cached"] == 7  # still held, still cached
    engine.add_request("hit", prompt + [11], greedy(max_tokens=1))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert sorted(finished) == ["held", "hit"]
    assert finished["hit"].num_cached_tokens == 56
    assert finished["held"].num_cached_tokens == 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()
