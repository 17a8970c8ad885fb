"""Speculation state that verification hides, checked exactly (issue 57).

A wrong choice of draft, a budget past its cap or a matcher left a few
tokens ahead still gives the right tokens most of the time (verification
rejects what the model would not have drawn), so the parity tests miss
them or catch them only on a real model. Here: the suffix proposer's tie
between the request's own trie and the global one, the speculator's budget
as it grows and where it stops, and the structured-output matcher's calls
and state around `verify()`, with a fake matcher that records them.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.core.sequence import Sequence
from engine.sampling.sampler import Sampler, SamplingRequest
from engine.sampling.speculative import Drafted, verify
from engine.sampling_params import SamplingParams
from engine.spec_decode.speculator import Speculator
from engine.spec_decode.suffix import SuffixCache


# -- the suffix proposer: own trie against the global one ------------------------------
def suffix_cache() -> SuffixCache:
    # Every continuation likely enough, and drafts up to 4x the match's length.
    return SuffixCache(SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=0.0,
                                         suffix_decoding_max_spec_factor=4.0))


def finished(cache: SuffixCache, output: list[int]) -> None:
    """A request whose output was `output` finished: it joins the global trie."""
    handle = cache.start("done", [999])
    handle.history = [999, *output]
    cache.finish(handle)


def test_a_tie_in_depth_goes_to_the_requests_own_trie():
    """Both tries match the context's last two tokens (5, 6): the request's own
    text went on 9 1, the finished request's 7 8. The deeper match wins, and
    at equal depth the request's own (suffix.py: the global trie wins only
    when deeper)."""
    cache = suffix_cache()
    finished(cache, [5, 6, 7, 8])
    handle = cache.start("r", [5, 6, 9, 1, 5, 6])
    assert cache.propose(handle, 2) == [9, 1]


def test_the_deeper_match_wins_whichever_trie_holds_it():
    cache = suffix_cache()
    finished(cache, [4, 5, 6, 7, 8])  # (4, 5, 6) went on 7 8
    # the own trie's deepest match is (5, 6) -> 9; the global one's (4, 5, 6) -> 7
    assert cache.propose(cache.start("r", [5, 6, 9, 1, 4, 5, 6]), 2) == [7, 8]
    cache = suffix_cache()
    finished(cache, [5, 6, 7, 8])  # (5, 6) went on 7 8
    # the own trie's deepest match is (1, 5, 6) -> 9
    assert cache.propose(cache.start("r", [1, 5, 6, 9, 2, 1, 5, 6]), 2) == [9, 2]


# -- the speculator's budget -----------------------------------------------------------
def repeating_seq(max_tokens: int = 64) -> Sequence:
    """A decoding sequence whose text repeats: an n-gram always has k tokens to draft."""
    seq = Sequence(0, "r0", 0, [1, 2] * 20, SamplingParams(max_tokens=max_tokens))
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def budgets(spec: Speculator, seq: Sequence, accepted: list[int | None]) -> list[int]:
    """Draft lengths step by step; after each, `accepted` of them were kept (None: all)."""
    lengths = []
    for kept in accepted:
        spec.propose([seq])
        drafted = len(seq.draft_token_ids)
        lengths.append(drafted)
        spec.record(seq.seq_id, drafted, drafted if kept is None else kept)
    return lengths


def test_the_budget_grows_by_one_after_a_whole_accept_and_stops_at_k():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                      max_model_len=1000)
    seq = repeating_seq()
    # 4, rejected -> 2, accepted whole -> 3 -> 4, then 4 however often accepted whole
    assert budgets(spec, seq, [0, None, None, None, None, None]) == [4, 2, 3, 4, 4, 4]
    assert spec.states[seq.seq_id].budget == 4
    # a partial accept sets the budget to what was kept (at least one)
    assert budgets(spec, seq, [3, None, 1, 0]) == [4, 3, 4, 1]
    assert spec.stats.accepted_per_position == [8, 7, 6, 3]


def test_a_short_draft_accepted_whole_grows_from_the_budget_not_past_k():
    """A draft shorter than the budget (the room left was short) accepted
    whole: the budget is at least that draft plus one, never above k."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                      max_model_len=1000)
    seq = repeating_seq(max_tokens=3)  # room for 2 drafted tokens
    assert budgets(spec, seq, [None]) == [2]
    assert spec.states[seq.seq_id].budget == 4
    seq.params = SamplingParams(max_tokens=64)
    assert budgets(spec, seq, [None, None]) == [4, 4]
    assert spec.states[seq.seq_id].budget == 4


# -- verify() and the structured-output matcher -----------------------------------------
VOCAB = 8


class ScriptGrammar:
    """A fake matcher that allows one token at each step, from a script, and
    records every call. `accepted` is its state: the tokens it took, in order."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.accepted, self.calls = script, [], []

    def accept(self, token_id: int) -> bool:
        self.calls.append(("accept", token_id))
        ok = len(self.accepted) < len(self.script) and self.script[len(self.accepted)] == token_id
        if ok:
            self.accepted.append(token_id)
        return ok

    def rollback(self, num_tokens: int) -> None:
        self.calls.append(("rollback", num_tokens))
        assert 0 < num_tokens <= len(self.accepted), (num_tokens, self.accepted)
        del self.accepted[len(self.accepted) - num_tokens:]

    @property
    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        if len(self.accepted) < len(self.script):
            token = self.script[len(self.accepted)]
            bitmask[row, token // 32] = 1 << (token % 32)


def verify_constrained(script: list[int], draft: list[int]):
    """verify() of one greedy request under ScriptGrammar(script), its first
    token already decoded, on logits that prefer token 0 everywhere (the
    grammar decides); returns the matcher and the emitted tokens."""
    grammar = ScriptGrammar(script)
    grammar.accept(script[0])  # a token decoded before this step
    grammar.calls.clear()
    request = SamplingRequest(SamplingParams(temperature=0.0), None, [0], [script[0]],
                              grammar=grammar)
    logits = torch.zeros(len(draft) + 1, VOCAB)
    logits[:, 0] = 5.0
    owners, out = verify(Sampler(VOCAB), logits, [Drafted(request, draft, 0, frozenset())])
    return grammar, out.token_ids


@pytest.mark.parametrize("draft, kept", [([2, 3, 4], 3), ([2, 3, 7], 2), ([7, 3], 0)],
                         ids=["whole", "partial", "none"])
def test_the_matcher_is_back_where_it_was_after_verification(draft, kept):
    """Each accepted draft token advances the matcher (so the next position's
    mask is the one after it), and one rollback of exactly those tokens
    follows, whether the draft was accepted whole, in part or not at all:
    the stop checker then feeds the emitted tokens one by one, and the
    matcher must end as a fresh one fed them one by one."""
    script = [1, 2, 3, 4, 5]
    grammar, emitted = verify_constrained(script, draft)
    assert emitted == script[1:2 + kept]  # the accepted tokens, then the grammar's next
    expected_calls = [("accept", t) for t in draft[:kept]] + ([("rollback", kept)] if kept else [])
    assert grammar.calls == expected_calls
    assert grammar.accepted == script[:1]
    for token in emitted:  # as StopChecker.check does when the engine appends them
        assert grammar.accept(token)
    fresh = ScriptGrammar(script)
    assert all(fresh.accept(token) for token in [script[0], *emitted])
    assert grammar.accepted == fresh.accepted
