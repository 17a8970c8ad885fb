"""scheduling_policy="priority" (vLLM's): the waiting queue in (priority, arrival)
order, preemption of the lowest-ranked running sequence, a head that outranks a
full engine preempting its way in; exact, on hand-made sequences; then the
engine's greedy outputs unchanged by priorities."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams


def make_seq(seq_id: int, prompt_len: int, priority: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0,
                    prompt_token_ids=[seq_id * 1000 + i for i in range(prompt_len)],
                    params=SamplingParams(temperature=0, max_tokens=max_tokens),
                    priority=priority)


def make_scheduler(num_blocks=64, max_num_seqs=8, policy="priority",
                   conservativeness=1.0) -> Scheduler:
    config = EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                          scheduling_policy=policy, schedule_conservativeness=conservativeness)
    return Scheduler(config, BlockManager(num_blocks, 4))


def step(sched: Scheduler):
    """One step with a fake model sampling token 7; finishes at max_tokens."""
    out = sched.schedule()
    sampled = {s.seq_id: 7 for s in out.sequences if s.sampling is not None}
    for seq in sched.update(out, sampled):
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")
    sched.block_manager.check_invariants()
    return out


def test_the_waiting_queue_is_in_priority_then_arrival_order():
    sched = make_scheduler()
    for seq_id, priority in enumerate([5, 1, 3, 1, 5]):
        sched.add(make_seq(seq_id, 4, priority))
    assert [s.seq_id for s in sched.waiting] == [1, 3, 2, 0, 4]
    fcfs = make_scheduler(policy="fcfs")
    for seq_id, priority in enumerate([5, 1, 3]):
        fcfs.add(make_seq(seq_id, 4, priority))
    assert [s.seq_id for s in fcfs.waiting] == [0, 1, 2]  # priorities ignored


def test_a_head_that_outranks_a_full_engine_preempts_the_lowest_ranked():
    sched = make_scheduler(max_num_seqs=2)
    batch = [make_seq(0, 8, priority=10), make_seq(1, 8, priority=5)]
    for seq in batch:
        sched.add(seq)
    step(sched)
    assert [s.seq_id for s in sched.running] == [1, 0]  # admitted in rank order
    sched.add(make_seq(2, 8, priority=0))
    out = step(sched)
    assert out.preempted_seq_ids == [0]  # the lowest priority, not the newest
    assert 2 in [s.seq_id for s in out.sequences]  # admitted in the same step
    assert [s.seq_id for s in sched.waiting] == [0]
    sched.add(make_seq(3, 8, priority=10))  # ties and lower ranks never preempt
    out = step(sched)
    assert out.preempted_seq_ids == [] and [s.seq_id for s in sched.waiting] == [0, 3]
    while sched.has_unfinished():
        step(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


def test_lower_priorities_sit_out_the_steps_of_an_urgent_prompt():
    # a 100-token urgent prompt takes two chunks of the 64-token budget
    sched = make_scheduler(max_num_seqs=2)
    for seq_id in (0, 1):
        sched.add(make_seq(seq_id, 8, priority=10, max_tokens=20))
    step(sched), step(sched)
    sched.add(make_seq(2, 100, priority=0))
    first, second, third = step(sched), step(sched), step(sched)
    assert first.preempted_seq_ids == [1]
    assert [(s.seq_id, s.num_new_tokens) for s in first.sequences] == [(2, 64)]
    assert [(s.seq_id, s.num_new_tokens) for s in second.sequences] == [(2, 36)]
    assert sorted((s.seq_id, s.num_new_tokens) for s in third.sequences) == [(0, 1), (2, 1)]
    while sched.has_unfinished():
        step(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


def test_under_fcfs_an_urgent_prompt_shares_its_step():
    sched = make_scheduler(max_num_seqs=3, policy="fcfs")
    for seq_id in (0, 1):
        sched.add(make_seq(seq_id, 8, priority=10, max_tokens=20))
    step(sched), step(sched)
    sched.add(make_seq(2, 100, priority=0))
    out = step(sched)
    assert sorted((s.seq_id, s.num_new_tokens) for s in out.sequences) == [(0, 1), (1, 1), (2, 62)]


def test_out_of_blocks_the_victim_is_the_lowest_ranked():
    # 8 usable blocks of 4 tokens; all three admitted at once (no headroom kept)
    sched = make_scheduler(num_blocks=9, conservativeness=0)
    for seq_id, priority in [(0, 1), (1, 9), (2, 1)]:
        sched.add(make_seq(seq_id, 8, priority, max_tokens=12))
    step(sched)
    assert len(sched.running) == 3
    victims = []
    while sched.has_unfinished():
        victims += step(sched).preempted_seq_ids
    # the priority-9 one first; then, between equals, the later arrival
    assert victims[0] == 1 and 0 not in victims
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


def test_priorities_leave_greedy_outputs_unchanged(tiny_llama_path, single_thread):
    from engine import EngineConfig as Config, LLMEngine

    def run(policy: str) -> dict[str, list[int]]:
        engine = LLMEngine(Config(model=str(tiny_llama_path), dtype="float32", max_num_seqs=2,
                                  scheduling_policy=policy, max_model_len=256))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i in range(5):
            engine.add_request(f"r{i}", list(range(100 + i, 140 + i)), params, priority=5 - i)
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)
        return finished

    assert run("priority") == run("fcfs")
