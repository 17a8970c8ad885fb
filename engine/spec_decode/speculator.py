"""Who drafts this step, how many tokens, and what it earned: the speculator.

Each step, before the scheduler runs, every decoding sequence may get a
draft (`seq.draft_token_ids`) from the configured proposer. The scheduler
gives the draft query slots after the sequence's last token, the runner
scores all of them in the same forward pass and keeps the drafted tokens
the model agrees with, left to right (engine/sampling/speculative.py). Then
`record` hears how many were accepted.

Speculation must pay for itself. A draft token costs a query row in the
forward pass even when it is rejected, so:

- with more than `disable_by_batch_size` sequences running nobody drafts:
  the batch already keeps the CPU busy computing (vLLM's knob);
- each sequence drafts at most `budget` tokens, its own adaptive K: one more
  after a draft that was accepted whole, halved after one that was rejected
  outright, so a sequence whose text does not repeat soon drafts nothing;
  at 0 it tries a single token every PROBE_EVERY steps to notice when its
  text starts repeating (a quote after a preamble).

Counters follow vLLM's spec-decode metrics: drafts, draft tokens, accepted
tokens, and accepted tokens by position in the draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramIndex
from engine.spec_decode.suffix import SuffixCache

PROBE_EVERY = 8  # steps a sequence at budget 0 waits before drafting one token again


@dataclass
class _State:
    """One sequence's proposer state and adaptive budget."""

    history: list[int]  # prompt + output, extended as tokens arrive
    index: object  # its NgramIndex, or its SuffixCache handle
    budget: int
    idle_steps: int = 0


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.states: dict[int, _State] = {}
        self.suffix = SuffixCache(config) if config.method == "suffix" else None
        self.stats = SpecStats(accepted_per_position=[0] * self.k)

    def propose(self, running: list) -> None:
        """Set `draft_token_ids` of every running sequence (duck-typed: the
        scheduler's Sequence) for this step; [] where it should not draft."""
        limit = self.config.disable_by_batch_size
        allowed = limit is None or len(running) <= limit
        for seq in running:
            seq.draft_token_ids = self._draft(seq) if allowed else []

    def _draft(self, seq) -> list[int]:
        if seq.num_computed_tokens != seq.num_tokens - 1:
            return []  # still prefilling: nothing to guess from yet
        state = self._state(seq)
        k = self._wanted(seq, state)
        if k <= 0:
            return []
        if self.suffix is not None:
            return self.suffix.propose(state.index, k)
        return state.index.propose(state.history, k)

    def _wanted(self, seq, state: _State) -> int:
        """Draft length: the adaptive budget, within max_tokens and max_model_len."""
        room = min(seq.params.max_tokens - len(seq.output_token_ids) - 1,
                   self.max_model_len - seq.num_tokens)
        budget = state.budget
        if budget == 0:
            state.idle_steps += 1
            budget = 1 if state.idle_steps % PROBE_EVERY == 0 else 0
        return min(budget, room)

    def _state(self, seq) -> _State:
        state = self.states.get(seq.seq_id)
        if state is None:
            history = list(seq.prompt_token_ids)
            if self.suffix is not None:
                index = self.suffix.start(seq.request_id, history)
            else:
                index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            state = self.states[seq.seq_id] = _State(history, index, self.k)
        outputs = seq.output_token_ids
        known = len(state.history) - len(seq.prompt_token_ids)
        if known < len(outputs):
            new = outputs[known:]
            state.history.extend(new)
            if self.suffix is not None:
                self.suffix.extend(state.index, state.history, len(new))
        return state

    def record(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """After verification: count, and move the sequence's budget."""
        if num_drafted == 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        state = self.states.get(seq_id)
        if state is None:
            return
        if num_accepted == num_drafted:
            state.budget = min(self.k, max(state.budget, num_drafted) + 1)
        elif num_accepted == 0:
            state.budget //= 2
        else:
            state.budget = max(1, num_accepted)
        if state.budget:
            state.idle_steps = 0

    def forget(self, seq) -> None:
        """A finished sequence: drop its state (its output joins the suffix cache)."""
        state = self.states.pop(seq.seq_id, None)
        if state is not None and self.suffix is not None:
            self.suffix.finish(state.index)
