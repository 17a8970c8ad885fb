"""Scheduler: token budget, seat cap, chunked prefill, mixed batches, FCFS and
preemption by recompute — driven directly with hand-made sequences and a fake
model that "samples" a deterministic token per (sequence, output index)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus


# -- helpers ----------------------------------------------------------------------------
def prompt_of(seq_id: int, length: int) -> list[int]:
    return [seq_id * 1000 + i for i in range(length)]


def fake_token(seq_id: int, index: int) -> int:
    """The token the fake model samples as output number `index` of a sequence."""
    return 500_000 + seq_id * 1000 + index


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 16) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        index=0,
        prompt_token_ids=prompt_of(seq_id, prompt_len),
        params=SamplingParams(temperature=0, max_tokens=max_tokens),
    )


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=256, max_num_batched_tokens=64,
                   schedule_conservativeness=1.0, max_model_len=0):
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        schedule_conservativeness=schedule_conservativeness,
        max_model_len=max_model_len,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


@dataclass
class Step:
    # (seq_id, start_position, num_new_tokens, samples) per scheduled sequence
    scheduled: list[tuple[int, int, int, bool]]
    token_ids: dict[int, list[int]]
    tables: dict[int, list[int]]
    preempted: list[int]
    finished: list[int]
    admitted: list[int]  # scheduled ids that were waiting before the step


def step(sched: Scheduler) -> Step:
    """One scheduler step with the fake model; finishes sequences at max_tokens.
    Checks the step's own consistency before returning a snapshot of it."""
    running_before = [seq.seq_id for seq in sched.running]
    waiting_before = [seq.seq_id for seq in sched.waiting]
    out = sched.schedule()
    bm = sched.block_manager
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(out.sequences) <= sched.max_num_seqs
    assert len({s.seq_id for s in out.sequences}) == len(out.sequences)
    running = {seq.seq_id: seq for seq in sched.running}
    record = Step(
        scheduled=[(s.seq_id, s.start_position, s.num_new_tokens, s.sampling is not None)
                   for s in out.sequences],
        token_ids={s.seq_id: list(s.token_ids) for s in out.sequences},
        tables={s.seq_id: list(s.block_table) for s in out.sequences},
        preempted=list(out.preempted_seq_ids),
        finished=[],
        admitted=[s.seq_id for s in out.sequences if s.seq_id not in running_before],
    )
    # victims are the newest running sequences, newest first
    assert record.preempted == running_before[::-1][: len(record.preempted)]
    # first come, first served; nothing is admitted in a step that preempted
    assert record.admitted == waiting_before[: len(record.admitted)]
    if record.preempted:
        assert record.admitted == []
    assert len(sched.running) <= sched.max_num_seqs
    for s in out.sequences:
        seq = running[s.seq_id]
        assert s.num_new_tokens >= 1
        assert s.start_position == seq.num_computed_tokens
        assert s.token_ids == seq.token_slice(s.start_position, s.context_len)
        assert len(s.block_table) == bm.blocks_for(s.context_len)
        assert s.block_table == bm.block_table(s.seq_id)
        assert (s.sampling is not None) == (s.context_len == seq.num_tokens)
        assert s.sampling is (seq.params if s.context_len == seq.num_tokens else None)
        assert s.generator is seq.generator  # sampling reads the sequence's own state
        assert s.prompt_token_ids is seq.prompt_token_ids
        assert s.output_token_ids is seq.output_token_ids
    sampled = {
        s.seq_id: fake_token(s.seq_id, len(running[s.seq_id].output_token_ids))
        for s in out.sequences
        if s.sampling is not None
    }
    grew = sched.update(out, sampled)
    assert sorted(seq.seq_id for seq in grew) == sorted(sampled)
    for seq in grew:
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")
            record.finished.append(seq.seq_id)
    bm.check_invariants()
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert bm.has(seq.seq_id)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert not bm.has(seq.seq_id)
    return record


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[Step]:
    records = []
    while sched.has_unfinished():
        assert len(records) < max_steps, "scheduler made no progress"
        records.append(step(sched))
    return records


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished()
    assert bm.block_tables == {}
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()


