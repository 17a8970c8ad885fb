"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`) and a cap on running
sequences (`max_num_seqs`). The scheduler spends the budget in two passes:

    1. running sequences, oldest first: a decode costs 1 token, an unfinished
       prefill the rest of its prompt (or as much as the budget allows: a *chunk*).
       Decodes therefore keep flowing while a long prompt is prefilled a chunk per step.
    2. waiting sequences, in arrival order, while budget, seats, blocks and LoRA slots
       last (at most `max_loras` adapters at once); a pooling prompt enters whole or waits.

When a running sequence needs a block and none is free, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of
the waiting queue with `num_computed_tokens = 0`. When it is admitted again it
recomputes its prompt *and* the tokens it already generated (recompute, not
swap), then carries on exactly where it stopped. Nothing new is admitted in a
step that preempted, so the freed memory goes to the sequences that needed it.
Recomputation is wasted work, so admission keeps headroom for the growth
the running sequences still expect (engine/core/headroom.py).

Prefix caching enters at admission: a new sequence first looks up the longest chain
of cached blocks matching its prompt and starts with `num_computed_tokens` there.
With offload tiers (engine/core/kv_offload/), the lookup goes on into the tiers:
a sequence with blocks to load waits aside in `loading`, holding up nobody,
and comes back to the head of the queue when they have landed as cached blocks.
It waits aside the same way for the remote tiers' answer, which is asked in
the background (kv_offload/lookup.py): no step waits on the network.
Blocks are registered in the cache in the step that fills them, so a request
can hit a prefix that another one is still generating from, or is computing
in this very step (each layer stores the whole batch's K/V before attending).

Priorities (`scheduling_policy="priority"`, vLLM's): the waiting queue is kept
in (priority, arrival) order, lower values first, and a preemption takes the
running sequence of the lowest priority (latest arrival among equals). A
waiting head that outranks a running sequence and finds no seat or no blocks
for its first chunk preempts the lowest-ranked ones first, so an interactive
request overtakes a batch job even when the batch fills the engine. While a
prompt is computed, running sequences of a lower priority sit out: the
prompt's step is then as short as on an idle engine (on a CPU every row of a
step costs compute), and the batch loses those steps, not the interactive
request its time to first token.

Parallel samples (n > 1) compute their shared prompt once: the first sample
prefills it, the others wait, then *fork* its blocks (ref counts + 1) and each
recomputes only the last prompt token to draw its own first token. Whoever
first writes into a block that is still shared gets a private copy of it
(copy on write; the runner copies the K/V before the forward pass).

The result is a `SchedulerOutput`, plain data and all the runner sees: which
sequences run, which of their tokens, and what sampling reads where they sample.
"""

from __future__ import annotations

from bisect import insort
from collections import deque

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.headroom import Headroom
from engine.core.kv_offload.offload import KVOffload
from engine.core.sched_output import ScheduledSequence, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus

LOADING = -1  # what _admit returns for a sequence that waits aside for its look-up or loads


def rank(seq: Sequence) -> tuple[int, int]:
    """A sequence's place under the priority policy: priority, then arrival."""
    return seq.priority, seq.seq_id


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 offload: KVOffload | None = None) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_loras = config.max_loras  # distinct LoRA adapters in the running batch
        self.whole_prompts = config.runner == "pooling"  # its prompts' rows are pooled together
        self.block_size = config.block_size
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # waiting for blocks from the offload tiers
        self.offload = offload
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prefill work done, recomputation included
        self.max_model_len = config.max_model_len
        self.by_priority = config.scheduling_policy == "priority"
        self.seated: Sequence | None = None  # a head that preempted others to be admitted
        self.headroom = Headroom(config, block_manager)

    # -- queue management ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.block_manager.enable_caching:
            seq.update_block_hashes(self.block_size)
            if self.offload is not None and seq.fork_parent is None:
                self.offload.note_arrival(seq.block_hashes)
        self._wait(seq, front=False)

    def _wait(self, seq: Sequence, front: bool) -> None:
        """Queue `seq`: by rank under the priority policy; else at the back, or at the
        front (a preempted or loaded sequence goes ahead of later arrivals)."""
        if self.by_priority:
            insort(self.waiting, seq, key=rank)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence (stop, length or abort) and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            if seq in self.running:  # not if async scheduling retired it (frontend/async_step.py)
                self.running.remove(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if self.offload is not None:
            self.offload.forget(seq)
        self.block_manager.free(seq.seq_id)
        if reason != "abort":
            self.headroom.note_finished(seq)
        seq.finish(reason, stop_reason)

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        made_room = self._make_room_for_priority(output) if self.by_priority else 0
        hold = self._prompt_priority() if self.by_priority else None
        budget = self._schedule_running(output, self.max_num_batched_tokens, hold)
        preempted = len(output.preempted_seq_ids) > made_room
        self.headroom.after_step(preempted)
        if not preempted:
            self._schedule_waiting(output, budget)
        output.window_blocks_to_copy = self.block_manager.take_window_copies()
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int, hold: int | None) -> int:
        """Running sequences in order; with `hold` (priority policy), in rank order
        and only those of priority `hold` or better (_prompt_priority)."""
        if hold is not None:
            self.running.sort(key=rank)  # the victims (lowest ranks) stay at the end
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if hold is not None and seq.priority > hold:
                break  # it and everyone after it sit out this step
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = self._fitting_draft(seq, num_new, budget, len(self.running) - i - 1)
            if not self._reserve(seq, num_new + len(draft), output):
                break  # `seq` itself was preempted: everything after it is gone too
            output.sequences.append(self._scheduled(seq, num_new, draft))
            budget -= num_new + len(draft)
            i += 1
        return budget

    def _prompt_priority(self) -> int | None:
        """The most urgent priority with prompt work this step (a running sequence's
        prefill or recompute, or a head that preempted for its seat, which is sure
        to be admitted), when running sequences of a lower priority would share
        the step; else None."""
        prompts = [seq.priority for seq in self.running
                   if seq.num_computed_tokens < seq.num_tokens - 1]
        if self.seated is not None and self.waiting and self.waiting[0] is self.seated:
            prompts.append(self.seated.priority)
        if not prompts:
            return None
        hold = min(prompts)
        return hold if any(seq.priority > hold for seq in self.running) else None

    def _fitting_draft(self, seq: Sequence, num_new: int, budget: int, others: int) -> list[int]:
        """The part of a decoding sequence's draft (engine/spec_decode/) that the
        token budget and the free blocks allow. A draft is a guess: it never
        preempts anyone, it is cut instead, and it leaves a free block for each
        of the `others` running sequences scheduled after it (their next token
        may need one)."""
        draft, seq.draft_token_ids = seq.draft_token_ids, []
        if not draft or num_new != 1 or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        room = self.max_model_len - seq.num_tokens if self.max_model_len else len(draft)
        draft = draft[: min(budget - 1, room)]
        manager = self.block_manager
        held = len(manager.block_table(seq.seq_id))
        spare = manager.num_free_blocks - others
        while draft and manager.blocks_for(seq.num_tokens + len(draft)) - held > spare:
            draft.pop()
        if draft and manager.append_slots(seq.seq_id, seq.num_tokens + len(draft)) is None:
            return []
        return draft

    def _reserve(self, seq: Sequence, num_new: int, output: SchedulerOutput) -> bool:
        """Find blocks for `seq`'s next tokens, preempting the newest sequences if needed."""
        start = seq.num_computed_tokens
        while not (
            self.block_manager.append_slots(seq.seq_id, start + num_new) is not None
            and self._unshare(seq, start, start + num_new, output)
        ):
            victim = self._victim()
            self._preempt(victim)
            output.preempted_seq_ids.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _unshare(self, seq: Sequence, start: int, end: int, output: SchedulerOutput) -> bool:
        """Copy on write: private copies of the shared blocks that tokens [start, end) land in."""
        manager = self.block_manager
        for index in range(start // self.block_size, (end - 1) // self.block_size + 1):
            if manager.is_shared(seq.seq_id, index):
                copy = manager.copy_on_write(seq.seq_id, index)
                if copy is None:
                    return False
                output.blocks_to_copy.append(copy)
        return True

    def _victim(self) -> Sequence:
        """Whom a preemption takes: the newest, or the lowest-ranked by priority."""
        return max(self.running, key=rank) if self.by_priority else self.running[-1]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._wait(seq, front=True)
        self.num_preemptions += 1

    def _make_room_for_priority(self, output: SchedulerOutput) -> int:
        """Preempt the lowest-ranked running sequences while the waiting head
        outranks them and has no seat or no blocks for its first chunk. Returns
        how many. A head that outranks a running sequence then skips the
        headroom check once (`seated`): the room made is not left to the next
        arrival, and it is sure to be admitted this step (_prompt_priority)."""
        made = 0
        while self.waiting and self.running:
            head, victim = self.waiting[0], self._victim()
            manager = self.block_manager
            needs = manager.blocks_for(min(head.num_tokens, self.max_num_batched_tokens))
            fits = len(self.running) < self.max_num_seqs and needs <= manager.num_free_blocks
            if fits and head.priority < victim.priority:
                self.seated = head
            if fits or head.priority >= victim.priority:
                break
            self._preempt(victim)
            output.preempted_seq_ids.append(victim.seq_id)
            self.seated = head
            made += 1
        return made

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        if self.loading:
            self._return_loaded()
        growth = self.headroom.running_growth(self.running) if self.waiting else 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget, output, growth)
            if num_new is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if seq is self.seated:
                self.seated = None
            if num_new == LOADING:
                self.loading.append(seq)  # aside until its blocks land; the next one may go
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.sequences.append(self._scheduled(seq, num_new))
            growth += self.headroom.growth(seq, len(self.block_manager.block_table(seq.seq_id)))
            budget -= num_new

    def _has_headroom(self, seq: Sequence, num_tokens: int, num_hits: int, growth: int) -> bool:
        """Headroom.allows, except that the head of the queue always enters an
        empty batch, and so does a head that preempted others for its seat."""
        if not self.running or seq is self.seated:
            return True
        return self.headroom.allows(seq, num_tokens, num_hits, growth)

    def _return_loaded(self) -> None:
        """Sequences whose loads have landed go back to the head of the queue, in order."""
        ready = [seq for seq in self.loading if self.offload.ready(seq)]
        for seq in reversed(ready):
            self.loading.remove(seq)
            self._wait(seq, front=True)

    def _admit(self, seq: Sequence, budget: int, output: SchedulerOutput, growth: int) -> int | None:
        """Give a waiting sequence its blocks; returns its token count, None to wait,
        or LOADING when it must first wait aside for the offload tiers (their
        answer, or their blocks)."""
        held = {s.lora_id for s in self.running} - {0}  # the LoRA adapters running
        if seq.lora_id and seq.lora_id not in held and len(held) >= self.max_loras:
            return None  # a step has max_loras slots: wait for one to leave
        parent = seq.fork_parent
        if parent is not None and parent.status is SequenceStatus.RUNNING:
            if parent.num_computed_tokens < parent.num_prompt_tokens:
                return None  # the first sample is still computing the shared prompt
            shared = self.block_manager.blocks_for(seq.num_prompt_tokens) - 1  # + 1 copied
            if not self._has_headroom(seq, seq.num_prompt_tokens, shared, growth):
                return None
            return self._admit_fork(seq, parent, output)
        manager = self.block_manager
        # A request for prompt logprobs recomputes its prompt (no hits, as in vLLM).
        reach = seq.num_tokens if seq.params.prompt_logprobs is None else 1
        hits = manager.find_cached_prefix(seq.block_hashes, reach)
        if self.offload is not None and manager.enable_caching and self.offload.start_loads(
                seq, hits, (reach - 1) // self.block_size):
            return LOADING
        cached = len(hits) * self.block_size
        num_new = min(seq.num_tokens - cached, budget)
        if self.whole_prompts and num_new < seq.num_tokens - cached:
            return None  # a pooling prompt runs in one step, never in chunks
        if not self._has_headroom(seq, cached + num_new, len(hits), growth):
            return None
        if manager.allocate(seq.seq_id, cached + num_new, hits) is None:
            return None
        if self.offload is not None:
            self.offload.forget(seq)  # the blocks it loaded are its own hits now
        if manager.enable_caching:
            manager.record_lookup(seq.num_tokens, cached)
        seq.num_computed_tokens = cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached
        return num_new

    def _admit_fork(self, seq: Sequence, parent: Sequence, output: SchedulerOutput) -> int | None:
        """Share the parent's prompt blocks; recompute only the last prompt token."""
        last = seq.num_prompt_tokens - 1
        self.block_manager.fork(parent.seq_id, seq.seq_id, seq.num_prompt_tokens)
        if not self._unshare(seq, last, last + 1, output):
            self.block_manager.free(seq.seq_id)
            return None
        seq.num_computed_tokens = last
        seq.num_cached_tokens = parent.num_cached_tokens
        return 1

    def _scheduled(self, seq: Sequence, num_new: int,
                   draft: list[int] | None = None) -> ScheduledSequence:
        start = seq.num_computed_tokens
        reaches_end = start + num_new == seq.num_tokens
        decodes = reaches_end and start >= seq.num_prompt_tokens  # one new output token
        # Register the blocks this step fills *now*, not after the step: a request
        # admitted later in this same step can then hit them. That is safe because
        # every layer writes the K/V of the whole batch before any attention reads.
        self.block_manager.cache_full_blocks(seq.seq_id, seq.block_hashes, start + num_new,
                                             token_slice=seq.token_slice,
                                             cache_salt=seq.cache_salt)
        self.num_prompt_tokens_computed += num_new - (1 if decodes else 0)
        return ScheduledSequence(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(start, start + num_new) + (draft or []),
            start_position=start,
            block_table=self.block_manager.block_table(seq.seq_id),
            sampling=seq.params if reaches_end else None,
            generator=seq.generator,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            grammar=seq.grammar,
            window_block_table=self.block_manager.window_table(seq.seq_id),
            prompt_logprobs=seq.params.prompt_logprobs,
            draft_token_ids=draft or [],
            lora_id=seq.lora_id,
        )

    # -- after the model ran -----------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[int, int],
               accepted: dict[int, list[int]] | None = None) -> list[Sequence]:
        """Advance computed counts; release blocks that left a sliding window;
        append the accepted draft tokens and the sampled token; hash newly
        full blocks.

        A draft's rejected tokens had their K/V written this step, but
        `num_computed_tokens` stops before them: the next step writes over
        their slots. Returns the sequences that grew.
        """
        grew, accepted = [], accepted or {}
        by_id = {seq.seq_id: seq for seq in self.running}
        manager = self.block_manager
        for scheduled in output.sequences:
            seq = by_id.get(scheduled.seq_id)
            if seq is None:  # finished or aborted while the step ran
                continue
            kept = accepted.get(scheduled.seq_id, ())
            rejected = len(scheduled.draft_token_ids) - len(kept)
            seq.num_computed_tokens += scheduled.num_new_tokens - rejected
            manager.free_outside_window(seq.seq_id, seq.num_computed_tokens)
            token_id = sampled.get(scheduled.seq_id)
            if token_id is not None:
                for draft_token in kept:
                    seq.append_token(draft_token)
                seq.append_token(token_id)
                grew.append(seq)
            if manager.enable_caching:  # hash blocks the new token completed
                seq.update_block_hashes(self.block_size)
        return grew
