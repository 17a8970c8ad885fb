"""Async scheduling (vLLM's --async-scheduling): step N+1 is scheduled and
launched before step N's sampled tokens are processed on the host.

The synchronous step (LLMEngine.sync_step) leaves the device idle while the
host schedules, reads the tokens back, checks stops and detokenizes, and the
host idle while the device runs. With `async_scheduling=True` one step stays
in flight: each `LLMEngine.step()` call schedules and launches the next step
first, then commits the one before it, so the host's work of step N overlaps
the device's step N+1:

    host    | sched N+1 | launch N+1 | commit N: wait, append, stop, detok, outputs | sched N+2 | ...
    device  |.. step N ..|................ step N+1 .....................|.... step N+2 ....

    call k      schedule N+1   every sequence that sampled in N is assumed to get
                               its token: a placeholder (Sequence.num_placeholders)
                               counts in num_tokens, so it is scheduled as a decode
                launch N+1     its placeholder rows' input ids are step N's sampled
                               tokens, gathered on the device (engine/model/step_launch.py);
                               num_computed_tokens advances now, as update() would
                commit N       step N's tokens, copied to pinned memory behind an event,
                               replace the placeholders: appended, stops checked,
                               outputs built, exactly as the synchronous step does
    call k + 1  schedule N+2, launch N+2, commit N+1, ...

A sequence whose token in N is surely its last (max_tokens, max_model_len) is
*retired* when N is launched: out of the running list, its blocks freed, so
step N+1 is scheduled as the synchronous engine would schedule it; N's commit
finishes it. One that stops unforeseen at step N (EOS, a stop token or string,
an abort between calls) already has a row in step N+1: that row's token is
dropped at N+1's commit. Blocks are freed while a step in flight may still
write them; that is safe because whatever reuses them (a later step's K/V
store, a copy on write) is a kernel queued on the same stream after it. A
seeded request's generator draws once per row, in step order, as in the
synchronous engine; only a dropped row draws once more, after its last token.
The first call after an idle engine only launches (it returns no outputs);
an in-flight step left when the last request ends is committed, and dropped,
by the next call.

What runs synchronously, and why:
- the whole engine (`async_reason`): speculative decoding (a draft is built from the
  host's tokens and verified against them), pooling models (no tokens), LoRA
  (adapters are loaded and remapped between steps), the KV offload tiers
  (they copy blocks out on the host after each step), tensor parallelism and
  any runner without `launch` (the executor broadcasts host inputs);
- a step whose schedule could depend on the step in flight (`_independent`):
  requests wait for a seat, or the running sequences' demand exceeds the
  token budget or the free blocks (a chunk would be cut, or someone
  preempted), or under the priority policy a prompt holds others back. A
  sequence that stops in the step in flight would hand its seat, tokens and
  blocks on in the synchronous engine, so the batches would differ, and with
  them the numerics (a request admitted a step later computes its prompt
  beside other rows);
- a step while some unfinished request is not plain (`plain`): structured
  outputs (the next mask needs the matcher advanced by the previous token),
  repetition/frequency/presence penalties (they count the previous tokens),
  min_tokens (the banned tokens depend on the count of tokens on the host),
  prompt logprobs and max_tokens=0 (prompt-only rows, settled after the step).
  The step in flight is drained first (committed: that call's outputs), then
  steps run synchronously until no such request is left.
Preemption itself would be safe (a preempted sequence is recomputed from its
tokens when admitted again, a later schedule, after its placeholder was
committed), but a step that may preempt is one whose blocks run short: synchronous.

Outputs are the synchronous engine's: each step runs the batch the synchronous
engine runs, and samples the same tokens from the same logits, with one
exception: the dropped row of a sequence that stopped unforeseen makes that one
step one row larger, and a float32 GEMM may round a row differently at another
batch size (on the CPU: fewer than 4 rows or not), so a logprob can move in its
last bits, as it does in either mode whenever the batch changes. Requests
without a seed draw from the sampler's shared generator, whose stream depends
on the batch in either mode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.core.sequence import Sequence
from engine.model.step_launch import LaunchedStep
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def async_reason(config, runner) -> str | None:
    """Why the whole engine steps synchronously despite async_scheduling, or None."""
    if config.speculative_config is not None:
        return "speculative decoding (drafts are made from and verified against host tokens)"
    if config.runner == "pooling":
        return "a pooling model samples no tokens"
    if config.enable_lora:
        return "--enable-lora (adapters are loaded and remapped between steps)"
    if config.kv_offload_enabled:
        return "the KV offload tiers (they copy blocks out on the host after each step)"
    if config.tensor_parallel_size > 1 or not hasattr(runner, "launch"):
        return "the runner cannot launch a step without waiting for it (tensor parallelism)"
    return None


def plain(params) -> bool:
    """Whether a request's steps may overlap: nothing it samples reads the tokens
    of the step before on the host (see the module docstring)."""
    return (isinstance(params, SamplingParams) and params.structured_outputs is None
            and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and params.min_tokens == 0
            and params.prompt_logprobs is None and params.max_tokens > 0)


@dataclass
class InFlight:
    launched: LaunchedStep
    sampled: dict[int, Sequence]  # the sequences that sample in it (hold a placeholder)


class AsyncSteps:
    """The in-flight step of one LLMEngine and the commit of its tokens."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        self.synchronous: set[str] = set()  # unfinished requests that are not plain
        self.num_launched = 0  # steps launched without waiting for them
        self.num_overlapped = 0  # of those, launched while another was in flight
        self.num_sync_steps = 0  # steps run by the synchronous path meanwhile

    @classmethod
    def build(cls, engine) -> AsyncSteps | None:
        """The engine's async steps, or None (logged) when it must step synchronously."""
        reason = async_reason(engine.config, engine.runner)
        if reason is not None:
            logger.info("async scheduling is off: %s", reason)
            return None
        return cls(engine)

    def note(self, request_id: str, params) -> None:
        """A new request: one that is not plain makes the steps synchronous until it ends."""
        if not plain(params):
            self.synchronous.add(request_id)

    def step(self) -> list[RequestOutput]:
        """LLMEngine.step(): launch the next step, then commit the one in flight."""
        engine = self.engine
        self.synchronous = {r for r in self.synchronous if r in engine.requests}
        if self.synchronous:
            if self.inflight is not None:
                return self.drain()
            self.num_sync_steps += 1
            return engine.sync_step()
        if not self._independent():
            if self.inflight is not None:
                return self.drain()
            self.num_sync_steps += 1
            return engine.sync_step()
        scheduled = engine.scheduler.schedule()
        previous, self.inflight = self.inflight, None
        if not scheduled.is_empty:
            launched = engine.runner.launch(scheduled, previous and previous.launched)
            self.inflight = InFlight(launched, self._advance(scheduled))
            self.num_launched += 1
            self.num_overlapped += previous is not None
        outputs = self._commit(previous) if previous is not None else []
        engine.publish_events()
        return outputs

    def _independent(self) -> bool:
        """Whether the next schedule is the synchronous engine's whatever the step in
        flight samples: nobody waits for a seat, every running sequence's whole
        demand fits the token budget and the free blocks (a copy on write each
        included), and no prompt holds lower priorities back. Otherwise a sequence
        that stops in the step in flight, whose seat, tokens and blocks the
        synchronous engine would hand on, changes who runs next and in what chunks."""
        scheduler = self.engine.scheduler
        if scheduler.waiting or scheduler.loading:
            return False
        manager = scheduler.block_manager
        tokens = blocks = 0
        for seq in scheduler.running:
            tokens += seq.num_tokens - seq.num_computed_tokens
            blocks += manager.blocks_for(seq.num_tokens) - len(manager.block_table(seq.seq_id)) + 1
            if scheduler.by_priority and seq.num_computed_tokens < seq.num_tokens - 1:
                return False
        return tokens <= scheduler.max_num_batched_tokens and blocks <= manager.num_free_blocks

    def drain(self) -> list[RequestOutput]:
        """Commit the step in flight, launching none: its outputs."""
        previous, self.inflight = self.inflight, None
        outputs = [] if previous is None else self._commit(previous)
        self.engine.publish_events()
        return outputs

    def _advance(self, scheduled) -> dict[int, Sequence]:
        """What Scheduler.update does before the tokens are known: computed counts,
        blocks that left the window; a placeholder for each sampled sequence."""
        scheduler = self.engine.scheduler
        by_id = {seq.seq_id: seq for seq in scheduler.running}
        sampled = {}
        for item in scheduled.sequences:
            seq = by_id[item.seq_id]
            seq.num_computed_tokens += item.num_new_tokens
            scheduler.block_manager.free_outside_window(seq.seq_id, seq.num_computed_tokens)
            if item.sampling is not None:
                seq.num_placeholders += 1
                sampled[seq.seq_id] = seq
                if self._last_token(seq):
                    scheduler.running.remove(seq)  # retired: no row in the next step
                    scheduler.block_manager.free(seq.seq_id)
        return sampled

    def _last_token(self, seq: Sequence) -> bool:
        """Whether the token in flight is surely `seq`'s last: max_tokens or
        max_model_len (StopChecker's length rule) stops it, if nothing earlier does.
        Retired at launch, it leaves its seat and blocks to the next schedule as
        the synchronous engine's update would; the commit finishes it."""
        return (len(seq.output_token_ids) + seq.num_placeholders >= seq.params.max_tokens
                or seq.num_tokens >= self.engine.config.max_model_len)

    def _commit(self, inflight: InFlight) -> list[RequestOutput]:
        """Step N's tokens: what Scheduler.update and the synchronous step do after
        the model ran, for the sequences that have not finished since."""
        engine = self.engine
        result = inflight.launched.result()
        block_size = engine.scheduler.block_size
        moved = {}
        for row, seq_id in enumerate(result.seq_ids):
            seq = inflight.sampled[seq_id]
            if seq.is_finished:  # aborted, or stopped by the step before: a dropped row
                continue
            seq.num_placeholders -= 1
            seq.append_token(result.sampled.token_ids[row])
            if engine.block_manager.enable_caching:  # hash blocks the new token completed
                seq.update_block_hashes(block_size)
            request = engine.requests[seq.request_id]
            engine.take_tokens(request, seq, [row], result.sampled)
            moved[request.request_id] = request
        return engine.report(moved)