def expected_outputs(seq: Sequence) -> list[int]:
    return [fake_token(seq.seq_id, i) for i in range(seq.params.max_tokens)]


# -- budget and seats -----------------------------------------------------------------------
def test_token_budget_is_split_in_arrival_order():
    sched = make_scheduler(max_num_batched_tokens=32)
    seqs = [make_seq(0, 10, 3), make_seq(1, 15, 3), make_seq(2, 20, 3)]
    for seq in seqs:
        sched.add(seq)
    s1 = step(sched)
    assert s1.scheduled == [(0, 0, 10, True), (1, 0, 15, True), (2, 0, 7, False)]
    assert s1.token_ids[2] == prompt_of(2, 20)[:7]
    assert s1.tables == {0: [1, 2, 3], 1: [4, 5, 6, 7], 2: [8, 9]}
    s2 = step(sched)
    assert s2.scheduled == [(0, 10, 1, True), (1, 15, 1, True), (2, 7, 13, True)]
    assert s2.token_ids[0] == [fake_token(0, 0)]
    assert s2.token_ids[2] == prompt_of(2, 20)[7:]
    assert s2.tables[0] == [1, 2, 3]
    assert s2.tables[2] == [8, 9, 10, 11, 12]
    s3 = step(sched)
    assert s3.scheduled == [(0, 11, 1, True), (1, 16, 1, True), (2, 20, 1, True)]
    assert s3.tables[1] == [4, 5, 6, 7, 13]  # position 16 opens a fifth block
    assert s3.finished == [0, 1]
    s4 = step(sched)
    assert s4.scheduled == [(2, 21, 1, True)]
    assert s4.finished == [2]
    assert seqs[2].output_token_ids == expected_outputs(seqs[2])
    assert_all_free(sched)


def test_budget_exhausted_by_running_leaves_later_running_idle():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_seq(0, 8, 4), make_seq(1, 8, 4)
    sched.add(a)
    sched.add(b)
    assert step(sched).scheduled == [(0, 0, 8, True)]
    # a decodes (1), b gets the 7 that remain, and then its last token next step
    assert step(sched).scheduled == [(0, 8, 1, True), (1, 0, 7, False)]
    assert step(sched).scheduled == [(0, 9, 1, True), (1, 7, 1, True)]
    records = run_to_completion(sched)
    assert a.output_token_ids == expected_outputs(a)
    assert b.output_token_ids == expected_outputs(b)
    assert sum(len(r.finished) for r in records) == 2
    assert_all_free(sched)


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq(0, 4, 2), make_seq(1, 4, 3), make_seq(2, 4, 1)
    for seq in (a, b, c):
        sched.add(seq)
    s1 = step(sched)
    assert s1.scheduled == [(0, 0, 4, True), (1, 0, 4, True)]
    assert list(sched.waiting) == [c]
    s2 = step(sched)
    assert s2.scheduled == [(0, 4, 1, True), (1, 4, 1, True)]
    assert s2.finished == [0]
    s3 = step(sched)  # a's seat is free again: c joins beside b's decode
    assert s3.scheduled == [(1, 5, 1, True), (2, 0, 4, True)]
    assert sorted(s3.finished) == [1, 2]
    assert_all_free(sched)


