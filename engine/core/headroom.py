"""Admission headroom: how many free KV blocks admission leaves for growth.

Recomputation is wasted work, so admission keeps headroom. Every sequence
may still grow to min(prompt + max_tokens, max_model_len), max_tokens counted
up to GROWTH_CAP_TOKENS; admission leaves free at least

    conservativeness x ratio x (blocks the running sequences and the
                                newcomer still lack to get there)

where `ratio` guesses how much of that growth will be needed, as the smaller
of two estimates. `growth_ratio` starts at 0.7, sinks by 0.002 each step that
preempts nobody, down to 0.1, and rises by 0.3 on a step that had to preempt:
sequences finish and give blocks back before the others need them all.
`observed_ratio` starts at 0.3 and follows the share of their counted
max_tokens that finished requests actually generated: requests without
max_tokens mostly stop at EOS long before it. Preemption stays the safety
net when the guess is wrong.

Without the check admission fills the cache with prompts, and decodes then
preempt the newest sequences, whose recomputation is wasted work (the chat
benchmark at 1 GiB recomputed 63 % more prompt tokens).
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence

# The share of the running
# sequences' remaining growth to keep free is the smaller of two guesses.
#   growth_ratio    how much of it tends to be needed at once: relaxes every
#                   step that preempts nobody, jumps back up on a preemption
#   observed_ratio  the share of their counted max_tokens that finished
#                   requests generated (a moving average; most stop at EOS)
GROWTH_RATIO_START, GROWTH_RATIO_FLOOR, GROWTH_RATIO_CEILING = 0.7, 0.1, 1.0
GROWTH_RATIO_DECAY, GROWTH_RATIO_STEP_UP = 0.002, 0.3
OBSERVED_START, OBSERVED_WEIGHT = 0.3, 0.1
# A request without max_tokens may run to max_model_len (thousands of tokens)
# but rarely does: at most this many of a sequence's max_tokens are counted.
GROWTH_CAP_TOKENS = 2048


class Headroom:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.max_model_len = config.max_model_len
        self.conservativeness = config.schedule_conservativeness
        self.growth_ratio = GROWTH_RATIO_START
        self.observed_ratio = OBSERVED_START

    def after_step(self, preempted: bool) -> None:
        """A step that had to preempt raises growth_ratio; a quiet one relaxes it."""
        if preempted:
            self.growth_ratio = min(GROWTH_RATIO_CEILING, self.growth_ratio + GROWTH_RATIO_STEP_UP)
        else:
            self.growth_ratio = max(GROWTH_RATIO_FLOOR, self.growth_ratio - GROWTH_RATIO_DECAY)

    def note_finished(self, seq: Sequence) -> None:
        """What a finished sequence generated of what admission counted on."""
        counted = min(seq.params.max_tokens, GROWTH_CAP_TOKENS)
        share = min(1.0, len(seq.output_token_ids) / counted) if counted else 1.0
        self.observed_ratio += OBSERVED_WEIGHT * (share - self.observed_ratio)

    def growth(self, seq: Sequence, num_blocks: int) -> int:
        """Blocks `seq` may still take beyond the `num_blocks` it has, if it runs
        to max_tokens (counting at most GROWTH_CAP_TOKENS of them)."""
        return max(0, self._final_blocks(seq) - num_blocks)

    def _final_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds if it runs to its expected end (fixed for its life)."""
        final = len(seq.prompt_token_ids) + min(seq.params.max_tokens, GROWTH_CAP_TOKENS)
        if self.max_model_len:
            final = min(final, self.max_model_len)
        # the last token is sampled but never fed back: its K/V is never stored
        return self.block_manager.blocks_for(final - 1)

    def running_growth(self, running: list[Sequence]) -> int:
        """growth() of every running sequence beyond its block table (which
        already holds this step's blocks). Once per step with someone waiting."""
        if not self.conservativeness:
            return 0
        tables = self.block_manager.block_tables
        return sum(self.growth(seq, len(tables[seq.seq_id])) for seq in running)

    def allows(self, seq: Sequence, num_tokens: int, num_hits: int, growth: int) -> bool:
        """Would admitting `seq` with `num_tokens` covered (`num_hits` blocks of
        them cached) leave enough free blocks for the expected growth of
        everyone running (`growth`), `seq` included?"""
        if not self.conservativeness:
            return True
        manager = self.block_manager
        num_blocks = manager.blocks_for(num_tokens)
        ratio = min(self.growth_ratio, self.observed_ratio)
        expected = ratio * (growth + self.growth(seq, num_blocks))
        return manager.num_free_blocks - (num_blocks - num_hits) >= self.conservativeness * expected
