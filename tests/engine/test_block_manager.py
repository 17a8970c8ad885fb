"""BlockManager: exact block ids, ref counts and free-queue order, plus a
stateful fuzz over allocate / append / free / preempt. Pure Python."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.core.block_manager import NULL_BLOCK, BlockManager


def fresh(num_blocks: int = 8, block_size: int = 4) -> BlockManager:
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size)
    bm.check_invariants()
    return bm


# -- construction and queries -------------------------------------------------------------
def test_fresh_manager_state():
    bm = fresh()
    assert list(bm.free_queue) == [1, 2, 3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 7
    assert bm.num_usable_blocks == 7
    assert bm.ref_counts == [0] * 8
    assert bm.block_tables == {}
    assert bm.usage() == 0.0


@pytest.mark.parametrize("num_blocks", [0, 1, -3])
def test_needs_null_block_and_one_more(num_blocks):
    with pytest.raises(ValueError, match=f"num_blocks={num_blocks}"):
        BlockManager(num_blocks=num_blocks, block_size=4)


def test_smallest_manager_has_one_usable_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert list(bm.free_queue) == [1]
    assert bm.allocate("a", 4) == [1]
    assert bm.allocate("b", 1) is None
    bm.check_invariants()


@pytest.mark.parametrize(
    "tokens, blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (28, 7)]
)
def test_blocks_for(tokens, blocks):
    assert fresh().blocks_for(tokens) == blocks


# -- allocate -----------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, table", [(0, []), (1, [1]), (4, [1]), (5, [1, 2])])
def test_allocate_covers_tokens(tokens, table):
    bm = fresh()
    assert bm.allocate("s", tokens) == table
    assert bm.block_table("s") == table
    assert bm.has("s")
    assert bm.num_free_blocks == 7 - len(table)
    for block_id in table:
        assert bm.ref_counts[block_id] == 1
    assert list(bm.free_queue) == list(range(1 + len(table), 8))
    bm.check_invariants()


def test_allocate_hands_out_blocks_in_order_and_never_the_null_block():
    bm = fresh()
    assert bm.allocate("a", 5) == [1, 2]
    assert bm.allocate("b", 1) == [3]
    assert bm.allocate("c", 12) == [4, 5, 6]
    assert bm.allocate("d", 4) == [7]
    assert bm.num_free_blocks == 0
    assert bm.ref_counts == [0, 1, 1, 1, 1, 1, 1, 1]
    assert NULL_BLOCK not in {b for t in bm.block_tables.values() for b in t}
    assert bm.usage() == 1.0
    bm.check_invariants()


def test_allocate_when_short_returns_none_and_changes_nothing():
    bm = fresh()
    bm.allocate("a", 20)  # 5 blocks: 1..5
    before = (list(bm.free_queue), list(bm.ref_counts), {k: list(v) for k, v in bm.block_tables.items()})
    assert bm.allocate("b", 9) is None  # needs 3, 2 free
    after = (list(bm.free_queue), list(bm.ref_counts), {k: list(v) for k, v in bm.block_tables.items()})
    assert after == before
    assert not bm.has("b")
    # exactly what is left still fits
    assert bm.allocate("b", 8) == [6, 7]
    bm.check_invariants()


def test_allocate_twice_for_same_sequence_raises():
    bm = fresh()
    bm.allocate("a", 4)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("a", 4)
    assert bm.block_table("a") == [1]
    assert bm.num_free_blocks == 6
    bm.check_invariants()


def test_allocate_zero_tokens_then_free_then_allocate_again():
    bm = fresh()
    assert bm.allocate("a", 0) == []
    with pytest.raises(ValueError):
        bm.allocate("a", 0)
    bm.free("a")
    assert not bm.has("a")
    assert bm.allocate("a", 1) == [1]
    bm.check_invariants()


# -- append_slots -------------------------------------------------------------------------
def test_append_slots_already_covered_returns_empty():
    bm = fresh()
    bm.allocate("a", 3)
    for total in (0, 1, 3, 4):
        assert bm.append_slots("a", total) == []
    assert bm.block_table("a") == [1]
    assert bm.num_free_blocks == 6
    bm.check_invariants()


def test_append_slots_grows_with_next_free_ids():
    bm = fresh()
    bm.allocate("a", 4)  # [1]
    bm.allocate("b", 4)  # [2]
    assert bm.append_slots("a", 5) == [3]
    assert bm.append_slots("a", 8) == []
    assert bm.append_slots("a", 16) == [4, 5]
    assert bm.block_table("a") == [1, 3, 4, 5]
    assert bm.block_table("b") == [2]
    assert list(bm.free_queue) == [6, 7]
    bm.check_invariants()


def test_append_slots_when_short_returns_none_and_changes_nothing():
    bm = fresh()
    bm.allocate("a", 16)  # [1, 2, 3, 4]
    bm.allocate("b", 8)  # [5, 6]
    assert bm.append_slots("a", 25) is None  # needs 3 more, 1 free
    assert bm.block_table("a") == [1, 2, 3, 4]
    assert list(bm.free_queue) == [7]
    assert bm.ref_counts == [0, 1, 1, 1, 1, 1, 1, 0]
    assert bm.append_slots("a", 20) == [7]
    assert bm.append_slots("b", 9) is None
    bm.check_invariants()


def test_append_slots_unknown_sequence_raises():
    with pytest.raises(KeyError):
        fresh().append_slots("nobody", 4)


# -- free -----------------------------------------------------------------------------------
def test_free_returns_blocks_tail_first_to_the_back():
    bm = fresh()
    assert bm.allocate("a", 12) == [1, 2, 3]
    assert bm.allocate("b", 8) == [4, 5]
    assert list(bm.free_queue) == [6, 7]
    bm.free("a")
    assert list(bm.free_queue) == [6, 7, 3, 2, 1]
    assert bm.ref_counts == [0, 0, 0, 0, 1, 1, 0, 0]
    assert not bm.has("a")
    bm.check_invariants()
    bm.free("b")
    assert list(bm.free_queue) == [6, 7, 3, 2, 1, 5, 4]
    assert bm.num_free_blocks == 7
    bm.check_invariants()
    # the next allocations take from the front, in queue order
    assert bm.allocate("c", 9) == [6, 7, 3]
    assert bm.allocate("d", 1) == [2]
    assert bm.allocate("e", 12) == [1, 5, 4]
    assert bm.allocate("f", 1) is None
    bm.check_invariants()


def test_free_of_grown_table_is_tail_first_in_table_order():
    bm = fresh()
    bm.allocate("a", 4)  # [1]
    bm.allocate("b", 4)  # [2]
    bm.append_slots("a", 12)  # a = [1, 3, 4]
    bm.free("a")
    assert list(bm.free_queue) == [5, 6, 7, 4, 3, 1]
    bm.check_invariants()


def test_free_unknown_id_is_a_no_op():
    bm = fresh()
    bm.allocate("a", 8)
    snapshot = (list(bm.free_queue), list(bm.ref_counts), dict(bm.block_tables))
    bm.free("nobody")
    bm.free(12345)
    assert (list(bm.free_queue), list(bm.ref_counts), dict(bm.block_tables)) == snapshot
    bm.free("a")
    bm.free("a")  # second free of the same id is also a no-op
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 2, 1]
    bm.check_invariants()


def test_check_invariants_detects_corruption():
    bm = fresh()
    bm.allocate("a", 8)
    bm.ref_counts[1] = 2  # claims a second holder that does not exist
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm.ref_counts[1] = 1
    bm.free_queue.append(1)  # in use and free at the same time
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm.free_queue.pop()
    bm.check_invariants()
    bm.free_queue.append(NULL_BLOCK)
    with pytest.raises(AssertionError):
        bm.check_invariants()


# -- stateful fuzz --------------------------------------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    """A model of the manager: seq -> covered token count, and preempted seqs
    waiting to be re-allocated with the tokens they had."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4, 8]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.tokens: dict[int, int] = {}  # running seq -> tokens covered
        self.preempted: dict[int, int] = {}  # seq -> tokens it had
        self.next_id = 0

    def _blocks(self, n):
        return -(-n // self.bm.block_size)

    @rule(num_tokens=st.integers(0, 40))
    def allocate(self, num_tokens):
        seq_id = self.next_id
        self.next_id += 1
        free_before = self.bm.num_free_blocks
        expected = list(self.bm.free_queue)[: self._blocks(num_tokens)]
        table = self.bm.allocate(seq_id, num_tokens)
        if self._blocks(num_tokens) > free_before:
            assert table is None
            assert self.bm.num_free_blocks == free_before
            assert not self.bm.has(seq_id)
        else:
            assert table == expected
            assert self.bm.num_free_blocks == free_before - len(table)
            self.tokens[seq_id] = num_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 20))
    def append(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        old_table = list(self.bm.block_table(seq_id))
        free_before = list(self.bm.free_queue)
        total = self.tokens[seq_id] + extra
        needed = self._blocks(total) - len(old_table)
        new = self.bm.append_slots(seq_id, total)
        if needed <= 0:
            assert new == []
        elif needed > len(free_before):
            assert new is None
            assert list(self.bm.free_queue) == free_before
            assert self.bm.block_table(seq_id) == old_table
            return
        else:
            assert new == free_before[:needed]
        assert self.bm.block_table(seq_id) == old_table + new
        self.tokens[seq_id] = total

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        table = list(self.bm.block_table(seq_id))
        queue = list(self.bm.free_queue)
        self.bm.free(seq_id)
        assert list(self.bm.free_queue) == queue + table[::-1]
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        self.preempted[seq_id] = self.tokens.pop(seq_id)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.preempted)))
        num_tokens = self.preempted[seq_id]
        table = self.bm.allocate(seq_id, num_tokens)
        if table is not None:
            assert len(table) == self._blocks(num_tokens)
            self.tokens[seq_id] = self.preempted.pop(seq_id)

    @rule()
    def free_unknown(self):
        snapshot = list(self.bm.free_queue)
        self.bm.free(-1)
        assert list(self.bm.free_queue) == snapshot

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants()
        free = set(bm.free_queue)
        referenced = {b for t in bm.block_tables.values() for b in t}
        assert not free & referenced
        assert all(count >= 0 for count in bm.ref_counts)
        assert NULL_BLOCK not in free | referenced
        held = sum(len(t) for t in bm.block_tables.values())
        assert bm.num_free_blocks + held == bm.num_usable_blocks
        assert set(bm.block_tables) == set(self.tokens)
        for seq_id, n in self.tokens.items():
            assert len(bm.block_table(seq_id)) == self._blocks(n)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert sorted(self.bm.free_queue) == list(range(1, self.bm.num_blocks))
        assert self.bm.block_tables == {}
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