def test_max_num_seqs_one_runs_strictly_one_at_a_time():
    sched = make_scheduler(max_num_seqs=1)
    seqs = [make_seq(i, 3, 2) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    records = run_to_completion(sched)
    assert [r.scheduled for r in records] == [
        [(0, 0, 3, True)], [(0, 3, 1, True)],
        [(1, 0, 3, True)], [(1, 3, 1, True)],
        [(2, 0, 3, True)], [(2, 3, 1, True)],
    ]
    assert_all_free(sched)


# -- chunked prefill ------------------------------------------------------------------------
def test_chunked_prefill_exact_chunks():
    sched = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq(0, 40, 2)
    sched.add(seq)
    prompt = prompt_of(0, 40)
    records = run_to_completion(sched)
    assert [r.scheduled for r in records] == [
        [(0, 0, 16, False)],
        [(0, 16, 16, False)],
        [(0, 32, 8, True)],
        [(0, 40, 1, True)],
    ]
    assert [r.token_ids[0] for r in records] == [
        prompt[:16], prompt[16:32], prompt[32:], [fake_token(0, 0)]
    ]
    assert [len(r.tables[0]) for r in records] == [4, 8, 10, 11]
    assert records[0].tables[0] == list(range(1, 5))
    assert records[3].tables[0] == list(range(1, 12))
    assert seq.output_token_ids == [fake_token(0, 0), fake_token(0, 1)]
    assert seq.status is SequenceStatus.FINISHED
    assert_all_free(sched)


def test_decodes_keep_flowing_beside_a_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=16)
    a = make_seq(0, 4, 6)
    b = make_seq(1, 40, 2)
    sched.add(a)
    assert step(sched).scheduled == [(0, 0, 4, True)]
    sched.add(b)
    s2 = step(sched)
    assert s2.scheduled == [(0, 4, 1, True), (1, 0, 15, False)]
    assert s2.token_ids == {0: [fake_token(0, 0)], 1: prompt_of(1, 40)[:15]}
    s3 = step(sched)
    assert s3.scheduled == [(0, 5, 1, True), (1, 15, 15, False)]
    assert s3.token_ids[1] == prompt_of(1, 40)[15:30]
    s4 = step(sched)
    assert s4.scheduled == [(0, 6, 1, True), (1, 30, 10, True)]
    assert s4.token_ids[1] == prompt_of(1, 40)[30:]
    s5 = step(sched)
    assert s5.scheduled == [(0, 7, 1, True), (1, 40, 1, True)]
    assert s5.finished == [1]
    s6 = step(sched)
    assert s6.scheduled == [(0, 8, 1, True)]
    assert s6.finished == [0]
    assert a.output_token_ids == expected_outputs(a)
    assert b.output_token_ids == expected_outputs(b)
    assert_all_free(sched)


# -- admission order -----------------------------------------------------------------------
def test_fcfs_head_of_queue_blocks_later_ones():
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=64)  # 6 usable blocks
    a, b, c = make_seq(0, 16, 3), make_seq(1, 12, 1), make_seq(2, 4, 1)
    for seq in (a, b, c):
        sched.add(seq)
    s1 = step(sched)
    # a takes 4 blocks; b needs 3 of the 2 left; c would fit but must not overtake b
    assert s1.scheduled == [(0, 0, 16, True)]
    assert list(sched.waiting) == [b, c]
    assert sched.block_manager.num_free_blocks == 2
    s2 = step(sched)
    assert s2.scheduled == [(0, 16, 1, True)]
    assert list(sched.waiting) == [b, c]
    assert sched.block_manager.num_free_blocks == 1
    s3 = step(sched)
    assert s3.scheduled == [(0, 17, 1, True)]
    assert s3.finished == [0]
    s4 = step(sched)
    assert s4.scheduled == [(1, 0, 12, True), (2, 0, 4, True)]
    assert s4.tables == {1: [6, 5, 4], 2: [3]}  # a's blocks came back tail first, behind 6
    assert sorted(s4.finished) == [1, 2]
    assert_all_free(sched)


def test_waiting_sequence_finished_before_it_ran():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq(0, 4, 2), make_seq(1, 4, 2)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.finish(b, "abort")
    assert b.status is SequenceStatus.FINISHED
    assert b.finish_reason == "abort"
    assert list(sched.waiting) == []
    run_to_completion(sched)
    assert b.output_token_ids == []
    assert_all_free(sched)


def test_finish_frees_blocks_of_running_sequence():
    sched = make_scheduler(num_blocks=16)
    a, b = make_seq(0, 9, 10), make_seq(1, 4, 10)
    sched.add(a)
    sched.add(b)
    step(sched)
    bm = sched.block_manager
    assert bm.block_table(0) == [1, 2, 3]
    assert bm.num_free_blocks == 11
    sched.finish(a, "stop", 7)
    assert not bm.has(0)
    assert bm.num_free_blocks == 14
    assert list(bm.free_queue)[-3:] == [3, 2, 1]
    assert sched.running == [b]
    assert (a.status, a.finish_reason, a.stop_reason) == (SequenceStatus.FINISHED, "stop", 7)
    # an update carrying a token for the finished sequence ignores it
    out = sched.schedule()
    assert [s.seq_id for s in out.sequences] == [1]
    grew = sched.update(out, {0: 99, 1: fake_token(1, 1)})
    assert grew == [b]
    assert a.output_token_ids == [fake_token(0, 0)]
    sched.finish(b, "abort")
    assert_all_free(sched)


def test_update_skips_a_sequence_finished_while_the_step_ran():
    sched = make_scheduler()
    a, b = make_seq(0, 4, 5), make_seq(1, 4, 5)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.finish(a, "abort")
    grew = sched.update(out, {0: 1, 1: 2})
    assert grew == [b]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert b.output_token_ids == [2] and b.num_computed_tokens == 4
    sched.finish(b, "abort")
    assert_all_free(sched)


# -- preemption -----------------------------------------------------------------------------
# These admit without headroom (schedule_conservativeness=0), as the scheduler did
# before it kept any, so that growing decodes must preempt.
def test_preemption_newest_first_by_recompute():
    # 4 usable blocks of 4 tokens
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64, schedule_conservativeness=0)
    a, b, c = make_seq(0, 7, 4), make_seq(1, 7, 4), make_seq(2, 3, 1)
    sched.add(a)
    sched.add(b)
    s1 = step(sched)
    assert s1.scheduled == [(0, 0, 7, True), (1, 0, 7, True)]
    assert s1.tables == {0: [1, 2], 1: [3, 4]}
    sched.add(c)  # arrives while memory is full
    s2 = step(sched)
    assert s2.scheduled == [(0, 7, 1, True), (1, 7, 1, True)]
    assert s2.preempted == []
    assert list(sched.waiting) == [c]
    # a's token at position 8 needs a third block: b (newest) is preempted
    s3 = step(sched)
    assert s3.preempted == [1]
    assert s3.scheduled == [(0, 8, 1, True)]  # b is gone and nothing new is admitted
    assert s3.tables[0] == [1, 2, 4]  # b's blocks went back tail first: 4, 3
    assert list(sched.waiting) == [b, c]  # front of the queue, ahead of c
    assert b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.output_token_ids == [fake_token(1, 0), fake_token(1, 1)]
    assert not sched.block_manager.has(1)
    assert sched.num_preemptions == 1
    s4 = step(sched)  # b needs 3 blocks to recompute 9 tokens, only 1 is free
    assert s4.scheduled == [(0, 9, 1, True)]
    assert s4.preempted == []
    assert s4.finished == [0]
    s5 = step(sched)  # b resumes: prompt + its outputs so far, all recomputed
    assert s5.scheduled == [(1, 0, 9, True), (2, 0, 3, True)]
    assert s5.token_ids[1] == prompt_of(1, 7) + [fake_token(1, 0), fake_token(1, 1)]
    assert s5.finished == [2]
    records = run_to_completion(sched)
    assert [r.scheduled for r in records] == [[(1, 9, 1, True)]]
    # it carries on exactly where it stopped
    assert b.output_token_ids == expected_outputs(b)
    assert a.output_token_ids == expected_outputs(a)
    assert sched.num_preemptions == 1
    assert_all_free(sched)


def test_two_sequences_each_preempt_one_victim_in_the_same_step():
    # 4 usable blocks
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64, schedule_conservativeness=0)
    seqs = [make_seq(i, 4, 3) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    s1 = step(sched)
    assert [x[0] for x in s1.scheduled] == [0, 1, 2, 3]
    s2 = step(sched)  # everybody crosses into a second block
    assert s2.preempted == [3, 2]
    assert s2.scheduled == [(0, 4, 1, True), (1, 4, 1, True)]
    assert s2.tables == {0: [1, 4], 1: [2, 3]}
    assert list(sched.waiting) == [seqs[2], seqs[3]]  # original order kept
    assert sched.num_preemptions == 2
    records = run_to_completion(sched)
    assert records[0].scheduled == [(0, 5, 1, True), (1, 5, 1, True)]
    assert records[0].finished == [0, 1]
    assert records[1].scheduled == [(2, 0, 5, True), (3, 0, 5, True)]
    assert records[1].token_ids == {
        2: prompt_of(2, 4) + [fake_token(2, 0)],
        3: prompt_of(3, 4) + [fake_token(3, 0)],
    }
    for seq in seqs:
        assert seq.output_token_ids == expected_outputs(seq)
    assert_all_free(sched)


def test_resumed_sequence_recomputes_in_chunks_and_samples_only_at_the_end():
    # 4 usable blocks, budget 8: b's recompute (prompt 6 + 3 outputs = 9 tokens)
    # takes two chunks; the first ends past the prompt but must not sample
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=8, schedule_conservativeness=0)
    a, b = make_seq(0, 4, 10), make_seq(1, 6, 5)
    sched.add(a)
    sched.add(b)
    records = run_to_completion(sched)
    assert [r.scheduled for r in records] == [
        [(0, 0, 4, True), (1, 0, 4, False)],
        [(0, 4, 1, True), (1, 4, 2, True)],
        [(0, 5, 1, True), (1, 6, 1, True)],
        [(0, 6, 1, True), (1, 7, 1, True)],
        [(0, 7, 1, True)],  # b needs a third block for position 8: it is the newest
        [(0, 8, 1, True)],
        [(0, 9, 1, True)],
        [(0, 10, 1, True)],
        [(0, 11, 1, True)],
        [(0, 12, 1, True)],
        [(1, 0, 8, False)],
        [(1, 8, 1, True)],
        [(1, 9, 1, True)],
    ]
    assert [r.preempted for r in records].index([1]) == 4
    assert records[10].token_ids[1] == prompt_of(1, 6) + [fake_token(1, 0), fake_token(1, 1)]
    assert records[11].token_ids[1] == [fake_token(1, 2)]
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert a.output_token_ids == expected_outputs(a)
    assert b.output_token_ids == expected_outputs(b)
    assert_all_free(sched)


def test_only_sequence_that_cannot_fit_preempts_itself():
    # 2 usable blocks of 4 tokens: the sequence outgrows the whole pool
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=16, schedule_conservativeness=0)
    seq = make_seq(0, 4, 100)
    sched.add(seq)
    records = [step(sched) for _ in range(5)]
    assert [r.scheduled for r in records] == [
        [(0, 0, 4, True)], [(0, 4, 1, True)], [(0, 5, 1, True)],
        [(0, 6, 1, True)], [(0, 7, 1, True)],
    ]
    out = sched.schedule()  # position 8 needs a third block: none exists
    assert out.is_empty
    assert out.preempted_seq_ids == [0]
    assert list(sched.waiting) == [seq] and sched.running == []
    assert seq.num_computed_tokens == 0
    assert seq.output_token_ids == [fake_token(0, i) for i in range(5)]
    assert sched.block_manager.num_free_blocks == 2
    sched.block_manager.check_invariants()
    # it can never be admitted again: later steps are empty and change nothing
    for _ in range(3):
        out = sched.schedule()
        assert out.is_empty and out.preempted_seq_ids == []
        assert sched.block_manager.num_free_blocks == 2
        assert list(sched.waiting) == [seq]
    assert sched.num_preemptions == 1
    sched.finish(seq, "abort")
    assert_all_free(sched)


def test_preempted_mid_prefill_sequence_restarts_its_prompt():
    # a decodes in 1 block; b's chunked prefill runs out of blocks and, as the
    # newest, preempts itself; it restarts from 0 once a is done
    # 5 usable blocks
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=8, schedule_conservativeness=0)
    a, b = make_seq(0, 4, 6), make_seq(1, 20, 1)
    sched.add(a)
    assert step(sched).scheduled == [(0, 0, 4, True)]
    sched.add(b)
    assert step(sched).scheduled == [(0, 4, 1, True), (1, 0, 7, False)]  # a: 2 blocks, b: 2
    s3 = step(sched)  # b needs 4 blocks for 14 tokens, 1 is free
    assert s3.preempted == [1]
    assert s3.scheduled == [(0, 5, 1, True)]
    assert b.num_computed_tokens == 0
    assert s3.tables == {0: [1, 2]}
    assert sched.block_manager.num_free_blocks == 3
    records = run_to_completion(sched)
    b_steps = [x for r in records for x in r.scheduled if x[0] == 1]
    # every (re)start of b begins at position 0 with its prompt
    restarts = [r.token_ids[1] for r in records if (1, 0, 7, False) in r.scheduled]
    assert restarts and all(t == prompt_of(1, 20)[:7] for t in restarts)
    assert b_steps[-1][3] is True and sum(x[2] for x in b_steps[-3:]) == 20
    assert a.num_preemptions == 0
    assert b.output_token_ids == expected_outputs(b)
    assert a.output_token_ids == expected_outputs(a)
    assert_all_free(sched)


# -- admission headroom -------------------------------------------------------------------------
def test_admission_keeps_headroom_for_growth_instead_of_preempting():
    # the preemption test's opening, with headroom: 4 usable blocks, a and b each
    # need 2 blocks for their prompts and a third to decode to max_tokens
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    a, b = make_seq(0, 7, 4), make_seq(1, 7, 4)
    sched.add(a)
    sched.add(b)
    s1 = step(sched)
    # b fits, but would leave 0 free blocks against an expected growth of
    # min(0.698, 0.3) * (1 + 1): it waits, a runs alone
    assert s1.scheduled == [(0, 0, 7, True)]
    assert s1.tables == {0: [1, 2]}
    records = run_to_completion(sched)
    assert [r.scheduled for r in records] == [
        [(0, 7, 1, True)],  # 2 free, b needs both: still 0 left for the growth
        [(0, 8, 1, True)],  # a takes its third block
        [(0, 9, 1, True)],
        [(1, 0, 7, True)],  # a has finished: b runs into an empty batch
        [(1, 7, 1, True)],
        [(1, 8, 1, True)],
        [(1, 9, 1, True)],
    ]
    assert records[1].tables == {0: [1, 2, 3]}
    assert records[3].tables == {1: [4, 3]}  # the unused block 4, then a's, freed tail first
    assert sched.num_preemptions == 0 and sched.num_prompt_tokens_computed == 14
    assert a.output_token_ids == expected_outputs(a)
    assert b.output_token_ids == expected_outputs(b)
    assert_all_free(sched)


def test_admission_fills_the_cache_when_nothing_grows():
    # prompts of one block that sample a single token never take another block:
    # all four fit exactly, headroom or not
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    seqs = [make_seq(i, 4, 1) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    s1 = step(sched)
    assert s1.scheduled == [(i, 0, 4, True) for i in range(4)]
    assert s1.tables == {0: [1], 1: [2], 2: [3], 3: [4]}
    assert s1.finished == [0, 1, 2, 3]
    assert_all_free(sched)


def test_growth_ratio_relaxes_each_quiet_step_and_rises_on_preemption():
    # one sequence that outgrows the whole pool: it preempts itself at step 6
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=16)
    sched.add(make_seq(0, 4, 100))
    for _ in range(5):
        step(sched)
    assert sched.headroom.growth_ratio == pytest.approx(0.7 - 5 * 0.002)
    out = sched.schedule()
    assert out.preempted_seq_ids == [0]
    assert sched.headroom.growth_ratio == pytest.approx(0.7 - 5 * 0.002 + 0.3)
    sched.schedule()  # a step with one preemption more would not pass the ceiling
    assert sched.headroom.growth_ratio == pytest.approx(0.99 - 0.002)
    for _ in range(1000):
        sched.schedule()
    assert sched.headroom.growth_ratio == pytest.approx(0.1)  # the floor
    sched.finish(sched.waiting[0], "abort")
    assert_all_free(sched)


def test_observed_ratio_follows_what_finished_requests_generated():
    sched = make_scheduler(num_blocks=64)
    seqs = [make_seq(i, 4, 10) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    step(sched)  # every sequence has its first token
    assert sched.headroom.observed_ratio == 0.3
    sched.finish(seqs[0], "stop")  # 1 of 10 tokens
    assert sched.headroom.observed_ratio == pytest.approx(0.3 + 0.1 * (0.1 - 0.3))
    sched.finish(seqs[1], "abort")  # says nothing about lengths
    assert sched.headroom.observed_ratio == pytest.approx(0.28)
    for _ in range(9):
        step(sched)  # the other two run to max_tokens
    assert sched.headroom.observed_ratio == pytest.approx(0.28 + 0.1 * 0.72 + 0.1 * (1 - 0.352))
    assert_all_free(sched)


def test_short_answers_let_admission_run_more_sequences():
    # 8 usable blocks of 4 tokens; a sequence of 4 prompt tokens and max_tokens
    # 20 ends up holding 6 blocks (23 tokens of K/V)
    def admitted_beside_a_running_one(shares):
        sched = make_scheduler(num_blocks=9, max_num_batched_tokens=64)
        sched.headroom.observed_ratio = shares
        sched.add(make_seq(0, 4, 20))
        step(sched)
        for i in range(1, 6):
            sched.add(make_seq(i, 4, 20))
        return step(sched).admitted
    # 0 holds 2 blocks (4 to go), 6 are free; each newcomer takes 1 (5 to go).
    # At the prior 0.3, one newcomer: 5 free >= 0.3 * 9, but not 4 >= 0.3 * 14
    assert admitted_beside_a_running_one(0.3) == [1]
    # requests that stop after 1/20 of max_tokens: 2 free >= 0.05 * 24, not 1 >= 0.05 * 29
    assert admitted_beside_a_running_one(0.05) == [1, 2, 3, 4]


def test_expected_growth_is_capped_by_max_model_len_and_the_estimate_cap():
    sched = make_scheduler(num_blocks=64, max_model_len=64)
    seq = make_seq(0, 10, 1000)
    # 63 tokens of K/V at most (the 64th is sampled, never stored): 16 blocks, 3 held
    assert sched.headroom.growth(seq, 3) == 13
    unbounded = make_scheduler(num_blocks=64)
    # no max_model_len: max_tokens counts up to GROWTH_CAP_TOKENS past the prompt
    assert unbounded.headroom.growth(make_seq(1, 10, 100_000), 3) == (10 + 2048 - 1 + 3) // 4 - 3
    assert unbounded.headroom.growth(make_seq(2, 10, 5), 3) == 1  # 14 tokens: 4 blocks


# -- random scenarios -------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 12),
    max_num_seqs=st.integers(1, 6),
    budget_extra=st.integers(0, 24),
    specs=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 8), st.integers(0, 3)),
                   min_size=1, max_size=8),
    conservativeness=st.sampled_from([0.0, 1.0, 3.0]),
)
def test_random_scenarios_complete_with_exact_outputs(
    block_size, spare_blocks, max_num_seqs, budget_extra, specs, conservativeness
):
    """Any mix finishes, every sequence gets exactly its fake tokens (so
    recompute after preemption neither loses nor repeats work), and all blocks
    come back. The pool always fits the longest sequence on its own."""
    longest = max(p + m - 1 for p, m, _ in specs)
    num_blocks = -(-longest // block_size) + 1 + spare_blocks
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, block_size + budget_extra,
                           schedule_conservativeness=conservativeness)
    seqs = [make_seq(i, p, m) for i, (p, m, _) in enumerate(specs)]
    pending = list(zip(seqs, (d for _, _, d in specs)))
    steps = 0
    while pending or sched.has_unfinished():
        # arrivals: each sequence waits `delay` steps after the previous one
        while pending and pending[0][1] == 0:
            sched.add(pending.pop(0)[0])
        if pending:
            pending[0] = (pending[0][0], pending[0][1] - 1)
        record = step(sched)
        steps += 1
        assert steps < 2000
        for seq_id in record.admitted:
            start = record.scheduled[[x[0] for x in record.scheduled].index(seq_id)][1]
            assert start == 0
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED
        assert seq.output_token_ids == expected_outputs(seq)
    assert sched.num_preemptions == sum(seq.num_preemptions for seq in seqs)
    assert_all_free(sched)
